"""CUDA's kernel choices and workspaces, on CPU (stagetorch/ops/kernels/cuda_*.py; issue 44).

Checked against PyTorch itself where it can answer on CPU: the fused attention ops' meta kernels give their
outputs' shapes, ``FakeTensorMode`` makes CUDA tensors, and the dispatcher's AutocastCUDA kernels cast them.
The backend choice is checked case by case against the constraints of ``sdp_utils.cpp`` (torch 2.11-2.13).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import stagetorch
from stagetorch.interpreters.memory import peak_bytes
from stagetorch.ir import Aval, Eqn, Var
from stagetorch.ops.kernels import cuda_blas, cuda_conv
from stagetorch.ops.kernels.cuda_dispatch import cuda_autocast_allowed, cuda_staging
from stagetorch.ops.kernels.cuda_sdpa import (
    CUDNN,
    EFFICIENT,
    FLASH,
    MATH,
    CudaProps,
    SdpaCall,
    backward_call,
    backward_workspace,
    forward_bytes,
    forward_workspace,
    sdpa_dispatch,
    select_backend,
)
from stagetorch.registry import slot

aten = torch.ops.aten
bf16, f16, f32, f64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


def call(dtype=bf16, heads=8, kv_heads=8, length=128, source=128, head_dim=64, value_dim=None, **flags) -> SdpaCall:
    return SdpaCall(2, heads, kv_heads, length, source, head_dim, head_dim if value_dim is None else value_dim, dtype,
                    **flags)


SM75, SM80, SM86, SM89, SM90 = (CudaProps(capability=c) for c in ((7, 5), (8, 0), (8, 6), (8, 9), (9, 0)))


# -- the choice, case by case --------------------------------------------------------------------------------

CASES = [
    # (what, call, device, backend)
    ("bf16 on Hopper: flash", call(), SM90, FLASH),
    ("fp16 on Ampere: flash", call(f16), SM80, FLASH),
    ("fp32: flash takes half types only; memory-efficient takes float", call(f32), SM90, EFFICIENT),
    ("fp64: no fused kernel", call(f64), SM90, MATH),
    ("a mask: flash refuses it, memory-efficient takes it", call(has_mask=True), SM90, EFFICIENT),
    ("is_causal with L == S: flash", call(is_causal=True), SM90, FLASH),
    ("is_causal with L != S: not flash", call(is_causal=True, length=64), SM90, EFFICIENT),
    ("dropout: flash keeps it", call(dropout_p=0.1), SM90, FLASH),
    ("GQA in bf16: flash takes it", call(heads=32, kv_heads=8, enable_gqa=True), SM90, FLASH),
    ("GQA in fp32: memory-efficient refuses it (torch 2.11): math", call(f32, heads=32, kv_heads=8, enable_gqa=True), SM90, MATH),
    ("GQA in fp32 where memory-efficient takes GQA (PyTorch main)",
     call(f32, heads=32, kv_heads=8, enable_gqa=True), CudaProps(efficient_gqa=True), EFFICIENT),
    ("head counts differ without enable_gqa: math", call(heads=32, kv_heads=8), SM90, MATH),
    ("head dim 256 in bf16: flash's limit", call(head_dim=256), SM90, FLASH),
    ("head dim 288: past flash's 256; memory-efficient has no limit", call(head_dim=288), SM90, EFFICIENT),
    ("q and v head dims differ: not flash", call(value_dim=128), SM90, EFFICIENT),
    ("fp32 head dim 6 on sm80+: not a multiple of 4", call(f32, head_dim=6), SM90, MATH),
    ("bf16 head dim 12: flash (which pads it to 16)", call(head_dim=12), SM80, FLASH),
    ("bf16 head dim 12 with a mask: memory-efficient needs a multiple of 8", call(head_dim=12, has_mask=True), SM80, MATH),
    ("training at head dim 200 on sm86: flash's backward refuses it", call(head_dim=200, requires_grad=True), SM86, EFFICIENT),
    ("the same on sm89", call(head_dim=200, requires_grad=True), SM89, EFFICIENT),
    ("the same on sm80: flash", call(head_dim=200, requires_grad=True), SM80, FLASH),
    ("head dim 240 on sm86 without dropout: flash", call(head_dim=240, requires_grad=True), SM86, FLASH),
    ("head dim 240 on sm86 with dropout: not flash", call(head_dim=240, requires_grad=True, dropout_p=0.1), SM86, EFFICIENT),
    ("inference at head dim 200 on sm86: flash", call(head_dim=200), SM86, FLASH),
    ("Turing (sm75): no flash, fp16 memory-efficient", call(f16), SM75, EFFICIENT),
    ("Turing: bf16 for neither fused kernel", call(bf16), SM75, MATH),
    ("Turing fp32: memory-efficient", call(f32), SM75, EFFICIENT),
    ("cuDNN preferred (sm90, new cuDNN): cuDNN first", call(), CudaProps(prefer_cudnn=True), CUDNN),
    ("cuDNN preferred but dropout not a multiple of 1/16: flash", call(dropout_p=0.1), CudaProps(prefer_cudnn=True), FLASH),
    ("cuDNN preferred, fp32: memory-efficient", call(f32), CudaProps(prefer_cudnn=True), EFFICIENT),
    ("a last dim not contiguous: no fused kernel", call(last_dim_contiguous=False), SM90, MATH),
]


@pytest.mark.parametrize("what,c,props,backend", CASES, ids=[c[0] for c in CASES])
def test_backend_choice(what: str, c: SdpaCall, props: CudaProps, backend: str) -> None:
    assert select_backend(c, props) == backend


# -- each backend's outputs, against PyTorch's meta kernels ---------------------------------------------------


def meta(shape: tuple[int, ...], dtype: torch.dtype = bf16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("length", [100, 128, 1000])
@pytest.mark.parametrize("grad", [False, True])
def test_fused_outputs_match_the_meta_kernels(length: int, grad: bool) -> None:
    q, k = meta((2, 8, length, 64)), meta((2, 8, 77, 64))
    c = SdpaCall.of(q, k, k, requires_grad=grad)
    out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, k, 0.0, False, False)
    flash = forward_bytes(c, FLASH)
    assert flash["out"] == out.numel() * out.element_size()
    assert flash["logsumexp"] == lse.numel() * 4 and lse.dtype == f32  # (B, H, L) float32, grad or not
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, k, None, grad, 0.0, False)
    eff = forward_bytes(c, EFFICIENT)
    assert eff["out"] == out.numel() * out.element_size()
    assert eff["logsumexp"] == lse.numel() * 4 and lse.dtype == f32  # L rounded up to 32; empty without grad
    assert lse.shape[-1] == (-(-length // 32) * 32 if grad else 0)
    assert eff["rng"] == seed.element_size() + offset.element_size()
    out, lse, *_ = aten._scaled_dot_product_cudnn_attention(q, k, k, None, True, 0.0, False, False)
    assert forward_bytes(c._replace(requires_grad=True), CUDNN)["logsumexp"] == lse.numel() * 4


def test_flash_pads_a_head_dim_not_a_multiple_of_8() -> None:
    c = call(head_dim=12)
    parts = forward_bytes(c, FLASH)
    assert parts["out"] == 2 * 8 * 128 * 16 * 2 and parts["padded_qkv"] == 3 * 2 * 8 * 128 * 16 * 2
    assert "padded_qkv" not in forward_bytes(call(head_dim=16), FLASH)


def test_math_path_materialises_the_attention_weights() -> None:
    c = call(f32, heads=32, kv_heads=8, length=1024, source=1024, is_causal=True, enable_gqa=True)
    parts = forward_bytes(c, MATH)
    weights = 2 * 32 * 1024 * 1024 * 4
    assert parts["scores"] == parts["softmax"] == parts["masked_scores"] == weights
    assert parts["gqa_kv"] == 2 * 32 * 1024 * 128 * 4  # k and v repeated to every query head
    assert sum(parts.values()) > 10 * sum(forward_bytes(c._replace(dtype=bf16), FLASH).values())


def test_backward_workspace_of_flash_rounds_as_flash_attention_2() -> None:
    c = call(length=100, head_dim=72)
    # dq accumulated in float32 at (B, L rounded to 128, H, E rounded to 32), and the row sums
    assert backward_workspace(c, FLASH) == 4 * 2 * 128 * 8 * 96 + 4 * 2 * 8 * 128
    gqa = call(heads=32, kv_heads=8, enable_gqa=True)
    assert backward_workspace(gqa, FLASH) - backward_workspace(gqa._replace(kv_heads=32), FLASH) == 2 * 128 * 32 * 128 * 2
    assert backward_workspace(call(f32), EFFICIENT) == 4 * 2 * 8 * 128  # delta only: float32 needs no accumulator
    assert backward_workspace(call(), EFFICIENT) == 4 * 2 * 8 * 128 + 4 * 2 * 8 * 128 * 64
    assert backward_workspace(call(), MATH) == 0
    assert forward_workspace(call(head_dim=256), EFFICIENT) == 4 * 2 * 128 * 8 * 256
    assert forward_workspace(call(head_dim=256), FLASH) == 0


# -- routing fake CUDA tensors to the GPU's kernel --------------------------------------------------------------


@pytest.mark.parametrize("dtype,gqa,expected", [
    (f32, False, EFFICIENT), (f32, True, MATH), (bf16, False, FLASH), (bf16, True, FLASH), (f16, True, FLASH),
])
def test_dispatch_on_fake_cuda_tensors(dtype: torch.dtype, gqa: bool, expected: str) -> None:
    with FakeTensorMode():
        q = torch.empty(2, 8, 128, 64, device="cuda", dtype=dtype)
        k = torch.empty(2, 2 if gqa else 8, 128, 64, device="cuda", dtype=dtype)
        with sdpa_dispatch(SM90) as mode:
            out = F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=gqa)
    assert mode.choices == [expected]
    assert out.shape == q.shape and out.dtype == dtype and out.device.type == "cuda"


def test_dispatch_follows_sdpa_kernel() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with FakeTensorMode():
        q = torch.empty(2, 8, 128, 64, device="cuda", dtype=bf16)
        with sdpa_dispatch() as mode:
            with sdpa_kernel([SDPBackend.MATH]):
                F.scaled_dot_product_attention(q, q, q)
            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
                F.scaled_dot_product_attention(q, q, q)
            F.scaled_dot_product_attention(q, q, q)
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), pytest.raises(stagetorch.UnsupportedOpError, match="No available kernel"):
                F.scaled_dot_product_attention(q.float(), q.float(), q.float())
    assert mode.choices == [MATH, EFFICIENT, FLASH]


def test_select_backend_with_an_order_and_enabled_set() -> None:
    assert select_backend(call(), SM90, order=(EFFICIENT, FLASH, MATH)) == EFFICIENT
    assert select_backend(call(), SM90, enabled=frozenset({MATH, EFFICIENT})) == EFFICIENT
    # cuDNN preferred moves it first only from the default order, as PyTorch sets its order once
    assert select_backend(call(), CudaProps(prefer_cudnn=True), order=(FLASH, EFFICIENT, MATH, CUDNN)) == CUDNN
    assert select_backend(call(), CudaProps(prefer_cudnn=True), order=(FLASH, CUDNN, MATH)) == FLASH


def test_dispatch_reads_strides() -> None:
    with FakeTensorMode():
        q = torch.empty(2, 8, 64, 128, device="cuda", dtype=bf16).transpose(-1, -2)  # last-dim stride 128
        with sdpa_dispatch() as mode:
            F.scaled_dot_product_attention(q, q, q)
    assert mode.choices == [MATH]


def test_dispatch_leaves_cpu_tensors_alone() -> None:
    q = torch.randn(1, 2, 8, 16)
    with sdpa_dispatch() as mode:
        out = F.scaled_dot_product_attention(q, q, q)
    assert mode.choices == []
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q))


def test_dispatch_takes_a_boolean_mask_as_the_fused_kernels_bias() -> None:
    with FakeTensorMode():
        q = torch.empty(2, 8, 128, 64, device="cuda")
        mask = torch.ones(2, 1, 128, 128, dtype=torch.bool, device="cuda")
        with sdpa_dispatch() as mode:
            out = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    assert mode.choices == [EFFICIENT] and out.shape == q.shape


def test_efficient_attention_reads_a_bias_padded_to_16() -> None:
    """A key length not a multiple of 16: the bias is copied padded (the staged graph holds the padded copy)."""
    q, k, mask = Aval((2, 8, 100, 64), f32, "cuda"), Aval((2, 8, 100, 64), f32, "cuda"), Aval((2, 1, 100, 100), f32, "cuda")
    with cuda_staging() as mode:
        graph = stagetorch.make_ir(lambda q, k, m: F.scaled_dot_product_attention(q, k, k, attn_mask=m))(q, k, mask)
    assert mode.choices == [EFFICIENT]
    assert any(o.aval.shape == (2, 1, 100, 112) for e in graph.eqns for o in e.outvars if o is not None)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum()


def prims(graph) -> list[str]:
    return [str(e.prim) for e in graph.eqns]


def test_staged_graph_records_the_gpus_kernel_and_costs_its_bytes() -> None:
    """A Llama-style grouped-query attention at 8 x 1024: in fp32 the GPU runs the math path (the issue's H200
    run took it; ~40% over CPU's plan for the whole model), in bf16 flash."""
    q, kv = Aval((8, 32, 1024, 128), f32, "cuda"), Aval((8, 8, 1024, 128), f32, "cuda")
    with cuda_staging() as mode:
        fp32 = stagetorch.make_ir(attention)(q, kv, kv)
    assert mode.choices == [MATH]
    weights = 8 * 32 * 1024 * 1024 * 4
    assert any(o.aval.shape == (8, 32, 1024, 1024) for e in fp32.eqns for o in e.outvars if o is not None)
    assert peak_bytes(fp32) >= 2 * weights
    half = lambda a: Aval(a.shape, bf16, "cuda")  # noqa: E731
    with cuda_staging() as mode:
        flash = stagetorch.make_ir(attention)(half(q), half(kv), half(kv))
    assert mode.choices == [FLASH]
    assert "aten._scaled_dot_product_flash_attention.default" in prims(flash)
    # the inputs, the output, the float32 logsumexp and the RNG state (two tensors, one 512-byte block each)
    parts = forward_bytes(SdpaCall.of(half(q), half(kv), half(kv), is_causal=True, enable_gqa=True), FLASH)
    inputs = sum(a.nbytes for a in (half(q), half(kv), half(kv)))
    assert peak_bytes(flash) == inputs + parts["out"] + parts["logsumexp"] + 2 * 512
    assert peak_bytes(flash) < weights / 5
    # On CPU the same step records CPU's flash kernel: no attention weights.
    cpu = stagetorch.make_ir(attention)(*(Aval(a.shape, f32) for a in (q, kv, kv)))
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in prims(cpu)
    assert peak_bytes(cpu) < weights


def test_llama_style_training_step_for_an_h200_takes_the_math_path() -> None:
    """Grouped-query attention in fp32, whole (no padding mask, so transformers passes ``enable_gqa=True``): the
    H200 ran the math path, materialising the attention weights, where CPU's flash kernel does not (the issue
    measured the CPU plan ~40% under the H200). Staged on CPU fake tensors with CUDA's choice (its backward too),
    the plan for the GPU holds the weights and their softmax per layer."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                                      num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512)
    model = transformers.LlamaForCausalLM(config)
    model.config._attn_implementation = "sdpa"

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=x, labels=y).loss
        loss.backward()
        return loss

    ids = torch.randint(0, 1000, (2, 512))
    cpu = stagetorch.make_ir(step)(ids, ids)
    with sdpa_dispatch(SM90, devices=("cpu",)) as mode:
        gpu = stagetorch.make_ir(step)(ids, ids)
    assert mode.choices == [MATH, MATH]
    weights = 2 * 8 * 512 * 512 * 4
    assert any(o.aval.shape == (2, 8, 512, 512) for e in gpu.eqns for o in e.outvars if o is not None)
    assert not any(o.aval.shape == (2, 8, 512, 512) for e in cpu.eqns for o in e.outvars if o is not None)
    assert peak_bytes(gpu) - peak_bytes(cpu) >= 2 * weights  # each layer's softmax kept for the backward pass
    # in bf16 the same step takes flash on the H200
    with sdpa_dispatch(SM90, devices=("cpu",)) as mode:
        model.to(bf16)
        stagetorch.make_ir(step)(ids, ids)
    assert mode.choices == [FLASH, FLASH]


def test_without_cuda_staging_fake_cuda_attention_decomposes_whatever_the_dtype() -> None:
    """What a CPU-only build does on its own: no CUDA kernel to choose, the math path even in bf16."""
    q = Aval((2, 8, 256, 64), bf16, "cuda")
    graph = stagetorch.make_ir(attention)(q, q, q)
    assert not any("flash" in p or "efficient" in p for p in prims(graph))


# -- CUDA's autocast on fake CUDA tensors ------------------------------------------------------------------------


def mixed(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = x @ w
        z = torch.softmax(y, -1)
        n = F.layer_norm(y, (y.shape[-1],))
        loss = F.cross_entropy(y, t)
    return y, z, n, loss


def test_cuda_autocast_casts_fake_cuda_tensors_by_cudas_lists() -> None:
    args = (Aval((4, 8), f32, "cuda"), Aval((8, 8), f32, "cuda"), Aval((4,), torch.int64, "cuda"))
    with cuda_staging():
        y, z, n, loss = stagetorch.eval_shape(mixed)(*args)
    assert (y.dtype, z.dtype, n.dtype, loss.dtype) == (bf16, f32, f32, f32)
    with cuda_staging():
        graph = stagetorch.make_ir(mixed)(*args)
    mm = next(e for e in graph.eqns if e.prim == aten.mm.default)
    assert all(a.aval.dtype == bf16 for a in mm.args)
    norm = next(e for e in graph.eqns if e.prim == aten.native_layer_norm.default)
    assert norm.args[0].aval.dtype == f32
    assert not torch.is_autocast_enabled("cuda")  # nothing left switched on
    # CPU's lists differ: its autocast leaves softmax and layer_norm in bfloat16
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cpu = (x @ w, torch.softmax(x @ w, -1), F.layer_norm(x @ w, (8,)))
    assert [o.dtype for o in cpu] == [bf16, bf16, bf16]


def test_cuda_autocast_is_off_on_a_cpu_build_without_it() -> None:
    """The cause: ``torch.autocast("cuda")`` checks for a GPU in Python and turns itself off (with a warning)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    args = (Aval((4, 8), f32, "cuda"), Aval((8, 8), f32, "cuda"), Aval((4,), torch.int64, "cuda"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        y, *_ = stagetorch.eval_shape(mixed)(*args)
    assert y.dtype == f32
    assert any("Disabling autocast" in str(w.message) for w in seen)


def test_cuda_autocast_allowed_restores_what_it_patched() -> None:
    before = torch.cuda.amp.common.amp_definitely_not_available, torch.cuda.is_bf16_supported
    with cuda_autocast_allowed():
        assert not torch.cuda.amp.common.amp_definitely_not_available()
    assert (torch.cuda.amp.common.amp_definitely_not_available, torch.cuda.is_bf16_supported) == before


def test_autocast_runs_attention_in_its_low_dtype_before_the_choice() -> None:
    """fp32 inputs under bf16 autocast: the GPU casts them first, so flash, not memory-efficient."""
    with FakeTensorMode():
        q = torch.empty(2, 8, 128, 64, device="cuda")
        with cuda_staging() as mode, torch.autocast("cuda", dtype=torch.bfloat16):
            out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert mode.choices == [FLASH] and out.dtype == bf16


# -- workspace rules keyed on the device -------------------------------------------------------------------------


def var(shape: tuple[int, ...], dtype: torch.dtype = bf16, device: str = "cuda") -> Var:
    return Var(Aval(shape, dtype, device))


@pytest.mark.parametrize("op,backend,dropout_at,causal_at", [
    (aten._scaled_dot_product_flash_attention_backward, FLASH, 10, 11),
    (aten._scaled_dot_product_efficient_attention_backward, EFFICIENT, 9, 11),
    (aten._scaled_dot_product_cudnn_attention_backward, CUDNN, 13, 14),
])
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_fused_backward_workspace_rules(op, backend: str, dropout_at: int, causal_at: int, device: str) -> None:
    q, k = var((2, 8, 100, 64), device=device), var((2, 2, 100, 64), device=device)
    args = [q, q, k, k] + [None] * (causal_at - 3)
    args[dropout_at], args[causal_at] = 0.0, True
    e = Eqn(op.default, tuple(args), {}, [var((2, 8, 100, 64), device=device)])
    expected = backward_workspace(backward_call(q.aval, k.aval, k.aval, 0.0, True), backend) if device == "cuda" else 0
    assert slot(op.default, "workspace")(e) == expected
    if device == "cuda":
        assert expected > 0


@pytest.mark.parametrize("dtype,head_dim,expected", [(bf16, 256, 4 * 2 * 100 * 8 * 256), (bf16, 128, 0), (f32, 256, 0)])
def test_efficient_forward_accumulates_large_head_dims_in_float32(dtype: torch.dtype, head_dim: int, expected: int) -> None:
    q = var((2, 8, 100, head_dim), dtype)
    e = Eqn(aten._scaled_dot_product_efficient_attention.default, (q, q, q, None, True), {}, [q])
    assert slot(aten._scaled_dot_product_efficient_attention.default, "workspace")(e) == expected
    cpu = var((2, 8, 100, head_dim), dtype, "cpu")
    e = Eqn(aten._scaled_dot_product_efficient_attention.default, (cpu, cpu, cpu, None, True), {}, [cpu])
    assert slot(aten._scaled_dot_product_efficient_attention.default, "workspace")(e) == 0


def conv_eqn(device: str, backward: bool) -> Eqn:
    x, w, out = var((4, 64, 56, 56), f32, device), var((64, 64, 3, 3), f32, device), var((4, 64, 56, 56), f32, device)
    if backward:
        args = (out, x, w, [64], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True])
        return Eqn(aten.convolution_backward.default, args, {}, [x, w, var((64,), f32, device)])
    return Eqn(aten.convolution.default, (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1), {}, [out])


def test_conv_workspace_on_cuda_is_cudnns_bound() -> None:
    fmap = 4 * 64 * 56 * 56 * 4
    assert slot(aten.convolution.default, "workspace")(conv_eqn("cuda", False)) == fmap + cuda_conv.PER_CALL
    assert slot(aten.convolution_backward.default, "workspace")(conv_eqn("cuda", True)) == 2 * fmap + cuda_conv.PER_CALL


def test_conv_workspace_cap() -> None:
    x = Aval((4, 64, 56, 56), f32, "cuda")
    assert cuda_conv.forward_workspace(x, x, env={"CUDNN_CONV_WSCAP_DBG": "2"}) == 2 * 2**20
    assert cuda_conv.backward_workspace(x, x, env={"CUDNN_CONV_WSCAP_DBG": "1024"}) == 2 * x.nbytes + cuda_conv.PER_CALL
    assert cuda_conv.workspace_cap({}) is None


def test_conv_workspace_on_cpu_is_not_cudas(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU branch (oneDNN's and the column buffers' replay) does not read the CUDA bound."""
    rules = [(slot(aten.convolution.default, "workspace"), False), (slot(aten.convolution_backward.default, "workspace"), True)]
    before = [rule(conv_eqn(device, backward)) for rule, backward in rules for device in ("cpu", "cuda")]
    monkeypatch.setattr(cuda_conv, "PER_CALL", 0)
    after = [rule(conv_eqn(device, backward)) for rule, backward in rules for device in ("cpu", "cuda")]
    assert after[0::2] == before[0::2]  # CPU: unchanged
    assert [b - a for a, b in zip(after[1::2], before[1::2])] == [4 * 2**20] * 2  # CUDA: the bound moved


# -- cuBLAS --------------------------------------------------------------------------------------------------------


def test_cublas_workspace_by_capability_and_environment() -> None:
    assert cuda_blas.cublas_workspace((9, 0), {}) == 32 * 2**20  # Hopper: measured on the H200
    assert cuda_blas.cublas_workspace((8, 0), {}) == 4096 * 1024 * 2 + 16 * 1024 * 8
    assert cuda_blas.cublas_workspace((8, 9), {}) == 8_519_680
    assert cuda_blas.cublas_workspace((9, 0), {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == 32 * 2**20
    assert cuda_blas.cublas_workspace((8, 0), {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 16 * 1024 * 8
    assert cuda_blas.cublas_workspace((8, 0), {"CUBLAS_WORKSPACE_CONFIG": ":4096:2:16:8"}) == 8_519_680
    assert cuda_blas.cublas_workspace((8, 0), {"CUBLAS_WORKSPACE_CONFIG": "junk"}) == 8_519_680


def test_cublaslt_workspace() -> None:
    assert cuda_blas.cublaslt_workspace((9, 0), {}) == 2**20
    assert cuda_blas.cublaslt_workspace((9, 0), {"CUBLASLT_WORKSPACE_SIZE": "4096"}) == 4 * 2**20
    assert cuda_blas.cublaslt_workspace((9, 0), {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"}) == 0
    # capped at the cuBLAS workspace
    assert cuda_blas.cublaslt_workspace((9, 0), {"CUBLASLT_WORKSPACE_SIZE": "65536"}) == 32 * 2**20
    assert cuda_blas.resident_workspaces((9, 0), {}) == [32 * 2**20, 2**20]
    assert cuda_blas.resident_workspaces((8, 0), {}, streams=2, lt=False) == [8_519_680, 8_519_680]

"""Rules for the attention op family."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ShapeError
from ..interpreters import batch_rules, flops, shape_rules
from ..interpreters.memory import MemoryEffect
from ..ir import Aval, Eqn
from .kernels import cuda_sdpa

aten = torch.ops.aten


def sdpa_cpu(q: Aval, k: Aval, v: Aval, *args: Any, **kwargs: Any) -> tuple[Aval, Aval]:
    """(batch..., heads, L, E) queries against (..., S, E) keys and (..., S, Ev) values."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ShapeError(f"aten._scaled_dot_product_flash_attention_for_cpu: expects 4-d q, k, v ({q}, {k}, {v})")
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2] or q.shape[0] != k.shape[0]:
        raise ShapeError(f"aten._scaled_dot_product_flash_attention_for_cpu: q, k, v do not line up ({q}, {k}, {v})")
    out = Aval(q.shape[:-1] + v.shape[-1:], q.dtype, q.device)
    return out, Aval(q.shape[:-1], _accumulate_dtype(q), q.device)


def sdpa_cpu_backward(grad: Aval, q: Aval, k: Aval, v: Aval, *args: Any, **kwargs: Any) -> tuple[Aval, Aval, Aval]:
    return q, k, v


def _flash_splits(q: Aval, k: Aval) -> tuple[int, int]:
    """The query and key blocks CPU flash attention works in (FlashAttentionKernel.cpp, torch 2.13)."""
    length = q.shape[-2]
    q_split = 256 if length >= 768 else 64 if length >= 192 else 32
    return min(length, q_split), min(k.shape[-2], 512)


def _accumulate_dtype(q: Aval) -> torch.dtype:
    """The type the kernel accumulates in, and returns the logsumexp in: double for double inputs, float for
    every other."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _accumulate_itemsize(q: Aval) -> int:
    """Bytes of the type the kernel accumulates in."""
    return _accumulate_dtype(q).itemsize


def sdpa_cpu_memory(e: Eqn) -> MemoryEffect:
    """The logsumexp's true bytes: the kernel returns it in the accumulation type, where torch 2.11's meta
    kernel (and so the traced value) says float for double inputs (2.13's says double). Exact on both."""
    q, logsumexp = e.args[0].aval, e.outvars[1]
    if logsumexp is None or q.device.type != "cpu":
        return MemoryEffect()
    return MemoryEffect(outputs={1: logsumexp.aval.numel * _accumulate_itemsize(q)})


def sdpa_cpu_workspace(e: Eqn) -> int:
    """Each thread's scores, row maxima and sums and output block, in the accumulation type (float; double for
    double inputs; measured at the allocator: tests/ops/test_workspace.py). Reduced-precision inputs add a copy of the scores block in their own dtype."""
    q, k, v = (a.aval for a in e.args[:3])
    if q.device.type != "cpu":
        return 0
    qs, ks = _flash_splits(q, k)
    acc = _accumulate_itemsize(q)
    per_thread = acc * (qs * ks + 2 * qs + qs * v.shape[-1]) + (q.itemsize * qs * ks if q.itemsize < 4 else 0)
    return torch.get_num_threads() * per_thread


def _read_in_place(shape: tuple[int, ...], strides: tuple[int, ...] | None) -> bool:
    """The kernel reads the output gradient (batch, heads, L, E) as (batch, L, heads, E) and copies it unless
    it is contiguous so (measured: tests/ops/test_workspace.py)."""
    if strides is None:
        return False
    return torch.empty_strided(shape, strides, device="meta").transpose(1, 2).is_contiguous()


def sdpa_cpu_backward_workspace(e: Eqn, layouts: Any = None) -> int:
    """Each thread's scores and their gradient in the accumulation type (float; double for double inputs), a
    row of the query block, and a copy of the output gradient unless it is laid out (batch, L, heads, E) (as
    after the usual ``transpose(1, 2).reshape``, where the IR's layouts show it; unknown counts the copy)."""
    grad, q, k = (a.aval for a in e.args[:3])
    if q.device.type != "cpu":
        return 0
    qs, ks = _flash_splits(q, k)
    reduced = 2 * q.itemsize * qs * ks if q.itemsize < 4 else 0
    acc = _accumulate_itemsize(q)
    copy = 0 if layouts is not None and _read_in_place(grad.shape, layouts(e.args[0])) else grad.nbytes
    return torch.get_num_threads() * (2 * acc * qs * ks + reduced) + acc * qs + copy


sdpa_cpu_backward_workspace.reads_layouts = True  # type: ignore[attr-defined]


def _arg(e: Eqn, i: int, name: str, default: Any) -> Any:
    """Argument ``i`` of ``e`` (``name`` when passed by keyword), else ``default``."""
    return e.args[i] if len(e.args) > i else e.kwargs.get(name, default)


def _cuda_backward_workspace(backend: str, dropout_at: int, causal_at: int) -> Any:
    """The workspace rule of a fused attention backward on a CUDA device (cuda_sdpa.backward_workspace)."""

    def rule(e: Eqn) -> int:
        q, k, v = (a.aval for a in e.args[1:4])
        if q.device.type != "cuda":
            return 0
        call = cuda_sdpa.backward_call(q, k, v, _arg(e, dropout_at, "dropout_p", 0.0), _arg(e, causal_at, "is_causal", False))
        return cuda_sdpa.backward_workspace(call, backend)

    return rule


def _cuda_efficient_workspace(e: Eqn) -> int:
    """The output accumulator of CUDA's memory-efficient attention (cuda_sdpa.forward_workspace)."""
    q, k, v = (a.aval for a in e.args[:3])
    if q.device.type != "cuda":
        return 0
    call = cuda_sdpa.SdpaCall.of(q, k, v, enable_gqa=q.shape[1] != k.shape[1])
    return cuda_sdpa.forward_workspace(call, cuda_sdpa.EFFICIENT)


# Shape rules: op -> rule(*args with Avals, **kwargs) -> Aval | tuple[Aval, ...]
SHAPE: dict = {
    aten._softmax: shape_rules.softmax("_softmax"),
    aten._log_softmax: shape_rules.softmax("_log_softmax"),
    aten._softmax_backward_data: lambda grad, out, dim, dtype: Aval(grad.shape, dtype, grad.device),
    aten._log_softmax_backward_data: lambda grad, out, dim, dtype: Aval(grad.shape, dtype, grad.device),
    aten._scaled_dot_product_flash_attention_for_cpu: sdpa_cpu,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: sdpa_cpu_backward,
}


def _traced_logsumexp_is_float() -> bool:
    """Whether this torch's fake kernel says float for a double input's logsumexp (torch 2.11; 2.13 says
    double, as the kernel returns): only then does the traced value need the memory rule, which otherwise
    would only keep the planner from deriving chunk peaks along a line (``planning._Sizes``)."""
    q = torch.empty(1, 1, 2, 8, dtype=torch.float64, device="meta")
    try:
        return aten._scaled_dot_product_flash_attention_for_cpu(q, q, q)[1].dtype != torch.float64
    except (RuntimeError, NotImplementedError):
        return True


# Memory rules: op -> rule(eqn) -> MemoryEffect (see stagetorch/interpreters/memory.py)
MEMORY: dict = {aten._scaled_dot_product_flash_attention_for_cpu: sdpa_cpu_memory} if _traced_logsumexp_is_float() else {}


# Batch rules: op -> rule(eqn, label) -> Chunked (see stagetorch/interpreters/batching.py)
BATCH: dict = {
    # (batch, heads, sequence, features) layouts: every example attends within itself. A shared mask of
    # full batch extent is cut to the chunk.
    aten._scaled_dot_product_flash_attention_for_cpu: batch_rules.per_example(slice_args=(5,)),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: batch_rules.per_example(slice_args=(8,)),
    aten._scaled_dot_product_flash_attention: batch_rules.per_example(),
    aten._scaled_dot_product_flash_attention_backward: batch_rules.per_example(),
    aten._scaled_dot_product_efficient_attention: batch_rules.per_example(slice_args=(3,)),
    aten._scaled_dot_product_efficient_attention_backward: batch_rules.per_example(slice_args=(3,)),
    aten._scaled_dot_product_cudnn_attention: batch_rules.per_example(slice_args=(3,)),
    aten._scaled_dot_product_cudnn_attention_backward: batch_rules.per_example(),
    # nn.TransformerEncoderLayer / nn.MultiheadAttention fast paths (eval, no grad, batch_first).
    aten._transformer_encoder_layer_fwd: batch_rules.per_example(),
    aten._native_multi_head_attention: batch_rules.per_example(),
    aten._softmax: batch_rules.softmax(dim_arg=1),
    aten._log_softmax: batch_rules.softmax(dim_arg=1),
    aten._softmax_backward_data: batch_rules.softmax(dim_arg=2),
    aten._log_softmax_backward_data: batch_rules.softmax(dim_arg=2),
    aten._safe_softmax: batch_rules.softmax(dim_arg=1),
}


# FLOP rules: op -> rule(eqn) -> int (see stagetorch/interpreters/flops.py)
FLOPS: dict = {
    **{op: flops.attention_rule for op in (
        aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention,
        aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_cudnn_attention,
    )},
    **{op: flops.attention_backward_rule for op in (
        aten._scaled_dot_product_flash_attention_for_cpu_backward, aten._scaled_dot_product_flash_attention_backward,
        aten._scaled_dot_product_efficient_attention_backward, aten._scaled_dot_product_cudnn_attention_backward,
    )},
}


# Workspace rules: op -> rule(eqn) -> bytes the kernel allocates inside itself (see stagetorch/interpreters/memory.py)
WORKSPACE: dict = {
    aten._scaled_dot_product_flash_attention_for_cpu: sdpa_cpu_workspace,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: sdpa_cpu_backward_workspace,
    # CUDA's fused kernels (what a GPU runs, and what cuda_sdpa.sdpa_dispatch records on fake CUDA tensors).
    aten._scaled_dot_product_efficient_attention: _cuda_efficient_workspace,
    aten._scaled_dot_product_flash_attention_backward: _cuda_backward_workspace(cuda_sdpa.FLASH, 10, 11),
    aten._scaled_dot_product_efficient_attention_backward: _cuda_backward_workspace(cuda_sdpa.EFFICIENT, 9, 11),
    aten._scaled_dot_product_cudnn_attention_backward: _cuda_backward_workspace(cuda_sdpa.CUDNN, 13, 14),
}

"""Which kernel ``scaled_dot_product_attention`` runs on a CUDA device, and the bytes each one allocates.

PyTorch picks the kernel at run time (``select_sdp_backend`` in ``aten/src/ATen/native/transformers/cuda/
sdp_utils.cpp``): it walks a priority order (flash, memory-efficient, math; cuDNN first where it is preferred)
and takes the first backend whose constraints the call meets. The backends differ by a lot in memory: flash and
memory-efficient attention keep only the output and a float32 logsumexp per query row for the backward pass,
while the math fallback materialises the (batch, heads, L, S) scores, their softmax (saved for the backward pass)
and, for grouped-query attention, copies of the keys and values expanded to every query head.

On a CPU-only build, fake CUDA tensors never reach that choice: ``_fused_sdp_choice`` has no CUDA kernel there,
so ``F.scaled_dot_product_attention`` always decomposes into the math path. :func:`sdpa_dispatch` (a
``TorchFunctionMode``) makes the choice as a GPU of the given compute capability would and calls the chosen
kernel's ATen op, so that a staged graph records ``_scaled_dot_product_flash_attention`` /
``_scaled_dot_product_efficient_attention`` / ``_scaled_dot_product_cudnn_attention`` where the GPU would run them,
and the math decomposition only where the GPU falls back to it.

The rules are those of torch 2.11-2.13 for dense (not nested) inputs, written from the constraints' meaning:

- flash: fp16/bf16 (fp16 only below sm80), sm80 and newer, no ``attn_mask``, q, k and v of one head dim
  <= 256, ``is_causal`` only with L == S, GQA accepted (query heads a multiple of key heads); on sm86/sm89 a
  head dim in (192, 224] (or (224, 256] with dropout) is refused when an input requires grad.
- memory-efficient: fp32, fp16 and bf16 from sm80 (fp32 and fp16 below), sm50 and newer, head dims divisible
  by the GEMM alignment (fp32: 4 on sm80+, 1 below; fp16/bf16: 8 on sm80+ ...) and q, k of one head dim; an
  ``attn_mask`` accepted. Grouped-query attention: refused in torch 2.11 (as the H200 measured: a Llama-style
  model in fp32 took the math path); PyTorch's main branch accepts it (``efficient_gqa=True``).
- cuDNN: fp16/bf16, sm80 and newer, head dims multiples of 8 and <= 128 (256 on sm90 with a new cuDNN), dropout a
  multiple of 1/16, S > 1. Tried first only where it is preferred (``prefer_cudnn``: sm90/sm100 with cuDNN newer
  than 9.15 in recent builds); otherwise the default order puts it after math, which always runs, so it is
  never chosen.
- math: everything else.
- every fused kernel: q, k and v with a last-dim stride of 1.

The dispatcher reads the process's settings as PyTorch does: the backends ``torch.nn.attention.sdpa_kernel`` (or
``torch.backends.cuda.enable_*_sdp``) leaves enabled, and the priority order (flash, memory-efficient, math, cuDNN
by default).

Plain values in, names and bytes out: nothing here runs a kernel except :func:`sdpa_dispatch`, on whatever
tensors it is given (fake ones, when staging).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch.overrides import TorchFunctionMode

from ...errors import UnsupportedOpError

__all__ = [
    "CudaProps", "DEFAULT_PROPS", "SdpaCall", "select_backend", "forward_bytes", "forward_workspace", "backward_workspace", "backward_call", "sdpa_dispatch",
    "torch_settings", "DEFAULT_ORDER", "FLASH", "EFFICIENT", "CUDNN", "MATH",
]

FLASH, EFFICIENT, CUDNN, MATH = "flash", "efficient", "cudnn", "math"


class CudaProps(NamedTuple):
    """What of a CUDA device and build changes the choice: the compute capability, whether cuDNN attention is
    tried first (``prefer_cudnn``), whether memory-efficient attention takes grouped-query attention
    (``efficient_gqa``: False for torch 2.11, as measured), the cuDNN version (``90100`` = 9.1.0)."""

    capability: tuple[int, int] = (9, 0)
    prefer_cudnn: bool = False
    efficient_gqa: bool = False
    cudnn_version: int = 91002


# A Hopper GPU as torch 2.11 drives it (the H200 measured).
DEFAULT_PROPS = CudaProps()


class SdpaCall(NamedTuple):
    """One call's shapes and flags: q (B, Hq, L, E), k (B, Hk, S, E), v (B, Hk, S, Ev)."""

    batch: int
    heads: int
    kv_heads: int
    length: int
    source: int
    head_dim: int
    value_dim: int
    dtype: torch.dtype
    has_mask: bool = False
    is_causal: bool = False
    dropout_p: float = 0.0
    enable_gqa: bool = False
    requires_grad: bool = False
    # q, k and v each have a last-dim stride of 1 (the fused kernels read rows; flash lets a size-1 dim pass)
    last_dim_contiguous: bool = True

    @classmethod
    def of(cls, q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
           enable_gqa: bool = False, requires_grad: bool | None = None) -> SdpaCall:
        """The call of 4-d tensors (or Avals) ``q, k, v``."""
        grad = requires_grad
        if grad is None:
            grad = any(getattr(t, "requires_grad", False) for t in (q, k, v))
        strides = [t.stride() for t in (q, k, v) if isinstance(t, torch.Tensor)]
        return cls(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3], q.dtype,
                   attn_mask is not None, bool(is_causal), float(dropout_p), bool(enable_gqa), bool(grad),
                   all(st[-1] == 1 for st in strides))


_HALF = (torch.float16, torch.bfloat16)


def _heads_ok(c: SdpaCall, gqa: bool) -> bool:
    """Equal head counts, or (a backend that takes grouped-query attention, ``enable_gqa`` given) query heads a
    multiple of key heads."""
    if c.heads == c.kv_heads:
        return True
    return gqa and c.enable_gqa and c.kv_heads > 0 and c.heads % c.kv_heads == 0


def _gemm_alignment(c: SdpaCall, props: CudaProps) -> int:
    """The head-dim alignment memory-efficient attention's GEMMs need (``minimum_gemm_alignment``)."""
    major = props.capability[0]
    half = c.dtype in _HALF
    tensor_cores = major >= 8 or (major >= 7 and half)
    align = 4 if major >= 8 else 1
    if tensor_cores:
        align = max(align, 128 // (16 if half else 32))
    return align


def _can_flash(c: SdpaCall, props: CudaProps) -> bool:
    cap = props.capability
    if c.has_mask or not (8, 0) <= cap <= (12, 1):
        return False
    if not (c.head_dim == c.value_dim and c.head_dim <= 256):
        return False
    consumer = (8, 6) <= cap <= (8, 9) or (12, 0) <= cap <= (12, 1)
    if c.requires_grad and consumer and not (c.head_dim <= 192 or (c.dropout_p == 0.0 and c.head_dim > 224)):
        return False
    if c.is_causal and c.length != c.source:
        return False
    if c.dtype not in (_HALF if cap[0] >= 8 else (torch.float16,)):
        return False
    if not c.last_dim_contiguous and not (c.head_dim == 1 and c.value_dim == 1):
        return False
    return _heads_ok(c, gqa=True) and c.length > 0 and c.source > 0


def _can_efficient(c: SdpaCall, props: CudaProps) -> bool:
    cap = props.capability
    if not (5, 0) <= cap <= (12, 1):
        return False
    align = _gemm_alignment(c, props)
    if not (c.head_dim % align == 0 and c.value_dim % align == 0 and c.head_dim > 0 and c.value_dim > 0):
        return False
    if not c.last_dim_contiguous or not _heads_ok(c, gqa=props.efficient_gqa) or c.length == 0 or c.source == 0:
        return False
    allowed = (torch.float16, torch.float32, torch.bfloat16) if cap[0] >= 8 else (torch.float16, torch.float32)
    return c.dtype in allowed


def _can_cudnn(c: SdpaCall, props: CudaProps) -> bool:
    cap = props.capability
    if props.cudnn_version < 90000 or not (8, 0) <= cap <= (12, 1):
        return False
    if c.dtype not in _HALF or c.dropout_p * 16.0 != math.floor(c.dropout_p * 16.0):
        return False
    if c.dropout_p > 0.0 and 91100 < props.cudnn_version < 91400:
        return False
    limit = 256 if (cap == (9, 0) or cap[0] == 10) and props.cudnn_version > 92200 else 128
    if c.head_dim > limit or c.value_dim > limit or c.head_dim % 8 or c.value_dim % 8:
        return False
    if not c.last_dim_contiguous or c.source == 1 or c.length == 0 or c.source == 0 or (c.dropout_p > 0.0 and c.length == 1):
        return False
    return c.heads == c.kv_heads or (c.enable_gqa and c.heads % c.kv_heads == 0)


_BY_ENUM = {0: MATH, 1: FLASH, 2: EFFICIENT, 3: CUDNN}
DEFAULT_ORDER = (FLASH, EFFICIENT, MATH, CUDNN)


def torch_settings() -> tuple[tuple[str, ...], frozenset[str]]:
    """This process's SDPA priority order and enabled backends (``torch.nn.attention.sdpa_kernel`` and
    ``torch.backends.cuda.enable_*_sdp`` set them; a CPU build keeps them too)."""
    order = tuple(_BY_ENUM[i] for i in torch._C._get_sdp_priority_order() if i in _BY_ENUM)
    cuda = torch.backends.cuda
    enabled = {name for name, on in ((FLASH, cuda.flash_sdp_enabled()), (EFFICIENT, cuda.mem_efficient_sdp_enabled()),
                                     (MATH, cuda.math_sdp_enabled()), (CUDNN, cuda.cudnn_sdp_enabled())) if on}
    return order, frozenset(enabled)


def select_backend(c: SdpaCall, props: CudaProps = DEFAULT_PROPS, order: tuple[str, ...] = DEFAULT_ORDER,
                   enabled: frozenset[str] = frozenset((FLASH, EFFICIENT, MATH, CUDNN))) -> str:
    """The backend a GPU of ``props`` runs ``c`` with: ``"flash"``, ``"efficient"``, ``"cudnn"`` or ``"math"``;
    the first of ``order`` that is ``enabled`` and takes the call (``order`` as PyTorch's default has it, cuDNN
    moved first where ``props.prefer_cudnn``). None taking it: PyTorch raises ``No available kernel``, and so
    does this (:class:`~stagetorch.errors.UnsupportedOpError`)."""
    if props.prefer_cudnn and tuple(order) == DEFAULT_ORDER:
        order = (CUDNN, FLASH, EFFICIENT, MATH)
    checks = {FLASH: _can_flash, EFFICIENT: _can_efficient, CUDNN: _can_cudnn, MATH: lambda c, p: True}
    for name in order:
        if name in enabled and checks[name](c, props):
            return name
    raise UnsupportedOpError(
        f"scaled_dot_product_attention: no enabled kernel takes this call on a GPU of compute capability "
        f"{props.capability} ({c}; enabled: {sorted(enabled)}), so PyTorch would raise 'No available kernel'. "
        "What to do: enable the math backend (torch.nn.attention.sdpa_kernel) or change the call."
    )


def _round(n: int, m: int) -> int:
    return -(-n // m) * m


def forward_bytes(c: SdpaCall, backend: str) -> dict[str, int]:
    """The tensors the forward call of ``backend`` allocates, by name, in bytes (before the allocator's 512-byte
    rounding): ``out``; ``logsumexp`` (float32, (B, H, L) for flash, (B, H, L rounded up to 32) for
    memory-efficient when a gradient is needed, (B, H, L, 1) for cuDNN); ``rng`` (the philox seed and offset);
    flash pads a head dim that is not a multiple of 8 (copies of q, k, v; the output sliced from a padded one);
    for math the scores, their softmax (kept for the backward pass), the mask's and dropout's copies and the
    grouped-query copies of k and v (fp16/bf16 inputs are computed in float32 on the math path)."""
    b, h, hk, L, S, E, Ev = c.batch, c.heads, c.kv_heads, c.length, c.source, c.head_dim, c.value_dim
    size = c.dtype.itemsize
    out = b * h * L * Ev * size
    if backend == FLASH:
        if E % 8:
            # the head dim padded to a multiple of 8 (q, k, v copied), the output a view of the padded one
            padded = _round(E, 8)
            return {"out": b * h * L * padded * size, "padded_qkv": b * (h * L + 2 * hk * S) * padded * size,
                    "logsumexp": 4 * b * h * L, "rng": 16 + 8}
        return {"out": out, "logsumexp": 4 * b * h * L, "rng": 16 + 8}
    if backend == EFFICIENT:
        lse = 4 * b * h * _round(L, 32) if c.requires_grad else 0
        return {"out": out, "logsumexp": lse, "rng": 8 + 8}
    if backend == CUDNN:
        lse = 4 * b * h * L if c.requires_grad else 0
        return {"out": out, "logsumexp": lse, "rng": 8 + 8}
    acc = 4 if c.dtype in _HALF else size  # the math path upcasts fp16/bf16 to float32
    scores = b * h * L * S * acc
    parts = {
        "scaled_q": b * h * L * E * acc,
        "scores": scores,
        "softmax": scores,
        "out": out,
    }
    if c.dtype in _HALF:
        parts["upcast_qkv"] = b * (h * L * E + hk * S * (E + Ev)) * 4
        parts["out_f32"] = b * h * L * Ev * 4
    if c.heads != c.kv_heads:
        parts["gqa_kv"] = b * h * S * (E + Ev) * acc
    if c.has_mask or c.is_causal:
        parts["masked_scores"] = scores
    if c.dropout_p > 0.0:
        parts["dropout_mask"] = b * h * L * S
        parts["dropped"] = scores
    return parts


def forward_workspace(c: SdpaCall, backend: str) -> int:
    """Scratch the forward kernel of ``backend`` allocates beside its outputs. memory-efficient (CUTLASS's
    kernel): above a head dim of 128 it iterates over the values in blocks and, unless its output is float32,
    accumulates the output in a float32 buffer (B, L, H, Ev). flash and cuDNN while training: none (flash's
    split-KV buffers are for inference of a few rows). math: its decomposition's own ops."""
    if backend == EFFICIENT and max(c.head_dim, c.value_dim) > 128 and c.dtype != torch.float32:
        return 4 * c.batch * c.length * c.heads * c.value_dim
    return 0


def backward_workspace(c: SdpaCall, backend: str) -> int:
    """Scratch the backward kernel of ``backend`` allocates beside its gradients (freed when it returns).

    flash (FlashAttention-2's ``mha_bwd``): a float32 accumulator for dq, (B, L rounded up to 128, H, E rounded up
    to 32; 256 above 192), and the float32 row sums (B, H, L rounded up to 128); with grouped-query attention, dk and dv for every
    query head before they are summed to the key heads. memory-efficient (an upper bound): its float32 ``delta``
    (B, H, L) and, for fp16/bf16, a float32 accumulator for dq. cuDNN: the float32 ``delta``. math: none (its
    backward is the decomposition's own ops)."""
    b, h, hk, L, S, E, Ev = c.batch, c.heads, c.kv_heads, c.length, c.source, c.head_dim, c.value_dim
    if backend == FLASH:
        ws = 4 * b * _round(L, 128) * h * (_round(E, 32) if E <= 192 else 256) + 4 * b * h * _round(L, 128)
        if h != hk:
            ws += b * S * h * (E + Ev) * c.dtype.itemsize
        return ws
    if backend == EFFICIENT:
        return 4 * b * h * L + (4 * b * h * L * E if c.dtype != torch.float32 else 0)
    if backend == CUDNN:
        return 4 * b * h * L
    return 0


def backward_call(q: Any, k: Any, v: Any, dropout_p: float = 0.0, is_causal: bool = False) -> SdpaCall:
    """The call a fused backward op's q, k, v avals (or tensors) describe (a gradient is being taken)."""
    return SdpaCall.of(q, k, v, None, dropout_p, is_causal, enable_gqa=q.shape[1] != k.shape[1], requires_grad=True)


def _autocast(t: Any, low: torch.dtype) -> Any:
    """``t`` as autocast's low-precision cast leaves it: floating tensors but float64 in ``low``."""
    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 and t.dtype != low:
        return t.to(low)
    return t


def _bias(mask: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """A boolean mask as the additive float bias the fused kernels take (``convert_boolean_attn_mask``)."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(mask.logical_not(), float("-inf"))
    return mask


def _aligned(bias: torch.Tensor) -> torch.Tensor:
    """The bias as memory-efficient attention reads it: its last dim padded to a multiple of 16 (a copy) and
    sliced back (``preprocess_mask``'s ``pad_bias``)."""
    extra = -bias.shape[-1] % 16
    if not extra:
        return bias
    return torch.nn.functional.pad(bias, (0, extra)).narrow(-1, 0, bias.shape[-1])


class sdpa_dispatch(TorchFunctionMode):
    """Inside it, ``F.scaled_dot_product_attention`` on CUDA tensors runs the kernel a GPU of ``props`` would
    choose: the fused backends' ATen ops (whose fake kernels give their outputs), or the math decomposition.
    ``self.choices`` records each call's backend, in order.

    ``devices``: the tensors' device types taken for the GPU. ``("cpu",)`` stages CUDA's kernels on CPU fake
    tensors, for a graph that is costed for a GPU once its values are moved there and never run: on a CPU-only
    build, autograd cannot run a backward pass over fake CUDA tensors (it asks for the device's streams), and
    over CPU fake tensors the fused kernels' fake implementations and their backward ops trace as on a GPU.

    For staging only: on a real GPU, PyTorch's own choice is the truth (this model of it may differ, e.g. with
    another cuDNN), and a graph staged with ``devices=("cpu",)`` calls CUDA kernels on CPU tensors if run."""

    def __init__(self, props: CudaProps = DEFAULT_PROPS, devices: tuple[str, ...] = ("cuda",)):
        super().__init__()
        self.props = props
        self.devices = tuple(devices)
        self.choices: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        bound = {**dict(zip(names, args)), **kwargs}
        q, k, v = bound["query"], bound["key"], bound["value"]
        if q.device.type not in self.devices or q.dim() != 4 or q.is_nested:
            return func(*args, **kwargs)
        mask, dropout = bound.get("attn_mask"), float(bound.get("dropout_p", 0.0))
        causal, scale, gqa = bool(bound.get("is_causal", False)), bound.get("scale"), bool(bound.get("enable_gqa", False))
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        low = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
        call = SdpaCall.of(q, k, v, mask, dropout, causal, gqa, grad)
        if low is not None and call.dtype != torch.float64:
            # CUDA's autocast runs attention in its low dtype: it casts q, k, v (and a float mask) before the
            # kernel is chosen, and the choice reads the cast dtype (this mode runs ahead of the dispatcher).
            call = call._replace(dtype=low)
        backend = select_backend(call, self.props, *torch_settings())
        self.choices.append(backend)
        if low is not None:
            q, k, v, mask = (_autocast(t, low) for t in (q, k, v, mask))
        aten = torch.ops.aten
        if backend == MATH:
            # the decomposition the GPU runs (on CPU tensors, F.scaled_dot_product_attention would run CPU's
            # flash kernel instead), a boolean mask made the additive bias first
            bias = None if mask is None else _bias(mask, q)
            return aten._scaled_dot_product_attention_math(q, k, v, bias, dropout, causal, scale=scale, enable_gqa=gqa)[0]
        if backend == FLASH:
            return aten._scaled_dot_product_flash_attention(q, k, v, dropout, causal, False, scale=scale)[0]
        if backend == EFFICIENT:
            bias = None if mask is None else _aligned(_bias(mask, q)).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
            return aten._scaled_dot_product_efficient_attention(q, k, v, bias, grad, dropout, causal, scale=scale)[0]
        bias = None if mask is None else _bias(mask, q)
        return aten._scaled_dot_product_cudnn_attention(q, k, v, bias, grad, dropout, causal, False, scale=scale)[0]

"""Rules for the pooling op family."""

from __future__ import annotations

import torch

from .. import batching
from ..errors import ShapeError
from ..ir import Aval

aten = torch.ops.aten


def _pooled(size: int, kernel: int, stride: int, padding: int, dilation: int, ceil_mode: bool) -> int:
    span = size + 2 * padding - dilation * (kernel - 1) - 1
    out = (span + (stride - 1 if ceil_mode else 0)) // stride + 1
    if ceil_mode and (out - 1) * stride >= size + padding:
        out -= 1
    return out


def _pool_shape(op: str, x: Aval, kernel, stride, padding, dilation, ceil_mode) -> Aval:  # noqa: ANN001
    two = lambda v: list(v) * 2 if len(v) == 1 else list(v)  # noqa: E731
    kernel, padding, dilation = two(kernel), two(padding), two(dilation)
    stride = two(stride) if stride else kernel
    if x.ndim not in (3, 4):
        raise ShapeError(f"aten.{op}: expects a 3-d or 4-d input, got {x}")
    sizes = [_pooled(x.shape[-2 + i], kernel[i], stride[i], padding[i], dilation[i], ceil_mode) for i in range(2)]
    if any(s <= 0 for s in sizes):
        raise ShapeError(f"aten.{op}: input {x} is too small for kernel {kernel}")
    return Aval(x.shape[:-2] + tuple(sizes), x.dtype, x.device)


def max_pool2d(x, kernel, stride=(), padding=(0,), dilation=(1,), ceil_mode=False):  # noqa: ANN001, ANN201
    out = _pool_shape("max_pool2d_with_indices", x, kernel, stride, padding, dilation, ceil_mode)
    return out, Aval(out.shape, torch.int64, x.device)


def avg_pool2d(x, kernel, stride=(), padding=(0,), ceil_mode=False, *args):  # noqa: ANN001, ANN201
    return _pool_shape("avg_pool2d", x, kernel, stride, padding, (1,), ceil_mode)

# Shape rules: op -> rule(*args with Avals, **kwargs) -> Aval | tuple[Aval, ...]
SHAPE: dict = {
    aten.max_pool2d_with_indices: max_pool2d,
    aten.max_pool2d_with_indices_backward: lambda grad, x, *args: x,
    aten.avg_pool2d: avg_pool2d,
    aten.avg_pool2d_backward: lambda grad, x, *args: x,
    aten._adaptive_avg_pool2d: lambda x, size: Aval(x.shape[:-2] + tuple(size), x.dtype, x.device),
    aten._adaptive_avg_pool2d_backward: lambda grad, x: x,
}


_UPSAMPLE = (
    "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
    "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "upsample_bicubic2d", "upsample_trilinear3d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa",
)

# Batch rules: op -> rule(eqn, label) -> Chunked (see stagetorch/batching.py)
BATCH: dict = {
    **{op: batching.per_example() for op in (
        aten.max_pool2d_with_indices, aten.max_pool2d_with_indices_backward, aten.max_pool3d_with_indices,
        aten.max_pool3d_with_indices_backward, aten.avg_pool2d, aten.avg_pool2d_backward, aten.avg_pool3d,
        aten.avg_pool3d_backward, aten._adaptive_avg_pool2d, aten._adaptive_avg_pool2d_backward,
        aten._adaptive_avg_pool3d, aten._adaptive_avg_pool3d_backward, aten.adaptive_max_pool2d,
        aten.adaptive_max_pool2d_backward, aten.max_unpool2d,
    )},
    # Upsampling: per-example; the backward's input_size (argument 2) is the input's full size, batch
    # included, and is cut to the chunk with it.
    **{getattr(aten, name): batching.per_example() for name in _UPSAMPLE},
    **{getattr(aten, name + "_backward"): batching.per_example(size_list_args=(2,)) for name in _UPSAMPLE},
}


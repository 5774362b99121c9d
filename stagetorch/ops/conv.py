"""Rules for the conv op family."""

from __future__ import annotations

import torch

from .. import batching, flops
from ..errors import ShapeError
from ..ir import Aval

aten = torch.ops.aten


def _window(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def convolution(x, w, bias, stride, padding, dilation, transposed, output_padding, groups):  # noqa: ANN001, ANN201
    """N-d convolution: (N, C_in, *spatial) with (C_out, C_in/groups, *kernel); transposed too."""
    spatial = x.ndim - 2
    if w.ndim != spatial + 2:
        raise ShapeError(f"aten.convolution: weight {w} does not fit input {x}")
    if w.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ShapeError(f"aten.convolution: input {x}, weight {w} and bias {bias} must have the same dtype")
    stride, padding, dilation, output_padding = (
        list(p) * (spatial if len(p) == 1 else 1) for p in (stride, padding, dilation, output_padding)
    )
    if transposed:
        if x.shape[1] != w.shape[0]:
            raise ShapeError(f"aten.convolution: input channels {x.shape[1]} do not match weight {w}")
        channels = w.shape[1] * groups
        sizes = [
            (x.shape[2 + i] - 1) * stride[i] - 2 * padding[i] + dilation[i] * (w.shape[2 + i] - 1) + output_padding[i] + 1
            for i in range(spatial)
        ]
    else:
        if x.shape[1] != w.shape[1] * groups:
            raise ShapeError(f"aten.convolution: input {x} has {x.shape[1]} channels, weight {w} with groups={groups} expects {w.shape[1] * groups}")
        channels = w.shape[0]
        sizes = [_window(x.shape[2 + i], w.shape[2 + i], stride[i], padding[i], dilation[i]) for i in range(spatial)]
    if any(s <= 0 for s in sizes):
        raise ShapeError(f"aten.convolution: input {x} is too small for kernel {w}")
    return Aval((x.shape[0], channels, *sizes), x.dtype, x.device)


def convolution_backward(grad, x, w, bias_sizes, *args):  # noqa: ANN001, ANN201
    mask = args[-1]
    bias = Aval(tuple(bias_sizes), grad.dtype, grad.device) if bias_sizes is not None else None
    return tuple(a if m else None for a, m in zip((x, w, bias), mask))

# Shape rules: op -> rule(*args with Avals, **kwargs) -> Aval | tuple[Aval, ...]
SHAPE: dict = {
    aten.convolution: convolution,
    aten.convolution_backward: convolution_backward,
}


# Batch rules: op -> rule(eqn, label) -> Chunked (see stagetorch/batching.py)
BATCH: dict = {
    aten.convolution: batching.per_example(outputs=("b",)),
    aten.convolution_backward: batching.per_example(outputs=("b", "sum", "sum")),
}


# FLOP rules: op -> rule(eqn) -> int (see stagetorch/flops.py)
FLOPS: dict = {
    aten.convolution: flops.conv_rule,
    aten.convolution_backward: flops.conv_backward_rule,
}

"""Rules for the pooling op family."""

from __future__ import annotations

import torch

from ..errors import ShapeError
from ..interpreters import batch_rules
from ..ir import Aval, Eqn
from . import layout_rules

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

# Batch rules: op -> rule(eqn, label) -> Chunked (see stagetorch/interpreters/batching.py)
BATCH: dict = {
    **{op: batch_rules.per_example() for op in (
        aten.max_pool2d_with_indices, aten.max_pool2d_with_indices_backward, aten.max_pool3d_with_indices,
        aten.max_pool3d_with_indices_backward, aten.avg_pool2d, aten.avg_pool2d_backward, aten.avg_pool3d,
        aten.avg_pool3d_backward, aten._adaptive_avg_pool2d, aten._adaptive_avg_pool2d_backward,
        aten._adaptive_avg_pool3d, aten._adaptive_avg_pool3d_backward, aten.adaptive_max_pool2d,
        aten.adaptive_max_pool2d_backward, aten.max_unpool2d,
    )},
    # Upsampling: per-example; the backward's input_size (argument 2) is the input's full size, batch
    # included, and is cut to the chunk with it.
    **{getattr(aten, name): batch_rules.per_example() for name in _UPSAMPLE},
    **{getattr(aten, name + "_backward"): batch_rules.per_example(size_list_args=(2,)) for name in _UPSAMPLE},
}



# -- Workspace: what the CPU kernels allocate inside themselves ---------------------------------------------
#
# Measured at the allocator on torch 2.13's CPU build (tests/ops/test_workspace.py), following the arguments'
# strides where the IR knows them (stagetorch.interpreters.memory.Layouts); an argument of unknown strides counts as copied.


def _copied(v: object, strides: tuple[int, ...] | None, fmt: torch.memory_format) -> int:
    """The bytes ``.contiguous(fmt)`` of ``v`` (laid out as ``strides``) copies."""
    return 0 if layout_rules.dense_in(v.aval.shape, strides, fmt) else v.aval.nbytes


def pool_backward_workspace(indices: int | None = None):  # noqa: ANN201
    """A 2-d pooling backward (avg_pool2d_backward, max_pool2d_with_indices_backward; ``indices``: the
    argument holding max pooling's indices). The kernel runs in the memory format the output gradient
    suggests; the input gradient, allocated in the input's, and the indices (laid out as the forward's
    output, in the input's format) are made dense in it: a copy of each laid out otherwise (a contiguous
    gradient reaching a channels-last activation's pooling, or the reverse), the input gradient's written
    back."""

    def rule(e: Eqn, layouts) -> int:  # noqa: ANN001
        grad, x = e.args[0], e.args[1]
        if x.aval.device.type != "cpu" or x.aval.ndim != 4:
            return 0
        fmt = layout_rules.suggested(grad, layouts)
        x_fmt = layout_rules.suggested(x, layouts)
        if fmt is None or x_fmt is None:  # unknown: counted as copied
            return x.aval.nbytes + grad.aval.nbytes + (e.args[indices].aval.nbytes if indices is not None else 0)
        out = _copied(x, layout_rules.dense_strides(x.aval.shape, x_fmt), fmt)  # the input gradient
        out += _copied(grad, layout_rules.strides_of(grad, layouts), fmt)
        if indices is not None:
            out += _copied(e.args[indices], layout_rules.strides_of(e.args[indices], layouts), fmt)
        return out

    rule.reads_layouts = True  # type: ignore[attr-defined]
    return rule


def upsample_nearest_workspace(e: Eqn, layouts) -> int:  # noqa: ANN001
    """Nearest upsampling, forward. A 2-d one over a channels-last input of more than 3 channels, or whose
    output's height and width add up to 128 or less, runs the vectorized channels-last kernel: an input laid
    out otherwise is copied channels-last, and the output computed channels-last and copied into the tensor
    returned (allocated in the input's format). Otherwise (1-d and 3-d too, but for a channels-last 3-d input
    of more than 3 channels) the generic kernel makes an index and a weight per output position along each
    spatial dim."""
    x, out = e.args[0], e.outvars[0]
    if x.aval.device.type != "cpu":
        return 0
    spatial = x.aval.ndim - 2
    strides = layout_rules.strides_of(x, layouts)
    fmt = torch.channels_last if spatial == 2 else torch.channels_last_3d
    wide = x.aval.shape[1] > 3 and spatial in (2, 3) and bool(layout_rules.dense_in(x.aval.shape, strides, fmt))
    if wide or (spatial == 2 and sum(out.aval.shape[2:]) <= 128):
        if spatial != 2 and not wide:
            return 0
        x_fmt = layout_rules.suggested(x, layouts) or torch.contiguous_format
        copied = _copied(x, strides, fmt)
        return copied + _copied(out, layout_rules.dense_strides(out.aval.shape, x_fmt), fmt)
    return sum(out.aval.shape[2:]) * (8 + x.aval.itemsize)


upsample_nearest_workspace.reads_layouts = True  # type: ignore[attr-defined]

WORKSPACE: dict = {
    aten.avg_pool2d_backward: pool_backward_workspace(),
    aten.max_pool2d_with_indices_backward: pool_backward_workspace(indices=7),
    **{getattr(aten, name): upsample_nearest_workspace for name in (
        "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
        "_upsample_nearest_exact1d", "_upsample_nearest_exact2d", "_upsample_nearest_exact3d",
    )},
}

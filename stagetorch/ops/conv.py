"""Rules for the conv op family: shape, batch, FLOP and workspace rules of ``aten.convolution`` and its backward.

The workspace rules decide which CPU kernel torch runs (ATen's ``ConvParams::use_mkldnn``, NNPACK), count the
copies torch makes of the operands before it and the native kernels' column buffers; what oneDNN's kernels book
inside themselves is replayed in :mod:`stagetorch.ops.kernels.onednn_conv`. This module knows the IR, the
layouts of the operands and the registry's tables; it does not replay oneDNN's blocking.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import ShapeError
from ..interpreters import batch_rules, flops
from ..ir import Aval, Eqn
from . import layout_rules
from .kernels import cuda_conv, onednn_conv

aten = torch.ops.aten


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
        sizes = [onednn_conv.window(x.shape[2 + i], w.shape[2 + i], stride[i], padding[i], dilation[i]) for i in range(spatial)]
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


# Batch rules: op -> rule(eqn, label) -> Chunked (see stagetorch/interpreters/batching.py)
BATCH: dict = {
    aten.convolution: batch_rules.per_example(outputs=("b",)),
    aten.convolution_backward: batch_rules.per_example(outputs=("b", "sum", "sum")),
}


# FLOP rules: op -> rule(eqn) -> int (see stagetorch/interpreters/flops.py)
FLOPS: dict = {
    aten.convolution: flops.conv_rule,
    aten.convolution_backward: flops.conv_backward_rule,
}


# -- Workspace: what the CPU kernels allocate inside themselves ---------------------------------------------
#
# Measured at the allocator (profiler allocation events) on torch 2.13's CPU build, float32, contiguous NCHW /
# NCDHW tensors; tests/ops/test_workspace.py holds each formula to the measured excess of the op alone. Two
# kernels run a CPU convolution, chosen as ConvParams::use_mkldnn chooses (_uses_mkldnn below):
#
# - the native one (slow_conv2d / slow_conv3d) unfolds its input into a column buffer of
#   (N, C_in * prod(kernel), prod(output spatial)) elements, forward and backward alike (none for a 1x1
#   kernel with stride 1 and no padding);
# - oneDNN reorders into channel-blocked layouts (channels padded to the vector width: 16 floats on AVX-512,
#   8 on AVX2): the weight (output channels padded), the input when it has a block of channels or more
#   (or the kernel is 1x1),
#   and the output, which is then reordered into the tensor returned. Its backward reorders the output
#   gradient again; the weight gradient runs one of five kernels (onednn_conv._weight_gradient_kernel; grouped and
#   depthwise ones: onednn_conv.grouped_weight_gradient), each with its scratchpad, their thread splits replayed
#   (onednn_conv._jit_scratchpad): the allocator's to 2% over 767 measured shapes at 1-3 threads, either layout. A strided
#   convolution's input gradient runs another kernel, channels-last inside (onednn_conv.strided_data), exact at the
#   allocator; a grouped one one of three (onednn_conv.grouped_data).
#   Which kernels run depends on oneDNN's ISA (onednn_conv.ISAS, onednn_conv.onednn_isa): the rules were measured on AVX-512 (Intel
#   Sapphire Rapids) and AVX2 (AMD EPYC; onednn_conv._forward_avx2, jit_avx2_1x1's weight gradient, brgemm's blocks bounded):
#   never under the allocator on tools/grids/conv_weight_grad_grid.py's grids there (docs/history/results-log.md).
# - without oneDNN, a 2-d forward of 16 examples or more runs NNPACK, whose buffers torch does not hand out;
#   the backward then unfolds fewer examples at once than the column buffer counted (an over-estimate).
#
# On CUDA, cuDNN picks an algorithm whose workspace PyTorch caps only through CUDNN_CONV_WSCAP_DBG; nothing
# here models it (unmeasured: no GPU in this project's CI). It lives in the plan's safety margin.


def _uses_mkldnn(x: Aval, w: Aval, stride, dilation, transposed, groups) -> bool:  # noqa: ANN001
    """Whether torch runs this CPU convolution with oneDNN (ConvParams::use_mkldnn, torch 2.13). Without
    oneDNN, a forward that no gradient will follow may run NNPACK from 16 examples, which allocates
    outside torch's allocator: the column buffer counted then is an over-estimate."""
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled) or x.dtype != torch.float32:
        return False
    strided = any(s != 1 for s in stride)
    dilated = any(d != 1 for d in dilation)
    one_by_one = w.shape[-1] == 1 and w.shape[-2] == 1
    threads = torch.get_num_threads()
    if not (strided or dilated or x.shape[0] >= 16 or not one_by_one or threads > 1):
        return False
    return groups > 1 or (w.shape[-1] > 3 and w.shape[-2] > 3) or x.shape[0] > 1 or math.prod(x.shape[:4]) > 20480


def _uses_nnpack(x: Aval, w: Aval, padding) -> bool:  # noqa: ANN001
    """Whether a native 2-d forward runs NNPACK (ConvParams::use_nnpack), whose buffers torch's allocator
    does not hand out (a grouped one copies each group's input)."""
    return (
        torch._nnpack_available() and x.ndim == 4 and x.shape[0] >= 16 and x.dtype == torch.float32
        and all(k < 17 and p < k for k, p in zip(w.shape[2:], padding))
    )


def _columns(x: Aval, w: Aval, out: Aval, stride, padding, transposed, groups, backward, grad_input, slices=None) -> int:  # noqa: ANN001
    """The native kernels' column buffers (and, grouped, the copies of a group's slices: ``slices``, see
    :func:`_group_slices`; None: as for contiguous tensors)."""
    kernel = math.prod(w.shape[2:])
    if not (transposed or backward) and _uses_nnpack(x, w, padding):
        return x.nbytes if groups > 1 else 0
    if transposed:
        # Columns of the output's channels by the input's positions: the 2-d forward unfolds the whole
        # batch at once, the 3-d forward and every backward one example at a time.
        examples = 1 if backward or x.ndim == 5 else x.shape[0]
        ones = math.prod(out.shape[2:]) * x.itemsize if x.ndim == 5 and not backward else 0  # the bias's ones
        return examples * w.shape[1] * kernel * math.prod(x.shape[2:]) * x.itemsize + ones
    if slices is None:
        # A group's channels of one contiguous example are contiguous: of several, copied.
        slices = (2 if backward else 1) * x.nbytes // groups if groups > 1 and x.shape[0] > 1 else 0
    if kernel == 1 and all(s == 1 for s in stride) and all(p == 0 for p in padding):
        # No columns; the 3-d backward still makes an input-sized buffer.
        return slices + (x.nbytes if grad_input and x.ndim == 5 else 0)
    return x.shape[0] * w.shape[1] * kernel * math.prod(out.shape[2:]) * x.itemsize + slices


def _input_gradient_columns(x: Aval, w: Aval, grad: Aval) -> int:
    """The native 2-d kernel's input gradient unfolds one example at a time into a buffer of each thread's own,
    one example's columns (whatever the kernel's size, 1x1 included), made with ``std::make_unique``
    (``slow_conv2d_backward_out_cpu_template``, ATen's ConvolutionMM2d.cpp): from plain ``malloc``, never
    torch's allocator, so the profiler does not see it (tests/ops/test_workspace.py measures it at ``malloc``;
    tests/support/memtrack.AllocatorPeak adds it to the profiler's reading). One buffer per thread that has examples,
    at most, when all of them run at once; a grouped convolution runs a group at a time (``w`` is a group's
    weight: its columns)."""
    examples = min(torch.get_num_threads(), x.shape[0])
    return examples * w.shape[1] * math.prod(w.shape[2:]) * math.prod(grad.shape[2:]) * x.itemsize


def _group_slices(e: Eqn, backward: bool, layouts: Any) -> int | None:
    """A grouped native convolution runs group by group (``subtensor`` in ATen's Convolution.cpp): each
    group's slice of the input's channels (and, backward, of the output gradient's) is made dense in the
    memory format its tensor suggests, a copy where the slice is not (every slice of several examples, any
    of a channels-last tensor); the kernel then makes each slice dense in the format it runs in (channels-last
    where the input's slice or the weight's suggests it), a second copy of a slice laid out otherwise (a
    contiguous gradient reaching a channels-last activation's convolution). Slices are copied one group at a
    time. None where the strides are unknown."""
    grad, x, w = (e.args[0], e.args[1], e.args[2]) if backward else (None, e.args[0], e.args[1])
    groups = _groups(e, backward)
    slices: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}  # name -> (slice shape, its strides)
    out = 0
    for name, v in (("x", x), ("grad", grad)):
        if v is None:
            continue
        strides = layout_rules.strides_of(v, layouts)
        if v is x and x.aval.ndim == 3:  # a 1-d convolution's input is made contiguous whole first
            strides = layout_rules.dense_strides(x.aval.shape, torch.contiguous_format)
        if strides is None:
            return None
        fmt = layout_rules.suggested(v, layouts) if v.aval.ndim != 3 else torch.contiguous_format
        shape = (v.aval.shape[0], v.aval.shape[1] // groups, *v.aval.shape[2:])
        if not layout_rules.dense_in(shape, strides, fmt):
            out += v.aval.nbytes // groups
            strides = layout_rules.dense_strides(shape, fmt)
        slices[name] = (shape, strides)
    kernel = torch.contiguous_format
    if x.aval.ndim == 4:
        shape, strides = slices["x"]
        meta = torch.empty_strided(shape, strides, device="meta")
        w_strides = layout_rules.strides_of(w, layouts)
        w_shape = (w.aval.shape[0] // groups, *w.aval.shape[1:])
        w_meta = torch.empty_strided(w_shape, w_strides, device="meta") if w_strides is not None else None
        if _suggests_channels_last(meta) or (w_meta is not None and _suggests_channels_last(w_meta)):
            kernel = torch.channels_last
    for shape, strides in slices.values():
        if not layout_rules.dense_in(shape, strides, kernel):
            out += math.prod(shape) * x.aval.itemsize
    return out


def _suggests_channels_last(t: torch.Tensor) -> bool:
    return layout_rules.suggested_of(t) in layout_rules.CHANNELS_LAST


def _as_2d(a: Aval) -> Aval:
    """A 1-d convolution's tensor as the 2-d one torch runs (a unit height)."""
    return Aval((*a.shape[:2], 1, *a.shape[2:]), a.dtype, a.device)


def _geometry(e: Eqn, backward: bool) -> tuple:
    a = e.args
    if backward:
        out, x, w = (v.aval for v in a[:3])
        stride, padding, dilation, transposed, _, groups, mask = a[4:11]
    else:
        x, w, out = a[0].aval, a[1].aval, e.outvars[0].aval
        stride, padding, dilation, transposed, _, groups = a[3:9]
        mask = (True, True, True)
    if x.ndim == 3:
        out, x, w = _as_2d(out), _as_2d(x), _as_2d(w)
        stride, padding, dilation = [1, *stride], [0, *padding], [1, *dilation]
    return out, x, w, stride, padding, dilation, transposed, groups, mask


def _copies(e: Eqn, backward: bool, mkldnn: bool, layouts: Any) -> tuple[int, bool]:
    """What torch copies before the kernel runs: the input, the weight and (backward) the output gradient
    are made dense in the memory format the kernel runs in (``_determine_backend_memory_format``):
    channels-last where the input or the weight suggests it, for oneDNN and for the native 2-d kernel; else
    contiguous (the native 3-d kernel always, and 1-d convolutions, run as 2-d ones of unit height). Returns
    the bytes copied and whether the kernel runs channels-last. An argument of unknown strides counts as
    the rule counted it before strides were known: dense, but a 1-d convolution's input and output gradient
    copied."""
    grad, x, w = (e.args[:3] if backward else (None, e.args[0], e.args[1]))
    one_d = x.aval.ndim == 3
    channels_last = not one_d and (mkldnn or x.aval.ndim == 4) and (
        layout_rules.suggested(x, layouts) in layout_rules.CHANNELS_LAST or layout_rules.suggested(w, layouts) in layout_rules.CHANNELS_LAST
    )
    if channels_last:
        fmt = torch.channels_last if x.aval.ndim == 4 else torch.channels_last_3d
    else:
        fmt = torch.contiguous_format
    copied = 0
    # A grouped native convolution copies its input and output gradient a group's slice at a time (above).
    # (A 1-d one's input is first made contiguous whole.)
    sliced = not mkldnn and _groups(e, backward) > 1 and not _transposed(e, backward)
    for v in (x, w, grad):
        if v is None or (sliced and (v is grad or (v is x and not one_d))):
            continue
        dense = layout_rules.dense_in(v.aval.shape, layout_rules.strides_of(v, layouts), fmt)
        if dense is False or (dense is None and one_d and v is not w):
            copied += v.aval.nbytes
    return copied, channels_last


def _groups(e: Eqn, backward: bool) -> int:
    return e.args[9] if backward else e.args[8]


def _transposed(e: Eqn, backward: bool) -> bool:
    return e.args[7] if backward else e.args[6]


def convolution_workspace(e: Eqn, layouts: Any = None) -> int:
    out, x, w, stride, padding, dilation, transposed, groups, _ = _geometry(e, backward=False)
    if x.device.type == "cuda":
        return cuda_conv.forward_workspace(x, out)
    if x.device.type != "cpu":
        return 0
    mkldnn = _uses_mkldnn(x, w, stride, dilation, transposed, groups)
    copies, channels_last = _copies(e, False, mkldnn, layouts or _unknown)
    if not mkldnn:
        slices = _group_slices(e, False, layouts or _unknown) if groups > 1 else None
        columns = _columns(x, w, out, stride, padding, transposed, groups, False, False, slices)
        if groups > 1 and not transposed and not _uses_nnpack(x, w, padding):
            # Each group's output apart, then concatenated into the one returned: all of them at the end.
            columns = max(columns, out.nbytes)
        return copies + columns
    own = None if transposed else onednn_conv.ISAS[onednn_conv.onednn_isa()].forward(x, w, out, stride, padding, channels_last, groups)
    if own is not None:
        return copies + own
    if channels_last and groups == 1 and not transposed:
        # oneDNN's brgemm kernel reads the input and writes the output in place (channels-last both): only the
        # weight is reordered (output channels padded to the kernel's block: onednn_conv.ISAS), beside a scratchpad of a page and
        # an array of 103 batch elements of 40 bytes per thread (brgemm_convolution_utils::init_scratchpad).
        padded = onednn_conv.ISAS[onednn_conv.onednn_isa()].brgemm_output_channels(w.shape[0])
        return copies + w.nbytes * padded // w.shape[0] + 4096 + 4120 * torch.get_num_threads()
    # oneDNN over grouped channels-last tensors reorders less than the formula below counts for contiguous ones
    # (but for a few shapes: tests/ops/test_workspace.py); it stands for it, mostly an over-estimate.
    src, weight, dst, _ = onednn_conv.onednn_parts(x, w, out, groups, transposed)
    # The blocked output is reordered into the returned tensor after the input and weight copies are freed.
    return copies + max(src + weight + dst, dst + out.nbytes) - out.nbytes


def _unknown(v: Any) -> None:
    return None


def convolution_backward_workspace(e: Eqn, layouts: Any = None) -> int:
    grad, x, w, stride, padding, dilation, transposed, groups, mask = _geometry(e, backward=True)
    if x.device.type == "cuda":
        return cuda_conv.backward_workspace(grad, x)
    if x.device.type != "cpu":
        return 0
    mkldnn = _uses_mkldnn(x, w, stride, dilation, transposed, groups)
    copies, channels_last = _copies(e, True, mkldnn, layouts or _unknown)
    if not mkldnn:
        slices = _group_slices(e, True, layouts or _unknown) if groups > 1 else None
        # The 3-d 1x1 kernel's input-sized buffer is the input's contiguous copy, where it makes one.
        buffer = not (x.ndim == 5 and copies >= x.nbytes and not layout_rules.dense_in(
            x.shape, layout_rules.strides_of(e.args[1], layouts or _unknown) or layout_rules.dense_strides(x.shape, torch.contiguous_format),
            torch.contiguous_format))
        # The 2-d kernel's input gradient: one example's columns per thread, from malloc (_input_gradient_columns).
        at_malloc = _input_gradient_columns(x, w, grad) if x.ndim == 4 and not transposed and mask[0] else 0
        if groups > 1 and not transposed:
            # Each group's gradients apart, then concatenated (the 3-d kernel's input gradient always). A
            # group's input gradient takes its columns at malloc while its slices and the gradients made so far
            # are held: at most the outputs' bytes (counted apart), so the slices and the columns beyond them.
            parts = (x.nbytes if mask[0] or x.ndim == 5 else 0) + (w.nbytes if mask[1] else 0)
            parts += e.args[3][0] * x.itemsize if mask[2] and e.args[3] is not None else 0
            columns = _columns(x, w, grad, stride, padding, transposed, groups, True, False, slices)
            if not at_malloc:
                return copies + max(columns, parts)
            if slices is None:
                slices = 2 * x.nbytes // groups if x.shape[0] > 1 else 0
            # (Without the weight's gradient, no weight columns.)
            return copies + max(columns if mask[1] else 0, parts, slices + at_malloc)
        if at_malloc and not mask[1]:
            # The input gradient alone: its own buffers, not the whole batch's columns the weight gradient's take.
            return copies + at_malloc
        columns = _columns(x, w, grad, stride, padding, transposed, groups, True, mask[0] and buffer, slices)
        # With the weight's gradient, its columns come after the input gradient's (none for a 1x1 kernel), and
        # so do the weight's and the bias's gradients (outputs, counted apart): the columns beyond them.
        later = (w.nbytes if mask[1] else 0) + (e.args[3][0] * x.itemsize if mask[2] and e.args[3] is not None else 0)
        return copies + max(columns, at_malloc - later)
    b = onednn_conv.channel_block()
    src, weight, grad_blocked, weight_padded = onednn_conv.onednn_parts(x, w, grad, groups, transposed)
    grad_input = x.nbytes if mask[0] else 0
    # The input gradient: the output gradient and the weight reordered, the input gradient in blocked layout
    # (channels padded), then reordered into the tensor returned.
    data = 0
    if mask[0] and onednn_conv.strided_backward_data(x, w, stride, dilation, groups, transposed):
        # Before the weight's gradient and the bias's are made: the workspace is the excess over all three.
        later = (w.nbytes if mask[1] else 0) + (e.args[3][0] * x.itemsize if mask[2] and e.args[3] is not None else 0)
        data = onednn_conv.strided_data(x, w, grad, stride, padding, channels_last) - grad_input - later
        if x.ndim == 5 and x.shape[1] < b and not channels_last:
            # A 3-d layer of few input channels the strided kernel may refuse (its blocking, not replayed):
            # jit_avx512_common's then (below), the larger.
            blocked_input = x.nbytes * onednn_conv.pad(x.shape[1], b) // x.shape[1]
            data = max(data, max(grad_blocked + weight_padded + blocked_input, blocked_input + grad_input) - grad_input)
    elif mask[0]:
        blocked_input = x.nbytes * onednn_conv.pad(x.shape[1], b) // x.shape[1]
        data = max(grad_blocked + weight_padded + blocked_input, blocked_input + grad_input) - grad_input
        if groups > 1 and not transposed:
            data = onednn_conv.grouped_data(x, w, grad, stride, padding, channels_last, groups)
        elif channels_last and not transposed and all(s == 1 for s in stride):
            data = onednn_conv.brgemm_data(w)
    # The weight gradient, after the input gradient (an output, already held).
    if not mask[1]:
        weights = 0
    elif groups > 1:
        weights = onednn_conv.grouped_weight_gradient(x, w, grad, stride, padding, channels_last, groups, mask[2])
    else:
        weights = onednn_conv.weight_gradient(x, w, grad, stride, padding, channels_last, mask[2])
    return copies + max(data, weights)


convolution_workspace.reads_layouts = True  # type: ignore[attr-defined]
convolution_backward_workspace.reads_layouts = True  # type: ignore[attr-defined]

WORKSPACE: dict = {
    aten.convolution: convolution_workspace,
    aten.convolution_backward: convolution_backward_workspace,
}

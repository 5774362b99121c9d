"""Rules for the conv op family."""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import batching, flops
from ..errors import ShapeError
from ..ir import Aval, Eqn
from . import _layout

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


# -- Workspace: what the CPU kernels allocate inside themselves ---------------------------------------------
#
# Measured at the allocator (profiler allocation events) on torch 2.13's CPU build, float32, contiguous NCHW /
# NCDHW tensors; tests/test_workspace.py holds each formula to the measured excess of the op alone. Two
# kernels run a CPU convolution, chosen as ConvParams::use_mkldnn chooses (_uses_mkldnn below):
#
# - the native one (slow_conv2d / slow_conv3d) unfolds its input into a column buffer of
#   (N, C_in * prod(kernel), prod(output spatial)) elements, forward and backward alike (none for a 1x1
#   kernel with stride 1 and no padding);
# - oneDNN reorders into channel-blocked layouts (channels padded to the vector width: 16 floats on AVX-512,
#   8 on AVX2): the weight (output channels padded), the input when it has a block of channels or more
#   (or the kernel is 1x1),
#   and the output, which is then reordered into the tensor returned. Its backward reorders the output
#   gradient again; the weight gradient runs one of five kernels (_weight_gradient_kernel), each with its
#   scratchpad: exact for gemm and for the jit kernels at one thread, a bound from above where the jit kernels
#   split threads over the batch (never under the allocator over 710 measured shapes; grouped and depthwise
#   ones the costlier of two kernels: _grouped_weight_gradient). A strided convolution's input gradient runs another kernel,
#   channels-last inside (_strided_data), exact at the allocator.
# - without oneDNN, a 2-d forward of 16 examples or more runs NNPACK, whose buffers torch does not hand out;
#   the backward then unfolds fewer examples at once than the column buffer counted (an over-estimate).
#
# On CUDA, cuDNN picks an algorithm whose workspace PyTorch caps only through CUDNN_CONV_WSCAP_DBG; nothing
# here models it (unmeasured: no GPU in this project's CI). It lives in the plan's safety margin.


def _block() -> int:
    """oneDNN's channel block: the floats in one vector register."""
    return 16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 8


def _pad(c: int, block: int) -> int:
    return -(-c // block) * block


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
    torch's allocator, so the profiler does not see it (tests/test_workspace.py measures it at ``malloc``;
    tests/memtrack.AllocatorPeak adds it to the profiler's reading). One buffer per thread that has examples,
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
        strides = _layout.strides_of(v, layouts)
        if v is x and x.aval.ndim == 3:  # a 1-d convolution's input is made contiguous whole first
            strides = _layout.dense_strides(x.aval.shape, torch.contiguous_format)
        if strides is None:
            return None
        fmt = _layout.suggested(v, layouts) if v.aval.ndim != 3 else torch.contiguous_format
        shape = (v.aval.shape[0], v.aval.shape[1] // groups, *v.aval.shape[2:])
        if not _layout.dense_in(shape, strides, fmt):
            out += v.aval.nbytes // groups
            strides = _layout.dense_strides(shape, fmt)
        slices[name] = (shape, strides)
    kernel = torch.contiguous_format
    if x.aval.ndim == 4:
        shape, strides = slices["x"]
        meta = torch.empty_strided(shape, strides, device="meta")
        w_strides = _layout.strides_of(w, layouts)
        w_shape = (w.aval.shape[0] // groups, *w.aval.shape[1:])
        w_meta = torch.empty_strided(w_shape, w_strides, device="meta") if w_strides is not None else None
        if _suggests_channels_last(meta) or (w_meta is not None and _suggests_channels_last(w_meta)):
            kernel = torch.channels_last
    for shape, strides in slices.values():
        if not _layout.dense_in(shape, strides, kernel):
            out += math.prod(shape) * x.aval.itemsize
    return out


def _suggests_channels_last(t: torch.Tensor) -> bool:
    return _layout.suggested_of(t) in _layout.CHANNELS_LAST


def _onednn_parts(x: Aval, w: Aval, out: Aval, groups: int, transposed: bool) -> tuple[int, int, int, int]:
    """oneDNN's reordered copies: (input, weight, output in blocked layout, weight for the backward)."""
    b = _block()
    c_in, c_out = x.shape[1], out.shape[1]
    # A first layer's few channels are read in place, except by a 1x1 kernel.
    src = x.nbytes * _pad(c_in, b) // c_in if c_in >= b or math.prod(w.shape[2:]) == 1 else 0
    pad_out = _pad(c_out, b) / c_out
    weight = w.nbytes if groups > 1 else int(w.nbytes * pad_out * (_pad(c_in, b) / c_in if c_in >= b else 1))
    weight_backward = w.nbytes if groups > 1 else int(w.nbytes * pad_out * _pad(c_in, b) / c_in)
    if transposed:  # flipped and then blocked
        weight *= 2
    return src, weight, int(out.nbytes * pad_out), weight_backward


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
        _layout.suggested(x, layouts) in _layout.CHANNELS_LAST or _layout.suggested(w, layouts) in _layout.CHANNELS_LAST
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
        dense = _layout.dense_in(v.aval.shape, _layout.strides_of(v, layouts), fmt)
        if dense is False or (dense is None and one_d and v is not w):
            copied += v.aval.nbytes
    return copied, channels_last


def _groups(e: Eqn, backward: bool) -> int:
    return e.args[9] if backward else e.args[8]


def _transposed(e: Eqn, backward: bool) -> bool:
    return e.args[7] if backward else e.args[6]


def convolution_workspace(e: Eqn, layouts: Any = None) -> int:
    out, x, w, stride, padding, dilation, transposed, groups, _ = _geometry(e, backward=False)
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
    if channels_last and groups == 1 and not transposed:
        # oneDNN's brgemm kernel reads the input and writes the output in place (channels-last both): only the
        # weight is reordered (output channels padded to the vector width), beside a scratchpad of a page and
        # an array of 103 batch elements of 40 bytes per thread (brgemm_convolution_utils::init_scratchpad).
        return copies + w.nbytes * _pad(w.shape[0], _block()) // w.shape[0] + 4096 + 4120 * torch.get_num_threads()
    # oneDNN over grouped channels-last tensors reorders less than the formula below counts for contiguous ones
    # (but for a few shapes: tests/test_workspace.py); it stands for it, mostly an over-estimate.
    src, weight, dst, _ = _onednn_parts(x, w, out, groups, transposed)
    # The blocked output is reordered into the returned tensor after the input and weight copies are freed.
    return copies + max(src + weight + dst, dst + out.nbytes) - out.nbytes


def _unknown(v: Any) -> None:
    return None


def _strided_backward_data(x: Aval, w: Aval, stride, dilation, groups: int, transposed: bool) -> bool:  # noqa: ANN001
    """Whether oneDNN computes this input gradient with its strided brgemm kernel (brgconv_strided): the first
    of the f32 backward-data kernels that accepts a stride above 1, undilated, but for a grouped convolution of
    a vector's worth of output channels per group or fewer."""
    return (
        not transposed and any(s != 1 for s in stride) and all(d == 1 for d in dilation)
        and (groups == 1 or w.shape[0] // groups > _block())
    )


def _strided_data(x: Aval, w: Aval, grad: Aval, stride, padding, channels_last: bool) -> int:  # noqa: ANN001
    """The input gradient's peak under oneDNN's strided brgemm kernel, which works channels-last (nxc): the
    output gradient and the weight (input channels padded) reordered, the input gradient channels-last and the
    kernel's scratchpad; then ``mkldnn_to_dense`` copies the channels-last result out whole and makes that copy
    contiguous (``.contiguous()`` of a channels-last tensor: a clone), three input gradients at once. Over
    channels-last tensors the kernel reads the output gradient and writes the input gradient returned in place:
    the weight and the scratchpad beside it are all.

    The scratchpad (oneDNN's brgemm_convolution_bwd_utils::init_scratchpad, f32) books per thread the output
    gradient of one example, padded where the kernel overhangs the input, in pages of 4096 elements; an array
    of batch elements (40 bytes each, a page's worth or more) and a page of masks; where the input's width is
    not a multiple of the stride, a row of the input gradient (the rule takes the kernel's block of the row to
    be all of it) times the stride; each booking 4096-byte aligned."""
    spatial = x.ndim - 2
    ins, outs, kernel = x.shape[2:], grad.shape[2:], w.shape[2:]
    padded = 1
    for i in range(spatial):
        s, p, k = stride[i], padding[i], kernel[i]
        far = (outs[i] - 1) * s + k - ins[i] - p  # the padding oneDNN infers at the far end
        padded *= outs[i] + max(0, k - 1 - p) // s + max(0, k - 1 - far) // s
    page, element = 4096, 40
    batch = -(-_pad(math.prod(kernel) * element, page) // element) * element
    per_thread = _pad(padded * w.shape[0], page) * grad.itemsize + batch + page
    bookings = 3
    if ins[-1] % stride[-1]:
        per_thread += _pad(_pad(ins[-1], stride[-1]) * stride[-1] * x.shape[1], page) * x.itemsize
        bookings += 1
    scratchpad = torch.get_num_threads() * per_thread + bookings * page
    weight = w.nbytes * _pad(w.shape[1], _block()) // w.shape[1]  # a group's input channels padded
    if channels_last:
        return weight + x.nbytes + scratchpad
    return max(grad.nbytes + weight + x.nbytes + scratchpad, 3 * x.nbytes)


def _weight_gradient_kernel(x: Aval, w: Aval, stride, padding, channels_last: bool) -> str:  # noqa: ANN001
    """Which of oneDNN's f32 backward-weights kernels runs an ungrouped convolution (the first of
    cpu_convolution_list's that accepts it, on AVX-512): ``1x1`` (jit_avx512_common_1x1: a 1x1 kernel without
    padding, strided only in 1-d and 2-d), ``first`` (jit_avx512_common's first-layer kernel: up to 3 input
    channels, or fewer than a block channels-last; the input read in place, the weight's output channels
    padded), ``avx2`` (jit_avx2, blocks of 8: 4-15 input channels, no padding in depth), ``gemm``
    (gemm_convolution, plain layouts: a 3-d one of 4-15 input channels padded in depth) or ``blocked``
    (jit_avx512_common, channels padded to the block)."""
    c, kernel, spatial = x.shape[1], w.shape[2:], x.ndim - 2
    if math.prod(kernel) == 1 and all(p == 0 for p in padding) and (spatial < 3 or all(s == 1 for s in stride)):
        return "1x1"
    for i in range(spatial):
        # The jit kernels' padding limits (boundaries_ok): none past half the kernel but along the width, and a
        # kernel within the padded input; else the gemm kernel.
        out = _window(x.shape[2 + i], kernel[i], stride[i], padding[i], 1)
        far = (out - 1) * stride[i] + kernel[i] - x.shape[2 + i] - padding[i]
        if (i < spatial - 1 and max(padding[i], far) > kernel[i] // 2) or kernel[i] >= x.shape[2 + i] + padding[i] > x.shape[2 + i]:
            return "gemm or avx2"  # jit_avx2's limits differ (not replayed): the costlier of the two
    if channels_last:
        return "first" if c < _block() else "blocked"
    if c <= 3:
        return "first"
    if c < _block():
        if spatial == 3:
            depth_out = _window(x.shape[2], kernel[0], stride[0], padding[0], 1)
            far = (depth_out - 1) * stride[0] + kernel[0] - x.shape[2] - padding[0]
            if padding[0] > 0 or far > 0:
                return "gemm"
        return "avx2"
    return "blocked"


def _weight_gradient(x: Aval, w: Aval, grad: Aval, stride, padding, channels_last: bool, bias: bool) -> int:  # noqa: ANN001
    """The weight gradient's workspace under oneDNN (groups 1, f32), over the weight's and the bias's gradients
    returned. ideep reorders the input and the output gradient into the layout the kernel picked (channels
    padded to its block; none channels-last, and a first layer's input is read in place), computes the weight
    gradient in the kernel's layout (padded) and the bias gradient beside a scratchpad, and then copies both
    into the tensors returned while its own are alive (channels-last, the weight gradient is copied dense and
    then channels-last: three weights at once).

    The scratchpad follows the kernel's ``init_scratchpad`` (each booking 128 bytes over its size): the gemm
    kernel's is exact (per thread when it threads over examples: a column buffer of one depth slice and the
    weight's reduction, booked as 4 bytes per byte of weight). The jit kernels' reduction buffers depend on how
    ``balance()`` splits the threads, which is not replayed: the rule takes every thread to reduce over the
    batch (a padded weight and bias per thread beyond the first) and a bias reducer of 8 KiB per thread and
    8 KiB more (the most measured: 24 KiB at 2-3 threads), a bound from above; a strided 1x1 kernel's input
    compacted to unit stride, per thread, is counted whole. At one thread the jit kernels have no reduction
    and the rule is exact but for the 1x1 kernel's compacted input (a bound)."""
    layouts = (True, False) if channels_last and x.shape[1] == 1 else (channels_last,)
    # One input channel: channels-last and contiguous are the same strides; which one torch and oneDNN take is
    # not followed: the costlier. jit_avx2's padding limits are not replayed either: the costlier of it and gemm.
    out = 0
    for layout in layouts:
        kind = _weight_gradient_kernel(x, w, stride, padding, layout)
        for k in ("gemm", "avx2") if kind == "gemm or avx2" else (kind,):
            out = max(out, _weight_gradient_as(k, x, w, grad, stride, padding, layout, bias))
    return out


def _weight_gradient_as(kind: str, x: Aval, w: Aval, grad: Aval, stride, padding, channels_last, bias: bool, groups: int = 1) -> int:  # noqa: ANN001
    threads = torch.get_num_threads()
    n, c, o = x.shape[0], x.shape[1], w.shape[0]
    c_g, o_g = c // groups, o // groups
    kernel, itemsize = math.prod(w.shape[2:]), x.itemsize
    weight, bias_bytes = w.nbytes, o * itemsize if bias else 0
    if kind == "gemm" and channels_last:
        # gemm's channels-last variant: per thread a column buffer and a transposed input of all positions
        # and a reduction weight (4 bytes booked per byte), threads taken all.
        columns = c * kernel * math.prod(grad.shape[2:]) * itemsize
        scratchpad = threads * (columns + x.nbytes // n + 4 * weight) + 3 * 128
        blocked, copies = weight, 0
    elif kind == "gemm":
        rows = math.prod(grad.shape[-2:])  # a depth slice's output positions
        unfolded = any(s != 1 for s in stride) or any(p != 0 for p in padding) or kernel != 1
        columns = c_g * kernel * rows * itemsize if unfolded else 0
        limit = min(1 << 30, 15 * threads * (x.nbytes + weight + grad.nbytes))
        estimate = threads * (4 * weight + c_g * kernel * 16 * itemsize)
        per_example = rows / threads < 256 and (n != 1 or groups > 2) and estimate < limit
        nthr = threads if per_example else 1
        scratchpad = nthr * columns + (128 if columns else 0) + nthr * 4 * weight + 128
        blocked, copies = weight, 0
    elif kind == "depthwise":  # channels blocked across groups
        b = _block()
        blocked = _pad(c, b) * kernel * itemsize
        copies = 0 if channels_last else x.nbytes * _pad(c, b) // c + grad.nbytes * _pad(o, b) // o
        scratchpad = (threads - 1) * (blocked + _pad(o, b) * itemsize) + 512 * threads
    elif kind in ("grouped", "grouped8"):  # each group's channels padded to the block
        b = 8 if kind == "grouped8" else _block()
        blocked = groups * _pad(o_g, b) * _pad(c_g, b) * kernel * itemsize
        src = x.nbytes // c * groups * _pad(c_g, b)
        dst = grad.nbytes // o * groups * _pad(o_g, b)
        copies = 0 if channels_last else src + dst
        padded_bias = groups * _pad(o_g, b) * itemsize
        scratchpad = (padded_bias + 128 if bias and o_g % b else 0)
        if threads > 1:
            scratchpad += (threads - 1) * (blocked + padded_bias) + 8192 * (threads + 1)
    else:
        b = 8 if kind == "avx2" else _block()
        c_in = c if kind == "first" else _pad(c, b)
        blocked = _pad(o, b) * c_in * kernel * itemsize
        src = 0 if channels_last or kind == "first" else x.nbytes * _pad(c, b) // c
        dst = 0 if channels_last else grad.nbytes * _pad(o, b) // o
        copies = src + dst
        padded_bias = _pad(o, b) * itemsize
        scratchpad = (_pad(o, b) * itemsize + 128 if bias and o % b else 0)
        if threads > 1:
            scratchpad += (threads - 1) * (blocked + padded_bias) + 8192 * (threads + 1)
        if kind == "1x1" and any(s != 1 for s in stride):
            scratchpad += threads * _pad(c, b) * math.prod(grad.shape[2:]) * itemsize + 128
    compute = copies + blocked + bias_bytes + scratchpad
    # Channels-last, the weight gradient is copied out dense and then made channels-last.
    end = blocked + bias_bytes + weight + bias_bytes + (weight if channels_last else 0)
    return max(compute, end) - weight - bias_bytes


def _grouped_weight_gradient(x: Aval, w: Aval, grad: Aval, stride, padding, channels_last: bool, groups: int, bias: bool) -> int:  # noqa: ANN001
    """A grouped or depthwise weight gradient's workspace under oneDNN. Contiguous: jit_avx512_common_dw for a
    depthwise 1-d or 2-d one (channels blocked across groups), the grouped jit kernels where each group's
    channels are a multiple of 16 (jit_avx512_common) or 8 (jit_avx2), else gemm per group; channels-last, the
    grouped jit kernel with each group's channels padded to 16 (a depthwise 3x3x3 layer's weight gradient 256
    times its size). Their fallbacks are not replayed: the rule takes the costlier of the kernel and gemm."""
    c_g, o_g = x.shape[1] // groups, w.shape[0] // groups
    depthwise = c_g == o_g == 1
    if channels_last:
        kinds = ["grouped", "gemm"] + (["depthwise"] if depthwise else [])
    elif depthwise:
        kinds = ["depthwise", "gemm"] if x.ndim < 5 else ["gemm"]
    elif c_g % _block() == 0 and o_g % _block() == 0:
        kinds = ["grouped", "gemm"]
    elif c_g % 8 == 0 and o_g % 8 == 0:
        kinds = ["grouped8", "gemm"]
    else:
        kinds = ["gemm"]
    return max(_weight_gradient_as(k, x, w, grad, stride, padding, channels_last, bias, groups) for k in kinds)


def convolution_backward_workspace(e: Eqn, layouts: Any = None) -> int:
    grad, x, w, stride, padding, dilation, transposed, groups, mask = _geometry(e, backward=True)
    if x.device.type != "cpu":
        return 0
    mkldnn = _uses_mkldnn(x, w, stride, dilation, transposed, groups)
    copies, channels_last = _copies(e, True, mkldnn, layouts or _unknown)
    if not mkldnn:
        slices = _group_slices(e, True, layouts or _unknown) if groups > 1 else None
        # The 3-d 1x1 kernel's input-sized buffer is the input's contiguous copy, where it makes one.
        buffer = not (x.ndim == 5 and copies >= x.nbytes and not _layout.dense_in(
            x.shape, _layout.strides_of(e.args[1], layouts or _unknown) or _layout.dense_strides(x.shape, torch.contiguous_format),
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
    b = _block()
    src, weight, grad_blocked, weight_padded = _onednn_parts(x, w, grad, groups, transposed)
    grad_input = x.nbytes if mask[0] else 0
    # The input gradient: the output gradient and the weight reordered, the input gradient in blocked layout
    # (channels padded), then reordered into the tensor returned.
    data = 0
    if mask[0] and _strided_backward_data(x, w, stride, dilation, groups, transposed):
        # Before the weight's gradient and the bias's are made: the workspace is the excess over all three.
        later = (w.nbytes if mask[1] else 0) + (e.args[3][0] * x.itemsize if mask[2] and e.args[3] is not None else 0)
        data = _strided_data(x, w, grad, stride, padding, channels_last) - grad_input - later
    elif mask[0]:
        blocked_input = x.nbytes * _pad(x.shape[1], b) // x.shape[1]
        data = max(grad_blocked + weight_padded + blocked_input, blocked_input + grad_input) - grad_input
    # The weight gradient, after the input gradient (an output, already held).
    if not mask[1]:
        weights = 0
    elif groups > 1:
        weights = _grouped_weight_gradient(x, w, grad, stride, padding, channels_last, groups, mask[2])
    else:
        weights = _weight_gradient(x, w, grad, stride, padding, channels_last, mask[2])
    return copies + max(data, weights)


convolution_workspace.reads_layouts = True  # type: ignore[attr-defined]
convolution_backward_workspace.reads_layouts = True  # type: ignore[attr-defined]

WORKSPACE: dict = {
    aten.convolution: convolution_workspace,
    aten.convolution_backward: convolution_backward_workspace,
}

"""Rules for the conv op family."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..errors import ShapeError
from ..interpreters import batch_rules, flops
from ..ir import Aval, Eqn
from . import layout_rules, linalg

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


# Batch rules: op -> rule(eqn, label) -> Chunked (see stagetorch/interpreters/batching.py)
BATCH: dict = {
    aten.convolution: batch_rules.per_example(outputs=("b",)),
    aten.convolution_backward: batch_rules.per_example(outputs=("b", "sum", "sum")),
}


# FLOP rules: op -> rule(eqn) -> int (see stagetorch/flops.py)
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
#   gradient again; the weight gradient runs one of five kernels (_weight_gradient_kernel; grouped and
#   depthwise ones: _grouped_weight_gradient), each with its scratchpad, their thread splits replayed
#   (_jit_scratchpad): the allocator's to 2% over 767 measured shapes at 1-3 threads, either layout. A strided
#   convolution's input gradient runs another kernel, channels-last inside (_strided_data), exact at the
#   allocator; a grouped one one of three (_grouped_data).
#   Which kernels run depends on oneDNN's ISA (_ISAS, _onednn_isa): the rules were measured on AVX-512 (Intel
#   Sapphire Rapids) and AVX2 (AMD EPYC; _forward_avx2, jit_avx2_1x1's weight gradient, brgemm's blocks bounded):
#   never under the allocator on bench/conv_weight_grad_grid.py's grids there (bench/RESULTS.md).
# - without oneDNN, a 2-d forward of 16 examples or more runs NNPACK, whose buffers torch does not hand out;
#   the backward then unfolds fewer examples at once than the column buffer counted (an over-estimate).
#
# On CUDA, cuDNN picks an algorithm whose workspace PyTorch caps only through CUDNN_CONV_WSCAP_DBG; nothing
# here models it (unmeasured: no GPU in this project's CI). It lives in the plan's safety margin.


def _brgemm_blocks_avx2(channels: int) -> int:
    """The channels as oneDNN's AVX2 brgemm kernels pad them: to a block of 8, 16, 24 or 32 (no more blocks of 8
    than the channels fill), picked by its efficiency estimate (``est_eff``, not replayed): the most padding of
    those (a bound: 40 channels are padded to 48 where the bound takes 64)."""
    return max(_pad(channels, 8 * blocks) for blocks in range(1, min(4, -(-channels // 8)) + 1))


class _Isa(NamedTuple):
    """What the rules need to know of the kernels oneDNN runs at one ISA."""

    block: int  # oneDNN's channel block: the floats in one vector register
    weight_gradient_kernels: tuple[str, ...]  # the ungrouped ones, in cpu_convolution_list's order
    brgemm_output_channels: Callable[[int], int]  # the forward brgemm kernel's output channels, padded
    brgemm_input_channels: Callable[[int], int]  # the input-gradient brgemm kernels' input channels, padded
    brgemm_grouped_data: bool  # whether a grouped channels-last unstrided input gradient may run brgemm's kernel
    forward: Callable[..., int | None]  # this ISA's own forward kernels' workspace (None: the generic rule's)


# The ISAs whose f32 convolution kernels the rules follow: AVX-512 (jit_avx512_common and its 1x1 and
# first-layer kernels; measured on Intel Sapphire Rapids) and AVX2 (jit_avx2 and jit_avx2_1x1; measured on an
# AMD EPYC, and on Intel under ONEDNN_MAX_CPU_ISA=AVX2). On AVX-512 the brgemm kernels' block of input channels
# is 16, or 32-64 where there are more (picked by efficiency, not replayed: 32, the most padding).
_ISAS = {
    "avx512": _Isa(16, ("1x1", "first", "blocked", "avx2", "gemm"), lambda c: _pad(c, 16),
                   lambda c: _pad(c, 32) if c > 16 else _pad(c, 16), False, lambda *_: None),
    "avx2": _Isa(8, ("1x1_avx2", "flat_avx2", "avx2", "gemm"), _brgemm_blocks_avx2, _brgemm_blocks_avx2, True,
                 lambda *a: _forward_avx2(*a)),
}


def _onednn_isa() -> str:
    """Which of :data:`_ISAS` oneDNN's f32 convolutions run at here: "avx512" where the CPU has AVX512 core
    (F, BW, VL, DQ) and oneDNN's ISA is not capped below it (``ONEDNN_MAX_CPU_ISA``); else "avx2" (below AVX2,
    where oneDNN runs neither, too: unmeasured)."""
    cap = linalg._isa_cap()
    if cap is not None and not cap.startswith(("AVX512", "AVX10")):
        return "avx2"
    cpu = linalg._cpu_capability()
    if cpu:
        wide = all(cpu.get(name) for name in ("avx512_f", "avx512_bw", "avx512_vl", "avx512_dq"))
    else:
        wide = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    return "avx512" if wide else "avx2"


def _block() -> int:
    """oneDNN's channel block: the floats in one vector register."""
    return _ISAS[_onednn_isa()].block


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
    own = None if transposed else _ISAS[_onednn_isa()].forward(x, w, out, stride, padding, channels_last, groups)
    if own is not None:
        return copies + own
    if channels_last and groups == 1 and not transposed:
        # oneDNN's brgemm kernel reads the input and writes the output in place (channels-last both): only the
        # weight is reordered (output channels padded to the kernel's block: _ISAS), beside a scratchpad of a page and
        # an array of 103 batch elements of 40 bytes per thread (brgemm_convolution_utils::init_scratchpad).
        padded = _ISAS[_onednn_isa()].brgemm_output_channels(w.shape[0])
        return copies + w.nbytes * padded // w.shape[0] + 4096 + 4120 * torch.get_num_threads()
    # oneDNN over grouped channels-last tensors reorders less than the formula below counts for contiguous ones
    # (but for a few shapes: tests/ops/test_workspace.py); it stands for it, mostly an over-estimate.
    src, weight, dst, _ = _onednn_parts(x, w, out, groups, transposed)
    # The blocked output is reordered into the returned tensor after the input and weight copies are freed.
    return copies + max(src + weight + dst, dst + out.nbytes) - out.nbytes


def _forward_avx2(x: Aval, w: Aval, out: Aval, stride, padding, channels_last: bool, groups: int) -> int | None:  # noqa: ANN001
    """A forward's workspace on AVX2 (None: the generic rule's, for transposed ones). Ungrouped: brgemm over
    channels-last tensors (the output channels padded to its block, bounded: :func:`_brgemm_blocks_avx2`; the
    batch elements of the kernel's positions per thread, :func:`_brgemm_batch`); jit_avx2 over blocked ones,
    as the generic rule, with a padded bias booked where the output channels are not a multiple of 8. Depthwise: brdgmm_dw over channels-last tensors
    (in place: the weight reordered, its channels padded to 8) and over contiguous 3-d ones (the input made
    channels-last beside the weight reordered, or the output made twice: the larger, fitted to four layers
    exactly, not derived); jit_uni_dw over contiguous 2-d ones (channels blocked by 8, the weight padded and a padded bias
    booked where they are not a multiple of 8; its blocked output reordered into the one returned after the
    rest is freed). Other groups: brgemm over channels-last tensors (as ungrouped, each group's output channels
    padded); over contiguous ones gemm where a group's channels are not a multiple of 8 (jit_avx2 refuses them:
    per thread a column buffer; the output made by ideep, then copied into the one returned). A 1x1 layer
    (jit_avx2_1x1): the weight's input channels padded too, the bias padded, and strided, its input compacted to unit stride per
    thread (rtus: the input channel blocks by the output's positions)."""
    c_g, o_g, b = x.shape[1] // groups, out.shape[1] // groups, 8
    if c_g == o_g == 1:
        g = x.shape[1]
        blocked = _pad(g, b)
        if channels_last:
            return w.nbytes * blocked // g
        if x.ndim == 5:
            return max(x.nbytes + w.nbytes * blocked // g, 2 * out.nbytes)
        src, dst = x.nbytes * blocked // g, out.nbytes * blocked // g
        weight = w.nbytes * blocked // g + (blocked * w.itemsize + 128 if g % b else 0)
        return max(src + weight + dst, dst + out.nbytes) - out.nbytes
    if groups > 1 and channels_last:
        weight = groups * _brgemm_blocks_avx2(o_g) * c_g * math.prod(w.shape[2:]) * w.itemsize
        return weight + 4096 + _brgemm_batch(w) * torch.get_num_threads()
    if groups > 1 and (c_g % b or o_g % b):
        return max(_gemm_data(x, w, out, stride, padding, groups), out.nbytes)
    c, o = x.shape[1], out.shape[1]
    bias = _pad(o, b) * w.itemsize + 128 if o % b else 0  # the bias padded (taken as given: 192 B at most over)
    if groups > 1:
        return None
    if channels_last:
        return w.nbytes * _brgemm_blocks_avx2(o) // o + 4096 + _brgemm_batch(w) * torch.get_num_threads()
    unit = math.prod(w.shape[2:]) == 1 and all(p == 0 for p in padding)
    strided = any(s != 1 for s in stride)
    tiles = x.ndim == 4 and all(o_ * s == i for o_, s, i in zip(out.shape[2:], stride, x.shape[2:]))
    if not unit or (strided and not tiles):
        src, weight, dst, _ = _onednn_parts(x, w, out, groups, False)
        return max(src + weight + bias + dst, dst + out.nbytes) - out.nbytes
    src, dst = x.nbytes * _pad(c, b) // c, out.nbytes * _pad(o, b) // o
    weight = _pad(o, b) * _pad(c, b) * w.itemsize + bias
    if strided:
        weight += torch.get_num_threads() * _pad(c, b) * math.prod(out.shape[2:]) * x.itemsize + 128
    return max(src + weight + dst, dst + out.nbytes) - out.nbytes


def _unknown(v: Any) -> None:
    return None


def _strided_backward_data(x: Aval, w: Aval, stride, dilation, groups: int, transposed: bool) -> bool:  # noqa: ANN001
    """Whether oneDNN computes this input gradient with its strided brgemm kernel (brgconv_strided): the first
    of the f32 backward-data kernels that accepts a stride above 1, undilated, but for a grouped convolution of
    8 output channels per group or fewer (its AVX2 variant takes 9-16, the AVX-512 one more)."""
    return (
        not transposed and any(s != 1 for s in stride) and all(d == 1 for d in dilation)
        and (groups == 1 or w.shape[0] // groups > 8)
    )


def _brgemm_data_weight(w: Aval) -> int:
    """The weight as oneDNN's brgemm input-gradient kernels reorder it: a group's input channels padded to the
    kernel's block of them (:data:`_ISAS`)."""
    c_g = w.shape[1]
    return w.nbytes * _ISAS[_onednn_isa()].brgemm_input_channels(c_g) // c_g


def _brgemm_batch(w: Aval) -> int:
    """The bytes of batch elements (40 each) oneDNN's brgemm convolutions book per thread: one per kernel
    position, in pages of 4096 bytes, as many elements as fill them (103 for a page)."""
    page, element = 4096, 40
    return -(-_pad(math.prod(w.shape[2:]) * element, page) // element) * element


def _brgemm_data(w: Aval) -> int:
    """The input gradient's workspace under oneDNN's unstrided brgemm kernel over channels-last tensors
    (``brg_conv_bwd`` running its forward kernel, ``brg_conv_fwd``, on the transposed problem), which reads the
    output gradient and writes the input gradient in place: the weight reordered (``_brgemm_data_weight``) and
    the scratchpad, a page and 128 bytes, and per thread the batch elements of one kernel's positions (40 bytes
    each) in pages of 4096 bytes, as many elements as fill them (a 1x1 kernel: 103). Measured to the byte on
    2-d and 3-d layers of 1-256 channels, kernels 1-7, padding 0-3, dilation 1-2 at 1-3 threads (no padded input block
    booked: the forward kernel reads the padding in place). A layer whose kernel covers its whole input
    (oneDNN's inner-product kernel, not modelled) books less: over there."""
    return _brgemm_data_weight(w) + 4096 + 128 + _brgemm_batch(w) * torch.get_num_threads()


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
    weight = _brgemm_data_weight(w)
    if channels_last:
        return weight + x.nbytes + scratchpad
    return max(grad.nbytes + weight + x.nbytes + scratchpad, 3 * x.nbytes)


# -- oneDNN's thread split of a jit weight gradient (replayed) ----------------------------------------------
#
# A jit backward-weights kernel splits its threads over the batch (nthr_mb), the output and the input channel
# blocks; every batch thread beyond the first reduces into a weight of its own. oneDNN's scratchpad books each
# piece 128 bytes over its size (memory_tracking.hpp; a barrier context is a 4096-byte aligned page, booked
# with a page of alignment), which is what torch's allocator hands ideep.

_PAGE = 4096
_BARRIER = 2 * _PAGE  # simple_barrier::ctx_t (4096-aligned) and its alignment


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def _reduce_balance(threads: int, job: int, jobs: int, reduction: int, max_buffer: int) -> tuple[int, int, int]:
    """oneDNN's reduce_balancer_t::balance (lock-free): (groups, threads per group, jobs per group at most)."""
    least = max(1, jobs // threads)
    most = max(1, max_buffer // (threads * job))
    groups = min(jobs // least, threads)
    per_group = min(threads // groups, reduction)
    ub = _div_up(jobs, groups)
    best = jobs * job * reduction
    for c in range(least, jobs):
        c_groups = min(jobs // c, threads)
        c_per_group = min(threads // c_groups, reduction)
        c_ub = _div_up(jobs, c_groups)
        if c_per_group > 1 and c_ub > most:
            continue
        cost = job * c_ub * (_div_up(reduction, c_per_group) + (c_per_group != 1))
        if cost < best:
            groups, per_group, ub, best = c_groups, c_per_group, c_ub, cost
    return groups, per_group, ub


def _reducer(threads: int, job: int, jobs: int, reduction: int, max_buffer: int) -> int:
    """A cpu_reducer_t's scratchpad (bytes of f32): each group's threads but its first reduce into a space of
    their own (page-aligned), beside a barrier per group."""
    groups, per_group, ub = _reduce_balance(threads, job, jobs, reduction, max_buffer)
    if per_group == 1:
        return 0
    return groups * (per_group - 1) * ub * job * 4 + _PAGE + groups * _PAGE + _PAGE


def _balance(threads: int, nb_oc: int, nb_ic: int, src_cost, dst_cost, wei_cost, mb_max: int,
             comp_cost=None) -> tuple[int, int, int]:  # noqa: ANN001
    """The jit kernels' balance(): the split (batch, output blocks, input blocks) of least memory traffic,
    then (jit_avx512_common, ``comp_cost``) of less compute within 10% of it. Costs are callables of
    (batch threads, output-block threads, input-block threads)."""
    def mem(m: int, o: int, i: int) -> int:
        return src_cost(m, i) + dst_cost(m, o) + wei_cost(o, i)

    best_m = best_o = best_i = 1
    best_mem = mem(1, 1, 1)
    splits = [(m, o, min(threads // m // o, nb_ic)) for m in range(1, mb_max + 1)
              for o in range(1, min(threads // m, nb_oc) + 1)]
    for m, o, i in splits:
        cost = mem(m, o, i)
        if cost <= best_mem:
            best_mem, best_m, best_o, best_i = cost, m, o, i
    if comp_cost is not None:
        best_comp = comp_cost(best_m, best_o, best_i)
        for m, o, i in splits:
            comp = comp_cost(m, o, i)
            if (comp <= best_comp and mem(m, o, i) < 1.1 * best_mem) or 4 * comp <= 3 * best_comp:
                best_comp, best_m, best_o, best_i = comp, m, o, i
    return best_m, best_o, best_i


def _best_divider(value: int, least: int, most: int, find_max: bool) -> int:
    """oneDNN's best_divider (jit_uni_1x1_conv_utils.hpp): the divider in [least, most] that leaves the least
    of ``value`` over, the largest (``find_max``) or the smallest of those."""
    most = max(1, min(most, value))
    least = max(1, min(least, most))
    best, out = math.inf, most
    for d in range(most, least - 1, -1):
        loss = (_pad(value, d) - value) / _pad(value, d)
        if loss < best or (not find_max and loss == best):
            best, out = loss, d
    return out


def _dims(x: Aval, w: Aval, grad: Aval, stride) -> tuple:  # noqa: ANN001
    """(depth, height, width) of the input, the output gradient, the kernel and the strides (depth 1 in 2-d)."""
    def three(s):  # noqa: ANN001, ANN202
        return (1, *s) if len(s) == 2 else tuple(s)
    return three(x.shape[2:]), three(grad.shape[2:]), three(w.shape[2:]), three(stride)


def _jit_scratchpad(kind: str, x: Aval, w: Aval, grad: Aval, stride, channels_last: bool, bias: bool, groups: int = 1) -> int:  # noqa: ANN001
    """The scratchpad of a jit weight gradient (``first``, ``blocked`` and, grouped, ``grouped``:
    jit_avx512_common; ``avx2`` and ``grouped8``: jit_avx2; ``1x1``: jit_avx512_common_1x1), its thread split
    replayed (``balance()`` and the kernels' ``init_scratchpad``, oneDNN 3.x)."""
    threads = torch.get_num_threads()
    n, c, o = x.shape[0], x.shape[1] // groups, w.shape[0] // groups
    (i_d, i_h, i_w), (o_d, o_h, o_w), (k_d, k_h, k_w), (s_d, s_h, s_w) = _dims(x, w, grad, stride)
    kernel = k_d * k_h * k_w
    out = 0
    if kind in ("avx2", "flat_avx2", "grouped8"):
        # Two reducers (cpu_reducer_t, 2M floats at most a thread), the weight's over the batch and depth.
        b = 8
        ic_block = c if c == 3 else b
        nb_oc = groups * _div_up(o, b)
        if bias:
            out += (groups * _pad(o, b) * 4 + 128 if o % b else 0) + _reducer(threads, b, nb_oc, n, 1 << 21)
        return out + _reducer(threads, kernel * ic_block * b, nb_oc * _div_up(c, ic_block), n * o_d, 1 << 21)
    if kind == "1x1_avx2":
        return out + _avx2_1x1_scratchpad(x, w, grad, stride, channels_last, bias)
    b = 16
    nb_oc = _div_up(o, b)
    if kind == "1x1":
        # A strided 1x1 kernel first compacts its input to unit stride (rtus): the output's positions.
        positions = o_d * o_h * o_w
        block = _best_divider(positions, 7, 16, True)
        if positions % block:
            block = _best_divider(o_w, 4, o_w, False)
        block = 1 if block > 256 else block
        nb_ic, nb_reduce = _div_up(c, b), _div_up(positions, block)
        m, ob, ib = _balance(
            threads, nb_oc, nb_ic,
            lambda m, i: _div_up(n * nb_reduce, m) * _div_up(nb_ic, i) * b * block,
            lambda m, o_: _div_up(n * nb_reduce, m) * _div_up(nb_oc, o_) * b * block,
            lambda o_, i: 12 * _div_up(nb_oc, o_) * _div_up(nb_ic, i) * b * b,
            min(threads, n * nb_reduce))
        m = min(n, threads) if threads // 2 < m < threads else m
        nthr = m * ob * ib
        weight = _pad(o, b) * _pad(c, b)
        if any(s != 1 for s in stride):
            per_thread = positions * c if channels_last else _best_divider(nb_ic, 5, nb_ic, False) * positions * b
            out += nthr * per_thread * 4 + 128
    else:
        ic_block = c if kind == "first" else b
        nb_ic = _div_up(c, ic_block)
        # The 2-d kernel over blocked tensors reduces over output rows too (harness_2d_reduction).
        rows = x.ndim == 4 and o_h > 9 and not channels_last
        i_r, o_r, i_n, o_n = (i_h, o_h, 1, 1) if rows else (1, 1, i_h, o_h)
        row_threads = max(1, o_r // 9)
        if threads < groups:  # a thread a group, no reduction
            m, nthr = 1, threads
        else:  # every group in parallel, its share of the threads split
            per_group = threads // groups
            m, ob, ib = _balance(
                per_group, nb_oc, nb_ic,
                lambda m, i: _div_up(n * i_r, m) * _div_up(nb_ic, i) * ic_block * i_n * i_w * i_d // s_d // s_h // s_w,
                lambda m, o_: _div_up(n * o_r, m) * _div_up(nb_oc, o_) * b * o_n * o_w * o_d,
                lambda o_, i: 8 * _div_up(nb_oc, o_) * _div_up(nb_ic, i) * kernel * ic_block * b,
                min(per_group, n * o_d * row_threads),
                lambda m, o_, i: _div_up(n * o_r, m) * _div_up(nb_oc, o_) * _div_up(nb_ic, i))
            m = min(n * o_d * row_threads, threads) if threads // 2 < m < threads else m
            nthr = m * groups * ob * ib
        weight = groups * (_pad(o, b) * _pad(c, ic_block) * kernel + _pad(o, b))  # and its bias
    if m > 1:  # each batch thread but the first reduces into a weight (and bias) of its own
        out += weight * (m - 1) * 4 + 128 + _BARRIER
    if bias:
        out += groups * _pad(o, b) * 4 + 128 if o % b else 0
        out += _reducer(nthr, b, groups * nb_oc, n, nthr * 3 * 5 * 5 * b * b)
    return out


def _halved(blocks: int, most: int) -> int:
    """jit_avx2_1x1's blocking of a dimension's blocks: halved, or divided by 3, while over ``most``."""
    while blocks > most and (blocks % 2 == 0 or blocks % 3 == 0):
        blocks //= 2 if blocks % 2 == 0 else 3
    return blocks


def _avx2_1x1_scratchpad(x: Aval, w: Aval, grad: Aval, stride, channels_last: bool, bias: bool) -> int:  # noqa: ANN001
    """jit_avx2_1x1's weight-gradient scratchpad (``init_conf``, ``init_balancers`` and ``init_scratchpad``
    of jit_avx2_1x1_convolution_bwd_weights_t): the bias padded to 8 channels; a strided layer's input
    compacted to unit stride per thread (rtus); the bias's reducer (cpu_reducer_t) and the weight's
    (cpu_reducer_2d_t: every thread of a group, the first too, reduces into a space of its own, aligned by
    128 bytes), over the blocks of output and input channels as the kernel blocks them, each example's
    output positions a reduction step."""
    threads, b = torch.get_num_threads(), 8
    n, c, o = x.shape[0], x.shape[1], w.shape[0]
    positions = math.prod(grad.shape[2:])
    nb_oc, nb_ic = _div_up(o, b), _div_up(c, b)
    oc_blocking = _halved(nb_oc, 32) if not channels_last or o % b == 0 else nb_oc
    small = math.prod(grad.shape[2:]) <= 1024  # the input after rtus: the output's positions
    ic_blocking = _halved(nb_ic, 17 if channels_last else 9) if not channels_last or (c % b == 0 and small) else nb_ic
    out = _pad(o, b) * 4 + 128 if bias and o % b else 0
    if any(s != 1 for s in stride):
        per_thread = positions * c if channels_last else ic_blocking * positions * b
        out += threads * per_thread * 4 + 128
    job = oc_blocking * ic_blocking * b * b
    max_buffer = threads * job * 8
    if bias:
        out += _reducer(threads, b, nb_oc, n, max_buffer)
    groups, per_group, ub = _reduce_balance(
        threads, job, _div_up(nb_ic, ic_blocking) * _div_up(nb_oc, oc_blocking), n * positions, max_buffer)
    if per_group > 1:
        out += groups * per_group * ub * job * 4 + 128 + groups * _PAGE + _PAGE
    return out


def _depthwise_scratchpad(x: Aval, w: Aval, channels_last: bool, bias: bool) -> int:
    """jit_uni_dw's (jit_avx512_common_dw) weight-gradient scratchpad: contiguous, threads over the channel
    blocks and then the batch, each batch thread but the first reducing a (channel-padded) weight and bias of its
    own; channels-last, the threads split channels, batch and rows (partition_nthr_nxc, not replayed: every
    thread but the first taken to reduce, a bound)."""
    threads, b = torch.get_num_threads(), _block()
    g, kernel = x.shape[1], math.prod(w.shape[2:])
    if channels_last:
        reducing = threads - 1
        return reducing and reducing * _pad(g, b) * kernel * 4 + 128 + (reducing * g * 4 + 128 if bias else 0)
    nthr_g = min(_div_up(g, b), threads)
    reducing = min(max(1, threads // nthr_g), x.shape[0]) - 1
    return reducing and reducing * _pad(g, b) * kernel * 4 + 128 + (reducing * _pad(g, b) * 4 + 128 if bias else 0)


def _weight_gradient_kernel(x: Aval, w: Aval, stride, padding, channels_last: bool) -> str:  # noqa: ANN001
    """Which of oneDNN's f32 backward-weights kernels runs an ungrouped convolution: the first of this ISA's
    (:data:`_ISAS`, in cpu_convolution_list's order) whose ``init_conf`` accepts it (a 1-d convolution as the
    2-d one torch runs). ``1x1`` (jit_avx512_common_1x1) and ``1x1_avx2`` (jit_avx2_1x1): a 1x1 kernel without
    padding; strided only in 1-d and 2-d where the stride tiles the input exactly, its input then compacted to
    unit stride. ``first`` (jit_avx512_common's first-layer kernel: up to 3 input channels, or fewer than a
    block channels-last; the input read in place, the weight's output channels padded), ``flat_avx2``
    (jit_avx2's, for 3 input channels: the same, by 8), ``blocked``
    (jit_avx512_common, channels padded to the block), ``avx2`` (jit_avx2, blocks of 8) or ``gemm``
    (gemm_convolution, plain layouts: where the others refuse). The limits are the kernels' ``init_conf``
    (``boundaries_ok``), in terms of the padding oneDNN infers at each far end."""
    c, kernel, spatial = x.shape[1], w.shape[2:], x.ndim - 2
    ins = x.shape[2:]
    outs = [_window(ins[i], kernel[i], stride[i], padding[i], 1) for i in range(spatial)]
    one_by_one = math.prod(kernel) == 1 and all(p == 0 for p in padding) and (
        all(s == 1 for s in stride) or (spatial < 3 and all(o * s == i for o, s, i in zip(outs, stride, ins)))
    )
    common, avx2, _ = _limits(x, w, stride, padding)
    b = _block()
    accepts = {
        "1x1": one_by_one,
        "1x1_avx2": one_by_one,
        "first": common and (c < b if channels_last else c <= 3),
        "blocked": common and c >= b,
        "flat_avx2": avx2 and c == 3,
        "avx2": avx2,
        "gemm": True,
    }
    return next(kind for kind in _ISAS[_onednn_isa()].weight_gradient_kernels if accepts[kind])


def _limits(x: Aval, w: Aval, stride, padding) -> tuple[bool, bool, bool]:  # noqa: ANN001
    """Whether jit_avx512_common's, jit_avx2's and jit_uni_dw's weight-gradient padding limits accept the
    convolution (their ``init_conf``: ``boundaries_ok`` and the like), in terms of the padding oneDNN infers
    at each far end."""
    kernel, spatial, ins = w.shape[2:], x.ndim - 2, x.shape[2:]
    outs = [_window(ins[i], kernel[i], stride[i], padding[i], 1) for i in range(spatial)]
    far = [max(0, (outs[i] - 1) * stride[i] + kernel[i] - ins[i] - padding[i]) for i in range(spatial)]
    (f, t, lp), (back, b, r) = ([0] * (3 - spatial) + list(padding)), ([0] * (3 - spatial) + far)
    (kd, kh, kw), (i_d, i_h, _) = ((1,) * (3 - spatial) + tuple(kernel)), ((1,) * (3 - spatial) + tuple(ins))
    s_h, s_w = stride[-2], stride[-1]
    common = (
        lp < kw and r < kw and t <= kh // 2 and b <= kh // 2 and f < kd and back < kd
        and (f == 0 or kd < i_d + f) and lp <= 28 and r <= 28 and kw <= 14
    )
    avx2 = t < kh and b < kh and lp < kw and r < kw and f == 0 and back == 0 and kw < 14 and kh <= i_h and kd <= i_d
    depthwise = (
        spatial == 2 and kw <= 3 and s_w <= kw and t <= kh // 2 and b <= kh // 2 and lp <= kw // 2
        and r <= kw // 2 and i_h >= kh + (-t) % s_h and (t <= 1 or t % s_h == 0) and (b <= 1 or b % s_h == 0)
    )
    return common, avx2, depthwise


def _weight_gradient(x: Aval, w: Aval, grad: Aval, stride, padding, channels_last: bool, bias: bool) -> int:  # noqa: ANN001
    """The weight gradient's workspace under oneDNN (groups 1, f32), over the weight's and the bias's gradients
    returned. ideep reorders the input and the output gradient into the layout the kernel picked (channels
    padded to its block; none channels-last, and a first layer's input is read in place), computes the weight
    gradient in the kernel's layout (padded) and the bias gradient beside a scratchpad, and then copies both
    into the tensors returned while its own are alive (channels-last, the weight gradient is copied dense and
    then channels-last: three weights at once).

    The scratchpad follows the kernel's ``init_scratchpad`` (each booking 128 bytes over its size): the gemm
    kernel's per thread where it threads over examples (a column buffer of one depth slice and the weight's
    reduction, booked as 4 bytes per byte of weight); the jit kernels' as their ``balance()`` splits the threads
    (:func:`_jit_scratchpad`: a reduction weight per batch thread beyond the first, the bias reducer's
    space, the barriers; a strided 1x1 kernel's input compacted to unit stride, per thread)."""
    layouts = (True, False) if channels_last and x.shape[1] == 1 else (channels_last,)
    # One input channel: channels-last and contiguous are the same strides; which one torch and oneDNN take is
    # not followed: the costlier.
    return max(
        _weight_gradient_as(_weight_gradient_kernel(x, w, stride, padding, layout), x, w, grad, stride, padding, layout, bias)
        for layout in layouts
    )


def _weight_gradient_as(kind: str, x: Aval, w: Aval, grad: Aval, stride, padding, channels_last, bias: bool, groups: int = 1) -> int:  # noqa: ANN001
    threads = torch.get_num_threads()
    n, c, o = x.shape[0], x.shape[1], w.shape[0]
    c_g, o_g = c // groups, o // groups
    kernel, itemsize = math.prod(w.shape[2:]), x.itemsize
    weight, bias_bytes = w.nbytes, o * itemsize if bias else 0
    if kind == "gemm" and channels_last:
        # gemm's channels-last variant (gemm_convolution_utils init_conf, nspc): per thread a column buffer of a
        # group's channels over one depth slice's output positions, a transposed input of a group's channels
        # and a reduction weight (4 bytes booked per byte); threads over examples where that fits.
        (i_d, i_h, i_w), (_, o_h, o_w), _, _ = _dims(x, w, grad, stride)
        unit = kernel == 1 and all(s == 1 for s in stride) and all(p == 0 for p in padding)
        columns = 0 if unit else c_g * kernel * o_h * o_w * itemsize
        transposed = i_d * i_h * i_w * c_g * itemsize
        limit = min(1 << 30, 15 * threads * (x.nbytes + weight + grad.nbytes))
        estimate = threads * (columns + transposed + 4 * weight)
        nthr = threads if estimate < limit and o_h * o_w // threads < 256 and (n != 1 or groups > 2) else 1
        scratchpad = nthr * (columns + 4 * weight + transposed) + (128 if columns else 0) + 2 * 128
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
        scratchpad = _depthwise_scratchpad(x, w, channels_last, bias)
    elif kind in ("grouped", "grouped8"):  # each group's channels padded to the block
        b = 8 if kind == "grouped8" else _block()
        blocked = groups * _pad(o_g, b) * _pad(c_g, b) * kernel * itemsize
        src = x.nbytes // c * groups * _pad(c_g, b)
        dst = grad.nbytes // o * groups * _pad(o_g, b)
        copies = 0 if channels_last else src + dst
        scratchpad = _jit_scratchpad(kind, x, w, grad, stride, channels_last, bias, groups)
    else:
        b = 8 if kind in ("avx2", "flat_avx2", "1x1_avx2") else _block()
        flat = kind in ("first", "flat_avx2")
        c_in = c if flat else _pad(c, b)
        blocked = _pad(o, b) * c_in * kernel * itemsize
        src = 0 if channels_last or flat else x.nbytes * _pad(c, b) // c
        dst = 0 if channels_last else grad.nbytes * _pad(o, b) // o
        copies = src + dst
        scratchpad = _jit_scratchpad(kind, x, w, grad, stride, channels_last, bias)
    compute = copies + blocked + bias_bytes + scratchpad
    # Channels-last, the weight gradient is copied out dense and then made channels-last.
    end = blocked + bias_bytes + weight + bias_bytes + (weight if channels_last else 0)
    return max(compute, end) - weight - bias_bytes


def _grouped_weight_gradient(x: Aval, w: Aval, grad: Aval, stride, padding, channels_last: bool, groups: int, bias: bool) -> int:  # noqa: ANN001
    """A grouped or depthwise weight gradient's workspace under oneDNN, in the first of its kernels that accepts
    it: jit_avx512_common_dw for a depthwise (one input and one output channel a group) 1-d or 2-d one (channels
    blocked across groups), jit_avx512_common where each group's channels are a multiple of 16 (channels-last:
    any, each group's padded to 16: a depthwise 3x3x3 layer's weight gradient 256 times its size), jit_avx2
    where they are a multiple of 8 (channels-last: any but 3 input channels a group), each within its padding
    limits (:func:`_limits`);
    else gemm, group by group."""
    c_g, o_g = x.shape[1] // groups, w.shape[0] // groups
    common, avx2, depthwise = _limits(x, w, stride, padding)
    if c_g == o_g == 1 and depthwise:
        kind = "depthwise"
    elif common and (channels_last or (c_g % 16 == 0 and o_g % 16 == 0)) and _block() == 16:
        kind = "grouped"
    elif avx2 and c_g != 3 and (channels_last or (c_g % 8 == 0 and o_g % 8 == 0)):
        kind = "grouped8"
        if c_g == o_g == 1 and _block() == 8:
            # AVX2 runs a depthwise one jit_uni_dw refuses in jit_avx2 (16 groups) or gemm (3 groups): which
            # not replayed, the larger.
            return max(_weight_gradient_as(k, x, w, grad, stride, padding, channels_last, bias, groups)
                       for k in ("grouped8", "gemm"))
    else:
        kind = "gemm"
    return _weight_gradient_as(kind, x, w, grad, stride, padding, channels_last, bias, groups)


def _grouped_data(x: Aval, w: Aval, grad: Aval, stride, padding, channels_last: bool, groups: int) -> int:  # noqa: ANN001
    """A grouped input gradient's workspace under oneDNN (beside the input gradient returned), by the kernel that
    runs it: jit_uni_dw for a depthwise 1-d or 2-d convolution (the output gradient, the weight and the input
    gradient in blocks of 16 channels, then the input gradient reordered out; channels-last the weight alone); jit_avx512_common over
    channels-last tensors, in place, each group's weight blocked by 16 channels, or 8 or 4 (the larger that
    divides both a group's input and output channels, fewer than 16 channels-last), else padded to 16; over
    contiguous ones that kernel where such a
    block divides them (the gradients reordered into it, no padding) or gemm group by group (its column
    buffers; where no block divides them, gemm), which of the two not replayed: the larger."""
    c_g, o_g, kernel, b = x.shape[1] // groups, w.shape[0] // groups, math.prod(w.shape[2:]), _block()
    if c_g == o_g == 1 and x.ndim == 4:
        weight = _pad(groups, b) * kernel * w.itemsize
        if channels_last:  # in place
            return weight
        blocked_input = x.nbytes * _pad(groups, b) // groups
        return max(grad.nbytes * _pad(groups, b) // groups + weight + blocked_input, blocked_input + x.nbytes) - x.nbytes
    block = b if c_g % b == 0 and o_g % b == 0 else None
    if block is None and (not channels_last or (c_g < b and o_g < b)):  # a narrower vector register (init_conf)
        block = next((bl for bl in (8, 4) if bl < b and c_g % bl == 0 and o_g % bl == 0), None)
    if channels_last:
        block = block or b
        blocked = groups * _pad(o_g, block) * _pad(c_g, block) * kernel * w.itemsize
        if _ISAS[_onednn_isa()].brgemm_grouped_data:
            # AVX2: its brgemm input-gradient kernel where unstrided (seen on groups of 4 channels), else jit_avx2
            # (each group's weight blocked by 8) where its init_conf allows (no stride in depth, the same in
            # height and width, not a kernel wider than 3 over fewer than 8 channels a group strided: then gemm
            # over the channels-last tensors; its further limits not replayed: the larger of the two).
            if all(s == 1 for s in stride):
                return max(blocked, _brgemm_data(w))
            jit = (x.ndim < 5 or stride[0] == 1) and stride[-1] == stride[-2] and not (c_g < 8 and w.shape[-1] > 3)
            return max(_gemm_nspc_data(x, w, grad, groups), blocked if jit else 0)
        return blocked
    # Either kernel writes the input gradient into ideep's own tensor, then copied into the one returned.
    gemm = max(_gemm_data(x, w, grad, stride, padding, groups), x.nbytes)
    if block is None:
        return gemm
    return max(gemm, grad.nbytes + w.nbytes, x.nbytes)


def _gemm_nspc_data(x: Aval, w: Aval, grad: Aval, groups: int) -> int:
    """gemm_convolution's input gradient over channels-last tensors (gemm_convolution_utils ``init_conf``,
    nspc backward data): per thread a column buffer of a group's input channels by the kernel's and the
    output's positions and, grouped, an accumulator of a group's input gradient (threads over groups and
    examples in 1-d and 2-d: all taken, a bound; one thread in 3-d), beside the weight transposed."""
    threads = 1 if x.ndim == 5 else torch.get_num_threads()
    c_g, kernel = x.shape[1] // groups, math.prod(w.shape[2:])
    columns = c_g * kernel * math.prod(grad.shape[2:]) * x.itemsize
    accumulator = math.prod(x.shape[2:]) * c_g * x.itemsize if groups > 1 else 0
    return threads * columns + 128 + (threads * accumulator + 128 if accumulator else 0) + w.nbytes


def _gemm_data(x: Aval, w: Aval, grad: Aval, stride, padding, groups: int) -> int:  # noqa: ANN001
    """gemm_convolution's input gradient over plain tensors (a grouped one it runs group by group): per thread a
    column buffer of a group's input channels over one depth slice's output positions, threads taken all (its
    outer threading not replayed: a bound)."""
    (_, o_h, o_w) = _dims(x, w, grad, stride)[1]
    kernel = math.prod(w.shape[2:])
    if kernel == 1 and all(s == 1 for s in stride) and all(p == 0 for p in padding):
        return 0
    return torch.get_num_threads() * x.shape[1] // groups * kernel * o_h * o_w * x.itemsize + 128


def convolution_backward_workspace(e: Eqn, layouts: Any = None) -> int:
    grad, x, w, stride, padding, dilation, transposed, groups, mask = _geometry(e, backward=True)
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
        if x.ndim == 5 and x.shape[1] < b and not channels_last:
            # A 3-d layer of few input channels the strided kernel may refuse (its blocking, not replayed):
            # jit_avx512_common's then (below), the larger.
            blocked_input = x.nbytes * _pad(x.shape[1], b) // x.shape[1]
            data = max(data, max(grad_blocked + weight_padded + blocked_input, blocked_input + grad_input) - grad_input)
    elif mask[0]:
        blocked_input = x.nbytes * _pad(x.shape[1], b) // x.shape[1]
        data = max(grad_blocked + weight_padded + blocked_input, blocked_input + grad_input) - grad_input
        if groups > 1 and not transposed:
            data = _grouped_data(x, w, grad, stride, padding, channels_last, groups)
        elif channels_last and not transposed and all(s == 1 for s in stride):
            data = _brgemm_data(w)
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

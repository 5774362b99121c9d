"""The workspace oneDNN's f32 convolution kernels book inside themselves on the CPU, by replaying which
kernel oneDNN picks at its ISA (AVX-512 or AVX2) and each kernel's blocking and thread split.

Measured at the allocator on torch 2.13's CPU build (tests/ops/test_workspace.py, bench/RESULTS.md): the
blocked reorders of the weight, the input and the output (channels padded to the vector width: 16 floats on
AVX-512, 8 on AVX2), the weight gradient's five kernels (:func:`_weight_gradient_kernel`; grouped and
depthwise ones: :func:`grouped_weight_gradient`) with their scratchpads and thread splits
(:func:`_jit_scratchpad`), the strided input gradient (:func:`strided_data`), the grouped one
(:func:`grouped_data`) and the AVX2 forward kernels (:func:`_forward_avx2`).

Avals in, bytes out: it knows the shapes, dtypes and memory format of a convolution's operands, the threads
torch runs and oneDNN's ISA on this CPU (:func:`onednn_isa`); it knows nothing of the IR's equations, of
ATen's choice of kernel (whether oneDNN runs at all: :mod:`stagetorch.ops.conv`) or of the registry.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from ...ir import Aval
from .. import linalg

__all__ = [
    "ISAS", "onednn_isa", "channel_block", "pad", "window", "onednn_parts", "strided_backward_data", "strided_data",
    "brgemm_data", "grouped_data", "weight_gradient", "grouped_weight_gradient",
]


def window(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    """The size of a convolution's output along one spatial dim (ATen's formula; the shape rule's too)."""
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def _brgemm_blocks_avx2(channels: int) -> int:
    """The channels as oneDNN's AVX2 brgemm kernels pad them: to a block of 8, 16, 24 or 32 (no more blocks of 8
    than the channels fill), picked by its efficiency estimate (``est_eff``, not replayed): the most padding of
    those (a bound: 40 channels are padded to 48 where the bound takes 64)."""
    return max(pad(channels, 8 * blocks) for blocks in range(1, min(4, -(-channels // 8)) + 1))


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
ISAS = {
    "avx512": _Isa(16, ("1x1", "first", "blocked", "avx2", "gemm"), lambda c: pad(c, 16),
                   lambda c: pad(c, 32) if c > 16 else pad(c, 16), False, lambda *_: None),
    "avx2": _Isa(8, ("1x1_avx2", "flat_avx2", "avx2", "gemm"), _brgemm_blocks_avx2, _brgemm_blocks_avx2, True,
                 lambda *a: _forward_avx2(*a)),
}


def onednn_isa() -> str:
    """Which of :data:`ISAS` oneDNN's f32 convolutions run at here: "avx512" where the CPU has AVX512 core
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


def channel_block() -> int:
    """oneDNN's channel block: the floats in one vector register."""
    return ISAS[onednn_isa()].block


def pad(c: int, block: int) -> int:
    return -(-c // block) * block


def onednn_parts(x: Aval, w: Aval, out: Aval, groups: int, transposed: bool) -> tuple[int, int, int, int]:
    """oneDNN's reordered copies: (input, weight, output in blocked layout, weight for the backward)."""
    b = channel_block()
    c_in, c_out = x.shape[1], out.shape[1]
    # A first layer's few channels are read in place, except by a 1x1 kernel.
    src = x.nbytes * pad(c_in, b) // c_in if c_in >= b or math.prod(w.shape[2:]) == 1 else 0
    pad_out = pad(c_out, b) / c_out
    weight = w.nbytes if groups > 1 else int(w.nbytes * pad_out * (pad(c_in, b) / c_in if c_in >= b else 1))
    weight_backward = w.nbytes if groups > 1 else int(w.nbytes * pad_out * pad(c_in, b) / c_in)
    if transposed:  # flipped and then blocked
        weight *= 2
    return src, weight, int(out.nbytes * pad_out), weight_backward


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
        blocked = pad(g, b)
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
    bias = pad(o, b) * w.itemsize + 128 if o % b else 0  # the bias padded (taken as given: 192 B at most over)
    if groups > 1:
        return None
    if channels_last:
        return w.nbytes * _brgemm_blocks_avx2(o) // o + 4096 + _brgemm_batch(w) * torch.get_num_threads()
    unit = math.prod(w.shape[2:]) == 1 and all(p == 0 for p in padding)
    strided = any(s != 1 for s in stride)
    tiles = x.ndim == 4 and all(o_ * s == i for o_, s, i in zip(out.shape[2:], stride, x.shape[2:]))
    if not unit or (strided and not tiles):
        src, weight, dst, _ = onednn_parts(x, w, out, groups, False)
        return max(src + weight + bias + dst, dst + out.nbytes) - out.nbytes
    src, dst = x.nbytes * pad(c, b) // c, out.nbytes * pad(o, b) // o
    weight = pad(o, b) * pad(c, b) * w.itemsize + bias
    if strided:
        weight += torch.get_num_threads() * pad(c, b) * math.prod(out.shape[2:]) * x.itemsize + 128
    return max(src + weight + dst, dst + out.nbytes) - out.nbytes


def strided_backward_data(x: Aval, w: Aval, stride, dilation, groups: int, transposed: bool) -> bool:  # noqa: ANN001
    """Whether oneDNN computes this input gradient with its strided brgemm kernel (brgconv_strided): the first
    of the f32 backward-data kernels that accepts a stride above 1, undilated, but for a grouped convolution of
    8 output channels per group or fewer (its AVX2 variant takes 9-16, the AVX-512 one more)."""
    return (
        not transposed and any(s != 1 for s in stride) and all(d == 1 for d in dilation)
        and (groups == 1 or w.shape[0] // groups > 8)
    )


def _brgemm_data_weight(w: Aval) -> int:
    """The weight as oneDNN's brgemm input-gradient kernels reorder it: a group's input channels padded to the
    kernel's block of them (:data:`ISAS`)."""
    c_g = w.shape[1]
    return w.nbytes * ISAS[onednn_isa()].brgemm_input_channels(c_g) // c_g


def _brgemm_batch(w: Aval) -> int:
    """The bytes of batch elements (40 each) oneDNN's brgemm convolutions book per thread: one per kernel
    position, in pages of 4096 bytes, as many elements as fill them (103 for a page)."""
    page, element = 4096, 40
    return -(-pad(math.prod(w.shape[2:]) * element, page) // element) * element


def brgemm_data(w: Aval) -> int:
    """The input gradient's workspace under oneDNN's unstrided brgemm kernel over channels-last tensors
    (``brg_conv_bwd`` running its forward kernel, ``brg_conv_fwd``, on the transposed problem), which reads the
    output gradient and writes the input gradient in place: the weight reordered (``_brgemm_data_weight``) and
    the scratchpad, a page and 128 bytes, and per thread the batch elements of one kernel's positions (40 bytes
    each) in pages of 4096 bytes, as many elements as fill them (a 1x1 kernel: 103). Measured to the byte on
    2-d and 3-d layers of 1-256 channels, kernels 1-7, padding 0-3, dilation 1-2 at 1-3 threads (no padded input block
    booked: the forward kernel reads the padding in place). A layer whose kernel covers its whole input
    (oneDNN's inner-product kernel, not modelled) books less: over there."""
    return _brgemm_data_weight(w) + 4096 + 128 + _brgemm_batch(w) * torch.get_num_threads()


def strided_data(x: Aval, w: Aval, grad: Aval, stride, padding, channels_last: bool) -> int:  # noqa: ANN001
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
    batch = -(-pad(math.prod(kernel) * element, page) // element) * element
    per_thread = pad(padded * w.shape[0], page) * grad.itemsize + batch + page
    bookings = 3
    if ins[-1] % stride[-1]:
        per_thread += pad(pad(ins[-1], stride[-1]) * stride[-1] * x.shape[1], page) * x.itemsize
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
        loss = (pad(value, d) - value) / pad(value, d)
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
            out += (groups * pad(o, b) * 4 + 128 if o % b else 0) + _reducer(threads, b, nb_oc, n, 1 << 21)
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
        weight = pad(o, b) * pad(c, b)
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
        weight = groups * (pad(o, b) * pad(c, ic_block) * kernel + pad(o, b))  # and its bias
    if m > 1:  # each batch thread but the first reduces into a weight (and bias) of its own
        out += weight * (m - 1) * 4 + 128 + _BARRIER
    if bias:
        out += groups * pad(o, b) * 4 + 128 if o % b else 0
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
    out = pad(o, b) * 4 + 128 if bias and o % b else 0
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
    threads, b = torch.get_num_threads(), channel_block()
    g, kernel = x.shape[1], math.prod(w.shape[2:])
    if channels_last:
        reducing = threads - 1
        return reducing and reducing * pad(g, b) * kernel * 4 + 128 + (reducing * g * 4 + 128 if bias else 0)
    nthr_g = min(_div_up(g, b), threads)
    reducing = min(max(1, threads // nthr_g), x.shape[0]) - 1
    return reducing and reducing * pad(g, b) * kernel * 4 + 128 + (reducing * pad(g, b) * 4 + 128 if bias else 0)


def _weight_gradient_kernel(x: Aval, w: Aval, stride, padding, channels_last: bool) -> str:  # noqa: ANN001
    """Which of oneDNN's f32 backward-weights kernels runs an ungrouped convolution: the first of this ISA's
    (:data:`ISAS`, in cpu_convolution_list's order) whose ``init_conf`` accepts it (a 1-d convolution as the
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
    outs = [window(ins[i], kernel[i], stride[i], padding[i], 1) for i in range(spatial)]
    one_by_one = math.prod(kernel) == 1 and all(p == 0 for p in padding) and (
        all(s == 1 for s in stride) or (spatial < 3 and all(o * s == i for o, s, i in zip(outs, stride, ins)))
    )
    common, avx2, _ = _limits(x, w, stride, padding)
    b = channel_block()
    accepts = {
        "1x1": one_by_one,
        "1x1_avx2": one_by_one,
        "first": common and (c < b if channels_last else c <= 3),
        "blocked": common and c >= b,
        "flat_avx2": avx2 and c == 3,
        "avx2": avx2,
        "gemm": True,
    }
    return next(kind for kind in ISAS[onednn_isa()].weight_gradient_kernels if accepts[kind])


def _limits(x: Aval, w: Aval, stride, padding) -> tuple[bool, bool, bool]:  # noqa: ANN001
    """Whether jit_avx512_common's, jit_avx2's and jit_uni_dw's weight-gradient padding limits accept the
    convolution (their ``init_conf``: ``boundaries_ok`` and the like), in terms of the padding oneDNN infers
    at each far end."""
    kernel, spatial, ins = w.shape[2:], x.ndim - 2, x.shape[2:]
    outs = [window(ins[i], kernel[i], stride[i], padding[i], 1) for i in range(spatial)]
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


def weight_gradient(x: Aval, w: Aval, grad: Aval, stride, padding, channels_last: bool, bias: bool) -> int:  # noqa: ANN001
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
        b = channel_block()
        blocked = pad(c, b) * kernel * itemsize
        copies = 0 if channels_last else x.nbytes * pad(c, b) // c + grad.nbytes * pad(o, b) // o
        scratchpad = _depthwise_scratchpad(x, w, channels_last, bias)
    elif kind in ("grouped", "grouped8"):  # each group's channels padded to the block
        b = 8 if kind == "grouped8" else channel_block()
        blocked = groups * pad(o_g, b) * pad(c_g, b) * kernel * itemsize
        src = x.nbytes // c * groups * pad(c_g, b)
        dst = grad.nbytes // o * groups * pad(o_g, b)
        copies = 0 if channels_last else src + dst
        scratchpad = _jit_scratchpad(kind, x, w, grad, stride, channels_last, bias, groups)
    else:
        b = 8 if kind in ("avx2", "flat_avx2", "1x1_avx2") else channel_block()
        flat = kind in ("first", "flat_avx2")
        c_in = c if flat else pad(c, b)
        blocked = pad(o, b) * c_in * kernel * itemsize
        src = 0 if channels_last or flat else x.nbytes * pad(c, b) // c
        dst = 0 if channels_last else grad.nbytes * pad(o, b) // o
        copies = src + dst
        scratchpad = _jit_scratchpad(kind, x, w, grad, stride, channels_last, bias)
    compute = copies + blocked + bias_bytes + scratchpad
    # Channels-last, the weight gradient is copied out dense and then made channels-last.
    end = blocked + bias_bytes + weight + bias_bytes + (weight if channels_last else 0)
    return max(compute, end) - weight - bias_bytes


def grouped_weight_gradient(x: Aval, w: Aval, grad: Aval, stride, padding, channels_last: bool, groups: int, bias: bool) -> int:  # noqa: ANN001
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
    elif common and (channels_last or (c_g % 16 == 0 and o_g % 16 == 0)) and channel_block() == 16:
        kind = "grouped"
    elif avx2 and c_g != 3 and (channels_last or (c_g % 8 == 0 and o_g % 8 == 0)):
        kind = "grouped8"
        if c_g == o_g == 1 and channel_block() == 8:
            # AVX2 runs a depthwise one jit_uni_dw refuses in jit_avx2 (16 groups) or gemm (3 groups): which
            # not replayed, the larger.
            return max(_weight_gradient_as(k, x, w, grad, stride, padding, channels_last, bias, groups)
                       for k in ("grouped8", "gemm"))
    else:
        kind = "gemm"
    return _weight_gradient_as(kind, x, w, grad, stride, padding, channels_last, bias, groups)


def grouped_data(x: Aval, w: Aval, grad: Aval, stride, padding, channels_last: bool, groups: int) -> int:  # noqa: ANN001
    """A grouped input gradient's workspace under oneDNN (beside the input gradient returned), by the kernel that
    runs it: jit_uni_dw for a depthwise 1-d or 2-d convolution (the output gradient, the weight and the input
    gradient in blocks of 16 channels, then the input gradient reordered out; channels-last the weight alone); jit_avx512_common over
    channels-last tensors, in place, each group's weight blocked by 16 channels, or 8 or 4 (the larger that
    divides both a group's input and output channels, fewer than 16 channels-last), else padded to 16; over
    contiguous ones that kernel where such a
    block divides them (the gradients reordered into it, no padding) or gemm group by group (its column
    buffers; where no block divides them, gemm), which of the two not replayed: the larger."""
    c_g, o_g, kernel, b = x.shape[1] // groups, w.shape[0] // groups, math.prod(w.shape[2:]), channel_block()
    if c_g == o_g == 1 and x.ndim == 4:
        weight = pad(groups, b) * kernel * w.itemsize
        if channels_last:  # in place
            return weight
        blocked_input = x.nbytes * pad(groups, b) // groups
        return max(grad.nbytes * pad(groups, b) // groups + weight + blocked_input, blocked_input + x.nbytes) - x.nbytes
    block = b if c_g % b == 0 and o_g % b == 0 else None
    if block is None and (not channels_last or (c_g < b and o_g < b)):  # a narrower vector register (init_conf)
        block = next((bl for bl in (8, 4) if bl < b and c_g % bl == 0 and o_g % bl == 0), None)
    if channels_last:
        block = block or b
        blocked = groups * pad(o_g, block) * pad(c_g, block) * kernel * w.itemsize
        if ISAS[onednn_isa()].brgemm_grouped_data:
            # AVX2: its brgemm input-gradient kernel where unstrided (seen on groups of 4 channels), else jit_avx2
            # (each group's weight blocked by 8) where its init_conf allows (no stride in depth, the same in
            # height and width, not a kernel wider than 3 over fewer than 8 channels a group strided: then gemm
            # over the channels-last tensors; its further limits not replayed: the larger of the two).
            if all(s == 1 for s in stride):
                return max(blocked, brgemm_data(w))
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

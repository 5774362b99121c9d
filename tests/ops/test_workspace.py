"""Workspace rules (the registry's ``workspace`` slot) against the allocator: what each kernel allocates inside
itself beyond its outputs, for the op alone (tests/support/memtrack.op_workspace), over several shapes.

The CPU formulas were measured on torch 2.13's CPU build (stagetorch/ops/conv.py and kernels/onednn_conv.py, recurrent.py, attention.py,
norms.py). Where a formula is a fit or a bound rather than the kernel's own arithmetic, the tolerance says so.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from memtrack import op_workspace

import stagetorch
from stagetorch.interpreters.memory import Layouts, effect, peak_bytes, workspace
from stagetorch.ops.kernels import onednn_conv

# The oneDNN convolution rules follow the kernels oneDNN runs at the CPU's ISA (stagetorch/ops/kernels/onednn_conv.py, ISAS):
# AVX-512 (jit_avx512_common, brgemm, blocks of 16 channels) and AVX2 (jit_avx2, jit_avx2_1x1, brgemm and gemm,
# blocks of 8). On AVX2 the brgemm kernels' block of channels (8-32, picked by an efficiency estimate) is bounded,
# not replayed: where a test claims the allocator's bytes on AVX-512, it claims "never under, within" the
# bound's slack on AVX2. test_onednn_convolutions_capped_at_avx2_are_never_under runs the AVX2 rules on any CPU.
AVX2 = onednn_conv.onednn_isa() == "avx2"


aten = torch.ops.aten


@contextlib.contextmanager
def _mkldnn(enabled):
    """torch.backends.mkldnn.flags without its TF32 warning."""
    before = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(enabled)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(before)


def _rule(op, *args):
    """The workspace rule's answer for the equation ``op(*args)`` stages to (its arguments' strides as the
    trace records them: the tensors passed, laid out as they are)."""
    eqn, graph = _staged(op, *args)
    return workspace(eqn, layouts=Layouts(graph))


def _staged(op, *args):
    """The equation ``op(*args)`` stages to, and its graph."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def call(*ts):
        full = list(args)
        for i, t in zip(positions, ts):
            full[i] = t
        return op(*full)

    graph = stagetorch.make_ir(call)(*tensors)
    (eqn,) = [e for e in graph.eqns if e.prim in (op, getattr(op, "default", None))]
    return eqn, graph


def _conv(x, w, b, stride, padding, transposed, groups):
    nd = x.ndim - 2
    return (x, w, b, [stride] * nd, [padding] * nd, [1] * nd, transposed, [0] * nd, groups)


def _conv_backward(go, x, w, stride, padding, transposed, groups, mask):
    nd = x.ndim - 2
    return (go, x, w, [w.shape[1] * groups if transposed else w.shape[0]], [stride] * nd, [padding] * nd, [1] * nd,
            transposed, [0] * nd, groups, list(mask))


# (batch, channels in, size, channels out, kernel, groups, padding, dims, stride)
CONVS = [
    (1, 3, 16, 16, 3, 1, 1, 2, 1), (2, 3, 16, 16, 3, 1, 1, 2, 1), (16, 3, 16, 16, 3, 1, 1, 2, 1),
    (4, 3, 24, 32, 3, 1, 1, 2, 1), (4, 32, 24, 8, 1, 1, 0, 2, 1), (4, 8, 24, 8, 3, 1, 1, 2, 1),
    (4, 8, 24, 32, 3, 1, 1, 2, 1), (4, 16, 24, 16, 3, 1, 1, 2, 1), (1, 16, 8, 16, 3, 4, 1, 2, 1),
    (16, 16, 8, 16, 3, 4, 1, 2, 1), (1, 32, 24, 8, 1, 1, 0, 2, 1), (4, 16, 12, 16, 3, 1, 1, 2, 2),
    (4, 72, 24, 8, 3, 1, 1, 2, 1), (4, 24, 24, 8, 3, 1, 1, 2, 1),
    (1, 4, 8, 8, 3, 1, 1, 3, 1), (2, 4, 8, 8, 3, 1, 1, 3, 1), (2, 1, 16, 8, 3, 1, 1, 3, 1),
    (2, 8, 16, 8, 3, 1, 1, 3, 1), (2, 8, 16, 2, 1, 1, 0, 3, 1),
]
# Three 3-d ones the weight gradient's old bound missed (45% under, 55% and 25% over): gemm and jit_avx512_common.
CONVS += [(2, 8, 8, 16, 3, 1, 1, 3, 1), (2, 16, 4, 8, 3, 1, 1, 3, 2), (2, 4, 8, 8, 3, 1, 1, 3, 1)]


def _conv_case(case):
    n, c, size, o, k, groups, padding, nd, stride = case
    torch.manual_seed(0)
    x = torch.randn(n, c, *[size] * nd)
    # A weight that needs its gradient, as in a training step: the kernel chosen is the one that allows
    # a backward (without oneDNN, NNPACK runs a batch of 16 when none follows).
    w = torch.randn(o, c // groups, *[k] * nd, requires_grad=True)
    return x, w, torch.randn(o, requires_grad=True), stride, padding, groups


@pytest.mark.parametrize("mkldnn", [True, False], ids=["onednn", "native"])
@pytest.mark.parametrize("case", CONVS, ids=lambda c: "x".join(map(str, c)))
def test_convolution_workspace_is_the_allocators(case, mkldnn):
    if not mkldnn and case[0] >= 16 and case[7] == 2:
        pytest.skip("without oneDNN, 16 examples run NNPACK's forward (no workspace) and a backward not modelled")
    x, w, b, stride, padding, groups = _conv_case(case)
    # Two threads: oneDNN's jit kernels split the weight gradient's threads over the batch, which the rule replays
    # (test_onednn_weight_gradient_workspace_is_never_under_the_allocators).
    with _mkldnn(mkldnn), _threads(2):
        args = _conv(x, w, b, stride, padding, False, groups)
        measured, rule = op_workspace(aten.convolution, *args), _rule(aten.convolution, *args)
        assert abs(rule - measured) <= 0.02 * measured + 256, ("forward", measured, rule)
        go = torch.randn_like(aten.convolution(*args))
        for mask in ((True, True, True), (False, True, True), (True, False, False)):
            if mkldnn and mask == (True, False, False):
                continue
            args = _conv_backward(go, x, w, stride, padding, False, groups, mask)
            measured = _backward_at_the_allocator(go, x, w, stride, padding, groups, mask, mkldnn)
            rule = _rule(aten.convolution_backward, *args)
            if mkldnn:  # never under; the input gradient's kernels are bounded where not replayed
                assert measured <= rule <= (1.10 if mask[0] else 1.02) * measured + 256, ("backward", mask, measured, rule)
            else:
                assert abs(rule - measured) <= 0.02 * measured + 256, ("backward", mask, measured, rule)


def _backward_at_the_allocator(go, x, w, stride, padding, groups, mask, mkldnn):
    """The backward's excess at the allocator: the profiler's events plus the buffers the native 2-d kernel's
    input gradient takes from plain ``malloc`` (memtrack._unseen_at_malloc, measured at ``malloc`` by
    test_the_native_input_gradients_columns_are_real_but_unseen_by_the_profiler)."""
    return op_workspace(aten.convolution_backward, *_conv_backward(go, x, w, stride, padding, False, groups, mask))


@contextlib.contextmanager
def _threads(n):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _layer(n, c, size, o, k, nd, layout, stride=1, padding=0, groups=1):
    """A convolution's input, weight and output gradient for the oneDNN backward tests, laid out as ``layout``
    (made under the number of threads the test runs with)."""
    if layout == "channels-last" and nd == 1:
        pytest.skip("a 1-d convolution has no channels-last format")
    torch.manual_seed(0)
    x, w, b = torch.randn(n, c, *[size] * nd), torch.randn(o, c // groups, *[k] * nd), torch.randn(o)
    x = _laid_out(x, layout)
    go = _laid_out(torch.randn_like(aten.convolution(*_conv(x, w, b, stride, padding, False, groups))), layout)
    return x, w, go


def _backward_workspace(go, x, w, stride, padding, groups, mask):
    """The convolution backward's workspace at the allocator and by the rule."""
    args = _conv_backward(go, x, w, stride, padding, False, groups, mask)
    return op_workspace(aten.convolution_backward, *args), _rule(aten.convolution_backward, *args)


# Strided convolutions whose input gradient oneDNN computes with its strided brgemm kernel (channels-last inside):
# (batch, channels in, size, channels out, kernel, padding, dims, stride, groups). VNet's down-convolution at one
# example of 48^3 (three input gradients at once: the old rule counted two); output gradients wider than the
# input, where the per-thread scratchpad is the peak; an uneven width (a row buffer per thread); stride 3; groups
# of 32 output channels; a 1-d convolution (run as 2-d, stride (1, 2)).
STRIDED = [
    (1, 16, 48, 32, 2, 0, 3, 2, 1), (2, 16, 24, 32, 2, 0, 3, 2, 1), (2, 8, 10, 16, 3, 1, 3, 2, 1),
    (1, 16, 40, 128, 3, 1, 2, 2, 1), (2, 64, 20, 128, 4, 0, 2, 2, 1), (1, 16, 41, 32, 3, 1, 2, 2, 1),
    (1, 16, 40, 32, 3, 1, 2, 3, 1), (2, 32, 20, 128, 3, 1, 2, 2, 4), (4, 16, 400, 64, 3, 1, 1, 2, 1),
]


@pytest.mark.parametrize("layout", ["contiguous", "channels-last"])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("case", STRIDED, ids=lambda c: "x".join(map(str, c)))
def test_onednn_strided_input_gradient_is_the_allocators(case, threads, layout):
    """oneDNN's strided backward-data kernel works channels-last: its result, copied out by ``mkldnn_to_dense``
    with channels-last strides, is made contiguous by a clone (VNet at 1/3 of its peak measured 7.8% over its
    plan at that convolution), and its scratchpad holds an output gradient of one example per thread. Over
    channels-last tensors it reads and writes in place: the weight and the scratchpad are all."""
    n, c, size, o, k, padding, nd, stride, groups = case
    with _threads(threads):
        x, w, go = _layer(n, c, size, o, k, nd, layout, stride, padding, groups)
        # With the weight's gradient too: where the input gradient's clone makes the op's peak (VNet's layer); on
        # most other shapes the weight gradient's buffers do, which the rule bounds (never under the allocator:
        # test_onednn_weight_gradient_workspace_is_never_under_the_allocators).
        both = case == STRIDED[0] and layout == "contiguous"
        for mask in ((True, False, False), (True, True, True)) if both else ((True, False, False),):
            measured, rule = _backward_workspace(go, x, w, stride, padding, groups, mask)
            if AVX2:  # the weight's input channels padded to the most of brgemm's blocks: 64 to 72 (1.10x)
                assert measured <= rule <= 1.10 * measured + 256, (mask, measured, rule)
            else:
                assert abs(rule - measured) <= 0.02 * measured + 256, (mask, measured, rule)


# oneDNN's weight gradient, one case per kernel it picks (stagetorch/ops/kernels/onednn_conv.py, _weight_gradient_kernel):
# (batch, channels in, size, channels out, kernel, groups, padding, dims, stride). gemm: 3-d layers of 4-8 input
# channels padded in depth (the old rule: 45-62% under) and one padded past half its kernel; jit_avx512_common's
# first-layer kernel (3 input channels); jit_avx2 (4-8 input channels); jit_avx512_common (channels padded to
# 16; 12 rows and more: its 2-d harness splitting threads over rows); the 1x1 kernel, strided in 1-d (the old
# rule: 30% under at 3 threads); grouped and depthwise (the old rule: up to 99% under: the input and output
# gradient reordered with their channels padded to 16). Then the kernels' padding limits: a 2-d layer padded
# past half its kernel runs jit_avx2 (the old rule: the costlier of it and gemm, 4.4x over), a 3-d one gemm
# (channels-last: its per-depth-slice columns, 4.4x over before); a strided 1x1 layer whose stride does not tile
# its input runs jit_avx512_common, not the 1x1 kernel; groups of 8 channels jit_avx2's grouped kernel.
WEIGHT_GRADIENTS = [
    (2, 8, 8, 16, 3, 1, 1, 3, 1), (4, 4, 6, 32, 3, 1, 1, 3, 1), (2, 24, 4, 8, 3, 1, 2, 3, 1),
    (4, 3, 40, 16, 3, 1, 1, 1, 1), (2, 3, 6, 16, 3, 1, 1, 3, 1),
    (4, 8, 40, 8, 3, 1, 1, 1, 1), (4, 4, 12, 8, 3, 1, 1, 2, 2),
    (4, 16, 6, 8, 3, 1, 1, 3, 1), (2, 64, 6, 64, 3, 1, 1, 3, 1), (4, 24, 12, 64, 3, 1, 1, 2, 1),
    (2, 3, 40, 8, 1, 1, 0, 1, 2), (4, 64, 12, 8, 1, 1, 0, 2, 1), (4, 16, 6, 16, 1, 1, 0, 3, 1),
    (4, 16, 8, 16, 3, 4, 1, 2, 1), (4, 16, 6, 16, 2, 16, 1, 2, 1), (8, 16, 64, 16, 3, 16, 1, 1, 1),
    (4, 4, 8, 4, 4, 4, 0, 3, 3),
    (2, 8, 12, 8, 3, 1, 2, 2, 2), (4, 3, 6, 12, 3, 1, 2, 3, 1), (2, 24, 17, 24, 1, 1, 0, 2, 2),
    (2, 16, 20, 32, 3, 2, 0, 1, 1), (2, 12, 12, 32, 3, 4, 2, 2, 1),
]


@pytest.mark.parametrize("layout", ["contiguous", "channels-last"])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("case", WEIGHT_GRADIENTS, ids=lambda c: "x".join(map(str, c)))
def test_onednn_weight_gradient_workspace_is_never_under_the_allocators(case, threads, layout):
    """The weight gradient's workspace is the allocator's (to 2%) at every number of threads and in either
    layout: the rule names the kernel oneDNN picks and replays how it splits its threads (``balance()``: every
    batch thread but the first reduces into a weight of its own; the bias reducer; the barriers), which it
    bounded before (1.35x-1.63x over at 2-3 threads, up to 24x). With the input gradient's before it, never under
    the allocator: a planned step must not run over its budget."""
    n, c, size, o, k, groups, padding, nd, stride = case
    with _threads(threads):
        x, w, go = _layer(n, c, size, o, k, nd, layout, stride, padding, groups)
        for mask in ((False, True, True), (True, True, True), (False, True, False)):
            measured, rule = _backward_workspace(go, x, w, stride, padding, groups, mask)
            assert measured <= rule, (mask, measured, rule)
            if not mask[0]:
                assert rule <= 1.02 * measured + 256, (mask, measured, rule)


# oneDNN's input gradient where the weight gradient's bound hid the rule's holes (each under the allocator before,
# alone and with the weight's): a channels-last grouped 3-d layer (jit_avx512_common, each group's weight padded to
# 16 by 16: 13x under), a contiguous one in gemm (its column buffers: 2.9x under), a depthwise 2-d one (jit_uni_dw,
# its weight's channels padded; channels-last in place: 55x over), a strided one of 48 input channels (the
# brgemm kernel's 32-channel blocks), a strided 3-d one of one input channel (which that kernel refuses) and a
# channels-last 1x1 layer (the 1x1 brgemm kernel, in place: 2x under, up to 15x over). Then unstrided channels-last
# layers of larger kernels (the brgemm kernel through its forward one, in place; the rule costed the contiguous
# kernel's blocked copies: 0.60-0.99 of the allocator on 8 of the 12 runs, 8.7-11x over on the padded one).
INPUT_GRADIENTS = [
    (8, 32, 4, 32, 3, 32, 0, 3, 2, "channels-last"), (2, 3, 8, 6, 3, 3, 0, 2, 3, "channels-last"),
    (8, 64, 4, 4, 3, 2, 2, 3, 1, "contiguous"), (4, 4, 17, 4, 4, 4, 1, 2, 1, "contiguous"),
    (8, 5, 8, 5, 1, 5, 0, 2, 1, "channels-last"), (2, 48, 8, 16, 5, 1, 0, 3, 2, "contiguous"),
    (8, 1, 6, 64, 4, 1, 0, 3, 3, "contiguous"), (2, 12, 6, 12, 1, 1, 0, 2, 1, "channels-last"),
    (2, 16, 4, 4, 2, 1, 0, 3, 1, "channels-last"), (4, 16, 6, 12, 2, 1, 0, 2, 1, "channels-last"),
    (2, 12, 4, 16, 2, 1, 0, 3, 1, "channels-last"), (2, 32, 6, 4, 3, 1, 0, 2, 1, "channels-last"),
    (8, 48, 6, 12, 5, 1, 0, 3, 1, "channels-last"), (8, 64, 12, 4, 3, 1, 2, 2, 1, "channels-last"),
]


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("case", INPUT_GRADIENTS, ids=lambda c: "x".join(map(str, c)))
def test_onednn_input_gradient_workspace_is_never_under_the_allocators(case, threads):
    n, c, size, o, k, groups, padding, nd, stride, layout = case
    with _threads(threads):
        x, w, go = _layer(n, c, size, o, k, nd, layout, stride, padding, groups)
        for mask in ((True, False, False), (True, True, True)):
            measured, rule = _backward_workspace(go, x, w, stride, padding, groups, mask)
            assert measured <= rule, (mask, measured, rule)
            if groups == 1 and (k == 1 or stride == 1) and layout == "channels-last" and mask[1] is False:
                # Exact but where oneDNN's channel block is 48 (the rule takes 64: 1.16x over at most); on AVX2,
                # where the block (8-32) is bounded, 32 channels padded to 48 (1.13x).
                assert rule == measured if c <= 32 and not AVX2 else rule <= 1.17 * measured, (mask, measured, rule)
            if groups == c == o and layout == "channels-last" and mask[1] is False:
                assert rule <= 1.02 * measured + 256, (mask, measured, rule)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("case", [(4, 16, 24, 32, 3, 1, 2, 1), (4, 3, 24, 32, 3, 1, 2, 1), (4, 16, 12, 16, 3, 1, 2, 2),
                                  (2, 8, 12, 16, 3, 1, 3, 1), (4, 24, 24, 24, 3, 1, 2, 1), (4, 16, 24, 40, 5, 2, 2, 1),
                                  (4, 32, 24, 8, 1, 0, 2, 1)], ids=lambda c: "x".join(map(str, c)))
def test_onednn_channels_last_forward_workspace_is_the_allocators(case, threads):
    """Over a channels-last input oneDNN's brgemm kernel reads the input and writes the output in place: the
    weight made channels-last and reordered, and a small scratchpad, are all (the rule counted the contiguous
    kernel's blocked copies: up to 20x the allocator). A 1x1 kernel at one thread holds less (a bound). On AVX2
    the weight's output channels are padded to a block of 8-32 the kernel picks by efficiency, bounded by the
    most padding (32 channels padded to 48 where the kernel keeps 32: 1.20x)."""
    n, c, size, o, k, padding, nd, stride = case
    torch.manual_seed(0)
    x = _laid_out(torch.randn(n, c, *[size] * nd), "channels-last")
    w, b = torch.randn(o, c, *[k] * nd), torch.randn(o)
    with _threads(threads):
        args = _conv(x, w, b, stride, padding, False, 1)
        measured, rule = op_workspace(aten.convolution, *args), _rule(aten.convolution, *args)
    if k == 1 and threads == 1:
        assert measured <= rule <= measured + 16 * 1024
    elif AVX2:
        assert measured <= rule <= 1.21 * measured, (measured, rule)
    else:
        assert rule == measured


def test_vnet_down_convolution_recomputing_in_chunks_of_one_is_at_its_plan():
    """A VNet's first level (48^3 in the bench; 40^3 here) recomputing at 0.4x its peak in chunks of one example:
    the peak is the strided down-convolution's input gradient, which the allocator measured 12.9% above the
    plan before the rule counted oneDNN's clone (VNet at 1/3 of its peak at 48^3: 68.51 MiB measured, 63.53
    planned; now 63.24 both)."""
    import math

    from memtrack import AllocatorPeak
    from remat_models import step_of

    from stagetorch.planning.remat_search import RematPlan

    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(
        nn.Conv3d(1, 16, 3, padding=1), nn.GroupNorm(2, 16), nn.PReLU(16), nn.Conv3d(16, 32, 2, stride=2),
        nn.GroupNorm(2, 32), nn.PReLU(32), nn.ConvTranspose3d(32, 16, 2, stride=2), nn.Conv3d(16, 2, 1),
    )
    x = torch.randn(2, 1, 40, 40, 40)
    budget = math.ceil(0.4 * peak_bytes(stagetorch.jit(step_of(model), remat=False).graph(x)))
    staged = stagetorch.jit(step_of(model), memory_budget=budget)
    plan = staged.plan(x)
    assert isinstance(plan, RematPlan) and plan.recompute is not None and plan.chunk_sizes == (1, 1)
    with AllocatorPeak([*model.parameters(), *model.buffers(), x]) as tracker:
        staged(x)
    assert tracker.peak <= budget
    assert abs(plan.peak - tracker.peak) <= 0.02 * tracker.peak, (plan.peak, tracker.peak)


@pytest.mark.parametrize("fraction", [1.0, 0.6, 0.5])
def test_a_3d_network_of_few_channels_chunked_is_at_its_plan(fraction):
    """A 3-d network whose second layer (8 input channels, a 5x5x5 kernel, padded in depth) takes its weight gradient
    through oneDNN's gemm kernel, whose scratchpad (a column buffer and the weight's reduction per thread) is its
    peak: whole (chunks of two) and at 0.6 of its peak (chunks of one), the allocator measured 19-20% above the
    plan before the rule followed that kernel (4.40 MB planned, 5.24 measured; 2.43 and 2.91); now at it.

    At 0.5 the line through the chunk planner's samples at 2 and 4 examples (that scratchpad does not shrink
    with the chunk) put one example at 3.69 MB, over the 3.63 MB usable, and the step was refused ("not even one
    example fits: a chunk of 1 needs 2.8 MiB against a budget of 3.8 MiB"); chunks of one are 2.91 MB. The
    gradients are the whole batch's."""
    import math

    from memtrack import AllocatorPeak
    from remat_models import step_of

    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(
        nn.Conv3d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv3d(8, 32, 5, padding=2), nn.ReLU(),
        nn.Conv3d(32, 16, 3, padding=1, groups=16), nn.ReLU(), nn.Conv3d(16, 2, 1),
    )
    x = torch.randn(4, 1, 16, 16, 16)
    with _threads(2):
        budget = math.ceil(fraction * peak_bytes(stagetorch.jit(step_of(model), remat=False).graph(x)))
        staged = stagetorch.jit(step_of(model), memory_budget=budget)
        plan = staged.plan(x)
        assert plan.chunk_sizes == ((2, 2) if fraction == 1.0 else (1, 1, 1, 1))
        with AllocatorPeak([*model.parameters(), *model.buffers(), x]) as tracker:
            staged(x)
        chunked = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        step_of(model)(x)
    assert tracker.peak <= budget
    assert abs(plan.peak - tracker.peak) <= 0.02 * tracker.peak, (plan.peak, tracker.peak)
    for got, want in zip(chunked, (p.grad for p in model.parameters())):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


_CAPPED_CONVS = """
import json, sys
import torch
sys.path[:0] = {tests!r}
from memtrack import op_workspace
from test_workspace import CONVS, INPUT_GRADIENTS, WEIGHT_GRADIENTS, _backward_workspace, _conv, _layer, _rule
from stagetorch.ops.kernels import onednn_conv
assert onednn_conv.onednn_isa() == "avx2", onednn_conv.onednn_isa()
aten = torch.ops.aten
rows = []
torch.set_num_threads(2)
for n, c, size, o, k, groups, padding, nd, stride in WEIGHT_GRADIENTS + CONVS:
    for layout in ("contiguous", "channels-last") if nd > 1 else ("contiguous",):
        x, w, go = _layer(n, c, size, o, k, nd, layout, stride, padding, groups)
        args = _conv(x, w, torch.randn(o), stride, padding, False, groups)
        aten.convolution(*args)
        rows.append(("fwd", n, c, o, k, groups, nd, layout, op_workspace(aten.convolution, *args),
                     _rule(aten.convolution, *args)))
        for mask in ((False, True, True), (True, True, True), (True, False, False)):
            rows.append(("".join("FT"[m] for m in mask), n, c, o, k, groups, nd, layout,
                         *_backward_workspace(go, x, w, stride, padding, groups, mask)))
for n, c, size, o, k, groups, padding, nd, stride, layout in INPUT_GRADIENTS:
    x, w, go = _layer(n, c, size, o, k, nd, layout, stride, padding, groups)
    rows.append(("TFF", n, c, o, k, groups, nd, layout,
                 *_backward_workspace(go, x, w, stride, padding, groups, (True, False, False))))
print(json.dumps(rows))
"""


@pytest.mark.skipif(AVX2, reason="this CPU runs oneDNN's AVX2 kernels uncapped: the tests above cover them")
def test_onednn_convolutions_capped_at_avx2_are_never_under():
    """oneDNN capped at AVX2 (ONEDNN_MAX_CPU_ISA, read when oneDNN first runs: a fresh interpreter) runs the
    kernels of a CPU without AVX-512 (jit_avx2, jit_avx2_1x1, AVX2's brgemm and brdgmm, gemm): the rules follow
    the cap, so an AVX-512 machine checks the AVX2 rules too. Every forward, weight and input gradient of the
    cases above at 2 threads, either layout: never under the allocator, and the weight gradient alone (its
    kernels' thread splits replayed) within 1.5x. (Within 2% is what the AVX2 tests above claim where the CPU
    runs AVX2 natively, measured there; this capped run was never measured on an AVX-512 machine, whose cache
    geometry some kernels' blocking reads, so here it claims the bound that matters and no byte-exactness.)"""
    script = _CAPPED_CONVS.format(tests=[str(Path(__file__).parent), str(Path(__file__).parents[1] / "support")])
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(rows) > 200
    under = [row for row in rows if row[-2] > row[-1]]
    loose = [row for row in rows if row[0] == "FTT" and row[-1] > 1.5 * row[-2] + 256]
    assert not under and not loose, (under, loose)


def test_onednn_isa_follows_the_cpu_and_the_cap(monkeypatch):
    """The convolution rules' ISA: AVX-512 where the CPU has AVX512 core and oneDNN is not capped below it
    (ONEDNN_MAX_CPU_ISA, or DNNL_MAX_CPU_ISA), else AVX2."""
    from stagetorch.ops import linalg

    wide = {name: True for name in ("avx512_f", "avx512_bw", "avx512_vl", "avx512_dq", "avx2")}
    for cpu, cap, isa in [(wide, None, "avx512"), (wide, "ALL", "avx512"), (wide, "AVX512_CORE_AMX", "avx512"),
                          (wide, "avx2", "avx2"), (wide, "AVX2_VNNI", "avx2"), ({"avx2": True}, None, "avx2"),
                          ({"avx2": True, "avx512_f": True}, None, "avx2")]:
        monkeypatch.setattr(linalg, "_cpu_capability", lambda cpu=cpu: cpu)
        for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
            monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
            monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
            if cap is not None:
                monkeypatch.setenv(name, cap)
            assert onednn_conv.onednn_isa() == isa, (cpu, cap, name)
            assert onednn_conv.channel_block() == (16 if isa == "avx512" else 8)


@pytest.mark.parametrize("case", [(2, 16, 4, 8, 2, 2), (4, 16, 6, 8, 3, 1)], ids=["3d", "2d"])
def test_native_transposed_convolution_workspace_is_the_allocators(case):
    n, c, size, o, k, stride = case
    nd = 3 if case[-1] == 2 else 2
    x, w, b = torch.randn(n, c, *[size] * nd), torch.randn(c, o, *[k] * nd), torch.randn(o)
    with _mkldnn(False):
        args = _conv(x, w, b, stride, 0 if stride == 2 else 1, True, 1)
        assert abs(_rule(aten.convolution, *args) - op_workspace(aten.convolution, *args)) <= 256
        go = torch.randn_like(aten.convolution(*args))
        args = _conv_backward(go, x, w, stride, 0 if stride == 2 else 1, True, 1, (True, True, True))
        assert abs(_rule(aten.convolution_backward, *args) - op_workspace(aten.convolution_backward, *args)) <= 256


_CL = {4: torch.channels_last, 5: torch.channels_last_3d}


def _laid_out(t, layout):
    """``t`` contiguous, channels-last, or (a 3-d tensor) transposed from (batch, length, channels)."""
    if layout == "contiguous":
        return t.contiguous()
    if t.ndim == 3:
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    return t.contiguous(memory_format=_CL[t.ndim])


# float64 runs the native kernels. (batch, channels in, size, channels out, kernel, groups, padding, dims, stride)
NATIVE_LAYOUT_CONVS = [
    (2, 3, 16, 16, 3, 1, 1, 2, 1), (4, 32, 24, 8, 1, 1, 0, 2, 1), (4, 8, 24, 32, 3, 1, 1, 2, 1),
    (1, 16, 8, 16, 3, 4, 1, 2, 1), (4, 16, 12, 16, 3, 1, 1, 2, 2), (2, 8, 8, 8, 3, 2, 1, 2, 1),
    (1, 8, 8, 8, 3, 8, 1, 2, 1), (5, 4, 8, 4, 3, 4, 1, 2, 1), (16, 3, 16, 16, 3, 1, 1, 2, 1),
    (2, 8, 16, 8, 3, 1, 1, 3, 1), (2, 8, 16, 2, 1, 1, 0, 3, 1), (2, 1, 16, 8, 3, 1, 1, 3, 1),
    (4, 8, 20, 16, 3, 1, 1, 1, 1), (2, 8, 30, 8, 5, 8, 1, 1, 1),
]


@pytest.mark.parametrize("case", NATIVE_LAYOUT_CONVS, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("layouts", [("contiguous", "contiguous"), ("channels-last", "contiguous"),
                                     ("contiguous", "channels-last"), ("channels-last", "channels-last")],
                         ids=lambda p: "-".join(p))
def test_native_convolution_workspace_follows_the_arguments_layouts(case, layouts):
    """The input, the weight and the output gradient are made dense in the format the kernel runs in
    (channels-last where the input suggests it, but for the 3-d and 1-d kernels): a contiguous weight is
    copied for a channels-last input (the xfail this closes: 1.24x the plan), a contiguous input is not
    copied by a 1-d convolution (the rule counted it always), a grouped convolution copies its slices as the
    tensor sliced is laid out. (A 1-d convolution's "channels-last": its input transposed from (batch,
    length, channels), as a sequence model's is.)"""
    x, w, b, stride, padding, groups = _conv_case(case)
    x, w, b = _laid_out(x.double(), layouts[0]), w.detach().double(), b.detach().double()
    args = _conv(x, w, b, stride, padding, False, groups)
    measured, rule = op_workspace(aten.convolution, *args), _rule(aten.convolution, *args)
    assert abs(rule - measured) <= 0.02 * measured + 256, ("forward", measured, rule)
    go = _laid_out(torch.randn_like(aten.convolution(*args)), layouts[1])
    for mask in ((True, True, True), (False, True, True)):
        args = _conv_backward(go, x, w, stride, padding, False, groups, mask)
        measured = _backward_at_the_allocator(go, x, w, stride, padding, groups, mask, False)
        rule = _rule(aten.convolution_backward, *args)
        assert abs(rule - measured) <= 0.02 * measured + 256, ("backward", mask, measured, rule)


@pytest.mark.parametrize("layouts", [("contiguous", "contiguous"), ("channels-last", "contiguous"),
                                     ("contiguous", "channels-last"), ("channels-last", "channels-last")],
                         ids=lambda p: "-".join(p))
@pytest.mark.parametrize("shape", [(6, 64, 4, 4, 4, 4, 0), (2, 4, 12, 12, 3, 1, 1), (2, 8, 8, 8, 2, 2, 0)])
def test_pooling_backward_workspace_follows_the_layouts(shape, layouts):
    """The kernel runs in the format the output gradient suggests: the input gradient (in the input's
    format), the gradient and max pooling's indices laid out otherwise are copied."""
    n, c, h, w_, k, s_, p = shape
    x = _laid_out(torch.randn(n, c, h, w_, dtype=torch.float64), layouts[0])
    out, indices = aten.max_pool2d_with_indices(x, [k, k], [s_, s_], [p, p])
    go = _laid_out(torch.randn_like(out), layouts[1])
    args = (go, x, [k, k], [s_, s_], [p, p], False, True, None)
    assert _rule(aten.avg_pool2d_backward, *args) == op_workspace(aten.avg_pool2d_backward, *args)
    args = (go, x, [k, k], [s_, s_], [p, p], [1, 1], False, indices)
    assert _rule(aten.max_pool2d_with_indices_backward, *args) == op_workspace(aten.max_pool2d_with_indices_backward, *args)


@pytest.mark.parametrize("case", [((2, 8, 3, 3), (6, 6)), ((2, 3, 3, 3), (6, 6)), ((2, 8, 50, 50), (100, 100)),
                                  ((1, 1, 8, 8), (16, 16)), ((2, 4, 8), (16,)), ((2, 4, 3, 3, 3), (6, 6, 6)),
                                  ((2, 2, 3, 3, 3), (6, 6, 6))], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "channels-last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nearest_upsampling_workspace_is_the_allocators(case, layout, dtype):
    """The vectorized channels-last kernel copies a contiguous input and output (5x the input for a 2x
    upsampling); the generic one keeps an index and a weight per output position along each dim."""
    shape, size = case
    x = torch.randn(shape, dtype=dtype)
    x = _laid_out(x, layout) if x.ndim > 3 else x
    op = {1: aten.upsample_nearest1d, 2: aten.upsample_nearest2d, 3: aten.upsample_nearest3d}[len(size)].default
    assert _rule(op, x, list(size)) == op_workspace(op, x, list(size))


@pytest.mark.parametrize("layouts", [("contiguous", "contiguous"), ("channels-last", "contiguous"),
                                     ("contiguous", "channels-last"), ("channels-last", "channels-last")],
                         ids=lambda p: "-".join(p))
@pytest.mark.parametrize("shape", [(5, 8, 6, 6), (2, 16, 12, 12), (4, 8, 10)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_norm_workspaces_follow_the_layouts(shape, layouts, dtype):
    """Batch norm's backward keeps an input-sized temporary only where the input and its gradient share a
    layout (contiguous or channels-last; "channels-last" of a 3-d tensor: transposed, which it never
    shares); its forward and group norm's over channels-last inputs keep per-channel buffers."""
    x = _laid_out(torch.randn(shape, dtype=dtype), layouts[0])
    c = shape[1]
    w, mean, var = torch.randn(c, dtype=dtype), torch.zeros(c, dtype=dtype), torch.ones(c, dtype=dtype)
    args = (x, w, None, mean, var, True, 0.1, 1e-5)
    assert _rule(aten.native_batch_norm, *args) == op_workspace(aten.native_batch_norm, *args)
    out, saved_mean, saved_invstd = aten.native_batch_norm(*args)
    go = _laid_out(torch.randn_like(x), layouts[1])
    args = (go, x, w, mean, var, saved_mean, saved_invstd, True, 1e-5, [True, True, True])
    assert _rule(aten.native_batch_norm_backward, *args) == op_workspace(aten.native_batch_norm_backward, *args)
    if x.ndim == 4:
        n, hw = shape[0], shape[2] * shape[3]
        args = (x, w, None, n, c, hw, 2, 1e-5)
        assert _rule(aten.native_group_norm, *args) == op_workspace(aten.native_group_norm, *args)
        out, mean, rstd = aten.native_group_norm(*args)
        args = (go, x, mean, rstd, w, n, c, hw, 2, [True, True, True])
        assert _rule(aten.native_group_norm_backward, *args) == op_workspace(aten.native_group_norm_backward, *args)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("case", [((3, 16, 16), 1), ((2, 5, 3, 8), 2), ((64, 16), 1)], ids=str)
@pytest.mark.parametrize("layouts", [("contiguous", "contiguous"), ("transposed", "contiguous"),
                                     ("contiguous", "transposed"), ("transposed", "transposed")],
                         ids=lambda p: "-".join(p))
def test_layer_norm_workspaces_follow_the_layouts_and_the_threads(case, layouts, threads):
    """The kernels make the input and the output gradient contiguous (a LayerNorm over a transposed
    activation: a copy of each); the backward reduces the weight's and the bias's gradients through two
    per-thread buffers of the normalized shape."""
    shape, k = case
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        def laid_out(t, layout):
            return t.transpose(0, 1).contiguous().transpose(0, 1) if layout == "transposed" else t

        x = laid_out(torch.randn(shape, dtype=torch.float64), layouts[0])
        normalized = list(shape[-k:])
        w, b = torch.randn(normalized, dtype=torch.float64), torch.randn(normalized, dtype=torch.float64)
        args = (x, normalized, w, b, 1e-5)
        assert _rule(aten.native_layer_norm, *args) == op_workspace(aten.native_layer_norm, *args)
        _, mean, rstd = aten.native_layer_norm(*args)
        go = laid_out(torch.randn(shape, dtype=torch.float64), layouts[1])
        for weight, mask in ((w, [True, True, True]), (w, [True, False, False]), (w, [False, True, False]), (None, [True, False, False])):
            args = (go, x, normalized, mean, rstd, weight, b if weight is not None else None, mask)
            assert _rule(aten.native_layer_norm_backward, *args) == op_workspace(aten.native_layer_norm_backward, *args), mask
    finally:
        torch.set_num_threads(before)


def _lstm_layer(steps, batch, features, hidden, train=True, reverse=False):
    """One layer's arguments as nn.LSTM(batch_first=True, num_layers=2) stages them."""
    torch.manual_seed(0)
    x = torch.randn(steps, batch, features)
    weights = [torch.randn(4 * hidden, features), torch.randn(4 * hidden, hidden), torch.randn(4 * hidden), torch.randn(4 * hidden)]
    states = [torch.randn(batch, hidden), torch.randn(batch, hidden)]
    return (x, *weights, *states, reverse, [], 2, hidden, 2, True, False, True, train)


def _lstm_backward(args, out, grads):
    """The layer's backward arguments, its forward's ``args`` and ``out``; ``grads``: the output's and the
    final states' gradients (None: not read)."""
    x, w_ih, w_hh, b_ih, b_hh, hx, cx = args[:7]
    return (x, w_ih, w_hh, b_ih, b_hh, hx, cx, *out[:3], *grads, args[7], 2, w_hh.shape[1], 2, True, True, False, [],
            True, out[3])


# oneDNN's reference LSTM (every float32 layer that keeps a workspace: training) computed as
# stagetorch/ops/recurrent.py says, exact. (steps, batch, features, hidden): the test models' layers; 64
# features at batch 1/2/4 (the old fit's +24/17/11% in the backward); sizes oneDNN pads (12, 24, 100: not a
# multiple of 16 floats; 64 hidden: 4 gates of 64 make a row of 256, padded against 4K aliasing; 200, 256);
# a batch of 130 (one step's gates in the forward's scratchpad, not every step's); one step.
LSTMS = [(7, 1, 8, 32), (7, 2, 8, 32), (7, 4, 8, 32), (7, 16, 8, 32), (7, 16, 32, 32), (14, 16, 8, 32), (7, 16, 8, 64),
         (7, 64, 8, 32), (7, 1, 64, 64), (7, 2, 64, 64), (7, 4, 64, 64), (48, 4, 64, 64), (5, 130, 24, 12),
         (1, 3, 100, 200), (3, 2, 12, 256), (33, 8, 256, 24)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", LSTMS, ids=lambda s: "x".join(map(str, s)))
def test_lstm_workspace_is_the_allocators(shape, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        args = _lstm_layer(*shape, reverse=shape[0] % 2 == 0)
        measured, rule = op_workspace(aten.mkldnn_rnn_layer, *args), _rule(aten.mkldnn_rnn_layer, *args)
        assert rule == measured, ("forward", measured, rule)
        with torch._C._AutoDispatchBelowAutograd():
            out = aten.mkldnn_rnn_layer(*args)
        grad = torch.randn_like(out[0])
        # The output's gradient alone, contiguous (the models read the output: the final states' are None,
        # zeros inside the kernel); a slice of a bidirectional layer's, strided, copied inside; all three
        # given, the states' expanded from a sum's backward (copied too).
        strided = torch.randn(*out[0].shape[:2], 2 * shape[3])[..., : shape[3]]
        states = [torch.ones(1, 1).expand_as(out[1]), torch.ones(1, 1).expand_as(out[2])]
        for grads in ((grad, None, None), (strided, None, None), (grad, *states)):
            back = _lstm_backward(args, out, grads)
            measured = op_workspace(aten.mkldnn_rnn_layer_backward, *back)
            rule = _rule(aten.mkldnn_rnn_layer_backward, *back)
            assert rule == measured, ("backward", [g is not None and g.is_contiguous() for g in grads], measured, rule)
    finally:
        torch.set_num_threads(before)


def test_lstm_backward_clones_a_cell_state_that_shares_the_hidden_states_storage():
    """``nn.LSTM(x, (h0, h0))``: ATen's backward clones the initial cell state where it shares the hidden
    state's storage, and the rule counts the clone."""
    args = list(_lstm_layer(7, 4, 16, 32))
    with torch._C._AutoDispatchBelowAutograd():
        out = aten.mkldnn_rnn_layer(*args)
    grads = (torch.randn_like(out[0]), None, None)
    apart = op_workspace(aten.mkldnn_rnn_layer_backward, *_lstm_backward(args, out, grads))
    args[6] = args[5]
    back = _lstm_backward(args, out, grads)
    measured = op_workspace(aten.mkldnn_rnn_layer_backward, *back)
    assert measured == apart + args[5].nbytes
    assert _rule(aten.mkldnn_rnn_layer_backward, *back) == measured


@pytest.mark.parametrize("shape", [(16, 4, 12, 12, 8), (4, 4, 16, 16, 8), (2, 2, 100, 100, 16), (2, 2, 300, 300, 16), (1, 2, 40, 70, 8)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_flash_attention_workspace_is_the_allocators(shape, causal, dtype):
    """The kernel accumulates in float, and in double for double inputs (the zoo's float64 models)."""
    b, h, length, source, e = shape
    if causal and length != source:
        pytest.skip("causal attention of unequal lengths")
    q, k, v = (torch.randn(b, h, n, e, dtype=dtype) for n in (length, source, source))
    op = aten._scaled_dot_product_flash_attention_for_cpu
    assert _rule(op, q, k, v, 0.0, causal) == op_workspace(op, q, k, v, 0.0, causal)
    out, lse = op(q, k, v, 0.0, causal)
    back = aten._scaled_dot_product_flash_attention_for_cpu_backward
    # The rule copies the output gradient, as the kernel does when it is laid out (batch, heads, L, E); one laid
    # out (batch, L, heads, E), as after transpose(1, 2).reshape, is read in place: the rule over-estimates it.
    contiguous = torch.randn_like(out)
    strided = torch.randn(b, length, h, e, dtype=dtype).transpose(1, 2)
    rule = _rule(back, contiguous, q, k, v, out, lse, 0.0, causal)
    assert rule == op_workspace(back, contiguous, q, k, v, out, lse, 0.0, causal)
    assert rule == op_workspace(back, strided, q, k, v, out, lse, 0.0, causal) + contiguous.nbytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_flash_attention_outputs_are_planned_at_their_real_bytes(dtype):
    """The logsumexp the kernel returns is in its accumulation type (double for double inputs), where torch
    2.11's meta kernel, and so the traced value, says float: the plan counts the real tensor's bytes (the zoo's
    float64 plans were 1,792 B per attention layer under the allocator on torch 2.11)."""
    q, k, v = (torch.randn(2, 4, 16, 8, dtype=dtype) for _ in range(3))
    op = aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = op(q, k, v, 0.0, False)
    eqn, _ = _staged(op, q, k, v, 0.0, False)
    planned = effect(eqn).outputs
    assert [planned.get(i, eqn.outvars[i].aval.nbytes) for i in (0, 1)] == [out.nbytes, lse.untyped_storage().nbytes()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("made", ["projected", "copied"])
def test_flash_attention_backward_reads_a_gradient_the_ir_shows_laid_out_in_place(made, dtype):
    """The output gradient as a model's backward makes it: a projection's gradient (batch * L, heads * E) viewed
    (batch, L, heads, E) and transposed is read in place; ``.contiguous()`` of that is copied. The IR shows which
    (costing.Layouts), and the rule follows it."""
    b, h, length, e = 2, 4, 40, 8
    q, k, v = (torch.randn(b, h, length, e, dtype=dtype) for _ in range(3))
    op = aten._scaled_dot_product_flash_attention_for_cpu
    back = aten._scaled_dot_product_flash_attention_for_cpu_backward
    out, lse = op(q, k, v, 0.0, False)

    def grad_of(a, w):
        g = (a @ w).view(b, length, h, e).transpose(1, 2)
        return g.contiguous() if made == "copied" else g

    a, w = torch.randn(b * length, 16, dtype=dtype), torch.randn(16, h * e, dtype=dtype)

    def step(a, w, q, k, v, out, lse):
        return back(grad_of(a, w), q, k, v, out, lse, 0.0, False)

    graph = stagetorch.make_ir(step)(a, w, q, k, v, out, lse)
    (eqn,) = [x for x in graph.eqns if x.prim is back.default]
    rule = workspace(eqn, layouts=Layouts(graph))
    assert rule == op_workspace(back, grad_of(a, w), q, k, v, out, lse, 0.0, False)
    # Without the layouts (an argument of unknown strides) the copy is counted.
    assert workspace(eqn) == rule + (0 if made == "copied" else q.nbytes)


@pytest.mark.parametrize("made", ["permuted", "contiguous"])
def test_a_native_convolution_backward_copies_a_permuted_output_gradient_the_ir_shows(made):
    """float64 runs the native kernels, which make the output gradient contiguous: a copy where it comes
    permuted (channels-last LayerNorm's gradient, ConvNeXt), none where it comes contiguous."""
    x, w = torch.randn(2, 3, 8, 8, dtype=torch.float64), torch.randn(4, 3, 3, 3, dtype=torch.float64)
    a, m = torch.randn(128, 5, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)

    def grad_of(a, m):
        g = (a @ m).view(2, 8, 8, 4).permute(0, 3, 1, 2)
        return g if made == "permuted" else g.contiguous()

    def step(a, m, x, w):
        return aten.convolution_backward(*_conv_backward(grad_of(a, m), x, w, 1, 1, False, 1, (True, True, False)))

    graph = stagetorch.make_ir(step)(a, m, x, w)
    (eqn,) = [e for e in graph.eqns if e.prim is aten.convolution_backward.default]
    rule = workspace(eqn, layouts=Layouts(graph))
    assert rule == op_workspace(aten.convolution_backward, *_conv_backward(grad_of(a, m), x, w, 1, 1, False, 1, (True, True, False)))
    assert rule - workspace(eqn) == (a.shape[0] * m.shape[1] * 8 if made == "permuted" else 0)


@pytest.mark.parametrize("shape", [(4, 32, 24, 24), (2, 8, 16, 16, 16), (16, 16), (8, 3, 5, 5), (1, 64), (3, 64, 1)])
def test_norm_backward_workspaces_are_the_allocators(shape):
    x = torch.randn(shape)
    c = shape[1]
    w, mean, var = torch.randn(c), torch.zeros(c), torch.ones(c)
    out, saved_mean, saved_invstd = aten.native_batch_norm(x, w, None, mean, var, True, 0.1, 1e-5)
    args = (torch.randn_like(x), x, w, mean, var, saved_mean, saved_invstd, True, 1e-5, [True, True, True])
    assert _rule(aten.native_batch_norm_backward, *args) == op_workspace(aten.native_batch_norm_backward, *args)
    if len(shape) > 2:
        groups = 1 if c % 2 else 2
        n, hw = shape[0], x[0, 0].numel()
        out, mean, rstd = aten.native_group_norm(x, w, None, n, c, hw, groups, 1e-5)
        args = (torch.randn_like(x), x, mean, rstd, w, n, c, hw, groups, [True, True, True])
        assert _rule(aten.native_group_norm_backward, *args) == op_workspace(aten.native_group_norm_backward, *args)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (2, 64), (7, 64), (2, 65536 // 64), (4, 32, 1, 1), (4, 32, 6, 6)])
def test_batch_norm_workspaces_follow_the_threads_the_mode_and_the_weight(shape, dtype, threads):
    """Over (N, C) the CPU batch norm reduces through per-thread buffers of C accumulators: on a small batch
    (a chunk of one or two examples) they are larger than the input-sized temporary the backward also makes.
    A BatchNorm1d of 65536 features over two examples held 512 KiB more at the allocator than its plan."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.randn(shape, dtype=dtype)
        c = shape[1]
        mean, var = torch.zeros(c, dtype=dtype), torch.ones(c, dtype=dtype)
        for weight in (torch.randn(c, dtype=dtype), None):
            for training in (True, False) if x.numel() > c else (False,):  # one value per channel: no statistics
                forward = (x, weight, None, mean, var, training, 0.1, 1e-5)
                assert _rule(aten.native_batch_norm, *forward) == op_workspace(aten.native_batch_norm, *forward), (
                    weight is None, training)
                _, saved_mean, saved_invstd = aten.native_batch_norm(*forward)
                saved = (saved_mean, saved_invstd) if training else (None, None)
                backward = (torch.randn_like(x), x, weight, mean, var, *saved, training, 1e-5, [True, weight is not None, True])
                assert _rule(aten.native_batch_norm_backward, *backward) == op_workspace(
                    aten.native_batch_norm_backward, *backward), (weight is None, training)
    finally:
        torch.set_num_threads(before)


def test_a_custom_op_workspace_is_held_while_it_runs_only():
    @torch.library.custom_op("stagetorch_test::scratch_heavy", mutates_args=())
    def scratch_heavy(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @scratch_heavy.register_fake
    def _(x):
        return torch.empty_like(x)

    def fn(x):
        return torch.ops.stagetorch_test.scratch_heavy(x).exp().sum()

    x = torch.randn(256, 256)
    graph = stagetorch.make_ir(fn)(x)
    before = peak_bytes(graph)
    assert before == 3 * x.nbytes  # x, the op's output, its exp
    stagetorch.ops.register(torch.ops.stagetorch_test.scratch_heavy, workspace=lambda eqn: 5 * eqn.invars[0].aval.nbytes)
    assert peak_bytes(graph) == 2 * x.nbytes + 5 * x.nbytes  # during the op: x, its output, the workspace
    assert stagetorch.ops.lookup(torch.ops.stagetorch_test.scratch_heavy.default).workspace is not None


# -- oneDNN's half-precision matmul on the CPU (stagetorch/ops/linalg.py, stagetorch/ops/kernels/onednn_matmul.py) ---------
# Where the kernel is one the replay of oneDNN's blocking search follows (bfloat16 on AMX-BF16, float16 on
# AVX512-FP16, oneDNN 3.12), the rule is the allocator's bytes exactly (tools/grids/onednn_matmul_grid.py: a grid of
# 18,000 products and 3,500 random ones at 1-16 threads). Elsewhere it falls back to a bound from above over
# every blocking oneDNN may choose (derived from its sources): never under the allocator.

from stagetorch.ops import linalg  # noqa: E402

HALF_MATMULS = [  # (batch or 0, M, K, N, A transposed, B transposed)
    (0, 8, 256, 3, False, False), (0, 32, 256, 3, False, False), (0, 128, 4, 256, False, True),
    (0, 3, 128, 256, True, False), (0, 256, 32, 4, True, False), (0, 100, 37, 51, False, False),
    (0, 1, 1000, 64, False, False), (0, 64, 1, 100, False, False), (0, 5, 1000, 7, False, True),
    (0, 17, 512, 1000, False, False), (0, 300, 680, 129, True, True), (0, 16, 16, 16, False, False),
    (0, 4, 4, 256, False, True), (4, 12, 64, 12, False, False), (2, 8, 3072, 100, False, True),
    (3, 40, 16, 40, True, False), (8, 2, 2, 2, False, False),
    # A weight's gradient over many tokens: float16 splits K across threads, each summing all of M x N
    # (3,442,432 B at 2 threads); bfloat16's blocks stay within L2.
    (0, 4096, 4096, 64, True, False),
    # Attention's two products (16 heads of 128 tokens by 64).
    (16, 128, 64, 128, False, True), (16, 128, 128, 64, False, False),
    # A single row (a row of A, tagged transposed by oneDNN; float16 runs ATen's gemv), a single column.
    (0, 1, 64, 256, False, True), (0, 256, 64, 1, False, False),
    # Blockings of tied scores: float32 rounding decides (2 threads: 77,440 B, 28,288 if not), and the hash
    # set oneDNN walks M's blocks from (2 threads: 154,496 B, 170,880 for the other tied pick).
    (0, 64, 100, 256, False, False), (0, 130, 140, 155, True, True),
]
# Over 2^29 multiply-adds, where the bound misses bfloat16 products (the accumulator oneDNN keeps for all of a
# thread's rows when K is blocked): a transformer's Linear 768 -> 3072 over 512 tokens (forward: 0.93 of the
# allocator at 1 thread), its input and weight gradients; a 2048-token Linear 2048 -> 512 (5,248,128 B at 1
# thread, the bound 2,433,024).
HALF_MATMULS_LARGE = [
    (0, 512, 768, 3072, False, True), (0, 512, 3072, 768, False, False), (0, 768, 512, 3072, True, False),
    (0, 2048, 2048, 512, False, True),
]


def _half_case(case, dtype):
    b, m, k, n, ta, tb = case
    lead = (b,) if b else ()
    a = torch.zeros(*lead, k, m, dtype=dtype).transpose(-1, -2) if ta else torch.zeros(*lead, m, k, dtype=dtype)
    w = torch.zeros(*lead, n, k, dtype=dtype).transpose(-1, -2) if tb else torch.zeros(*lead, k, n, dtype=dtype)
    if b:
        return (aten.bmm, (a, w)), (aten.baddbmm, (torch.zeros(b, m, n, dtype=dtype), a, w))
    return (aten.mm, (a, w)), (aten.addmm, (torch.zeros(n, dtype=dtype), a, w))


@pytest.mark.parametrize("threads", [1, 2, 3])  # oneDNN books one buffer per thread asked for, cores or not
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", HALF_MATMULS + HALF_MATMULS_LARGE, ids=lambda c: "x".join(map(str, c)))
def test_half_precision_matmul_workspace_is_the_allocators(case, dtype, threads):
    """A float16/bfloat16 product over 16 * 16 * 16 multiply-adds runs oneDNN, which allocates a scratchpad
    per thread sized by its blocking search (a 32 x 256 by 256 x 3 float16 product: 166,016 B at 2 threads); the
    rule replays the search and says the allocator's bytes. At or under that size, ATen's own gemm: 0. On a CPU
    where oneDNN does not take the type (no AVX512-BF16 or AVX512-FP16: an AMD EPYC of AVX2), every product runs
    ATen's gemm, which allocates nothing (measured there at 1-3 threads): the rule says 0 too."""
    kernel = linalg._onednn_half(dtype)
    if kernel == "other" or (kernel is not None and linalg._replay_caches() is None):
        pytest.skip("replayed for oneDNN 3.12 on AMX-BF16 and AVX512-FP16; this CPU or build runs another oneDNN "
                    "kernel (test_half_precision_matmul_on_other_isas_is_never_over_the_bound covers it)")
    with _threads(threads):
        for op, args in _half_case(case, dtype):
            measured, rule = op_workspace(op, *args), _rule(op, *args)
            if kernel is None:
                assert measured == rule == 0, (op, measured, rule)
            elif case[2] == 1:  # K = 1: the blocking oneDNN's primitive cache holds decides; the rule the larger
                assert measured <= rule, (op, measured, rule)
            else:
                assert measured == rule, (op, measured, rule)


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", HALF_MATMULS + HALF_MATMULS_LARGE, ids=lambda c: "x".join(map(str, c)))
def test_half_precision_matmul_fallback_bound_is_above_the_allocators(case, dtype, threads, monkeypatch):
    """Where the search is not replayed (another oneDNN version here; another ISA below), the rule is a bound
    from above over every blocking oneDNN's searches may choose (stagetorch/ops/kernels/onednn_matmul.py's ``bound``): never
    under the allocator, the large bfloat16 products the fitted bound missed included (a 2048-token Linear
    2048 -> 512: 5,248,128 B, the old bound 2,433,024). Loosest where the AMX macro search may run (bfloat16, A
    plain: its strips may span all of N; 100x a 512-token Linear 768 -> 3072's 119,936 B), else within 12x."""
    if linalg._onednn_half(dtype) not in ("amx", "avx512"):
        # ATen's gemm (no oneDNN for the type: the test above checks its 0), or another oneDNN kernel (the
        # ISA-capped test below measures those on an AMX CPU): the bound's looseness was measured on these two.
        pytest.skip("this CPU runs ATen's gemm or another oneDNN kernel, where the rule is not this bound")
    monkeypatch.setattr(linalg, "_replay_caches", lambda: None)
    with _threads(threads):
        for op, args in _half_case(case, dtype):
            measured, rule = op_workspace(op, *args), _rule(op, *args)
            b, m, k, n = (case[0] or 1), *case[1:4]
            if b * m * k * n <= 16 * 16 * 16:
                assert measured == rule == 0, (op, measured, rule)
                continue
            looseness = 128 if dtype == torch.bfloat16 and not case[4] else 12
            assert measured <= rule <= looseness * measured + 64 * 1024, (op, measured, rule)


_CAPPED = """
import json, sys
import torch
sys.path[:0] = {tests!r}
from memtrack import op_workspace
from test_workspace import _half_case, _rule
from stagetorch.ops import linalg
rows = []
for threads in (1, 3):
    torch.set_num_threads(threads)
    for dtype in (torch.bfloat16, torch.float16):
        assert linalg._onednn_half(dtype) in ("other", None), linalg._onednn_half(dtype)
        for case in {cases!r}:
            for op, args in _half_case(case, dtype):
                rows.append((threads, str(dtype), case, op.__name__, op_workspace(op, *args), _rule(op, *args)))
print(json.dumps(rows))
"""


@pytest.mark.skipif(linalg._onednn_half(torch.bfloat16) != "amx", reason="caps oneDNN's ISA below this CPU's AMX")
@pytest.mark.parametrize("isa", ["AVX512_CORE_BF16", "AVX512_CORE"])
def test_half_precision_matmul_on_other_isas_is_never_over_the_bound(isa):
    """Another ISA, run on this CPU by capping oneDNN's (ONEDNN_MAX_CPU_ISA, read when oneDNN first runs: a
    fresh interpreter): bfloat16 on AVX512-BF16 without AMX (the AVX512 brgemm search), on AVX512 without BF16
    (gemm_bf16_matmul, its float32 result); float16 runs what the cap leaves it. The rule sees the cap, falls
    back to the bound, and is never under the allocator."""
    cases = [c for c in HALF_MATMULS + HALF_MATMULS_LARGE[-1:] if (c[0] or 1) * c[1] * c[2] * c[3] > 4096]
    script = _CAPPED.format(tests=[str(Path(__file__).parent), str(Path(__file__).parents[1] / "support")], cases=cases)
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": isa,
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(rows) == 2 * 2 * 2 * len(cases)
    for threads, dtype, case, op, measured, rule in rows:
        assert measured <= rule, (isa, threads, dtype, case, op, measured, rule)
    # The bound is not vacuous: within 12x (+64 KiB) of what bfloat16's kernels booked.
    assert all(rule <= 12 * measured + 64 * 1024 for _, dtype, *_, measured, rule in rows if "bfloat16" in dtype)


def test_half_precision_matmul_kernel_families_follow_the_isa_cap(monkeypatch):
    """ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA) below the CPU's ISA: the replay's kernels no longer run, so
    the rule falls back; the cap decides which of the bound's kernels may (AMX, brgemm, gemm_bf16_matmul)."""
    monkeypatch.setattr(linalg, "_cpu_capability", lambda: {"amx_bf16": True, "avx512_bf16": True, "avx512_fp16": True})
    for cap, bf16, f16 in [(None, (True, True, False), (False, True, False)),
                           ("ALL", (True, True, False), (False, True, False)),
                           ("AVX512_CORE_BF16", (False, True, False), (False, False, False)),
                           ("avx512_core", (False, False, True), (False, False, False)),
                           ("SOMETHING_NEW", (False, True, True), (False, True, False))]:
        for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
            monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
            monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
            if cap is not None:
                monkeypatch.setenv(name, cap)
            assert linalg._kernel_families(torch.bfloat16) == bf16, (cap, name)
            assert linalg._kernel_families(torch.float16) == f16, (cap, name)
            assert linalg._max_isa_capped() == (cap not in (None, "ALL")), (cap, name)


def test_half_precision_matmul_at_16_threads_is_never_under(monkeypatch):
    """At 16 threads the AMX micro search may split K across threads (each then sums all of M x N in float32):
    not replayed, the rule bounds it (without the macro search's terms, which declined). A weight's gradient
    of K 2048 tokens, at 16 threads asked (oneDNN books per thread asked, cores or not)."""
    if linalg._onednn_half(torch.bfloat16) != "amx" or linalg._replay_caches() is None:
        pytest.skip("the replay follows oneDNN 3.12 on AMX-BF16")
    with _threads(16):
        for m, k, n in ((256, 2048, 128), (64, 4096, 64)):
            for op, args in _half_case((0, m, k, n, True, False), torch.bfloat16):
                measured, rule = op_workspace(op, *args), _rule(op, *args)
                assert measured <= rule <= 40 * measured, (op, m, k, n, measured, rule)


def test_half_precision_matmul_workspace_follows_the_switches_and_copies():
    """oneDNN off (torch.backends.mkldnn): ATen's gemm, no workspace; float32: none either. An operand laid out
    neither contiguous nor transposed is copied contiguous first, and the rule counts the copy."""
    a, w = torch.zeros(32, 256, dtype=torch.float16), torch.zeros(256, 3, dtype=torch.float16)
    with _mkldnn(False):
        assert op_workspace(aten.mm, a, w) == _rule(aten.mm, a, w) == 0
    assert op_workspace(aten.mm, a.float(), w.float()) == 0 and not _rule(aten.mm, a.float(), w.float())
    if linalg._onednn_half(torch.float16) != "avx512":
        pytest.skip("the bounds were measured on AVX512-FP16 kernels; this CPU runs others")
    strided = torch.zeros(32, 512, dtype=torch.float16)[:, ::2]
    measured, rule = op_workspace(aten.mm, strided, w), _rule(aten.mm, strided, w)
    assert measured - op_workspace(aten.mm, a, w) == strided.contiguous().nbytes
    assert rule - _rule(aten.mm, a, w) == strided.contiguous().nbytes and measured <= rule
    # Strides unknown (no layouts): both operands counted as copied, the costlier case.
    graph = stagetorch.make_ir(lambda a, w: aten.mm(a, w))(a, w)
    (eqn,) = [e for e in graph.eqns if e.prim is aten.mm.default]
    assert workspace(eqn) == workspace(eqn, layouts=Layouts(graph)) + a.nbytes + w.nbytes


def test_an_autocast_step_under_a_budget_stays_under_it_at_the_allocator():
    """bfloat16 autocast in ``stagetorch.jit``: before the rule the plan (2 chunks) ran 1,338,884 B at the
    allocator against a 1.2 MiB budget; the scratchpads now planned for, it stays under."""
    if linalg._onednn_half(torch.bfloat16) is None:
        pytest.skip("bfloat16 matmuls run ATen's gemm here")
    from memtrack import AllocatorPeak

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 128),
                                    torch.nn.GELU(), torch.nn.Linear(128, 10))
        x, y = torch.randn(1024, 64), torch.randint(0, 10, (1024,))

        def step(x, y):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            return loss.detach()

        staged = stagetorch.jit(step, memory_budget="1.2MiB")
        staged(x, y)  # planned, and the gradients exist from here on
        with AllocatorPeak([*model.parameters(), x, y, *(p.grad for p in model.parameters())]) as run:
            staged(x, y)
        assert run.peak <= 1.2 * 2**20, run.peak
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("number", [0.9, 2])
def test_a_wrapped_python_number_is_the_allocators(number, dtype):
    """``beta ** step`` and ``1 - t``: the CPU kernel wraps the number as a 0-dim tensor and casts it to the
    result's dtype inside the call (12 B for float32, 8 B for a float to a float64 result). An optimizer's
    bias corrections run these in its commit, where they were the 12 B an AdamW stepped inside ran over its
    plan (tests/interpreters/test_memory.py)."""
    steps = [torch.tensor(3.0, dtype=dtype) for _ in range(4)]

    def rule(fn):
        graph = stagetorch.make_ir(fn)(*steps)
        (eqn,) = [e for e in graph.eqns if getattr(e.prim, "overloadpacket", None) in (aten.pow, aten._foreach_pow, aten.rsub)]
        return workspace(eqn)

    cases = [
        (lambda *ts: torch._foreach_pow(number, list(ts)), lambda: op_workspace(aten._foreach_pow, number, steps)),
        (lambda t, *_: torch.pow(number, t), lambda: op_workspace(aten.pow, number, steps[0])),
        (lambda t, *_: number - t, lambda: op_workspace(aten.rsub, steps[0], number)),
    ]
    for fn, measured in cases:
        expected = measured()
        assert expected > 0 and rule(fn) == expected, (rule(fn), expected)


# Ops on a tensor and a Python number, measured at the allocator: the number at argument 1 (``other``) or 0
# (``self``), or a _foreach_ op's (a list of tensors first). Each wraps the number as a 0-dim tensor and casts
# it, and any tensor of another dtype, to the dtype it computes in (stagetorch/ops/elementwise.py).
_NUMBER_OTHER = [
    "add.Tensor", "sub.Tensor", "mul.Tensor", "div.Tensor", "add.Scalar", "sub.Scalar", "mul.Scalar", "div.Scalar",
    "rsub.Scalar", "eq.Scalar", "ne.Scalar", "lt.Scalar", "ge.Scalar", "remainder.Scalar", "fmod.Scalar",
    "floor_divide.Scalar", "copysign.Scalar", "xlogy.Scalar_Other", "bitwise_and.Scalar",
    "special_xlog1py.other_scalar", "mul_.Tensor", "add_.Tensor", "sub_.Scalar", "div_.Tensor", "mul_.Scalar",
]
_NUMBER_SELF = ["pow.Scalar", "remainder.Scalar_Tensor", "xlogy.Scalar_Self"]
_NUMBER_FOREACH = ["_foreach_mul.Scalar", "_foreach_add_.Scalar", "_foreach_div.Scalar", "_foreach_sub_.ScalarList",
                   "_foreach_mul.ScalarList", "_foreach_pow.ScalarAndTensor"]


def _overload(name):
    packet, overload = name.split(".")
    return getattr(getattr(aten, packet), overload)


@pytest.mark.parametrize("number", [2, 0.5, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("name", _NUMBER_OTHER + _NUMBER_SELF + _NUMBER_FOREACH)
def test_an_op_on_a_python_number_is_the_allocators(name, dtype, number):
    """``x * 2``, ``x > 0``, ``x.mul_(beta)``, an int64 tensor times 0.5 (computed in float32: the tensor is
    cast too), a _foreach_ op over tensors of two dtypes (the most of one call per tensor)."""
    op = _overload(name)
    torch.manual_seed(0)
    x = (torch.rand(5, 7) + 1).to(dtype)
    if name.startswith("_foreach"):
        tensors = [x, (torch.rand(9) + 1).to(torch.float64 if dtype != torch.float64 else torch.float32)]
        given = [number, number] if name.endswith("List") else number
        args = (given, tensors) if name.endswith("ScalarAndTensor") else (tensors, given)
    else:
        args = (number, x) if name in _NUMBER_SELF else (x, number)
    try:
        expected = op_workspace(op, *[[t.clone() for t in a] if isinstance(a, list) and a and isinstance(a[0], torch.Tensor)
                                      else a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    except (RuntimeError, TypeError):
        pytest.skip("torch refuses these operands")
    assert expected > 0
    assert _rule(op, *args) == expected


def test_an_op_on_a_complex_number_or_on_two_tensors():
    """A complex number makes a float32 tensor complex (the tensor cast as well); a tensor for ``other``
    wraps nothing (the rule says 0; the allocator agrees where the dtypes match)."""
    x = torch.rand(5, 7)
    assert _rule(aten.mul.Tensor, x, 1j) == op_workspace(aten.mul.Tensor, x, 1j) == 16 + 8 + 35 * 8
    assert _rule(aten.mul.Tensor, x, x) == op_workspace(aten.mul.Tensor, x, x) == 0


def test_a_division_by_a_number_rounding_computes_in_the_operands_dtype():
    """``x // 2`` on int64 stays int64 (the number wrapped, nothing cast); ``x / 2`` computes in float32."""
    x = torch.arange(35).reshape(5, 7)
    for mode, expected in (("floor", 8), ("trunc", 8), (None, 8 + 4 + 35 * 4)):
        def fn(t, mode=mode):
            return torch.div(t, 2, rounding_mode=mode)

        graph = stagetorch.make_ir(fn)(x)
        (eqn,) = [e for e in graph.eqns if e.prim in (aten.div.Tensor_mode, aten.div.Tensor)]
        assert workspace(eqn) == op_workspace(fn, x) == expected, mode


# Loss kernels and reductions (stagetorch/ops/losses.py, reductions.py). A reduced loss computes the unreduced
# loss first, a tensor of the operands' broadcast shape; mse_loss and smooth_l1_loss (structured kernels) make
# their output at that shape and resize it to 0-dim, keeping the storage for as long as the loss lives, as
# binary_cross_entropy and soft_margin_loss do (they compute the loss in their output). A reduction to one
# element over 32768 elements or more, on more than one thread, sums each thread's part into a buffer.
_NONE, _MEAN, _SUM = 0, 1, 2
# name: (op, its arguments after (input, target), with R where the reduction goes)
R = object()
LOSSES = {
    "mse": (aten.mse_loss, (R,)),
    "smooth_l1": (aten.smooth_l1_loss, (R, 1.0)),
    "smooth_l1_beta0": (aten.smooth_l1_loss, (R, 0.0)),
    "huber": (aten.huber_loss, (R, 1.0)),
    "bce": (aten.binary_cross_entropy, (None, R)),
    "bce_logits": (aten.binary_cross_entropy_with_logits, (None, None, R)),
    "soft_margin": (aten.soft_margin_loss, (R,)),
}
LOSS_SHAPES = [(32, 256), (100,), (64, 1000), (3, 5, 7), (4, 16, 24, 24)]


def _loss_args(name, shape, reduction):
    op, extra = LOSSES[name]
    torch.manual_seed(0)
    x, t = torch.rand(shape).clamp(0.01, 0.99), torch.rand(shape)
    if name == "soft_margin":
        t = t.sign()
    return op, (x, t, *(reduction if a is R else a for a in extra))


def _storage(out):
    return out.untyped_storage().nbytes()


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("reduction", [_NONE, _MEAN, _SUM], ids=["none", "mean", "sum"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_loss_workspace_and_kept_storage_are_the_allocators(name, reduction, threads):
    """Each loss kernel's workspace (rule = allocator to the byte), and the storage its output keeps (the
    memory rule's output size): F.mse_loss's 32 KiB at a batch of 32x256 were no rule's (the step's peak
    measured 8.7% above its plan at 512x256, the loss's kept storage held through the backward)."""
    with _threads(threads):
        for shape in LOSS_SHAPES:
            op, args = _loss_args(name, shape, reduction)
            measured, rule = op_workspace(op, *args), _rule(op, *args)
            assert rule == measured, (shape, measured, rule)
            eqn, _ = _staged(op, *args)
            planned = effect(eqn).outputs.get(0, eqn.outvars[0].aval.nbytes)
            with torch._C._AutoDispatchBelowAutograd():
                assert planned == _storage(op(*args)), shape


@pytest.mark.parametrize("reduction", [_NONE, _MEAN, _SUM], ids=["none", "mean", "sum"])
@pytest.mark.parametrize("shapes", [((64, 1000), (64, 1000)), ((64, 1000), (1, 1000)), ((1, 1000), (64, 1000))],
                         ids=["same", "target_broadcast", "input_broadcast"])
def test_mse_loss_over_broadcast_and_mixed_dtype_operands_is_the_allocators(shapes, reduction):
    """The unreduced loss has the broadcast shape, in the promoted dtype; an operand of another dtype is
    copied into it once per TensorIterator (the structured kernel builds two when it reduces)."""
    torch.manual_seed(0)
    for dtypes in ((torch.float32, torch.float32), (torch.float32, torch.float64), (torch.float64, torch.float32)):
        x, t = (torch.randn(s, dtype=d) for s, d in zip(shapes, dtypes))
        measured, rule = op_workspace(aten.mse_loss, x, t, reduction), _rule(aten.mse_loss, x, t, reduction)
        assert rule == measured, (dtypes, measured, rule)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("shape", [(32, 256), (64, 1000), (128, 256), (4, 100000), (300, 7)], ids=lambda s: "x".join(map(str, s)))
def test_sum_and_mean_workspace_is_the_allocators(shape, dtype, threads):
    """Per-thread partial sums of a full reduction (32768 elements or more, several threads), and a mean's
    division by the count (a Python number wrapped as a tensor); a reduction along a dim allocates neither
    partials (it splits the output between threads) nor, for a sum, anything else."""
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype)
    cases = [(aten.sum.default, (x,)), (aten.mean.default, (x,)), (aten.sum.dim_IntList, (x, [0])),
             (aten.sum.dim_IntList, (x, [0, 1])), (aten.mean.dim, (x, [-1])), (aten.mean.dim, (x, [0, 1]))]
    with _threads(threads):
        for op, args in cases:
            measured, rule = op_workspace(op, *args), _rule(op, *args)
            assert rule == measured, (op, measured, rule)


@pytest.mark.parametrize("threads", [1, 3])
def test_loss_backward_workspace_is_the_allocators(threads):
    """soft_margin_loss_backward holds two tensors of the input's size; binary_cross_entropy_backward divides a
    mean gradient in place by a wrapped number; mse, smooth_l1 and huber's backwards allocate nothing."""
    torch.manual_seed(0)
    with _threads(threads):
        for shape in ((64, 1000), (3, 5, 7)):
            x, t = torch.rand(shape).clamp(0.01, 0.99), torch.rand(shape)
            for reduction in (_NONE, _MEAN, _SUM):
                g = torch.randn(()) if reduction else torch.randn(shape)
                for op, args in ((aten.soft_margin_loss_backward, (g, x, t.sign(), reduction)),
                                 (aten.binary_cross_entropy_backward, (g, x, t, None, reduction)),
                                 (aten.mse_loss_backward, (g, x, t, reduction)),
                                 (aten.smooth_l1_loss_backward, (g, x, t, reduction, 1.0)),
                                 (aten.huber_loss_backward, (g, x, t, reduction, 1.0))):
                    measured, rule = op_workspace(op, *args), _rule(op, *args) or 0
                    assert rule == measured, (op, shape, reduction, measured, rule)


_AT_MALLOC = """
import ctypes, json, sys
import torch
sys.path[:0] = {tests!r}
from memtrack import op_workspace
from test_workspace import _conv, _conv_backward, _mkldnn, _rule
shim = ctypes.CDLL(None)
shim.mallocpeak_live.restype = shim.mallocpeak_peak.restype = ctypes.c_long
aten = torch.ops.aten
torch.set_num_threads(1)
torch.manual_seed(0)
rows = []
for n, c, size, o, k, padding, stride, groups in {cases!r}:
    x, w = torch.randn(n, c, size, size), torch.randn(o, c // groups, k, k, requires_grad=True)
    with _mkldnn(False):
        go = torch.randn_like(aten.convolution(*_conv(x, w, None, stride, padding, False, groups)))
        for mask in ((True, False, False), (True, True, True)):
            args = _conv_backward(go, x, w, stride, padding, False, groups, mask)
            with torch._C._AutoDispatchBelowAutograd():
                aten.convolution_backward(*args)
                shim.mallocpeak_reset()
                base = shim.mallocpeak_live()
                out = aten.convolution_backward(*args)
                peak = shim.mallocpeak_peak()
            kept = sum(t.untyped_storage().nbytes() for t in out if isinstance(t, torch.Tensor))
            columns = c // groups * k * k * go.shape[2:].numel() * 4
            rows.append((mask, peak - base - kept, op_workspace(aten.convolution_backward, *args, at_malloc=False),
                         _rule(aten.convolution_backward, *args), columns, op_workspace(aten.convolution_backward, *args)))
print(json.dumps(rows))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("cc") is None, reason="needs Linux and a C compiler")
def test_the_native_input_gradients_columns_are_real_but_unseen_by_the_profiler(tmp_path):
    """The native 2-d kernel's input gradient unfolds each example into ``std::make_unique<scalar_t[]>``
    (ATen's ConvolutionMM2d.cpp, ``slow_conv2d_backward_out_cpu_template``): plain ``malloc``, so the profiler's
    allocation events (tests/support/memtrack.AllocatorPeak) show nothing for it, where RSS grew by it. Measured here
    at ``malloc`` itself (a preloaded shim, tests/support/mallocpeak.c, which counts torch's allocations too): one
    example's columns per thread, whatever the kernel's size (a 1x1 kernel's too), which the rule counts. With
    the weight's gradient, that gradient's columns (torch's allocator, seen) come after: the larger of the two
    is the op's peak. A grouped convolution runs a group at a time, each group's input gradient with a group's
    columns while its slices and the gradients made so far are held: the rule is tests/memtrack's reading
    (the profiler's events plus these buffers), and what malloc sees but for the C++ objects of each group's
    tensors (0.5-2 KiB a group, not modelled: the plan's safety margin)."""
    shim = tmp_path / "mallocpeak.so"
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(shim), str(Path(__file__).parents[1] / "support" / "mallocpeak.c"), "-ldl"],
                   check=True)
    cases = [(4, 8, 24, 16, 3, 1, 1, 1), (8, 8, 32, 8, 3, 1, 1, 1), (2, 32, 40, 32, 3, 1, 1, 1),
             (4, 16, 24, 8, 3, 1, 2, 1), (4, 8, 24, 16, 1, 0, 1, 1), (1, 32, 24, 8, 1, 0, 1, 1),
             (1, 16, 8, 16, 3, 1, 1, 4), (4, 16, 12, 16, 3, 1, 1, 4), (2, 8, 10, 8, 1, 0, 1, 2)]
    script = _AT_MALLOC.format(tests=[str(Path(__file__).parent), str(Path(__file__).parents[1] / "support")], cases=cases)
    env = {**os.environ, "LD_PRELOAD": str(shim), "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    python = 8192  # what the interpreter itself allocates around the call (1.7-6.7 KiB seen)
    for case, (grad_input, both) in zip(cases, zip(rows[::2], rows[1::2])):
        _, at_malloc, profiler, rule, columns, reading = grad_input
        _, both_at_malloc, both_profiler, both_rule, _, both_reading = both
        # tests/memtrack's reading (the profiler's events and these buffers) is the rule's, within the outputs
        # made after the buffer is gone (the weight's and bias's gradients: the reading takes them off).
        for read, planned in ((reading, rule), (both_reading, both_rule)):
            assert read <= planned <= read + 0.05 * planned + 256, (case, grad_input, both)
        groups = case[7]
        if groups > 1:
            # The profiler alone misses a group's columns; malloc sees them, and each group's tensors' objects.
            assert profiler < rule, (case, grad_input)
            for at, planned in ((at_malloc, rule), (both_at_malloc, both_rule)):
                assert at - 2048 * groups - python <= planned <= at + python, (case, grad_input, both)
            continue
        assert profiler == 0 and columns <= at_malloc <= columns + python, (case, grad_input)
        assert rule == columns, (case, grad_input)
        # With the weight's gradient: its columns after the buffer, and its and the bias's gradients (outputs).
        later = (case[3] * case[1] * case[4] ** 2 + case[3]) * 4
        assert both_rule == max(both_profiler, columns - later) <= both_at_malloc <= both_rule + later + python, (case, both)


# Pointwise ops on tensors of more than one dtype (stagetorch/ops/elementwise.py, _cast_peak): the CPU kernel
# casts each operand of another dtype to the one it computes in, at the operand's own shape; in place, where
# that dtype is not the output's, it computes into a temporary of it as well. name -> the op's tensor arguments.
_MIXED = {
    "add.Tensor": lambda x, y: (x, y), "sub.Tensor": lambda x, y: (x, y), "mul.Tensor": lambda x, y: (x, y),
    "div.Tensor": lambda x, y: (x, y), "rsub.Tensor": lambda x, y: (x, y),
    "eq.Tensor": lambda x, y: (x, y), "ne.Tensor": lambda x, y: (x, y), "lt.Tensor": lambda x, y: (x, y),
    "ge.Tensor": lambda x, y: (x, y), "maximum.default": lambda x, y: (x, y), "minimum.default": lambda x, y: (x, y),
    "fmax.default": lambda x, y: (x, y), "pow.Tensor_Tensor": lambda x, y: (x, y),
    "remainder.Tensor": lambda x, y: (x, y), "fmod.Tensor": lambda x, y: (x, y),
    "floor_divide.default": lambda x, y: (x, y), "bitwise_and.Tensor": lambda x, y: (x, y),
    "logical_or.default": lambda x, y: (x, y), "atan2.default": lambda x, y: (x, y),
    "hypot.default": lambda x, y: (x, y), "xlogy.Tensor": lambda x, y: (x, y),
    "copysign.Tensor": lambda x, y: (x, y),
    "where.self": lambda x, y: (torch.rand(torch.broadcast_shapes(x.shape, y.shape)) > 0.5, x, y),
    "addcmul.default": lambda x, y: (x, y, y), "addcdiv.default": lambda x, y: (x, y, y),
    "add_.Tensor": lambda x, y: (x, y), "mul_.Tensor": lambda x, y: (x, y), "div_.Tensor": lambda x, y: (x, y),
    "eq_.Tensor": lambda x, y: (x, y), "atan2_.default": lambda x, y: (x, y),
    "addcmul_.default": lambda x, y: (x, y, y),
}
_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool]
_SHAPES = {"same": ((6, 8), (6, 8)), "broadcast": ((6, 8), (1, 8)), "0-dim other": ((6, 8), ()),
           "0-dim self": ((), (6, 8))}


@pytest.mark.parametrize("shapes", list(_SHAPES))
@pytest.mark.parametrize("name", list(_MIXED))
def test_a_mixed_dtype_pointwise_op_casts_as_the_allocator_says(name, shapes):
    """An int64 or bool mask times a float32 tensor, ``x.eq(y)`` across dtypes, ``torch.where(c, f32, f64)``,
    ``bf16.add_(f32)``: for every pair of dtypes torch accepts, the rule is the allocator's, to the byte, and
    where the dtypes differ the op allocates (a case that would fail without the rule)."""
    op = _overload(name)
    ran = 0
    for a, b in itertools.product(_DTYPES, _DTYPES):
        torch.manual_seed(0)
        x, y = ((torch.rand(s) * 3 + 1).to(d) for s, d in zip(_SHAPES[shapes], (a, b)))
        args = _MIXED[name](x, y)
        try:
            measured = op_workspace(op, *[t.clone() for t in args])
        except (RuntimeError, TypeError):
            continue  # torch refuses these operands
        assert _rule(op, *[t.clone() for t in args]) == measured, (a, b)
        assert measured > 0 or a == b, (a, b)
        ran += a != b
    if not ran and name.split(".")[0].endswith("_"):
        pytest.skip("torch refuses to broadcast a 0-dim self in place")
    assert ran > 0


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("number", [0.5, 2, True])
@pytest.mark.parametrize("name", ["pow.Tensor_Scalar", "clamp.default", "clamp_min.default", "clamp_max.default"])
def test_a_number_that_promotes_the_tensor_casts_it(name, number, dtype):
    """``int_tensor ** 0.5`` and ``int_tensor.clamp(0.5)`` compute in float32, ``bool_tensor ** 2`` in int64:
    the kernel reads the number as a number but casts the tensor (0 where the number does not promote it)."""
    op = _overload(name)
    x = (torch.rand(6, 8) * 3 + 1).to(dtype)
    args = (x, number, number + 1) if name == "clamp.default" else (x, number)
    try:
        measured = op_workspace(op, x.clone(), *args[1:])
    except (RuntimeError, TypeError):
        pytest.skip("torch refuses these operands")
    assert (measured > 0) == (op(*args).dtype != dtype), measured
    assert _rule(op, *args) == measured

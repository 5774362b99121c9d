"""Recomputation (rematerialisation): the passes layer, the remat pass and the joint planner, against PyTorch.

Every recomputing run is compared bit for bit with the same step staged without recomputation (and, for
BatchNorm state and dropout's generator, with eager PyTorch); every budgeted run's live-tensor peak is
measured and held to the budget and to the plan's prediction.
"""

from __future__ import annotations

import collections
import copy
import math
import random

import pytest
import remat_models
import torch
import torch.nn as nn
import torch.nn.functional as F
from hungry_op import _DEVICE  # importing it registers its op, stagetorch_test::scratch_hungry
from memtrack import AllocatorPeak
from remat_models import mlp_chain, step_of
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

import stagetorch
from stagetorch.errors import BatchCouplingError, OutOfMemoryError, UnsupportedOpError
from stagetorch.interpreters.eager import Program
from stagetorch.interpreters.flops import eqn_flops, graph_calls, graph_flops
from stagetorch.interpreters.memory import peak_bytes
from stagetorch.interpreters.shapes import check
from stagetorch.ir import Eqn, GraphError, Var, op_name
from stagetorch.planning.budget import SAFETY_MARGIN
from stagetorch.planning.remat_frontier import _dynamic_program, frontier
from stagetorch.planning.remat_search import (
    RematPlan,
    plan_joint,
    predicted_cost,
    step_cost,
)
from stagetorch.planning.remat_simulator import Simulator, segment_chain
from stagetorch.transforms.remat import NOT_HELD, RECOMPUTED, candidates, recomputed_eqns, remat
from stagetorch.transforms.rng import ReplayRandom, SaveRngState
from stagetorch.transforms.schedule import dce, has_effect, liveness, writes

MiB = 2**20


def conv_bn(n: int = 6, c: int = 8) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, c, 3, padding=1),
        *[nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU()) for _ in range(n)],
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 3),
    )


def dropout_chain(n: int = 8, d: int = 64) -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Dropout(0.3)) for _ in range(n)])


def inplace_chain(n: int = 8, d: int = 64) -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.ReLU(inplace=True), nn.LayerNorm(d)) for _ in range(n)])


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters()]


def run_graph(graph, model, x):
    return Program(graph).run([x, *model.parameters(), *model.buffers()])


# ---------------------------------------------------------------------------------------------------------
# The passes layer.


def test_check_accepts_staged_graphs_and_rejects_broken_ones():
    model = mlp_chain(3, 16)
    g = stagetorch.make_ir(step_of(model))(torch.randn(4, 16))
    check(g)
    broken = copy.copy(g)
    broken.eqns = [g.eqns[1], g.eqns[0], *g.eqns[2:]] if g.eqns[1].invars[0] in g.eqns[0].outvars else g.eqns[::-1]
    with pytest.raises(GraphError, match="before it is defined"):
        check(broken)
    twice = copy.copy(g)
    twice.eqns = [*g.eqns, g.eqns[-1]]
    with pytest.raises(GraphError, match="defined twice"):
        check(twice)


def test_dce_drops_dead_pure_ops_and_keeps_effects():
    def fn(x, buf):
        dead = x.exp() * 2  # noqa: F841 - nobody reads it
        buf.add_(1)  # an in-place write nobody reads: an effect
        torch.rand_like(x)  # moves the generator: an effect
        return x.sin()

    x, buf = torch.randn(3), torch.zeros(3)
    g = stagetorch.make_ir(fn)(x, buf)
    out = check(dce(g))
    names = [op_name(e.prim) for e in out.eqns]
    assert "aten.exp" not in names and "aten.mul.Tensor" not in names
    assert "aten.add_.Tensor" in names and "aten.rand_like" in names and "aten.sin" in names
    assert all(has_effect(e) for e in g.eqns if op_name(e.prim) in ("aten.add_.Tensor", "aten.rand_like"))
    (result,), _ = Program(out).run([x, buf.clone()])
    assert torch.equal(result, x.sin())
    assert dce(out) is out  # nothing more to drop: the same graph back


def test_liveness_matches_program_order():
    g = stagetorch.make_ir(step_of(mlp_chain(2, 8)))(torch.randn(2, 8))
    live = liveness(g)
    for i, e in enumerate(g.eqns):
        for v in e.invars:
            assert live.last_use[v.root] >= i
            assert live.defined[v.root] < i or live.defined[v.root] == -1
    for _, v in g.grads:
        assert live.last_use[v.root] == len(g.eqns)


# ---------------------------------------------------------------------------------------------------------
# The remat pass: exact, and the peak it promises.


def test_remat_is_bit_exact_and_lowers_the_peak():
    model = mlp_chain(12, 64)
    x = torch.randn(2, 256, 64)
    g = stagetorch.make_ir(step_of(model))(x)
    cands = candidates(g)
    assert cands.roots and not cands.pinned
    (loss, *_), ref = run_graph(g, model, x)
    for k in (2, 3, 4, 6):
        r = check(remat(g, set(cands.roots[k - 1 :: k]), cands))
        assert recomputed_eqns(r) and peak_bytes(r) < peak_bytes(g)
        (loss_r, *_), got = run_graph(r, model, x)
        assert torch.equal(loss_r, loss)
        assert all(i == j and torch.equal(a, b) for (i, a), (j, b) in zip(got, ref))
        assert check(dce(r)).eqns == r.eqns  # the pass adds nothing dead


def test_remat_keeping_everything_is_the_identity():
    g = stagetorch.make_ir(step_of(mlp_chain(3, 8)))(torch.randn(2, 8))
    cands = candidates(g)
    assert remat(g, set(cands.roots), cands) is g


def test_side_effects_are_never_recomputed():
    """BatchNorm's running-stat update happens once, in the forward; dropout's draws are replayed from the
    generator state saved in the forward; an in-place write is recomputed only into a fresh copy the
    recomputation made (a ReLU(inplace=True) on a Linear's output, dropout's noise on CPU)."""
    for model in (conv_bn(3), dropout_chain(3), inplace_chain(3)):
        x = torch.randn(4, 3, 8, 8) if isinstance(model[0], nn.Conv2d) else torch.randn(4, 64)
        g = stagetorch.make_ir(step_of(model))(x)
        r = check(remat(g, set(), candidates(g)))  # drop every value that may be dropped
        assert recomputed_eqns(r)
        fresh = {v.root for e in recomputed_eqns(r) for v in e.outvars if v is not None and v.base is None}
        for e in recomputed_eqns(r):
            assert not has_effect(e) or all(v.root in fresh for v in writes(e)), op_name(e.prim)
            if "batch_norm" in op_name(e.prim):  # recomputed without its running statistics
                assert e.args[3] is None and e.args[4] is None
        replays = [e for e in recomputed_eqns(r) if isinstance(e.prim, ReplayRandom)]
        assert bool(replays) == any(isinstance(m, nn.Dropout) for m in model.modules())


def test_remat_with_dropout_replays_the_draws_and_is_exact():
    """Dropping every value recomputes each dropout under the generator state saved before it: the same
    loss and gradients bit for bit, and the generator where the run without recomputation leaves it."""
    model = dropout_chain()
    x = torch.randn(16, 64)
    g = stagetorch.make_ir(step_of(model))(x)
    cands = candidates(g)
    assert not cands.pinned  # dropout's noise and output are recomputed, not kept
    r = remat(g, set(), cands)
    assert sum(isinstance(e.prim, ReplayRandom) for e in recomputed_eqns(r)) == 8
    assert sum(isinstance(e.prim, SaveRngState) for e in r.eqns) == 8
    torch.manual_seed(3)
    (loss, *_), ref = run_graph(g, model, x)
    state = torch.get_rng_state()
    torch.manual_seed(3)
    (loss_r, *_), got = run_graph(r, model, x)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(loss_r, loss) and all(torch.equal(a, b) for (_, a), (_, b) in zip(got, ref))


def test_two_levels_of_recomputation_are_exact_with_batchnorm():
    """ResNet's least-peak plan recomputes values twice (``transient``) and BatchNorm without its running
    statistics: loss, gradients and the running statistics after the step equal the no-recompute run's
    bit for bit, and the predicted peak is the memory interpreter's."""
    torch.manual_seed(0)
    model, x = remat_models.resnet()
    g = stagetorch.make_ir(step_of(model))(x)
    least = frontier(g)[-1]
    assert least.transient and least.peak_bytes < 0.45 * peak_bytes(g)
    r = check(least.graph)
    assert least.peak_bytes == peak_bytes(r)
    where = collections.Counter((e.source.module, e.source.line, op_name(e.prim)) for e in recomputed_eqns(r))
    assert max(where.values()) >= 2  # an op of the forward recomputed twice
    norms = [e for e in recomputed_eqns(r) if "batch_norm" in op_name(e.prim)]
    assert norms and all(e.args[3] is None and e.args[4] is None for e in norms)
    states = []
    for graph in (g, r):
        buffers = [b.clone() for b in model.buffers()]
        (loss, *_), got = Program(graph).run([x, *model.parameters(), *buffers])
        states.append((loss, got, buffers))
    (loss, ref, bufs), (loss_r, got, bufs_r) = states
    assert torch.equal(loss_r, loss)
    assert all(i == j and torch.equal(a, b) for (i, a), (j, b) in zip(got, ref))
    assert all(map(torch.equal, bufs_r, bufs)) and not all(map(torch.equal, bufs, model.buffers()))


def dropout_mlp(n: int = 8, d: int = 64, p: float = 0.1) -> nn.Module:
    """The issue's dropout chain, smaller: ``n`` x (Linear(d, d) + GELU + Dropout(p))."""
    return nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Dropout(p)) for _ in range(n)])


def _smallest_budget(staged: stagetorch.Staged, *args) -> int:
    staged.memory_budget = 1024
    with pytest.raises(OutOfMemoryError) as info:
        staged.plan(*args)
    return info.value.smallest_budget


def _replays(plan) -> int:
    return sum(isinstance(e.prim, ReplayRandom) for e in recomputed_eqns(plan.recompute.graph))


@pytest.mark.parametrize("batch", [1, 6], ids=["whole", "chunks"])
def test_dropout_recomputed_by_replay_equals_no_recompute_bit_for_bit(batch, monkeypatch):
    """At the smallest budget the planner accepts, every dropout is recomputed under the generator state
    saved before it: loss, every .grad and the generator state after the step equal the run without
    recomputation bit for bit (for a chunked plan: the same chunks, each drawing its own masks, in order).
    Keeping dropout's noise and output instead (as before the replay) does not fit that budget."""
    torch.manual_seed(0)
    model = dropout_mlp()
    reference = copy.deepcopy(model)
    x = torch.randn(batch, 2048 // batch, 64)
    staged = stagetorch.jit(step_of(model))
    staged.memory_budget = _smallest_budget(staged, x)
    plan = staged.plan(x)
    assert isinstance(plan, RematPlan) and _replays(plan) > 0 and plan.chunked == (batch > 1)
    with monkeypatch.context() as patch:  # dropout kept, as before the replay: out of memory there
        patch.setattr(stagetorch.transforms.remat, "replayable", lambda e: False)
        with pytest.raises(OutOfMemoryError):
            stagetorch.jit(step_of(model), memory_budget=staged.memory_budget).plan(x)
    ref = stagetorch.jit(step_of(reference), remat=False)
    ref._caps[batch] = max(plan.chunk_sizes)  # the same chunks, without recomputation
    assert ref.plan(x).chunk_sizes == plan.chunk_sizes
    for _ in range(2):  # the second step starts from the generator the first left
        torch.manual_seed(7)
        loss, state = staged(x), torch.get_rng_state()
        torch.manual_seed(7)
        expected, expected_state = ref(x), torch.get_rng_state()
        assert torch.equal(loss, expected) and all(map(torch.equal, grads(model), grads(reference)))
        assert torch.equal(state, expected_state)
        model.zero_grad(), reference.zero_grad()


def test_the_dropout_chain_plans_as_low_as_the_chain_without_dropout():
    """The issue's dropout chain, 24 x (Linear(128) + GELU + Dropout(0.1)) over one example of 2048 tokens:
    its smallest budget is within 1.10x of the same chain without dropout plus a mask of a byte per
    element (21.9 MiB against 18.5 MiB + 6 MiB; 44.1 MiB when dropout was kept), and the run there is
    within it, as predicted."""
    x = torch.randn(1, 2048, 128)
    budgets = {}
    for p in (0.0, 0.1):
        torch.manual_seed(0)
        model = dropout_mlp(24, 128, p) if p else mlp_chain(24, 128)
        staged = stagetorch.jit(step_of(model))
        budgets[p] = staged.memory_budget = _smallest_budget(staged, x)
        plan = staged.plan(x)
        # At the allocator, as the issue measured it.
        with AllocatorPeak([*model.parameters(), x]) as run:
            staged(x)
        assert plan.peak <= budgets[p] and abs(run.peak - plan.peak) <= 0.01 * plan.peak
    assert budgets[0.1] <= 1.10 * (budgets[0.0] + 24 * x.numel())


class _WrittenAfterARead(nn.Module):
    def __init__(self, d: int = 64):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        h = self.lin(x)
        a = h.sigmoid()
        h.add_(1)  # after sigmoid read h: recomputing h would not give what sigmoid read
        return a * h


@pytest.mark.parametrize("case", ["whole", "read_before"])
def test_remat_with_inplace_ops_is_exact(case):
    """A storage made in the forward and then written in place (relu_ on a Linear's output) is recomputed
    whole: its maker and every write run again, in order, on a fresh copy. One read before its write is
    kept (recomputing it would not give what that read saw)."""
    model = inplace_chain() if case == "whole" else nn.Sequential(_WrittenAfterARead(), _WrittenAfterARead())
    x = torch.randn(16, 64)
    g = stagetorch.make_ir(step_of(model))(x)
    cands = candidates(g)
    assert bool(cands.pinned) == (case == "read_before")
    r = check(remat(g, set(), cands))
    recomputed = recomputed_eqns(r)
    assert recomputed and ("aten.relu_" in {op_name(e.prim) for e in recomputed}) == (case == "whole")
    assert peak_bytes(r) == Simulator(g, cands).run(frozenset())[0]
    (loss, *_), ref = run_graph(g, model, x)
    (loss_r, *_), got = run_graph(r, model, x)
    assert torch.equal(loss_r, loss) and all(torch.equal(a, b) for (_, a), (_, b) in zip(got, ref))


# ---------------------------------------------------------------------------------------------------------
# The joint planner and jit.


def _run(model, x, **options):
    staged = stagetorch.jit(step_of(model), **options)
    plan = staged.plan(x)
    with AllocatorPeak([*model.parameters(), *model.buffers(), x]) as tracker:
        loss = staged(x)
    return loss, plan, tracker.peak


def test_the_issue_example_fits_where_no_chunk_size_does():
    """24 x (Linear(128,128) + GELU) over 1024 tokens, batch 2, under 16 MiB."""
    torch.manual_seed(0)
    model = mlp_chain(24, 128)
    x = torch.randn(2, 1024, 128)
    with pytest.raises(OutOfMemoryError, match="not even one example fits"):
        stagetorch.jit(step_of(model), memory_budget="16MiB", remat=False).plan(x)
    reference = copy.deepcopy(model)
    loss, plan, peak = _run(model, x, memory_budget="16MiB")
    assert isinstance(plan, RematPlan) and plan.extra_flops > 0
    assert "Recomputes" in str(plan)
    # The same chunks without recomputation, under a budget they fit (the whole batch: no budget; it plans
    # whole, recomputing more, where that costs less than two chunks): recomputation changes no bit.
    expected, ref_plan, ref_peak = _run(reference, x, memory_budget="36MiB" if plan.chunked else None, remat=False)
    # Both chunked runs are predicted to the byte. (The chunk graphs once counted each chunk's view of its
    # input as a new tensor, 512 KiB too many here, and a mean's partial as two tensors where it is one.)
    # (Within the few bytes of 0-dim temporaries the commit makes.)
    assert abs(ref_plan.peak - ref_peak) <= 64
    assert abs(peak - plan.peak) <= 64 and plan.peak <= 16 * MiB
    assert plan.chunk_sizes == ref_plan.chunk_sizes
    assert torch.equal(loss, expected) and all(map(torch.equal, grads(model), grads(reference)))


@pytest.mark.parametrize("fraction", [0.95, 0.8, 0.65, 0.5, 0.4, 0.3])
def test_budget_sweep_single_example(fraction):
    """Batch 1 cannot be chunked: recomputation alone must fit, exactly, within the predicted peak, or a
    named error must say the budget is below the floor."""
    model = mlp_chain(16, 96)
    x = torch.randn(1, 512, 96)
    full = peak_bytes(stagetorch.make_ir(step_of(model))(x))
    budget = int(full * fraction)
    reference = copy.deepcopy(model)
    expected, *_ = _run(reference, x, remat=False)
    try:
        loss, plan, peak = _run(model, x, memory_budget=budget)
    except OutOfMemoryError as e:
        smallest = stagetorch.devices.budget.parse_bytes(str(e).split("fits is ")[1].split(" (")[0].replace(" ", ""))
        assert smallest > budget and fraction <= 0.4
        return
    assert isinstance(plan, RematPlan) and not plan.chunked
    assert peak <= budget and abs(peak - plan.peak) <= 0.02 * peak, (peak, plan)
    assert torch.equal(loss, expected) and all(map(torch.equal, grads(model), grads(reference)))


def test_below_the_floor_names_the_smallest_budget():
    model = mlp_chain(16, 96)
    x = torch.randn(1, 512, 96)
    with pytest.raises(OutOfMemoryError, match="smallest budget any schedule fits is") as info:
        stagetorch.jit(step_of(model), memory_budget="1MiB").plan(x)
    smallest = stagetorch.devices.budget.parse_bytes(str(info.value).split("fits is ")[1].split(" (")[0].replace(" ", ""))
    # ... and that budget does fit.
    plan = stagetorch.jit(step_of(model), memory_budget=smallest + 4096).plan(x)
    assert plan.peak <= smallest


def test_one_example_that_does_not_fit_is_out_of_memory_even_where_the_batch_would_not_split():
    """A transformer on one sequence: its attention's batch analysis fails at a batch of one (the heads fold
    into the size-1 batch dim), which matters to nobody, since one example is never split. Under too small a
    budget the error is OutOfMemoryError with the smallest budget that fits, and that budget runs."""
    torch.manual_seed(0)
    model, x = remat_models.SEEDS["transformer"]()
    x = x[:1]
    staged = stagetorch.jit(step_of(model))
    staged.memory_budget = int(peak_bytes(staged.graph(x)) * 0.7)
    with pytest.raises(OutOfMemoryError, match="a batch of one cannot be split") as info:
        staged.plan(x)
    assert "smallest budget any schedule fits is" in str(info.value)
    staged.memory_budget = info.value.smallest_budget
    assert staged.plan(x).peak <= info.value.smallest_budget
    reference = copy.deepcopy(model)
    expected, *_ = _run(reference, x, remat=False)
    assert torch.equal(staged(x), expected)
    assert all(map(torch.equal, grads(model), grads(reference)))


def test_no_recompute_when_the_step_fits():
    model = mlp_chain(4, 32)
    x = torch.randn(8, 32)
    plan = stagetorch.jit(step_of(model), memory_budget="1GiB").plan(x)
    assert not isinstance(plan, RematPlan) and not plan.chunked


def test_frontier_is_never_worse_than_no_recompute():
    for model, x in ((mlp_chain(8, 32), torch.randn(4, 64, 32)), (conv_bn(4), torch.randn(2, 3, 16, 16))):
        g = stagetorch.make_ir(step_of(model))(x)
        points = frontier(g)
        assert points[0].graph is g and points[0].extra_flops == 0
        peaks = [p.peak_bytes for p in points]
        assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == len(peaks)
        assert [p.extra_flops for p in points] == sorted(p.extra_flops for p in points)


@pytest.mark.parametrize(
    "case", ["chain-0.3", "chain-0.45", "transformer-0.33", "transformer-0.5", "densenet-0.33", "big-0.3"]
)
def test_joint_plan_is_the_cheapest_of_every_frontier_point(case, monkeypatch):
    """The joint planner sizes chunks for only the recompute sets whose lower bound (the fewest chunks their
    whole-batch peak allows) can beat the best plan so far; sizing chunks for every point of the frontier
    finds no cheaper plan (the winner's polish may find a cheaper one). On a graph of over 1,000 equations
    the plan also runs within its budget, and its loss is the eager step's."""
    name, fraction = case.rsplit("-", 1)
    torch.manual_seed(0)
    if name == "chain":
        model, x = mlp_chain(12, 64), torch.randn(8, 256, 64)
    elif name == "big":
        model, x = mlp_chain(80, 32), torch.randn(16, 64, 32)
    else:
        model, x = remat_models.SEEDS[name]()
        x = x.repeat(2, *[1] * (x.dim() - 1))
    seen = {}

    def recording(graph, budget, chunk_plan, floor, points=None, **kwargs):
        seen.update(graph=graph, chunk_plan=chunk_plan, points=points)
        return plan_joint(graph, budget, chunk_plan, floor, points, **kwargs)

    monkeypatch.setattr(stagetorch.planning.planner, "plan_joint", recording)
    staged = stagetorch.jit(step_of(model))
    full = peak_bytes(staged.graph(x))
    staged.memory_budget = int(full * float(fraction))
    plan = staged.plan(x)
    graph, base, calls = seen["graph"], graph_flops(seen["graph"]), graph_calls(seen["graph"])

    def cost(p, chunk_plan):
        return step_cost(base + p.extra_flops, calls + p.extra_calls, len(chunk_plan.chunk_sizes))

    scores = []
    for p in seen["points"]():
        try:
            scores.append(cost(p, seen["chunk_plan"](p.graph)))
        except (OutOfMemoryError, BatchCouplingError, UnsupportedOpError):
            continue
    chosen = plan.recompute if isinstance(plan, RematPlan) and plan.recompute else seen["points"]()[0]
    assert isinstance(plan, RematPlan) or plan.chunked  # the budget needs one or the other
    assert cost(chosen, plan) <= min(scores), (plan, sorted(scores)[:3])
    if name != "big":
        return
    assert len(graph.eqns) > 1000
    expected = step_of(copy.deepcopy(model))(x)
    with AllocatorPeak([*model.parameters(), x]) as tracker:
        loss = staged(x)
    assert tracker.peak <= staged.memory_budget
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


# Not the VNet any more: at one example its native 3-d convolutions' column buffers are the peak (counted since
# the workspace rules), and no recomputation lowers them below 0.9x. DenseNet at 0.65, not 0.6: with oneDNN's
# weight-gradient reductions counted per thread, no frontier point fits 0.6 (the least is 1,360,364 B against
# 1,323,468 usable; the search below the frontier plans it, which this test does not compare with).
@pytest.mark.parametrize("case", ["resnet-0.5", "densenet-0.65"])
def test_the_winning_set_is_polished_to_keep_what_fits(case):
    """One example (it cannot be chunked): the plan's recompute set is the cheapest frontier point that fits,
    with dropped values kept again where that lowers the predicted cost and the peak still fits. It costs
    less than that point (the VNet at 0.7x, before its workspaces were counted: 31% extra FLOPs became 12%), keeping any one more of its dropped
    values would not fit or not save, and it runs within the budget, to the predicted peak and bit for bit
    as the step without recomputation does."""
    name, fraction = case.rsplit("-", 1)
    torch.manual_seed(0)
    model, x = remat_models.SEEDS[name]()
    x = x[:1]
    reference = copy.deepcopy(model)
    expected, *_ = _run(reference, x, remat=False)
    staged = stagetorch.jit(step_of(model))
    graph = staged.graph(x)
    held = sum(b.untyped_storage().nbytes() for b in model.buffers())  # the copies kept to restore them
    budget = math.ceil(peak_bytes(graph) * float(fraction)) + held
    staged.memory_budget = budget
    plan = staged.plan(x)
    assert isinstance(plan, RematPlan) and plan.chunk_sizes == (1,)
    usable = int((budget - held) * (1 - SAFETY_MARGIN))

    def cost(flops, calls):
        return step_cost(flops, calls, 1)

    chosen = plan.recompute
    cheapest = min(cost(p.extra_flops, p.extra_calls) for p in frontier(graph) if p.peak_bytes <= usable)
    assert chosen.peak_bytes <= usable and cost(chosen.extra_flops, chosen.extra_calls) < 0.9 * cheapest
    sim = Simulator(graph, chosen.cands)
    for r in chosen.cands.roots:
        if r not in chosen.keep:
            peak, flops, _, calls = sim.run(chosen.keep | {r}, {v: s for v, s in chosen.transient.items() if v != r})
            assert peak > usable or cost(flops, calls) >= cost(chosen.extra_flops, chosen.extra_calls), r
    assert peak_bytes(chosen.graph) == chosen.peak_bytes
    with AllocatorPeak([*model.parameters(), *model.buffers(), x]) as tracker:
        loss = staged(x)
    assert tracker.peak <= budget and abs(tracker.peak - plan.peak) <= 0.02 * tracker.peak
    assert torch.equal(loss, expected)
    assert all(map(torch.equal, grads(model), grads(reference)))


@pytest.mark.parametrize("name", ["chain", "bn", "dropout", "inplace", *sorted(remat_models.SEEDS)])
def test_planner_costing_equals_the_memory_interpreter(name):
    """The planner costs recompute sets without building their graphs: it must agree with the memory
    interpreter on the graph the pass builds, for random keep sets as well as the frontier's."""
    model, x = {
        "chain": lambda: (mlp_chain(8, 32), torch.randn(2, 64, 32)),
        "bn": lambda: (conv_bn(3), torch.randn(2, 3, 8, 8)),
        "dropout": lambda: (dropout_chain(4), torch.randn(8, 64)),
        "inplace": lambda: (inplace_chain(4), torch.randn(8, 64)),
        **remat_models.SEEDS,
    }[name]()
    g = stagetorch.make_ir(step_of(model))(x)
    cands = candidates(g)
    sim = Simulator(g, cands)
    rng = random.Random(0)
    keeps = [frozenset(r for r in cands.roots if rng.random() < q) for q in (0.0, 0.2, 0.5, 0.8)]
    # Two levels: dropped values recomputed again for their own segment (random segments).
    transients = [None, None, None, None, {r: rng.randrange(4) for r in cands.roots if rng.random() < 0.6}]
    keeps.append(frozenset(r for r in cands.roots if rng.random() < 0.3))
    # ... and the values the backward never reads made again wherever they are needed (NOT_HELD).
    transients.append({**dict.fromkeys(cands.recomputable - set(cands.roots), NOT_HELD), **transients[-1]})
    keeps.append(keeps[-1])
    for keep, transient in zip(keeps, transients):
        peak, extra, names, calls = sim.run(keep, transient)
        r = check(remat(g, keep, cands, transient))
        assert peak == peak_bytes(r)
        assert extra == graph_flops(recomputed_eqns(r)) and len(names) == len(recomputed_eqns(r))
        assert calls == graph_calls(recomputed_eqns(r))
    for p in frontier(g):
        assert p.peak_bytes == peak_bytes(p.graph)


class _SumOfSums(nn.Module):
    def __init__(self, d: int = 256):
        super().__init__()
        self.lin, self.out = nn.Linear(4, d), nn.Linear(d, 1)

    def forward(self, x):
        c = self.lin(x)
        a = c + F.hardswish(c)  # read by the next sum and by the head: added out of place in the forward
        s = a + F.leaky_relu(c)
        return self.out(a) + s.mean(-1, keepdim=True)


def test_the_planner_costs_a_recomputed_sum_added_into_its_dying_operand():
    """A sum the forward makes out of place (its operand has other readers) is recomputed, where those
    readers are not, into the operand's copy, which only the sum reads (passes.steals: a recomputation is
    the backward's): the planner's simulator costs it so, as the memory interpreter does on the built
    graph. Before, it held the copy and the sum apart and planned random image network 5 9.4% over the
    allocator (tests/end_to_end/test_random_steps.py); here 4 of the 16 keep sets were over-estimated."""
    g = stagetorch.make_ir(step_of(_SumOfSums()))(torch.randn(16, 4))
    cands = candidates(g)
    sim = Simulator(g, cands)
    stolen = 0
    for mask in range(2 ** len(cands.roots)):
        keep = frozenset(r for i, r in enumerate(cands.roots) if mask >> i & 1)
        r = check(remat(g, keep, cands))
        stolen += bool(liveness(r).steal.keys() & {e.outvars[0] for e in recomputed_eqns(r)})
        assert sim.run(keep)[0] == peak_bytes(r), sorted(cands.roots.index(v) for v in keep)
    assert stolen


def test_the_planner_costs_the_commit_of_an_optimizer_stepped_inside():
    """An optimizer stepped last in the step is the program's commit: its workspace is allocated before its
    first write and held to the end, beside the moments a first step makes (costing.commit_cost). The
    recomputation planner's simulator costs it as the memory interpreter does, for every keep set; before,
    it costed the commit's equations one tensor each, as if it were not one, and planned Adam's first step
    (per element) recomputing at 4,623,364 B where it ran at 4,796,636 (3.7% over the plan, past the
    margin): the commit, which no recomputation lowers, is its peak."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(256, 256), nn.GELU())])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)

    def step(x, y):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        return loss

    x, y = torch.randn(416, 256), torch.randn(416, 256)
    staged = stagetorch.jit(step)
    g = staged.graph(x, y)
    cands = candidates(g)
    sim = Simulator(g, cands)
    for mask in range(2 ** len(cands.roots)):
        keep = frozenset(r for i, r in enumerate(cands.roots) if mask >> i & 1)
        assert sim.run(keep)[0] == peak_bytes(remat(g, keep, cands)), sorted(cands.roots.index(v) for v in keep)
    # A budget whose usable bytes just hold the step recomputing everything: below the step's own peak.
    least = peak_bytes(remat(g, frozenset(), cands))
    staged.memory_budget = int(least / (1 - SAFETY_MARGIN)) + 4096
    assert peak_bytes(g) > staged.memory_budget * (1 - SAFETY_MARGIN)
    plan = staged.plan(x, y)
    assert plan.recompute is not None and plan.peak <= staged.memory_budget * (1 - SAFETY_MARGIN)
    with AllocatorPeak([*model.parameters(), x, y]) as run:
        staged(x, y)
    assert abs(run.peak - plan.peak) <= 64, (run.peak, plan.peak)


def test_a_node_s_values_are_recomputed_before_its_first_equation():
    """As autograd's checkpointing recomputes a layer before its backward, the pass recomputes what an
    autograd node reads before the node's first equation: not between its equations, beside the input
    gradient an ``addmm``'s backward makes before the weight gradient that reads the recomputed input."""
    g = stagetorch.make_ir(step_of(mlp_chain(4, 32)))(torch.randn(2, 64, 32))
    cands = candidates(g)
    # Keep what the Linears make, recompute the GELUs: each Linear's backward reads its (dropped) input.
    made = {v.root: e.prim for e in reversed(g.eqns[: cands.boundary]) for v in e.outvars if v is not None}
    keep = frozenset(r for r in cands.roots if made[r] is torch.ops.aten.addmm.default)
    r = check(remat(g, keep, cands, hoist=True))
    labels = [e.source.backward for e in r.eqns]
    bursts = [i for i, b in enumerate(labels) if b == RECOMPUTED and labels[i - 1] != RECOMPUTED]
    assert bursts
    for i in bursts:
        j = next(k for k in range(i, len(labels)) if labels[k] != RECOMPUTED)
        assert labels[i - 1] != labels[j] or not labels[j], (i, labels[i - 1])
    assert peak_bytes(r) == Simulator(g, cands, hoist=True).run(keep)[0]


def test_chain_cut_at_narrow_points_and_the_dynamic_program():
    """A chain of Linear + GELU blocks is cut after each op (one value crosses); the dynamic program
    recomputes nothing that costs when the budget allows it, recomputes where it does not, and gives up below one segment."""
    g = stagetorch.make_ir(step_of(mlp_chain(8, 32)))(torch.randn(2, 64, 32))
    cands = candidates(g)
    sim = Simulator(g, cands)
    segments = segment_chain(sim)
    assert len(segments) >= 8 and [r for s in segments for r in s[0]] == list(cands.roots)
    assert all(len(s[1]) <= 1 for s in segments)  # one value crosses each cut
    total = sum(s[2] for s in segments)
    roomy = _dynamic_program(segments, int(total * 1.05))
    assert roomy is not None and sim.run(roomy)[1] <= 0.001 * graph_flops(g)  # at most a free op recomputed
    assert _dynamic_program(segments, max(s[2] for s in segments) - 1) is None
    peaks = []
    for fraction in (0.8, 0.65, 0.5):  # Chen's bound: 16 values need 2 x sqrt(16) = 8 of them held
        keep = _dynamic_program(segments, int(total * fraction))
        assert keep is not None and keep < frozenset(cands.roots)
        peak, extra, *_ = sim.run(keep)
        assert peak == peak_bytes(remat(g, keep, cands)) and extra > 0
        peaks.append(peak)
    assert peaks == sorted(peaks, reverse=True) and peaks[-1] < 0.75 * sim.run(frozenset(cands.roots))[0]


def test_a_chain_of_5000_equations_plans():
    """312 x (Linear + GELU), one example (it cannot be chunked): the frontier goes down to the parameters
    and their gradients (0.12x) and a little more, its costing equals the memory interpreter's at the
    smallest point, and jit plans a budget of 0.3x."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(312)])
    x = torch.randn(1, 128, 16)
    g = stagetorch.make_ir(step_of(model))(x)
    assert len(g.eqns) >= 4900
    points = frontier(g)
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert points[-1].peak_bytes < 2 * weights + 0.06 * points[0].peak_bytes
    assert points[-1].peak_bytes == peak_bytes(points[-1].graph)
    plan = stagetorch.jit(step_of(model), memory_budget=int(points[0].peak_bytes * 0.3)).plan(x)
    assert isinstance(plan, RematPlan) and plan.peak <= 0.3 * points[0].peak_bytes
    assert plan.extra_flops < plan.base_flops  # less than one more forward and backward


@pytest.mark.parametrize("name", ["chain", "bn"])
def test_planner_against_exhaustive_search(name):
    """On graphs small enough to try every keep set (one level of recomputation): the planner's smallest
    one-level peak is within 1.10x of the least, at each budget down to it the planner's recomputation
    costs at most 1.10x the fewest FLOPs any set needs, and with two levels it goes below the least."""
    model, x = {"chain": (mlp_chain(6, 32), torch.randn(2, 64, 32)), "bn": (conv_bn(2), torch.randn(2, 3, 16, 16))}[name]
    g = stagetorch.make_ir(step_of(model))(x)
    cands = candidates(g)
    assert len(cands.roots) <= 14
    sim = Simulator(g, cands)
    every = [sim.run(frozenset(r for i, r in enumerate(cands.roots) if mask >> i & 1))[:2]
             for mask in range(2 ** len(cands.roots))]
    points = frontier(g)
    least = min(p for p, _ in every)
    one_level = min(p.peak_bytes for p in points if not p.transient)
    # (BatchNorm's backward workspace is a floor no schedule goes below: there two levels reach the least.)
    two_levels = min(p.peak_bytes for p in points)
    assert one_level <= 1.10 * least and (two_levels < least if name == "chain" else two_levels <= least)
    for budget in sorted({p for p, _ in every if p >= one_level}):
        ours = [p.extra_flops for p in points if p.peak_bytes <= budget]
        assert min(ours) <= 1.10 * min(e for p, e in every if p <= budget), budget


def test_batchnorm_state_after_three_steps_equals_eager():
    """BatchNorm couples the batch, so only recomputation can lower the peak; its running statistics and
    num_batches_tracked must be updated once per step, as in eager PyTorch."""
    torch.manual_seed(0)
    model = conv_bn(6, 16)
    eager = copy.deepcopy(model)
    x = torch.randn(4, 3, 32, 32)
    full = peak_bytes(stagetorch.make_ir(step_of(model))(x))
    with pytest.raises(BatchCouplingError):
        stagetorch.jit(step_of(copy.deepcopy(model)), memory_budget=int(full * 0.8), remat=False).plan(x)
    staged = stagetorch.jit(step_of(model), memory_budget=int(full * 0.8))
    opt, opt_e = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(eager.parameters(), lr=0.1)
    for step in range(3):
        xs = x * (step + 1)
        loss, loss_e = staged(xs), step_of(eager)(xs)
        assert isinstance(staged.plan(xs), RematPlan)
        torch.testing.assert_close(loss, loss_e, rtol=1e-5, atol=1e-6)
        opt.step(), opt_e.step()
        opt.zero_grad(), opt_e.zero_grad()
    for (name, b), b_e in zip(model.named_buffers(), eager.buffers()):
        if name.endswith("num_batches_tracked"):
            assert b.item() == b_e.item() == 3
        else:
            torch.testing.assert_close(b, b_e, rtol=1e-5, atol=1e-6)


def test_batchnorm_staged_bit_exact_against_no_recompute():
    model = conv_bn(6, 16)
    reference = copy.deepcopy(model)
    x = torch.randn(4, 3, 32, 32)
    full = peak_bytes(stagetorch.make_ir(step_of(model))(x))
    expected, *_ = _run(reference, x, remat=False)
    loss, plan, peak = _run(model, x, memory_budget=int(full * 0.8))
    assert isinstance(plan, RematPlan) and peak <= int(full * 0.8)
    assert abs(peak - plan.peak) <= 0.02 * peak
    assert torch.equal(loss, expected) and all(map(torch.equal, grads(model), grads(reference)))
    assert all(map(torch.equal, model.buffers(), reference.buffers()))


def test_remat_false_and_bad_values():
    with pytest.raises(ValueError, match="remat"):
        stagetorch.jit(lambda x: x, remat="always")


# ---------------------------------------------------------------------------------------------------------
# FLOP rules against torch.utils.flop_counter.


def _ours(graph, packets) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in graph.eqns:
        if e.prim.overloadpacket in packets:
            key = str(e.prim.overloadpacket).split(".")[-1]
            out[key] = out.get(key, 0) + eqn_flops(e)
    return out


def test_flops_match_torch_flop_counter():
    aten = torch.ops.aten
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ConvTranspose2d(8, 4, 3),
        nn.Flatten(), nn.LazyLinear(7),
    )
    x = torch.randn(2, 3, 13, 13)
    model(x)
    g = stagetorch.make_ir(step_of(model))(x)
    with FlopCounterMode(display=False) as counter:
        step_of(model)(x)
    theirs = {str(k).split(".")[-1]: v for k, v in counter.get_flop_counts()["Global"].items()}
    ours = _ours(g, {aten.mm, aten.addmm, aten.convolution, aten.convolution_backward})
    assert ours == theirs and ours["convolution_backward"] > 0


def test_flops_of_batched_matmul_and_attention():
    aten = torch.ops.aten
    q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))

    def fn(q, k, v):
        out = F.scaled_dot_product_attention(q, k, v) + torch.bmm(q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2)).sum()
        out.sum().backward()
        return out

    g = stagetorch.make_ir(fn)(q, k, v)
    with FlopCounterMode(display=False) as counter:
        torch.bmm(q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2))
    attn = [e for e in g.eqns if "attention" in op_name(e.prim)]
    assert len(attn) == 2  # CPU's flash kernel, which flop_counter has no formula for: use its formulas
    shapes = [tuple(q.shape)] * 3
    assert eqn_flops(attn[0]) == sdpa_flop_count(*shapes)
    assert eqn_flops(attn[1]) == sdpa_backward_flop_count(shapes[0], *shapes)
    assert _ours(g, {aten.bmm})["bmm"] == counter.get_total_flops() * 3  # forward + two in the backward


def test_pointwise_flops_are_by_size_and_views_free():
    x = Var(stagetorch.Aval((4, 5), torch.float32))
    out = Var(stagetorch.Aval((4, 5), torch.float32))
    view = Var(stagetorch.Aval((20,), torch.float32), base=x)
    assert eqn_flops(Eqn(torch.ops.aten.sin.default, (x,), {}, (out,))) == 20
    assert eqn_flops(Eqn(torch.ops.aten.view.default, (x, [20]), {}, (view,))) == 0


# ---------------------------------------------------------------------------------------------------------
# The seed models: a budget sweep, measured.


_OVER = {"densenet": 0.08, "lstm": 0.05}


@pytest.mark.parametrize("name", sorted(remat_models.SEEDS))
def test_seed_model_budget_sweep(name):
    """From the whole step's peak down to 0.2x of it: each budget runs within itself (or a named error says
    it is below the floor), the plan predicts the measured peak to 2%, chunked or not, the measured peak
    does not rise as the budget falls, and the result is exactly the no-recompute staged step's when the
    batch is not split (close to it when it is)."""
    torch.manual_seed(0)
    model, x = remat_models.SEEDS[name]()
    reference = copy.deepcopy(model)
    expected, *_ = _run(reference, x, remat=False)
    staged = stagetorch.jit(step_of(model))
    full = peak_bytes(staged.graph(x))
    floor_seen, last_peak = False, math.inf
    # The call holds a copy of each buffer the step updates (BatchNorm's running statistics) beside the program.
    held = sum(b.untyped_storage().nbytes() for b in model.buffers())
    for fraction in (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.45, 0.4, 0.3, 0.2):
        budget = math.ceil(full * fraction / (1 - SAFETY_MARGIN)) + held + 1
        staged.memory_budget = budget
        model.zero_grad(set_to_none=True)
        try:
            plan = staged.plan(x)
        except (OutOfMemoryError, BatchCouplingError, UnsupportedOpError) as e:
            assert "smallest budget any schedule fits is" in str(e)
            floor_seen = True
            continue
        assert not floor_seen, "a smaller budget fitted after a larger one did not"
        with AllocatorPeak([*model.parameters(), *model.buffers(), x]) as tracker:
            loss = staged(x)
        assert tracker.peak <= budget, (fraction, plan)
        # At the allocator: the plan is at most 2% under; over by up to _OVER where a workspace rule is a bound
        # or a fit (oneDNN's weight-gradient buffers, its LSTM scratchpad: tests/ops/test_workspace.py).
        assert -0.02 <= (plan.peak - tracker.peak) / tracker.peak <= _OVER.get(name, 0.02), (fraction, tracker.peak, plan)
        assert tracker.peak <= last_peak, (fraction, tracker.peak, last_peak, plan)  # non-increasing as it falls
        last_peak = tracker.peak
        if plan.chunked:  # chunks sum in another order: close, not equal
            torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
            continue
        assert torch.equal(loss, expected)
        assert all(map(torch.equal, grads(model), grads(reference))), (fraction, plan)
        assert fraction < 1.0 or not isinstance(plan, RematPlan)


@pytest.mark.parametrize("name", sorted(remat_models.SEEDS))
def test_the_checkpointed_baselines_compute_the_models_step(name):
    """The bench's baselines (per-block checkpoint, checkpoint_sequential) give the model's loss and gradients:
    they are timed against stagetorch as the same step. BatchNorm's statistics are left out of the comparison
    (torch's checkpoint updates them twice, pytorch#96136)."""
    torch.manual_seed(0)
    model, x = remat_models.SEEDS[name]()
    forwards = [remat_models.per_block(name, model)[1], remat_models.sequential(name, model)]
    assert (forwards[1] is None) == (name == "lstm")
    expected = step_of(model)(x)
    expected_grads = [g.clone() for g in grads(model)]
    for forward in filter(None, forwards):
        model.zero_grad(set_to_none=True)
        loss = forward(x).square().mean()
        loss.backward()
        torch.testing.assert_close(loss, expected)
        for got, want in zip(grads(model), expected_grads):
            torch.testing.assert_close(got, want)


def _block_forward_flops(graph, blocks: list[str]) -> int:
    """FLOPs of the forward equations inside the given modules: what per-block checkpointing recomputes."""

    def inside(module: str) -> bool:
        path = module.split(".", 1)[1] if "." in module else ""  # drop the step's own name for the model
        return any(path == b or path.startswith(b + ".") for b in blocks)

    return sum(eqn_flops(e) for e in graph.eqns if not e.source.backward and inside(e.source.module))


@pytest.mark.parametrize("name", sorted(remat_models.SEEDS))
def test_fewer_recompute_flops_than_per_block_checkpoint(name):
    """Per-block ``torch.utils.checkpoint`` recomputes each block's whole forward; its peak is measured on
    the real run. The planner's cheapest recompute set whose predicted peak is no higher recomputes at most
    0.6x those FLOPs (a part of some blocks, or only their cheap ops). ResNet's bottlenecks need the
    two-level sets that hold each block's narrow convolution outputs beside every other block's output
    (0.37x): without them the planner only matched per-block checkpointing (0.97x)."""
    torch.manual_seed(0)
    model, x = remat_models.SEEDS[name]()
    graph = stagetorch.make_ir(step_of(model))(x)
    blocks, forward = remat_models.per_block(name, model)
    theirs = _block_forward_flops(graph, blocks)
    assert theirs > 0.2 * graph_flops(graph)  # the blocks are most of the forward
    with AllocatorPeak([*model.parameters(), *model.buffers(), x]) as tracker:
        loss = forward(x).square().mean()
        loss.backward()
    points = frontier(graph)
    # At the allocator, per-block checkpointing of the LSTM holds oneDNN's workspace again for each layer it
    # recomputes: no lower than recomputing nothing, which the planner's first point then matches.
    assert tracker.peak < points[0].peak_bytes or name == "lstm"
    ours = min(p.extra_flops for p in points if p.peak_bytes <= tracker.peak)
    assert ours <= 0.6 * theirs, (ours / theirs, tracker.peak / points[0].peak_bytes)


@pytest.mark.parametrize("name", sorted(remat_models.TRAINING))
def test_one_third_of_the_peak_at_training_sizes(name):
    """At a budget of 1/3 the no-recompute peak, the joint plan's predicted step cost (FLOPs, recomputed ones
    included, plus the price of each op call per chunk) is at most 1.20x the unconstrained step's on the
    seed models at training sizes: chunking is nearly free there, and recomputation fills in where a chunk
    alone does not fit. ResNet's BatchNorm rules out chunks, so recomputation alone must reach 1/3: its
    bottlenecks then recompute their wide 1x1 convolution, some twice (for the block's output and for its
    own backward). With the convolutions' workspaces counted, the frontier's first set below 1/3 cost 1.29x;
    the repair of the sets just above it (a few more drops where the peak is) and the polish reach 1.18x.
    VNet's two examples run as two chunks of one: the sets chosen for the whole batch's peak cost 1.38x
    there, those chosen for a chunk's (its own frontier) 1.10x; with the strided 3D convolution's input
    gradient's true workspace, 1.29x, and 1.17x with the chunk's sets repaired to the budget (see
    test_vnet_just_above_a_third). Planning only: the plan is exact by the other tests."""
    torch.manual_seed(0)
    model, x = remat_models.TRAINING[name]()
    staged = stagetorch.jit(step_of(model), remat=False)
    graph = staged.graph(x)
    full = peak_bytes(graph)
    plan = stagetorch.jit(step_of(model), memory_budget=math.ceil(full / 3)).plan(x)
    assert plan.peak <= full / 3
    assert predicted_cost(graph, plan) <= 1.20 * predicted_cost(graph)
    assert (len(plan.chunk_sizes) == 1) == (name == "resnet")


def test_vnet_just_above_a_third():
    """VNet at training size in two chunks of one, at budgets of 1/3 of its peak and just above: each plan
    costs at most 1.20x the unconstrained step, and no more than the plan of a smaller budget. A chunk's
    32-channel convolutions' backward holds a 46 MiB workspace, beside which no full-resolution value fits:
    the first stage's values must be made again after it. The frontier's sets either hold one across it
    (1/3: 1.29x) or recompute the stage for every segment, and the repair that drops one value at a time
    never took the cheaper one: dropping the stage's convolution output alone raises the peak (the stage is
    rebuilt whole before the strided convolution's backward), which recomputing its first half again for its
    own backward then lowers (the repair's look-ahead: 1.17x). Just above 1/3 (0.345: 1.41x) the chunk's sets
    predicted to fit were costed by the first chunk alone, and the four tried did not fit a later chunk,
    which holds the parameters' gradients (1.7 MiB) beside its own peak: a bound on it orders them (1.06x)."""
    torch.manual_seed(0)
    model, x = remat_models.TRAINING["vnet"]()
    graph = stagetorch.jit(step_of(model), remat=False).graph(x)
    full, unconstrained = peak_bytes(graph), predicted_cost(graph)
    costs = []
    for fraction in (1 / 3, 0.345, 0.36):
        plan = stagetorch.jit(step_of(model), memory_budget=math.ceil(full * fraction)).plan(x)
        assert plan.peak <= full * fraction and plan.chunk_sizes == (1, 1)
        costs.append(predicted_cost(graph, plan) / unconstrained)
    assert max(costs) <= 1.20, costs
    assert costs == sorted(costs, reverse=True), costs


# ---------------------------------------------------------------------------------------------------------
# Training loops as users write them, under a recomputing plan, against the same loop in eager PyTorch.


def _training_step(model: nn.Module, opt: torch.optim.Optimizer, weights: dict):
    """An optimizer step inside the step, a loss weight read from a dict the loop changes, a clipped norm."""

    def step(x, y):
        opt.zero_grad()
        loss = weights["ce"] * F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    return step


def _budget_that_recomputes(staged: stagetorch.Staged, chunked: bool, *args) -> RematPlan:
    """Set the largest budget (in 3% steps down from the whole batch's peak) whose plan recomputes, in chunks
    or whole; its plan."""
    staged.memory_budget = None
    budget = staged.plan(*args).full_batch_peak_bytes
    while budget > 1024:
        staged.memory_budget = budget
        plan = staged.plan(*args)
        if isinstance(plan, RematPlan) and plan.recompute is not None and plan.chunked == chunked:
            return plan
        budget = int(budget * 0.97)
    raise AssertionError("no budget gives such a plan")


@pytest.mark.parametrize("chunked", [True, False], ids=["chunks-and-recompute", "recompute-whole"])
def test_a_training_loop_under_recomputation_matches_eager(chunked):
    """Four steps of a deep MLP with SGD (Nesterov momentum, weight decay) inside the step, a gradient hook
    on a weight, a loss weight the loop changes between steps (the step is staged again), and every step's
    loss kept across steps: losses, weights, gradients and momentum equal the same loop in eager PyTorch
    (float64), and every plan recomputes."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(32, 32), nn.GELU())], nn.Linear(32, 5)).double()
    batch = 6 if chunked else 1  # one example cannot be split: only recomputation fits it
    reference = copy.deepcopy(model)
    for m in (model, reference):
        m[0].weight.register_hook(lambda g: g.clamp(-0.05, 0.05))
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)
                    for m in (model, reference))
    weights = {"ce": 1.0}
    staged = stagetorch.jit(_training_step(model, opt, weights))
    batches = [(torch.randn(batch, 256, 32, dtype=torch.float64), torch.randint(0, 5, (batch, 256))) for _ in range(4)]
    tol = 1e-10
    kept, kept_eager = [], []
    for call, (x, y) in enumerate(batches):
        weights["ce"] = 1.0 + 0.5 * call
        eager = _training_step(reference, ref_opt, dict(weights))
        _budget_that_recomputes(staged, chunked, x, y)  # the optimizer's state is new after the first call
        loss, expected = staged(x, y), eager(x, y)
        kept.append(loss), kept_eager.append(expected.detach())
        torch.testing.assert_close(loss, expected.detach(), rtol=tol, atol=tol)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=tol, atol=tol)
            torch.testing.assert_close(p.grad, q.grad, rtol=tol, atol=tol)
            for key, value in ref_opt.state[q].items():
                torch.testing.assert_close(opt.state[p][key], value, rtol=tol, atol=tol)
    assert len(staged._cache) == 4  # one program per loss weight
    torch.testing.assert_close(kept, kept_eager, rtol=tol, atol=tol)  # no later step wrote into an earlier's


# ---------------------------------------------------------------------------------------------------------
# Out of memory where a recomputing plan said the step fits.


class _Deep(nn.Module):
    """Eight Linear + GELU blocks, then test_chunking's op that runs out of memory above a number of rows."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(64, 64), nn.GELU())])
        self.head = nn.Linear(64, 5)

    def forward(self, x):
        return self.head(torch.ops.stagetorch_test.scratch_hungry(self.body(x)))


@pytest.mark.parametrize("fraction", [0.7, 0.4])  # a whole-batch and a chunked plan that recompute
def test_an_oom_under_a_recomputing_plan_is_redone_exactly_and_remembered(fraction, caplog):
    """Three SGD steps against the same eager loop; the device holds 20 rows where the plan runs 64 or 32."""
    torch.manual_seed(0)
    model = _Deep()
    reference = copy.deepcopy(model)
    batches = [(torch.randn(64, 16, 64), torch.randint(0, 5, (64, 16))) for _ in range(3)]

    def step_of(m):
        def step(x, y):
            loss = F.cross_entropy(m(x).flatten(0, 1), y.flatten())
            loss.backward()
            return loss

        return step

    staged = stagetorch.jit(step_of(model))
    staged.memory_budget = int(staged.plan(*batches[0]).full_batch_peak_bytes * fraction)
    plan = staged.plan(*batches[0])
    assert isinstance(plan, RematPlan) and plan.recompute is not None and max(plan.chunk_sizes) > 20
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    try:
        with caplog.at_level("WARNING", logger="stagetorch"):
            for k, (x, y) in enumerate(batches):
                _DEVICE.update(limit=20, raised=0)
                optimizer.zero_grad()
                loss = staged(x, y)
                raised = _DEVICE["raised"]
                _DEVICE["limit"] = 10**9
                ref_optimizer.zero_grad()
                expected = step_of(reference)(x, y)
                torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
                for p, q in zip(model.parameters(), reference.parameters()):
                    torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
                optimizer.step()
                ref_optimizer.step()
                assert (raised > 0) == (k == 0), (k, raised)  # later steps plan with the chunk that ran
    finally:
        _DEVICE.update(limit=10**9, raised=0)
    plan = staged.plan(*batches[0])
    assert max(plan.chunk_sizes) <= 20, plan
    assert any("later calls" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


def test_step_cost_prices_each_op_call_by_device():
    """A chunk more costs every op call once more, at the device's price: a CUDA launch is worth far more
    arithmetic than a CPU dispatch, so on CUDA the planner prefers recomputation to chunks sooner."""
    from stagetorch.planning.remat_search import CALL_FLOPS

    assert step_cost(1000, 10, 1) == 1000 + 10 * CALL_FLOPS["cpu"]
    assert step_cost(1000, 10, 3, torch.device("cuda", 0)) == 1000 + 30 * CALL_FLOPS["cuda"]
    assert step_cost(1000, 10, 3, "mps") == 1000 + 30 * CALL_FLOPS["cpu"]  # unknown device types price as CPU
    assert CALL_FLOPS["cuda"] > 100 * CALL_FLOPS["cpu"]


def test_an_lstm_layer_runs_a_kernel_per_time_step():
    """The ``calls`` rule: a CPU LSTM layer multiplies each step's hidden state apart, so chunking it costs
    the fixed price per call once per time step (twice in the backward); every other op runs one kernel."""
    torch.manual_seed(0)
    model, _ = remat_models.lstm()  # 3 layers
    for steps in (48, 96):
        graph = stagetorch.make_ir(step_of(model))(torch.randn(4, steps, 64))
        layers = [e for e in graph.eqns if op_name(e.prim).startswith("aten.mkldnn_rnn_layer")]
        assert len(layers) == 6  # a forward and a backward per layer
        assert graph_calls(graph) == len(graph.eqns) - 6 + 3 * steps + 3 * 2 * steps

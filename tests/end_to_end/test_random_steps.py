"""Random networks under random budgets, trained for two steps against eager PyTorch.

Each case (tests/support/random_nets.py) draws a small DAG network over sequences or images, a batch size, a loss
and a fraction of the whole step's peak as ``memory_budget``. The staged step (recomputation allowed, the
planner choosing chunks and recompute together) must run, or raise a named error whose smallest budget
then runs; within its budget, as its plan predicts (to 2% either way); and give eager's loss, gradients,
weights and BatchNorm statistics (float64, to 1e-9), over two SGD steps between which a Python value the
forward reads changes. The same generators over hundreds more seeds (tools/probes/random_probe.py) found the
defects tests/ops/test_layout.py and the chunk-graph and upsampling tests now pin down.
"""

from __future__ import annotations

import copy

import pytest
import random_nets
import torch
from memtrack import AllocatorPeak

import stagetorch
from stagetorch.errors import BatchCouplingError, OutOfMemoryError
from stagetorch.interpreters.memory import peak_bytes

_TOL = {"rtol": 1e-9, "atol": 1e-12}


def _plan_within(staged, x, y, budget: int):
    """The plan at ``budget``, or at the smallest budget the planner's error names (which must plan)."""
    staged.memory_budget = budget
    try:
        return staged.plan(x, y), budget
    except (OutOfMemoryError, BatchCouplingError) as e:
        assert "smallest" in str(e) and e.smallest_budget is not None, str(e)
        staged.memory_budget = e.smallest_budget
        return staged.plan(x, y), e.smallest_budget


def train_against_eager(case: random_nets.Case, steps: int = 2) -> list:
    """``steps`` SGD steps of ``case`` staged and eager; asserts as the module says; returns the plans."""
    model = case.model
    reference = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, reference))
    staged = stagetorch.jit(case.step(model))
    plans = []
    for k in range(steps):
        x, y = (case.x, case.y) if k == 0 else case.batch(k)
        model.scale = reference.scale = 1.0 + 0.7 * k
        # The call holds a copy of each buffer the step updates (BatchNorm's statistics) beside the program.
        held = sum(b.untyped_storage().nbytes() for b in model.buffers())
        opt.zero_grad(set_to_none=True)  # before planning: a .grad held would be planned as added into
        plan, budget = _plan_within(staged, x, y, int(peak_bytes(staged.graph(x, y)) * case.fraction) + held)
        plans.append(plan)
        with AllocatorPeak([*model.parameters(), *model.buffers(), x, y]) as tracker:
            got = staged(x, y)
        where = f"{case.description}, step {k}"
        assert tracker.peak <= budget, (where, plan)
        # At the allocator, to 2%: the workspace rules follow the strides the trace records (a Conv1d copies
        # only a transposed input, BatchNorm's backward keeps its input-sized temporary only where input and
        # gradient share a layout, channels-last convolutions copy a contiguous weight...). Before they did,
        # these seeds measured 15% over and 8% under their plans; image 5, 9.4% under, where the recomputation
        # simulator held a recomputed sum beside the operand it adds into (tests/transforms/test_remat.py).
        assert plan.held_bytes == held and plan.peak * 0.98 <= tracker.peak <= plan.peak * 1.02, (where, tracker.peak, plan)
        ref_opt.zero_grad(set_to_none=True)
        expected = case.step(reference)(x, y)
        torch.testing.assert_close(got, expected.detach(), **_TOL, msg=lambda m, where=where: f"{where}: {m}")
        for p, q in zip(model.parameters(), reference.parameters()):
            assert (p.grad is None) == (q.grad is None), where
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, **_TOL, msg=lambda m, where=where: f"{where}: {m}")
        for b, c in zip(model.buffers(), reference.buffers()):
            torch.testing.assert_close(b, c, **_TOL, msg=lambda m, where=where: f"{where}: {m}")
        opt.step()
        ref_opt.step()
    return plans


@pytest.mark.parametrize("seed", range(64))
def test_a_random_sequence_network_trains_within_its_budget_as_eager(seed):
    train_against_eager(random_nets.sequence(seed))


@pytest.mark.parametrize("seed", range(32))
def test_a_random_image_network_trains_within_its_budget_as_eager(seed):
    train_against_eager(random_nets.image(seed))


def test_the_smallest_budget_an_error_names_plans():
    """Image 51 at half its peak: the error names the budget where its least recompute set runs one
    example per chunk. That set's chunk of one holds less than half its whole-batch peak (whose schedule
    differs), so the joint planner's bound on its fewest chunks left it out, and the named budget raised
    again; the set is now planned there."""
    case = random_nets.image(51)
    staged = stagetorch.jit(case.step(case.model))
    staged.memory_budget = int(peak_bytes(staged.graph(case.x, case.y)) * case.fraction)
    with pytest.raises(OutOfMemoryError) as error:
        staged.plan(case.x, case.y)
    staged.memory_budget = error.value.smallest_budget
    plan = staged.plan(case.x, case.y)
    assert plan.recompute is not None and plan.peak <= staged.memory_budget


@pytest.mark.parametrize("seed", [36, 38, 59, 68, 74, 75])
def test_image_networks_that_mix_layouts_measure_their_plan(seed):
    """Networks whose activations are channels-last in places (or whose batch of one is): measured at the
    allocator within 0.1% of the plan (before the rules read layouts: up to 20% over and 6% under). Each
    found a gap: nearest upsampling's and pooling backward's copies (75, 74), group norm's traced layout on a
    batch of one (68), a gradient accumulation the plan took as in place where the run cannot add into the
    operand, or the sum it makes is laid out otherwise than the plan's (38, 36, 59)."""
    case = random_nets.image(seed)
    staged = stagetorch.jit(case.step(case.model))
    held = sum(b.untyped_storage().nbytes() for b in case.model.buffers())
    plan, budget = _plan_within(staged, case.x, case.y, int(peak_bytes(staged.graph(case.x, case.y)) * case.fraction) + held)
    with AllocatorPeak([*case.model.parameters(), *case.model.buffers(), case.x, case.y]) as tracker:
        staged(case.x, case.y)
    assert tracker.peak <= budget and abs(tracker.peak - plan.peak) <= 0.001 * plan.peak, (case.description, tracker.peak, plan)

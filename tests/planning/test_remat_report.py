"""``stagetorch.memory(fn, memory_budget=...)``: the report of how a step runs under a budget, recomputation
included, held to the plan ``jit`` makes for that budget and to the live-storage tracker's measurement."""

from __future__ import annotations

import pytest
import torch
from memtrack import AllocatorPeak
from remat_models import mlp_chain, step_of

import stagetorch
from stagetorch.errors import OutOfMemoryError
from stagetorch.interpreters.memory import peak_bytes
from stagetorch.ir import op_name
from stagetorch.planning.remat_search import RematPlan
from stagetorch.transforms.remat import recomputed_eqns


def _ops(eqns):
    return [(op_name(e.prim), str(e.source)) for e in eqns]


# Recomputing: whole, and in 2 chunks. (At 2.6 MiB the 12 B the pow backward's wrapped 2.0 takes moved the
# recompute frontier, and the whole batch recomputing more became the cheaper plan.)
@pytest.mark.parametrize("batch, budget", [(1, "2MiB"), (2, "2.4MiB")])
def test_the_schedule_is_jits_plan_and_the_measured_peak(batch, budget):
    torch.manual_seed(0)
    model = mlp_chain()
    x = torch.randn(batch, 512, 64)
    report = stagetorch.memory(step_of(model), memory_budget=budget)(x)
    staged = stagetorch.jit(step_of(model), memory_budget=budget)
    plan = staged.plan(x)
    s = report.schedule
    assert isinstance(plan, RematPlan) and plan.recompute is not None
    # The same plan: chunks, peak, recomputed equations (op and source, in order), FLOPs, values and checkpoints.
    assert s.chunk_sizes == plan.chunk_sizes == (1,) * batch
    assert s.peak_bytes == plan.peak and s.plan == str(plan)
    assert _ops(s.recomputed) == _ops(recomputed_eqns(plan.recompute.graph)) and s.recomputed
    assert s.extra_flops == plan.extra_flops > 0 and s.base_flops == plan.base_flops
    assert len(s.kept) == len(plan.recompute.keep) and len(s.dropped) + len(s.kept) == len(plan.recompute.cands.roots)
    assert [v.aval for v in s.dropped] == [r.aval for r in plan.recompute.cands.roots if r not in plan.recompute.keep]
    assert all(e.outvars[0].root is v for v, e in zip(s.dropped, s.made_by))
    # The timeline is that of the program that runs: its peak is the plan's (a later chunk's, when chunked),
    # and every mark is a recomputed equation.
    assert max(s.live) == (plan.peak_bytes[-1] if batch > 1 else plan.peak)
    assert s.marks and all(0 < i < len(s.live) for i in s.marks)
    if batch == 1:
        assert len(s.marks) == len(s.recomputed) and len(s.live) == len(plan.recompute.graph.eqns) + 1
    # The report without a budget is the step without recomputation.
    assert report.peak_bytes == peak_bytes(staged.graph(x)) > s.budget_bytes
    with AllocatorPeak([*model.parameters(), x]) as tracker:
        staged(x)
    assert tracker.peak <= s.peak_bytes + 64 and s.peak_bytes <= s.budget_bytes  # 0-dim temporaries: bytes
    assert s.peak_bytes - tracker.peak <= 0.02 * tracker.peak
    text = str(report)
    assert "Recomputes" in text and "checkpoint(s) kept" in text and "aten.addmm" in text


def test_a_budget_the_step_fits_recomputes_nothing(tmp_path):
    model = mlp_chain()
    x = torch.randn(2, 512, 64)
    report = stagetorch.memory(step_of(model), memory_budget="1GiB")(x)
    s = report.schedule
    assert s.recomputed == () and s.marks == () and s.extra_flops == 0 and s.chunk_sizes == (2,)
    assert s.peak_bytes == max(s.live) == report.peak_bytes
    assert "Nothing is recomputed" in str(report)
    assert stagetorch.memory(step_of(model))(x).schedule is None


def test_remat_false_and_a_budget_nothing_fits():
    model = mlp_chain()
    x = torch.randn(2, 512, 64)
    with pytest.raises(OutOfMemoryError, match="not even one example fits") as info:
        stagetorch.memory(step_of(model), memory_budget="3MiB", remat=False)(x)
    assert "Recomputing" not in str(info.value)
    with pytest.raises(OutOfMemoryError, match="smallest budget any schedule fits is"):
        stagetorch.memory(step_of(model), memory_budget="256KiB")(x)
    report = stagetorch.memory(step_of(model), memory_budget="6MiB", remat=False)(x)
    assert report.schedule.chunk_sizes == (1, 1) and report.schedule.recomputed == ()


def test_the_plot_draws_the_schedule(tmp_path):
    model = mlp_chain()
    x = torch.randn(1, 512, 64)
    path = stagetorch.memory(step_of(model), memory_budget="2MiB")(x).plot(str(tmp_path / "remat.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"

"""tools/gpu/cuda_memory_check.py --remat-seeds: each seed model of tests/support/remat_models.py recomputing at 1.0, 0.7 and
0.5 of its peak plans within 2% of the allocator's peak of the call it measures, runs under its budget, and
gets the eager step's gradients. It planned with the last fraction's .grad still held (which the program
replaces, so the plan counted it and recomputed more), then measured a call without it: the transformer at
0.7x read +4.5%, the LSTM +9.5%, DenseNet at 0.5x +2.9% (issue 25)."""

from __future__ import annotations

import copy
import importlib.util
import pathlib
import sys

import pytest
import remat_models
import torch

_BENCH = pathlib.Path(__file__).parents[2] / "tools" / "gpu" / "cuda_memory_check.py"


def _bench():
    spec = importlib.util.spec_from_file_location("cuda_memory_check", _BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(_BENCH.parent))  # for its ``import _paths`` (tools/_paths.py)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(_BENCH.parent))
    return module


# The LSTM at 0.5x runs in chunks of one example, where oneDNN's LSTM backward allocates 206,904 B inside
# itself and its rule (a fit: stagetorch/ops/recurrent.py, tests/ops/test_workspace.py) says 256,256 B: the plan is
# 49,352 B (2.8%) over, on the safe side. Every other case is within 2%.
TOLERANCE = {("lstm", 0.5): 0.03}


@pytest.mark.parametrize("name", ["transformer", "lstm", "densenet"])
def test_seed_plans_are_the_allocators(name):
    bench = _bench()
    torch.manual_seed(0)
    model, x = remat_models.SEEDS[name]()
    eager = copy.deepcopy(model)
    remat_models.step_of(eager)(x)
    expected = [p.grad for p in eager.parameters()]

    def same_grads(fraction):
        for p, g in zip(model.parameters(), expected):
            torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} at {fraction}x: {m}")

    runs = bench.seed_runs(model, x, "cpu", False, after=same_grads)
    assert [r[0] for r in runs] == [1.0, 0.7, 0.5]
    for fraction, budget, plan, run in runs:
        assert plan is not None, (name, fraction)
        assert run.peak <= budget, (name, fraction, run.peak, budget)
        tolerance = TOLERANCE.get((name, fraction), 0.02)
        assert abs(plan.peak - run.peak) <= tolerance * run.peak, (name, fraction, plan.peak, run.peak)

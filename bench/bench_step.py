"""A staged step against eager PyTorch on CPU at steady state (issue 2).

Run: python -m pytest bench/bench_step.py --benchmark-enable -s
"""

from __future__ import annotations

import models
import pytest
import torch

import stagetorch

CASES = {"seed_mlp_b256": (models.seed_mlp, 256), "transformer_b64": (models.transformer, 64)}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", ["eager", "staged"])
def test_step(benchmark, case, mode):
    torch.set_num_threads(2)
    factory, batch = CASES[case]
    model, make = factory()
    x, y = make(batch)
    step = models.train_step(model)
    run = stagetorch.jit(step) if mode == "staged" else step

    def one():
        model.zero_grad(set_to_none=True)
        return run(x, y)

    for _ in range(3):
        one()
    benchmark.pedantic(one, rounds=50, iterations=1, warmup_rounds=5)

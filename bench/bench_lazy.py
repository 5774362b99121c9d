"""One-line mode against eager PyTorch on CPU: the seed MLP train step at batch 8 and 256 (issue 5).

Run: python -m pytest bench/bench_lazy.py --benchmark-enable
"""

from __future__ import annotations

import models
import pytest
import torch
import torch.nn as nn

import stagetorch


@pytest.mark.parametrize("batch", [8, 256])
@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_seed_step(benchmark, batch, mode):
    torch.set_num_threads(2)
    model, make = models.seed_mlp()
    x, y = make(batch)
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        inputs, labels = stagetorch.lazy(x, y, batch=0) if mode == "lazy" else (x, y)
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), labels)
        loss.backward()
        optimizer.step()

    for _ in range(3):
        step()
    benchmark.pedantic(step, rounds=30, iterations=1, warmup_rounds=3)

"""One-line mode against eager PyTorch on CPU: the seed MLP train step at batch 8 and 256 (issue 5).

Run: python -m pytest bench/bench_lazy.py --benchmark-enable -s

``test_seed_step`` times each mode on its own (pytest-benchmark's table). ``test_interleaved_ratio`` runs
an eager step and a lazy step alternately, 400 times, and prints the ratio of their medians: on a shared
machine whose speed drifts by 20-30% within a minute, that ratio is the number to quote.
"""

from __future__ import annotations

import copy
import statistics
import time

import models
import pytest
import torch
import torch.nn as nn

import stagetorch


def seed_step(model, x, y, mode):
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        inputs, labels = stagetorch.lazy(x, y, batch=0) if mode == "lazy" else (x, y)
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), labels)
        loss.backward()
        optimizer.step()

    return step


@pytest.mark.parametrize("batch", [8, 256])
@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_seed_step(benchmark, batch, mode):
    torch.set_num_threads(2)
    model, make = models.seed_mlp()
    x, y = make(batch)
    step = seed_step(model, x, y, mode)
    for _ in range(3):
        step()
    benchmark.pedantic(step, rounds=30, iterations=1, warmup_rounds=3)


@pytest.mark.parametrize("batch", [8, 256])
def test_interleaved_ratio(benchmark, batch):
    torch.set_num_threads(2)
    model, make = models.seed_mlp()
    x, y = make(batch)
    eager, lazy = seed_step(model, x, y, "eager"), seed_step(copy.deepcopy(model), x, y, "lazy")
    for _ in range(20):
        eager()
        lazy()
    times: dict[str, list[float]] = {"eager": [], "lazy": []}

    def rounds():
        for _ in range(400):
            for name, step in (("eager", eager), ("lazy", lazy)):
                t = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - t)

    benchmark.pedantic(rounds, rounds=1, iterations=1)
    e, z = statistics.median(times["eager"]), statistics.median(times["lazy"])
    benchmark.extra_info.update(eager_median_us=e * 1e6, lazy_median_us=z * 1e6, ratio=z / e)
    print(f"\nbatch {batch}: eager median {e * 1e6:.0f} us, lazy median {z * 1e6:.0f} us, lazy / eager {z / e:.2f}")

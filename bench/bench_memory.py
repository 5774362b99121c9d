"""Memory: costing time for a deep staged step (issue 3), and predicted against measured peaks on every path
(issue 12).

Run: python -m pytest bench/bench_memory.py --benchmark-enable -s
"""

from __future__ import annotations

import models
import pytest
import torch
import torch.nn as nn
from memtrack import MODELS, PATHS, AllocatorPeak, measure, smallest_plan_peak

import stagetorch
from stagetorch.interpreters.memory import peak_bytes


@pytest.fixture(scope="module")
def graph():
    model, make = models.transformer(layers=96)
    return stagetorch.make_ir(models.train_step(model))(*make(8))


def test_cost_staged_96_layer_transformer(benchmark, graph):
    peak = benchmark(peak_bytes, graph)
    if not benchmark.disabled:
        print(f"\n96 layers: {len(graph.eqns)} eqns, peak {peak} bytes, costed in {benchmark.stats.stats.median * 1e3:.1f} ms")


def test_predicted_against_measured_every_path(benchmark):
    """The test zoo along every path (tests/support/memtrack.measure): plan's peak, live-storage peak, budget."""
    rows = []

    def table():
        rows.clear()
        for name in MODELS:
            for path in PATHS:
                rows.append((name, path, *measure(name, path)))

    benchmark.pedantic(table, rounds=1, iterations=1)
    print("\n| model | path | chunks | budget | predicted | measured | measured / predicted |\n|---|---|---|---|---|---|---|")
    for name, path, predicted, measured, budget, chunks in rows:
        shown = "-" if budget is None else f"{budget:,}"
        print(f"| {name} | {path} | {chunks} | {shown} | {predicted:,} | {measured:,} | {measured / predicted:.4f} |")


def test_issue_12_mlp_at_four_budgets(benchmark):
    """8 x (Linear(512, 512) + ReLU) + Linear(512, 10), batch 4096, cross-entropy train step."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(512, 512), nn.ReLU())], nn.Linear(512, 10))
    x, y = torch.randn(4096, 512), torch.randint(0, 10, (4096,))
    params = [p.nbytes for p in model.parameters()]
    floor = 2 * sum(params) + x.nbytes + y.nbytes + max(params)
    rows = []

    def table():
        rows.clear()
        for mib in (100, 64, 48, 40, 30):
            staged = stagetorch.jit(models.train_step(model), memory_budget=mib * 2**20)
            # No .grad left by the row before: the plan would hold it beside the program (the 30 MiB row then
            # asked for 36 MiB and raised).
            model.zero_grad(set_to_none=True)
            plan = staged.plan(x, y)
            with AllocatorPeak([*model.parameters(), x, y]) as run:
                staged(x, y)
            rows.append((mib, len(plan.chunk_sizes), plan.peak, run.peak))

    benchmark.pedantic(table, rounds=1, iterations=1)
    smallest = smallest_plan_peak(stagetorch.jit(models.train_step(model)), x, y)
    print(f"\naccumulation floor {floor / 2**20:.1f} MiB; smallest plan's peak {smallest / 2**20:.1f} MiB "
          f"({smallest / floor:.3f} x the floor)")
    print("| budget | chunks | predicted | measured |\n|---|---|---|---|")
    for mib, chunks, predicted, measured in rows:
        print(f"| {mib} MiB | {chunks} | {predicted / 2**20:.1f} MiB | {measured / 2**20:.1f} MiB |")

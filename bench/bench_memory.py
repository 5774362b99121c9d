"""Costing time for an already-staged 96-layer transformer step (issue 3; target under 100 ms).

Run: python -m pytest bench/bench_memory.py --benchmark-enable -s
"""

from __future__ import annotations

import models
import pytest

import stagetorch
from stagetorch.costing import peak_bytes


@pytest.fixture(scope="module")
def graph():
    model, make = models.transformer(layers=96)
    return stagetorch.make_ir(models.train_step(model))(*make(8))


def test_cost_staged_96_layer_transformer(benchmark, graph):
    peak = benchmark(peak_bytes, graph)
    if not benchmark.disabled:
        print(f"\n96 layers: {len(graph.eqns)} eqns, peak {peak} bytes, costed in {benchmark.stats.stats.median * 1e3:.1f} ms")

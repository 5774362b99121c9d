"""Tracing time against depth: a TransformerEncoder train step of 2 to 96 layers (issue 2).

Run: python -m pytest bench/bench_trace.py --benchmark-enable -s
"""

from __future__ import annotations

import time

import models
import pytest

import stagetorch

DEPTHS = (2, 8, 24, 48, 96)


@pytest.mark.parametrize("layers", DEPTHS)
def test_trace_time(benchmark, layers):
    model, make = models.transformer(layers=layers)
    x, y = make(8)
    step = models.train_step(model)
    stagetorch.make_ir(step)(x, y)  # warm FakeTensorMode's caches
    graph = benchmark.pedantic(lambda: stagetorch.make_ir(step)(x, y), rounds=3, iterations=1)
    if benchmark.disabled:  # run as a test (--benchmark-disable): it ran once, there are no timings
        return
    stats = benchmark.stats.stats
    benchmark.extra_info.update(eqns=len(graph.eqns), ms_per_layer=stats.median * 1e3 / layers)
    print(f"\n{layers} layers: {len(graph.eqns)} eqns, min {stats.min * 1e3:.0f} ms, median {stats.median * 1e3:.0f} ms, "
          f"{stats.median * 1e3 / layers:.1f} ms/layer")


def test_trace_time_cold(benchmark):
    """96 layers with stagetorch's metadata cache emptied before each trace: what a first trace costs."""
    from stagetorch.staging import meta_cache

    model, make = models.transformer(layers=96)
    x, y = make(8)
    step = models.train_step(model)
    graph = benchmark.pedantic(
        lambda: stagetorch.make_ir(step)(x, y), setup=meta_cache.META_CACHE.clear, rounds=3, iterations=1
    )
    if benchmark.disabled:
        return
    stats = benchmark.stats.stats
    print(f"\n96 layers, cold cache: {len(graph.eqns)} eqns, min {stats.min * 1e3:.0f} ms, median {stats.median * 1e3:.0f} ms")


def test_fake_tensor_floor():
    """The same step under FakeTensorMode alone: the cost stagetorch's tracer sits on."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from stagetorch.staging.state import discover
    from stagetorch.staging.tracer import _swap

    model, make = models.transformer(layers=8)
    x, y = make(8)
    step = models.train_step(model)
    best = float("inf")
    for _ in range(3):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        state = discover(step, (x, y), {})
        with mode:
            fx, fy = mode.from_tensor(x), mode.from_tensor(y)
            fakes = {id(t): mode.from_tensor(t) for _, _, t in state.named_state()}
        restore = _swap(state, fakes)
        try:
            t = time.perf_counter()
            with mode:
                step(fx, fy)
            best = min(best, time.perf_counter() - t)
        finally:
            restore()
    graph = stagetorch.make_ir(step)(x, y)
    print(f"\nFakeTensorMode alone, 8 layers: {best * 1e3:.0f} ms = {best / len(graph.eqns) * 1e6:.0f} us per op")

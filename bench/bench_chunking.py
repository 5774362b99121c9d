"""Chunked execution benchmarks (issue 4).

(a) Throughput of the plan stagetorch chooses against the best hand-picked uniform chunk size that fits
    the same budget, over several budgets.
(b) Trial runs needed to reach a working configuration: stagetorch plans from its estimate (zero trials);
    catch-OOM searches (accelerate's halving, Lightning's power scaling) run the step until it stops
    raising. Out-of-memory is simulated: a trial at batch b "fails" when the step's peak at b exceeds the
    budget, the peak being stagetorch's tensor-level estimate (which tests/interpreters/test_memory.py checks against
    peaks measured on real tensors). The searches find a smaller *batch*; stagetorch keeps the batch.

Run: python -m pytest bench/bench_chunking.py --benchmark-enable -s
"""

from __future__ import annotations

import statistics
import time

import models
import pytest
import torch

import stagetorch
from stagetorch.interpreters.chunked import run_chunked
from stagetorch.interpreters.memory import peak_bytes as cost
from stagetorch.planning.budget import SAFETY_MARGIN
from stagetorch.planning.chunks import _chunk_peaks

BATCH = 256
FRACTIONS = (0.35, 0.5, 0.7)


def _setup():
    torch.manual_seed(0)
    model, make = models.transformer(layers=2)
    x, y = make(BATCH)
    step = stagetorch.jit(models.train_step(model))
    return model, step, (x, y)


def _median_time(fn, repeat: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_plan_throughput_against_best_hand_picked(benchmark, fraction):
    model, step, args = _setup()
    full = step.plan(*args).full_batch_peak_bytes
    step.memory_budget = int(full * fraction)
    plan = step.plan(*args)
    entry, inputs, _ = step._stage(args, {})
    split = entry.executable.split()
    usable = step.memory_budget * (1 - SAFETY_MARGIN)
    candidates = [n for n in (8, 16, 24, 32, 48, 64, 96, 128, 192) if n < BATCH and max(_chunk_peaks(split, n, cost)) <= usable]
    timings = {}
    for n in candidates:
        sizes = [n] * (BATCH // n) + ([BATCH % n] if BATCH % n else [])
        timings[n] = _median_time(lambda sizes=sizes: run_chunked(split, inputs, sizes))
        model.zero_grad(set_to_none=True)
    planned = _median_time(lambda: step(*args))
    best_n = min(timings, key=timings.get)
    ratio = timings[best_n] / planned
    print(
        f"\nbudget {fraction:.2f} x full peak: plan {list(plan.chunk_sizes)} {planned * 1e3:.1f} ms; "
        f"best hand-picked n={best_n} {timings[best_n] * 1e3:.1f} ms; throughput ratio {ratio:.3f}; "
        + ", ".join(f"n={n}: {t * 1e3:.1f} ms" for n, t in timings.items())
    )
    benchmark.extra_info.update(plan=list(plan.chunk_sizes), best_hand_picked=best_n, throughput_ratio=ratio)
    benchmark(lambda: step(*args))


def _oom_at(step, args, budget: int):
    """A simulated device: running the full step at batch ``b`` fails when its peak exceeds ``budget``."""

    def fits(b: int) -> bool:
        sliced = tuple(a[:b] for a in args)
        return step.plan(*sliced).full_batch_peak_bytes <= budget * (1 - SAFETY_MARGIN)

    return fits


def _halving(fits, start: int) -> tuple[int, int]:
    """accelerate.find_executable_batch_size / toma: start at the batch, halve on OOM."""
    b, trials = start, 0
    while b >= 1:
        trials += 1
        if fits(b):
            return b, trials
        b //= 2
    return 0, trials


def _power(fits, start: int) -> tuple[int, int]:
    """Lightning scale_batch_size(mode="power"): double from 2 until OOM, keep the last that fit."""
    b, trials, last = 2, 0, 0
    while b <= start:
        trials += 1
        if not fits(b):
            break
        last, b = b, b * 2
    return last, trials


def test_trials_to_a_working_configuration():
    model, step, args = _setup()
    rows = []
    for fraction in FRACTIONS:
        full = step.plan(*args).full_batch_peak_bytes
        budget = int(full * fraction)
        fits = _oom_at(step, args, budget)
        step.memory_budget = budget
        plan = step.plan(*args)
        halving_b, halving_trials = _halving(fits, BATCH)
        power_b, power_trials = _power(fits, BATCH)
        rows.append((fraction, plan.chunk_sizes, halving_b, halving_trials, power_b, power_trials))
        step.memory_budget = None
        assert halving_trials >= 2 and power_trials >= 2
    print("\nbudget | stagetorch plan (0 trials, whole batch) | halving: batch, trials | power: batch, trials")
    for fraction, sizes, hb, ht, pb, pt in rows:
        print(f"{fraction:.2f} | {list(sizes)} | {hb}, {ht} | {pb}, {pt}")

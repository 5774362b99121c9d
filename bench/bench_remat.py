"""Measures: recomputation plans, peaks and step times against torch.utils.checkpoint; planning time. Last run: 2026-11-24.

Recomputation benchmarks (issue 15).

(a) Budget sweep on the seed models (tests/support/remat_models.py): for each budget, what the joint planner chose
    (chunks, recomputed ops, extra FLOPs), its predicted peak and the live-tensor peak measured.
(b) The issue's example, 24 x (Linear(128,128) + GELU) over 1024 tokens, at budgets down to 1/3 of its peak:
    step time of stagetorch's plan against the unconstrained staged step, per-block torch.utils.checkpoint,
    checkpoint_sequential (sqrt(24) ~ 5 segments) and chunking alone, with each one's measured peak.
(c) Planning time on a chain of 5,000 equations: the frontier, and jit's plan at batch 64 (staging and planning
    timed apart) and with one example.
(d) The seed models against per-block torch.utils.checkpoint at its measured peak: recompute FLOPs (what the
    blocks' forwards cost, against the planner's cheapest set that fits the same peak), predicted step cost
    at 1/3 of the no-recompute peak, and measured step times of the unconstrained staged step, per-block
    checkpoint, stagetorch at the checkpoint's peak, and chunking alone there.
(e) 1/3 of the no-recompute peak where activations dominate (the seed models at 4x their test batch, a
    transformer of width 128, and the seed models at training sizes): the plan, its predicted step cost, the
    measured step time and peak, and per-block checkpoint and chunking alone beside them.

Run: python -m pytest bench/bench_remat.py --benchmark-enable -s
CPU step times vary between runs (see /work/shared/REMAT.md): compare FLOPs and peaks first.
"""

from __future__ import annotations

import copy
import math
import statistics
import time

import pytest
import remat_models
import torch
import torch.nn as nn
from memtrack import AllocatorPeak
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import stagetorch
from stagetorch.interpreters.flops import eqn_flops, graph_flops
from stagetorch.interpreters.memory import peak_bytes
from stagetorch.planning.budget import SAFETY_MARGIN
from stagetorch.planning.remat_search import RematPlan, frontier, predicted_cost

MiB = 2**20


def step_of(model: nn.Module, forward=None):
    forward = forward or model

    def step(x):
        loss = forward(x).square().mean()
        loss.backward()
        return loss

    return step


def _describe(plan) -> str:
    kind = f"{len(plan.chunk_sizes)} chunk(s)"
    if isinstance(plan, RematPlan) and plan.recompute is not None:
        kind += f" + recompute {plan.recompute.dropped} ops (+{plan.extra_flops / plan.base_flops:.0%} FLOPs)"
    return kind


def _seed_sweep(name):
    torch.manual_seed(0)
    model, x = remat_models.SEEDS[name]()
    staged = stagetorch.jit(step_of(model))
    full = peak_bytes(staged.graph(x))
    print(f"\n{name}: no-recompute peak {full / MiB:.2f} MiB")
    for fraction in (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.45, 0.4, 0.35, 0.3, 0.25, 0.2):
        budget = math.ceil(full * fraction / (1 - SAFETY_MARGIN)) + 1
        staged.memory_budget = budget
        try:
            plan = staged.plan(x)
        except stagetorch.errors.StagingError as e:
            print(f"  {fraction:4.2f}: below the floor ({str(e).split('schedule fits is ')[-1]}")
            continue
        model.zero_grad(set_to_none=True)
        with AllocatorPeak([*model.parameters(), *model.buffers(), x]) as tracker:
            staged(x)
        predicted = max(plan.peak_bytes)
        print(
            f"  {fraction:4.2f}: {_describe(plan):48s} predicted {predicted / MiB:6.2f} MiB, measured "
            f"{tracker.peak / MiB:6.2f} MiB ({(tracker.peak - predicted) / predicted:+.1%}), "
            f"{'within' if tracker.peak <= budget else 'OVER'} the budget"
        )


@pytest.mark.parametrize("name", sorted(remat_models.SEEDS))
def test_seed_sweep(benchmark, name):
    benchmark.pedantic(_seed_sweep, args=(name,), rounds=1, iterations=1)


def _chain():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.GELU()) for _ in range(24)]), torch.randn(2, 1024, 128)


def _timed(fn, x, model, repeat: int = 7, resident=()) -> tuple[float, int]:
    fn(x)  # stage / warm up
    times = []
    for _ in range(repeat):
        model.zero_grad(set_to_none=True)
        t = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t)
    model.zero_grad(set_to_none=True)
    with AllocatorPeak([*model.parameters(), *resident, x]) as tracker:
        fn(x)
    return statistics.median(times), tracker.peak


def _issue_example_step_time():
    model, x = _chain()
    full = peak_bytes(stagetorch.make_ir(step_of(model))(x))
    rows = [("staged, unconstrained", stagetorch.jit(step_of(model), remat=False))]
    blocks = list(model)
    rows.append(("torch.utils.checkpoint per block (eager)", step_of(model, lambda x: _per_block(blocks, x))))
    rows.append(("checkpoint_sequential, 5 segments (eager)",
                 step_of(model, lambda x: checkpoint_sequential(model, 5, x, use_reentrant=False))))
    for fraction in (0.6, 1 / 3):
        budget = int(full * fraction)
        rows.append((f"stagetorch at {fraction:.2f}x budget", stagetorch.jit(step_of(model), memory_budget=budget)))
        rows.append((f"chunking alone at {fraction:.2f}x", stagetorch.jit(step_of(model), memory_budget=budget, remat=False)))
    print(f"\n24 x (Linear(128,128)+GELU), batch 2 x 1024 tokens; no-recompute peak {full / MiB:.1f} MiB")
    base = None
    for label, fn in rows:
        try:
            plan = fn.plan(x) if isinstance(fn, stagetorch.Staged) else None
            seconds, peak = _timed(fn, x, model)
        except stagetorch.errors.StagingError as e:
            print(f"  {label:44s} fails: {type(e).__name__}")
            continue
        base = base or seconds
        what = _describe(plan) if plan is not None else ""
        print(f"  {label:44s} {seconds * 1e3:7.1f} ms ({seconds / base:4.2f}x)  peak {peak / MiB:6.1f} MiB  {what}")


def test_issue_example_step_time(benchmark):
    benchmark.pedantic(_issue_example_step_time, rounds=1, iterations=1)


def _per_block(blocks, x):
    for b in blocks:
        x = checkpoint(b, x, use_reentrant=False)
    return x


def _planning_time_5000_equations():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(312)])
    x = torch.randn(64, 256, 32)
    graph = stagetorch.make_ir(step_of(model))(x)
    frontier(graph)  # first call: schema and registry caches
    times = []
    for _ in range(3):
        t = time.perf_counter()
        points = frontier(graph)
        times.append(time.perf_counter() - t)
    print(f"\nfrontier of {len(graph.eqns)} equations: {len(points)} points in {min(times):.2f} s (best of 3; "
          f"median {statistics.median(times):.2f} s); least peak {points[-1].peak_bytes / points[0].peak_bytes:.3f}x")
    # Staging (the trace) and planning are timed apart: the target (issue 15) is about planning.
    staged = stagetorch.jit(step_of(copy.deepcopy(model)), memory_budget=int(points[-1].peak_bytes * 0.8))
    t = time.perf_counter()
    staged.graph(x)
    staging = time.perf_counter() - t
    t = time.perf_counter()
    plan = staged.plan(x)
    print(f"jit plan, batch 64: staging {staging:.2f} s, then planning {time.perf_counter() - t:.2f} s: {_describe(plan)} "
          f"[{'+'.join(map(str, plan.chunk_sizes))}]")
    one = torch.randn(1, 256, 32)
    staged = stagetorch.jit(step_of(copy.deepcopy(model)))
    full = peak_bytes(staged.graph(one))
    staged.memory_budget = int(full * 0.3)
    t = time.perf_counter()
    plan = staged.plan(one)
    print(f"jit plan, one example at 0.3x (staged already) {time.perf_counter() - t:.2f} s: {_describe(plan)}")


def test_planning_time_5000_equations(benchmark):
    benchmark.pedantic(_planning_time_5000_equations, rounds=1, iterations=1)


def _block_flops(graph, blocks: list[str]) -> int:
    def inside(module: str) -> bool:
        path = module.split(".", 1)[1] if "." in module else ""
        return any(path == b or path.startswith(b + ".") for b in blocks)

    return sum(eqn_flops(e) for e in graph.eqns if not e.source.backward and inside(e.source.module))


def _seed_against_per_block_checkpoint(name):
    torch.manual_seed(0)
    model, x = remat_models.SEEDS[name]()
    blocks, forward = remat_models.per_block(name, model)
    graph = stagetorch.make_ir(step_of(model))(x)
    base = graph_flops(graph)
    points = frontier(graph)
    full = points[0].peak_bytes
    ckpt = step_of(model, forward)
    ckpt_time, ckpt_peak = _timed(ckpt, x, model, resident=[*model.buffers()])
    theirs = _block_flops(graph, blocks)
    fits = [p for p in points if p.peak_bytes <= ckpt_peak]
    ours = min(p.extra_flops for p in fits) if fits else None
    print(f"\n{name}: no-recompute peak {full / MiB:.2f} MiB; per-block checkpoint peak {ckpt_peak / MiB:.2f} MiB "
          f"({ckpt_peak / full:.2f}x), recomputes {theirs / base:.1%} of the step's FLOPs; the planner's cheapest set "
          f"at that peak: " + (f"{ours / base:.1%} ({ours / theirs:.2f}x per-block's)" if ours is not None else "none"))
    staged = stagetorch.jit(step_of(model))
    staged.graph(x)
    staged.memory_budget = full // 3
    try:
        plan = staged.plan(x)
        print(f"  at 1/3 budget: {_describe(plan)}, predicted step cost "
              f"{predicted_cost(graph, plan) / predicted_cost(graph):.3f}x")
    except stagetorch.errors.StagingError as e:
        print(f"  at 1/3 budget: below the floor ({str(e).split('schedule fits is ')[-1]}")
    budget = math.ceil(ckpt_peak / (1 - SAFETY_MARGIN)) + 1
    rows = [("staged, unconstrained", stagetorch.jit(step_of(model), remat=False)), ("per-block checkpoint (eager)", ckpt),
            ("stagetorch at the checkpoint's peak", stagetorch.jit(step_of(model), memory_budget=budget)),
            ("chunking alone there", stagetorch.jit(step_of(model), memory_budget=budget, remat=False))]
    base_time = None
    for label, fn in rows:
        try:
            plan = fn.plan(x) if isinstance(fn, stagetorch.Staged) else None
            seconds, peak = (ckpt_time, ckpt_peak) if fn is ckpt else _timed(fn, x, model, resident=[*model.buffers()])
        except stagetorch.errors.StagingError as e:
            print(f"  {label:40s} fails: {type(e).__name__}")
            continue
        base_time = base_time or seconds
        print(f"  {label:40s} {seconds * 1e3:7.1f} ms ({seconds / base_time:4.2f}x)  peak {peak / MiB:6.2f} MiB  "
              f"{_describe(plan) if plan is not None else ''}")


@pytest.mark.parametrize("name", sorted(remat_models.SEEDS))
def test_seed_against_per_block_checkpoint(benchmark, name):
    benchmark.pedantic(_seed_against_per_block_checkpoint, args=(name,), rounds=1, iterations=1)


def _times4(factory):
    model, x = factory()
    return model, x.repeat(4, *[1] * (x.dim() - 1))


# (seed name, factory of the model and its batch): the seed models at 4x their test batch, a transformer of
# width 128, and the seed models at training sizes (tests/support/remat_models.py's TRAINING).
_ACTIVATION_DOMINATED = {
    **{f"{name} x4": (name, lambda f=f: _times4(f)) for name, f in remat_models.SEEDS.items()},
    "transformer d128 x4": ("transformer", lambda: _times4(lambda: remat_models.transformer(4, 128))),
    **{f"{name} training": (name, f) for name, f in remat_models.TRAINING.items()},
}


def _one_third_budget(name):
    torch.manual_seed(0)
    seed, factory = _ACTIVATION_DOMINATED[name]
    model, x = factory()
    repeat = 3 if name.endswith("training") else 7
    staged = stagetorch.jit(step_of(model), remat=False)
    graph = staged.graph(x)
    full, base = peak_bytes(graph), graph_flops(graph)
    held = 2 * sum(p.untyped_storage().nbytes() for p in model.parameters())
    print(f"\n{name} (input {tuple(x.shape)}, {base / 1e9:.1f} GFLOP): no-recompute peak {full / MiB:.2f} MiB, "
          f"parameters + gradients {held / full:.0%} of it")
    budget = math.ceil(full / 3)
    constrained = stagetorch.jit(step_of(model), memory_budget=budget)
    try:
        plan = constrained.plan(x)
    except stagetorch.errors.StagingError as e:
        print(f"  at 1/3: below the floor ({str(e).split('schedule fits is ')[-1]}")
        return
    predicted = predicted_cost(graph, plan) / predicted_cost(graph)
    resident = [*model.buffers()]
    base_time, _ = _timed(staged, x, model, repeat, resident)
    seconds, peak = _timed(constrained, x, model, repeat, resident)
    print(f"  at 1/3 ({budget / MiB:.2f} MiB): {_describe(plan)}; predicted step cost {predicted:.3f}x; measured "
          f"{seconds * 1e3:.1f} ms against {base_time * 1e3:.1f} ms unconstrained ({seconds / base_time:.2f}x), "
          f"peak {peak / MiB:.2f} MiB ({'within' if peak <= budget else 'OVER'} the budget)")
    _, forward = remat_models.per_block(seed, model)
    ckpt_time, ckpt_peak = _timed(step_of(model, forward), x, model, repeat, resident)
    print(f"  per-block checkpoint (eager): {ckpt_time * 1e3:.1f} ms ({ckpt_time / base_time:.2f}x), peak "
          f"{ckpt_peak / MiB:.2f} MiB ({ckpt_peak / full:.2f}x the no-recompute peak)")
    forward = remat_models.sequential(seed, model)
    if forward is None:
        print("  checkpoint_sequential: not a sequence of modules")
    else:
        seq_time, seq_peak = _timed(step_of(model, forward), x, model, repeat, resident)
        print(f"  checkpoint_sequential, sqrt(n) segments (eager): {seq_time * 1e3:.1f} ms ({seq_time / base_time:.2f}x), "
              f"peak {seq_peak / MiB:.2f} MiB ({seq_peak / full:.2f}x the no-recompute peak)")
    alone = stagetorch.jit(step_of(model), memory_budget=budget, remat=False)
    try:
        alone_time, alone_peak = _timed(alone, x, model, repeat, resident)
    except stagetorch.errors.StagingError as e:
        print(f"  chunking alone at 1/3: {type(e).__name__}")
    else:
        print(f"  chunking alone at 1/3: {_describe(alone.plan(x))}, {alone_time * 1e3:.1f} ms "
              f"({alone_time / base_time:.2f}x), peak {alone_peak / MiB:.2f} MiB")


@pytest.mark.parametrize("name", sorted(_ACTIVATION_DOMINATED))
def test_one_third_budget(benchmark, name):
    benchmark.pedantic(_one_third_budget, args=(name,), rounds=1, iterations=1)

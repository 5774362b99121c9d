"""Measures: a contrastive step whole, cut where examples meet, and GradCache. Last run: 2026-11-29.

A contrastive step with in-batch negatives (issue 38): the whole-batch step, the step stagetorch cuts where
its examples meet (stagetorch.planning.cut), and a hand-written GradCache loop, on CPU at float32.

(a) Time per example and peak at the allocator (tests/support/memtrack.AllocatorPeak) at one batch: the whole step,
    the cut step under ``MARGIN`` times the smallest budget it runs in, GradCache in the cut step's chunks.
(b) The largest batch whose step fits a budget (the whole step's predicted peak at ``BATCH``): whole-batch
    steps against the cut step (planned only: nothing runs).

(c) ``python bench/bench_contrastive.py ratio [BATCH]``: the cut step with large chunks (0.8x the whole step's
    peak) and with small ones (``MARGIN`` times the smallest budget), and GradCache by hand, against the whole
    step, timed in rounds.
(d) ``valgrind --tool=callgrind --instr-atstart=no python bench/bench_contrastive.py instructions [BATCH]``: the
    same steps' instruction counts, one callgrind dump each (repeatable on a loaded machine; run it with
    ``OMP_NUM_THREADS=1`` so that every step runs the same kernels).

Run: python bench/bench_contrastive.py   (or python -m pytest bench/bench_contrastive.py -s)
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from memtrack import AllocatorPeak

import stagetorch

BATCH, TOKENS, IN, HIDDEN, EMBED = 512, 16, 256, 256, 128
MARGIN = 1.15  # the cut step's budget, over the smallest it runs in


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
                                 nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
                                 nn.Linear(HIDDEN, EMBED))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.net(x).mean(1), dim=-1)  # tokens through the MLP, mean-pooled


class DualEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.image, self.text = Tower(), Tower()
        self.log_scale = nn.Parameter(torch.tensor(2.5))


def loss_of(model: DualEncoder, a: torch.Tensor, b: torch.Tensor, negatives: torch.Tensor) -> torch.Tensor:
    """Symmetric InfoNCE, in-batch negatives plus one hard negative per example."""
    logits = a @ torch.cat([b, negatives]).T * model.log_scale.exp()
    target = torch.arange(a.shape[0])
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits[:, : a.shape[0]].T, target)) / 2


def step_of(model: DualEncoder):
    def step(images, texts, hard):
        loss = loss_of(model, model.image(images), model.text(texts), model.text(hard))
        loss.backward()
        return loss

    return step


def gradcache(model: DualEncoder, chunk: int):
    """GradCache by hand (Gao et al., 2021): embeddings in chunks without a graph, the loss and its gradient
    on the whole batch's embeddings, then each chunk's forward again with its embeddings' gradient."""

    def step(images, texts, hard):
        towers = (model.image, model.text, model.text)
        inputs = (images, texts, hard)
        with torch.no_grad():
            cached = [torch.cat([t(c) for c in x.split(chunk)]) for t, x in zip(towers, inputs)]
        cached = [e.requires_grad_() for e in cached]
        loss = loss_of(model, *cached)
        loss.backward()
        for t, x, e in zip(towers, inputs, cached):
            for c, g in zip(x.split(chunk), e.grad.split(chunk)):
                t(c).backward(g)
        return loss.detach()

    return step


def _batch(n: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(n, TOKENS, IN, generator=g) for _ in range(3))


def _measure(model: DualEncoder, fn, args, repeat: int = 3) -> tuple[float, int]:
    """Median seconds per step and the allocator's peak over a step (parameters, .grad and inputs resident)."""
    fn(*args)
    times = []
    for _ in range(repeat):
        model.zero_grad(set_to_none=False)
        t = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t)
    model.zero_grad(set_to_none=False)
    resident = [*model.parameters(), *(p.grad for p in model.parameters()), *args]
    with AllocatorPeak(resident) as peak:
        fn(*args)
    return statistics.median(times), peak.peak


def _largest(plan_at, sizes) -> int:
    best = 0
    for n in sizes:
        try:
            plan_at(n)
        except stagetorch.OutOfMemoryError:
            break
        best = n
    return best


def run() -> list[str]:
    torch.manual_seed(0)
    model = DualEncoder()
    args = _batch(BATCH)
    whole = stagetorch.jit(step_of(model), remat=False)
    whole(*args)  # the .grad it makes, which later calls hold beside the program
    whole_peak = whole.plan(*args).peak
    cut = stagetorch.jit(step_of(model), remat=False, memory_budget=1 << 20)
    try:
        cut.plan(*args)
    except stagetorch.OutOfMemoryError as e:
        floor = e.smallest_budget
    cut.memory_budget = int(floor * MARGIN)
    plan = cut.plan(*args)
    chunk = max(plan.chunk_sizes)
    lines = [f"batch {BATCH} x {TOKENS} tokens, towers {IN}->{HIDDEN}x4->{EMBED} per token, mean-pooled (2 towers, "
             f"3 passes), float32, CPU, "
             f"{torch.get_num_threads()} threads", f"whole step's predicted peak {whole_peak / 2**20:.1f} MiB",
             f"cut plan: {plan}"]
    # The cost of cutting itself: a budget a little under the whole step's, where the chunks are large.
    large = stagetorch.jit(step_of(model), remat=False, memory_budget=int(whole_peak * 0.8))
    large_chunks = "+".join(map(str, large.plan(*args).chunk_sizes))
    for name, fn in (("whole-batch staged step", whole), (f"cut step (stagetorch), chunks [{'+'.join(map(str, plan.chunk_sizes))}]", cut),
                     (f"GradCache by hand, chunks of {chunk}", gradcache(model, chunk)),
                     (f"cut step (stagetorch) at 0.8x the whole step's peak, chunks [{large_chunks}]", large)):
        seconds, peak = _measure(model, fn, args)
        lines.append(f"{name}: {seconds / BATCH * 1e6:.0f} us/example, allocator peak {peak / 2**20:.1f} MiB")
    budget = int(whole_peak / (1 - 0.10)) + 1  # the whole step at BATCH fits, with the planner's margin

    def plan_at(n: int, staged: stagetorch.Staged) -> None:
        staged.memory_budget = budget
        p = staged.plan(*_batch(n))
        if staged is whole and len(p.chunk_sizes) > 1:
            raise stagetorch.OutOfMemoryError("chunked")

    sizes = [BATCH * 2**k for k in range(6)]
    lines.append(f"largest batch in a {budget / 2**20:.1f} MiB budget: whole-batch step "
                 f"{_largest(lambda n: plan_at(n, whole), sizes)}, cut step {_largest(lambda n: plan_at(n, cut), sizes)} "
                 f"(tried {sizes})")
    return lines


def _steps(model: DualEncoder, args: tuple[torch.Tensor, ...]) -> dict:
    """The steps (c) and (d) compare: the whole-batch step, the cut step at 0.8x its peak (large chunks) and at
    ``MARGIN`` times the smallest budget (small chunks), and GradCache by hand in the small plan's chunks."""
    whole = stagetorch.jit(step_of(model), remat=False)
    whole(*args)
    large = stagetorch.jit(step_of(model), remat=False, memory_budget=int(whole.plan(*args).peak * 0.8))
    small = stagetorch.jit(step_of(model), remat=False, memory_budget=1 << 20)
    try:
        small.plan(*args)
    except stagetorch.OutOfMemoryError as e:
        small.memory_budget = int(e.smallest_budget * MARGIN)
    chunk = max(small.plan(*args).chunk_sizes)
    steps = {"whole": whole, "cut, 0.8x": large, f"cut, {MARGIN}x floor": small, f"GradCache by hand ({chunk})": gradcache(model, chunk)}
    for fn in steps.values():
        fn(*args)
    return steps


def _chunks(fn) -> str:
    plan = fn.plan if isinstance(fn, stagetorch.Staged) else None
    return "" if plan is None else f" [{'+'.join(map(str, plan(*_batch(BATCH)).chunk_sizes))}]"


def ratio(rounds: int = 5) -> list[str]:
    """(c) Each step against the whole step, timed in rounds (each round runs every step once, so that drift on a
    loaded machine hits all alike): the median of the per-round ratios."""
    torch.manual_seed(0)
    model = DualEncoder()
    args = _batch(BATCH)
    steps = _steps(model, args)
    # Wall clock, and the process's CPU time: at one thread (OMP_NUM_THREADS=1) the latter leaves out the time
    # the process waits for a core on a loaded machine.
    seconds: dict[tuple[str, str], list[float]] = {(clock, name): [] for clock in ("wall", "cpu") for name in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            t, c = time.perf_counter(), time.process_time()
            fn(*args)
            seconds["wall", name].append(time.perf_counter() - t)
            seconds["cpu", name].append(time.process_time() - c)
    lines = [f"{rounds} rounds, {torch.get_num_threads()} thread(s); whole step median {statistics.median(seconds['wall', 'whole']):.3f} s "
             f"wall, {statistics.median(seconds['cpu', 'whole']):.3f} s CPU"]
    for clock in ("wall", "cpu"):
        for name, fn in steps.items():
            ratios = [t / w for t, w in zip(seconds[clock, name], seconds[clock, "whole"])]
            lines.append(f"{clock}: {name}{_chunks(fn)} / whole: median {statistics.median(ratios):.2f}x "
                         f"(all: {', '.join(f'{r:.2f}' for r in ratios)})")
    return lines


_CALLGRIND = """#include <valgrind/callgrind.h>
void start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; }
void stop(const char *name) { CALLGRIND_DUMP_STATS_AT(name); CALLGRIND_STOP_INSTRUMENTATION; }
"""


def instructions() -> list[str]:
    """(d) Under ``valgrind --tool=callgrind --instr-atstart=no``: one step of each, instrumented alone (a dump
    per step, named after it; instruction counts do not depend on the machine's load)."""
    import ctypes
    import subprocess
    import tempfile

    folder = tempfile.mkdtemp()
    with open(f"{folder}/callgrind.c", "w") as f:
        f.write(_CALLGRIND)
    subprocess.run(["cc", "-shared", "-fPIC", f"{folder}/callgrind.c", "-o", f"{folder}/callgrind.so"], check=True)
    callgrind = ctypes.CDLL(f"{folder}/callgrind.so")
    torch.manual_seed(0)
    model = DualEncoder()
    args = _batch(BATCH)
    lines = []
    for name, fn in _steps(model, args).items():
        callgrind.start()
        fn(*args)
        callgrind.stop(name.encode())
        lines.append(f"{name}{_chunks(fn)}")
    return lines


def _contrastive_bench():
    print("\n".join(run()))


def test_contrastive_bench(benchmark):
    benchmark.pedantic(_contrastive_bench, rounds=1, iterations=1)


if __name__ == "__main__":
    import sys

    if sys.argv[2:]:
        BATCH = int(sys.argv[2])
    mode = sys.argv[1] if sys.argv[1:] else "run"
    print("\n".join({"run": run, "ratio": ratio, "instructions": instructions}[mode]()))

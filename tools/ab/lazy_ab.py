"""A/B: one-line mode's step against eager for two trees of stagetorch in one process. Last run: 2026-11-26.

One-line mode's step against eager, for two trees of stagetorch in one process: ``stagetorch`` (this tree)
and a copy of another tree imported as ``stagetorch_base`` (``git archive <commit> stagetorch | tar -x``, then
rename the folder; it must be on ``sys.path``). Eager, base and new steps run in turn on the seed MLP (the step
of bench/bench_lazy.py), so the three medians see the same machine; each ratio is to eager's median.

Run: ``PYTHONPATH=/path/to/base python tools/ab/lazy_ab.py --batches 8 256 --runs 3`` (``--cpu``: thread CPU
time, with ``--threads 1``; ``--parts [--no-kernels]``: thread CPU time per part of the step, each tree's
blocks of steps run in turn).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import os
import statistics
import time

import _paths  # noqa: F401  (tools/_paths.py: the tree and tests/support on sys.path)
import models
import torch
import torch.nn as nn


def step_of(lazy, model, x, y):
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        inputs, labels = lazy(x, y, batch=0) if lazy is not None else (x, y)
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), labels)
        loss.backward()
        optimizer.step()

    return step


def run(batch: int, alternations: int, clock, trees: dict) -> dict[str, float]:
    torch.manual_seed(0)
    model, make = models.seed_mlp()
    x, y = make(batch)
    steps = {"eager": step_of(None, model, x, y)}
    for name, package in trees.items():
        steps[name] = step_of(package.lazy, copy.deepcopy(model), x, y)
    for _ in range(20):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    # Each tree's step right after an eager one, as bench/bench_lazy.py runs them: a lazy step that follows
    # another lazy step finds the caches warm for it and ran ~6% faster at batch 8 (eager, base, new made
    # the same tree look that much faster as new than as base).
    lazies = [name for name in steps if name != "eager"] or ["eager"]
    for _ in range(alternations):
        for lazy_name in lazies:
            for name in ("eager", lazy_name):
                t = clock()
                steps[name]()
                times[name].append(clock() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


class _Parts:
    """One tree's one-line step (or eager's, ``package`` None) with a timer around each part: thread CPU
    time per part, summed over the steps of a block (the timers' own cost taken off)."""

    def __init__(self, package, batch: int, no_kernels: bool):
        torch.manual_seed(0)
        model, make = models.seed_mlp()
        self.x, self.y = make(batch)
        self.model, self.package = model, package
        self.loss_fn = nn.CrossEntropyLoss()
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        self.cpu: dict[str, int] = {}
        if package is not None:
            executable = importlib.import_module(package.__name__ + ".executable").Executable
            session = importlib.import_module(package.__name__ + ".lazymode.session")._Session
            run, kept = executable.run, {}

            def no_kernel_run(self_, *args, **kwargs):  # a real run's outputs, once per executable
                if id(self_) not in kept:
                    kept[id(self_)] = run(self_, *args, **kwargs)
                return kept[id(self_)]

            executable.run = self._timed("  of which the staged program", no_kernel_run if no_kernels else run)
            session.flush = self._timed(" of which the flush (the program included)", session.flush)

    def _timed(self, name, fn):
        cpu, clock = self.cpu, time.thread_time_ns

        def wrapper(*args, **kwargs):
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                cpu[name] = cpu.get(name, 0) + clock() - t

        return wrapper

    def part(self, name, fn, *args):
        t = time.thread_time_ns()
        out = fn(*args)
        self.cpu[name] = self.cpu.get(name, 0) + time.thread_time_ns() - t
        return out

    def step(self) -> None:
        x, y, part = self.x, self.y, self.part
        if self.package is not None:
            x, y = part("lazy(x, y)", self.package.lazy, x, y)
        part("zero_grad", self.optimizer.zero_grad)
        loss = part("forward", lambda: self.loss_fn(self.model(x), y))
        part("backward", loss.backward)
        part("optimizer.step", self.optimizer.step)

    def block(self, steps: int) -> dict[str, float]:
        self.cpu.clear()
        t = time.thread_time_ns()
        for _ in range(steps):
            self.step()
        whole = time.thread_time_ns() - t
        for _ in range(steps):
            self.part("(timer)", lambda: None)
        timer = self.cpu.pop("(timer)") / steps
        out = {"whole step": whole / steps / 1e3}
        for name, ns in self.cpu.items():
            out[name] = (ns / steps - timer) / 1e3
        return out


def parts(batch: int, trees: dict, steps: int, blocks: int, no_kernels: bool) -> dict[str, dict[str, float]]:
    """Per part, the median over ``blocks`` blocks of each tree's (and eager's) mean per step, the blocks of
    the trees run in turn."""
    runners = {"eager": _Parts(None, batch, no_kernels)}
    runners.update({name: _Parts(package, batch, no_kernels) for name, package in trees.items()})
    for runner in runners.values():
        runner.block(20)
    seen: dict[str, dict[str, list[float]]] = {name: {} for name in runners}
    for _ in range(blocks):
        for name, runner in runners.items():
            for part, us in runner.block(steps).items():
                seen[name].setdefault(part, []).append(us)
    return {name: {part: statistics.median(v) for part, v in d.items()} for name, d in seen.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", nargs="*", type=int, default=[8, 256])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--alternations", type=int, default=400)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--parts", action="store_true", help="thread CPU time per part of the step, not ratios")
    p.add_argument("--no-kernels", action="store_true", help="with --parts: the flush's program replaced by its outputs")
    p.add_argument("--steps", type=int, default=50, help="with --parts: steps per block")
    p.add_argument("--blocks", type=int, default=15, help="with --parts: blocks per tree")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    trees = {}
    for name, module in (("base", "stagetorch_base"), ("new", "stagetorch")):
        try:
            trees[name] = importlib.import_module(module)
        except ImportError:
            print(f"({module} not importable: left out)")
    clock = time.thread_time if a.cpu else time.perf_counter
    print(f"torch {torch.__version__}, {a.threads} threads, {'thread CPU' if a.cpu or a.parts else 'wall'} clock, load {os.getloadavg()[0]:.1f}")
    if a.parts:
        for batch in a.batches:
            table = parts(batch, trees, a.steps, a.blocks, a.no_kernels)
            names = list(table)
            print(f"\nbatch {batch}{', no kernels' if a.no_kernels else ''} (load {os.getloadavg()[0]:.1f}): us per step, "
                  "thread CPU, median of blocks")
            print("| part | " + " | ".join(names) + " |")
            print("|---|" + "---|" * len(names))
            rows = list(dict.fromkeys(r for d in table.values() for r in d))
            for row in rows:
                print(f"| {row} | " + " | ".join(f"{table[n][row]:.1f}" if row in table[n] else "-" for n in names) + " |")
        return
    for batch in a.batches:
        for _ in range(a.runs):
            m = run(batch, a.alternations, clock, trees)
            ratios = ", ".join(f"{n} / eager {m[n] / m['eager']:.3f}" for n in trees)
            print(f"batch {batch}: eager {m['eager'] * 1e6:.0f} us, " + ", ".join(f"{n} {m[n] * 1e6:.0f} us" for n in trees)
                  + f": {ratios} (load {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()

"""One-line mode's step against eager, for two trees of stagetorch in one process: ``stagetorch`` (this tree)
and a copy of another tree imported as ``stagetorch_base`` (``git archive <commit> stagetorch | tar -x``, then
rename the folder; it must be on ``sys.path``). Eager, base and new steps run in turn on the seed MLP (the step
of bench/bench_lazy.py), so the three medians see the same machine; each ratio is to eager's median.

Run: ``PYTHONPATH=.:/path/to/base python bench/lazy_ab.py --batches 8 256 --runs 3`` (``--cpu``: thread CPU
time, with ``--threads 1``).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import models  # noqa: E402


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
    for _ in range(alternations):
        for name, step in steps.items():
            t = clock()
            step()
            times[name].append(clock() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", nargs="*", type=int, default=[8, 256])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--alternations", type=int, default=400)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cpu", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    trees = {}
    for name, module in (("base", "stagetorch_base"), ("new", "stagetorch")):
        try:
            trees[name] = importlib.import_module(module)
        except ImportError:
            print(f"({module} not importable: left out)")
    clock = time.thread_time if a.cpu else time.perf_counter
    print(f"torch {torch.__version__}, {a.threads} threads, {'thread CPU' if a.cpu else 'wall'} clock, load {os.getloadavg()[0]:.1f}")
    for batch in a.batches:
        for _ in range(a.runs):
            m = run(batch, a.alternations, clock, trees)
            ratios = ", ".join(f"{n} / eager {m[n] / m['eager']:.3f}" for n in trees)
            print(f"batch {batch}: eager {m['eager'] * 1e6:.0f} us, " + ", ".join(f"{n} {m[n] * 1e6:.0f} us" for n in trees)
                  + f": {ratios} (load {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()

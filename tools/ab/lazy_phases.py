"""A/B: where one-line mode's per-step overhead goes, timers around each part of a step. Last run: 2026-11-22.

Where one-line mode's per-step overhead goes: medians of timers around each part of a lazy step and an
eager step, run alternately (issue 5).

Run: python tools/ab/lazy_phases.py [batch]
"""

from __future__ import annotations

import statistics
import sys
import time

import _paths  # noqa: F401  (tools/_paths.py: the tree and tests/support on sys.path)
import models
import torch
import torch.nn as nn

import stagetorch
from stagetorch.lazymode import backward
from stagetorch.lazymode.session import _Session
from stagetorch.runtime import executable

times: dict[str, list[float]] = {}


def timed(name, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        result = fn(*args, **kwargs)
        times.setdefault(name, []).append(time.perf_counter() - t)
        return result

    return wrapper


def main(batch: int) -> None:
    torch.set_num_threads(2)
    model, make = models.seed_mlp()
    x, y = make(batch)
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    executable.Executable.run = timed("lazy: the staged program (Executable.run)", executable.Executable.run)
    _Session.flush = timed("lazy: flush (incl. the program)", _Session.flush)
    _Session.backward = timed("lazy: backward (incl. flush)", _Session.backward)
    # The slow path's walk (the express replay walks only real arguments' graphs, in its guards).
    backward.autograd_graph = timed("lazy: walking the autograd graph", backward.autograd_graph)
    make_lazy = timed("lazy: stagetorch.lazy(x, y)", stagetorch.lazy)

    def lazy_step():
        inputs, labels = make_lazy(x, y, batch=0)
        optimizer.zero_grad()
        t = time.perf_counter()
        loss = loss_fn(model(inputs), labels)
        times.setdefault("lazy: forward", []).append(time.perf_counter() - t)
        loss.backward()
        optimizer.step()

    def eager_step():
        optimizer.zero_grad()
        t = time.perf_counter()
        loss = loss_fn(model(x), y)
        times.setdefault("eager: forward", []).append(time.perf_counter() - t)
        t = time.perf_counter()
        loss.backward()
        times.setdefault("eager: backward", []).append(time.perf_counter() - t)
        optimizer.step()

    for _ in range(20):
        lazy_step()
        eager_step()
    times.clear()
    for _ in range(400):
        for name, step in (("lazy: whole step", lazy_step), ("eager: whole step", eager_step)):
            t = time.perf_counter()
            step()
            times.setdefault(name, []).append(time.perf_counter() - t)
    print(f"seed MLP, batch {batch}, torch {torch.__version__}, medians of 400 steps:")
    for name in sorted(times):
        print(f"  {name:45s} {statistics.median(times[name]) * 1e6:8.1f} us")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)

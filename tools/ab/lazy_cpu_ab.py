"""A/B: CPU time per seed-MLP step, eager against one-line mode, in alternating blocks. Last run: 2026-11-23.

CPU time per seed-MLP train step (process_time), eager and lazy alternating in blocks: less sensitive to
other processes than wall time on a shared machine.

Run from the repository root: python tools/ab/lazy_cpu_ab.py 8
"""
import statistics
import sys
import time

import _paths  # noqa: F401  (tools/_paths.py: the tree and tests/support on sys.path)
import models
import torch
import torch.nn as nn

import stagetorch


def main(batch: int) -> None:
    torch.set_num_threads(1)
    model, make = models.seed_mlp()
    x, y = make(batch)
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(lazy: bool) -> None:
        xx, yy = stagetorch.lazy(x, y, batch=0) if lazy else (x, y)
        optimizer.zero_grad()
        loss_fn(model(xx), yy).backward()
        optimizer.step()

    for lazy in (False, True, False, True):  # warm up: the first lazy step records, the second tapes
        for _ in range(50):
            step(lazy)
    per_step: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(20):
        for lazy in (False, True):
            t = time.process_time()
            for _ in range(50):
                step(lazy)
            per_step[lazy].append((time.process_time() - t) / 50 * 1e6)
    e, z = statistics.median(per_step[False]), statistics.median(per_step[True])
    print(f"batch {batch}: eager {e:.0f} us cpu, lazy {z:.0f} us cpu, ratio {z / e:.3f}")


if __name__ == "__main__":
    main(int(sys.argv[1]))

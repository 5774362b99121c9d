"""Planned / measured peak at the allocator of a 3 x (Linear(256) + GELU) step ending in each loss the test
models use, at 512 examples, whole and at 0.6 of the whole step's plan (chunks), on 1 and 3 threads:

    python bench/loss_plan_check.py

The measured peak is tests/memtrack.AllocatorPeak's, with the parameters and the batch resident.
"""

from __future__ import annotations

import pathlib
import sys

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "tests"))
from memtrack import AllocatorPeak  # noqa: E402
from test_memory import _LOSS_STEPS as LOSSES  # noqa: E402  (the table the tests check)

import stagetorch  # noqa: E402


def run(name: str, fraction: float | None) -> tuple[int, int, int]:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(256, 256), nn.GELU())])

    def step(x, y):
        loss = LOSSES[name](model(x), y)
        loss.backward()
        return loss

    x, y = torch.randn(512, 256), torch.randn(512, 256)
    budget = 1 << 40
    if fraction is not None:
        budget = int(fraction * stagetorch.jit(step, memory_budget=budget).plan(x, y).peak)
    staged = stagetorch.jit(step, memory_budget=budget, remat=False)
    plan = staged.plan(x, y)
    staged(x, y)
    model.zero_grad(set_to_none=True)
    with AllocatorPeak([*model.parameters(), x, y]) as measured:
        staged(x, y)
    return plan.peak, measured.peak, len(plan.chunk_sizes)


def main() -> None:
    print("threads | loss | budget | chunks | plan (B) | allocator (B) | plan - allocator")
    for threads in (1, 3):
        torch.set_num_threads(threads)
        for name in LOSSES:
            for fraction in (None, 0.6):
                planned, measured, chunks = run(name, fraction)
                print(f"{threads} | {name} | {fraction or 'whole'} | {chunks} | {planned:,} | {measured:,} | "
                      f"{planned - measured:+,} ({(planned - measured) / measured:+.2%})")


if __name__ == "__main__":
    main()

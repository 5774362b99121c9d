"""Probe: planned / measured peak at the allocator for a small step ending in each test loss. Last run: 2026-11-26.

Planned / measured peak at the allocator of a 3 x (Linear(256) + GELU) step ending in each loss the test
models use, at 512 examples, whole and at 0.6 of the whole step's plan (chunks), on 1 and 3 threads:

    python tools/probes/loss_plan_check.py

The measured peak is tests/support/memtrack.AllocatorPeak's, with the parameters and the batch resident.
"""

from __future__ import annotations

import _paths  # noqa: F401  (tools/_paths.py: the tree and tests/support on sys.path)
import torch
from test_memory import _LOSS_STEPS as LOSSES  # (what the tests check)
from test_memory import loss_step_at_the_allocator


def run(name: str, fraction: float | None) -> tuple[int, int, int]:
    plan, measured = loss_step_at_the_allocator(name, fraction)
    return plan.peak, measured, len(plan.chunk_sizes)


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

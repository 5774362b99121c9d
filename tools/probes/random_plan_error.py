"""Probe: measured / planned peak at the allocator over random networks, as a distribution. Last run: 2026-11-26.

Measured / planned peak at the allocator for the random networks of tests/support/random_nets.py, stepped as
tests/end_to_end/test_random_steps.py steps them (two SGD steps at a fraction of the whole step's peak, or at the
smallest budget the planner's error names), reporting the distribution instead of asserting:

    python tools/probes/random_plan_error.py image 0 80        # 80 networks, 160 steps
    python tools/probes/random_plan_error.py sequence 0 80 --worst 10

"within 0.1%" and "within 2%" count steps; "over budget" counts steps whose measured peak exceeded the budget.
"""

from __future__ import annotations

import argparse
import statistics

import _paths  # noqa: F401  (tools/_paths.py: the tree and tests/support on sys.path)
import random_nets
import torch
from memtrack import AllocatorPeak

import stagetorch
from stagetorch.errors import BatchCouplingError, OutOfMemoryError
from stagetorch.interpreters.memory import peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=sorted(random_nets.KINDS))
    parser.add_argument("start", type=int)
    parser.add_argument("stop", type=int)
    parser.add_argument("--worst", type=int, default=6, help="list this many steps farthest from their plan")
    args = parser.parse_args()
    rows = []
    for seed in range(args.start, args.stop):
        case = random_nets.KINDS[args.kind](seed)
        model = case.model
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        staged = stagetorch.jit(case.step(model))
        for k in range(2):
            x, y = (case.x, case.y) if k == 0 else case.batch(k)
            model.scale = 1.0 + 0.7 * k
            held = sum(b.untyped_storage().nbytes() for b in model.buffers())
            opt.zero_grad(set_to_none=True)
            staged.memory_budget = int(peak_bytes(staged.graph(x, y)) * case.fraction) + held
            try:
                plan = staged.plan(x, y)
            except (OutOfMemoryError, BatchCouplingError) as e:
                staged.memory_budget = e.smallest_budget
                plan = staged.plan(x, y)
            with AllocatorPeak([*model.parameters(), *model.buffers(), x, y]) as tracker:
                staged(x, y)
            kind = ("chunks " if plan.chunked else "") + ("recompute" if getattr(plan, "recompute", None) is not None else "")
            rows.append((tracker.peak / plan.peak, seed, k, kind.strip() or "whole", tracker.peak, plan.peak,
                         tracker.peak > staged.memory_budget))
            opt.step()
    ratios = sorted(r[0] for r in rows)
    print(f"{args.kind} {args.start}-{args.stop}: {len(rows)} steps, measured / plan: min {ratios[0]:.4f}, "
          f"p5 {ratios[len(ratios) // 20]:.4f}, median {statistics.median(ratios):.4f}, "
          f"p95 {ratios[min(len(ratios) - 1, len(ratios) * 19 // 20)]:.4f}, max {ratios[-1]:.4f}; "
          f"within 0.1%: {sum(abs(r - 1) <= 0.001 for r in ratios)}, within 2%: {sum(abs(r - 1) <= 0.02 for r in ratios)}, "
          f"over budget: {sum(r[-1] for r in rows)}")
    for r in sorted(rows, key=lambda r: -abs(r[0] - 1))[: args.worst]:
        print(f"  seed {r[1]} step {r[2]} ({r[3]}): {r[0]:.4f} (measured {r[4]:,}, plan {r[5]:,}){' OVER BUDGET' if r[6] else ''}")


if __name__ == "__main__":
    main()

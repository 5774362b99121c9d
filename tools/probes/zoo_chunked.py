"""Probe: the transformers zoo chunked exactly, gradients and allocator peak against the plan. Last run: 2026-11-26.

The transformers zoo (tests/end_to_end/test_transformers_zoo.py) chunked exactly: per model, a padded batch of 7 x 16
tokens in >= 3 uneven chunks against the same step in eager PyTorch, and the run's peak at the allocator
against the plan and the budget.

    python tools/probes/zoo_chunked.py [name ...]
"""

from __future__ import annotations

import sys

import _paths  # noqa: F401  (tools/_paths.py: the tree and tests/support on sys.path)
import test_transformers_zoo as zoo
import torch
from memtrack import AllocatorPeak

import stagetorch


def row(name: str) -> str:
    model = zoo.make_model(name)
    batch = zoo.make_batch(name)
    staged = stagetorch.jit(zoo.step_of(model), remat=False)
    budget = zoo._force_chunks(staged, batch)
    plan = staged.plan(**batch)
    with AllocatorPeak([*model.parameters(), *model.buffers(), *batch.values()]) as measured:
        loss = staged(**batch)
    reference, expected = zoo._eager(name, True)
    grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    whole = torch.cat([g.flatten() for g in grads.values()]).norm()
    error = max(
        ((p.grad - grads[n]).norm() / max(grads[n].norm(), 1e-6 * whole)).item()
        for n, p in model.named_parameters() if n in grads
    )
    sizes = "+".join(map(str, plan.chunk_sizes))
    return (
        f"| {name} | {sizes} | {plan.peak:,} | {measured.peak:,} | {measured.peak / plan.peak - 1:+.2%} | "
        f"{budget:,} | {abs(loss.item() - expected.item()):.1e} | {error:.1e} |"
    )


def main(names: list[str]) -> None:
    print("| model | chunks | plan (B) | allocator (B) | error | budget (B) | loss vs eager | max grad rel. error |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names or list(zoo.ZOO):
        print(row(name), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

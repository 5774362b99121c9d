"""Probe: the planner's floor against transformers' own per-layer checkpointing, on the zoo's tiny configs. Last
run: 2026-12-07.

Per zoo model (tests/end_to_end/test_transformers_zoo.py: 2 layers, hidden 32, float64), on its padded batch of 7 x
16 tokens and on one example of 96 tokens (the last 26 padding; it cannot be chunked), at the allocator: the eager
step's peak and ``gradient_checkpointing_enable(use_reentrant=False)``'s; predicted, as ratios of checkpointing's
peak: the least peak of the per-block checkpoint sets (:func:`~stagetorch.planning.remat_frontier.block_checkpoints`,
no margin), the smallest budget at which ``remat="auto"`` recomputes with the whole batch at once and the smallest
it accepts at all (chunks allowed; both with the planner's 10% margin: a floor of 1.0 means a least peak of 0.9x);
then the step at a budget of exactly checkpointing's peak: its measured peak, the plan's, its chunks and the largest
relative gradient error against eager PyTorch. ConvNeXt has no ``gradient_checkpointing_enable()``.

    python tools/probes/remat_vs_checkpointing.py [7x16|1x96] [name ...]
"""

from __future__ import annotations

import sys
import time
import warnings

import _paths  # noqa: F401  (tools/_paths.py: the tree and tests/support on sys.path)
from memtrack import AllocatorPeak
from transformer_zoo import ZOO, make_batch, make_model, step_of

import stagetorch
from stagetorch.errors import OutOfMemoryError
from stagetorch.planning import budget as margin
from stagetorch.planning.remat_frontier import block_checkpoints, frontier
from stagetorch.planning.remat_search import _least_peak
from stagetorch.planning.remat_simulator import Simulator, point
from stagetorch.transforms.remat import candidates

KiB = 1024


def _resident(model, batch):
    return [*model.parameters(), *model.buffers(), *batch.values()]


def measured(step, model, batch) -> int:
    model.zero_grad(set_to_none=True)
    with AllocatorPeak(_resident(model, batch)) as tracker:
        step(**batch)
    return tracker.peak


def checkpointing_peak(model, batch) -> int:
    """The peak of the eager step under ``gradient_checkpointing_enable()`` (non-reentrant), at the allocator."""
    step = step_of(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        try:
            step(**make_batch_like(batch))  # warm: lazily made buffers
            return measured(step, model, batch)
        finally:
            model.gradient_checkpointing_disable()


def make_batch_like(batch):
    return {k: v.clone() for k, v in batch.items()}


def floor(staged, batch) -> int:
    """The smallest budget ``staged`` accepts for ``batch``, as its error names it."""
    staged.memory_budget = KiB
    try:
        staged.plan(**batch)
    except OutOfMemoryError as e:
        return e.smallest_budget
    raise AssertionError("a 1 KiB budget was accepted")


def whole_floor(staged, batch) -> int:
    """The smallest budget at which the planner recomputes with the whole batch at once (no chunks): its
    least-peak recompute set, the search below the frontier included."""
    graph = staged.graph(**batch)
    points = frontier(graph)
    deeper = _least_peak(points, len(graph.eqns))
    return margin.smallest_budget(min(p.peak_bytes for p in [*points, *([deeper] if deeper else [])]))


def per_block_peak(staged, batch) -> int:
    """The least predicted peak of the per-block checkpoint sets (:func:`block_checkpoints`), the whole batch at once."""
    graph = staged.graph(**batch)
    cands = candidates(graph)
    sim = Simulator(graph, cands)
    return min(point(sim, k).peak_bytes for k in block_checkpoints(graph, cands))


def long_batch(name: str) -> dict:
    """One example of 96 tokens, its last 26 padding (the zoo's recomputation test)."""
    batch = make_batch(name, b=1, s=96, padded=False)
    if "attention_mask" in batch:
        batch["attention_mask"][0, 70:] = 0
        if batch["labels"].dim() == 2:
            batch["labels"][0, 70:] = -100
    return batch


def row(name: str, shape: str = "7x16") -> str:
    model = make_model(name)
    batch = make_batch(name) if shape == "7x16" else long_batch(name)
    step = step_of(model)
    step(**make_batch_like(batch))
    eager = measured(step, model, batch)
    ckpt = checkpointing_peak(model, batch)
    model.zero_grad(set_to_none=True)
    staged = stagetorch.jit(step)
    t0 = time.perf_counter()
    least = floor(staged, batch)
    planning = time.perf_counter() - t0
    whole = whole_floor(staged, batch)
    blocks = per_block_peak(staged, batch)
    staged.memory_budget = ckpt
    model.zero_grad(set_to_none=True)
    try:
        plan = staged.plan(**batch)
    except OutOfMemoryError:
        return (f"| {name} {shape} | {eager / KiB:.1f} | {ckpt / KiB:.1f} | {blocks / ckpt:.3f} | {whole / ckpt:.3f} | {least / ckpt:.3f} | refused | | | "
                f"{planning:.1f} |")
    at = measured(staged, model, batch)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    reference = make_model(name)
    model.zero_grad(set_to_none=True)
    step_of(reference)(**batch)
    error = max(((grads[n] - p.grad).norm() / max(p.grad.norm(), 1e-30)).item()
                for n, p in reference.named_parameters() if p.grad is not None)
    what = f"{'+'.join(map(str, plan.chunk_sizes))}" + (" remat" if getattr(plan, "recompute", None) else "")
    return (f"| {name} {shape} | {eager / KiB:.1f} | {ckpt / KiB:.1f} | {blocks / ckpt:.3f} | {whole / ckpt:.3f} | {least / ckpt:.3f} | {at / ckpt:.3f} "
            f"(plan {plan.peak / ckpt:.3f}) | {what} | {error:.0e} | {planning:.1f} |")


if __name__ == "__main__":
    shapes = [a for a in sys.argv[1:] if a in ("7x16", "1x96")] or ["7x16", "1x96"]
    names = [a for a in sys.argv[1:] if a not in shapes] or [n for n in ZOO if n != "convnext"]
    print("| model | eager peak KiB | checkpointing peak KiB | per-block set's peak / ckpt | whole floor / ckpt | floor / ckpt | measured at 1.0x / ckpt | plan | grad err | "
          "floor planning s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for shape in shapes:
        for name in names:
            print(row(name, shape), flush=True)

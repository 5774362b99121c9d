"""Will it fit? What a step staged for a CUDA device (:class:`~stagetorch.runtime.staged.Staged` with a
``device``) holds on that card: the predicted max allocated and max reserved bytes at its batch, and the
largest batch that fits the card whole, in chunks, and recomputing (:class:`DeviceFit`), as
``stagetorch.memory(step, device=...)`` and ``python -m stagetorch fit`` report them.

Max reserved is the caching allocator's model replayed on the whole batch's program (its inputs, the cuBLAS
workspace, then the step). The largest batches come from lines through two batches (the step's own and half
of it): the whole batch's allocated peak, the peak in chunks of one example, and the lowest peak
recomputation reaches unchunked, each scaled by the reserved / allocated ratio measured at the step's batch,
and kept within the plans' safety margin. They are estimates between and beyond the batches staged; the plan
under the budget is the planner's own.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import attrs

from ..devices.budget import format_bytes
from ..devices.catalog import Device
from ..errors import StagingError
from ..planning import budget as margin
from ..planning.chunks import Plan, chunked_peak
from ..planning.reserved import reserved_of
from ..interpreters.memory import peak_bytes
from .staged import Staged, map_batched

__all__ = ["DeviceFit", "device_fit"]

log = logging.getLogger("stagetorch")


@attrs.frozen
class DeviceFit:
    """What a step needs on one CUDA device (see the module's doc).

    ``max_allocated_bytes`` / ``max_reserved_bytes``: the whole batch's predicted
    ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` (the cuBLAS workspace included in both).
    ``largest_whole`` / ``largest_chunked`` / ``largest_recomputing``: the largest batch that fits the budget
    run whole, in chunks (of one example at the limit), and recomputing without chunks; None where even one
    example does not fit (or where it could not be estimated: ``note`` says why). ``plan``: the planner's
    plan at the step's batch under ``budget_bytes``, or the error that says none fits."""

    device: Device
    batch: int
    budget_bytes: int
    max_allocated_bytes: int
    max_reserved_bytes: int
    workspace_bytes: int
    largest_whole: int | None
    largest_chunked: int | None
    largest_recomputing: int | None
    plan: Plan | StagingError
    note: str = ""

    def __str__(self) -> str:
        def batch(n: int | None) -> str:
            return "does not fit" if n is None else "any size" if n >= UNBOUNDED else f"up to {n}"

        fits = self.max_reserved_bytes <= self.budget_bytes
        lines = [
            f"Device: {self.device.describe()}",
            f"Budget: {format_bytes(self.budget_bytes)}",
            f"At batch {self.batch}, whole: max allocated {format_bytes(self.max_allocated_bytes)}, max reserved "
            f"{format_bytes(self.max_reserved_bytes)} (cuBLAS workspace {format_bytes(self.workspace_bytes)} "
            f"included): {'fits' if fits else 'does NOT fit'}.",
            "Largest batch that fits:",
            f"  whole             {batch(self.largest_whole)}",
            f"  recomputing       {batch(self.largest_recomputing)}",
            f"  in chunks         {batch(self.largest_chunked)}",
        ]
        if isinstance(self.plan, StagingError):
            lines.append(f"Plan at batch {self.batch}: none fits: {str(self.plan).splitlines()[0]}")
        else:
            lines.append(f"Plan at batch {self.batch}: {self.plan}")
            if self.plan.reserved_bytes is not None and self.plan.reserved_bytes > self.budget_bytes:
                lines.append(f"WARNING: even this plan is predicted to reserve {format_bytes(self.plan.reserved_bytes)}"
                             f", more than the budget: it will not fit {self.device.name}.")
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)


def _largest(at: Callable[[int], float], budget: float) -> int | None:
    """The largest batch ``b >= 1`` with ``at(b) <= budget``, for ``at`` non-decreasing in ``b``: doubling, then
    halving the interval; None where ``at(1)`` is over, :data:`UNBOUNDED` past 2**31 examples."""
    if at(1) > budget:
        return None
    lo, hi = 1, 2
    while at(hi) <= budget:
        lo, hi = hi, 2 * hi
        if hi > UNBOUNDED:
            return UNBOUNDED
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if at(mid) <= budget else (lo, mid)
    return lo


# A batch this large fits: the bytes per example do not grow (in chunks, with a step whose per-example
# results are reduced as they go).
UNBOUNDED = 2**31


def device_fit(staged: Staged, report: Any, args: tuple, kwargs: dict) -> DeviceFit:
    """What ``staged`` (with a ``device``) holds on its device for these arguments, ``report`` its memory
    report (its line through the batches staged gives the whole batch's peak at any batch)."""
    device = staged.device
    entry, inputs, _ = staged._stage(args, kwargs)
    executable = entry.executable
    planner = executable.planner
    graph = executable.graph
    batch = executable.batch
    budget = staged._budget(executable, inputs)
    whole = Plan(batch, (batch,), (peak_bytes(graph),), budget, peak_bytes(graph), "")
    stats = reserved_of(whole, graph, planner.split, device)
    ratio = stats.max_reserved / max(stats.max_allocated, 1)
    usable = margin.usable(budget) / ratio  # allocated bytes whose reserved bytes keep the plans' margin
    held = report.by_category.get("held", 0)
    try:
        plan: Plan | StagingError = staged.plan(*args, **kwargs)
    except StagingError as e:
        plan = e
    note = ""
    extra = stats.max_allocated - whole.peak_bytes[0]  # the workspace, beside the program's tensors
    largest_whole = _largest(lambda b: report.predict(b) + extra, usable)
    largest_chunked = largest_recomputing = None
    try:
        half = max(batch // 2, 1)
        planners = {batch: planner}

        def planner_at(b: int) -> Any:
            if b not in planners:
                planners[b] = _planner_at(staged, args, kwargs, b)
            return planners[b]

        def floor_at(cost: Callable[[Any], int | None]) -> Callable[[int], float]:
            # At and above half the batch: the line through half and the batch; below: the step staged there.
            costs: dict[int, float] = {}

            def at(b: int) -> float:
                if b not in costs:
                    if b < half or half == batch:
                        value = cost(planner_at(b))
                    else:
                        low, high = cost(planner_at(half)), cost(planner)
                        value = None if None in (low, high) else low + (high - low) * (b - half) / (batch - half)
                    costs[b] = math.inf if value is None else value + held + extra
                return costs[b]

            return at

        largest_chunked = _largest(floor_at(_floor), usable)
        largest_recomputing = _largest(floor_at(_recompute_floor), usable)
        if UNBOUNDED in (largest_chunked, largest_recomputing):
            note = "A batch of any size fits in chunks: its bytes per example do not grow with the batch."
    except (StagingError, RuntimeError, ValueError) as e:
        log.info("stagetorch: fit: the largest batches in chunks and recomputing were not estimated: %s", e)
        note = f"The largest batches in chunks and recomputing were not estimated: {str(e).splitlines()[0]}"
    if largest_whole is not None:
        largest_recomputing = max(largest_recomputing or 0, largest_whole)
    if largest_recomputing is not None:
        largest_chunked = max(largest_chunked or 0, largest_recomputing)
    return DeviceFit(device, batch, budget, stats.max_allocated, stats.max_reserved, reserved_workspace(graph, device),
                     largest_whole, largest_chunked, largest_recomputing, plan, note)


def reserved_workspace(graph: Any, device: Device) -> int:
    from ..planning.reserved import device_workspace

    return device_workspace(graph, device)


def _planner_at(staged: Staged, args: tuple, kwargs: dict, b: int) -> Any:
    """The planner of the step staged at ``b`` examples (the batched arguments sliced or repeated)."""

    def resize(x: Any, dim: int) -> Any:
        n = x.shape[dim]
        if b <= n:
            return x.narrow(dim, 0, b)
        return x.repeat_interleave(-(-b // n), dim=dim).narrow(dim, 0, b)

    new_args, new_kwargs = map_batched(staged, args, kwargs, resize)
    return staged._stage(new_args, new_kwargs)[0].executable.planner


def _floor(planner: Any) -> int | None:
    """The peak in chunks of one example, or the whole batch's where that is less (None where the step cannot
    be chunked)."""
    whole = peak_bytes(planner.graph)
    if planner.batch == 1:
        return whole
    try:
        return min(whole, chunked_peak(planner.split(), 1, peak_bytes))
    except StagingError:
        return None


def _recompute_floor(planner: Any) -> int:
    """The lowest peak recomputation reaches on the whole batch, unchunked."""
    return min(point.peak_bytes for point in planner.frontier())

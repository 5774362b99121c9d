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
from ..interpreters.memory import peak_bytes
from ..planning import budget as margin
from ..planning.chunks import Plan, chunked_peak
from ..planning.reserved import reserved_of
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


def _largest(at: Callable[[int], float], budget: float, start: int) -> int | None:
    """The largest batch ``b >= 1`` with ``at(b) <= budget``, for ``at`` non-decreasing in ``b``, searched from
    the batch ``start`` (where ``at`` is cheapest): doubling up from it, or halving the interval below it;
    None where ``at(1)`` is over, :data:`UNBOUNDED` past 2**31 examples."""
    if at(start) <= budget:
        lo, hi = start, 2 * start
        while at(hi) <= budget:
            lo, hi = hi, 2 * hi
            if hi > UNBOUNDED:
                return UNBOUNDED
    else:
        if start == 1 or at(1) > budget:
            return None
        lo, hi = 1, start
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if at(mid) <= budget else (lo, mid)
    return lo


def _verified(
    candidate: int | None, fits: Callable[[int], bool], what: str, tries: int = 6, limit: int | None = None
) -> tuple[int | None, str]:
    """``candidate`` (an estimate of the largest batch that fits ``what`` way) checked with ``fits`` (the step
    staged at that batch, its reserved bytes predicted), and where it does not fit, the largest below it that
    does, halving the interval at most ``tries`` times. A candidate above ``limit`` is not checked (staging the
    step that large costs too much). **Returns** the batch (None: none fits) and a note where it is not exact."""
    if candidate is None:
        return None, ""
    if candidate >= UNBOUNDED or (limit is not None and candidate > limit):
        return candidate, (f" The largest batch {what} is estimated from lines through the batches staged (not "
                           "checked by staging the step there).")
    if fits(candidate):
        return candidate, ""
    lo, hi = 0, candidate
    for _ in range(tries):
        if hi - lo <= 1:
            break
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    if hi - lo <= 1:
        return lo or None, ""
    return lo or None, f" The largest batch {what} lies between {lo} and {hi - 1}: the smaller is shown."


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
    held = report.by_category.get("held", 0)
    try:
        plan: Plan | StagingError = staged.plan(*args, **kwargs)
    except StagingError as e:
        plan = e
    note = ""
    extra = stats.max_allocated - whole.peak_bytes[0]  # the workspace, beside the program's tensors
    # A batch fits a strategy where its allocated bytes keep the plans' margin and its reserved bytes (the
    # allocated times the reserved / allocated ratio the strategy has at the step's batch) fit the budget.
    keep = budget / max(margin.usable(budget), 1)

    def over(ratio: float) -> float:
        return max(keep, ratio)

    whole_ratio = over(stats.max_reserved / max(stats.max_allocated, 1))
    planners = {batch: planner}
    # The floors of a batch's planner, each computed once: the searches below ask for the same batches' (the
    # line through half the batch and the batch is drawn again for every batch tried; 92 costings of 36
    # graphs on a 4-layer Llama, most of the command's time).
    floor_of, recompute_floor_of = _once(_floor), _once(_recompute_floor)

    def planner_at(b: int) -> Any:
        if b not in planners:
            planners[b] = _planner_at(staged, args, kwargs, b)
        return planners[b]

    def whole_at(b: int) -> float:
        # The report's line where it holds (at and above the batches it was checked at), else the step staged.
        if b in report.probes:
            return (report.probes[b] + extra) * whole_ratio
        if report.linear and report.per_example_known and report.lines_from is not None and b >= report.lines_from:
            return (_line(report, b) + extra) * whole_ratio
        return (peak_bytes(planner_at(b).graph) + held + extra) * whole_ratio

    def whole_fits(b: int) -> bool:
        p = planner_at(b)
        at_b = Plan(b, (b,), (peak_bytes(p.graph),), budget, peak_bytes(p.graph), "")
        reserved = reserved_of(at_b, p.graph, p.split, device)
        return reserved.max_reserved + held <= budget and margin.fits(reserved.max_allocated + held, budget)

    largest_whole, note = _verified(_largest(whole_at, budget, batch), whole_fits, "whole")
    largest_chunked = largest_recomputing = None
    inputs_per_example = sum(v.aval.nbytes for v in planner.batched) / max(batch, 1)
    try:
        half = max(batch // 2, 1)

        def floor_at(cost: Callable[[Any], int | None], ratio: float) -> Callable[[int], float]:
            # At and above half the batch: the line through half and the batch; below: the step staged there.
            costs: dict[int, float] = {}

            def at(b: int) -> float:
                if b not in costs:
                    if b < half or half == batch:
                        value = cost(planner_at(b))
                    else:
                        # Above the batch, the line grows at least by the batched arguments, resident for the
                        # whole run (the peak between two batches may lie where they do not show: flat).
                        low, high = cost(planner_at(half)), cost(planner)
                        slope = None if None in (low, high) else (high - low) / (batch - half)
                        if slope is not None and b > batch:
                            slope = max(slope, inputs_per_example)
                        value = None if slope is None else (low if b <= batch else high) + slope * (
                            b - (half if b <= batch else batch))
                    costs[b] = math.inf if value is None else (value + held + extra) * ratio
                return costs[b]

            return at

        def chunked_fits(b: int) -> bool:
            p = planner_at(b)
            floor = floor_of(p)
            return floor is not None and margin.fits(floor + held + extra, budget) and (
                _smallest_chunks_reserved(p, device) + held <= budget)

        def recomputing_fits(b: int) -> bool:
            p = planner_at(b)
            return margin.fits(recompute_floor_of(p) + held + extra, budget) and _recompute_reserved(p, device) + held <= budget

        floor = floor_of(planner)
        if floor is not None:
            ratio = over(_smallest_chunks_reserved(planner, device) / max(floor + extra, 1))
            largest_chunked, said = _verified(_largest(floor_at(floor_of, ratio), budget, batch), chunked_fits,
                                              "in chunks", limit=_VERIFY_UP_TO * batch)
            note += said
        rec = _recompute_reserved(planner, device)
        ratio = over(rec / max(recompute_floor_of(planner) + extra, 1))
        largest_recomputing, said = _verified(_largest(floor_at(recompute_floor_of, ratio), budget, batch),
                                              recomputing_fits, "recomputing", limit=_VERIFY_UP_TO * batch)
        note += said
        if UNBOUNDED in (largest_chunked, largest_recomputing):
            note += " A batch of any size fits in chunks: its bytes per example do not grow with the batch."
    except (StagingError, RuntimeError, ValueError) as e:
        log.info("stagetorch: fit: the largest batches in chunks and recomputing were not estimated: %s", e)
        note = f"The largest batches in chunks and recomputing were not estimated: {str(e).splitlines()[0]}"
    if largest_whole is not None:
        largest_recomputing = max(largest_recomputing or 0, largest_whole)
    if largest_recomputing is not None:
        largest_chunked = max(largest_chunked or 0, largest_recomputing)
    return DeviceFit(device, batch, budget, stats.max_allocated, stats.max_reserved, reserved_workspace(graph, device),
                     largest_whole, largest_chunked, largest_recomputing, plan, note.strip())


def _line(report: Any, b: int) -> float:
    """The whole batch's peak at ``b`` by the report's lines (every program point's, else the peaks')."""
    if report.point_fixed:
        return max(a + s * b for a, s in zip(report.point_fixed, report.point_per_example))
    return report.fixed_bytes + report.per_example_bytes * b


# The most chunks a reserved-bytes prediction of chunks of one replays (each chunk's events once more).
_MAX_REPLAYED_CHUNKS = 256


# The largest batch, as a multiple of the step's own, at which an estimated largest batch is checked by
# staging the step there.
_VERIFY_UP_TO = 64


def _smallest_chunks_reserved(planner: Any, device: Device) -> int:
    """What the caching allocator is predicted to reserve for the step in its smallest chunks (of one
    example; of a few where the batch is larger than :data:`_MAX_REPLAYED_CHUNKS`), or whole where it
    cannot be chunked or is one example."""
    batch = planner.batch
    n = max(1, -(-batch // _MAX_REPLAYED_CHUNKS))
    sizes = (n,) * (batch // n) + ((batch % n,) if batch % n else ())
    if batch == 1 or _floor(planner) is None:
        sizes = (batch,)
    smallest = Plan(batch, sizes, (0,), 0, 0, "")
    return reserved_of(smallest, planner.graph, planner.split, device).max_reserved


def _recompute_reserved(planner: Any, device: Device) -> int:
    """What the caching allocator is predicted to reserve for the whole batch recomputing the most it can."""
    point = min(planner.frontier(), key=lambda q: q.peak_bytes)
    whole = Plan(planner.batch, (planner.batch,), (point.peak_bytes,), 0, point.peak_bytes, "")
    split = planner.split if point.graph is planner.graph else planner.recomputing(point.graph).split
    return reserved_of(whole, point.graph, split, device).max_reserved


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
    # A step of its own per batch: the user's staged step keeps its programs (and its warning about many).
    probe = Staged(staged.fn, batch_dim=staged.batch_dim, batch_argnums=staged.batch_argnums,
                   static_argnums=staged.static_argnums, memory_budget=staged.memory_budget,
                   remat="auto" if staged.remat else False, donate_grads=staged.donate_grads, device=staged.device)
    return probe._stage(new_args, new_kwargs)[0].executable.planner


def _once(cost: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``cost`` of a planner, remembered per planner (the caller keeps the planners alive: ids stay theirs)."""
    seen: dict[int, Any] = {}

    def once(planner: Any) -> Any:
        if id(planner) not in seen:
            seen[id(planner)] = cost(planner)
        return seen[id(planner)]

    return once


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

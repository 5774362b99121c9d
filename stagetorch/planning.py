"""The planner: chunk sizes for a staged step, from the memory model and the memory available.

It costs the graphs the chunked executor will run (the whole graph when it fits, else the shared, body
and post graphs), so a plan's predicted peak is the peak of what runs. It runs nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import attrs

from .chunking import Split
from .devices import format_bytes
from .errors import OutOfMemoryError
from .ir import Graph, Var

__all__ = ["Plan", "plan_chunks", "SAFETY_MARGIN"]

# Fraction of the budget the plan leaves unused: the allocator's rounding and fragmentation live there.
SAFETY_MARGIN = 0.10


@attrs.frozen
class Plan:
    """How a step will run: ``chunk_sizes`` (one entry when the whole batch fits), the predicted peak of
    each chunk, the budget planned against, and why."""

    batch: int
    chunk_sizes: tuple[int, ...]
    peak_bytes: tuple[int, ...]
    budget_bytes: int
    full_batch_peak_bytes: int
    reason: str

    @property
    def chunked(self) -> bool:
        return len(self.chunk_sizes) > 1

    def __str__(self) -> str:
        sizes = "+".join(map(str, self.chunk_sizes))
        peak = max(self.peak_bytes)
        return (
            f"Plan: batch {self.batch} as {len(self.chunk_sizes)} chunk(s) [{sizes}], predicted peak "
            f"{format_bytes(peak)} of a {format_bytes(self.budget_bytes)} budget (whole batch at once: "
            f"{format_bytes(self.full_batch_peak_bytes)}). {self.reason}"
        )


def _resident(split: Split, n: int) -> int:
    """Bytes held across the chunk loop besides the body's own values: every graph input, what the shared
    phase hands on, the accumulators, and the full per-example results."""
    seen: set[Var] = set()
    total = 0
    for v in [*split.graph.invars, *split.shared.outvars]:
        r = v.root
        if r not in seen:
            seen.add(r)
            total += r.owned_nbytes
    body = split.body(n)
    # The accumulators and full per-example results; each chunk's own partials are in the body's peak.
    total += sum(v.aval.nbytes for v, _ in body.results)
    return total


def _body_peak(split: Split, n: int, cost: Callable[[Graph], int]) -> int:
    body = split.body(n)
    inputs = sum(v.aval.nbytes for v in body.graph.invars)
    return max(cost(body.graph) - inputs, 0)


def _chunk_peak(split: Split, n: int, cost: Callable[[Graph], int]) -> int:
    return _resident(split, n) + _body_peak(split, n, cost)


def _sizes(batch: int, largest: int) -> list[int]:
    """Even chunks no larger than ``largest``, rounded up to a multiple of 8 where that still fits, so the
    last chunk is not tiny and kernels see friendly sizes."""
    count = math.ceil(batch / largest)
    size = math.ceil(batch / count)
    if size > 8 and math.ceil(size / 8) * 8 <= largest:
        size = math.ceil(size / 8) * 8
    sizes = [size] * (batch // size)
    if batch % size:
        sizes.append(batch % size)
    return sizes


def plan_chunks(
    graph: Graph,
    split: Callable[[], Split],
    batch: int,
    budget: int,
    cost: Callable[[Graph], int],
    full: int | None = None,
) -> Plan:
    """Choose chunk sizes for ``graph`` over ``batch`` examples within ``budget`` bytes.

    ``split`` builds the chunked form on demand (only when the whole batch does not fit). ``cost`` is the
    memory interpreter: a Graph's peak bytes; ``full`` is ``cost(graph)`` when the caller already has it.
    """
    usable = int(budget * (1 - SAFETY_MARGIN))
    full = cost(graph) if full is None else full
    if full <= usable or batch == 1:
        why = "The whole batch fits." if full <= usable else "A single example cannot be split further."
        if full > usable:
            raise _too_big(graph, split(), budget, cost)
        return Plan(batch, (batch,), (full,), budget, full, why)
    s = split()
    small, large = (1, 2) if batch < 4 else (2, 4)
    p_small, p_large = _chunk_peak(s, small, cost), _chunk_peak(s, large, cost)
    per_example = max((p_large - p_small) / (large - small), 1)
    fixed = p_small - per_example * small
    largest = min(int((usable - fixed) // per_example), batch - 1)
    while largest >= 1 and _chunk_peak(s, largest, cost) > usable:
        largest -= max(1, largest // 16)
    if largest < 1:
        raise _too_big(graph, s, budget, cost)
    sizes = _sizes(batch, largest)
    peaks = tuple(_chunk_peak(s, n, cost) for n in sizes)
    why = (
        f"The whole batch needs {format_bytes(full)}; fixed {format_bytes(fixed)} + {format_bytes(per_example)} per example allows "
        f"chunks of up to {largest}."
    )
    return Plan(batch, tuple(sizes), peaks, budget, full, why)


def _too_big(graph: Graph, split: Split, budget: int, cost: Callable[[Graph], int]) -> OutOfMemoryError:
    one = _chunk_peak(split, 1, cost)
    resident = _resident(split, 1)
    params = sum(v.aval.nbytes for v, r in zip(graph.invars, graph.roles) if r in ("param", "buffer"))
    return OutOfMemoryError(
        f"not even one example fits: a chunk of 1 needs {format_bytes(one)} against a budget of {format_bytes(budget)} "
        f"(less a {SAFETY_MARGIN:.0%} margin). Of that, {format_bytes(resident)} is held for the whole step "
        f"(parameters and buffers {format_bytes(params)}, the full batch inputs, gradient accumulators and outputs) "
        f"and {format_bytes(one - resident)} is one example's activations. What to do: raise memory_budget, use a "
        "smaller model or lower precision, or move the batch off the device."
    )

"""The planner: chunk sizes for a staged step, from the memory model and the memory available.

It costs the graphs the chunked executor will run (the whole graph when it fits, else the shared, body
and post graphs), so a plan's predicted peak is the peak of what runs. It runs nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import attrs

from .chunking import BodyGraph, Split, even_chunks
from .costing import timeline
from .devices import format_bytes
from .errors import OutOfMemoryError
from .ir import Graph, Var

__all__ = ["Plan", "plan_chunks", "chunked_peak", "body_peaks", "SAFETY_MARGIN"]

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
    # The peak of what runs once around the chunks (the shared phase, the post phase with every accumulator).
    phase_peak_bytes: int = 0

    @property
    def peak(self) -> int:
        """The predicted peak of the whole run."""
        return max(*self.peak_bytes, self.phase_peak_bytes)

    @property
    def chunked(self) -> bool:
        return len(self.chunk_sizes) > 1

    def __str__(self) -> str:
        sizes = "+".join(map(str, self.chunk_sizes))
        peak = self.peak
        return (
            f"Plan: batch {self.batch} as {len(self.chunk_sizes)} chunk(s) [{sizes}], predicted peak "
            f"{format_bytes(peak)} of a {format_bytes(self.budget_bytes)} budget (whole batch at once: "
            f"{format_bytes(self.full_batch_peak_bytes)}). {self.reason}"
        )


def _bytes(vars: list[Var]) -> int:
    """Bytes of the storages ``vars`` live in, each counted once."""
    seen: set[Var] = set()
    total = 0
    for v in vars:
        r = v.root
        if r not in seen:
            seen.add(r)
            total += r.owned_nbytes
    return total


def _base(split: Split) -> int:
    """Bytes held for the whole chunked run: every graph input and what the shared phase hands on."""
    return _bytes([*split.graph.invars, *split.shared.outvars]) - split.input_overlap


def _own_peak(graph: Graph, cost: Callable[[Graph], int]) -> int:
    """A per-chunk graph's peak less its inputs (they are counted as held by the run)."""
    return max(cost(graph) - sum(v.aval.nbytes for v in graph.invars), 0)


def body_peaks(split: Split, body: BodyGraph, cost: Callable[[Graph], int]) -> tuple[int, int]:
    """Predicted peak of the run while ``body``'s first chunk runs, and while any later chunk does. The
    first chunk's partials become the accumulators, so they are counted in its own peak."""
    base = _base(split)
    cat, acc = body.held_bytes
    return base + cat + _own_peak(body.first, cost), base + cat + acc + _own_peak(body.rest, cost)


def _chunk_peaks(split: Split, n: int, cost: Callable[[Graph], int]) -> tuple[int, int]:
    """(first, later) chunk peaks for chunks of ``n``: the body's, or a pre-pass's where that is larger."""
    first, rest = body_peaks(split, split.body(n), cost)
    for make, wanted in ((split.normaliser_pass, split.globals), (split.reduction_pass, split.reduced_for_globals)):
        if wanted:
            f, r = body_peaks(split, make(n), cost)
            first, rest = max(first, f), max(rest, r)
    return first, rest


def _phase_peak(split: Split, n: int, cost: Callable[[Graph], int]) -> int:
    """Peak of the phases that run once: the shared phase before the chunks, the post phase after them
    (with the accumulators and full results held)."""
    base = _base(split)
    cat, acc = split.body(n).held_bytes
    post = cost(split.post) - _bytes(split.post.invars) if split.post.eqns else 0
    return max(cost(split.shared) - split.input_overlap, base + cat + acc + max(post, 0))


def chunked_peak(split: Split, n: int, cost: Callable[[Graph], int]) -> int:
    """The predicted peak of a chunked run in chunks of ``n``: its chunks' and its once-only phases'."""
    return max(*_chunk_peaks(split, n, cost), _phase_peak(split, n, cost))


def plan_chunks(
    graph: Graph,
    split: Callable[[], Split],
    batch: int,
    budget: int,
    cost: Callable[[Graph], int],
    full: int | None = None,
    cap: int | None = None,
) -> Plan:
    """Choose chunk sizes for ``graph`` over ``batch`` examples within ``budget`` bytes.

    ``split`` builds the chunked form on demand (only when the whole batch does not fit). ``cost`` is the
    memory interpreter: a Graph's peak bytes; ``full`` is ``cost(graph)`` when the caller already has it.
    ``cap``: the largest chunk to plan (a larger one ran out of memory before); the whole batch is then
    split even when the estimate says it fits.
    """
    usable = int(budget * (1 - SAFETY_MARGIN))
    cost = _once_per_graph(cost)
    full = cost(graph) if full is None else full
    if (full <= usable and (cap is None or cap >= batch)) or batch == 1:
        why = "The whole batch fits." if full <= usable else "A single example cannot be split further."
        if full > usable:
            raise _too_big(graph, split(), budget, cost)
        return Plan(batch, (batch,), (full,), budget, full, why)
    s = split()
    peak = functools.partial(chunked_peak, s, cost=cost)
    small, large = (1, 2) if batch < 4 else (2, 4)
    p_small, p_large = peak(small), peak(large)
    per_example = max((p_large - p_small) / (large - small), 1)
    fixed = p_small - per_example * small
    largest = min(int((usable - fixed) // per_example), batch - 1, cap or batch)
    while largest >= 1 and peak(largest) > usable:
        largest -= max(1, largest // 16)
    if largest < 1:
        raise _too_big(graph, s, budget, cost)
    sizes = even_chunks(batch, largest)
    peaks = tuple(_chunk_peaks(s, n, cost)[k > 0] for k, n in enumerate(sizes))
    phases = _phase_peak(s, sizes[0], cost)
    why = (
        f"The whole batch needs {format_bytes(full)}; fixed {format_bytes(fixed)} + {format_bytes(per_example)} per example allows "
        f"chunks of up to {largest}."
    )
    if cap is not None and cap < batch:
        why += f" Chunks are at most {cap} examples: a larger one ran out of memory in an earlier call."
    return Plan(batch, tuple(sizes), peaks, budget, full, why, phases)


def _once_per_graph(cost: Callable[[Graph], int]) -> Callable[[Graph], int]:
    """``cost`` remembered per graph for one planning: the search costs the same chunk bodies (built once
    per size by the split) several times, and a 5,000-equation body takes ~0.1 s to cost."""
    seen: dict[int, tuple[Graph, int]] = {}

    def once(graph: Graph) -> int:
        hit = seen.get(id(graph))
        if hit is None:
            hit = seen[id(graph)] = (graph, cost(graph))  # the graph is held, so its id is not reused
        return hit[1]

    return once


def _too_big(graph: Graph, split: Split, budget: int, cost: Callable[[Graph], int]) -> OutOfMemoryError:
    body = split.body(1)
    first, rest = _chunk_peaks(split, 1, cost)
    phases = _phase_peak(split, 1, cost)
    roles = dict(zip(graph.invars, graph.roles or ["arg"] * len(graph.invars)))
    params = _bytes([v for v in graph.invars if roles[v] in ("param", "buffer")])
    inputs = _base(split) - params
    cat, acc = body.held_bytes
    t = timeline(body.rest)
    partial_roots = {x.root for x in body.partials}
    live = [r for r in t.peak_live if t.owners[r][2] >= 0]
    partials = sum(t.owners[r][1] for r in live if r in partial_roots)
    activations = sum(t.owners[r][1] for r in live if r not in partial_roots) + t.peak_workspace
    parts = [
        ("parameters and buffers", params), ("inputs (the whole batch) and shared values", inputs),
        ("gradient and other accumulators", acc), ("per-example outputs", cat),
        ("partial gradients of the chunk", partials), ("activations and temporaries of one example", activations),
    ]
    listed = ", ".join(f"{name} {format_bytes(n)}" for name, n in parts if n)
    needs = max(first, rest, phases)
    error = OutOfMemoryError(
        f"not even one example fits: a chunk of 1 needs {format_bytes(needs)} against a budget of {format_bytes(budget)} "
        f"(less a {SAFETY_MARGIN:.0%} margin). At a later chunk's peak: {listed}. What to do: raise memory_budget, "
        "use a smaller model or lower precision, or move the batch off the device."
    )
    error.smallest_budget = int(needs / (1 - SAFETY_MARGIN)) + 1
    return error

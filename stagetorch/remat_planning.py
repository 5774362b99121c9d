"""The joint planner: which forward values to recompute, and the chunk size, chosen together for a budget.

First the memory -> extra-compute frontier of recompute sets: cut the chain of candidate values (in forward
order) into segments of a given size and keep each segment's last value (Chen et al.'s scheme, for a range
of segment sizes), plus "keep only what matrix products, convolutions and attention make" (recompute the
cheap ops); each set is applied with :func:`~stagetorch.remat.remat` and costed exactly by the memory
interpreter, and only sets that lower the peak for their extra FLOPs survive. Keeping everything is always
on the frontier, so a plan is never worse than no recomputation. Then, for each frontier point, the chunk
planner sizes chunks for the recomputing graph, and the point with the lowest predicted step cost wins.

It knows graphs, the remat pass, the FLOP and memory interpreters and the chunk planner's :class:`Plan`;
it runs nothing, and it builds no executable (the caller passes a function that plans chunks for a graph).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from .costing import peak_bytes
from .devices import format_bytes
from .errors import BatchCouplingError, OutOfMemoryError, UnsupportedOpError
from .flops import eqn_flops, graph_flops
from .ir import Graph, Var, op_name
from .planning import SAFETY_MARGIN, Plan
from .registry import slot
from .remat import Candidates, candidates, recomputed_eqns, remat

# What the chunk planner raises when a graph cannot run in chunks that fit: then only recomputation can help.
_CANNOT = (OutOfMemoryError, BatchCouplingError, UnsupportedOpError)

__all__ = ["Recompute", "frontier", "RematPlan", "plan_joint", "CALL_FLOPS"]

# What one op call costs beyond its arithmetic, in FLOP-equivalents (a few microseconds of dispatch at tens
# of GFLOP/s): the price of running the body once more per extra chunk.
CALL_FLOPS = 200_000


@attrs.frozen
class Recompute:
    """One recompute set: the roots kept (checkpoints), the graph that recomputes the rest, its peak and the
    FLOPs its recomputation adds."""

    keep: frozenset[Var]
    graph: Graph
    peak_bytes: int
    extra_flops: int
    recomputed: tuple[str, ...]

    @property
    def dropped(self) -> int:
        return len(self.recomputed)


def _point(graph: Graph, cands: Candidates, keep: frozenset[Var], cost: Callable[[Graph], int]) -> Recompute:
    g = remat(graph, keep, cands)
    extra = recomputed_eqns(g)
    return Recompute(keep, g, cost(g), graph_flops(extra), tuple(op_name(e.prim) for e in extra))


def _segments(cands: Candidates, size: float) -> frozenset[Var]:
    """Keep the last value of each run of candidates whose bytes add up to ``size``."""
    keep, acc = set(), 0
    for r, nbytes in zip(cands.roots, cands.nbytes):
        acc += nbytes
        if acc >= size:
            keep.add(r)
            acc = 0
    return frozenset(keep)


def _expensive(graph: Graph, cands: Candidates) -> frozenset[Var]:
    """The candidates an op with a FLOP rule of its own makes (matrix products, convolutions, attention)."""
    made: dict[Var, bool] = {}
    for e in graph.eqns[: cands.boundary]:
        costly = slot(e.prim, "flops") is not None and eqn_flops(e) > 0
        for v in e.outvars:
            if v is not None:
                made[v.root] = made.get(v.root, False) or costly
    return frozenset(r for r in cands.roots if made.get(r))


def frontier(graph: Graph, cost: Callable[[Graph], int] = peak_bytes) -> list[Recompute]:
    """The recompute sets worth considering, by increasing extra FLOPs and decreasing peak; the first keeps
    everything (``graph`` itself)."""
    cands = candidates(graph)
    full = Recompute(frozenset(cands.roots), graph, cost(graph), 0, ())
    if not cands.roots:
        return [full]
    total = sum(cands.nbytes)
    sizes, size = [], float(total)
    while size >= min(cands.nbytes) and len(sizes) < 40:
        size /= 2**0.5
        sizes.append(size)
    keeps = {_segments(cands, s) for s in sizes} | {_expensive(graph, cands)}
    points = [full] + [_point(graph, cands, k, cost) for k in keeps if k != full.keep]
    points.sort(key=lambda p: (p.extra_flops, p.peak_bytes))
    out = [full]
    for p in points[1:]:
        if p.peak_bytes < out[-1].peak_bytes:
            out.append(p)
    return out


@attrs.frozen
class RematPlan(Plan):
    """A plan that recomputes: ``recompute`` says what (the graph run is ``recompute.graph``), and
    ``extra_flops`` / ``base_flops`` what it costs against the step without recomputation."""

    recompute: Recompute | None = None
    base_flops: int = 0

    @property
    def extra_flops(self) -> int:
        return self.recompute.extra_flops if self.recompute else 0

    def __str__(self) -> str:
        if self.recompute is None:
            return super().__str__()
        r = self.recompute
        return (
            f"{super().__str__()} Recomputes {r.dropped} op(s) in the backward ({', '.join(sorted(set(r.recomputed)))}) "
            f"for {r.extra_flops / max(self.base_flops, 1):.1%} extra FLOPs, keeping {len(r.keep)} checkpoint(s); "
            f"predicted peak without chunking {format_bytes(r.peak_bytes)}."
        )


def step_cost(flops: int, calls: int, chunks: int) -> float:
    """Predicted step cost in FLOP-equivalents: the arithmetic, plus the calls of every chunk."""
    return flops + CALL_FLOPS * calls * chunks


def plan_joint(
    graph: Graph,
    budget: int,
    chunk_plan: Callable[[Graph], Plan],
    floor: Callable[[Graph], int],
    points: Callable[[], list[Recompute]] | None = None,
) -> Plan:
    """Choose the recompute set and the chunk sizes for ``graph`` within ``budget`` bytes.

    ``chunk_plan(g)`` is the chunk planner for graph ``g`` (it raises :class:`OutOfMemoryError` when not
    even one example fits, :class:`BatchCouplingError` or :class:`UnsupportedOpError` when ``g`` cannot be
    chunked); ``floor(g)`` is the
    fewest bytes ``g`` can run in (one example per chunk, or the whole batch when it cannot be chunked);
    ``points()`` is ``frontier(graph)``, for a caller that keeps it across budgets.
    Returns the plain chunk plan when no recomputation is needed or it is the cheapest; else a
    :class:`RematPlan`. Raises the chunk planner's error, naming the smallest budget some schedule fits,
    when none fits.
    """
    base_flops = graph_flops(graph)
    usable = int(budget * (1 - SAFETY_MARGIN))
    best: tuple[float, Plan] | None = None
    first_error: Exception | None = None
    try:
        plain = chunk_plan(graph)
        if not plain.chunked:
            return plain
        best = (step_cost(base_flops, len(graph.eqns), len(plain.chunk_sizes)), plain)
    except _CANNOT as e:
        first_error = e
    points = frontier(graph) if points is None else points()
    for p in points[1:]:
        flops = base_flops + p.extra_flops
        if best is not None and step_cost(flops, len(p.graph.eqns), 1) >= best[0]:
            break  # later points add more FLOPs: none can beat the best so far
        if p.peak_bytes <= usable:
            plan = chunk_plan(p.graph)
        else:
            try:
                plan = chunk_plan(p.graph)
            except _CANNOT:
                continue
        score = step_cost(flops, len(p.graph.eqns), len(plan.chunk_sizes))
        if best is None or score < best[0]:
            best = (score, RematPlan(**attrs.asdict(plan, recurse=False), recompute=p, base_flops=base_flops))
    if best is not None:
        return best[1]
    assert first_error is not None
    floors = [floor(p.graph) for p in points]
    least = min(range(len(points)), key=floors.__getitem__)
    smallest = int(floors[least] / (1 - SAFETY_MARGIN)) + 1
    raise type(first_error)(
        f"{first_error} Recomputing forward values in the backward does not fit either: the smallest budget any "
        f"schedule fits is {format_bytes(smallest)} (recomputing {points[least].dropped} op(s))."
    ) from first_error

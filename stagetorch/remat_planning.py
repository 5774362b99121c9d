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

from .costing import allocated, effect, peak_bytes
from .devices import format_bytes
from .errors import BatchCouplingError, OutOfMemoryError, UnsupportedOpError
from .flops import eqn_flops, graph_flops
from .ir import Graph, Var, op_name
from .passes import has_effect
from .planning import SAFETY_MARGIN, Plan
from .registry import slot
from .remat import Candidates, candidates, remat

# How many recompute sets that do not fit whole the joint planner sizes chunks for (besides the last).
_CHUNK_TRIES = 4

# What the chunk planner raises when a graph cannot run in chunks that fit: then only recomputation can help.
_CANNOT = (OutOfMemoryError, BatchCouplingError, UnsupportedOpError)

__all__ = ["Recompute", "frontier", "RematPlan", "plan_joint", "CALL_FLOPS"]

# What one op call costs beyond its arithmetic, in FLOP-equivalents (a few microseconds of dispatch at tens
# of GFLOP/s): the price of running the body once more per extra chunk.
CALL_FLOPS = 200_000


class Recompute:
    """One recompute set: the roots kept (checkpoints), its predicted peak and the FLOPs its recomputation
    adds, and (built on first use) ``graph``, the program that recomputes the rest."""

    def __init__(self, source: Graph, cands: Candidates, keep: frozenset[Var], peak_bytes: int, extra_flops: int,
                 recomputed: tuple[str, ...], graph: Graph | None = None):
        self.source, self.cands, self.keep = source, cands, keep
        self.peak_bytes, self.extra_flops, self.recomputed = peak_bytes, extra_flops, recomputed
        self._graph = graph

    @property
    def graph(self) -> Graph:
        if self._graph is None:
            self._graph = remat(self.source, self.keep, self.cands)
        return self._graph

    @property
    def dropped(self) -> int:
        return len(self.recomputed)

    def __repr__(self) -> str:
        return f"Recompute(keep={len(self.keep)}, peak_bytes={self.peak_bytes}, extra_flops={self.extra_flops})"


class _Simulator:
    """The memory interpreter's walk over ``remat(graph, keep)``, without building that graph: the same
    schedule (the pass's recompute order, its dead-code elimination, allocation at first definition, free
    after last use, outputs kept) over per-equation facts computed once, so that a planner can cost many
    recompute sets of a big graph. Tests hold it equal to ``peak_bytes(remat(graph, keep))``.

    Vars are numbered; a recomputed copy of var ``i`` (or a backward var rebased onto one) is ``i + n``.
    """

    def __init__(self, graph: Graph, cands: Candidates):
        self.graph, self.cands = graph, cands
        index: dict[Var, int] = {}
        for v in graph.vars():
            index.setdefault(v, len(index))
        self.index = index
        n = self.n = len(index)
        self.root = [0] * n
        self.base = [-1] * n
        for v, i in index.items():
            self.root[i] = index[v.root]
            self.base[i] = -1 if v.base is None else index[v.base]
        self.reads: list[tuple[int, ...]] = []
        self.outs: list[tuple[int, ...]] = []
        self.sizes: list[tuple[int, ...]] = []
        self.workspace: list[int] = []
        for e in graph.eqns:
            self.reads.append(tuple(index[v] for v in e.invars))
            eff = effect(e)
            outs = [(j, v) for j, v in enumerate(e.outvars) if v is not None]
            self.outs.append(tuple(index[v] for _, v in outs))
            self.sizes.append(tuple(allocated(eff.outputs.get(j, v.root.owned_nbytes), v.root.aval.device) for j, v in outs))
            self.workspace.append(eff.workspace)
        self.effect = [has_effect(e) for e in graph.eqns]
        self.flops = [eqn_flops(e) for e in graph.eqns]
        self.producer = [-1] * n
        for k in range(cands.boundary):
            for i in self.outs[k]:
                self.producer[i] = k
        self.inputs = {index[v.root] for v in graph.invars}
        self.resident = {index[v.root]: allocated(v.root.owned_nbytes, v.root.aval.device) for v in graph.invars}
        self.recomputable = {index[r] for r in cands.recomputable}
        self.kept = [index[v] for v in graph.outvars if isinstance(v, Var)] + [index[v] for _, v in graph.grads]

    def run(self, keep: frozenset[Var]) -> tuple[int, int, tuple[str, ...]]:
        """(peak bytes, extra FLOPs, recomputed op names) of ``remat(graph, keep)``."""
        n, root, base, reads_of, outs_of, producer = self.n, self.root, self.base, self.reads, self.outs, self.producer
        drop = self.recomputable - {self.index[r] for r in keep}
        copied = [False] * n
        # Events: (equation index, recomputed?, vars read, vars defined), vars numbered as above.
        events: list[tuple[int, bool, tuple[int, ...], tuple[int, ...]]] = [
            (k, False, reads_of[k], outs_of[k]) for k in range(self.cands.boundary)
        ]

        def recompute(v: int) -> None:
            stack = [(producer[v], False)]
            while stack:
                k, ready = stack.pop()
                outs = outs_of[k]
                if any(copied[o] for o in outs):
                    continue
                if ready:
                    for o in outs:
                        copied[o] = True
                    events.append((k, True, tuple(u + n if copied[u] else u for u in reads_of[k]), tuple(o + n for o in outs)))
                    continue
                stack.append((k, True))
                needs = [u for u in reads_of[k] if root[u] in drop and not copied[u]]
                needs += [base[o] for o in outs if base[o] >= 0 and root[base[o]] in drop and not copied[base[o]]
                          and producer[base[o]] >= 0]
                stack.extend((producer[u], False) for u in reversed(needs))

        for k in range(self.cands.boundary, len(reads_of)):
            for u in reads_of[k]:
                if root[u] in drop and not copied[u]:
                    recompute(u)
            reads = tuple(u + n if copied[u] else u for u in reads_of[k])
            # As remat's _rebase: onto a copied base only when the equation reads the copy's storage.
            read_storages = {root[u - n] + n if u >= n else root[u] for u in reads}
            outs = []
            for o in outs_of[k]:
                if base[o] >= 0 and copied[base[o]] and root[base[o]] + n in read_storages:
                    copied[o] = True
                    outs.append(o + n)
                else:
                    outs.append(o)
            events.append((k, False, reads, tuple(outs)))
        kept = [v + n if copied[v] else v for v in self.kept]
        # Dead-code elimination, as passes.dce does it.
        needed = set(kept)
        live = [False] * len(events)
        for i in range(len(events) - 1, -1, -1):
            k, _, reads, outs = events[i]
            if self.effect[k] or any(o in needed for o in outs):
                live[i] = True
                needed.update(reads)
                for o in outs:
                    b = base[o % n]
                    if b >= 0:
                        needed.add(b + n if o >= n and copied[b] else b)
        events = [ev for ev, ok in zip(events, live) if ok]
        extra = [k for k, copy, _, _ in events if copy]
        names = tuple(op_name(self.graph.eqns[k].prim) for k in extra)
        return self._peak(events, kept), sum(self.flops[k] for k in extra), names

    def _peak(self, events: list, kept: list[int]) -> int:
        n, root = self.n, self.root
        count = len(events)

        def storage(v: int) -> int:
            return root[v - n] + n if v >= n else root[v]

        last: dict[int, int] = {}
        for i, (_, _, reads, _) in enumerate(events):
            for v in reads:
                last[storage(v)] = i
        for v in kept:
            last[storage(v)] = count
        owned = dict(self.resident)
        live = sum(owned.values())
        frees: list[list[int]] = [[] for _ in range(count + 1)]
        for key, i in last.items():
            if key not in self.inputs:
                frees[i].append(key)
        peak = live
        for i, (k, _, _, outs) in enumerate(events):
            for v, size in zip(outs, self.sizes[k]):
                key = storage(v)
                if key in owned:
                    continue
                owned[key] = size
                live += size
                if key not in last:
                    frees[i].append(key)
            peak = max(peak, live + self.workspace[k])
            for key in frees[i]:
                live -= owned[key]
        return peak


def _point(sim: _Simulator, keep: frozenset[Var]) -> Recompute:
    peak, extra, names = sim.run(keep)
    return Recompute(sim.graph, sim.cands, keep, peak, extra, names)


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


# Graphs with at most this many candidates also get the greedy descent (its cost grows as the square).
_GREEDY_MAX = 48


def _greedy(sim: _Simulator, start: Recompute) -> list[Recompute]:
    """From keeping everything, drop one more candidate at a time: the one that lowers the peak most per
    FLOP it adds (a drop that lowers it for free first). Every step is a point."""
    out, current = [], start
    while True:
        best, best_score = None, 0.0
        for r in sim.cands.roots:  # in graph order, so that ties break the same way every time
            if r not in current.keep:
                continue
            p = _point(sim, current.keep - {r})
            gain = current.peak_bytes - p.peak_bytes
            if gain <= 0:
                continue
            score = gain / (max(p.extra_flops - current.extra_flops, 0) + 1)
            if score > best_score:
                best, best_score = p, score
        if best is None:
            return out
        out.append(best)
        current = best


def frontier(graph: Graph) -> list[Recompute]:
    """The recompute sets worth considering, by increasing extra FLOPs and decreasing peak; the first keeps
    everything (``graph`` itself)."""
    cands = candidates(graph)
    full = Recompute(graph, cands, frozenset(cands.roots), peak_bytes(graph), 0, (), graph)
    if not cands.roots:
        return [full]
    total = sum(cands.nbytes)
    sizes, size = [], float(total)
    while size >= min(cands.nbytes) and len(sizes) < 24:
        size /= 2
        sizes.append(size)
    keeps = list(dict.fromkeys([*(_segments(cands, s) for s in sizes), _expensive(graph, cands)]))
    sim = _Simulator(graph, cands)
    points = [full] + [_point(sim, k) for k in keeps if k != full.keep]
    if len(cands.roots) <= _GREEDY_MAX:
        points += _greedy(sim, full)
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
            f"for {r.extra_flops / max(self.base_flops, 1):.1%} extra FLOPs, keeping {len(r.keep)} checkpoint(s)."
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
    tries = 0
    for p in points[1:]:
        flops, calls = base_flops + p.extra_flops, len(graph.eqns) + p.dropped
        if best is not None and step_cost(flops, calls, 1) >= best[0]:
            break  # later points add more FLOPs: none can beat the best so far
        if p.peak_bytes <= usable:
            plan = chunk_plan(p.graph)
        else:
            # Sizing chunks builds and costs the chunked form of the graph: try a few points, and the
            # last (the least peak), not every one.
            if tries >= _CHUNK_TRIES and p is not points[-1]:
                continue
            tries += 1
            try:
                plan = chunk_plan(p.graph)
            except _CANNOT:
                continue
        score = step_cost(flops, calls, len(plan.chunk_sizes))
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

"""The joint planner: which forward values to recompute, and the chunk size, chosen together for a budget.

For points of the frontier (:mod:`~stagetorch.planning.remat_frontier`), the chunk planner sizes chunks for the
recomputing graph, and the point with the lowest predicted step cost wins (:func:`plan_joint`). Keeping
everything is always on the frontier, so a plan is never worse than no recomputation. On graphs of up to
``BIG`` equations the winner is then polished for its budget: dropped values are kept again where the peak
still fits and the cost falls; sets just above the budget are repaired, and the least peak descended.

It knows the frontier and its simulator, the FLOP interpreter and the chunk planner's :class:`Plan`; it runs
nothing, and it builds no executable (the caller passes a function that plans chunks for a graph).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator

import attrs
import torch

from ..devices.budget import bytes_ceiling, format_bytes
from ..errors import BatchCouplingError, OutOfMemoryError, UnsupportedOpError
from ..interpreters.flops import graph_calls, graph_flops
from ..ir import Graph, Var
from ..transforms.remat import NOT_HELD
from . import budget as margin
from .chunks import Plan
from .remat_frontier import BIG, REPAIR_STARTS, frontier, repaired_to
from .remat_simulator import Recompute, hoisted_of, live_at_peak, point, storage_bytes

__all__ = ["RematPlan", "plan_joint", "CALL_FLOPS", "step_cost", "predicted_cost"]

# What the chunk planner raises when a graph cannot run in chunks that fit: then only recomputation can help.
_CANNOT = (OutOfMemoryError, BatchCouplingError, UnsupportedOpError)

# What one op call costs beyond its arithmetic, in FLOP-equivalents, by device type: the price of running the
# body once more per extra chunk. CPU: measured on a 2-core VM (docs/history/results-log.md, "1/3 of the no-recompute
# peak"), a chunk added 8-70 us per op call at ~50 GFLOP/s, as small-batch convolutions and an LSTM's
# per-step work do not shrink with the chunk (200,000 before: the planner chose 4-6 chunks where fewer with
# recomputation ran faster). An op's ``calls`` rule says how many kernels it runs (an LSTM layer: one per
# time step). CUDA: a kernel launch, ~5 us, at ~50 TFLOP/s; not measured yet.
CALL_FLOPS = {"cpu": 1_000_000, "cuda": 250_000_000}

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


def step_cost(flops: int, calls: int, chunks: int, device: torch.device | str = "cpu") -> float:
    """Predicted step cost in FLOP-equivalents on ``device``: the arithmetic, plus the kernel calls of every
    chunk."""
    per_call = CALL_FLOPS.get(torch.device(device).type, CALL_FLOPS["cpu"])
    return flops + per_call * calls * chunks


def predicted_cost(graph: Graph, plan: Plan | None = None) -> float:
    """The step cost :func:`plan_joint` predicts for running ``graph`` by ``plan`` (None: whole, nothing
    recomputed), in FLOP-equivalents on the graph's device."""
    recompute = plan.recompute if isinstance(plan, RematPlan) else None
    flops = graph_flops(graph) + (recompute.extra_flops if recompute else 0)
    calls = graph_calls(graph) + (recompute.extra_calls if recompute else 0)
    return step_cost(flops, calls, len(plan.chunk_sizes) if plan else 1, graph.device)


def plan_joint(
    graph: Graph,
    budget: int,
    chunk_plan: Callable[..., Plan],
    floor: Callable[[Graph], int],
    points: Callable[[], list[Recompute]] | None = None,
    *,
    batch: int | None = None,
    chunk_points: Callable[[int, int], list[tuple[Recompute, int, int]]] | None = None,
) -> Plan:
    """Choose the recompute set and the chunk sizes for ``graph`` within ``budget`` bytes.

    ``chunk_plan(g)`` is the chunk planner for graph ``g`` (it raises :class:`OutOfMemoryError` when not
    even one example fits, :class:`BatchCouplingError` or :class:`UnsupportedOpError` when ``g`` cannot be
    chunked); for a recomputing graph it is called as ``chunk_plan(g, peak)``, with the whole-batch peak
    the simulation predicts for ``g`` (equal to the memory interpreter's); ``floor(g)`` is the
    fewest bytes ``g`` can run in (one example per chunk, or the whole batch when it cannot be chunked);
    ``points()`` is ``frontier(graph)``, for a caller that keeps it across budgets. ``batch``, when given,
    is the number of examples: with one, no graph can be chunked, and no chunk planning is tried for a
    recompute set that does not fit whole. ``chunk_points(n, usable)``, when given, is :func:`chunk_frontier`
    for chunks of ``n`` examples, each set with the peak of the chunked run's first chunk its chunk's graph
    predicts and a bound on a later chunk's, and its sets just above ``usable`` bytes repaired to fit it:
    where the cheapest plan recomputes in chunks, the sets chosen for a chunk are tried too.
    Returns the plain chunk plan when no recomputation is needed or it is the cheapest; else a
    :class:`RematPlan`. Raises the chunk planner's error, naming the smallest budget some schedule fits,
    when none fits.
    """
    base_flops, base_calls, device = graph_flops(graph), graph_calls(graph), graph.device
    usable = margin.usable(budget)
    first_error: Exception | None = None
    points = frontier(graph) if points is None else points()
    # A graph that cannot be split (one example, or ops coupling the batch: found when the chunk planner
    # says so) cannot be split once it recomputes either: then only the sets that fit whole are planned.
    whole_only = batch == 1
    # Each candidate (the plain graph, then every recompute set) has a least step cost it can plan to: in
    # the fewest chunks its whole-batch peak allows (``_fewest_chunks``). Candidates are planned in the order
    # of that bound, and the search ends where no bound left can beat the cheapest plan found (the first in
    # frontier order among equal ones): the chunked forms of sets that cannot win (a split and its chunk
    # bodies costed) are never built, and the plan is the cheapest of all, as if every one were sized.
    fixed = _held_by_every_chunk(graph)
    candidates: list[tuple[float, int, Recompute]] = []
    for index, p in enumerate(points):
        if index == 0 and batch == 1 and p.peak_bytes > usable:
            continue  # one example that does not fit whole cannot be split: asked only for its error, below
        fewest = _fewest_chunks(p.peak_bytes - fixed, usable - fixed, batch)
        if fewest is not None or index == 0:  # the plain graph's planner is asked for its error, too
            calls = base_calls + p.extra_calls
            candidates.append((step_cost(base_flops + p.extra_flops, calls, fewest or 1, device), index, p))
    candidates.sort(key=lambda c: c[:2])
    best: tuple[float, int, Plan] | None = None
    for bound, index, p in candidates:
        if best is not None and (bound, index) >= best[:2]:
            break  # no candidate left can plan cheaper than the best so far
        if index > 0 and whole_only and p.peak_bytes > usable:
            continue
        try:
            plan = chunk_plan(graph) if index == 0 else chunk_plan(p.graph, p.peak_bytes)
        except _CANNOT as e:
            if index == 0:
                first_error = e
            elif p.peak_bytes <= usable and floor(p.graph) <= usable:
                raise  # it fits: its planner should not have failed
            # (A shard runs through the split graphs even whole, which may hold more than the whole graph:
            # a set whose whole-batch peak fits may still be out of a shard's reach. Others may not be.)
            whole_only = whole_only or isinstance(e, (BatchCouplingError, UnsupportedOpError))
            continue
        if index == 0 and not plan.chunked:
            return plan
        score = step_cost(base_flops + p.extra_flops, base_calls + p.extra_calls, len(plan.chunk_sizes), device)
        if best is None or (score, index) < best[:2]:
            if index > 0:
                plan = RematPlan(**attrs.asdict(plan, recurse=False), recompute=p, base_flops=base_flops)
            best = (score, index, plan)
    if best is not None:
        if len(graph.eqns) <= BIG:
            best = _repairs(best, points, usable, chunk_plan, base_flops, base_calls, device)
            if chunk_points is not None:
                best = _for_chunks(best, chunk_points, usable, chunk_plan, base_flops, base_calls, device)
            if best[1] > 0:
                best = _polished(best, usable, chunk_plan, base_flops, base_calls, device)
        return best[2]
    # Below every set of the frontier: the least-peak one, deeper (tried only here, where nothing else fits,
    # as it simulates many sets).
    deeper = _least_peak(points, len(graph.eqns))
    if deeper is not None:
        if not (whole_only and deeper.peak_bytes > usable):
            try:
                plan = chunk_plan(deeper.graph, deeper.peak_bytes)
            except _CANNOT:
                pass
            else:
                plan = RematPlan(**attrs.asdict(plan, recurse=False), recompute=deeper, base_flops=base_flops)
                score = step_cost(base_flops + deeper.extra_flops, base_calls + deeper.extra_calls,
                                  len(plan.chunk_sizes), device)
                best = (score, len(points), plan)
                if len(graph.eqns) <= BIG:
                    best = _polished(best, usable, chunk_plan, base_flops, base_calls, device)
                return best[2]
        points = [*points, deeper]
    if first_error is None:
        try:
            chunk_plan(graph)
        except _CANNOT as e:
            first_error = e
    assert first_error is not None
    floors = [p.peak_bytes if whole_only else floor(p.graph) for p in points]
    least = min(range(len(points)), key=floors.__getitem__)
    if least > 0 and floors[least] <= usable and not whole_only:
        # A set the bound on its fewest chunks left out (a chunk held less than its share of the whole-batch
        # peak, whose schedule differs), though one example per chunk fits: the budget this error would
        # name. Planned, so that the named budget plans.
        try:
            plan = chunk_plan(points[least].graph, points[least].peak_bytes)
        except _CANNOT:
            pass
        else:
            return RematPlan(**attrs.asdict(plan, recurse=False), recompute=points[least], base_flops=base_flops)
    smallest = margin.smallest_budget(floors[least])
    error = type(first_error)(
        f"{first_error} Recomputing forward values in the backward does not fit either: the smallest budget any "
        f"schedule fits is {format_bytes(bytes_ceiling(smallest))} (recomputing {points[least].dropped} op(s))."
    )
    # What callers read off the planner's error carries over (``chunk_local_result``: one-line mode then
    # computes only what a mid-step read needs, as it does without recomputation).
    raise error.copy_from(first_error, smallest_budget=smallest) from first_error


# How many kept candidates the descent below the frontier drops, at most (one per step; each step simulates
# the set without each kept candidate in turn).
_DESCENT_STEPS = 4


# The least gain of peak (a fraction of it) the descent takes for making every value the backward never reads
# again: it recomputes them all where they are needed (BERT at 8 x 256: 0.03% less peak for 35% more FLOPs).
_LOOSE_GAIN = 0.01


def _descended(p: Recompute) -> Recompute | None:
    """``p`` with kept candidates dropped one at a time, each the one whose drop lowers the peak most, while
    that lowers it (None when none does; only those live at the peak are simulated, as no other drop can
    lower it: BART at 8 x 512 keeps 20-39 candidates in the sets it descends, 0-29 live at their peaks).
    The frontier's families keep checkpoints by segment, by kind or by the dynamic program's coarse memory
    model; at its least peak, a checkpoint or two more can often go (a transformer's: one per layer, as
    per-layer checkpointing keeps, not two in some layers).

    First, the values the backward never reads are made again wherever a recomputation needs them
    (:data:`~stagetorch.transforms.remat.NOT_HELD`), where that lowers the peak by ``_LOOSE_GAIN`` at least: the
    frontier's sets hold them from the recomputation that made them to the next that reads them, which in a
    two-level set is the backward of the segment before, while this one's runs (OPT's q, k, v and fc1
    outputs: 0.6 MiB of its least two-level set's 4.7 MiB at 8 layers x 512 tokens).

    Before that, the same set with what an autograd node reads recomputed before the node's first equation
    (``remat(hoist=True)``, as checkpointing recomputes a layer before its backward), where its peak is
    lower: there, a Linear's recomputed input is not made beside the input gradient its node made first
    (OPT at 8 x 512: 4.24 -> 4.15 MiB). (The frontier holds its sets hoisted where that is lower too, beside
    the others: hoisting every set instead cost VNet at a third of its peak 1.10x -> 1.85x its FLOPs.)"""
    sim = p.sim
    if sim is None:
        return None
    start = p
    if not sim.hoist:
        hoisted = point(hoisted_of(sim), p.keep, p.transient)
        if hoisted.peak_bytes < p.peak_bytes:
            p, sim = hoisted, hoisted.sim
    loose = point(sim, p.keep, {**dict.fromkeys(sim.cands.recomputable - set(sim.cands.roots), NOT_HELD),
                                 **p.transient})
    if loose.peak_bytes < (1 - _LOOSE_GAIN) * p.peak_bytes:
        p = loose
    nbytes = storage_bytes(sim)
    for _ in range(_DESCENT_STEPS):
        live = live_at_peak(p)  # only these can lower the peak: the others are not simulated
        order = [r for r in sim.cands.roots if r in p.keep and r in live]
        moves: dict[int, Recompute] = {}
        lowest = p.peak_bytes
        # The largest first: a drop lowers the peak by at most its storage's bytes, so once one has lowered
        # it further than the next could, the rest cannot be the lowest.
        for i in sorted(range(len(order)), key=lambda i: -nbytes[order[i]]):
            if p.peak_bytes - nbytes[order[i]] > lowest:
                break
            moves[i] = q = point(sim, p.keep - {order[i]}, p.transient)
            lowest = min(lowest, q.peak_bytes)
        best = min((moves[i] for i in sorted(moves)), key=lambda q: (q.peak_bytes, q.extra_flops), default=None)
        if best is None or best.peak_bytes >= p.peak_bytes:
            break
        p = best
    return None if p is start else p


# The sets near the least peak the search below the frontier also starts from: at most this many, those within
# this factor of the frontier's least peak, on graphs of up to this many equations (each start descends and
# repairs: 1-2 s of simulation on a transformer of 1,500 equations; T5 of 2,500 spent 6 s finding nothing).
_NEAR_STARTS = 3
_NEAR = 1.25
_NEAR_EQNS = 2 * BIG


def _least_peak(points: list[Recompute], eqns: int) -> Recompute | None:
    """The set below the frontier that a budget under its least peak gets (None: none lower): the frontier's
    least-peak set, descended (:func:`_descended`), or, where one costs fewer FLOPs at a peak no higher, one
    of the few sets just above it descended, repaired to that peak (:func:`repaired_to`) and descended again. The
    frontier's least-peak set is often a two-level one that recomputes much to save little beside a
    per-layer one: BERT at 8 layers x 256 tokens, 0.9% of peak for 8% of a forward more (the per-layer set,
    repaired where its peak is, is 1% lower at one forward); BART at 8 x 512, a set of 0.32 forwards repairs
    to a peak below the two-level set's 1.15 forwards at 0.87. Kept on the least-peak set, for the next
    budget below the same frontier (the error's smallest budget, then that budget)."""
    least = min(points, key=lambda p: p.peak_bytes)
    memo = least.__dict__.get("_below")
    if memo is not None and memo[0] is points[0]:
        return memo[1]
    best = _below(least, points, eqns)
    least._below = (points[0], best)
    return best


def _below(least: Recompute, points: list[Recompute], eqns: int) -> Recompute | None:
    best = _descended(least)
    if eqns > _NEAR_EQNS:
        return best
    floor = best or least
    near = sorted((p for p in points if p is not least and p.sim is not None
                   and p.peak_bytes <= _NEAR * least.peak_bytes), key=lambda p: p.peak_bytes)
    for p in near[:_NEAR_STARTS]:
        q = _descended(p) or p
        if q.extra_flops >= floor.extra_flops:
            continue  # the repair and the descent only add FLOPs
        q = repaired_to(q, floor.peak_bytes, floor.extra_flops)
        if q is None:
            continue
        q = _descended(q) or q
        cheaper = (q.extra_flops, q.peak_bytes) < (floor.extra_flops, floor.peak_bytes)
        if cheaper and q.peak_bytes <= floor.peak_bytes:
            best = floor = q
    return best


# How many times the polish goes over a winning set's dropped candidates (it stops early when a pass keeps none).
_POLISH_PASSES = 3


def _polish(p: Recompute, target: int, cost: Callable[[Recompute], float]) -> Recompute:
    """``p`` with dropped candidates kept again, or (those recomputed for their own segment again) held
    once recomputed, where that lowers ``cost`` and its peak stays within ``target`` bytes: first the move
    that lowers it most (often keeping one whose recomputation made the peak, so that keeping it leaves room
    for more), then one at a time, the dearest to recompute for their bytes first, in passes until one
    changes nothing. (The frontier's families drop whole kinds of values or whole segments; a set that fits
    a budget often drops a value that is not live at its peak.)"""
    sim = p.sim
    if sim is None:
        return p
    order = sorted((r for r in sim.cands.roots if r not in p.keep), key=lambda r: -sim.density[r])

    def moves(q: Recompute, r: Var, held: bool = True) -> Iterator[Recompute]:
        if r in q.keep:
            return
        rest = {v: s for v, s in q.transient.items() if v != r}
        yield point(sim, q.keep | {r}, rest)
        if held and r in q.transient:
            yield point(sim, q.keep, rest)

    def key(q: Recompute) -> tuple[float, int]:
        return cost(q), q.peak_bytes

    fits = [q for r in order for q in moves(p, r, held=False) if q.peak_bytes <= target and key(q) < key(p)]
    if not fits:
        return p
    p = min(fits, key=key)
    for _ in range(_POLISH_PASSES):
        better = False
        for r in order:
            for q in moves(p, r):
                if q.peak_bytes <= target and key(q) < key(p):
                    p, better = q, True
                    break
        if not better:
            break
    return p


def _repairs(best: tuple[float, int, Plan], points: list[Recompute], usable: int, chunk_plan: Callable[..., Plan],
             base_flops: int, base_calls: int, device: torch.device) -> tuple[float, int, Plan]:
    """``best``, or a plan that runs whole within ``usable`` bytes at a lower step cost: a set of the
    frontier's just above ``usable`` that costs less than ``best``, repaired (:func:`repaired_to`)."""
    above = [p for p in points[1:] if p.peak_bytes > usable and p.sim is not None]
    for p in reversed(above[-REPAIR_STARTS:]):
        if step_cost(base_flops + p.extra_flops, base_calls + p.extra_calls, 1, device) >= best[0]:
            continue  # a repair only adds FLOPs
        q = repaired_to(p, usable)
        if q is None or step_cost(base_flops + q.extra_flops, base_calls + q.extra_calls, 1, device) >= best[0]:
            continue
        sized = _sized(q, chunk_plan, base_flops, base_calls, device)
        if sized is not None and sized[0] < best[0]:
            best = (sized[0], len(points), sized[1])
    return best


def _sized(q: Recompute, chunk_plan: Callable[..., Plan], base_flops: int, base_calls: int,
           device: torch.device) -> tuple[float, RematPlan] | None:
    """``q``'s graph in the chunks that fit its whole-batch peak, with the step's cost in them (None when no
    chunk size fits)."""
    try:
        plan = chunk_plan(q.graph, q.peak_bytes)
    except _CANNOT:
        return None
    score = step_cost(base_flops + q.extra_flops, base_calls + q.extra_calls, len(plan.chunk_sizes), device)
    return score, RematPlan(**attrs.asdict(plan, recurse=False), recompute=q, base_flops=base_flops)


def _polished(best: tuple[float, int, Plan], usable: int, chunk_plan: Callable[..., Plan], base_flops: int,
              base_calls: int, device: torch.device) -> tuple[float, int, Plan]:
    """The winning plan with its recompute set polished (:func:`_polish`): within the usable budget when it
    runs whole, else within its own whole-batch peak (its chunks are then sized again); ``best`` itself
    when that plans no cheaper."""
    score, index, plan = best
    assert isinstance(plan, RematPlan) and plan.recompute is not None
    p, chunks = plan.recompute, len(plan.chunk_sizes)
    q = _polish(p, usable if chunks == 1 else p.peak_bytes,
                lambda r: step_cost(r.extra_flops, r.extra_calls, chunks, device))
    if q is p:
        return best
    sized = _sized(q, chunk_plan, base_flops, base_calls, device)
    if sized is None or sized[0] >= score:
        return best
    return sized[0], index, sized[1]


# The chunk frontier is tried where the cheapest plan recomputes in chunks more than this fraction of the
# step's FLOPs; of its sets, at most this many are sized in chunks.
_CHUNK_FRONTIER_MIN = 0.01
_CHUNK_TRIES = 4


def _for_chunks(best: tuple[float, int, Plan], chunk_points: Callable[[int, int], list[tuple[Recompute, int, int]]],
                usable: int, chunk_plan: Callable[..., Plan], base_flops: int, base_calls: int,
                device: torch.device) -> tuple[float, int, Plan]:
    """``best``, or a plan of a set chosen for chunks of its size (:func:`chunk_frontier`) that costs
    less: of those whose first chunk is predicted to fit, the cheapest first, those whose later chunks are
    bounded within ``usable`` too before the others (each predicted peak is the first chunk's; a later
    chunk holds the accumulators beside its own, and may not fit: trying the cheapest first spent the
    tries on those)."""
    score, _, plan = best
    if not (isinstance(plan, RematPlan) and plan.chunked and plan.extra_flops > _CHUNK_FRONTIER_MIN * base_flops):
        return best
    chunks = len(plan.chunk_sizes)
    sets = [(later > usable, step_cost(base_flops + q.extra_flops, base_calls + q.extra_calls, chunks, device), i, q)
            for i, (q, first, later) in enumerate(chunk_points(max(plan.chunk_sizes), usable)) if first <= usable]
    tries = 0
    for _, cost, _, q in sorted(sets, key=operator.itemgetter(0, 1, 2)):
        if tries >= _CHUNK_TRIES:
            break
        if cost >= best[0]:
            continue
        tries += 1
        sized = _sized(q, chunk_plan, base_flops, base_calls, device)
        if sized is not None and sized[0] < best[0]:
            best = (sized[0], best[1], sized[1])
    return best


def _held_by_every_chunk(graph: Graph) -> int:
    """Bytes a chunk of any size holds at its peak: the graph's inputs (they stay resident: parameters, the
    whole batch it is sliced from) and the gradients of its parameters, buffers and constants (accumulated
    across the chunks, so held whole while every chunk after the first runs)."""
    inputs = {v.root: v.root.owned_nbytes for v in graph.invars}
    grads = {v.root: v.root.owned_nbytes for i, v in graph.grads if graph.roles[i] != "arg"}
    return sum(inputs.values()) + sum(grads.values())


def _fewest_chunks(held: int, usable: int, batch: int | None) -> int | None:
    """The fewest chunks a graph can run in, without building its chunked form: at its peak over the whole
    ``batch`` it holds ``held`` bytes beyond what every chunk holds (:func:`_held_by_every_chunk`), and a
    chunk has ``usable`` bytes beside that (None: not even one example fits). A chunk of ``n`` examples holds
    at least ``n / batch`` of ``held``: it runs the same equations, so the same per-example values are live
    together, beside full results at least as large as what the whole batch holds of them
    (tests/planning/test_planning_time.py holds the bound on the seed models). An unknown batch, or one that fits
    whole: 1."""
    if batch is None or held <= usable:
        return 1
    largest = min(batch - 1, usable * batch // held)
    return -(-batch // largest) if largest >= 1 else None

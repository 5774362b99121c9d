"""The memory -> extra-compute frontier of recompute sets.

The forward is cut into a chain of segments at its narrow points, and a Rotor-style dynamic program picks, for a
range of budgets, which segments to keep and which to recompute from checkpoints; two-level sets recompute a
segment's values again for its own backward rather than hold them, and hold beside their checkpoints what is
dear to recompute for its bytes; Chen's segments by bytes, "keep only what matrix products, convolutions and
attention make" (recompute the cheap ops) and its opposite, and a greedy descent on small graphs fill in. Each
set is costed exactly by :mod:`~stagetorch.planning.remat_simulator`, and only sets that lower the peak for their
extra FLOPs survive (:func:`frontier`; per chunk size: :func:`chunk_frontier`, whose sets just above a bound are
repaired to it by :func:`repaired_to`).

It knows graphs and the simulator. It must not know budgets' margins, chunk plans or step costs: choosing a
point for a budget is :mod:`~stagetorch.planning.remat_search`'s.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import numpy as np

from ..interpreters.flops import eqn_flops
from ..interpreters.memory import peak_bytes
from ..ir import Graph, Var, op_name
from ..registry import slot
from ..transforms.remat import Candidates, candidates
from .remat_simulator import Recompute, Simulator, best_move, hoisted_of, live_at_peak, point, segment_chain

__all__ = ["frontier", "chunk_frontier", "repaired_to", "block_checkpoints", "BIG", "REPAIR_STARTS"]



def _two_level(segments: list, every: int, deep: bool, tail: float = 0.0) -> tuple[frozenset[Var], dict[Var, int]]:
    """Checkpoints at every ``every``-th segment end; the other segment ends are recomputed once and held
    (or, ``deep``, recomputed again for their own segment too), and every segment's inner values are
    recomputed for their own segment only: one segment's values and a few ends held at a time. The last
    segments, up to a ``tail`` fraction of the bytes, are kept (the backward needs them first, before the
    held ends pile up)."""
    keep: set[Var] = set()
    transient: dict[Var, int] = {}
    ends, acc = 0, 0
    total = sum(s[2] for s in segments)
    kept_from = len(segments)
    while kept_from > 0 and acc + segments[kept_from - 1][2] <= tail * total:
        kept_from -= 1
        acc += segments[kept_from][2]
    for i, (roots, outs, *_) in enumerate(segments):
        ends += bool(outs)
        for r in roots:
            if i >= kept_from or (r in outs and ends % every == 0):
                keep.add(r)
            elif r not in outs or deep:
                transient[r] = i
    return frozenset(keep), transient


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


# A module path's numbered child: ``model.encoder.layer.3`` of ``model.encoder.layer.3.attention.self``, and the
# child of that block an equation ran in (``attention``), if any.
_NUMBERED = re.compile(r"^(.*?\.\d+)(?:\.([^.]+))?")


# How many ops on from a block's end that the backward does not read its per-block set looks for candidates.
_END_STEPS = 4


def _attends(prim: object) -> bool:
    """Whether ``prim`` is attention: an SDPA kernel or a softmax (an eager attention's weights)."""
    name = op_name(prim)
    return "attention" in name or "softmax" in name


def block_checkpoints(graph: Graph, cands: Candidates) -> list[frozenset[Var]]:
    """Checkpoints at the ends of the numbered children of a module (a ``ModuleList`` of layers): the values
    made in one and read by the forward outside it, what per-layer checkpointing
    (``gradient_checkpointing_enable()``) keeps; once with the candidates made outside every such block
    (embeddings, a head) kept, once with them dropped. None when the forward has fewer than two blocks.
    (The chain's cuts and the dynamic program's coarse memory model can miss them: BERT's least set
    recomputed 54% extra FLOPs where the per-layer one recomputes 34% at a lower peak.)

    Then the same with the ends of each block's attention sub-blocks kept too (the children of a block that
    run an attention kernel or a softmax: ``self_attn``, ``encoder_attn``): per-layer checkpointing
    recomputes a layer's first attention again to rebuild the input of its second (a decoder layer's
    cross-attention) and holds it, mask included, through the second's backward; with the first's output
    kept, each attention is recomputed just before its own backward (BART, one example of 96 tokens:
    1.04x checkpointing's peak for the per-layer set)."""
    eqns = graph.eqns[: cands.boundary]
    block: list[str | None] = []
    children: list[str | None] = []
    for e in eqns:
        m = _NUMBERED.match(e.source.module or "")
        block.append(m.group(1) if m else None)
        children.append(m.group(2) if m else None)
    # An equation outside every module between two of one block belongs to it (a function a layer calls, as
    # Llama's apply_rotary_pos_emb: its ops carry no module path of the layer).
    before: str | None = None
    for i, b in enumerate(block):
        if b is not None:
            before = b
        elif before is not None:
            after = next((c for c in block[i + 1:] if c is not None), None)
            if after == before:
                block[i] = before
    made_in: dict[Var, str | None] = {}
    made_at: dict[Var, int] = {}
    last: dict[tuple[str, str], int] = {}  # each attention sub-block's last equation
    attending: set[tuple[str, str]] = set()
    readers: dict[Var, list[int]] = {}
    for i, (e, b, child) in enumerate(zip(eqns, block, children)):
        if b is not None and child is not None:
            last[b, child] = i
            if _attends(e.prim):
                attending.add((b, child))
        for v in e.invars:
            readers.setdefault(v.root, []).append(i)
        for v in e.outvars:
            if v is not None:
                made_in.setdefault(v.root, b)
                made_at.setdefault(v.root, i)
    if len({b for b in block if b is not None}) < 2:
        return []
    ends = set()
    for e, b in zip(eqns, block):
        for v in e.invars:
            where = made_in.get(v.root)
            if where is not None and where != b:
                ends.add(v.root)
    roots = set(cands.roots)
    # An end the backward does not read is no candidate: the candidates made from it, a few ops on, are kept
    # instead (Llama's layer output, read by the next layer's RMSNorm through a float32 copy: without them
    # the set kept no boundary between layers and recomputed every layer at once, 1.27x checkpointing's peak).
    kept = set()
    for r in ends:
        front = {r}
        for _ in range(_END_STEPS):
            if not front:
                break
            nxt = set()
            for f in front:
                if f in roots:
                    kept.add(f)
                    continue
                for i in readers.get(f, ()):
                    nxt.update(o.root for o in eqns[i].outvars if o is not None)
            front = nxt
    kept = frozenset(kept)
    outside = frozenset(r for r in cands.roots if made_in.get(r) is None)
    out = [kept, kept | outside]
    # An attention sub-block's output: the first candidate its block makes from its last equation on (its own
    # output where the backward reads it, else the residual sum or the norm after it).
    attention = set()
    for b, child in attending:
        after = [r for r in cands.roots if made_in.get(r) == b and made_at[r] >= last[b, child]]
        if after:
            attention.add(min(after, key=made_at.__getitem__))
    if attention - kept:
        out += [kept | attention, kept | attention | outside]
    return out


# How many "dear to recompute" sets the two-level tries hold beside their checkpoints.
_DEAR_LEVELS = 6


def _dear(sim: Simulator, levels: int) -> list[frozenset[Var]]:
    """Sets of candidates that are dear to recompute for the bytes they hold: the empty set, then those
    whose op does more than a threshold of FLOPs per byte it makes, for up to ``levels`` thresholds spread
    over the distinct costs (the dearest first)."""
    cands, density = sim.cands, sim.density
    costs = sorted(set(density.values()))[:-1]  # above the dearest cost nothing is held
    picks = [costs[round(i * (len(costs) - 1) / max(levels - 1, 1))] for i in range(levels)] if costs else []
    out = [frozenset()]
    for tau in sorted(set(picks), reverse=True):
        out.append(frozenset(r for r in cands.roots if density[r] > tau))
    return out


# Graphs with at most this many candidates also get the greedy descent (its cost grows as the square).
_GREEDY_MAX = 48


# ... and at most this many, also the swaps (drop one candidate, keep another) once no drop helps.
_SWAP_MAX = 16


def _greedy(sim: Simulator, start: Recompute, per_flop: bool = True) -> list[Recompute]:
    """From keeping everything, drop one more candidate at a time: the one that lowers the peak most per
    FLOP it adds (a drop that lowers it for free first), or most (``per_flop`` false); on small graphs,
    when no drop lowers the peak, a swap may. Every set tried on the way is a point."""
    roots = sim.cands.roots  # in graph order, so that ties break the same way every time
    out, current = [], start
    while True:
        moves = [point(sim, current.keep - {r}) for r in roots if r in current.keep]
        best = best_move(current, moves, per_flop)
        if best is None and len(roots) <= _SWAP_MAX:
            dropped = [r for r in roots if r not in current.keep]
            swaps = [point(sim, current.keep - {r} | {s}) for r in roots if r in current.keep for s in dropped]
            moves += swaps
            best = best_move(current, moves, False)
        out += moves
        if best is None:
            return out
        current = best


# The dynamic program's resolution: segments (consecutive ones are merged beyond this) and memory steps.
_DP_SEGMENTS = 32
_DP_STEPS = 128
# How many activation budgets it is solved for (from one segment's bytes to all of them; 3x on small graphs).
_DP_BUDGETS = 8


def _coarsen(segments: list, most: int) -> list:
    """Merge consecutive segments into at most ``most`` of about equal bytes (the last one's outputs end each)."""
    if len(segments) <= most:
        return segments
    total = sum(s[2] for s in segments)
    out: list = []
    group: list = []
    for s in segments:
        group.append(s)
        if sum(g[2] for g in group) * most >= total or s is segments[-1]:
            out.append(([r for g in group for r in g[0]], s[1], sum(g[2] for g in group), s[3],
                        sum(g[4] for g in group), sum(g[4] for g in group[:-1]) + s[5]))
            group = []
    return out


def _dynamic_program(segments: list, budget: int) -> frozenset[Var] | None:
    """Rotor's dynamic program over a chain of segments, for checkpoints held until the backward needs them:
    each segment is kept whole, or recomputed in a run of consecutive segments that starts after a
    checkpoint and ends with one (the run's last outputs, kept). While the backward goes through a run, the
    bytes kept before it plus the run's recomputed bytes must fit ``budget``; among the plans that fit,
    the one that recomputes the fewest FLOPs. Held bytes are counted in steps of ``budget / _DP_STEPS``
    (rounded). Returns the roots to keep (None when nothing fits)."""
    n = len(segments)
    step = max(budget / _DP_STEPS, 1.0)
    width = _DP_STEPS + 1
    cost = np.full((n + 1, width), np.inf)
    cost[0, 0] = 0.0
    # back[k, h]: where the best plan for the first k segments holding h steps came from: the first
    # segment j of the last run (or of the kept segment) and the steps held before it; kept[k, h]: whether
    # that segment was kept whole rather than recomputed.
    back_j = np.zeros((n + 1, width), dtype=np.int64)
    back_h = np.zeros((n + 1, width), dtype=np.int64)
    kept = np.zeros((n + 1, width), dtype=bool)
    levels = np.arange(width)
    for j in range(n):
        row = cost[j]
        if not np.isfinite(row).any():
            continue
        need, flops = 0, 0
        for k in range(j, n):
            need += segments[k][2]
            top = int((budget - need) // step)  # the most steps held before the run that still fit
            if top < 0:
                break
            # The run recomputes its segments but not the ops that make its last outputs (kept).
            choices = [(flops + segments[k][5], round(segments[k][3] / step), False)]
            flops += segments[k][4]
            if k == j:
                choices.append((0, round(need / step), True))
            for extra, add, whole in choices:
                hi = min(top, width - 1 - add)
                if hi < 0:
                    continue
                cand = row[: hi + 1] + extra
                target = cost[k + 1, add : add + hi + 1]
                better = cand < target
                if better.any():
                    target[better] = cand[better]
                    back_j[k + 1, add : add + hi + 1][better] = j
                    back_h[k + 1, add : add + hi + 1][better] = levels[: hi + 1][better]
                    kept[k + 1, add : add + hi + 1][better] = whole
    best = int(np.argmin(cost[n]))
    if not np.isfinite(cost[n, best]):
        return None
    keep: set[Var] = set()
    k, h = n, best
    while k > 0:
        j, hj = int(back_j[k, h]), int(back_h[k, h])
        keep.update(segments[j][0] if kept[k, h] else segments[k - 1][1])
        k, h = j, hj
    return frozenset(keep)


def frontier(graph: Graph) -> list[Recompute]:
    """The recompute sets worth considering, by increasing extra FLOPs and decreasing peak; the first keeps
    everything (``graph`` itself)."""
    cands = candidates(graph)
    if not cands.roots:
        return [Recompute(graph, cands, frozenset(), peak_bytes(graph), 0, (), graph)]
    sim = Simulator(graph, cands)
    everything = frozenset(cands.roots)
    # Keeping everything is the graph itself: the simulator's walk costs it as the memory interpreter does.
    full = Recompute(graph, cands, everything, sim.run(everything)[0], 0, (), graph, sim=sim)
    total = sum(cands.nbytes)
    # Chen's segments of halving sizes (quartering on big graphs, where the dynamic program fills between).
    small = len(cands.roots) <= _GREEDY_MAX
    sizes, size = [], float(total)
    while size >= min(cands.nbytes) and len(sizes) < 24:
        size /= 2 if small else 4
        sizes.append(size)
    # Keep what matrix products and convolutions make (recompute the cheap ops), or the opposite (their
    # outputs are recomputed from what the cheap ops kept: where a cheap op cannot be recomputed without
    # its input, that input is held anyway).
    expensive = _expensive(graph, cands)
    keeps = [*(_segments(cands, s) for s in sizes), expensive, everything - expensive, *block_checkpoints(graph, cands)]
    chain = segment_chain(sim)
    segments = _coarsen(chain, _DP_SEGMENTS)
    if len(segments) > 1:
        least = max(s[2] for s in segments)
        tries = _DP_BUDGETS * (3 if small else 1)
        for i in range(tries):
            keeps.append(_dynamic_program(segments, int(least * (total / least) ** (i / (tries - 1)))))
    keeps = [k for k in dict.fromkeys(keeps) if k is not None and k != full.keep]
    points = [full] + [point(sim, k) for k in keeps]
    # Two levels of recomputation, for peaks one level cannot reach: checkpoints every 1, 2, 3, 4, 6, 8...
    # segment ends (fewer tries on big graphs); besides them, hold what is dear to recompute for its bytes
    # (a bottleneck's narrow convolution output: its block is then rebuilt from it for a 1x1 convolution
    # and pointwise ops, not from the block's input).
    ends = sum(1 for s in chain if s[1])
    spacings = sorted({int(1.5 ** i) for i in range(32) if int(1.5 ** i) <= ends})
    if not small:
        spacings = spacings[:: max(1, len(spacings) // 3)]
    for dear in _dear(sim, _DEAR_LEVELS):
        for every in spacings:
            for deep in (False, True) if small else (False,):
                for tail in (0.0, 0.125, 0.25) if small and not dear else (0.0,):
                    keep, transient = _two_level(chain, every, deep, tail)
                    points.append(point(sim, keep | dear, {r: s for r, s in transient.items() if r not in dear}))
    if len(cands.roots) <= _GREEDY_MAX:
        points += _greedy(sim, full)
    if len(cands.roots) <= _SWAP_MAX:
        points += _greedy(sim, full, per_flop=False)
    out = _pareto(full, points)
    out = _pareto(full, out + _bridges(sim, out))
    # Each set, too, with what an autograd node reads recomputed before the node's first equation
    # (remat(hoist=True)), where that lowers its peak: the same FLOPs, so it replaces the set on the frontier.
    hoisted = hoisted_of(sim)
    lower = [q for p in out[1:] if (q := point(hoisted, p.keep, p.transient)).peak_bytes < p.peak_bytes]
    return _pareto(full, out + lower)


def chunk_frontier(whole: Recompute, body: Graph, vars: Mapping[Var, Var], fit: int | None = None,
                   inner: list[Recompute] | None = None) -> list[tuple[Recompute, int]]:
    """Recompute sets of ``whole``'s graph chosen for a chunk: the frontier of ``body``, the graph that one
    chunk of it runs (``vars``: the chunk's var for each of the graph's), each set mapped back to the
    graph's candidates (those the chunk does not make are kept), with its peak on ``body``. A graph's peak
    is not affine in the batch (a kernel's workspace has a fixed part; which equation makes the peak moves),
    so a set the whole batch's frontier leaves out may be the cheapest that lets a chunk fit.

    ``fit``, when given, is the peak ``body`` must stay within: the frontier's sets just above it are also
    repaired to it on ``body`` (:func:`repaired_to`, looking a move ahead), after those of the frontier;
    ``inner``: ``frontier(body)``, for a caller that keeps it across budgets. (VNet
    at a third of its peak, in chunks of one: its 32-channel convolutions' backward holds a 46 MiB workspace,
    beside which no full-resolution value fits, and the frontier's sets either hold one across it or
    recompute the first stage for every segment: 1.29x the step. Recomputing the stage once, after it, and
    its first half again for its own backward: 1.17x; the first drop alone raises the peak, as the stage is
    then rebuilt whole before the strided convolution's backward.)"""
    sim = whole.sim
    if sim is None:
        return []
    inner = frontier(body) if inner is None else inner
    if len(inner) < 2 or inner[1].sim is None:
        return []
    roots = set(inner[1].sim.cands.roots)
    mapped = {r: vars[r].root for r in sim.cands.roots if r in vars and vars[r].root in roots}
    if len(set(mapped.values())) != len(mapped):
        return []  # not one candidate of the chunk's for each of the graph's
    sets = inner[1:]
    if fit is not None:
        above = [p for p in sets if p.peak_bytes > fit and p.sim is not None]
        repaired = (repaired_to(p, fit, lookahead=True) for p in reversed(above[-REPAIR_STARTS:]))
        sets = sets + [q for q in repaired if q is not None]
    out = []
    for p in sets:
        keep = frozenset(r for r in sim.cands.roots if r not in mapped or mapped[r] in p.keep)
        transient = {r: p.transient[b] for r, b in mapped.items() if b in p.transient}
        out.append((point(sim, keep, transient), p.peak_bytes))
    return out


def _pareto(full: Recompute, points: list[Recompute]) -> list[Recompute]:
    """``full`` and the points that lower the peak below every cheaper one, by increasing extra FLOPs."""
    out = [full]
    for p in sorted(points, key=lambda p: (p.extra_flops, p.peak_bytes)):
        if p is not full and p.peak_bytes < out[-1].peak_bytes:
            out.append(p)
    return out


# Neighbours on the frontier further apart than this fraction of the no-recompute peak get sets between them,
# in this many steps (the widest gaps first; on graphs of over BIG equations, where each set costs tens of
# milliseconds or more, half the steps, at most _BRIDGE_SETS sets, and only from sets that drop little).
_GAP = 0.02
_BRIDGE_STEPS = 8
_BRIDGE_SETS = 6
BIG = 1000


def _bridges(sim: Simulator, points: list[Recompute]) -> list[Recompute]:
    """Sets between neighbours of the frontier far apart in peak: the cheaper one, with a growing part of
    what only the dearer one drops also dropped, cheapest to recompute for its bytes first. (The frontier's
    families jump: a chain that keeps every matrix product's output, then one that drops a third of them;
    a budget between gets the first at 2x the chunks, or the second at +20% FLOPs, when dropping two would
    do.)"""
    cands = sim.cands
    big = len(sim.reads) > BIG
    steps, most = (_BRIDGE_STEPS // 2, _BRIDGE_SETS) if big else (_BRIDGE_STEPS, math.inf)
    density = sim.density
    order = {r: i for i, r in enumerate(cands.roots)}
    gaps = [(a, b) for a, b in zip(points, points[1:]) if a.peak_bytes - b.peak_bytes > _GAP * points[0].peak_bytes]
    if big:  # simulating a set costs with what it recomputes: only bridges from sets that drop a third or less
        gaps = [(a, b) for a, b in gaps if 3 * (len(cands.roots) - len(a.keep)) <= len(cands.roots)]
    gaps.sort(key=lambda ab: ab[1].peak_bytes - ab[0].peak_bytes)
    out: list[Recompute] = []
    for a, b in gaps:
        more = sorted(a.keep - b.keep, key=lambda r: (density[r], -order[r]))
        sizes = [r.owned_nbytes for r in more]
        total, acc, cut = sum(sizes), 0, []
        for i, size in enumerate(sizes):
            acc += size
            if len(cut) < steps - 1 and acc * steps >= total * (len(cut) + 1):
                cut.append(i + 1)
        merged = {**a.transient, **b.transient}
        for i in cut:
            if len(out) >= most:
                return out
            keep = a.keep - frozenset(more[:i])
            out.append(point(sim, keep, {r: s for r, s in merged.items() if r not in keep}))
    return out


# How many recompute steps the repair of a set above the budget takes at most, and from how many of the
# frontier's sets just above the budget it starts.
_REPAIR_STEPS = 24
REPAIR_STARTS = 2
# How many of the candidates live at the peak each repair step tries (the largest).
_REPAIR_MOVES = 12


def repaired_to(p: Recompute, target: int, most_flops: float = math.inf, lookahead: bool = False) -> Recompute | None:
    """``p`` brought within ``target`` bytes: one candidate live at its peak at a time (only those can lower
    it) is dropped (recomputed once and held, or recomputed for its own segment only) or, held once
    recomputed, recomputed for its own segment only: the move that lowers the peak most per FLOP it adds.
    None when no move lowers it, it takes more than ``_REPAIR_STEPS``, or it adds ``most_flops`` or more.
    (The frontier's sets just above a budget are often far cheaper than the first below it: a few more drops
    where the peak is, then the polish, cost less than the next family's whole step down.)

    ``lookahead``: a move that does not lower the peak is also tried followed by the best move from it (a
    drop whose recomputation makes a new peak elsewhere, which a second drop there removes)."""
    sim = p.sim
    if sim is None:
        return None
    for _ in range(_REPAIR_STEPS):
        if p.extra_flops >= most_flops:
            return None
        if p.peak_bytes <= target:
            return p
        moves = _repair_moves(p)
        if lookahead:
            moves += [q for m in moves if m.peak_bytes >= p.peak_bytes
                      if (q := best_move(m, _repair_moves(m), per_flop=True)) is not None]
        best = best_move(p, moves, per_flop=True)
        if best is None:
            return None
        p = best
    return p if p.peak_bytes <= target else None


def _repair_moves(p: Recompute) -> list[Recompute]:
    """The repair's moves from ``p`` (see :func:`repaired_to`), of its largest candidates live at its peak."""
    sim = p.sim
    assert sim is not None
    segment = sim.segment
    live = live_at_peak(p)
    moves = []
    # The largest first: a drop lowers the peak by at most its bytes.
    for r in sorted((r for r in sim.cands.roots if r in live), key=lambda r: -r.owned_nbytes)[:_REPAIR_MOVES]:
        if r in p.keep:
            moves.append(point(sim, p.keep - {r}, p.transient))
        if r not in p.transient and r in segment:
            moves.append(point(sim, p.keep - {r}, {**p.transient, r: segment[r]}))
    return moves

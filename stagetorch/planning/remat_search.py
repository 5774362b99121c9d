"""The joint planner: which forward values to recompute, and the chunk size, chosen together for a budget.

First the memory -> extra-compute frontier of recompute sets: the forward is cut into a chain of segments at
its narrow points, and a Rotor-style dynamic program picks, for a range of budgets, which segments to keep
and which to recompute from checkpoints; two-level sets recompute a segment's values again for its own
backward rather than hold them, and hold beside their checkpoints what is dear to recompute for its
bytes; Chen's segments by bytes, "keep only what matrix products, convolutions and attention make"
(recompute the cheap ops) and its opposite, and a greedy descent on small graphs fill in. Each set is
costed exactly by a simulator of the memory interpreter's walk over :func:`~stagetorch.transforms.remat.remat`'s
graph, and only sets that lower the peak for their extra FLOPs survive.
Keeping everything is always on the frontier, so a plan is never worse than no recomputation. Then, for
frontier points, the chunk planner sizes chunks for the recomputing graph, and the point with the lowest
predicted step cost wins. On graphs of up to ``_BIG`` equations the winner is then polished for its budget:
dropped values are kept again where the peak still fits and the cost falls.

It knows graphs, the remat pass, the FLOP and memory interpreters and the chunk planner's :class:`Plan`;
it runs nothing, and it builds no executable (the caller passes a function that plans chunks for a graph).
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
import re
from collections.abc import Callable, Iterator, Mapping

import attrs
import numpy as np
import torch

from ..devices.budget import bytes_ceiling, format_bytes
from ..errors import BatchCouplingError, OutOfMemoryError, UnsupportedOpError
from ..interpreters.flops import eqn_calls, eqn_flops, graph_calls, graph_flops
from ..interpreters.memory import Layouts, allocated, commit_cost, effect, peak_bytes
from ..ir import Graph, Var, op_name
from ..registry import slot
from ..transforms.remat import NOT_HELD, Candidates, candidates, node_spans, remat
from ..transforms.rng import METADATA_ONLY, SaveRngState, device_of, replayable
from ..transforms.schedule import adds_in_place, has_effect, is_random, steals
from .chunks import SAFETY_MARGIN, Plan

# What the chunk planner raises when a graph cannot run in chunks that fit: then only recomputation can help.
_CANNOT = (OutOfMemoryError, BatchCouplingError, UnsupportedOpError)

__all__ = ["Recompute", "frontier", "chunk_frontier", "RematPlan", "plan_joint", "CALL_FLOPS", "step_cost", "predicted_cost"]

# What one op call costs beyond its arithmetic, in FLOP-equivalents, by device type: the price of running the
# body once more per extra chunk. CPU: measured on a 2-core VM (docs/history/results-log.md, "1/3 of the no-recompute
# peak"), a chunk added 8-70 us per op call at ~50 GFLOP/s, as small-batch convolutions and an LSTM's
# per-step work do not shrink with the chunk (200,000 before: the planner chose 4-6 chunks where fewer with
# recomputation ran faster). An op's ``calls`` rule says how many kernels it runs (an LSTM layer: one per
# time step). CUDA: a kernel launch, ~5 us, at ~50 TFLOP/s; not measured yet.
CALL_FLOPS = {"cpu": 1_000_000, "cuda": 250_000_000}


class Recompute:
    """One recompute set: the roots kept (checkpoints), the dropped roots recomputed a second time rather
    than held (``transient``, by segment; see :func:`~stagetorch.transforms.remat.remat`), its predicted peak and the
    FLOPs and kernel calls its recomputation adds, and (built on first use) ``graph``, the program that
    recomputes the rest."""

    def __init__(self, source: Graph, cands: Candidates, keep: frozenset[Var], peak_bytes: int, extra_flops: int,
                 recomputed: tuple[str, ...], graph: Graph | None = None, transient: Mapping[Var, int] | None = None,
                 extra_calls: int = 0, sim: _Simulator | None = None):
        self.source, self.cands, self.keep, self.transient = source, cands, keep, dict(transient or {})
        self.peak_bytes, self.extra_flops, self.recomputed = peak_bytes, extra_flops, recomputed
        self.extra_calls = extra_calls
        self._graph = graph
        self.sim = sim  # what costed it (None: nothing to recompute), for sets near it

    @property
    def graph(self) -> Graph:
        if self._graph is None:
            self._graph = remat(self.source, self.keep, self.cands, self.transient, hoist=bool(self.sim and self.sim.hoist))
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

    Vars are numbered by ``index``; each recomputed copy (or backward var rebased onto one) gets a new id.
    """

    def __init__(self, graph: Graph, cands: Candidates, hoist: bool = False):
        self.graph, self.cands = graph, cands
        index: dict[Var, int] = {}
        for v in graph.vars():
            index.setdefault(v, len(index))
        self.index = index
        n = self.n = len(index)
        self.root = [0] * n
        self.base = [-1] * n
        # A gradient accumulation into its dying operand lives in that operand's storage (passes.steals).
        stolen = {v: x.root for v, x in steals(graph).items()}
        for v, i in index.items():
            self.root[i] = index[v.root]
            self.base[i] = -1 if v.base is None else index[v.base]
        for v in stolen:  # in program order: an operand's own storage is settled before its accumulation's
            self.root[index[v]] = self.root[index[stolen[v]]]
        if stolen:
            self.root = [self.root[r] for r in self.root]
        self.reads: list[tuple[int, ...]] = []
        self.outs: list[tuple[int, ...]] = []
        self.sizes: list[tuple[int, ...]] = []
        self.workspace: list[int] = []
        layouts = Layouts(graph)
        for e in graph.eqns:
            self.reads.append(tuple(index[v] for v in e.invars))
            eff = effect(e, layouts=layouts)
            outs = [(j, v) for j, v in enumerate(e.outvars) if v is not None]
            self.outs.append(tuple(index[v] for _, v in outs))
            self.sizes.append(tuple(allocated(eff.outputs.get(j, v.root.owned_nbytes), v.root.aval.device) for j, v in outs))
            self.workspace.append(eff.workspace)
        self.effect = [has_effect(e) for e in graph.eqns]
        self.flops = [eqn_flops(e) for e in graph.eqns]
        self.calls = [eqn_calls(e) for e in graph.eqns]
        # A random forward equation that is recomputed gets its generator state saved before it (remat's
        # _saving_states): per such equation, the id of that state (past every var's) and its bytes. The
        # save's events have the index SAVE, an equation of no workspace, effect or FLOPs.
        self.state_of: dict[int, tuple[int, int]] = {}
        for k in range(cands.boundary):
            e = graph.eqns[k]
            if is_random(e) and replayable(e):
                aval = SaveRngState.of(device_of(e)).aval()
                self.state_of[k] = (n + len(self.state_of), allocated(aval.nbytes, aval.device))
        # A metadata-only forward equation (empty_like) is recomputed from a token of its first argument's
        # layout, of no bytes, when that argument is dropped (remat's _shaped_like): per such equation, the
        # id of that argument.
        self.shaped_like = {k: self.reads[k][0] for k in range(cands.boundary)
                            if getattr(graph.eqns[k].prim, "overloadpacket", None) in METADATA_ONLY
                            and graph.eqns[k].args and isinstance(graph.eqns[k].args[0], Var)}
        # A recomputed sum (its equation's source is the recomputation, which steals() treats as the backward's)
        # adds into a dying operand's storage where the built graph's copy of that operand is read by the sum
        # alone: per forward add.Tensor that may, the positions in its reads of the operands that may be taken
        # over, in steals()' order; _steal() checks the rest (the copy's readers and views) on each walk.
        self.add_steals: dict[int, tuple[int, ...]] = {}
        for k in range(cands.boundary):
            e = graph.eqns[k]
            if e.prim is not torch.ops.aten.add.Tensor or len(e.outvars) != 1 or e.outvars[0] is None:
                continue
            y = e.outvars[0]
            if y.base is not None:
                continue
            at = []
            for p in ((0, 1) if e.kwargs.get("alpha", 1) == 1 else (0,)):
                x, other = e.args[p], e.args[1 - p]
                if (type(x) is Var and x.base is None and x.aval == y.aval and x.owned_nbytes == x.aval.nbytes
                        and not (isinstance(other, Var) and other.root is x) and adds_in_place(x, other, y)):
                    at.append(self.reads[k].index(index[x]))
            if at:
                self.add_steals[k] = tuple(at)
        # An optimizer stepped last is the program's commit (costing.commit_cost), the same tail in every
        # graph remat builds (it reads no forward value): before its first equation, its workspace is
        # allocated and held to the end, with the tensors a first step keeps (filled at their own equations);
        # its temporaries take no storage of their own. None: no commit.
        self.commit: tuple[int, int, frozenset[int], dict[int, int]] | None = None
        self._commit_from_end = 0
        commit = commit_cost(graph)
        if commit is not None:
            by_id = list(index)
            early = {self.root[index[v]]: allocated(by_id[self.root[index[v]]].owned_nbytes, v.aval.device)
                     for v in commit.early}
            self.commit = (commit.eqn, sum(allocated(b, d) for b, d in commit.spaces),
                           frozenset(index[v] for v in commit.placed), early)
        self.SAVE = len(graph.eqns)
        self.workspace.append(0)
        self.effect.append(False)
        self.producer = [-1] * n
        for k in range(cands.boundary):
            for i in self.outs[k]:
                self.producer[i] = k
        self.inputs = {index[v.root] for v in graph.invars}
        self.resident = {index[v.root]: allocated(v.root.owned_nbytes, v.root.aval.device) for v in graph.invars}
        self.recomputable = {index[r] for r in cands.recomputable}
        self.kept = [index[v] for v in graph.outvars if isinstance(v, Var)] + [index[v] for _, v in graph.grads]
        self.names = [op_name(e.prim) for e in graph.eqns]
        self.out_bases = [tuple(self.base[o] for o in outs if self.base[o] >= 0) for outs in self.outs]
        # Events as run() lists them (see there), for the equations as they are.
        self.as_is = [(k, False, self.reads[k], self.outs[k], self.out_bases[k],
                       tuple(self.root[u] for u in self.reads[k]), tuple(zip((self.root[o] for o in self.outs[k]), self.sizes[k])))
                      for k in range(len(graph.eqns))]
        # Per backward equation: what it reads of the values a set may drop (most read none).
        self.cand_reads = [tuple(u for u in reads if self.root[u] in self.recomputable) for reads in self.reads]
        # What remat recomputes before each backward equation: what it reads, or, at the first equation of
        # an autograd node, what the node's equations read (remat.node_spans).
        self.ahead_reads = list(self.cand_reads)
        self.hoist = hoist  # as remat(hoist=)
        for i, j in (node_spans(graph, cands.boundary) if hoist else {}).items():
            self.ahead_reads[i] = self.cand_reads[i] + tuple(
                u for k in range(i + 1, j) for u in self.cand_reads[k] if self.producer[u] >= 0)
        # Per candidate: the FLOPs of the op that makes it, per byte it holds (how dear it is to recompute).
        self.density = {r: self.flops[self.producer[index[r]]] / max(n, 1) for r, n in zip(cands.roots, cands.nbytes)}
        self.vars = list(index)  # by id
        self._segment: dict[Var, int] | None = None

    @property
    def segment(self) -> dict[Var, int]:
        """Per candidate, the segment of the forward's chain (:func:`_chain`) it is in: the segment number a
        transient value is recomputed for."""
        if self._segment is None:
            self._segment = {r: i for i, s in enumerate(_chain(self)) for r in s[0]}
        return self._segment

    def run(self, keep: frozenset[Var], transient: Mapping[Var, int] | None = None,
            at_peak: set[Var] | None = None) -> tuple[int, int, tuple[str, ...], int]:
        """(peak bytes, extra FLOPs, recomputed op names, extra kernel calls) of ``remat(graph, keep,
        transient=transient)``. ``at_peak``, when given, gets the candidates whose storage (or its recomputed
        copy) is live at the peak: only dropping one of those can lower it."""
        base, reads_of, outs_of, producer, out_bases = self.base, self.reads, self.outs, self.producer, self.out_bases
        index = self.index
        drop = self.recomputable - {index[r] for r in keep}
        dropped = [r in drop for r in self.root]  # per var: does its storage get recomputed?
        segment = {index[r]: s for r, s in transient.items()} if transient else {}
        seg = [segment.get(r, -1) for r in self.root] if segment else None
        # Ids: a var's own index for the original, a new id >= n for each copy; per id, the storage it lives
        # in (a root's id) and the id of its base (-1: none).
        states, shaped_like = self.state_of, self.shaped_like
        store, base_id = list(self.root), list(base)
        store += [sid for sid, _ in states.values()]
        base_id += [-1] * len(states)
        saved: set[int] = set()  # the random equations a replay reads the state of
        sub: dict[int, int] = {}  # var -> the id of its copy that stands for it from here on
        origin: dict[int, int] = {}  # a copy's own storage id -> the var it copies

        def copy_of(o: int) -> int:
            b = base[o]
            b = sub.get(b, b) if b >= 0 else -1
            new = len(store)
            store.append(store[b] if b >= 0 else new)
            base_id.append(b)
            origin[new] = o
            return new

        # Events: (equation index, recomputed?, ids read, ids defined, the ids of their bases, the storages
        # read, and (storage, bytes) of what it defines).
        sizes = self.sizes
        as_is, cand_reads, ahead = self.as_is, self.cand_reads, self.ahead_reads
        events: list[tuple[int, bool, tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = as_is[: self.cands.boundary]
        subbed = sub.keys()

        def recompute(v: int, burst: list[int]) -> None:
            stack = [(producer[v], False)]
            while stack:
                k, ready = stack.pop()
                outs = outs_of[k]
                if not subbed.isdisjoint(outs):
                    continue
                if ready:
                    new = tuple(copy_of(o) for o in outs)
                    sub.update(zip(outs, new))
                    bases = tuple(base_id[o] for o in new if base_id[o] >= 0)
                    like = shaped_like.get(k, -1)
                    reads = tuple(sub.get(u, u) for u in reads_of[k] if u != like or not dropped[u])
                    if k in states:
                        reads += (states[k][0],)
                        saved.add(k)
                    events.append((k, True, reads, new, bases, tuple(store[u] for u in reads),
                                   tuple(zip((store[o] for o in new), sizes[k]))))
                    burst.append(k)
                    continue
                stack.append((k, True))
                like = shaped_like.get(k, -1)
                needs = [u for u in cand_reads[k] if dropped[u] and u not in sub and u != like]
                needs += [b for b in out_bases[k] if dropped[b] and b not in sub and producer[b] >= 0]
                stack.extend((producer[u], False) for u in reversed(needs))

        for k in range(self.cands.boundary, len(reads_of)):
            targets = [u for u in ahead[k] if dropped[u] and u not in sub] if ahead[k] else None
            if targets:
                burst: list[int] = []
                for u in targets:
                    if u not in sub:
                        recompute(u, burst)
                if seg is not None:
                    wanted = {seg[u] for u in targets} | {-1}
                    for j in burst:
                        if all(seg[o] not in wanted for o in outs_of[j]):
                            for o in outs_of[j]:
                                sub.pop(o, None)
            # An equation that reads no copy and makes no view of one is as it was (most of them).
            if sub and not (subbed.isdisjoint(reads_of[k]) and subbed.isdisjoint(out_bases[k])):
                reads = tuple(sub.get(u, u) for u in reads_of[k])
                # As remat's _rebase: onto a copied base only when the equation reads the copy's storage.
                read_storages = {store[u] for u in reads}
                outs = []
                for o in outs_of[k]:
                    if base[o] >= 0 and base[o] in sub and store[sub[base[o]]] in read_storages:
                        sub[o] = copy_of(o)
                    outs.append(sub.get(o, o))
                events.append((k, False, reads, tuple(outs), tuple(base_id[o] for o in outs if base_id[o] >= 0),
                               tuple(store[u] for u in reads), tuple(zip((store[o] for o in outs), sizes[k]))))
            else:
                events.append(as_is[k])
        if saved:
            forward = []
            for k in range(self.cands.boundary):
                if k in saved:
                    sid, size = states[k]
                    reads = self.reads[k]
                    forward.append((self.SAVE, False, reads, (sid,), (), tuple(self.root[u] for u in reads), ((sid, size),)))
                forward.append(as_is[k])
            events[: self.cands.boundary] = forward
        kept = [sub.get(v, v) for v in self.kept]
        # Dead-code elimination, as passes.dce does it.
        needed = set(kept)
        effect = self.effect
        live = [False] * len(events)
        for i in range(len(events) - 1, -1, -1):
            k, copy, reads, outs, bases, _, _ = events[i]
            # A recomputation has no effect (BatchNorm's is run without its running statistics).
            if (effect[k] and not copy) or not needed.isdisjoint(outs):
                live[i] = True
                needed.update(reads)
                needed.update(bases)
        events = [ev for ev, ok in zip(events, live) if ok]
        extra = [ev[0] for ev in events if ev[1]]
        names = tuple(self.names[k] for k in extra)
        steals = self.add_steals
        sums = [i for i, ev in enumerate(events) if ev[1] and ev[0] in steals] if steals and extra else None
        peak = self._peak(events, [store[v] for v in kept], at_peak, sums)
        if at_peak is not None:
            keys, n = list(at_peak), self.n
            at_peak.clear()
            for k in keys:
                o = k if k < n else origin.get(k, -1)
                v = self.vars[self.root[o]] if o >= 0 else None
                if v is not None and v in self.cands.recomputable:
                    at_peak.add(v)
        return peak, sum(self.flops[k] for k in extra), names, sum(self.calls[k] for k in extra)

    def _steal(self, events: list, sums: list[int], first: dict, last: dict) -> None:
        """Each recomputed sum of ``sums`` that the built graph adds into its operand's storage (as
        :func:`~stagetorch.transforms.schedule.steals` does on ``remat``'s graph, where a recomputation is the backward's:
        the operand is read by the sum alone, has no view and is not kept) lives in that storage: its own
        storage leaves ``first``, and the operand's is held to the sum's last read. A forward sum whose
        operand other forward equations read adds out of place; its recomputation, where they are not
        recomputed, in place."""
        into: dict[int, int] = {}  # a sum's storage -> the storage it adds into
        for i in sums:
            ev = events[i]
            for j in self.add_steals[ev[0]]:
                s = ev[5][j]
                # Read last here (so not kept, and read by no later event), once, and by nothing since it
                # was made, which nothing viewed.
                if last.get(s) != i or ev[5].count(s) != 1 or s not in first:
                    continue
                made = first[s][0]
                if sum(key == s for key, _ in events[made][6]) != 1 or any(
                        s in e[5] or any(key == s for key, _ in e[6]) for e in events[made + 1: i]):
                    continue
                into[ev[6][0][0]] = s
                break
        for t, s in into.items():  # in program order: a sum added into by a later one is settled first
            while s in into:
                s = into[s]
            last[s] = max(last[s], last.get(t, first[t][0]))
            del first[t]

    def _peak(self, events: list, kept: list[int], at_peak: set | None = None, sums: list[int] | None = None) -> int:
        """The memory interpreter's peak over ``events``: each storage from the event that first defines it
        until after the last that reads it (inputs always, the ``kept`` storages to the end), each event's
        workspace on top while it runs. ``at_peak``, when given, gets the storages live at the peak.
        ``sums``: the events of recomputed sums that may add into a dying operand (``add_steals``)."""
        workspace, resident = self.workspace, self.resident
        count = len(events)
        # The first definition of each storage (walking back, so the earliest stands) and its last read.
        first = {key: (i, size) for i in range(count - 1, -1, -1) for key, size in events[i][6]}
        last = {key: i for i, ev in enumerate(events) for key in ev[5]}
        for key in kept:
            last[key] = count
        if sums:
            self._steal(events, sums, first, last)
        # delta[i]: bytes allocated at event i less those freed after event i - 1.
        delta = [0] * (count + 2)
        if self.commit is not None:
            eqn, space, placed, early = self.commit
            # Its event: as many from the end in every set's walk (the tail recomputes nothing), found once.
            at = count - self._commit_from_end
            if not (0 <= at < count and events[at][0] == eqn and not events[at][1]):
                at = next(i for i in range(count - 1, -1, -1) if events[i][0] == eqn and not events[i][1])
                self._commit_from_end = count - at
            delta[at] += space
            delta[count] -= space
            for key in placed:
                first.pop(key, None)
            for key, size in early.items():
                if key not in resident and first.get(key, (-1,))[0] > at:
                    first[key] = (at, size)
        for key, (i, size) in first.items():
            if key not in resident:
                delta[i] += size
                delta[last.get(key, i) + 1] -= size
        held = sum(resident.values())
        during = map(operator.add, itertools.accumulate(delta[:count]), (workspace[ev[0]] for ev in events))
        if at_peak is None:
            return held + max(0, max(during, default=0))
        during = list(during)
        top = max(range(count), key=during.__getitem__, default=0)
        at_peak.clear()
        at_peak.update(key for key, (i, _) in first.items() if i <= top <= last.get(key, i) and key not in resident)
        return held + max(0, max(during, default=0))


def _point(sim: _Simulator, keep: frozenset[Var], transient: Mapping[Var, int] | None = None) -> Recompute:
    peak, extra, names, calls = sim.run(keep, transient)
    return Recompute(sim.graph, sim.cands, keep, peak, extra, names, transient=transient, extra_calls=calls, sim=sim)


def _hoisted(sim: _Simulator) -> _Simulator:
    """``sim``'s walk with ``hoist`` (as ``remat(hoist=True)``), built once per simulator: the frontier and
    every descent below it cost sets hoisted on the same one (building one is ~0.1 s at 1,500 equations)."""
    if sim.hoist:
        return sim
    hoisted = sim.__dict__.get("_hoisted")
    if hoisted is None:
        hoisted = sim._hoisted = _Simulator(sim.graph, sim.cands, hoist=True)
    return hoisted


def _storage_bytes(sim: _Simulator) -> dict[Var, int]:
    """Per candidate, the most bytes an equation defines of its storage (what dropping it can free at most).
    Built once per simulator."""
    out = sim.__dict__.get("_storage_bytes")
    if out is None:
        most: dict[int, int] = {}
        for outs, sizes in zip(sim.outs, sim.sizes):
            for o, size in zip(outs, sizes):
                r = sim.root[o]
                most[r] = max(most.get(r, 0), size)
        out = sim._storage_bytes = {r: most.get(sim.index[r], 0) for r in sim.cands.roots}
    return out


def _live_at_peak(p: Recompute) -> set[Var]:
    """The candidates whose storage (or its recomputed copy) is live at ``p``'s peak: only dropping one of
    those can lower it. One simulation, kept on ``p`` (the descent and the repair both ask)."""
    live = p.__dict__.get("_at_peak")
    if live is None:
        assert p.sim is not None
        live = set()
        p.sim.run(p.keep, p.transient, live)
        p._at_peak = live
    return live


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


# A module path's numbered child: ``model.encoder.layer.3`` of ``model.encoder.layer.3.attention.self``.
_NUMBERED = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def _blocks(graph: Graph, cands: Candidates) -> list[frozenset[Var]]:
    """Checkpoints at the ends of the numbered children of a module (a ``ModuleList`` of layers): the values
    made in one and read by the forward outside it, what per-layer checkpointing
    (``gradient_checkpointing_enable()``) keeps; once with the candidates made outside every such block
    (embeddings, a head) kept, once with them dropped. None when the forward has fewer than two blocks.
    (The chain's cuts and the dynamic program's coarse memory model can miss them: BERT's least set
    recomputed 54% extra FLOPs where the per-layer one recomputes 34% at a lower peak.)"""
    block: list[str | None] = []
    made_in: dict[Var, str | None] = {}
    for e in graph.eqns[: cands.boundary]:
        m = _NUMBERED.match(e.source.module or "")
        block.append(m.group(1) if m else None)
        for v in e.outvars:
            if v is not None:
                made_in.setdefault(v.root, block[-1])
    if len({b for b in block if b is not None}) < 2:
        return []
    ends = set()
    for e, b in zip(graph.eqns[: cands.boundary], block):
        for v in e.invars:
            where = made_in.get(v.root)
            if where is not None and where != b:
                ends.add(v.root)
    roots = set(cands.roots)
    kept = frozenset(r for r in ends if r in roots)
    outside = frozenset(r for r in cands.roots if made_in.get(r) is None)
    return [kept, kept | outside]


# How many "dear to recompute" sets the two-level tries hold beside their checkpoints.
_DEAR_LEVELS = 6


def _dear(sim: _Simulator, levels: int) -> list[frozenset[Var]]:
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


def _greedy(sim: _Simulator, start: Recompute, per_flop: bool = True) -> list[Recompute]:
    """From keeping everything, drop one more candidate at a time: the one that lowers the peak most per
    FLOP it adds (a drop that lowers it for free first), or most (``per_flop`` false); on small graphs,
    when no drop lowers the peak, a swap may. Every set tried on the way is a point."""
    roots = sim.cands.roots  # in graph order, so that ties break the same way every time
    out, current = [], start
    while True:
        moves = [_point(sim, current.keep - {r}) for r in roots if r in current.keep]
        best = _best_move(current, moves, per_flop)
        if best is None and len(roots) <= _SWAP_MAX:
            dropped = [r for r in roots if r not in current.keep]
            swaps = [_point(sim, current.keep - {r} | {s}) for r in roots if r in current.keep for s in dropped]
            moves += swaps
            best = _best_move(current, moves, False)
        out += moves
        if best is None:
            return out
        current = best


def _best_move(current: Recompute, moves: list[Recompute], per_flop: bool) -> Recompute | None:
    """The point among ``moves`` that lowers the peak most per FLOP it adds (or most, when not
    ``per_flop``, the fewest FLOPs breaking ties); None if none lowers it."""
    best, best_score = None, (0.0, 0)
    for p in moves:
        gain = current.peak_bytes - p.peak_bytes
        if gain <= 0:
            continue
        added = max(p.extra_flops - current.extra_flops, 0)
        score = (gain / (added + 1), 0) if per_flop else (gain, -added)
        if score > best_score:
            best, best_score = p, score
    return best


# How many of the longest-lived storages the chain's cuts may leave uncounted, at most.
_SKIP_MOST = 8


def _chain(sim: _Simulator) -> list[tuple[list[Var], list[Var], int, int, int, int]]:
    """The forward cut into a chain of segments at its narrow points: where a single storage made by the
    forward is read by it later (a block's output between residual blocks, a layer's output in a chain).

    Per segment, in forward order: (its candidates, those read by the forward after the segment (its
    outputs, the checkpoint that ends it), bytes of its candidates, bytes of its outputs, FLOPs of running
    its forward again, and of running it but the ops that make its outputs).
    """
    cands = sim.cands
    boundary = cands.boundary
    # Each forward storage's first definition and last forward read; inputs are always resident.
    made: dict[int, int] = {}
    last: dict[int, int] = {}
    for k in range(boundary):
        for u in sim.reads[k]:
            r = sim.root[u]
            if r in made:
                last[r] = k
        for o in sim.outs[k]:
            made.setdefault(sim.root[o], k)
    index = sim.index
    where = [made[index[r]] for r in cands.roots]
    cuts = _cuts(made, last, boundary, set())
    # A storage every layer reads (a causal mask, rotary tables made once) crosses every point between
    # layers: then one segment holds most of the bytes. Cut again without counting the longest-lived
    # storages (the fewest that break the chain up), held as the outputs of the segment that made them;
    # then, while twice as many again at least halve the largest segment, without those too (an
    # encoder-decoder: the encoder's output and the decoder's mask, read by every decoder layer, and the
    # decoder's inputs, made before the encoder, would otherwise leave a segment per stack, not per layer).
    nbytes = list(zip(where, cands.nbytes))
    if _largest_segment(cuts, nbytes) * 2 > sum(cands.nbytes):
        by_life = sorted(last, key=lambda r: made[r] - last[r])
        most, largest = 1, 0
        while most <= _SKIP_MOST:
            finer = _cuts(made, last, boundary, set(by_life[:most]))
            size = _largest_segment(finer, nbytes)
            if size * 2 <= (largest or sum(cands.nbytes)):
                cuts, largest = finer, size
            elif largest:
                break
            most *= 2
    segments: list[tuple[list[Var], list[Var], int, int, int, int]] = []
    start, pos = 0, 0
    for end in [*cuts, boundary]:
        roots, outs = [], []
        while pos < len(where) and where[pos] < end:
            r = cands.roots[pos]
            roots.append(r)
            if last.get(index[r], -1) >= end:
                outs.append(r)
            pos += 1
        if roots:
            ends = {index[r] for r in outs}
            flops = [(sim.flops[k], not ends.isdisjoint(sim.root[o] for o in sim.outs[k]))
                     for k in range(start, end) if not sim.effect[k]]
            segments.append((roots, outs, sum(r.owned_nbytes for r in roots), sum(r.owned_nbytes for r in outs),
                             sum(f for f, _ in flops), sum(f for f, end_op in flops if not end_op)))
            start = end
    return segments


def _cuts(made: dict[int, int], last: dict[int, int], boundary: int, skip: set[int]) -> list[int]:
    """The equations before which at most one forward storage (``skip`` not counted) made earlier is read
    at or after it, at the end of each stretch of such points."""
    delta = [0] * (boundary + 1)
    for r, k in last.items():
        if r not in skip:
            delta[made[r] + 1] += 1
            delta[k + 1] -= 1
    cuts, live = [], 0
    for t in range(1, boundary):
        live += delta[t]
        if live <= 1 and delta[t + 1] >= 0:
            cuts.append(t)
    return cuts


def _largest_segment(cuts: list[int], nbytes: list[tuple[int, int]]) -> int:
    """The most candidate bytes (``nbytes``: the equation that makes each, and its bytes) between consecutive
    cuts."""
    edges = [0, *cuts]
    sizes = [0] * (len(edges) + 1)
    for k, n in nbytes:
        sizes[bisect.bisect_right(edges, k)] += n
    return max(sizes)


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
    sim = _Simulator(graph, cands)
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
    keeps = [*(_segments(cands, s) for s in sizes), expensive, everything - expensive, *_blocks(graph, cands)]
    chain = _chain(sim)
    segments = _coarsen(chain, _DP_SEGMENTS)
    if len(segments) > 1:
        least = max(s[2] for s in segments)
        tries = _DP_BUDGETS * (3 if small else 1)
        for i in range(tries):
            keeps.append(_dynamic_program(segments, int(least * (total / least) ** (i / (tries - 1)))))
    keeps = [k for k in dict.fromkeys(keeps) if k is not None and k != full.keep]
    points = [full] + [_point(sim, k) for k in keeps]
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
                    points.append(_point(sim, keep | dear, {r: s for r, s in transient.items() if r not in dear}))
    if len(cands.roots) <= _GREEDY_MAX:
        points += _greedy(sim, full)
    if len(cands.roots) <= _SWAP_MAX:
        points += _greedy(sim, full, per_flop=False)
    out = _pareto(full, points)
    out = _pareto(full, out + _bridges(sim, out))
    # Each set, too, with what an autograd node reads recomputed before the node's first equation
    # (remat(hoist=True)), where that lowers its peak: the same FLOPs, so it replaces the set on the frontier.
    hoisted = _hoisted(sim)
    lower = [q for p in out[1:] if (q := _point(hoisted, p.keep, p.transient)).peak_bytes < p.peak_bytes]
    return _pareto(full, out + lower)


def chunk_frontier(whole: Recompute, body: Graph, vars: Mapping[Var, Var], fit: int | None = None,
                   inner: list[Recompute] | None = None) -> list[tuple[Recompute, int]]:
    """Recompute sets of ``whole``'s graph chosen for a chunk: the frontier of ``body``, the graph that one
    chunk of it runs (``vars``: the chunk's var for each of the graph's), each set mapped back to the
    graph's candidates (those the chunk does not make are kept), with its peak on ``body``. A graph's peak
    is not affine in the batch (a kernel's workspace has a fixed part; which equation makes the peak moves),
    so a set the whole batch's frontier leaves out may be the cheapest that lets a chunk fit.

    ``fit``, when given, is the peak ``body`` must stay within: the frontier's sets just above it are also
    repaired to it on ``body`` (:func:`_repaired`, looking a move ahead), after those of the frontier;
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
        repaired = (_repaired(p, fit, lookahead=True) for p in reversed(above[-_REPAIR_STARTS:]))
        sets = sets + [q for q in repaired if q is not None]
    out = []
    for p in sets:
        keep = frozenset(r for r in sim.cands.roots if r not in mapped or mapped[r] in p.keep)
        transient = {r: p.transient[b] for r, b in mapped.items() if b in p.transient}
        out.append((_point(sim, keep, transient), p.peak_bytes))
    return out


def _pareto(full: Recompute, points: list[Recompute]) -> list[Recompute]:
    """``full`` and the points that lower the peak below every cheaper one, by increasing extra FLOPs."""
    out = [full]
    for p in sorted(points, key=lambda p: (p.extra_flops, p.peak_bytes)):
        if p is not full and p.peak_bytes < out[-1].peak_bytes:
            out.append(p)
    return out


# Neighbours on the frontier further apart than this fraction of the no-recompute peak get sets between them,
# in this many steps (the widest gaps first; on graphs of over _BIG equations, where each set costs tens of
# milliseconds or more, half the steps, at most _BRIDGE_SETS sets, and only from sets that drop little).
_GAP = 0.02
_BRIDGE_STEPS = 8
_BRIDGE_SETS = 6
_BIG = 1000


def _bridges(sim: _Simulator, points: list[Recompute]) -> list[Recompute]:
    """Sets between neighbours of the frontier far apart in peak: the cheaper one, with a growing part of
    what only the dearer one drops also dropped, cheapest to recompute for its bytes first. (The frontier's
    families jump: a chain that keeps every matrix product's output, then one that drops a third of them;
    a budget between gets the first at 2x the chunks, or the second at +20% FLOPs, when dropping two would
    do.)"""
    cands = sim.cands
    big = len(sim.reads) > _BIG
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
            out.append(_point(sim, keep, {r: s for r, s in merged.items() if r not in keep}))
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
    usable = int(budget * (1 - SAFETY_MARGIN))
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
        if len(graph.eqns) <= _BIG:
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
                if len(graph.eqns) <= _BIG:
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
    smallest = int(floors[least] / (1 - SAFETY_MARGIN)) + 1
    error = type(first_error)(
        f"{first_error} Recomputing forward values in the backward does not fit either: the smallest budget any "
        f"schedule fits is {format_bytes(bytes_ceiling(smallest))} (recomputing {points[least].dropped} op(s))."
    )
    # What callers read off the planner's error carries over (``chunk_local_result``: one-line mode then
    # computes only what a mid-step read needs, as it does without recomputation).
    error.__dict__.update(vars(first_error))
    error.smallest_budget = smallest
    raise error from first_error


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
        hoisted = _point(_hoisted(sim), p.keep, p.transient)
        if hoisted.peak_bytes < p.peak_bytes:
            p, sim = hoisted, hoisted.sim
    loose = _point(sim, p.keep, {**dict.fromkeys(sim.cands.recomputable - set(sim.cands.roots), NOT_HELD),
                                 **p.transient})
    if loose.peak_bytes < (1 - _LOOSE_GAIN) * p.peak_bytes:
        p = loose
    nbytes = _storage_bytes(sim)
    for _ in range(_DESCENT_STEPS):
        live = _live_at_peak(p)  # only these can lower the peak: the others are not simulated
        order = [r for r in sim.cands.roots if r in p.keep and r in live]
        moves: dict[int, Recompute] = {}
        lowest = p.peak_bytes
        # The largest first: a drop lowers the peak by at most its storage's bytes, so once one has lowered
        # it further than the next could, the rest cannot be the lowest.
        for i in sorted(range(len(order)), key=lambda i: -nbytes[order[i]]):
            if p.peak_bytes - nbytes[order[i]] > lowest:
                break
            moves[i] = q = _point(sim, p.keep - {order[i]}, p.transient)
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
_NEAR_EQNS = 2 * _BIG


def _least_peak(points: list[Recompute], eqns: int) -> Recompute | None:
    """The set below the frontier that a budget under its least peak gets (None: none lower): the frontier's
    least-peak set, descended (:func:`_descended`), or, where one costs fewer FLOPs at a peak no higher, one
    of the few sets just above it descended, repaired to that peak (:func:`_repaired`) and descended again. The
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
        q = _repaired(q, floor.peak_bytes, floor.extra_flops)
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
        yield _point(sim, q.keep | {r}, rest)
        if held and r in q.transient:
            yield _point(sim, q.keep, rest)

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


# How many recompute steps the repair of a set above the budget takes at most, and from how many of the
# frontier's sets just above the budget it starts.
_REPAIR_STEPS = 24
_REPAIR_STARTS = 2
# How many of the candidates live at the peak each repair step tries (the largest).
_REPAIR_MOVES = 12


def _repaired(p: Recompute, target: int, most_flops: float = math.inf, lookahead: bool = False) -> Recompute | None:
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
                      if (q := _best_move(m, _repair_moves(m), per_flop=True)) is not None]
        best = _best_move(p, moves, per_flop=True)
        if best is None:
            return None
        p = best
    return p if p.peak_bytes <= target else None


def _repair_moves(p: Recompute) -> list[Recompute]:
    """The repair's moves from ``p`` (see :func:`_repaired`), of its largest candidates live at its peak."""
    sim = p.sim
    assert sim is not None
    segment = sim.segment
    live = _live_at_peak(p)
    moves = []
    # The largest first: a drop lowers the peak by at most its bytes.
    for r in sorted((r for r in sim.cands.roots if r in live), key=lambda r: -r.owned_nbytes)[:_REPAIR_MOVES]:
        if r in p.keep:
            moves.append(_point(sim, p.keep - {r}, p.transient))
        if r not in p.transient and r in segment:
            moves.append(_point(sim, p.keep - {r}, {**p.transient, r: segment[r]}))
    return moves


def _repairs(best: tuple[float, int, Plan], points: list[Recompute], usable: int, chunk_plan: Callable[..., Plan],
             base_flops: int, base_calls: int, device: torch.device) -> tuple[float, int, Plan]:
    """``best``, or a plan that runs whole within ``usable`` bytes at a lower step cost: a set of the
    frontier's just above ``usable`` that costs less than ``best``, repaired (:func:`_repaired`)."""
    above = [p for p in points[1:] if p.peak_bytes > usable and p.sim is not None]
    for p in reversed(above[-_REPAIR_STARTS:]):
        if step_cost(base_flops + p.extra_flops, base_calls + p.extra_calls, 1, device) >= best[0]:
            continue  # a repair only adds FLOPs
        q = _repaired(p, usable)
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

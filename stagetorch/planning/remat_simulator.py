"""The recompute simulator: a recompute set's peak bytes and extra FLOPs, exactly as the memory interpreter
would cost :func:`~stagetorch.transforms.remat.remat`'s graph for it, without building that graph.

A :class:`Simulator` numbers the graph's recompute candidates once and then costs any set of kept roots (and
roots recomputed for their own segment only) by replaying the memory interpreter's walk; a :class:`Recompute`
is one costed set (a point), and :func:`point`, :func:`best_move` and :func:`segment_chain` (the forward cut
into a chain of segments at its narrow points) are what the frontier and the joint planner build from.

It knows graphs, the remat pass's candidates, and the FLOP and memory interpreters. It must not know budgets,
chunks or plans: which sets are worth costing is :mod:`~stagetorch.planning.remat_frontier`'s business, which one
runs :mod:`~stagetorch.planning.remat_search`'s.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Mapping

import torch

from ..interpreters.flops import eqn_calls, eqn_flops
from ..interpreters.memory import Layouts, allocated, commit_cost, effect
from ..ir import Graph, Var, op_name
from ..transforms.remat import Candidates, node_spans, remat
from ..transforms.rng import METADATA_ONLY, SaveRngState, device_of, replayable
from ..transforms.schedule import adds_in_place, has_effect, is_random, steals

__all__ = ["Recompute", "Simulator", "point", "hoisted_of", "storage_bytes", "live_at_peak", "best_move", "segment_chain"]



class Recompute:
    """One recompute set: the roots kept (checkpoints), the dropped roots recomputed a second time rather
    than held (``transient``, by segment; see :func:`~stagetorch.transforms.remat.remat`), its predicted peak and the
    FLOPs and kernel calls its recomputation adds, and (built on first use) ``graph``, the program that
    recomputes the rest."""

    def __init__(self, source: Graph, cands: Candidates, keep: frozenset[Var], peak_bytes: int, extra_flops: int,
                 recomputed: tuple[str, ...], graph: Graph | None = None, transient: Mapping[Var, int] | None = None,
                 extra_calls: int = 0, sim: Simulator | None = None):
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


class Simulator:
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
        # An optimizer stepped last is the program's commit (interpreters.memory.commit_cost), the same tail in every
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
        """Per candidate, the segment of the forward's chain (:func:`segment_chain`) it is in: the segment number a
        transient value is recomputed for."""
        if self._segment is None:
            self._segment = {r: i for i, s in enumerate(segment_chain(self)) for r in s[0]}
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


def point(sim: Simulator, keep: frozenset[Var], transient: Mapping[Var, int] | None = None) -> Recompute:
    peak, extra, names, calls = sim.run(keep, transient)
    return Recompute(sim.graph, sim.cands, keep, peak, extra, names, transient=transient, extra_calls=calls, sim=sim)


def hoisted_of(sim: Simulator) -> Simulator:
    """``sim``'s walk with ``hoist`` (as ``remat(hoist=True)``), built once per simulator: the frontier and
    every descent below it cost sets hoisted on the same one (building one is ~0.1 s at 1,500 equations)."""
    if sim.hoist:
        return sim
    hoisted = sim.__dict__.get("_hoisted")
    if hoisted is None:
        hoisted = sim._hoisted = Simulator(sim.graph, sim.cands, hoist=True)
    return hoisted


def storage_bytes(sim: Simulator) -> dict[Var, int]:
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


def live_at_peak(p: Recompute) -> set[Var]:
    """The candidates whose storage (or its recomputed copy) is live at ``p``'s peak: only dropping one of
    those can lower it. One simulation, kept on ``p`` (the descent and the repair both ask)."""
    live = p.__dict__.get("_at_peak")
    if live is None:
        assert p.sim is not None
        live = set()
        p.sim.run(p.keep, p.transient, live)
        p._at_peak = live
    return live


def best_move(current: Recompute, moves: list[Recompute], per_flop: bool) -> Recompute | None:
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


def segment_chain(sim: Simulator) -> list[tuple[list[Var], list[Var], int, int, int, int]]:
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

"""Rematerialisation as a Graph -> Graph pass: forward values the backward reads are dropped after their last
forward use and recomputed just before their first backward use.

Which values may be dropped is decided here, from the graph alone (a pure function of it, so a policy can
never disagree between the forward and its recomputation): a storage can be recomputed only when every
equation that made it can run again with the same result and no other effect — no in-place write, no op
outside ATen, and no read of a storage that is written after the read. BatchNorm in training mode is
recomputed without its running statistics (its outputs are the same; the statistics are updated once, in
the forward). A random op (dropout) is recomputed with the draws it made: the forward saves the
generator's state just before it, and the recomputation runs it under that state and puts the generator
back (:mod:`stagetorch.transforms.rng`). Which of those to drop is the caller's choice (``keep``); the planner makes it.

The pass emits an ordinary Graph, so the memory interpreter costs it exactly and the eager interpreter and
the chunked executor run it unchanged. It knows the IR, the passes layer and the generator's replay only.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import attrs
import torch

from ..ir import Eqn, Graph, Var, iter_vars
from .rng import LAYOUT_OF, METADATA_ONLY, LayoutOf, ReplayRandom, SaveRngState, device_of, replayable
from .schedule import dce, has_effect, is_random, writes

__all__ = ["RECOMPUTED", "Candidates", "candidates", "remat", "recomputed_eqns"]

# ``SourceInfo.backward`` of an equation the pass inserted: the memory report files its outputs as
# temporaries of the backward, and the plan counts them.
RECOMPUTED = "recomputation"

# A segment of ``remat``'s ``transient`` that no value is recomputed for: a value in it is never held past
# the recomputation that made it (for a value the backward never reads, that only feeds recomputations).
NOT_HELD = -2


@attrs.frozen
class Candidates:
    """What the pass may drop in ``graph``.

    ``roots`` are the storages the forward makes and the backward reads, that can be recomputed, in the
    order the forward makes them; ``nbytes`` their sizes; ``boundary`` is the index of the first backward
    equation (``len(graph.eqns)`` when there is no backward). ``pinned`` are the storages the backward
    reads that must be kept (made by an op with a side effect, or written in place). ``recomputable`` is
    every forward storage that can be recomputed, read by the backward or not (a value only the
    recomputation needs is recomputed too, rather than kept).
    """

    roots: tuple[Var, ...]
    nbytes: tuple[int, ...]
    boundary: int
    pinned: frozenset[Var]
    recomputable: frozenset[Var]


def _boundary(graph: Graph) -> int:
    for i, e in enumerate(graph.eqns):
        if e.source.backward:
            return i
    return len(graph.eqns)


def _without_running_stats(e: Eqn) -> Eqn:
    """BatchNorm in training mode without its running statistics: the same outputs (it normalises with the
    batch's statistics either way), and no write."""
    return attrs.evolve(e, args=(*e.args[:3], None, None, *e.args[5:]))


# Ops whose only effect has a pure form that computes the same outputs, by packet: recomputation runs that.
_REPLAY = {torch.ops.aten.native_batch_norm: _without_running_stats}


def _replay(e: Eqn) -> Eqn:
    """The equation recomputation runs for ``e``: ``e`` itself, or its pure form (see ``_REPLAY``)."""
    pure = _REPLAY.get(getattr(e.prim, "overloadpacket", None))
    return e if pure is None or not has_effect(e) else pure(e)


def _beside_writes(e: Eqn) -> bool:
    """Whether running ``e`` again does something besides writing its written arguments: a draw that cannot
    be replayed (:func:`stagetorch.transforms.rng.replayable`), or an op outside ATen, or one that returns nothing."""
    if is_random(e):
        return not replayable(e)
    prim = e.prim
    return not (isinstance(prim, torch._ops.OpOverload) and prim.namespace in ("aten", "prims") and prim._schema.returns)


def _written_whole(graph: Graph, boundary: int) -> set[Var]:
    """Storages the forward makes and then writes in place, that can be recomputed whole by running again
    the equation that made them and every write, in order, on a fresh copy: CPU dropout's noise
    (``empty_like``, ``bernoulli_``, ``div_``). Each write is by a forward equation that writes that storage
    only and has no other effect, and nothing else reads the storage before its last write or through a
    value of an earlier version (which the copy, written on, would no longer hold)."""
    made: dict[Var, int] = {}
    writers: dict[Var, list[int]] = {}
    for i, e in enumerate(graph.eqns):
        for v in writes(e):
            writers.setdefault(v.root, []).append(i)
        if i < boundary:
            for v in e.outvars:
                if v is not None:
                    made.setdefault(v.root, i)
    inputs = {v.root for v in graph.invars}
    out = {r for r, ks in writers.items() if r in made and r not in inputs and made[r] not in ks and ks[-1] < boundary}
    for r in list(out):
        if any(len({v.root for v in writes(graph.eqns[k])}) != 1 or _beside_writes(graph.eqns[k]) for k in writers[r]):
            out.discard(r)
    if not out:
        return out
    last = {r: writers[r][-1] for r in out}
    final = {v for r, k in last.items() for v in graph.eqns[k].outvars if v is not None and v.root is r}
    defined: dict[Var, int] = {}
    for i, e in enumerate(graph.eqns):
        written = {v.root for v in writes(e)}
        for v in e.invars:
            r = v.root
            if r in out and r not in written and (i <= last[r] or (v not in final and defined[v] <= last[r])):
                out.discard(r)
        for v in e.outvars:
            if v is not None:
                defined[v] = i
    return out


def _replayable(graph: Graph, whole: set[Var]) -> list[bool]:
    """Per equation: may it (or its pure form) run a second time, later in the program, with the same
    result and no effect? A random op replays its draws; a write into a storage recomputed whole
    (``whole``: see :func:`_written_whole`) writes its fresh copy."""
    last_write: dict[Var, int] = {}
    for i, e in enumerate(graph.eqns):
        for v in writes(e):
            last_write[v.root] = i
    out = []
    for i, e in enumerate(graph.eqns):
        r = _replay(e)
        written = writes(r)
        if written:
            again = all(v.root in whole for v in written) and not _beside_writes(r)
        else:
            again = not has_effect(r) or (is_random(r) and replayable(r))
        out.append(again and all(last_write.get(v.root, -1) < i or v.root in whole for v in r.invars))
    return out


def candidates(graph: Graph) -> Candidates:
    """The storages ``remat`` may drop (see :class:`Candidates`)."""
    boundary = _boundary(graph)
    whole = _written_whole(graph, boundary)
    ok = _replayable(graph, whole)
    made: dict[Var, int] = {}  # root -> equation that first made it, forward only
    recomputable: dict[Var, bool] = {}
    inputs = {v.root for v in graph.invars}
    for i, e in enumerate(graph.eqns[:boundary]):
        for v in e.outvars:
            if v is None or v.root in inputs:
                continue
            r = v.root
            made.setdefault(r, i)
            recomputable[r] = recomputable.get(r, True) and ok[i]
        for v in writes(e):
            if v.root not in whole:
                recomputable[v.root] = False
    kept_to_end = {v.root for v in graph.outvars if isinstance(v, Var)} | {v.root for _, v in graph.grads}
    read_late: list[Var] = []
    seen: set[Var] = set()
    for e in graph.eqns[boundary:]:
        for v in e.invars:
            r = v.root
            if r in made and r not in seen:
                seen.add(r)
                read_late.append(r)
    roots = sorted((r for r in read_late if recomputable[r] and r not in kept_to_end), key=made.__getitem__)
    pinned = frozenset(r for r in read_late if not recomputable[r] or r in kept_to_end)
    every = frozenset(r for r, ok_r in recomputable.items() if ok_r and r not in kept_to_end)
    return Candidates(tuple(roots), tuple(r.owned_nbytes for r in roots), boundary, pinned, every)


def remat(
    graph: Graph, keep: Collection[Var], cands: Candidates | None = None, transient: Mapping[Var, int] | None = None,
    *, hoist: bool = False,
) -> Graph:
    """Recompute the recomputable storages not in ``keep`` (root vars) where the backward needs them.

    Each dropped value is recomputed just before the first backward equation that reads it (with the
    dropped values it depends on, recursively, back to kept values and inputs), and then read by every later
    backward use; the eager schedule frees the original after its last forward use and the copy after its
    last backward use. ``cands`` is ``candidates(graph)`` when the caller has it.

    ``transient`` maps dropped roots to a segment number: such a value, recomputed only because a value of
    another segment needs it, is not held for its own backward use but recomputed again then (a second
    level of recomputation: more FLOPs, and only one segment's values held at a time). A value the backward
    does not read may be mapped too: to :data:`NOT_HELD` to be made again wherever a recomputation needs it.

    ``hoist``: recompute what an autograd node reads before the node's first equation (:func:`node_spans`).
    Off by default: it lowers OPT's least peak at 8 x 512 tokens (4.24 -> 4.15 MiB, checkpointing 4.17) but
    raises VNet's cost at a third of its peak (1.10x -> 1.85x) where the planner does not choose per plan.
    """
    cands = candidates(graph) if cands is None else cands
    transient = transient or {}
    drop = cands.recomputable - set(keep)
    if not any(r in drop for r in cands.roots):
        return graph
    producer: dict[Var, Eqn] = {}
    for e in graph.eqns[: cands.boundary]:
        for v in e.outvars:
            if v is not None:
                producer[v] = e
    sub: dict[Var, Var] = {}  # original var -> the var that stands for it from here on
    out: list[Eqn] = list(graph.eqns[: cands.boundary])
    # By the id of a forward equation recomputed: what the forward saves for it just before it runs (the
    # generator's state for a random op, a layout token for a metadata-only op), by kind: (prim, what it
    # reads, the var it saves into).
    saves: dict[int, dict[object, tuple]] = {}

    def fresh(v: Var) -> Var:
        base = None if v.base is None else sub.get(v.base, v.base)
        return Var(v.aval, base, v.storage_nbytes, v.strides)

    def recompute(v: Var, burst: list[Eqn]) -> None:
        # Depth-first over the dropped values ``v`` needs, emitting each producing equation once, inputs first.
        stack = [(producer[v], False)]
        while stack:
            e, ready = stack.pop()
            if any(o is not None and o in sub for o in e.outvars):
                continue
            if ready:
                outs = tuple(None if o is None else fresh(o) for o in e.outvars)
                for o, n in zip(e.outvars, outs):
                    if o is not None:
                        sub[o] = n
                r = _replay(e)
                prim, args, source = r.prim, _subst(r.args, sub), attrs.evolve(e.source, backward=RECOMPUTED)
                kwargs = _subst(r.kwargs, sub)
                shaped_like = _shaped_like(r, drop)
                if shaped_like is not None:  # from a token of the argument's layout, not the argument
                    saved = saves.setdefault(id(e), {})
                    if LAYOUT_OF not in saved:
                        saved[LAYOUT_OF] = (LAYOUT_OF, shaped_like, LayoutOf.var(shaped_like))
                    args, kwargs = (saved[LAYOUT_OF][2], *args[1:]), {**kwargs, "device": shaped_like.aval.device}
                if is_random(r):
                    device = device_of(r)
                    saved = saves.setdefault(id(e), {})
                    if SaveRngState not in saved:
                        saved[SaveRngState] = (SaveRngState.of(device), None, Var(SaveRngState.of(device).aval()))
                    prim, args = ReplayRandom.of(r.prim, device), (saved[SaveRngState][2], *args)
                out.append(Eqn(prim, args, kwargs, outs, source))
                burst.append(e)
                continue
            stack.append((e, True))
            shaped_like = _shaped_like(e, drop)
            needs = [u for u in e.invars if u.root in drop and u not in sub and u is not shaped_like]
            # A view's storage comes with its base: recompute the base too, so the copy has one.
            needs += [o.base for o in e.outvars if o is not None and o.base is not None and o.base.root in drop
                      and o.base not in sub and o.base in producer]
            stack.extend((producer[u], False) for u in reversed(needs))

    spans = node_spans(graph, cands.boundary) if hoist else {}
    for i in range(cands.boundary, len(graph.eqns)):
        e = graph.eqns[i]
        reads = e.invars
        if i in spans:  # and the forward values the node's later equations read
            reads = [*reads, *(v for f in graph.eqns[i + 1: spans[i]] for v in f.invars if v in producer)]
        targets = [v for v in reads if v.root in drop and v not in sub]
        if targets:
            burst: list[Eqn] = []
            for v in targets:
                if v not in sub:
                    recompute(v, burst)
            if transient:
                # Copies of other segments' transient values made on the way are not held.
                wanted = {transient.get(v.root, -1) for v in targets} | {-1}
                for made in burst:
                    if all(o is None or transient.get(o.root, -1) not in wanted for o in made.outvars):
                        for o in made.outvars:
                            sub.pop(o, None)
        args, kwargs = _subst(e.args, sub), _subst(e.kwargs, sub)
        reads = {v.root for v in iter_vars((args, kwargs))}
        outs = tuple(_rebase(o, sub, reads) for o in e.outvars)
        if args is e.args and kwargs is e.kwargs and all(a is b for a, b in zip(outs, e.outvars)):
            out.append(e)
        else:
            out.append(attrs.evolve(e, args=args, kwargs=kwargs, outvars=outs))
    if saves:
        out[: cands.boundary] = _saving(graph.eqns[: cands.boundary], saves)
    outvars = [sub.get(v, v) if isinstance(v, Var) else v for v in graph.outvars]
    grads = [(i, sub.get(v, v)) for i, v in graph.grads]
    # Forward values that only the backward read, and that it now recomputes, are left with no reader.
    return dce(attrs.evolve(graph, eqns=out, outvars=outvars, grads=grads))


def node_spans(graph: Graph, boundary: int) -> dict[int, int]:
    """The backward's autograd nodes of more than one equation: the index of each one's first equation ->
    one past its last (a run of equations with the same ``source.backward``).

    :func:`remat` recomputes what a node reads before its first equation, as autograd's checkpointing
    recomputes a layer before its backward: recomputed before the equation that reads it, a value's
    recomputation ran beside what the node's earlier equations had made (an ``addmm``'s input gradient,
    computed before the weight gradient that reads the recomputed input: OPT's per-layer set held a
    [tokens, 4 x hidden] gradient beside the whole layer's recomputation)."""
    spans: dict[int, int] = {}
    eqns = graph.eqns
    i = boundary
    while i < len(eqns):
        label = eqns[i].source.backward
        j = i + 1
        while label and j < len(eqns) and eqns[j].source.backward == label:
            j += 1
        if j - i > 1:
            spans[i] = j
        i = j
    return spans


def _saving(forward: list[Eqn], saves: dict[int, dict[object, tuple]]) -> list[Eqn]:
    """``forward`` with what the recomputation of an equation needs saved right before it (``saves``, by
    the equation's id: see :func:`remat`). A generator state's save reads the equation's arguments (and
    ignores them), so that it runs in the same phase and chunk as the equation."""
    out: list[Eqn] = []
    for e in forward:
        for prim, reads, var in saves.get(id(e), {}).values():
            out.append(Eqn(prim, tuple(e.invars) if reads is None else (reads,), {}, (var,), e.source))
        out.append(e)
    return out


def _shaped_like(e: Eqn, drop: Collection[Var]) -> Var | None:
    """The first argument of ``e``, when ``e`` reads only its layout (``empty_like``) and it is dropped:
    then ``e`` is recomputed from a token of that layout (:class:`~stagetorch.transforms.rng.LayoutOf`)."""
    if getattr(e.prim, "overloadpacket", None) not in METADATA_ONLY or not e.args:
        return None
    x = e.args[0]
    return x if isinstance(x, Var) and x.root in drop else None


def _rebase(v: Var | None, sub: dict[Var, Var], reads: set[Var]) -> Var | None:
    """A backward value that lives in the storage of a recomputed one gets a var based on the copy, when its
    equation reads the copy's storage (``reads``: the roots it reads). One that reads a kept forward view of
    the original (a value recomputed only beside another output of its op) stays in the original's storage."""
    if v is None or v.base is None or sub.get(v.base, v.base) is v.base or sub[v.base].root not in reads:
        return v
    n = Var(v.aval, sub[v.base], v.storage_nbytes, v.strides)
    sub[v] = n
    return n


def _subst(x: object, sub: dict[Var, Var]) -> object:
    """``x`` with vars replaced through ``sub``; ``x`` itself when nothing changes."""
    if isinstance(x, Var):
        return sub.get(x, x)
    if isinstance(x, (list, tuple)):
        items = [_subst(y, sub) for y in x]
        if all(a is b for a, b in zip(items, x)):
            return x
        return items if isinstance(x, list) else tuple(items)
    if isinstance(x, dict):
        items = {k: _subst(y, sub) for k, y in x.items()}
        if all(items[k] is x[k] for k in x):
            return x
        return items
    return x


def recomputed_eqns(graph: Graph) -> list[Eqn]:
    """The equations a remat pass inserted into ``graph``."""
    return [e for e in graph.eqns if e.source.backward == RECOMPUTED]

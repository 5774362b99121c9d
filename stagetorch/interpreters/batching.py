"""The batch interpreter: which values of a Graph are per-example, shared, or reduced over the batch.

Labels, from the batch dims of the inputs forward:

- ``Batched(dim, k, outer)``: the value is per-example along ``dim``, which has size ``outer * batch * k``;
  example ``e`` owns entries ``[(o*batch + e)*k, (o*batch + e + 1)*k)`` for each ``o < outer`` (reshapes merge
  the batch with inner dims, ``k``, or under outer ones, ``outer``).
- ``Reduced(kind)``: a combination over the examples (``"sum"``, ``"max"``, ``"min"``): a chunk computes
  a partial, and partials combine by ``kind``. Mean-like reductions are written by their rules as sums of
  partials already divided by the *global* count, so they combine by ``"sum"`` too.
- ``None``: shared, independent of the batch.

Every equation falls in one phase: ``shared`` (no input depends on the batch: run once, first), ``body``
(some input is per-example: run per chunk, by its batch rule) or ``post`` (reads a reduced value and no
per-example one: run once, after the chunks). A body equation that reads a reduced value needs its *global*
value before the chunk loop: a pre-pass computes it, from the cheap formula a rule offers (the count of a
count-normalised loss) or from the slice of the graph that produces it.

The generic batch rules the op families reuse are :mod:`stagetorch.interpreters.batch_rules`; this module
holds the rule interface they answer in (``Chunked``, ``LabelFn``, :func:`coupling`) and the one rule the
analysis applies itself: :func:`elementwise`, to an op tagged pointwise that has no rule of its own.

This module knows the IR and the registry; it runs nothing, and names no op family's rules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from ..errors import BatchCouplingError, UnsupportedOpError
from ..ir import Eqn, Graph, Var, op_name
from ..registry import slot
from ..transforms.schedule import writes

aten = torch.ops.aten

__all__ = [
    "Batched", "Reduced", "Global", "Chunked", "Prepass", "BatchAnalysis", "analyze", "coupling", "LabelFn",
    "rule_for",
    # The rule of a pointwise op with none of its own, and the helpers the generic batch rules share.
    "elementwise", "agree", "arg_vars", "with_chunk_sizes", "INDEXING",
]


@attrs.frozen
class Batched:
    """Per-example along ``dim``, which has ``outer * batch * k`` entries: entry ``(o*batch + e)*k + j`` belongs
    to example ``e``. ``k > 1`` after a reshape merges the batch with inner dims, ``outer > 1`` after one
    merges it under an outer dim (``[time, batch, features] -> [time*batch, features]``)."""

    dim: int
    k: int = 1
    outer: int = 1

    def extent(self, batch: int) -> int:
        """The size of ``dim`` for a batch (or chunk) of ``batch`` examples."""
        return self.outer * batch * self.k

    def moved(self, dim: int) -> Batched:
        return attrs.evolve(self, dim=dim)


@attrs.frozen
class Reduced:
    """Combined over the examples: chunk partials combine by ``kind`` (``sum``, ``max`` or ``min``)."""

    kind: str = "sum"


@attrs.frozen
class Global:
    """An output equal to a value the pre-pass computed for the whole batch (a loss's normaliser)."""


@attrs.frozen
class Prepass:
    """A global value a rule can compute cheaply: ``sum over chunks of fn(*args)``; ``args`` may hold Vars."""

    fn: Callable[..., torch.Tensor]
    args: tuple
    cuts: dict = attrs.field(factory=dict)


Label = Batched | Reduced | None


@attrs.frozen
class Chunked:
    """A batch rule's answer: how one equation runs on a chunk.

    ``out`` labels each outvar (``Batched``, ``Reduced``, ``None`` for a value that is the same in every
    chunk, or ``Global()`` for one the pre-pass supplies). ``call(n, chunk_start)`` gives
    ``(prim, args, kwargs)`` for a chunk of ``n`` examples (default: the equation as traced, sizes unchanged).
    ``slice`` names shared inputs that must be cut to the chunk along a dim (a full-size mask met by a
    per-example value). ``prepass`` maps an outvar index to the cheap formula of its global value.
    ``out_of_place``: the equation writes an argument in place, and ``call`` computes its result into a new
    tensor instead, leaving the argument as it was (``zeros(E).scatter_add_(0, ids, w)``, a count over the
    batch: each chunk's partial is made apart and the partials summed). The analysis accepts such a write to
    a shared tensor only where nothing reads that tensor afterwards but through the equation's result.
    ``whole``: shared operands the rule has decided every chunk reads whole, because no dim of theirs pairs
    with the examples (a table of class weights looked up by per-example targets, an embedding table, zeros a
    chunk's share is scattered into, an index of each example's own position that ``call`` maps to the
    chunk's). An indexing op's rule (:data:`INDEXING`) must say of every shared operand with a dim of the
    batch's size that the step did not receive either this or ``slice``; the analysis refuses one it leaves
    unsaid rather than guess.
    """

    out: tuple
    call: Callable[[int], tuple[Any, tuple, dict]] | None = None
    slice: dict = attrs.field(factory=dict)
    prepass: dict = attrs.field(factory=dict)
    out_of_place: bool = False
    whole: frozenset = frozenset()
    # ``renorm``: the equation writes a shared tensor in place, row by row, each row at most once and from that
    # row alone (``embedding_renorm_``: a renormalised row is no longer over the norm); the chunks' writes, one
    # after another, leave it as the whole batch's one write. Exact only where nothing reads the tensor before
    # the last chunk but lookups of those same rows: the analysis checks the readers and refuses otherwise.
    renorm: tuple | None = None  # (the written tensor, the indices of the rows written)


class LabelFn:
    """What a batch rule asks about its arguments: ``label(x)``, the full batch size ``label.batch``, and
    ``label.maker(x)``, the equation that made ``x`` (``None`` for a graph input)."""

    def __init__(self, labels: dict[Var, Any], batch: int, makers: dict[Var, Eqn] | None = None):
        self._labels = labels
        self.batch = batch
        self._makers = makers or {}

    def maker(self, x: Var) -> Eqn | None:
        return self._makers.get(x)

    def __call__(self, x: Any) -> Batched | None:
        if isinstance(x, Var):
            lab = self._labels.get(x)
            return lab if isinstance(lab, Batched) else None
        return None


def coupling(eqn: Eqn, why: str, fix: str) -> BatchCouplingError:
    """The error for an op that mixes the examples of a batch, naming the op and the user's line."""
    return BatchCouplingError(
        f"{op_name(eqn.prim)} at {eqn.source} {why}, so running the batch in chunks would change the "
        f"result.\nWhat to do: {fix.rstrip('.')}."
    )


_POST = "post"  # label of a shared-shaped value computed from reduced values, after the chunk loop


@attrs.define
class BatchAnalysis:
    """The labels of every value and the phase and batch rule of every equation."""

    graph: Graph
    batch: int
    labels: dict[Var, Any]
    phases: list[str]
    decisions: dict[int, Chunked]
    placeholders: dict[int, dict[Var, Any]]
    needs_global: list[Var]
    prepass: dict[Var, Prepass]
    # Shared values of the whole batch's extent that eager pairs with the examples (a tensor the step closed
    # over, a buffer, one it built from Python data): per-example, made whole and cut to each chunk.
    spanning: dict[Var, Batched] = attrs.field(factory=dict)



# Ops that read only the shape, dtype and device of their tensor argument, never its data.
_METADATA_ONLY = {
    torch.ops.aten.ones_like, torch.ops.aten.zeros_like, torch.ops.aten.empty_like, torch.ops.aten.full_like,
    torch.ops.aten.new_ones, torch.ops.aten.new_zeros, torch.ops.aten.new_empty, torch.ops.aten.new_full,
    torch.ops.aten.new_empty_strided,
}


# Indexing ops, by packet: an operand's pairing with the examples follows from the op's semantics (gather pairs
# every dim of its index but ``dim`` with the same dim of its source; ``x[idx]`` looks ``x`` up), not from
# broadcasting, so their rules must declare it for every shared operand of the batch's size the step did not
# receive (``Chunked.slice`` or ``Chunked.whole``); one left undeclared is refused by name (see _undeclared).
_aten = torch.ops.aten
INDEXING = frozenset({
    _aten.gather, _aten.take_along_dim, _aten.index_select, _aten.index, _aten._unsafe_index, _aten.index_put,
    _aten.index_put_, _aten._unsafe_index_put, _aten.scatter, _aten.scatter_, _aten.scatter_add, _aten.scatter_add_,
    _aten.scatter_reduce, _aten.scatter_reduce_, _aten.index_add, _aten.index_add_, _aten.index_copy,
    _aten.index_copy_, _aten.index_fill, _aten.index_fill_, _aten.take, _aten.embedding, _aten.embedding_bag,
    _aten._embedding_bag, _aten.embedding_dense_backward,
})


def _packet(prim: Any) -> Any:
    return prim.overloadpacket if isinstance(prim, torch._ops.OpOverload) else prim


def rule_for(prim: Any) -> Callable | None:
    """The batch rule of ``prim``: the registry's, else :func:`elementwise` for an op tagged pointwise; None."""
    rule = slot(prim, "batch")
    if rule is None and isinstance(prim, torch._ops.OpOverload) and torch.Tag.pointwise in prim.tags:
        return elementwise
    return rule


def analyze(graph: Graph, inputs: dict[Var, Batched], batch: int) -> BatchAnalysis:
    """Label every value of ``graph`` given the batched inputs (by Var) and the full batch size.

    A tensor the step makes with a factory (``input_ids.new_zeros(input_ids.shape)``, ``torch.zeros(B, S)``)
    depends on the batch only through its size, so it is first taken as shared; when per-example values are
    then written into it, it was per-example after all: it is made per chunk, at the chunk's size, and the
    analysis starts again with that known (once per such tensor).
    """
    promoted: dict[Var, Batched] = {}
    spanning: dict[Var, Batched] = {}
    while True:
        try:
            return _analyze(graph, inputs, batch, promoted, spanning)
        except _Promote as p:
            promoted[p.var] = p.label
        except _Span as p:
            spanning.update(p.found)


class _Promote(Exception):  # noqa: N818 - control flow inside analyze, never seen by users
    def __init__(self, var: Var, label: Batched):
        self.var, self.label = var, label


class _Span(Exception):  # noqa: N818 - control flow inside analyze, never seen by users
    def __init__(self, found: dict[Var, Batched]):
        self.found = found


def _pointwise(prim: Any) -> bool:
    return isinstance(prim, torch._ops.OpOverload) and torch.Tag.pointwise in prim.tags


def _origins(v: Var, lab: Batched, makers: dict[Var, Eqn], batch: int) -> dict[Var, Batched]:
    """Where a shared value that eager pairs with the examples gets its batch extent: through the pointwise
    ops that made it from other shared values (``-W``, ``W.double() * 2``, the backward's ``grad * W``), back to
    the operands that carry the extent at the aligned dim, so that those are cut per chunk rather than the
    whole product made first (which would hold a whole batch's tensor through the chunks)."""
    e = makers.get(v)
    if e is None or not _pointwise(e.prim) or len([w for w in e.outvars if w is not None]) != 1:
        return {v: lab}
    extent, ndim = lab.extent(batch), v.aval.ndim
    found: dict[Var, Batched] = {}
    for _, x in arg_vars(e.args) + [(k, x) for k, x in e.kwargs.items() if isinstance(x, Var)]:
        own = lab.dim - (ndim - x.aval.ndim)
        if own >= 0 and x.aval.shape[own] == extent:
            found.update(_origins(x, lab.moved(own), makers, batch))
    return found or {v: lab}


# Factories whose output depends on nothing but their sizes (and a fill value): where per-example values are
# written into their output, they are made per chunk. Value: the position of the sizes argument, or None for
# the ``*_like`` ones (shaped like their input, which is then cut to the chunk).
_FACTORIES = {
    torch.ops.aten.zeros: 0, torch.ops.aten.ones: 0, torch.ops.aten.empty: 0, torch.ops.aten.full: 0,
    torch.ops.aten.new_zeros: 1, torch.ops.aten.new_ones: 1, torch.ops.aten.new_empty: 1,
    torch.ops.aten.new_full: 1, torch.ops.aten.zeros_like: None, torch.ops.aten.ones_like: None,
    torch.ops.aten.empty_like: None, torch.ops.aten.full_like: None,
    # (the backward of a slice assignment, ``o[:, :2] = 0``, copies the gradient into one of these)
    torch.ops.aten.new_empty_strided: 1, torch.ops.aten.empty_strided: 0,
}
_STRIDED = frozenset({torch.ops.aten.new_empty_strided, torch.ops.aten.empty_strided})


def _fits_chunks(maker: Eqn, dim: int) -> bool:
    """Whether factory ``maker`` made with the chunk's extent along ``dim`` (its other arguments as they are)
    is the chunk's part of the whole batch's: true but for a strided factory with a dim of size > 1 before
    ``dim``, whose stride counts the batch's rows."""
    return _packet(maker.prim) not in _STRIDED or all(size == 1 for size in maker.outvars[0].aval.shape[:dim])


def _factory_rule(eqn: Eqn, lab: Batched) -> Chunked:
    """A promoted factory: made per chunk, with the batch's extent in its sizes set to the chunk's."""
    pos = _FACTORIES[_packet(eqn.prim)]
    if pos is None:
        return Chunked((lab,), slice={eqn.args[0]: lab})

    def call(n: int) -> tuple[Any, tuple, dict]:
        return with_chunk_sizes(eqn, lab, n, (), (pos,))

    return Chunked((lab,), call=call)


def _into_factory(
    producer: dict[Var, Eqn], eqn: Eqn, written: Var, decision: Chunked, labels: dict[Var, Any], batch: int
) -> _Promote | None:
    """The promotion of the fresh factory output ``written`` lives in, if per-example values written into it
    line up with its dims (through the slices, selects and transposes that viewed it)."""
    lab = next((lab for v, lab in zip(eqn.outvars, decision.out) if v is not None and v.root is written.root
                and isinstance(lab, Batched)), None)
    if lab is None:
        return None
    dim, v = lab.dim, written
    while v.base is not None:
        e = producer.get(v)
        if e is None or not isinstance(e.args[0], Var):
            return None
        op, x = _packet(e.prim), e.args[0]
        same_dims = op in (torch.ops.aten.alias, torch.ops.aten.detach, torch.ops.aten.view) and x.aval.shape == v.aval.shape
        if same_dims or (op is torch.ops.aten.slice and e.args[1] % x.aval.ndim != dim):
            pass
        elif op is torch.ops.aten.select:
            dim += e.args[1] % x.aval.ndim <= dim
        elif op is torch.ops.aten.unsqueeze and e.args[1] % v.aval.ndim != dim:
            dim -= e.args[1] % v.aval.ndim < dim
        elif op is torch.ops.aten.transpose:
            a, b = (d % x.aval.ndim for d in e.args[1:3])
            dim = b if dim == a else a if dim == b else dim
        else:
            return None
        v = x
    maker = producer.get(v)
    if maker is None or _packet(maker.prim) not in _FACTORIES or labels.get(v) is not None or not _fits_chunks(maker, dim):
        return None
    if v.aval.shape[dim] != lab.extent(batch) or (_FACTORIES[_packet(maker.prim)] is None and maker.args[0] in labels
                                                   and labels[maker.args[0]] is not None):
        return None
    return _Promote(v, attrs.evolve(lab, dim=dim))


def _analyze(
    graph: Graph, inputs: dict[Var, Batched], batch: int, promoted: dict[Var, Batched],
    spanning: dict[Var, Batched],
) -> BatchAnalysis:
    labels: dict[Var, Any] = dict(inputs)
    labels.update((v, lab) for v, lab in spanning.items() if v in graph.invars)
    makers = {v: e for e in graph.eqns for v in e.outvars if v is not None}
    phases: list[str] = []
    decisions: dict[int, Chunked] = {}
    placeholders: dict[int, dict[Var, Any]] = {}
    needs_global: list[Var] = []
    prepass: dict[Var, Prepass] = {}
    updated: set[Var] = set()  # written in place after the chunk loop, and what is computed from that
    read_late: set[Var] = set()  # storage (roots) that body or post equations read
    made_per_chunk: set[Var] = set()  # shared values body equations make: made whole again in every chunk
    captured = _not_received(graph)
    renorms: list[tuple[int, Var, Var]] = []  # rows of a shared tensor rewritten chunk by chunk (Chunked.renorm)

    for i, e in enumerate(graph.eqns):
        ins = e.invars
        made = next((promoted[v] for v in e.outvars if v in promoted), None)
        if made is not None:
            phases.append("body")
            decisions[i] = _factory_rule(e, made)
            labels[e.outvars[0]] = made
            continue
        batched = [v for v in ins if isinstance(labels.get(v), Batched)]
        late = [v for v in ins if isinstance(labels.get(v), Reduced) or labels.get(v) == _POST]
        if not batched and late and _packet(e.prim) in _METADATA_ONLY:
            # ones_like(loss): only the aval of the reduced value matters, so it is shared after all.
            placeholders[i] = {v: v.aval for v in late}
            late = []
        if not batched and not late and any(w.root in read_late for w in writes(e)):
            # An in-place write to storage the chunks have read (AdamW's weight decay ``p.mul_(1 - lr * wd)``,
            # which needs no gradient): run once before the chunks, the chunks would read the written value.
            late = [w for w in writes(e) if w.root in read_late]
        if not batched and not late and any(v in made_per_chunk for v in ins):
            # A value no example owns but the body makes (``x.new_ones(B, C)``: made from an argument's
            # metadata in every chunk) has no whole-batch copy before the chunk loop: what reads it is made in
            # every chunk too, the same in each. A write it makes into anything else would repeat per chunk.
            if any(w not in made_per_chunk and w.root not in made_per_chunk for w in writes(e)):
                raise coupling(
                    e,
                    "writes a tensor shared by the whole batch from a value every chunk makes again",
                    "compute that value outside the staged function, or run without chunking (a larger "
                    "memory_budget)",
                )
            phases.append("body")
            read_late.update(v.root for v in ins)
            decisions[i] = Chunked(tuple(None for _ in e.outvars))
            for v in e.outvars:
                if v is not None:
                    labels[v] = None
                    made_per_chunk.add(v)
            continue
        if not batched:
            phase = "post" if late else "shared"
            if late:
                read_late.update(v.root for v in ins)
            phases.append(phase)
            for v in e.outvars:
                if v is not None:
                    labels[v] = _POST if late else spanning.get(v)
            if late:
                # An in-place op that returns nothing (_foreach_add_ of an optimizer's step) leaves its
                # arguments' Vars as they were: what reads them after it must run after it too.
                for v in writes(e):
                    if labels.get(v) is None:
                        labels[v] = _POST
                    updated.add(v)
                if any(v in updated for v in ins):
                    updated.update(v for v in e.outvars if v is not None)
            continue
        phases.append("body")
        read_late.update(v.root for v in ins)
        if any(v in updated for v in late):
            raise coupling(
                e,
                "reads a value updated in place after the whole batch's reductions (a weight an optimizer "
                "inside the step has already stepped)",
                "compute it outside the staged function (after the call), or run without chunking (a larger "
                "memory_budget)",
            )
        rule = rule_for(e.prim)
        if rule is None:
            raise UnsupportedOpError(_no_rule_message(e, batched, labels))
        try:
            decision = rule(e, LabelFn(labels, batch, makers))
        except BatchCouplingError as error:
            raise _ambiguous(graph, e, spanning, batch, error) from None
        for v in writes(e):
            if not isinstance(labels.get(v), Batched):
                if decision.out_of_place and _read_only_through(graph, i, v):
                    continue
                if decision.renorm is not None and decision.renorm[0] is v:
                    renorms.append((i, v, decision.renorm[1]))
                    continue
                if (promote := _into_factory(makers, e, v, decision, labels, batch)) is not None:
                    raise promote
                raise coupling(
                    e,
                    "updates a tensor shared by the whole batch in place from per-example values",
                    "update it outside the staged function, or run without chunking (a larger memory_budget)",
                )
        for v, cut in decision.slice.items():
            if labels.get(v) is None and v in made_per_chunk:
                raise _made_in_chunk(e, v, cut, makers, batch)
        if _packet(e.prim) in INDEXING:
            _undeclared(graph, e, decision, labels, captured, makers, batch)
        written = {w.root for w in writes(e)}  # (a write's target is promoted or refused above instead)
        span: dict[Var, Batched] = {}
        for v, cut in decision.slice.items() if decision.call is None else ():
            # A shared value cut to the chunk here is paired with the examples, as eager's broadcasting pairs
            # it: it is per-example everywhere, the backward's products with it included (cut here alone, the
            # backward would read the whole batch's values against a chunk's: wrong gradients, right loss).
            # (A rule with a call of its own cuts what it then reads in its own way: an index's positions.)
            if type(cut) is Batched and labels.get(v) is None and v not in spanning and v.root not in written:
                span.update(_origins(v, cut, makers, batch))
        if span:
            raise _Span(span)
        for v in late:
            if v not in needs_global:
                needs_global.append(v)
        for j, (v, lab) in enumerate(zip(e.outvars, decision.out)):
            if v is None:
                continue
            labels[v] = lab
            if lab is None:
                made_per_chunk.add(v)
            if isinstance(lab, Global):
                prepass[v] = decision.prepass[j]
        decisions[i] = decision

    if renorms:
        _renorm_read_only_by_lookups(graph, renorms, phases)
    return BatchAnalysis(graph, batch, labels, phases, decisions, placeholders, needs_global, prepass, dict(spanning))


def _no_rule_message(e: Eqn, batched: list[Var], labels: dict[Var, Any]) -> str:
    """The refusal of a body equation whose op has no batch rule. Its advice, ``per_example``, is given for
    the dim its per-example operands have the batch on here (the step's ``batch_dim``, or another after a
    transpose), which is the dim ``per_example`` must be told; none where they disagree."""
    dims = sorted({labels[v].dim for v in batched})
    name = f"torch.ops.{op_name(_packet(e.prim))}"
    if len(dims) == 1:
        how = (
            f"teach it with one line if it treats each example independently along dim {dims[0]} (where its "
            f"per-example operands have the batch here): stagetorch.ops.register({name}, "
            f"batch=stagetorch.ops.per_example({f'dim={dims[0]}' if dims[0] else ''}))"
        )
    else:
        how = (
            f"its per-example operands have the batch on different dims ({', '.join(map(str, dims))}), which "
            f"stagetorch.ops.per_example cannot express: register a batch rule of its own "
            f"(stagetorch.ops.register({name}, batch=...), see stagetorch.interpreters.batching.Chunked)"
        )
    return (
        f"{op_name(e.prim)} at {e.source} reads a per-example value, and stagetorch has no batch rule for it, so "
        f"it cannot tell whether running it on a chunk of the batch is exact.\nWhat to do: {how}, or run "
        "without chunking (a larger memory_budget)."
    )


def _not_received(graph: Graph) -> set[Var]:
    """The values the step did not receive: the graph's inputs other than its arguments (parameters, buffers,
    tensors it closed over or read from globals, ``torch.tensor(data)``), and every value computed from one."""
    roles = graph.roles or ["arg"] * len(graph.invars)
    out = {v for v, role in zip(graph.invars, roles) if role != "arg"}
    for e in graph.eqns:
        if any(v in out for v in e.invars):
            out.update(v for v in e.outvars if v is not None)
    return out


def _described(graph: Graph, v: Var, makers: dict[Var, Eqn]) -> str:
    """``v`` in the user's words: the input it is, or the input it was computed from."""
    names = dict(zip(graph.invars, zip(graph.roles or [], graph.names or [])))
    seen, todo = set(), [v]
    while todo:
        x = todo.pop(0)
        if x in names and names[x][1]:
            role, name = names[x]
            return f"{role} {name!r}" if x is v else f"a value of shape {tuple(v.aval.shape)} computed from {role} {name!r}"
        e = makers.get(x)
        if e is not None and x not in seen:
            seen.add(x)
            todo += list(e.invars)
    return f"a value of shape {tuple(v.aval.shape)} the step made without its arguments"


def _undeclared(
    graph: Graph, eqn: Eqn, decision: Chunked, labels: dict[Var, Any], captured: set[Var], makers: dict[Var, Eqn],
    batch: int,
) -> None:
    """The safety net of the indexing ops: a shared operand the step did not receive, with a dim of the batch's
    size, that the rule neither cuts to the chunk nor declares read whole, is refused by name. Whether its rows
    pair with the examples follows from the op's semantics, which only its rule knows; a guess either way runs
    and is silently wrong the other way."""
    extents = {batch} | {lab.extent(batch) for v in eqn.invars if isinstance(lab := labels.get(v), Batched)}
    extents.discard(1)
    operands = arg_vars(eqn.args) + [(k, x) for k, x in eqn.kwargs.items() if isinstance(x, Var)]
    for _, v in operands:
        if v not in captured or labels.get(v) is not None or v in decision.slice or v in decision.whole:
            continue
        dims = [d for d, size in enumerate(v.aval.shape) if size in extents]
        if not dims:
            continue
        raise UnsupportedOpError(
            f"{op_name(eqn.prim)} at {eqn.source} reads {_described(graph, v, makers)}, which the step did not "
            f"receive as an argument and which has the batch's size ({v.aval.shape[dims[0]]}) along dim "
            f"{dims[0]}; the op's batch rule does not say whether those rows pair with the examples (each chunk "
            f"reads its own) or are looked up whole, so running the batch in chunks could read the wrong rows."
            f"\nWhat to do: pass it to the staged function as an argument (batched along its batch dim), or run "
            f"without chunking (a larger memory_budget)."
        )


def _made_in_chunk(eqn: Eqn, v: Var, cut: Any, makers: dict[Var, Eqn], batch: int) -> Exception:
    """A rule cuts to the chunk a shared value that a body equation makes (the backward of ``t[arange(B), y]``
    writes each example's own row of ``new_zeros(grad, [B, C])``): made whole again in every chunk, no cut
    reaches it. A factory is made per chunk at the chunk's size instead (promoted); anything else is refused."""
    m = makers.get(v)
    if (
        m is not None and type(cut) is Batched and _FACTORIES.get(_packet(m.prim)) is not None
        and v.aval.shape[cut.dim] == cut.extent(batch) and _fits_chunks(m, cut.dim)
    ):
        return _Promote(v, cut)
    if type(cut) is Batched and (root := _factory_root(v, cut.extent(batch), makers)) is not None:
        # Computed from a factory by ops that read nothing of the examples (``x.new_ones(B, C) * 2``, then
        # ``.cumsum(1)``): the factory is made per chunk at the chunk's size, and what is computed from it
        # follows by those ops' own rules (refused by name there where they cross the examples).
        return _Promote(root[0], cut.moved(root[1]))
    return coupling(
        eqn,
        f"reads a value of shape {tuple(v.aval.shape)} that is made whole in every chunk as rows of the examples",
        "make it from the batched tensors it pairs with (x.new_zeros(x.shape)), or run without chunking (a larger "
        "memory_budget)",
    )


def _factory_root(v: Var, extent: int, makers: dict[Var, Eqn]) -> tuple[Var, int] | None:
    """The factory (made from its sizes alone) that ``v``, a value the body makes again in every chunk, was
    computed from, and its one dim of the batch's ``extent``; None where there is none, more than one, a dim
    that is ambiguous, or an input of ``v`` with a dim of that extent (which might be rows of the examples)."""
    found: list[tuple[Var, int]] = []
    seen: set[Var] = set()
    stack = [v]
    while stack:
        w = stack.pop()
        if w in seen:
            continue
        seen.add(w)
        e = makers.get(w)
        if e is None:
            if extent in w.aval.shape:
                return None
            continue
        if _FACTORIES.get(_packet(e.prim)) is not None:
            dims = [d for d, size in enumerate(w.aval.shape) if size == extent]
            if len(dims) != 1 or not _fits_chunks(e, dims[0]):
                return None
            found.append((w, dims[0]))
            continue
        stack.extend(e.invars)
    return found[0] if len(found) == 1 else None


def _ambiguous(
    graph: Graph, eqn: Eqn, spanning: dict[Var, Batched], batch: int, error: BatchCouplingError
) -> BatchCouplingError:
    """``error``, naming the tensor the step did not receive when the coupling is with one taken as per-example
    (it has the batch's size where it met the examples first, and is used otherwise here)."""
    read = [v for v in eqn.invars if v in spanning]
    if not read:
        return error
    v = read[0]
    roles = dict(zip(graph.invars, zip(graph.roles or [], graph.names or [])))
    role, name = roles.get(v, ("", ""))
    what = (
        f"{role} {name!r}" if name else f"a value of shape {tuple(v.aval.shape)} the step made without its arguments"
    )
    return BatchCouplingError(
        f"{error}\nThe per-example operand here is {what}: it was not passed in as batched, but it has the "
        f"batch's size ({spanning[v].extent(batch)}) along dim {spanning[v].dim} "
        f"where it first met the examples, so stagetorch took it as one entry per example, as eager's "
        f"broadcasting pairs it; here it is used some other way. Pass it to the staged function as an argument "
        f"(batched along its batch dim), or give it a shape whose batch dim cannot be mistaken."
    )


def _renorm_read_only_by_lookups(graph: Graph, renorms: list[tuple[int, Var, Var]], phases: list[str]) -> None:
    """Each of ``renorms`` (equation, shared tensor, indices) rewrites rows of a shared tensor chunk by chunk
    (:attr:`Chunked.renorm`): a chunk's write covers only its own examples' rows, so until the last chunk has
    run the tensor is the whole batch's only at the rows some chunk has rewritten. A row is either as it was or
    rewritten, and rewriting it again leaves it be, so a lookup by indices a rewrite before it covered reads the
    whole batch's rows. Refuses any other reader that could see a row before then: what is not such a lookup,
    a rewrite or an alias (``weight.detach()``), unless it runs after every chunk (an optimizer's update)."""
    for root in dict.fromkeys(v.root for _, v, _ in renorms):
        mine = {i: ids for i, v, ids in renorms if v.root is root}
        first, covered = min(mine), set()
        for j in range(first, len(graph.eqns)):
            e = graph.eqns[j]
            if j in mine:
                covered.add(mine[j])
                continue
            if not any(v.root is root for v in e.invars) or phases[j] == "post" or _packet(e.prim) in _ALIASES:
                continue
            if _packet(e.prim) is aten.embedding and len(e.args) > 1 and e.args[1] in covered:
                continue
            raise coupling(
                graph.eqns[first],
                f"renormalises in place the rows the chunk's indices read, and {op_name(e.prim)} at {e.source} "
                "then reads that weight other than by a lookup of indices renormalised before it (a chunk would "
                "see the rows later chunks renormalise still unrenormalised)",
                "renormalise before the call, outside the staged function (with torch.no_grad(): "
                "torch.embedding_renorm_(emb.weight, ids, max_norm, norm_type)) and build the embedding without "
                "max_norm (the same values and gradients), or run without chunking (a larger memory_budget)",
            )


_ALIASES = (aten.detach, aten.alias)  # the same storage, no value read: a later reader of it is checked


def _read_only_through(graph: Graph, i: int, written: Var) -> bool:
    """Equation ``i`` writes ``written`` in place; true when its storage is a temporary the graph made (not an
    input) that no later equation, output or gradient reads but through ``i``'s results (and views of them):
    then computing the result into a new tensor instead changes nothing any other equation sees."""
    root = written.root
    if root in graph.invars or any(v is root for v in graph.invars):
        return False
    ok = {v for v in graph.eqns[i].outvars if v is not None}

    def through(v: Var) -> bool:
        while v is not None:
            if v in ok:
                return True
            v = v.base
        return False

    for e in graph.eqns[i + 1 :]:
        if any(v.root is root and not through(v) for v in e.invars):
            return False
    finals = [v for v in graph.outvars if isinstance(v, Var)] + [v for _, v in graph.grads]
    return not any(v.root is root and not through(v) for v in finals)


# ---------------------------------------------------------------------------------------------------------
# The rule interface's helpers, and the rule of a pointwise op with none of its own (elementwise): shared with
# the generic batch rules (interpreters/batch_rules.py).


def arg_vars(args: Any) -> list[tuple[Any, Var]]:
    """(position, var) for tensor arguments, positions being an index or (index, j) into a list."""
    out = []
    for i, a in enumerate(args):
        if isinstance(a, Var):
            out.append((i, a))
        elif isinstance(a, (list, tuple)):
            out += [((i, j), x) for j, x in enumerate(a) if isinstance(x, Var)]
    return out


def agree(eqn: Eqn, placed: list[Any]) -> Any:
    """All per-example operands must line the batch up the same way (same output dim, ``k`` and ``outer``)."""
    if len(set(placed)) > 1:
        raise coupling(
            eqn,
            f"combines per-example values whose batch dims do not line up ({sorted(set(placed), key=str)})",
            "keep the batch on the same dimension of every per-example operand",
        )
    return placed[0]


def elementwise(eqn: Eqn, label: LabelFn) -> Chunked:
    """Broadcasting ops: the batch dim lines up across operands; a shared operand of full batch extent is sliced."""
    out_ndim = max((v.aval.ndim for v in eqn.outvars if v is not None), default=0)
    operands = arg_vars(eqn.args) + [(key, v) for key, v in eqn.kwargs.items() if isinstance(v, Var)]
    placed = [lab.moved(lab.dim + out_ndim - v.aval.ndim) for _, v in operands if (lab := label(v)) is not None]
    lab = agree(eqn, placed)
    extent = lab.extent(label.batch)
    cut = {}
    for _, v in operands:
        if label(v) is None:
            own = lab.dim - (out_ndim - v.aval.ndim)
            if own >= 0 and v.aval.shape[own] == extent and extent != 1:
                cut[v] = lab.moved(own)
    return Chunked(tuple(lab if v is not None else None for v in eqn.outvars), slice=cut)


def with_chunk_sizes(
    eqn: Eqn, lab: Batched, n: int, ints: Sequence[int], lists: Sequence[int]
) -> tuple[Any, tuple, dict]:
    """``eqn``'s call for a chunk of ``n``: the integer arguments ``ints`` that are the batch size, and the
    batch entry of the size lists ``lists``, set to the chunk's extent."""
    args = list(eqn.args)
    for i in ints:
        args[i] = lab.extent(n)
    for i in lists:
        sizes = list(args[i])
        sizes[lab.dim] = lab.extent(n)
        args[i] = sizes
    return eqn.prim, tuple(args), eqn.kwargs

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

This module knows the IR and the registry; it runs nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from ..errors import BatchCouplingError, UnsupportedOpError
from ..ir import Eqn, Graph, Var, op_name
from ..registry import slot
from ..transforms.schedule import writes

__all__ = [
    "Batched", "Reduced", "Global", "Chunked", "Prepass", "BatchAnalysis", "analyze", "coupling", "LabelFn",
    # Generic batch rules that the op families reuse.
    "elementwise", "per_example", "contraction", "reduction", "mean_reduction", "view", "expand", "permute",
    "transpose", "unsqueeze", "squeeze", "select", "slice_", "split", "cat", "stack", "softmax", "along",
    "same_in_every_chunk", "batch_size_list",
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
    """

    out: tuple
    call: Callable[[int], tuple[Any, tuple, dict]] | None = None
    slice: dict = attrs.field(factory=dict)
    prepass: dict = attrs.field(factory=dict)
    out_of_place: bool = False


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


def _packet(prim: Any) -> Any:
    return prim.overloadpacket if isinstance(prim, torch._ops.OpOverload) else prim


def _rule_for(prim: Any) -> Callable | None:
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
    for _, x in _vars(e.args) + [(k, x) for k, x in e.kwargs.items() if isinstance(x, Var)]:
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
}


def _factory_rule(eqn: Eqn, lab: Batched) -> Chunked:
    """A promoted factory: made per chunk, with the batch's extent in its sizes set to the chunk's."""
    pos = _FACTORIES[_packet(eqn.prim)]
    if pos is None:
        return Chunked((lab,), slice={eqn.args[0]: lab})

    def call(n: int) -> tuple[Any, tuple, dict]:
        return _with_chunk_sizes(eqn, lab, n, (), (pos,))

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
    if maker is None or _packet(maker.prim) not in _FACTORIES or labels.get(v) is not None:
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
        rule = _rule_for(e.prim)
        if rule is None:
            raise UnsupportedOpError(
                f"{op_name(e.prim)} at {e.source} reads a per-example value, and stagetorch has no batch rule "
                f"for it, so it cannot tell whether running it on a chunk of the batch is exact.\nTeach it with "
                f"one line, e.g. for an op that treats each example independently along dim 0: "
                f"stagetorch.ops.register(torch.ops.{op_name(_packet(e.prim))}, "
                f"batch=stagetorch.ops.per_example()), or run without chunking (a larger memory_budget)."
            )
        try:
            decision = rule(e, LabelFn(labels, batch, makers))
        except BatchCouplingError as error:
            raise _ambiguous(graph, e, spanning, batch, error) from None
        for v in writes(e):
            if not isinstance(labels.get(v), Batched):
                if decision.out_of_place and _read_only_through(graph, i, v):
                    continue
                if (promote := _into_factory(makers, e, v, decision, labels, batch)) is not None:
                    raise promote
                raise coupling(
                    e,
                    "updates a tensor shared by the whole batch in place from per-example values",
                    "update it outside the staged function, or run without chunking (a larger memory_budget)",
                )
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
            if isinstance(lab, Global):
                prepass[v] = decision.prepass[j]
        decisions[i] = decision

    return BatchAnalysis(graph, batch, labels, phases, decisions, placeholders, needs_global, prepass, dict(spanning))


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
# Generic batch rules, which the op families' tables reuse (as JAX's batching module owns its generic
# batchers). A batch rule is ``rule(eqn, label) -> Chunked``: ``label(x)`` is the ``Batched`` label of an
# argument (``None`` when shared) and ``label.batch`` the full batch size. It says how the equation runs on a
# chunk and what its outputs are, or raises ``BatchCouplingError`` (via :func:`coupling`) when a chunk cannot
# compute its share exactly. Rules for one op family (losses, embedding, BatchNorm, RNN) live in that
# family's file under ``stagetorch/ops/``.


def _vars(args: Any) -> list[tuple[Any, Var]]:
    """(position, var) for tensor arguments, positions being an index or (index, j) into a list."""
    out = []
    for i, a in enumerate(args):
        if isinstance(a, Var):
            out.append((i, a))
        elif isinstance(a, (list, tuple)):
            out += [((i, j), x) for j, x in enumerate(a) if isinstance(x, Var)]
    return out


def _agree(eqn: Eqn, placed: list[Any]) -> Any:
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
    operands = _vars(eqn.args) + [(key, v) for key, v in eqn.kwargs.items() if isinstance(v, Var)]
    placed = [lab.moved(lab.dim + out_ndim - v.aval.ndim) for _, v in operands if (lab := label(v)) is not None]
    lab = _agree(eqn, placed)
    extent = lab.extent(label.batch)
    cut = {}
    for _, v in operands:
        if label(v) is None:
            own = lab.dim - (out_ndim - v.aval.ndim)
            if own >= 0 and v.aval.shape[own] == extent and extent != 1:
                cut[v] = lab.moved(own)
    return Chunked(tuple(lab if v is not None else None for v in eqn.outvars), slice=cut)


def same_in_every_chunk(eqn: Eqn, label: LabelFn) -> Chunked:
    """An op whose outputs do not depend on which chunk runs it (e.g. an empty placeholder)."""
    return Chunked(tuple(None for _ in eqn.outvars))


def per_example(
    *,
    dim: int = 0,
    outputs: Sequence[str | None] | None = None,
    slice_args: Sequence[int] = (),
    batch_size_args: Sequence[int] = (),
    size_list_args: Sequence[int] = (),
) -> Callable[[Eqn, LabelFn], Chunked]:
    """An op that treats each example independently along ``dim`` (convolution, pooling, attention...).

    ``outputs`` gives each outvar's kind: ``"b"`` per-example, ``"sum"`` summed over the batch (a weight
    gradient), ``None`` the same in every chunk; by default an output is per-example when its ``dim`` has the
    full batch extent. ``slice_args`` are argument positions that, when shared, are cut to the chunk
    (an initial hidden state). ``batch_size_args`` are integer arguments that carry the batch size itself;
    ``size_list_args`` are full sizes whose entry ``dim`` is the batch size (an upsampling backward's
    ``input_size``).
    """

    def rule(eqn: Eqn, label: LabelFn) -> Chunked:
        placed = [lab for _, v in _vars(eqn.args) if (lab := label(v)) is not None]
        bdims = {p.dim for p in placed}
        if bdims != {dim}:
            raise coupling(
                eqn,
                f"is per-example along dim {dim} only, but its input is batched along dim {sorted(bdims)}",
                f"put the batch on dim {dim} of this op's input (batch_dim=...), or run without chunking",
            )
        lab = _agree(eqn, placed)
        extent = lab.extent(label.batch)
        cut = {}
        for i in slice_args:
            v = _argument(eqn, i)
            if isinstance(v, Var) and label(v) is None and v.aval.ndim > dim and v.aval.shape[dim] == extent:
                cut[v] = lab
        out = []
        for j, v in enumerate(eqn.outvars):
            kind = outputs[j] if outputs is not None and j < len(outputs) else "auto"
            if v is None:
                out.append(None)
            elif kind == "b" or (kind == "auto" and v.aval.ndim > dim and v.aval.shape[dim] == extent):
                out.append(lab)
            elif kind == "sum":
                out.append(Reduced("sum"))
            else:
                out.append(None)
        call = None
        if batch_size_args or size_list_args:

            def call(n: int) -> tuple[Any, tuple, dict]:
                return _with_chunk_sizes(eqn, lab, n, batch_size_args, size_list_args)

        return Chunked(tuple(out), call=call, slice=cut)

    return rule


def _argument(eqn: Eqn, i: int) -> Any:
    """Argument ``i`` of the op's schema, passed by position or by keyword (``attn_mask=``)."""
    if i < len(eqn.args):
        return eqn.args[i]
    schema = getattr(eqn.prim, "_schema", None)
    if schema is None or i >= len(schema.arguments):
        return None
    return eqn.kwargs.get(schema.arguments[i].name)


def _with_chunk_sizes(
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


def contraction(spec: str, *, bias: bool = False) -> Callable[[Eqn, LabelFn], Chunked]:
    """Matmul-like ops from an einsum spec (``"ij,jk->ik"``): a batch letter kept in the output stays
    per-example; one summed over becomes a per-chunk partial of a sum (a weight gradient).

    With ``bias=True`` the first argument is added to the product (``addmm``): it broadcasts against the
    output, so its dims take the output's trailing letters; it must not meet a partial sum.
    """
    ins, out_spec = spec.split("->")
    in_specs = ins.split(",")

    def rule(eqn: Eqn, label: LabelFn) -> Chunked:
        operands = list(eqn.args[1 : 1 + len(in_specs)] if bias else eqn.args[: len(in_specs)])
        specs = list(in_specs)
        if bias and isinstance(eqn.args[0], Var):
            operands.append(eqn.args[0])
            specs.append(out_spec[len(out_spec) - eqn.args[0].aval.ndim :])
        letters = [(s[lab.dim], lab.moved(0)) for v, s in zip(operands, specs) if (lab := label(v)) is not None]
        letter, lab = _agree(eqn, letters)
        extent = lab.extent(label.batch)
        cut = {}
        for v, s in zip(operands, specs):
            if isinstance(v, Var) and label(v) is None and letter in s:
                pos = s.index(letter)
                if v.aval.shape[pos] == extent and extent != 1:
                    cut[v] = lab.moved(pos)
        if letter in out_spec:
            return Chunked((lab.moved(out_spec.index(letter)),), slice=cut)
        if bias and _beta(eqn) != 0:
            raise coupling(
                eqn,
                "adds a term to a product summed over the batch",
                "add the term outside the sum, or run without chunking",
            )
        return Chunked((Reduced("sum"),), slice=cut)

    return rule


def _beta(eqn: Eqn) -> float:
    return eqn.kwargs.get("beta", eqn.args[3] if len(eqn.args) > 3 else 1)


def _dims(dims: Any, ndim: int) -> list[int]:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return [d % ndim if ndim else 0 for d in dims]


def _reduced_label(
    eqn: Eqn, label: LabelFn, dims_arg: int | None, keepdim_arg: int | None
) -> tuple[Batched, list[int], bool]:
    x = eqn.args[0]
    lab = label(x)
    dims = _dims(eqn.args[dims_arg] if dims_arg is not None and len(eqn.args) > dims_arg else None, x.aval.ndim)
    keepdim = bool(eqn.args[keepdim_arg]) if keepdim_arg is not None and len(eqn.args) > keepdim_arg else False
    keepdim = eqn.kwargs.get("keepdim", keepdim)
    return lab, dims, keepdim


def reduction(kind: str, *, dims_arg: int | None = 1, keepdim_arg: int | None = 2) -> Callable[[Eqn, LabelFn], Chunked]:
    """``sum``/``amax``/``amin``-like: over the batch dim it becomes a partial; otherwise per-example."""

    def rule(eqn: Eqn, label: LabelFn) -> Chunked:
        lab, dims, keepdim = _reduced_label(eqn, label, dims_arg, keepdim_arg)
        if lab.dim in dims:
            return Chunked(tuple(Reduced(kind) if v is not None else None for v in eqn.outvars))
        shift = 0 if keepdim else sum(d < lab.dim for d in dims)
        return Chunked(tuple(lab.moved(lab.dim - shift) if v is not None else None for v in eqn.outvars))

    return rule


def _partial_mean(x: torch.Tensor, dims: list[int], keepdim: bool, count: int, dtype: Any = None) -> torch.Tensor:
    # Divided in place: one tensor, as the memory interpreter counts (``sum / count`` held two at once).
    return torch.sum(x, dims, keepdim=keepdim, dtype=dtype).div_(count)


def mean_reduction(*, dims_arg: int | None = 1, keepdim_arg: int | None = 2) -> Callable[[Eqn, LabelFn], Chunked]:
    """``mean``: over the batch dim a chunk contributes its sum divided by the *full* count."""

    def rule(eqn: Eqn, label: LabelFn) -> Chunked:
        lab, dims, keepdim = _reduced_label(eqn, label, dims_arg, keepdim_arg)
        if lab.dim not in dims:
            shift = 0 if keepdim else sum(d < lab.dim for d in dims)
            return Chunked((lab.moved(lab.dim - shift),))
        x = eqn.args[0]
        count = math.prod(x.aval.shape[d] for d in dims)
        dtype = eqn.kwargs.get("dtype")

        def call(n: int) -> tuple[Any, tuple, dict]:
            return _partial_mean, (x, dims, keepdim, count, dtype), {}

        return Chunked((Reduced("sum"),), call=call)

    return rule


def _view_label(eqn: Eqn, label: LabelFn, in_shape: Sequence[int], out_shape: Sequence[int]) -> Batched:
    """Where the batch lands after a reshape. In logical order the elements factor as
    (everything before the batch) x batch x (everything after); a reshape keeps that order, so the batch lands
    on the output dim whose prefix divides "before" and whose size holds the batch whole."""
    lab = label(eqn.args[0])
    before = math.prod(in_shape[: lab.dim]) * lab.outer
    after = lab.k * math.prod(in_shape[lab.dim + 1 :])
    batch = label.batch
    acc = 1
    for d, size in enumerate(out_shape):
        if before % acc == 0:
            outer = before // acc
            if size % (outer * batch) == 0 and size // (outer * batch) * math.prod(out_shape[d + 1 :]) == after:
                return Batched(d, size // (outer * batch), outer)
        acc *= size
        if acc > before:
            break
    raise coupling(
        eqn,
        f"reshapes {list(in_shape)} to {list(out_shape)}, splitting the batch dim {lab.dim} across dims",
        "keep the batch dim whole (outermost of any dims merged with it) in reshapes",
    )


def view(eqn: Eqn, label: LabelFn) -> Chunked:
    """view/reshape: the batch dim stays whole, possibly merged with inner dims (``k`` grows) or split off."""
    x = eqn.args[0]
    out_shape = eqn.outvars[0].aval.shape
    lab = _view_label(eqn, label, x.aval.shape, out_shape)

    def call(n: int) -> tuple[Any, tuple, dict]:
        new = list(out_shape)
        new[lab.dim] = lab.extent(n)
        return eqn.prim, (x, new, *eqn.args[2:]), eqn.kwargs

    return Chunked((lab,), call=call)


def expand(eqn: Eqn, label: LabelFn) -> Chunked:
    x, sizes = eqn.args[0], list(eqn.args[1])
    lab = label(x)
    lab = lab.moved(lab.dim + len(sizes) - x.aval.ndim)

    def call(n: int) -> tuple[Any, tuple, dict]:
        new = list(sizes)
        new[lab.dim] = lab.extent(n)
        return eqn.prim, (x, new, *eqn.args[2:]), eqn.kwargs

    return Chunked((lab,), call=call)


def _moved(eqn: Eqn, label: LabelFn, new_dim: int) -> Chunked:
    return Chunked((label(eqn.args[0]).moved(new_dim),))


def permute(eqn: Eqn, label: LabelFn) -> Chunked:
    lab = label(eqn.args[0])
    order = [d % eqn.args[0].aval.ndim for d in eqn.args[1]]
    return _moved(eqn, label, order.index(lab.dim))


def transpose(eqn: Eqn, label: LabelFn) -> Chunked:
    lab = label(eqn.args[0])
    ndim = eqn.args[0].aval.ndim
    if eqn.args[0].aval.ndim < 2:
        return _moved(eqn, label, lab.dim)
    d0, d1 = (eqn.args[1] % ndim, eqn.args[2] % ndim) if len(eqn.args) > 2 else (0, 1)
    return _moved(eqn, label, d1 if lab.dim == d0 else d0 if lab.dim == d1 else lab.dim)


def unsqueeze(eqn: Eqn, label: LabelFn) -> Chunked:
    lab = label(eqn.args[0])
    d = eqn.args[1] % (eqn.args[0].aval.ndim + 1)
    return _moved(eqn, label, lab.dim + (d <= lab.dim))


def squeeze(eqn: Eqn, label: LabelFn) -> Chunked:
    x = eqn.args[0]
    lab = label(x)
    shape = x.aval.shape
    dims = _dims(eqn.args[1] if len(eqn.args) > 1 else None, x.aval.ndim)
    gone = [d for d in dims if shape[d] == 1 and d != lab.dim]
    if lab.dim in dims and shape[lab.dim] == 1:
        raise coupling(eqn, "squeezes away a batch dim of size 1", "use a batch larger than one example")
    return _moved(eqn, label, lab.dim - sum(d < lab.dim for d in gone))


def select(eqn: Eqn, label: LabelFn) -> Chunked:
    x, dim = eqn.args[0], eqn.args[1] % eqn.args[0].aval.ndim
    lab = label(x)
    if dim == lab.dim:
        raise coupling(eqn, "picks one example out of the batch", "index examples outside the staged function")
    return _moved(eqn, label, lab.dim - (dim < lab.dim))


def slice_(eqn: Eqn, label: LabelFn) -> Chunked:
    x = eqn.args[0]
    lab = label(x)
    dim = (eqn.args[1] if len(eqn.args) > 1 else 0) % x.aval.ndim
    if dim == lab.dim and eqn.outvars[0].aval.shape[dim] != x.aval.shape[dim]:
        raise coupling(eqn, "slices the batch dim", "slice examples outside the staged function")
    if dim == lab.dim:

        def call(n: int) -> tuple[Any, tuple, dict]:
            return torch.ops.aten.alias.default, (x,), {}

        return Chunked((lab,), call=call)
    return Chunked((lab,))


def batch_size_list(arg: int, label_of_list: Callable[[Eqn, LabelFn], Batched]) -> Callable:
    """A rule for ``*_backward(grad, input_sizes, dim, ...)`` ops whose sizes list carries the batch."""

    def rule(eqn: Eqn, label: LabelFn) -> Chunked:
        lab = label_of_list(eqn, label)

        def call(n: int) -> tuple[Any, tuple, dict]:
            return _with_chunk_sizes(eqn, lab, n, (), (arg,))

        return Chunked((lab,), call=call)

    return rule


def split(eqn: Eqn, label: LabelFn) -> Chunked:
    x = eqn.args[0]
    lab = label(x)
    dim_arg = 1 if eqn.prim.overloadpacket is torch.ops.aten.unbind else 2
    dim = (eqn.args[dim_arg] if len(eqn.args) > dim_arg else eqn.kwargs.get("dim", 0)) % x.aval.ndim
    if dim == lab.dim:
        raise coupling(eqn, "splits the batch dim", "split examples outside the staged function")
    if dim < lab.dim and dim_arg == 1:
        return Chunked(tuple(lab.moved(lab.dim - 1) if v is not None else None for v in eqn.outvars))
    return Chunked(tuple(lab if v is not None else None for v in eqn.outvars))


def cat(eqn: Eqn, label: LabelFn) -> Chunked:
    tensors = eqn.args[0]
    dim = eqn.args[1] if len(eqn.args) > 1 else eqn.kwargs.get("dim", 0)
    ndim = eqn.outvars[0].aval.ndim
    dim %= ndim
    lab = _agree(eqn, [lab for v in tensors if (lab := label(v)) is not None])
    if lab.dim == dim:
        raise coupling(eqn, "concatenates along the batch dim", "concatenate batches outside the staged function")
    extent = lab.extent(label.batch)
    cut = {
        v: lab
        for v in tensors
        if isinstance(v, Var) and label(v) is None and v.aval.ndim == ndim and v.aval.shape[lab.dim] == extent
    }
    if any(isinstance(v, Var) and label(v) is None and v not in cut and v.aval.numel > 0 for v in tensors):
        raise coupling(eqn, "concatenates per-example values with a shared one", "broadcast the shared value first")
    return Chunked((lab,), slice=cut)


def stack(eqn: Eqn, label: LabelFn) -> Chunked:
    tensors = eqn.args[0]
    dim = (eqn.args[1] if len(eqn.args) > 1 else eqn.kwargs.get("dim", 0)) % eqn.outvars[0].aval.ndim
    lab = _agree(eqn, [lab for v in tensors if (lab := label(v)) is not None])
    extent = lab.extent(label.batch)
    cut = {v: lab for v in tensors if isinstance(v, Var) and label(v) is None and v.aval.shape[lab.dim] == extent}
    if any(isinstance(v, Var) and label(v) is None and v not in cut for v in tensors):
        raise coupling(eqn, "stacks per-example values with a shared one", "broadcast the shared value first")
    return Chunked((lab.moved(lab.dim + (dim <= lab.dim)),), slice=cut)


def softmax(*, dim_arg: int, operands: int = 1) -> Callable[[Eqn, LabelFn], Chunked]:
    """softmax/log_softmax and their backwards: exact per chunk unless normalised across the batch dim."""

    def rule(eqn: Eqn, label: LabelFn) -> Chunked:
        ndim = eqn.outvars[0].aval.ndim
        dim = eqn.args[dim_arg] % max(ndim, 1)
        result = elementwise(eqn, label)
        if result.out[0].dim == dim:
            raise coupling(
                eqn,
                "normalises across the batch dim (softmax over examples)",
                "normalise over a non-batch dim, or run without chunking (a larger memory_budget)",
            )
        return result

    return rule


def _dims_at(eqn: Eqn, arg: int | str | None, default: Any, ndim: int) -> list[int]:
    """The dims an op mixes along, from a positional or keyword argument; ``None`` means all of them."""
    if isinstance(arg, str):
        value = eqn.kwargs.get(arg, default)
    elif arg is None:
        value = default
    else:
        value = eqn.args[arg] if len(eqn.args) > arg else eqn.kwargs.get("dim", default)
    if value is None:
        return list(range(ndim))
    if isinstance(value, int):
        value = [value]
    return [d % ndim for d in value] if ndim else []


def along(
    dim: int | str | None,
    *,
    default: Any = None,
    last: int = 0,
    keepdim: int | str | None = None,
    reduces: bool = False,
) -> Callable[[Eqn, LabelFn], Chunked]:
    """Ops that mix entries only along some dims (a scan, a sort, a norm, a gather, linear algebra over
    trailing dims): exact per chunk whenever the batch is on another dim.

    The mixed dims come from argument ``dim`` (position or keyword name; ``default`` when absent) or are
    the ``last`` trailing dims. With ``reduces``, those dims are removed from the outputs unless the
    ``keepdim`` argument says otherwise. Other tensor arguments must carry the batch the same way or be
    shared.
    """

    def rule(eqn: Eqn, label: LabelFn) -> Chunked:
        x = eqn.args[0]
        lab = label(x)
        if lab is None:
            raise coupling(eqn, "reads per-example values through an argument other than its input", "batch the input")
        ndim = x.aval.ndim
        dims = list(range(ndim - last, ndim)) if last else _dims_at(eqn, dim, default, ndim)
        if lab.dim in dims:
            raise coupling(
                eqn,
                f"mixes entries along dim {lab.dim}, the batch dim",
                "move the batch to a dim the op does not mix along (batch_dim=...), or run without chunking",
            )
        kept = False
        if keepdim is not None:
            kept = bool(eqn.kwargs.get(keepdim) if isinstance(keepdim, str) else (eqn.args[keepdim] if len(eqn.args) > keepdim else eqn.kwargs.get("keepdim", False)))
        out_lab = lab.moved(lab.dim - sum(d < lab.dim for d in dims)) if reduces and not kept else lab
        extent = lab.extent(label.batch)
        cut = {}
        for _, v in _vars(eqn.args[1:]):
            other = label(v)
            if other is not None and other != lab:
                raise coupling(eqn, "combines per-example values batched in different ways", "keep the batch consistent")
            # Operands line up dim by dim with the input (an index, the other vector of a cross product).
            if other is None and v.aval.ndim == ndim and v.aval.shape[lab.dim] == extent and extent != 1:
                cut[v] = lab
            elif other is None and v.aval.ndim == ndim and v.aval.shape[lab.dim] not in (1, extent):
                raise coupling(
                    eqn,
                    f"lines up an operand of {v.aval.shape[lab.dim]} entries against {extent} along the batch dim",
                    "give the operand one entry per example, or run without chunking",
                )
        out = []
        for v in eqn.outvars:
            if v is None:
                out.append(None)
            elif v.aval.ndim > out_lab.dim and v.aval.shape[out_lab.dim] == extent:
                out.append(out_lab)
            else:
                raise coupling(eqn, "returns a value whose batch dim stagetorch cannot place", "run without chunking")
        return Chunked(tuple(out), slice=cut)

    return rule

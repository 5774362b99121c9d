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

from collections.abc import Callable
from typing import Any

import attrs
import torch

from .errors import BatchCouplingError, UnsupportedOpError
from .ir import Eqn, Graph, Var, op_name
from .ops._registry import slot

__all__ = ["Batched", "Reduced", "Chunked", "Prepass", "BatchAnalysis", "analyze", "coupling", "LabelFn"]


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
    """

    out: tuple
    call: Callable[[int], tuple[Any, tuple, dict]] | None = None
    slice: dict = attrs.field(factory=dict)
    prepass: dict = attrs.field(factory=dict)


class LabelFn:
    """What a batch rule asks about its arguments: ``label(x)`` and the full batch size ``label.batch``."""

    def __init__(self, labels: dict[Var, Any], batch: int):
        self._labels = labels
        self.batch = batch

    def __call__(self, x: Any) -> Batched | None:
        if isinstance(x, Var):
            lab = self._labels.get(x)
            return lab if isinstance(lab, Batched) else None
        return None


def coupling(eqn: Eqn, why: str, fix: str) -> BatchCouplingError:
    """The error for an op that mixes the examples of a batch, naming the op and the user's line."""
    return BatchCouplingError(
        f"{op_name(eqn.prim)} at {eqn.source} {why}, so running the batch in chunks would change the "
        f"result.\nWhat to do: {fix}"
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



# Ops that read only the shape, dtype and device of their tensor argument, never its data.
_METADATA_ONLY = {
    torch.ops.aten.ones_like, torch.ops.aten.zeros_like, torch.ops.aten.empty_like, torch.ops.aten.full_like,
    torch.ops.aten.new_ones, torch.ops.aten.new_zeros, torch.ops.aten.new_empty, torch.ops.aten.new_full,
    torch.ops.aten.new_empty_strided,
}


def _packet(prim: Any) -> Any:
    return prim.overloadpacket if isinstance(prim, torch._ops.OpOverload) else prim


def _rule_for(prim: Any) -> Callable | None:
    from .ops import _batch

    rule = slot(prim, "batch")
    if rule is None and isinstance(prim, torch._ops.OpOverload) and torch.Tag.pointwise in prim.tags:
        return _batch.elementwise
    return rule


def _mutated_args(eqn: Eqn) -> list[Var]:
    schema = getattr(eqn.prim, "_schema", None)
    if schema is None:
        return []
    out = []
    for a, x in zip(schema.arguments, eqn.args):
        if a.alias_info is not None and a.alias_info.is_write:
            out += [x] if isinstance(x, Var) else [y for y in (x if isinstance(x, (list, tuple)) else ()) if isinstance(y, Var)]
    for name, x in eqn.kwargs.items():
        for a in schema.arguments:
            if a.name == name and a.alias_info is not None and a.alias_info.is_write and isinstance(x, Var):
                out.append(x)
    return out


def analyze(graph: Graph, inputs: dict[Var, Batched], batch: int) -> BatchAnalysis:
    """Label every value of ``graph`` given the batched inputs (by Var) and the full batch size."""
    labels: dict[Var, Any] = dict(inputs)
    phases: list[str] = []
    decisions: dict[int, Chunked] = {}
    placeholders: dict[int, dict[Var, Any]] = {}
    needs_global: list[Var] = []
    prepass: dict[Var, Prepass] = {}

    for i, e in enumerate(graph.eqns):
        ins = e.invars
        batched = [v for v in ins if isinstance(labels.get(v), Batched)]
        late = [v for v in ins if isinstance(labels.get(v), Reduced) or labels.get(v) == _POST]
        if not batched and late and _packet(e.prim) in _METADATA_ONLY:
            # ones_like(loss): only the aval of the reduced value matters, so it is shared after all.
            placeholders[i] = {v: v.aval for v in late}
            late = []
        if not batched:
            phase = "post" if late else "shared"
            phases.append(phase)
            for v in e.outvars:
                if v is not None:
                    labels[v] = _POST if late else None
            continue
        phases.append("body")
        rule = _rule_for(e.prim)
        if rule is None:
            raise UnsupportedOpError(
                f"{op_name(e.prim)} at {e.source} reads a per-example value, and stagetorch has no batch rule "
                f"for it, so it cannot tell whether running it on a chunk of the batch is exact.\nTeach it with "
                f"one line, e.g. for an op that treats each example independently along dim 0: "
                f"stagetorch.ops.register(torch.ops.{op_name(_packet(e.prim))}, "
                f"batch=stagetorch.ops.per_example()), or run without chunking (a larger memory_budget)."
            )
        decision = rule(e, LabelFn(labels, batch))
        for v in _mutated_args(e):
            if not isinstance(labels.get(v), Batched):
                raise coupling(
                    e,
                    "updates a tensor shared by the whole batch in place from per-example values",
                    "update it outside the staged function, or run without chunking (a larger memory_budget)",
                )
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

    return BatchAnalysis(graph, batch, labels, phases, decisions, placeholders, needs_global, prepass)

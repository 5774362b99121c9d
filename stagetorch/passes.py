"""Graph -> Graph passes and what they share: which equations have side effects, where each storage is last
used, and dead-code elimination (every pass must leave a graph that :func:`stagetorch.ir.check` accepts).

A pass returns a new Graph and never mutates the one it is given (equations and vars of the input that it
keeps unchanged are shared). It knows the IR only: no registry, no real tensors, no chunking.
"""

from __future__ import annotations

import attrs
import torch

from .ir import Eqn, Graph, Var, iter_vars

__all__ = ["Liveness", "liveness", "writes", "is_random", "has_effect", "dce"]

aten = torch.ops.aten

# Ops that update arguments in place although their schema does not say so: BatchNorm in training mode
# writes its running statistics. By packet: (the training flag's position, the positions written when set).
_HIDDEN_WRITES: dict = {
    aten.native_batch_norm: (5, (3, 4)),
    aten.cudnn_batch_norm: (5, (3, 4)),
    aten.miopen_batch_norm: (5, (3, 4)),
    aten._native_batch_norm_legit: (5, (3, 4)),
    aten.batch_norm: (5, (3, 4)),
}


def writes(e: Eqn) -> list[Var]:
    """The vars whose storage ``e`` writes in place: the schema's written arguments (lists of tensors too, by
    position or keyword) and the hidden writes above. The one account of in-place writes that the batch
    interpreter, the restore-on-failure of a step and recomputation all read."""
    out: list[Var] = []
    schema = getattr(e.prim, "_schema", None)
    if schema is not None:
        for a, x in zip(schema.arguments, e.args):
            if a.alias_info is not None and a.alias_info.is_write:
                out += iter_vars(x)
        for name, x in e.kwargs.items():
            arg = next((a for a in schema.arguments if a.name == name), None)
            if arg is not None and arg.alias_info is not None and arg.alias_info.is_write:
                out += iter_vars(x)
    hidden = _HIDDEN_WRITES.get(getattr(e.prim, "overloadpacket", None))
    if hidden is not None and len(e.args) > hidden[0] and e.args[hidden[0]]:
        out += [e.args[i] for i in hidden[1] if isinstance(e.args[i], Var)]
    return out


def is_random(e: Eqn) -> bool:
    """``e`` draws from a random generator: running it again gives other values and moves the generator."""
    tags = getattr(e.prim, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def has_effect(e: Eqn) -> bool:
    """Running ``e`` does something besides computing its outputs: writes an argument, draws random numbers,
    or is an op outside ATen (a collective, a user's custom op) whose effects stagetorch cannot see."""
    namespace = getattr(e.prim, "namespace", "aten")
    return namespace not in ("aten", "prims") or is_random(e) or bool(writes(e))


@attrs.frozen
class Liveness:
    """Where each storage is used, by root var.

    ``last_use[r]`` is the index of the last equation that reads any var living in storage ``r``
    (``len(graph.eqns)`` for storage the graph's outputs or gradients keep to the end); a root missing from
    it is never read. ``defined[r]`` is the index of the equation that first made it (-1 for an input).
    """

    last_use: dict[Var, int]
    defined: dict[Var, int]


def liveness(graph: Graph) -> Liveness:
    """First definition and last use of each storage, the schedule the eager interpreter follows: a value
    is freed after the last use of any var on its storage. The memory interpreter and the executor both
    follow it."""
    n = len(graph.eqns)
    last: dict[Var, int] = {}
    defined: dict[Var, int] = {v.root: -1 for v in graph.invars}
    for i, e in enumerate(graph.eqns):
        for v in e.invars:
            last[v.root] = i
        for v in e.outvars:
            if v is not None:
                defined.setdefault(v.root, i)
    for v in graph.outvars:
        if isinstance(v, Var):
            last[v.root] = n
    for _, v in graph.grads:
        last[v.root] = n
    return Liveness(last, defined)


def dce(graph: Graph) -> Graph:
    """Drop the equations whose results nobody needs: no output, gradient or live equation reads them, and
    they have no side effect (:func:`has_effect`)."""
    needed: set[Var] = {v for v in graph.outvars if isinstance(v, Var)} | {v for _, v in graph.grads}
    keep: list[bool] = [False] * len(graph.eqns)
    for i in range(len(graph.eqns) - 1, -1, -1):
        e = graph.eqns[i]
        if has_effect(e) or any(v is not None and v in needed for v in e.outvars):
            keep[i] = True
            needed.update(e.invars)
            # A view's storage belongs to its base: keeping the view keeps the equation that made the base.
            needed.update(v.base for v in e.outvars if v is not None and v.base is not None)
    eqns = [e for e, k in zip(graph.eqns, keep) if k]
    if len(eqns) == len(graph.eqns):
        return graph
    return attrs.evolve(graph, eqns=eqns)

"""The eager interpreter: runs a Graph on real tensors, freeing each value after its last use.

Its schedule (program order, free after last use) is the one the memory interpreter costs. It knows the IR
only; chunking builds graphs for it to run, and the staged callable gives it the real inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._tree import flatten
from .ir import Eqn, Graph, Literal, Var

__all__ = ["Program", "accumulate_grad"]

_DETACH = torch.ops.aten.detach.default


def _binder(tree: Any, slot_of: dict[Var, int]) -> Callable[[list], Any]:
    """A function env -> the call's arguments with tensors in place of Vars. Literals are returned as-is."""
    if isinstance(tree, Var):
        i = slot_of[tree]
        return lambda env: env[i]
    if isinstance(tree, (list, tuple)) and any(_has_var(x) for x in tree):
        if all(isinstance(x, Var) or not _has_var(x) for x in tree):
            # Flat (the common case): a template with the slots filled in place.
            template = list(tree)
            fills = [(k, slot_of[x]) for k, x in enumerate(tree) if isinstance(x, Var)]
            kind = type(tree)

            def bind_flat(env: list) -> Any:
                args = template.copy()
                for k, i in fills:
                    args[k] = env[i]
                return args if kind is list else kind(args)

            if kind is tuple and len(fills) == len(tree):
                slots = [i for _, i in fills]
                return lambda env: [env[i] for i in slots]
            return bind_flat
        parts = [_binder(x, slot_of) for x in tree]
        kind = type(tree)
        return lambda env: kind(p(env) for p in parts)
    if isinstance(tree, dict) and any(_has_var(x) for x in tree.values()):
        parts_d = {k: _binder(v, slot_of) for k, v in tree.items()}
        return lambda env: {k: p(env) for k, p in parts_d.items()}
    return lambda env: tree


def _has_var(tree: Any) -> bool:
    if isinstance(tree, Var):
        return True
    if isinstance(tree, (list, tuple)):
        return any(_has_var(x) for x in tree)
    if isinstance(tree, dict):
        return any(_has_var(x) for x in tree.values())
    return False


class Program:
    """A Graph compiled for repeated execution: variables become slots in a list, last uses precomputed."""

    def __init__(self, graph: Graph, keep: Sequence[Var] = ()):
        self.graph = graph
        kept = {v for v in graph.outvars if isinstance(v, Var)} | set(keep) | {v for _, v in graph.grads}
        inputs = set(graph.invars)
        # Autograd detaches every tensor it saves; below autograd a detach of a computed value is only an
        # alias. Such a detach (not of an input, not kept) costs no call: its output shares its input's slot.
        alias: dict[Var, Var] = {}
        eqns = []
        for e in graph.eqns:
            src = e.args[0] if e.prim is _DETACH and e.args else None
            if type(src) is Var and src not in inputs and e.outvars[0] not in kept and not e.kwargs:
                alias[e.outvars[0]] = alias.get(src, src)
            else:
                eqns.append(e)
        slot_of: dict[Var, int] = {}
        nslots = 0
        for v in graph.vars():
            root = alias.get(v, v)
            if root not in slot_of:
                slot_of[root] = nslots
                nslots += 1
            slot_of[v] = slot_of[root]
        self.nslots = nslots
        self.in_slots = [slot_of[v] for v in graph.invars]
        kept_roots = {alias.get(v, v) for v in kept}
        last_use: dict[Var, int] = {}
        for i, e in enumerate(eqns):
            for v in e.invars:
                last_use[alias.get(v, v)] = i
        frees: list[list[int]] = [[] for _ in eqns]
        for v, i in last_use.items():
            if v not in kept_roots and v not in inputs:
                frees[i].append(slot_of[v])
        # A value no equation reads and nobody keeps dies at once.
        for i, e in enumerate(eqns):
            for v in e.outvars:
                if v is not None and v not in last_use and v not in kept_roots:
                    frees[i].append(slot_of[v])
        self.steps = [self._step(e, slot_of, f) for e, f in zip(eqns, frees)]
        self.out_slots = [slot_of[v] if isinstance(v, Var) else v for v in graph.outvars]
        self.grad_slots = [(i, slot_of[v]) for i, v in graph.grads]
        self.slot_of = slot_of

    @staticmethod
    def _step(e: Eqn, slot_of: dict[Var, int], frees: list[int]) -> tuple:
        bind_args = _binder(e.args, slot_of)
        bind_kwargs = _binder(e.kwargs, slot_of) if e.kwargs else None
        outs = [(j, slot_of[v]) for j, v in enumerate(e.outvars) if v is not None]
        # The overload's C++ entry point, without OpOverload.__call__'s Python frame.
        return getattr(e.prim, "_op", e.prim), bind_args, bind_kwargs, outs, frees

    def run_env(self, inputs: Sequence[torch.Tensor]) -> list:
        """Run on real inputs (parallel to the graph's invars); returns the environment of live slots."""
        env: list = [None] * self.nslots
        for s, x in zip(self.in_slots, inputs):
            env[s] = x
        # Below autograd, not under no_grad: some kernels (mkldnn RNN) skip saving what their backward
        # needs when grad mode is off, and the staged backward needs it.
        with torch._C._AutoDispatchBelowAutograd():
            for prim, bind_args, bind_kwargs, outs, frees in self.steps:
                result = prim(*bind_args(env)) if bind_kwargs is None else prim(*bind_args(env), **bind_kwargs(env))
                if type(result) is torch.Tensor:  # the common case; a list (split) or tuple is flattened
                    env[outs[0][1]] = result
                else:
                    flat = flatten(result)
                    for j, s in outs:
                        env[s] = flat[j]
                    flat = None
                # Drop the loop's own references too, or an output nobody reads outlives its free.
                result = None
                for s in frees:
                    env[s] = None
        return env

    def outputs(self, env: list) -> list:
        return [x.value if isinstance(x, Literal) else env[x] for x in self.out_slots]

    def run(self, inputs: Sequence[torch.Tensor]) -> tuple[list, list[tuple[int, torch.Tensor]]]:
        """Run; return the flat outputs and the (input position, gradient) pairs to accumulate."""
        env = self.run_env(inputs)
        return self.outputs(env), [(i, env[s]) for i, s in self.grad_slots]


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """What autograd's AccumulateGrad does for a dense leaf: set ``.grad`` or add into it in place."""
    if param.grad is None:
        if grad.stride() != param.stride() or grad.untyped_storage().data_ptr() == param.untyped_storage().data_ptr():
            grad = torch.empty_strided(param.shape, param.stride(), dtype=param.dtype, device=param.device).copy_(grad)
        param.grad = grad
    else:
        with torch.no_grad():
            param.grad.add_(grad)

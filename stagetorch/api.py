"""The public entry points that stage a function: ``make_ir``, ``eval_shape`` and ``jit``.

``jit`` caches one staged program per input signature and runs it with the chunked executor, which runs
the whole batch at once when it fits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
import torch.utils._pytree as pytree

from . import shapes
from .execute import Program, accumulate_grad
from .ir import Aval, Graph
from .tracing import State, Traced, discover, trace

__all__ = ["make_ir", "eval_shape", "jit", "Staged"]


def _signature(leaves: list, static: set[int], leaf_argnum: list[int]) -> tuple:
    sig = []
    for leaf, argnum in zip(leaves, leaf_argnum):
        if isinstance(leaf, torch.Tensor) and argnum not in static:
            sig.append((leaf.shape, leaf.dtype, leaf.device, leaf.requires_grad))
        else:
            try:
                hash(leaf)
                sig.append(("static", type(leaf), leaf))
            except TypeError:
                sig.append(("static-id", id(leaf)))
    return tuple(sig)


def _leaf_argnums(args: Sequence, kwargs: dict) -> list[int]:
    out = []
    for i, a in enumerate(args):
        out += [i] * len(pytree.tree_leaves(a))
    for a in kwargs.values():
        out += [-1] * len(pytree.tree_leaves(a))
    return out


def make_ir(fn: Callable, *, static_argnums: Sequence[int] = ()) -> Callable[..., Graph]:
    """Stage ``fn`` and return its :class:`~stagetorch.Graph`, forward and backward.

    ``make_ir(fn)(*args, **kwargs)`` traces ``fn`` on abstract copies of the arguments; no real tensor is
    read or changed. Print the result to read the staged program.
    """

    @functools.wraps(fn)
    def staged(*args: Any, **kwargs: Any) -> Graph:
        return trace(fn, args, kwargs, static_argnums=static_argnums).graph

    return staged


def eval_shape(fn: Callable, *, static_argnums: Sequence[int] = ()) -> Callable[..., Any]:
    """``fn``'s outputs as :class:`~stagetorch.Aval`, in the same structure, without running it."""

    @functools.wraps(fn)
    def shaped(*args: Any, **kwargs: Any) -> Any:
        graph = trace(fn, args, kwargs, static_argnums=static_argnums).graph
        outs = [o.value if not isinstance(o, Aval) and hasattr(o, "value") else o for o in shapes.infer(graph)]
        return pytree.tree_unflatten(outs, graph.out_tree)

    return shaped


@attrs.define
class _Entry:
    traced: Traced
    program: Program


class Staged:
    """A function staged by :func:`jit`. Call it like the function; inspect it with ``graph``/``plan``."""

    def __init__(
        self,
        fn: Callable,
        *,
        batch_dim: int = 0,
        batch_argnums: Sequence[int] | None = None,
        static_argnums: Sequence[int] = (),
        memory_budget: int | str | None = None,
    ):
        self.fn = fn
        self.batch_dim = batch_dim
        self.batch_argnums = None if batch_argnums is None else tuple(batch_argnums)
        self.static_argnums = tuple(static_argnums)
        self.memory_budget = memory_budget
        self._cache: dict[tuple, _Entry] = {}
        functools.update_wrapper(self, fn)

    def _stage(self, args: tuple, kwargs: dict) -> tuple[_Entry, list, State]:
        state = discover(self.fn, args, kwargs)
        leaves, tree = pytree.tree_flatten((args, kwargs))
        static = set(self.static_argnums)
        key = (tree, _signature(leaves, static, _leaf_argnums(args, kwargs)), state.key())
        entry = self._cache.get(key)
        if entry is None:
            traced = trace(self.fn, args, kwargs, static_argnums=self.static_argnums, state=state)
            entry = _Entry(traced, Program(traced.graph))
            self._cache[key] = entry
        argnums = _leaf_argnums(args, kwargs)
        inputs = [x for x, a in zip(leaves, argnums) if isinstance(x, torch.Tensor) and a not in static]
        inputs += [t for _, _, t in state.named_state()]
        inputs += entry.traced.consts
        return entry, inputs, state

    def graph(self, *args: Any, **kwargs: Any) -> Graph:
        """The staged program for these arguments (staging it if needed)."""
        return self._stage(args, kwargs)[0].traced.graph

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        entry, inputs, _ = self._stage(args, kwargs)
        outs, grads = entry.program.run(inputs)
        for i, g in grads:
            accumulate_grad(inputs[i], g)
        return pytree.tree_unflatten(outs, entry.traced.graph.out_tree)


def jit(
    fn: Callable | None = None,
    *,
    batch_dim: int = 0,
    batch_argnums: Sequence[int] | None = None,
    static_argnums: Sequence[int] = (),
    memory_budget: int | str | None = None,
) -> Any:
    """Stage ``fn`` once per input signature and run the staged program.

    Usable bare (``@stagetorch.jit``) or with options (``@stagetorch.jit(memory_budget="2GiB")``).

    **Arguments**

    - ``batch_dim``: the batch dimension of every batched tensor argument.
    - ``batch_argnums``: which positional arguments carry the batch (default: every tensor argument).
    - ``static_argnums``: positional arguments that are Python values steering control flow; a new value
      stages a new program.
    - ``memory_budget``: bytes (or ``"512MiB"``) the step may use; default: the device's free memory.

    **Returns** a :class:`Staged` callable.
    """
    options = dict(
        batch_dim=batch_dim, batch_argnums=batch_argnums, static_argnums=static_argnums, memory_budget=memory_budget
    )
    if fn is None:
        return lambda f: Staged(f, **options)
    return Staged(fn, **options)

"""The tree walks the passes need over ATen arguments and results (lists, tuples, dicts)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def map_leaves(tree: Any, leaf_type: type | tuple[type, ...], fn: Callable[[Any], Any]) -> Any:
    """``tree`` with every leaf of ``leaf_type`` replaced by ``fn(leaf)``; containers rebuilt, rest kept."""
    if isinstance(tree, leaf_type):
        return fn(tree)
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_leaves(x, leaf_type, fn) for x in tree)
    if isinstance(tree, dict):
        return {k: map_leaves(v, leaf_type, fn) for k, v in tree.items()}
    return tree


def flatten(out: Any) -> list[Any]:
    """An op's result as a flat list, nested tuples and lists (``split``, multi-output ops) unrolled."""
    if isinstance(out, (tuple, list)):
        return [y for x in out for y in flatten(x)]
    return [out]


def flat_call(args: tuple, kwargs: dict) -> list[Any]:
    """A call's arguments as one flat list: the number of positional arguments, each leaf, a marker with
    the type and length of each nested list or tuple, and the keyword names. Two calls with equal flat
    lists have the same structure (what the tracer's metadata cache and lazy replay compare)."""
    out: list[Any] = [len(args)]
    _extend(args, out)
    if kwargs:
        out.append(tuple(kwargs))
        _extend(kwargs.values(), out)
    return out


def _extend(items: Any, out: list) -> None:
    for x in items:
        kind = type(x)
        if kind is tuple or kind is list:
            out.append((kind, len(x)))
            _extend(x, out)
        else:
            out.append(x)


def unflat_call(flat: list) -> tuple[tuple, dict]:
    """The ``(args, kwargs)`` of a :func:`flat_call` list (with its leaves possibly replaced)."""
    it = iter(flat)
    args = tuple(_take(it, next(it)))
    names = next(it, None)
    return args, dict(zip(names, _take(it, len(names)))) if names is not None else {}


def _take(it: Any, n: int) -> list:
    out = []
    for _ in range(n):
        x = next(it)
        if type(x) is tuple and len(x) == 2 and (x[0] is tuple or x[0] is list):
            out.append(x[0](_take(it, x[1])))
        else:
            out.append(x)
    return out

"""The two tree walks every pass needs over ATen arguments and results (lists, tuples, dicts)."""

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

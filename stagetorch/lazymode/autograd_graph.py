"""Reading an autograd graph without running it: its leaves, its node types, and what its nodes saved.

What the backward replay compares from one step to the next, and where a skipped backward takes the real
tensors the engine would have used.
"""

from __future__ import annotations

from typing import Any

import torch

from .tensor import LazyTensor


def autograd_graph(roots: list[torch.Tensor]) -> tuple[list[torch.Tensor], tuple, list]:
    """The leaf tensors a backward from ``roots`` accumulates into (its graph's AccumulateGrad nodes), the
    graph's node types in a fixed walk order, and the nodes in that order."""
    leaves, kinds, nodes, seen, stack = [], [], [], set(), [t.grad_fn for t in reversed(roots)]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nodes.append(node)
        kinds.append(type(node))
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves.append(variable)
        stack.extend(n for n, _ in node.next_functions)
    return leaves, tuple(kinds), nodes

_SAVED_ATTRS: dict[type, list[str]] = {}

class Unreadable(Exception):
    """A saved value autograd cannot hand out without running an op on a lazy tensor."""

def saved_state(nodes: list, only: list[tuple[int, str]] | None = None) -> tuple[tuple, dict]:
    """What the graph's nodes saved for their backward formulas: a summary to compare, ((node index in walk
    order, attribute, value) with each Python value, the variable of each lazy tensor and the metadata of
    each real tensor), and the real tensors by (node index, attribute). Read before the engine runs: it
    frees them. ``only``: just these attributes."""
    summary, real = [], {}
    if only is None:
        only = []
        for i, node in enumerate(nodes):
            kind = type(node)
            names = _SAVED_ATTRS.get(kind)
            if names is None:
                names = _SAVED_ATTRS[kind] = [a for a in dir(node) if a.startswith("_saved_")]
            only.extend((i, name) for name in names)
    for i, name in only:
        try:
            x = getattr(nodes[i], name)
        except Exception:  # not readable (released, or a saved value that needs an op): compare its absence
            summary.append((i, name, Unreadable))
            continue
        if isinstance(x, torch.Tensor):
            if type(x) is not LazyTensor:
                real[(i, name)] = x
            summary.append((i, name, _summary(x)))
        elif isinstance(x, (list, tuple)):
            summary.append((i, name, tuple(_summary(y) if isinstance(y, torch.Tensor) else y for y in x)))
        else:
            summary.append((i, name, x))
    return tuple(summary), real

def is_lazy_summary(value: Any) -> bool:
    """A saved attribute that is one lazy tensor (a list of tensors is always compared whole)."""
    return type(value) is tuple and len(value) == 2 and isinstance(value[0], str) and value[0] == "lazy"

def _summary(t: torch.Tensor) -> tuple:
    if type(t) is LazyTensor:
        return ("lazy", t._var)
    meta = (t.shape, t.stride(), t.storage_offset(), t.dtype, t.device, t.layout)
    if t.ndim == 0 and t.device.type == "cpu":
        # A Python number autograd saved as a tensor (`weight * scale`): the backward call gets it back as
        # a number, recorded in the step, so its value is part of what must match.
        return (*meta, t.item())
    return meta

PYTHON_FUNCTION_NODE = torch.autograd.function.BackwardCFunction

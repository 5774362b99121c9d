"""The shape interpreter: walks a Graph on abstract values, with the registry's shape rules.

An op without an explicit rule falls back to its meta kernel. It knows the IR and the registry only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import ShapeError, UnsupportedOpError
from ..ir import Aval, Eqn, Graph, Literal, Var, op_name
from ..ir import check as ir_check
from ..registry import slot
from ..utils.tree import flatten, map_leaves

__all__ = ["infer", "abstract_eval", "check"]


def _to_meta(x: Any) -> Any:
    if isinstance(x, Aval):
        return torch.empty(x.shape, dtype=x.dtype, device="meta")
    if isinstance(x, (list, tuple)):
        return type(x)(_to_meta(y) for y in x)
    if isinstance(x, dict):
        return {k: _to_meta(v) for k, v in x.items()}
    if isinstance(x, torch.device):
        return torch.device("meta")
    return x


def _first_device(tree: Any) -> torch.device:
    if isinstance(tree, Aval):
        return tree.device
    if isinstance(tree, (list, tuple)):
        for x in tree:
            d = _first_device(x)
            if d is not None:
                return d
    if isinstance(tree, dict):
        return _first_device(list(tree.values()))
    return None


def meta_eval(prim: Any, args: tuple, kwargs: dict) -> list[Aval | None]:
    """Output avals of ``prim`` from its meta kernel, on the device of its first tensor argument."""
    device = _first_device((args, kwargs)) or kwargs.get("device") or torch.device("cpu")
    meta_kwargs = _to_meta(kwargs)
    try:
        out = prim(*_to_meta(args), **meta_kwargs)
    except NotImplementedError as e:
        packet = op_name(getattr(prim, "overloadpacket", prim))
        raise UnsupportedOpError(
            f"{op_name(prim)} has no meta kernel and stagetorch has no shape rule for it, so the shapes of its "
            f"outputs cannot be known without running it.\nWhat to do: teach it with one call: "
            f"stagetorch.ops.register(torch.ops.{packet}, shape=rule), where rule(*args, **kwargs) takes the "
            f"arguments with a stagetorch.Aval for each tensor and returns the output Aval (or a tuple of them)."
        ) from e
    except (RuntimeError, ValueError, IndexError, TypeError) as e:
        raise ShapeError(f"{op_name(prim)}: {str(e).strip().splitlines()[0]}") from e
    return [Aval(t.shape, t.dtype, device) if isinstance(t, torch.Tensor) else None for t in flatten(out)]


def abstract_eval(prim: Any, args: tuple, kwargs: dict) -> list[Aval | None]:
    """Output avals of one call with Avals for tensors: the explicit rule if registered, else meta."""
    rule = slot(prim, "shape")
    if rule is None:
        return meta_eval(prim, args, kwargs)
    out = rule(*args, **kwargs)
    return [o if isinstance(o, Aval) else None for o in flatten(out)]


def infer(graph: Graph, in_avals: Sequence[Aval] | None = None) -> list[Aval | Literal]:
    """The output avals of ``graph`` given avals for its inputs (its own, by default).

    Raises :class:`ShapeError` naming the op, its operand shapes and the user's line when an op cannot take
    what it is given.
    """
    env: dict[Var, Aval] = dict(zip(graph.invars, in_avals if in_avals is not None else (v.aval for v in graph.invars)))
    for e in graph.eqns:
        _infer_eqn(e, env)
    return [env[v] if isinstance(v, Var) else v for v in graph.outvars]


def _infer_eqn(e: Eqn, env: dict[Var, Aval]) -> None:
    args, kwargs = map_leaves(e.args, Var, env.__getitem__), map_leaves(e.kwargs, Var, env.__getitem__)
    try:
        outs = abstract_eval(e.prim, args, kwargs)
    except ShapeError as err:
        raise ShapeError(f"{err} at {e.source}") from err
    except UnsupportedOpError as err:
        first, _, rest = str(err).partition("\n")
        raise UnsupportedOpError(f"{first} (at {e.source})\n{rest}") from err
    for v, a in zip(e.outvars, outs):
        if v is not None:
            env[v] = a if a is not None else v.aval


def check(graph: Graph) -> Graph:
    """:func:`stagetorch.ir.check` with the registry's shape rules (else meta kernels) for the avals."""
    return ir_check(graph, abstract_eval=abstract_eval)

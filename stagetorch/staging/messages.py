"""The words of the errors an op meets while it is staged: operands that fail, a tensor's value needed
where only its shape is known, a value read on the host that depends on the parameters, an op with no fake
kernel, a kernel that reads a tensor argument's data.

Each message is made from the op, its operands and the user's line (:func:`stagetorch.staging.source.code_line`),
and says what to do.

What it must not know: the recorder, the state, or when an error is raised (the recorder and the trace decide).
"""

from __future__ import annotations

from typing import Any

import torch

from ..ir import Aval, SourceInfo, op_name
from .source import code_line

__all__ = [
    "shape_message", "concretization_message", "host_read_message", "unsupported_message", "reads_data_message",
]


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return str(Aval.of(x))
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(_describe(y) for y in x) + "]"
    return repr(x)


def shape_message(func: Any, args: tuple, kwargs: dict, src: SourceInfo, e: Exception | str) -> str:
    operands = ", ".join([_describe(a) for a in args] + [f"{k}={_describe(v)}" for k, v in kwargs.items()])
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"{op_name(func)}({operands}) failed at {src}:{code_line(src)}\n{first}"


def concretization_message(func: Any, src: SourceInfo) -> str:
    return (
        f"{op_name(func)} at {src} needs a tensor's value, but stagetorch.jit stages with shapes only:"
        f"{code_line(src)}\n"
        "This is data-dependent Python control flow or output shape (.item(), float(t), `if t:`, "
        "boolean-mask indexing, nonzero). What to do: pass Python values that steer control flow as static "
        "arguments (stagetorch.jit(fn, static_argnums=...)); select with torch.where(cond, a, b) instead of "
        "`if`; or use stagetorch.lazy(...), which evaluates such reads eagerly."
    )


def host_read_message(func: Any, src: SourceInfo, depends_on: str = "the parameters or on activations") -> str:
    """``depends_on``: what the value read follows from that the call does not know before its program runs
    (the parameters it was computed from, an argument that requires grad)."""
    return (
        f"{op_name(func)} at {src} reads a tensor's value on the host, and that value depends on {depends_on}:"
        f"{code_line(src)}\nstagetorch.jit computes on the host only values that follow from the step's arguments "
        "and constants that need no gradient (labels, masks, lengths, inputs, of any dtype) and random draws; a "
        "value computed from the model's parameters or outputs is known only when the staged program runs. What "
        "to do: make the decision outside the staged step (return the loss and test it after the call, e.g. for "
        "early stopping), or pass the Python value that steers it as a static argument (stagetorch.jit(fn, "
        "static_argnums=...)); select with torch.where(cond, a, b) instead of `if`; keep shapes fixed with a mask "
        "(loss * mask) instead of x[mask]; or use stagetorch.lazy(...), which evaluates such reads eagerly."
    )


def unsupported_message(func: Any, src: SourceInfo, detail: str = "") -> str:
    name = op_name(func)
    return (
        f"{name} at {src} has no fake (meta) kernel, so stagetorch cannot infer its output shape."
        f"{code_line(src)}\nWhat to do: teach it with one line: stagetorch.ops.register(torch.ops.{name}, "
        "shape=lambda *args, **kwargs: stagetorch.Aval(shape, dtype, device)), or give the op a fake impl "
        "with torch.library.register_fake." + (f"\n({detail.splitlines()[0]})" if detail else "")
    )


def reads_data_message(func: Any, src: SourceInfo) -> str:
    name = getattr(func, "__qualname__", "")
    name = name if name.startswith("Tensor.") else f"torch.{getattr(func, '__name__', func)}"
    return (
        f"{name} at {src} reads the values of a tensor argument, but stagetorch.jit stages with shapes "
        f"only:{code_line(src)}\nWhat to do: pass those values as Python numbers (torch.tensor_split(x, [1, "
        "3]) rather than a tensor of split points; .tolist() outside the staged function), or build the tensor "
        "in the function from Python data (torch.tensor([1, 3])), which stagetorch reads; or use "
        "stagetorch.lazy(...), which evaluates such reads eagerly."
    )

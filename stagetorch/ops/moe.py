"""Rules for mixture-of-experts layers: the grouped matrix product ``aten._grouped_mm`` that runs every
expert in one kernel, and the routing around it.

``_grouped_mm(a, b, offs)`` multiplies groups of rows (or columns) of one operand by one matrix each of the
other; ``offs`` holds the groups' cumulative ends. Its layouts:

- ``a [M, K]`` 2-d, ``b [G, K, N]`` 3-d: rows ``offs[g-1]:offs[g]`` of ``a`` times ``b[g]`` -> ``[M, N]``
  (an MoE layer's experts over its tokens, sorted by expert);
- ``a [G, M, K]`` 3-d, ``b [K, N]`` 2-d: ``a[g]`` times columns ``offs[g-1]:offs[g]`` of ``b`` -> ``[M, N]``;
- ``a [M, K]`` 2-d, ``b [K, N]`` 2-d: columns ``offs[g-1]:offs[g]`` of ``a`` times those rows of ``b``
  -> ``[G, M, N]`` (the expert weights' gradient: a sum over each expert's tokens);
- ``a [G, M, K]``, ``b [G, K, N]``, no ``offs``: a batched product -> ``[G, M, N]``.

Its meta kernel accepts bfloat16 only (the CUDA kernel's fast path), while the CPU kernel runs float32,
float16 and bfloat16: the shape rule here follows the kernel, and the tracer believes it where the meta
kernel refuses.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import ShapeError
from ..ir import Aval, Eqn, Var

aten = torch.ops.aten

_GROUPED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _refuse(why: str, *avals: Any) -> ShapeError:
    shapes = ", ".join(str(a) for a in avals if isinstance(a, Aval))
    return ShapeError(f"aten._grouped_mm: {why} ({shapes})")


def grouped_mm(a: Aval, b: Aval, offs: Aval | None = None, bias: Aval | None = None, out_dtype: Any = None) -> Aval:
    """The output of ``aten._grouped_mm`` in each of its four layouts, with the kernel's checks."""
    operands = (a, b, offs)
    if a.ndim not in (2, 3) or b.ndim not in (2, 3):
        raise _refuse("operands must be 2-d or 3-d", *operands)
    for name, x in (("mat_a", a), ("mat_b", b)):
        if x.dtype not in _GROUPED_DTYPES:
            raise _refuse(f"{name} must be float32, float16 or bfloat16, not {x.dtype}", *operands)
    if a.dtype != b.dtype:
        raise _refuse("operands must have the same dtype", *operands)
    if out_dtype is not None and out_dtype != a.dtype:
        raise _refuse(f"out_dtype {out_dtype} must be the operands' dtype", *operands)
    if bias is not None:
        raise _refuse("a bias is not supported", *operands)
    grouped = a.ndim == 2 or b.ndim == 2
    if grouped != (offs is not None):
        raise _refuse("offsets are needed exactly when an operand is 2-d", *operands)
    if offs is not None and (offs.ndim != 1 or offs.dtype != torch.int32):
        raise _refuse("offsets must be a 1-d int32 tensor", *operands)
    if a.shape[-1] != b.shape[-2]:
        raise _refuse(f"contraction dims differ: {a.shape[-1]} vs {b.shape[-2]}", *operands)
    if a.ndim == 2 and b.ndim == 2:
        shape: tuple[int, ...] = (offs.shape[0], a.shape[0], b.shape[1])
    elif a.ndim == 2:
        if offs.shape[0] != b.shape[0]:
            raise _refuse(f"{offs.shape[0]} offsets for {b.shape[0]} matrices", *operands)
        shape = (a.shape[0], b.shape[2])
    elif b.ndim == 2:
        if offs.shape[0] != a.shape[0]:
            raise _refuse(f"{offs.shape[0]} offsets for {a.shape[0]} matrices", *operands)
        shape = (a.shape[1], b.shape[1])
    else:
        if a.shape[0] != b.shape[0]:
            raise _refuse(f"batch sizes differ: {a.shape[0]} vs {b.shape[0]}", *operands)
        shape = (a.shape[0], a.shape[1], b.shape[2])
    return Aval(shape, a.dtype, a.device)


def grouped_mm_flops(eqn: Eqn) -> int:
    """Each output entry is one dot product over the contraction dim, except in the 2-d x 2-d layout, where
    the groups split the contraction dim between them (``M x K x N`` multiply-adds in all). Rows past
    ``offs[-1]`` are counted: the bound, reached when every row belongs to a group."""
    a, b = eqn.args[0], eqn.args[1]
    assert isinstance(a, Var) and isinstance(b, Var)
    out = eqn.outvars[0].aval.shape
    k = a.aval.shape[-1]
    if a.aval.ndim == 2 and b.aval.ndim == 2:
        return 2 * a.aval.numel * b.aval.shape[1]
    return 2 * math.prod(out) * k


SHAPE: dict = {aten._grouped_mm: grouped_mm}

FLOPS: dict = {aten._grouped_mm: grouped_mm_flops}

"""Generic shape rules (broadcasting, reductions, contractions, views) that the family tables reuse.

A shape rule is called with the op's arguments, :class:`~stagetorch.Aval` in place of tensors, and returns
an Aval or a tuple of them (``None`` for an undefined output). It raises :class:`~stagetorch.ShapeError`
naming the op and the shapes. Type promotion is torch's own (``torch._prims_common.elementwise_dtypes``, the
helper behind torch's reference implementations), never re-derived.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as Promotion
from torch._prims_common import elementwise_dtypes

from ..errors import ShapeError
from ..ir import Aval

__all__ = [
    "Promotion", "result_dtype", "same", "broadcast", "compare", "matmul", "addmm", "bmm", "transpose_2d", "view",
    "expand", "permute", "transpose", "unsqueeze", "squeeze", "select", "slice_", "split", "constant_pad", "cat",
    "stack", "reduce", "softmax",
]


def _fail(op: str, why: str, *avals: Any) -> ShapeError:
    shapes = ", ".join(str(a) for a in avals if isinstance(a, Aval))
    return ShapeError(f"aten.{op}: {why} ({shapes})")


def _probe(x: Any) -> Any:
    """A meta stand-in for an aval in type promotion: 0-dim for a 0-dim aval, 1-element otherwise (dimensioned
    tensors outrank 0-dim ones and numbers)."""
    if isinstance(x, Aval):
        return torch.empty(() if x.ndim == 0 else (1,), dtype=x.dtype, device="meta")
    return x


def result_dtype(*operands: Any, kind: Promotion = Promotion.DEFAULT) -> torch.dtype:
    """The dtype torch gives an elementwise op over ``operands`` (avals and Python numbers; others ignored)."""
    probes = [_probe(x) for x in operands if isinstance(x, (Aval, bool, int, float, complex))]
    return elementwise_dtypes(*probes, type_promotion_kind=kind)[1]


def _device(*operands: Any) -> torch.device:
    for x in operands:
        if isinstance(x, Aval) and x.ndim > 0:
            return x.device
    for x in operands:
        if isinstance(x, Aval):
            return x.device
    return torch.device("cpu")


def broadcast_shapes(op: str, *avals: Aval) -> tuple[int, ...]:
    out: list[int] = []
    for a in avals:
        shape = list(a.shape)
        if len(shape) > len(out):
            out = [1] * (len(shape) - len(out)) + out
        shape = [1] * (len(out) - len(shape)) + shape
        for i, (x, y) in enumerate(zip(out, shape)):
            if x != y and x != 1 and y != 1:
                raise _fail(op, f"shapes cannot broadcast at dim {i}: {x} vs {y}", *avals)
            out[i] = y if x == 1 else x
    return tuple(out)


def same(op: str, *, dtype_arg: str | None = None) -> Callable[..., Aval]:
    """Output like the first argument (unary ops, clones, ``*_like``; ``dtype=`` honoured)."""

    def rule(x: Aval, *args: Any, **kwargs: Any) -> Aval:
        dtype = kwargs.get(dtype_arg) if dtype_arg else None
        return Aval(x.shape, dtype or x.dtype, kwargs.get("device") or x.device)

    return rule


def broadcast(
    op: str, *, tensors: int = 2, kind: Promotion = Promotion.DEFAULT, bool_ok: bool = True
) -> Callable[..., Aval]:
    """Broadcasting elementwise ops over the first ``tensors`` arguments (tensors or numbers), with torch's
    type promotion of the given ``kind``. Unary math is ``tensors=1``. ``bool_ok=False``: the kernels have
    no bool implementation (their meta kernels accept bool anyway)."""

    def rule(*args: Any, **kwargs: Any) -> Aval:
        operands = [a for a in args[:tensors] if a is not None]
        avals = [a for a in operands if isinstance(a, Aval)]
        if not avals:
            # Numbers only (``torch.div(seq_len, window, rounding_mode="trunc")``): torch wraps them and
            # returns a 0-dim CPU tensor of the promoted dtype.
            if not any(isinstance(a, (bool, int, float, complex)) for a in operands):
                raise _fail(op, "no tensor or number operand")
            return Aval((), result_dtype(*operands, kind=kind), _device())
        if not bool_ok and any(a.dtype == torch.bool for a in avals):
            raise _fail(op, "bool tensors are not supported; convert with .float() or .int() first", *avals)
        return Aval(broadcast_shapes(op, *avals), result_dtype(*operands, kind=kind), _device(*avals))

    return rule


def compare(op: str) -> Callable[..., Aval]:
    return broadcast(op, kind=Promotion.ALWAYS_BOOL)


def _same_dtype(op: str, *avals: Aval | None) -> None:
    present = [a for a in avals if a is not None]
    if len({a.dtype for a in present}) > 1:
        raise _fail(op, "operands must have the same dtype", *present)


def matmul(a: Aval, b: Aval) -> Aval:
    if a.ndim != 2 or b.ndim != 2:
        raise _fail("mm", "both operands must be matrices", a, b)
    if a.shape[1] != b.shape[0]:
        raise _fail("mm", f"contraction dims differ: {a} @ {b}", a, b)
    _same_dtype("mm", a, b)
    return Aval((a.shape[0], b.shape[1]), a.dtype, a.device)


def addmm(bias: Aval, a: Aval, b: Aval, *, beta: Any = 1, alpha: Any = 1) -> Aval:
    out = matmul(a, b)
    _same_dtype("addmm", bias, a, b)
    if broadcast_shapes("addmm", bias, out) != out.shape:
        raise _fail("addmm", f"bias {bias} does not broadcast to {out}", bias, a, b)
    return out


def bmm(a: Aval, b: Aval) -> Aval:
    if a.ndim != 3 or b.ndim != 3:
        raise _fail("bmm", "both operands must be 3-d", a, b)
    if a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise _fail("bmm", f"batch or contraction dims differ: {a} @ {b}", a, b)
    _same_dtype("bmm", a, b)
    return Aval((a.shape[0], a.shape[1], b.shape[2]), a.dtype, a.device)


def transpose_2d(x: Aval) -> Aval:
    if x.ndim > 2:
        raise _fail("t", "expects a tensor with at most 2 dims", x)
    return Aval(tuple(reversed(x.shape)), x.dtype, x.device)


def _wrap(op: str, d: int, ndim: int, x: Aval) -> int:
    n = max(ndim, 1)
    if not -n <= d < n:
        raise _fail(op, f"dim {d} out of range for {ndim} dims", x)
    return d % n


def view(x: Aval, shape: Sequence[int]) -> Aval:
    shape = list(shape)
    if shape.count(-1) > 1:
        raise _fail("view", "only one dim can be -1", x)
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if known == 0 or x.numel % known:
            raise _fail("view", f"shape {shape} is invalid for {x.numel} elements", x)
        shape[shape.index(-1)] = x.numel // known
    if math.prod(shape) != x.numel:
        raise _fail("view", f"shape {shape} is invalid for {x.numel} elements", x)
    return Aval(tuple(shape), x.dtype, x.device)


def expand(x: Aval, sizes: Sequence[int], *, implicit: bool = False) -> Aval:
    sizes = list(sizes)
    if len(sizes) < x.ndim:
        raise _fail("expand", f"{len(sizes)} sizes for {x.ndim} dims", x)
    offset = len(sizes) - x.ndim
    out = []
    for i, s in enumerate(sizes):
        own = x.shape[i - offset] if i >= offset else 1
        if s == -1:
            if i < offset:
                raise _fail("expand", "-1 is not allowed for a new leading dim", x)
            s = own
        elif own != 1 and own != s:
            raise _fail("expand", f"size {own} at dim {i - offset} cannot expand to {s}", x)
        out.append(s)
    return Aval(tuple(out), x.dtype, x.device)


def permute(x: Aval, dims: Sequence[int]) -> Aval:
    dims = [_wrap("permute", d, x.ndim, x) for d in dims]
    if sorted(dims) != list(range(x.ndim)):
        raise _fail("permute", f"{list(dims)} is not a permutation of {x.ndim} dims", x)
    return Aval(tuple(x.shape[d] for d in dims), x.dtype, x.device)


def transpose(x: Aval, d0: int, d1: int) -> Aval:
    if x.ndim == 0:
        return x
    d0, d1 = _wrap("transpose", d0, x.ndim, x), _wrap("transpose", d1, x.ndim, x)
    shape = list(x.shape)
    shape[d0], shape[d1] = shape[d1], shape[d0]
    return Aval(tuple(shape), x.dtype, x.device)


def unsqueeze(x: Aval, dim: int) -> Aval:
    d = _wrap("unsqueeze", dim, x.ndim + 1, x)
    shape = list(x.shape)
    shape.insert(d, 1)
    return Aval(tuple(shape), x.dtype, x.device)


def squeeze(x: Aval, dim: Any = None) -> Aval:
    if x.ndim == 0:
        return x
    dims = range(x.ndim) if dim is None else [dim] if isinstance(dim, int) else dim
    dims = {_wrap("squeeze", d, x.ndim, x) for d in dims}
    return Aval(tuple(s for i, s in enumerate(x.shape) if not (i in dims and s == 1)), x.dtype, x.device)


def select(x: Aval, dim: int, index: int) -> Aval:
    d = _wrap("select", dim, x.ndim, x)
    if not -x.shape[d] <= index < x.shape[d]:
        raise _fail("select", f"index {index} out of range for dim {d} of size {x.shape[d]}", x)
    return Aval(x.shape[:d] + x.shape[d + 1 :], x.dtype, x.device)


def slice_(x: Aval, dim: int = 0, start: Any = None, end: Any = None, step: int = 1) -> Aval:
    d = _wrap("slice", dim, x.ndim, x)
    if step <= 0:
        raise _fail("slice", "step must be positive", x)
    n = len(range(*slice(start, end, step).indices(x.shape[d])))
    return Aval(x.shape[:d] + (n,) + x.shape[d + 1 :], x.dtype, x.device)


def split(x: Aval, split_size: int, dim: int = 0) -> tuple[Aval, ...]:
    """Pieces of ``split_size`` along ``dim``, the last one shorter; an empty dim gives one empty piece."""
    d = _wrap("split", dim, x.ndim, x)
    size = x.shape[d]
    if split_size < 0 or (split_size == 0 and size > 0):
        raise _fail("split", f"split_size {split_size} cannot split dim {d} of size {size}", x)
    count = max(1, -(-size // split_size)) if split_size else 1
    return tuple(
        Aval(x.shape[:d] + (min(split_size, size - i * split_size),) + x.shape[d + 1 :], x.dtype, x.device)
        for i in range(count)
    )


def constant_pad(x: Aval, pad: Sequence[int], value: Any = 0) -> Aval:
    """``pad`` holds (before, after) pairs from the last dim backwards; negative amounts crop."""
    if len(pad) % 2 or len(pad) // 2 > x.ndim:
        raise _fail("constant_pad_nd", f"padding {list(pad)} does not fit {x.ndim} dims", x)
    shape = list(x.shape)
    for i in range(len(pad) // 2):
        d = x.ndim - 1 - i
        shape[d] += pad[2 * i] + pad[2 * i + 1]
        if shape[d] < 0:
            raise _fail("constant_pad_nd", f"padding {list(pad)} leaves dim {d} with size {shape[d]}", x)
    return Aval(tuple(shape), x.dtype, x.device)


def cat(tensors: Sequence[Aval], dim: int = 0) -> Aval:
    parts = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]
    if not parts:
        return tensors[0]
    ref = parts[0]
    d = _wrap("cat", dim, ref.ndim, ref)
    for t in parts[1:]:
        if t.ndim != ref.ndim or any(a != b for i, (a, b) in enumerate(zip(t.shape, ref.shape)) if i != d):
            raise _fail("cat", f"sizes must match except in dim {d}", *parts)
    shape = list(ref.shape)
    shape[d] = sum(t.shape[d] for t in parts)
    return Aval(tuple(shape), result_dtype(*parts), ref.device)


def stack(tensors: Sequence[Aval], dim: int = 0) -> Aval:
    ref = tensors[0]
    if any(t.shape != ref.shape for t in tensors):
        raise _fail("stack", "expects tensors of equal size", *tensors)
    d = _wrap("stack", dim, ref.ndim + 1, ref)
    shape = list(ref.shape)
    shape.insert(d, len(tensors))
    return Aval(tuple(shape), result_dtype(*tensors), ref.device)


def reduce(op: str, *, dims_arg: int | None = 1, keepdim_arg: int | None = 2, float_out: bool = False) -> Callable:
    """Reductions over ``dim`` (all dims when it is None or empty), ``keepdim`` and ``dtype=`` honoured."""

    def rule(x: Aval, *args: Any, **kwargs: Any) -> Aval:
        full = (x, *args)
        dims = full[dims_arg] if dims_arg is not None and len(full) > dims_arg else kwargs.get("dim")
        keepdim = full[keepdim_arg] if keepdim_arg is not None and len(full) > keepdim_arg else kwargs.get("keepdim", False)
        if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
            dims = list(range(x.ndim))
        elif isinstance(dims, int):
            dims = [dims]
        dims = {_wrap(op, d, x.ndim, x) for d in dims}
        shape = tuple(1 if i in dims else s for i, s in enumerate(x.shape)) if keepdim else tuple(
            s for i, s in enumerate(x.shape) if i not in dims
        )
        dtype = kwargs.get("dtype") or x.dtype
        if dtype in (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32) and op == "sum" and not kwargs.get("dtype"):
            dtype = torch.int64
        if float_out and not dtype.is_floating_point and not dtype.is_complex:
            raise _fail(op, f"expects a floating point input, got {dtype}", x)
        return Aval(shape, dtype, x.device)

    return rule


def softmax(op: str) -> Callable:
    def rule(x: Aval, dim: int, half_to_float: bool) -> Aval:
        _wrap(op, dim, x.ndim, x)
        return Aval(x.shape, torch.float32 if half_to_float else x.dtype, x.device)

    return rule

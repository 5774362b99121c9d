"""Generic batch rules, which the op families' tables reuse (as JAX's batching module owns its generic
batchers): per-example ops, contractions, reductions, views, concatenations, softmax, ops that mix entries
along some dims.

A batch rule is ``rule(eqn, label) -> Chunked``: ``label(x)`` is the ``Batched`` label of an argument
(``None`` when shared) and ``label.batch`` the full batch size. It says how the equation runs on a chunk and
what its outputs are, or raises ``BatchCouplingError`` (via :func:`~stagetorch.interpreters.batching.coupling`)
when a chunk cannot compute its share exactly. Rules for one op family (losses, embedding, BatchNorm, RNN)
live in that family's file under ``stagetorch/ops/``; the rule of a pointwise op
(:func:`~stagetorch.interpreters.batching.elementwise`) lives with the analysis, which applies it to every op
tagged pointwise that has no rule of its own.

It knows the IR and the batch analysis's labels and rule interface (:mod:`stagetorch.interpreters.batching`);
it names no op of the registry's tables and runs nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import batch_keyword
from ..ir import Eqn, Var
from .batching import (
    Batched,
    Chunked,
    LabelFn,
    Reduced,
    agree,
    arg_vars,
    coupling,
    elementwise,
    with_chunk_sizes,
)

__all__ = [
    "per_example", "contraction", "reduction", "mean_reduction", "view", "expand", "permute", "transpose",
    "unsqueeze", "squeeze", "select", "slice_", "split", "cat", "stack", "softmax", "along", "same_in_every_chunk",
    "batch_size_list",
]


def same_in_every_chunk(eqn: Eqn, label: LabelFn) -> Chunked:
    """An op whose outputs do not depend on which chunk runs it (e.g. an empty placeholder)."""
    return Chunked(tuple(None for _ in eqn.outvars))


def per_example(
    *,
    dim: int = 0,
    outputs: Sequence[str | None] | None = None,
    slice_args: Sequence[int] = (),
    batch_size_args: Sequence[int] = (),
    size_list_args: Sequence[int] = (),
) -> Callable[[Eqn, LabelFn], Chunked]:
    """An op that treats each example independently along ``dim`` (convolution, pooling, attention...).

    ``outputs`` gives each outvar's kind: ``"b"`` per-example, ``"sum"`` summed over the batch (a weight
    gradient), ``None`` the same in every chunk; by default an output is per-example when its ``dim`` has the
    full batch extent. ``slice_args`` are argument positions that, when shared, are cut to the chunk
    (an initial hidden state). ``batch_size_args`` are integer arguments that carry the batch size itself;
    ``size_list_args`` are full sizes whose entry ``dim`` is the batch size (an upsampling backward's
    ``input_size``).
    """

    def rule(eqn: Eqn, label: LabelFn) -> Chunked:
        placed = [lab for _, v in arg_vars(eqn.args) if (lab := label(v)) is not None]
        bdims = {p.dim for p in placed}
        if bdims != {dim}:
            raise coupling(
                eqn,
                f"is per-example along dim {dim} only, but its input is batched along dim {sorted(bdims)}",
                f"put the batch on dim {dim} of this op's input ({batch_keyword()}), or run without chunking",
            )
        lab = agree(eqn, placed)
        extent = lab.extent(label.batch)
        cut = {}
        for i in slice_args:
            v = _argument(eqn, i)
            if isinstance(v, Var) and label(v) is None and v.aval.ndim > dim and v.aval.shape[dim] == extent:
                cut[v] = lab
        out = []
        for j, v in enumerate(eqn.outvars):
            kind = outputs[j] if outputs is not None and j < len(outputs) else "auto"
            if v is None:
                out.append(None)
            elif kind == "b" or (kind == "auto" and v.aval.ndim > dim and v.aval.shape[dim] == extent):
                out.append(lab)
            elif kind == "sum":
                out.append(Reduced("sum"))
            else:
                out.append(None)
        call = None
        if batch_size_args or size_list_args:

            def call(n: int) -> tuple[Any, tuple, dict]:
                return with_chunk_sizes(eqn, lab, n, batch_size_args, size_list_args)

        return Chunked(tuple(out), call=call, slice=cut)

    return rule


def _argument(eqn: Eqn, i: int) -> Any:
    """Argument ``i`` of the op's schema, passed by position or by keyword (``attn_mask=``)."""
    if i < len(eqn.args):
        return eqn.args[i]
    schema = getattr(eqn.prim, "_schema", None)
    if schema is None or i >= len(schema.arguments):
        return None
    return eqn.kwargs.get(schema.arguments[i].name)


def contraction(
    spec: str, *, bias: bool = False, positions: Sequence[int] | None = None, mixes: str = ""
) -> Callable[[Eqn, LabelFn], Chunked]:
    """Matmul-like ops from an einsum spec (``"ij,jk->ik"``): a batch letter kept in the output stays
    per-example; one summed over becomes a per-chunk partial of a sum (a weight gradient).

    With ``bias=True`` the first argument is added to the product (``addmm``): it broadcasts against the
    output, so its dims take the output's trailing letters; it must not meet a partial sum. ``positions``: the
    argument positions of the spec's operands (default: the first ones). ``mixes``: letters the op combines
    otherwise than by a sum of terms (the features of a distance under its root): the batch there is refused.
    """
    ins, out_spec = spec.split("->")
    in_specs = ins.split(",")

    def rule(eqn: Eqn, label: LabelFn) -> Chunked:
        if positions is not None:
            operands = [eqn.args[i] for i in positions]
        else:
            operands = list(eqn.args[1 : 1 + len(in_specs)] if bias else eqn.args[: len(in_specs)])
        specs = list(in_specs)
        if bias and isinstance(eqn.args[0], Var):
            operands.append(eqn.args[0])
            specs.append(out_spec[len(out_spec) - eqn.args[0].aval.ndim :])
        letters = [(s[lab.dim], lab.moved(0)) for v, s in zip(operands, specs) if (lab := label(v)) is not None]
        letter, lab = agree(eqn, letters)
        if letter in mixes:
            raise coupling(
                eqn,
                "combines entries along the batch dim otherwise than by a sum (the features of a distance)",
                "keep the batch on a dim the op does not combine along, or run without chunking",
            )
        extent = lab.extent(label.batch)
        cut = {}
        for v, s in zip(operands, specs):
            if isinstance(v, Var) and label(v) is None and letter in s:
                pos = s.index(letter)
                if v.aval.shape[pos] == extent and extent != 1:
                    cut[v] = lab.moved(pos)
        if letter in out_spec:
            return Chunked((lab.moved(out_spec.index(letter)),), slice=cut)
        if bias and _beta(eqn) != 0:
            raise coupling(
                eqn,
                "adds a term to a product summed over the batch",
                "add the term outside the sum, or run without chunking",
            )
        return Chunked((Reduced("sum"),), slice=cut)

    return rule


def _beta(eqn: Eqn) -> float:
    return eqn.kwargs.get("beta", eqn.args[3] if len(eqn.args) > 3 else 1)


def _dims(dims: Any, ndim: int) -> list[int]:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return [d % ndim if ndim else 0 for d in dims]


def _reduced_label(
    eqn: Eqn, label: LabelFn, dims_arg: int | None, keepdim_arg: int | None
) -> tuple[Batched, list[int], bool]:
    x = eqn.args[0]
    lab = label(x)
    dims = _dims(eqn.args[dims_arg] if dims_arg is not None and len(eqn.args) > dims_arg else None, x.aval.ndim)
    keepdim = bool(eqn.args[keepdim_arg]) if keepdim_arg is not None and len(eqn.args) > keepdim_arg else False
    keepdim = eqn.kwargs.get("keepdim", keepdim)
    return lab, dims, keepdim


def reduction(kind: str, *, dims_arg: int | None = 1, keepdim_arg: int | None = 2) -> Callable[[Eqn, LabelFn], Chunked]:
    """``sum``/``amax``/``amin``-like: over the batch dim it becomes a partial; otherwise per-example."""

    def rule(eqn: Eqn, label: LabelFn) -> Chunked:
        lab, dims, keepdim = _reduced_label(eqn, label, dims_arg, keepdim_arg)
        if lab.dim in dims:
            return Chunked(tuple(Reduced(kind) if v is not None else None for v in eqn.outvars))
        shift = 0 if keepdim else sum(d < lab.dim for d in dims)
        return Chunked(tuple(lab.moved(lab.dim - shift) if v is not None else None for v in eqn.outvars))

    return rule


def _partial_mean(x: torch.Tensor, dims: list[int], keepdim: bool, count: int, dtype: Any = None) -> torch.Tensor:
    # Divided in place: one tensor, as the memory interpreter counts (``sum / count`` held two at once).
    return torch.sum(x, dims, keepdim=keepdim, dtype=dtype).div_(count)


def mean_reduction(*, dims_arg: int | None = 1, keepdim_arg: int | None = 2) -> Callable[[Eqn, LabelFn], Chunked]:
    """``mean``: over the batch dim a chunk contributes its sum divided by the *full* count."""

    def rule(eqn: Eqn, label: LabelFn) -> Chunked:
        lab, dims, keepdim = _reduced_label(eqn, label, dims_arg, keepdim_arg)
        if lab.dim not in dims:
            shift = 0 if keepdim else sum(d < lab.dim for d in dims)
            return Chunked((lab.moved(lab.dim - shift),))
        x = eqn.args[0]
        count = math.prod(x.aval.shape[d] for d in dims)
        dtype = eqn.kwargs.get("dtype")

        def call(n: int) -> tuple[Any, tuple, dict]:
            return _partial_mean, (x, dims, keepdim, count, dtype), {}

        return Chunked((Reduced("sum"),), call=call)

    return rule


def _view_label(eqn: Eqn, label: LabelFn, in_shape: Sequence[int], out_shape: Sequence[int]) -> Batched:
    """Where the batch lands after a reshape. In logical order the elements factor as
    (everything before the batch) x batch x (everything after); a reshape keeps that order, so the batch lands
    on the output dim whose prefix divides "before" and whose size holds the batch whole."""
    lab = label(eqn.args[0])
    before = math.prod(in_shape[: lab.dim]) * lab.outer
    after = lab.k * math.prod(in_shape[lab.dim + 1 :])
    batch = label.batch
    acc = 1
    for d, size in enumerate(out_shape):
        if before % acc == 0:
            outer = before // acc
            if size % (outer * batch) == 0 and size // (outer * batch) * math.prod(out_shape[d + 1 :]) == after:
                return Batched(d, size // (outer * batch), outer)
        acc *= size
        if acc > before:
            break
    raise coupling(
        eqn,
        f"reshapes {list(in_shape)} to {list(out_shape)}, splitting the batch dim {lab.dim} across dims",
        "keep the batch dim whole (outermost of any dims merged with it) in reshapes",
    )


def view(eqn: Eqn, label: LabelFn) -> Chunked:
    """view/reshape: the batch dim stays whole, possibly merged with inner dims (``k`` grows) or split off."""
    x = eqn.args[0]
    out_shape = eqn.outvars[0].aval.shape
    lab = _view_label(eqn, label, x.aval.shape, out_shape)

    def call(n: int) -> tuple[Any, tuple, dict]:
        new = list(out_shape)
        new[lab.dim] = lab.extent(n)
        return eqn.prim, (x, new, *eqn.args[2:]), eqn.kwargs

    return Chunked((lab,), call=call)


def expand(eqn: Eqn, label: LabelFn) -> Chunked:
    x, sizes = eqn.args[0], list(eqn.args[1])
    lab = label(x)
    lab = lab.moved(lab.dim + len(sizes) - x.aval.ndim)

    def call(n: int) -> tuple[Any, tuple, dict]:
        new = list(sizes)
        new[lab.dim] = lab.extent(n)
        return eqn.prim, (x, new, *eqn.args[2:]), eqn.kwargs

    return Chunked((lab,), call=call)


def _moved(eqn: Eqn, label: LabelFn, new_dim: int) -> Chunked:
    return Chunked((label(eqn.args[0]).moved(new_dim),))


def permute(eqn: Eqn, label: LabelFn) -> Chunked:
    lab = label(eqn.args[0])
    order = [d % eqn.args[0].aval.ndim for d in eqn.args[1]]
    return _moved(eqn, label, order.index(lab.dim))


def transpose(eqn: Eqn, label: LabelFn) -> Chunked:
    lab = label(eqn.args[0])
    ndim = eqn.args[0].aval.ndim
    if eqn.args[0].aval.ndim < 2:
        return _moved(eqn, label, lab.dim)
    d0, d1 = (eqn.args[1] % ndim, eqn.args[2] % ndim) if len(eqn.args) > 2 else (0, 1)
    return _moved(eqn, label, d1 if lab.dim == d0 else d0 if lab.dim == d1 else lab.dim)


def unsqueeze(eqn: Eqn, label: LabelFn) -> Chunked:
    lab = label(eqn.args[0])
    d = eqn.args[1] % (eqn.args[0].aval.ndim + 1)
    return _moved(eqn, label, lab.dim + (d <= lab.dim))


def squeeze(eqn: Eqn, label: LabelFn) -> Chunked:
    x = eqn.args[0]
    lab = label(x)
    shape = x.aval.shape
    dims = _dims(eqn.args[1] if len(eqn.args) > 1 else None, x.aval.ndim)
    gone = [d for d in dims if shape[d] == 1 and d != lab.dim]
    if lab.dim in dims and shape[lab.dim] == 1:
        raise coupling(eqn, "squeezes away a batch dim of size 1", "use a batch larger than one example")
    return _moved(eqn, label, lab.dim - sum(d < lab.dim for d in gone))


def select(eqn: Eqn, label: LabelFn) -> Chunked:
    x, dim = eqn.args[0], eqn.args[1] % eqn.args[0].aval.ndim
    lab = label(x)
    if dim == lab.dim:
        raise coupling(eqn, "picks one example out of the batch", "index examples outside the staged function")
    return _moved(eqn, label, lab.dim - (dim < lab.dim))


def slice_(eqn: Eqn, label: LabelFn) -> Chunked:
    x = eqn.args[0]
    lab = label(x)
    dim = (eqn.args[1] if len(eqn.args) > 1 else 0) % x.aval.ndim
    if dim == lab.dim and eqn.outvars[0].aval.shape[dim] != x.aval.shape[dim]:
        raise coupling(eqn, "slices the batch dim", "slice examples outside the staged function")
    if dim == lab.dim:

        def call(n: int) -> tuple[Any, tuple, dict]:
            return torch.ops.aten.alias.default, (x,), {}

        return Chunked((lab,), call=call)
    return Chunked((lab,))


def batch_size_list(arg: int, label_of_list: Callable[[Eqn, LabelFn], Batched]) -> Callable:
    """A rule for ``*_backward(grad, input_sizes, dim, ...)`` ops whose sizes list carries the batch."""

    def rule(eqn: Eqn, label: LabelFn) -> Chunked:
        lab = label_of_list(eqn, label)

        def call(n: int) -> tuple[Any, tuple, dict]:
            return with_chunk_sizes(eqn, lab, n, (), (arg,))

        return Chunked((lab,), call=call)

    return rule


def split(eqn: Eqn, label: LabelFn) -> Chunked:
    x = eqn.args[0]
    lab = label(x)
    dim_arg = 1 if eqn.prim.overloadpacket is torch.ops.aten.unbind else 2
    dim = (eqn.args[dim_arg] if len(eqn.args) > dim_arg else eqn.kwargs.get("dim", 0)) % x.aval.ndim
    if dim == lab.dim:
        raise coupling(eqn, "splits the batch dim", "split examples outside the staged function")
    if dim < lab.dim and dim_arg == 1:
        return Chunked(tuple(lab.moved(lab.dim - 1) if v is not None else None for v in eqn.outvars))
    return Chunked(tuple(lab if v is not None else None for v in eqn.outvars))


def cat(eqn: Eqn, label: LabelFn) -> Chunked:
    tensors = eqn.args[0]
    dim = eqn.args[1] if len(eqn.args) > 1 else eqn.kwargs.get("dim", 0)
    ndim = eqn.outvars[0].aval.ndim
    dim %= ndim
    lab = agree(eqn, [lab for v in tensors if (lab := label(v)) is not None])
    if lab.dim == dim:
        raise coupling(eqn, "concatenates along the batch dim", "concatenate batches outside the staged function")
    extent = lab.extent(label.batch)
    cut = {
        v: lab
        for v in tensors
        if isinstance(v, Var) and label(v) is None and v.aval.ndim == ndim and v.aval.shape[lab.dim] == extent
    }
    if any(isinstance(v, Var) and label(v) is None and v not in cut and v.aval.numel > 0 for v in tensors):
        raise coupling(eqn, "concatenates per-example values with a shared one", "broadcast the shared value first")
    return Chunked((lab,), slice=cut)


def stack(eqn: Eqn, label: LabelFn) -> Chunked:
    tensors = eqn.args[0]
    dim = (eqn.args[1] if len(eqn.args) > 1 else eqn.kwargs.get("dim", 0)) % eqn.outvars[0].aval.ndim
    lab = agree(eqn, [lab for v in tensors if (lab := label(v)) is not None])
    extent = lab.extent(label.batch)
    cut = {v: lab for v in tensors if isinstance(v, Var) and label(v) is None and v.aval.shape[lab.dim] == extent}
    if any(isinstance(v, Var) and label(v) is None and v not in cut for v in tensors):
        raise coupling(eqn, "stacks per-example values with a shared one", "broadcast the shared value first")
    return Chunked((lab.moved(lab.dim + (dim <= lab.dim)),), slice=cut)


def softmax(*, dim_arg: int, operands: int = 1) -> Callable[[Eqn, LabelFn], Chunked]:
    """softmax/log_softmax and their backwards: exact per chunk unless normalised across the batch dim."""

    def rule(eqn: Eqn, label: LabelFn) -> Chunked:
        ndim = eqn.outvars[0].aval.ndim
        dim = eqn.args[dim_arg] % max(ndim, 1)
        result = elementwise(eqn, label)
        if result.out[0].dim == dim:
            raise coupling(
                eqn,
                "normalises across the batch dim (softmax over examples)",
                "normalise over a non-batch dim, or run without chunking (a larger memory_budget)",
            )
        return result

    return rule


def _dims_at(eqn: Eqn, arg: int | str | None, default: Any, ndim: int) -> list[int]:
    """The dims an op mixes along, from a positional or keyword argument; ``None`` means all of them."""
    if isinstance(arg, str):
        value = eqn.kwargs.get(arg, default)
    elif arg is None:
        value = default
    else:
        value = eqn.args[arg] if len(eqn.args) > arg else eqn.kwargs.get("dim", default)
    if value is None:
        return list(range(ndim))
    if isinstance(value, int):
        value = [value]
    return [d % ndim for d in value] if ndim else []


def along(
    dim: int | str | None,
    *,
    default: Any = None,
    last: int = 0,
    keepdim: int | str | None = None,
    reduces: bool = False,
) -> Callable[[Eqn, LabelFn], Chunked]:
    """Ops that mix entries only along some dims (a scan, a sort, a norm, a gather, linear algebra over
    trailing dims): exact per chunk whenever the batch is on another dim.

    The mixed dims come from argument ``dim`` (position or keyword name; ``default`` when absent) or are
    the ``last`` trailing dims. With ``reduces``, those dims are removed from the outputs unless the
    ``keepdim`` argument says otherwise. Other tensor arguments must carry the batch the same way or be
    shared.
    """

    def rule(eqn: Eqn, label: LabelFn) -> Chunked:
        x = eqn.args[0]
        lab = label(x)
        if lab is None:
            raise coupling(eqn, "reads per-example values through an argument other than its input", "batch the input")
        ndim = x.aval.ndim
        dims = list(range(ndim - last, ndim)) if last else _dims_at(eqn, dim, default, ndim)
        if lab.dim in dims:
            raise coupling(
                eqn,
                f"mixes entries along dim {lab.dim}, the batch dim",
                f"move the batch to a dim the op does not mix along ({batch_keyword()}), or run without chunking",
            )
        kept = False
        if keepdim is not None:
            kept = bool(eqn.kwargs.get(keepdim) if isinstance(keepdim, str) else (eqn.args[keepdim] if len(eqn.args) > keepdim else eqn.kwargs.get("keepdim", False)))
        out_lab = lab.moved(lab.dim - sum(d < lab.dim for d in dims)) if reduces and not kept else lab
        extent = lab.extent(label.batch)
        cut = {}
        for _, v in arg_vars(eqn.args[1:]):
            other = label(v)
            if other is not None and other != lab:
                raise coupling(eqn, "combines per-example values batched in different ways", "keep the batch consistent")
            # Operands line up dim by dim with the input (an index, the other vector of a cross product).
            if other is None and v.aval.ndim == ndim and v.aval.shape[lab.dim] == extent and extent != 1:
                cut[v] = lab
            elif other is None and v.aval.ndim == ndim and v.aval.shape[lab.dim] not in (1, extent):
                raise coupling(
                    eqn,
                    f"lines up an operand of {v.aval.shape[lab.dim]} entries against {extent} along the batch dim",
                    "give the operand one entry per example, or run without chunking",
                )
        out = []
        for v in eqn.outvars:
            if v is None:
                out.append(None)
            elif v.aval.ndim > out_lab.dim and v.aval.shape[out_lab.dim] == extent:
                out.append(out_lab)
            else:
                raise coupling(eqn, "returns a value whose batch dim stagetorch cannot place", "run without chunking")
        return Chunked(tuple(out), slice=cut)

    return rule

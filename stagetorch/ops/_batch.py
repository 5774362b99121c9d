"""Generic batch rules (elementwise, contraction, reduction, view) that the family tables reuse.

A batch rule is ``rule(eqn, label) -> Chunked``: ``label(x)`` is the :class:`~stagetorch.batching.Batched`
label of an argument (``None`` when shared) and ``label.batch`` the full batch size. The rule says how the
equation runs on a chunk and what its outputs are; it raises ``BatchCouplingError`` (via
:func:`~stagetorch.batching.coupling`) when a chunk cannot compute its share exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..batching import Batched, Chunked, Global, LabelFn, Prepass, Reduced, coupling
from ..ir import Eqn, Var

__all__ = [
    "elementwise", "per_example", "contraction", "reduction", "mean_reduction", "view", "expand",
    "permute", "transpose", "unsqueeze", "squeeze", "select", "slice_", "split", "cat", "stack",
    "softmax", "reduction_loss", "same_in_every_chunk",
]


def _vars(args: Any) -> list[tuple[Any, Var]]:
    """(position, var) for tensor arguments, positions being an index or (index, j) into a list."""
    out = []
    for i, a in enumerate(args):
        if isinstance(a, Var):
            out.append((i, a))
        elif isinstance(a, (list, tuple)):
            out += [((i, j), x) for j, x in enumerate(a) if isinstance(x, Var)]
    return out


def _agree(eqn: Eqn, placed: list[Any]) -> Any:
    """All per-example operands must line the batch up the same way (same output dim, ``k`` and ``outer``)."""
    if len(set(placed)) > 1:
        raise coupling(
            eqn,
            f"combines per-example values whose batch dims do not line up ({sorted(set(placed), key=str)})",
            "keep the batch on the same dimension of every per-example operand",
        )
    return placed[0]


def elementwise(eqn: Eqn, label: LabelFn) -> Chunked:
    """Broadcasting ops: the batch dim lines up across operands; a shared operand of full batch extent is sliced."""
    out_ndim = max((v.aval.ndim for v in eqn.outvars if v is not None), default=0)
    operands = _vars(eqn.args) + [(key, v) for key, v in eqn.kwargs.items() if isinstance(v, Var)]
    placed = [lab.moved(lab.dim + out_ndim - v.aval.ndim) for _, v in operands if (lab := label(v)) is not None]
    lab = _agree(eqn, placed)
    extent = lab.extent(label.batch)
    cut = {}
    for _, v in operands:
        if label(v) is None:
            own = lab.dim - (out_ndim - v.aval.ndim)
            if own >= 0 and v.aval.shape[own] == extent and extent != 1:
                cut[v] = lab.moved(own)
    return Chunked(tuple(lab if v is not None else None for v in eqn.outvars), slice=cut)


def same_in_every_chunk(eqn: Eqn, label: LabelFn) -> Chunked:
    """An op whose outputs do not depend on which chunk runs it (e.g. an empty placeholder)."""
    return Chunked(tuple(None for _ in eqn.outvars))


def per_example(
    *,
    dim: int = 0,
    outputs: Sequence[str | None] | None = None,
    slice_args: Sequence[int] = (),
    batch_size_args: Sequence[int] = (),
) -> Callable[[Eqn, LabelFn], Chunked]:
    """An op that treats each example independently along ``dim`` (convolution, pooling, attention...).

    ``outputs`` gives each outvar's kind: ``"b"`` per-example, ``"sum"`` summed over the batch (a weight
    gradient), ``None`` the same in every chunk; by default an output is per-example when its ``dim`` has the
    full batch extent. ``slice_args`` are argument positions that, when shared, are cut to the chunk
    (an initial hidden state). ``batch_size_args`` are integer arguments that carry the batch size itself.
    """

    def rule(eqn: Eqn, label: LabelFn) -> Chunked:
        placed = [lab for _, v in _vars(eqn.args) if (lab := label(v)) is not None]
        bdims = {p.dim for p in placed}
        if bdims != {dim}:
            raise coupling(
                eqn,
                f"is per-example along dim {dim} only, but its input is batched along dim {sorted(bdims)}",
                f"put the batch on dim {dim} of this op's input (batch_dim=...), or run without chunking",
            )
        lab = _agree(eqn, placed)
        extent = lab.extent(label.batch)
        cut = {}
        for i in slice_args:
            v = eqn.args[i] if i < len(eqn.args) else None
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
        if batch_size_args:

            def call(n: int) -> tuple[Any, tuple, dict]:
                args = list(eqn.args)
                for i in batch_size_args:
                    args[i] = lab.extent(n)
                return eqn.prim, tuple(args), eqn.kwargs

        return Chunked(tuple(out), call=call, slice=cut)

    return rule


def contraction(spec: str, *, bias: bool = False) -> Callable[[Eqn, LabelFn], Chunked]:
    """Matmul-like ops from an einsum spec (``"ij,jk->ik"``): a batch letter kept in the output stays
    per-example; one summed over becomes a per-chunk partial of a sum (a weight gradient).

    With ``bias=True`` the first argument is added to the product (``addmm``): it broadcasts against the
    output, so its dims take the output's trailing letters; it must not meet a partial sum.
    """
    ins, out_spec = spec.split("->")
    in_specs = ins.split(",")

    def rule(eqn: Eqn, label: LabelFn) -> Chunked:
        operands = list(eqn.args[1 : 1 + len(in_specs)] if bias else eqn.args[: len(in_specs)])
        specs = list(in_specs)
        if bias and isinstance(eqn.args[0], Var):
            operands.append(eqn.args[0])
            specs.append(out_spec[len(out_spec) - eqn.args[0].aval.ndim :])
        letters = [(s[lab.dim], lab.moved(0)) for v, s in zip(operands, specs) if (lab := label(v)) is not None]
        letter, lab = _agree(eqn, letters)
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
    return torch.sum(x, dims, keepdim=keepdim, dtype=dtype) / count


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


def _batch_size_list(arg: int, label_of_list: Callable[[Eqn, LabelFn], Batched]) -> Callable:
    """A rule for ``*_backward(grad, input_sizes, dim, ...)`` ops whose sizes list carries the batch."""

    def rule(eqn: Eqn, label: LabelFn) -> Chunked:
        lab = label_of_list(eqn, label)

        def call(n: int) -> tuple[Any, tuple, dict]:
            args = list(eqn.args)
            sizes = list(args[arg])
            sizes[lab.dim] = lab.extent(n)
            args[arg] = sizes
            return eqn.prim, tuple(args), eqn.kwargs

        return Chunked((lab,), call=call)

    return rule


def _select_backward_label(eqn: Eqn, label: LabelFn) -> Batched:
    grad, dim = eqn.args[0], eqn.args[2] % len(eqn.args[1])
    lab = label(grad)
    return lab.moved(lab.dim + (dim <= lab.dim))


def _slice_backward_label(eqn: Eqn, label: LabelFn) -> Batched:
    grad, dim = eqn.args[0], eqn.args[2] % len(eqn.args[1])
    lab = label(grad)
    if dim == lab.dim and list(eqn.args[1])[dim] != grad.aval.shape[dim]:
        raise coupling(eqn, "is the gradient of a slice of the batch dim", "slice examples outside the staged function")
    return lab


select_backward = _batch_size_list(1, _select_backward_label)
slice_backward = _batch_size_list(1, _slice_backward_label)


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
    lab = _agree(eqn, [lab for v in tensors if (lab := label(v)) is not None])
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
    lab = _agree(eqn, [lab for v in tensors if (lab := label(v)) is not None])
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


_NONE, _MEAN, _SUM = 0, 1, 2  # at::Reduction


def reduction_loss(*, reduction_arg: int, backward: bool = False) -> Callable[[Eqn, LabelFn], Chunked]:
    """Losses with a ``reduction`` argument (mse, smooth_l1, huber, bce...), forward or backward.

    ``mean`` is rewritten as the chunk's ``sum`` divided by the full batch's element count, which is exact.
    """

    def rule(eqn: Eqn, label: LabelFn) -> Chunked:
        reduction = eqn.args[reduction_arg] if len(eqn.args) > reduction_arg else eqn.kwargs.get("reduction", _MEAN)
        inner = elementwise(eqn, label)
        lab = inner.out[0]
        if reduction == _NONE:
            return inner
        x = eqn.args[1] if backward else eqn.args[0]
        count = x.aval.numel

        def call(n: int) -> tuple[Any, tuple, dict]:
            args, kwargs = list(eqn.args), dict(eqn.kwargs)
            if len(args) > reduction_arg:
                args[reduction_arg] = _SUM
            else:
                kwargs["reduction"] = _SUM
            if reduction == _SUM:
                return eqn.prim, tuple(args), kwargs
            return _divided(eqn.prim, count), tuple(args), kwargs

        if backward:
            return Chunked((lab,), call=call, slice=inner.slice)
        return Chunked((Reduced("sum"),), call=call, slice=inner.slice)

    return rule


def _divided(prim: Any, count: int) -> Callable[..., torch.Tensor]:
    def divided(*args: Any, **kwargs: Any) -> torch.Tensor:
        return prim(*args, **kwargs) / count

    divided.__name__ = f"{getattr(prim, '__name__', 'op')}_sum_over_{count}"
    return divided


def _nll_total_weight(target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int) -> torch.Tensor:
    keep = target != ignore_index
    if weight is None:
        return keep.sum().to(torch.float32)
    return torch.where(keep, weight[target.clamp(min=0)], 0).sum()


def _nll_partial(prim: Any, normalise: bool) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    def nll_loss_partial(x: torch.Tensor, target: torch.Tensor, weight: Any, ignore_index: int, total: torch.Tensor):
        out, _ = prim(x, target, weight, _SUM, ignore_index)
        total = total.to(out.dtype)
        return (out / total if normalise else out), total

    return nll_loss_partial


def nll_loss_forward(eqn: Eqn, label: LabelFn) -> Chunked:
    """Count-normalised: a mean over the non-ignored targets (or their class weights), divided by the *global*
    total weight, which a pre-pass over the targets computes before the chunk loop. The backward reads that
    total too (for ``sum`` it ignores it), so it is global for both reductions."""
    x, target, weight, reduction, ignore_index = eqn.args[:5]
    lab = label(x) or label(target)
    if lab.dim != 0 or lab.outer != 1:
        raise coupling(eqn, "has its batch off dim 0", "keep the batch on dim 0 of the loss input")
    cut = {
        v: lab
        for v in (x, target)
        if label(v) is None and v.aval.ndim and v.aval.shape[0] == lab.extent(label.batch)
    }
    if reduction == _NONE:
        return Chunked((lab, None), slice=cut)
    if x.aval.ndim == 1:
        raise coupling(eqn, "reduces a single unbatched example", "give the loss a batch dim")
    total = eqn.outvars[1]
    partial = _nll_partial(eqn.prim, normalise=reduction == _MEAN)

    def call(n: int) -> tuple[Any, tuple, dict]:
        return partial, (x, target, weight, ignore_index, total), {}

    return Chunked(
        (Reduced("sum"), Global()),
        call=call,
        slice=cut,
        prepass={1: Prepass(_nll_total_weight, (target, weight, ignore_index))},
    )


def nll_loss_backward(eqn: Eqn, label: LabelFn) -> Chunked:
    """Exact per chunk: the global total weight arrives as an argument."""
    x, target = eqn.args[1], eqn.args[2]
    lab = label(x) or label(target)
    if lab is None or lab.dim != 0:
        raise coupling(eqn, "has its batch off dim 0", "keep the batch on dim 0 of the loss input")
    cut = {
        v: lab
        for v in (x, target)
        if label(v) is None and v.aval.ndim and v.aval.shape[0] == lab.extent(label.batch)
    }
    return Chunked((lab,), slice=cut)


def embedding(eqn: Eqn, label: LabelFn) -> Chunked:
    weight, indices = eqn.args[0], eqn.args[1]
    if label(weight) is not None:
        raise coupling(eqn, "looks up a per-example table", "keep embedding tables shared")
    return Chunked((label(indices),))


def embedding_dense_backward(eqn: Eqn, label: LabelFn) -> Chunked:
    scale_by_freq = eqn.args[4] if len(eqn.args) > 4 else eqn.kwargs.get("scale_grad_by_freq", False)
    if scale_by_freq:
        raise coupling(eqn, "scales gradients by token counts over the batch", "use scale_grad_by_freq=False")
    return Chunked((Reduced("sum"),))


def constant_pad_nd(eqn: Eqn, label: LabelFn) -> Chunked:
    x, pad = eqn.args[0], eqn.args[1]
    lab = label(x)
    padded = {x.aval.ndim - 1 - i // 2 for i, p in enumerate(pad) if p != 0}
    if lab.dim in padded:
        raise coupling(eqn, "pads the batch dim", "pad examples outside the staged function")
    return Chunked((lab,))


def batch_norm(*, training_arg: int | None, outputs: Sequence[str | None]) -> Callable[[Eqn, LabelFn], Chunked]:
    """Batch norm: exact per chunk in eval mode (running statistics); training couples the examples."""
    inner = per_example(outputs=outputs)

    def rule(eqn: Eqn, label: LabelFn) -> Chunked:
        if training_arg is not None and eqn.args[training_arg]:
            raise coupling(
                eqn,
                "normalises with statistics of the whole batch (BatchNorm in training mode)",
                "use GroupNorm or LayerNorm, put the BatchNorm layers in eval mode (model.eval()), or run "
                "without chunking (a larger memory_budget)",
            )
        return inner(eqn, label)

    return rule


def _rnn_layer(outputs: Sequence[str | None], hidden_args: Sequence[int]) -> Callable[[Eqn, LabelFn], Chunked]:
    """mkldnn RNN layers: the sequence is (time, batch, features), hidden states are (batch, hidden).

    ``outputs`` names each outvar: ``"seq"`` batched on dim 1, ``"hidden"`` batched on dim 0, ``"sum"`` a
    weight gradient, ``None`` an opaque workspace that only this chunk's backward reads.
    """

    def rule(eqn: Eqn, label: LabelFn) -> Chunked:
        seq = label(eqn.args[0])
        if seq is None or seq.dim != 1:
            raise coupling(eqn, "runs a recurrent layer whose input is not batched on dim 1", "keep the batch whole")
        extent = seq.extent(label.batch)
        cut = {}
        for i in hidden_args:
            v = eqn.args[i]
            if isinstance(v, Var) and label(v) is None and v.aval.ndim and v.aval.shape[0] == extent:
                cut[v] = seq.moved(0)
        kinds = {"seq": seq, "hidden": seq.moved(0), "sum": Reduced("sum"), None: None}
        return Chunked(tuple(kinds[o] if v is not None else None for o, v in zip(outputs, eqn.outvars)), slice=cut)

    return rule


rnn_layer = _rnn_layer(("seq", "hidden", "hidden", None), hidden_args=(5, 6))
rnn_layer_backward = _rnn_layer(
    ("seq", "sum", "sum", "sum", "sum", "hidden", "hidden"), hidden_args=(5, 6, 8, 9, 11, 12)
)


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
                "move the batch to a dim the op does not mix along (batch_dim=...), or run without chunking",
            )
        kept = False
        if keepdim is not None:
            kept = bool(eqn.kwargs.get(keepdim) if isinstance(keepdim, str) else (eqn.args[keepdim] if len(eqn.args) > keepdim else eqn.kwargs.get("keepdim", False)))
        out_lab = lab.moved(lab.dim - sum(d < lab.dim for d in dims)) if reduces and not kept else lab
        extent = lab.extent(label.batch)
        cut = {}
        for _, v in _vars(eqn.args[1:]):
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

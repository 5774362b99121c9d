"""Rules for the views op family."""

from __future__ import annotations

import torch

from ..interpreters import batch_rules, batching, shape_rules
from ..interpreters.batching import Batched, Chunked, LabelFn, coupling
from ..ir import Aval, Eqn, Var

aten = torch.ops.aten


# Batch rules for this family's ops (see stagetorch/interpreters/batching.py).

_along_dim_arg = batch_rules.along(1)


def _gather(eqn: Eqn, label: LabelFn) -> Chunked:
    """``gather(input, dim, index)``: ``out[i][j] = input[index[i][j]][j]`` (``dim`` 0), every dim of the index
    but ``dim`` paired entry by entry with the same dim of the input (which may be longer: its extra entries
    are never read). With a shared input and a per-example index:

    - batched along ``dim`` itself (class weights ``(C,)`` gathered by the targets): the input is a lookup
      table, read whole by every chunk;
    - batched along another dim (``PRIOR.gather(1, y[:, None])``, ``PRIOR`` of shape ``(B, C)``): row ``e`` of
      the index reads row ``e`` of the input, so the input is paired with the examples and cut to each chunk
      (a tensor the step closed over, or made before the examples met it; one made in each chunk is made
      per chunk, or refused); an input with more rows than examples is refused by name.
    """
    x, index = eqn.args[0], eqn.args[2]
    dim = eqn.args[1] % max(x.aval.ndim, 1)
    lab = label(index)
    if label(x) is None and lab is not None:
        if lab.dim == dim:
            return Chunked((lab,), whole=frozenset({x}))
        extent = lab.extent(label.batch)
        if x.aval.shape[lab.dim] != extent:
            raise coupling(
                eqn,
                f"reads a shared input whose dim {lab.dim} ({x.aval.shape[lab.dim]} entries) gather pairs entry by "
                f"entry with the index's {extent} examples",
                "give that input one row per example and pass it to the staged function as an argument (batched "
                "along its batch dim), or run without chunking (a larger memory_budget)",
            )
        return Chunked((lab,), slice={x: lab})
    return _along_dim_arg(eqn, label)


def _index_select(eqn: Eqn, label: LabelFn) -> Chunked:
    """``index_select(input, dim, index)``: the index picks whole slices of the input along ``dim``, pairing
    with no other dim. A shared input looked up by per-example positions is a table (the output's ``dim``
    holds the examples); a per-example input with a shared index keeps its batch dim (when it is not ``dim``)."""
    x, index = eqn.args[0], eqn.args[2]
    dim = eqn.args[1] % max(x.aval.ndim, 1)
    xl, il = label(x), label(index)
    if xl is None:
        return Chunked((Batched(dim, il.k, il.outer),), whole=frozenset({x}))
    if il is not None:
        raise coupling(
            eqn,
            "selects from per-example values with per-example positions (every example would meet every other "
            "example's positions)",
            "select with a shared index, or run without chunking (a larger memory_budget)",
        )
    if xl.dim == dim:
        raise coupling(eqn, "selects along the batch dim", "select examples outside the staged function")
    return Chunked((xl,), whole=frozenset({index}))


def _scatter_along(eqn: Eqn, label: LabelFn) -> Chunked:
    """``scatter``/``scatter_add``/``scatter_reduce(input, dim, index, src)`` into a per-example input: every dim
    of the index but ``dim`` is paired entry by entry with the input's and the source's, without broadcasting
    (a shared index of one row writes the first row of the batch only): a shared index must have a row per
    example, cut to the chunk with the input (a source with more rows than the index is refused by the
    generic rule). A shared input is the MoE family's (``ops/moe.py``)."""
    x, index = eqn.args[0], eqn.args[2]
    lab = label(x)
    if lab is not None and isinstance(index, Var) and label(index) is None:
        rows = index.aval.shape[lab.dim] if index.aval.ndim > lab.dim else 1
        if rows != lab.extent(label.batch):
            raise coupling(
                eqn,
                f"writes into per-example rows with a shared index of {rows} entries along the batch dim, which "
                f"scatter pairs entry by entry with the examples",
                "give the index one row per example (index.expand(...) of a row is one), or run without chunking",
            )
    return _along_dim_arg(eqn, label)


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


select_backward = batch_rules.batch_size_list(1, _select_backward_label)


slice_backward = batch_rules.batch_size_list(1, _slice_backward_label)


def constant_pad_nd(eqn: Eqn, label: LabelFn) -> Chunked:
    x, pad = eqn.args[0], eqn.args[1]
    lab = label(x)
    padded = {x.aval.ndim - 1 - i // 2 for i, p in enumerate(pad) if p != 0}
    if lab.dim in padded:
        raise coupling(eqn, "pads the batch dim", "pad examples outside the staged function")
    return Chunked((lab,))


def repeat(eqn: Eqn, label: LabelFn) -> Chunked:
    """``x.repeat(*repeats)``: tiles each dim ``repeats[d]`` times (new leading dims first). Per-example where the
    batch dim is repeated once; tiling the batch dim itself lays the examples out again after each other."""
    x, repeats = eqn.args[0], list(eqn.args[1])
    lab = label(x)
    out_dim = lab.dim + len(repeats) - x.aval.ndim
    if repeats[out_dim] != 1:
        raise coupling(
            eqn,
            "tiles the batch dim (the whole batch again after itself)",
            "repeat along a non-batch dim (x[:, None].repeat(1, n, ...)), or repeat_interleave the examples outside "
            "the staged function",
        )
    return Chunked((lab.moved(out_dim),))


def _diagonal_dims(eqn: Eqn, ndim: int, first: int) -> tuple[int, int]:
    dim1 = eqn.args[first + 1] if len(eqn.args) > first + 1 else eqn.kwargs.get("dim1", 0)
    dim2 = eqn.args[first + 2] if len(eqn.args) > first + 2 else eqn.kwargs.get("dim2", 1)
    return dim1 % ndim, dim2 % ndim


def diagonal(eqn: Eqn, label: LabelFn) -> Chunked:
    """``x.diagonal(offset, dim1, dim2)``: the two dims go, their diagonal is appended last; per-example on
    any other dim."""
    x = eqn.args[0]
    lab = label(x)
    dims = _diagonal_dims(eqn, x.aval.ndim, 1)
    if lab.dim in dims:
        raise coupling(eqn, "takes a diagonal across the batch dim", "take the diagonal of dims other than the batch's")
    return Chunked((lab.moved(lab.dim - sum(d < lab.dim for d in dims)),))


def _diagonal_backward_label(eqn: Eqn, label: LabelFn) -> Batched:
    grad, sizes = eqn.args[0], eqn.args[1]
    lab = label(grad)
    dims = _diagonal_dims(eqn, len(sizes), 2)
    kept = [d for d in range(len(sizes)) if d not in dims]
    if lab.dim >= len(kept):
        raise coupling(eqn, "is the gradient of a diagonal across the batch dim", "take the diagonal of other dims")
    return lab.moved(kept[lab.dim])


diagonal_backward = batch_rules.batch_size_list(1, _diagonal_backward_label)


def unfold(eqn: Eqn, label: LabelFn) -> Chunked:
    """``x.unfold(dim, size, step)``: windows along ``dim`` (their entries appended as a last dim); per-example
    along any other dim."""
    x = eqn.args[0]
    lab = label(x)
    if lab.dim == eqn.args[1] % max(x.aval.ndim, 1):
        raise coupling(eqn, "takes windows along the batch dim", "unfold a dim other than the batch's")
    return Chunked((lab,))


def _unfold_backward_label(eqn: Eqn, label: LabelFn) -> Batched:
    grad, sizes = eqn.args[0], eqn.args[1]
    lab = label(grad)
    if lab.dim in (eqn.args[2] % max(len(sizes), 1), grad.aval.ndim - 1):
        raise coupling(eqn, "is the gradient of windows along the batch dim", "unfold a dim other than the batch's")
    return lab


unfold_backward = batch_rules.batch_size_list(1, _unfold_backward_label)


def index_along(eqn: Eqn, label: LabelFn) -> Chunked:
    """``index_fill``/``index_copy``/``index_add(x, dim, index, source)``: the index names positions along
    ``dim`` alone (no dim of it pairs with the examples: read whole); ``x`` and ``source`` have equal sizes on
    every other dim, so they pair entry by entry there, the batch dim included: a shared one with the batch's
    extent is cut to the chunk (a ``new_zeros`` of the whole batch, as the backward of ``index_select`` adds
    into, is made per chunk). Along the batch dim the index names examples, which a chunk cannot place."""
    x, index = eqn.args[0], eqn.args[2]
    dim = eqn.args[1] % max(x.aval.ndim, 1)
    rest = [v for v in eqn.args[3:] if isinstance(v, Var)]
    source = rest[0] if rest and rest[0].aval.ndim == x.aval.ndim and x.aval.ndim > 0 else None
    if label(index) is not None:
        raise coupling(
            eqn,
            "writes at per-example positions along a dim every example shares",
            "use scatter/scatter_add with an index of one row per example, or run without chunking",
        )
    placed = [lab for v in (x, source) if v is not None and (lab := label(v)) is not None]
    if not placed or any(label(v) is not None for v in rest if v is not source):
        raise coupling(eqn, "fills with a per-example value", "fill with a shared value, or use torch.where")
    lab = batching.agree(eqn, placed)
    if lab.dim == dim:
        raise coupling(
            eqn,
            f"indexes dim {dim}, the batch dim, whose positions are the examples' (each chunk holds others)",
            "select examples with a mask over the batch (torch.where(mask[:, None], value, x)), index a non-batch "
            "dim, or run without chunking (a larger memory_budget)",
        )
    cut = {}
    for v in (x, source):
        if v is not None and label(v) is None:
            if v.aval.shape[lab.dim] != lab.extent(label.batch):
                raise coupling(eqn, "pairs a shared operand without a row per example with the examples", "batch it")
            cut[v] = lab
    return Chunked((lab,), slice=cut, whole=frozenset({index, *(v for v in rest if v is not source)}))


# Shape rules: op -> rule(*args with Avals, **kwargs) -> Aval | tuple[Aval, ...]
SHAPE: dict = {
    aten.view: shape_rules.view,
    aten._unsafe_view: shape_rules.view,
    aten.expand: shape_rules.expand,
    aten.permute: shape_rules.permute,
    aten.transpose.int: shape_rules.transpose,
    aten.unsqueeze: shape_rules.unsqueeze,
    aten.squeeze: shape_rules.squeeze,
    aten.select.int: shape_rules.select,
    aten.slice.Tensor: shape_rules.slice_,
    aten.split.Tensor: shape_rules.split,
    aten.constant_pad_nd: shape_rules.constant_pad,
    aten.cat: shape_rules.cat,
    aten.stack: shape_rules.stack,
    aten.select_backward: lambda grad, sizes, dim, index: Aval(tuple(sizes), grad.dtype, grad.device),
    aten.slice_backward: lambda grad, sizes, dim, start, end, step: Aval(tuple(sizes), grad.dtype, grad.device),
}


# Batch rules: op -> rule(eqn, label) -> Chunked (see stagetorch/interpreters/batching.py)
BATCH: dict = {
    aten.view: batch_rules.view,
    aten._unsafe_view: batch_rules.view,
    aten.reshape: batch_rules.view,
    aten.expand: batch_rules.expand,
    aten.permute: batch_rules.permute,
    aten.t: batch_rules.transpose,
    aten.transpose: batch_rules.transpose,
    aten.unsqueeze: batch_rules.unsqueeze,
    aten.squeeze: batch_rules.squeeze,
    aten.select.int: batch_rules.select,
    aten.slice.Tensor: batch_rules.slice_,
    aten.select_backward: select_backward,
    aten.slice_backward: slice_backward,
    aten.split: batch_rules.split,
    aten.split_with_sizes: batch_rules.split,
    aten.unbind: batch_rules.split,
    aten.cat: batch_rules.cat,
    aten.stack: batch_rules.stack,
    aten.constant_pad_nd: constant_pad_nd,
    # Copying variants of the views above.
    aten.view_copy: batch_rules.view,
    aten.expand_copy: batch_rules.expand,
    aten.alias_copy: batching.elementwise,
    aten.squeeze_copy: batch_rules.squeeze,
    aten.unsqueeze_copy: batch_rules.unsqueeze,
    aten.unsafe_split: batch_rules.split,
    aten.split_with_sizes_copy: batch_rules.split,
    aten.flip: batch_rules.along(1),
    aten.roll: batch_rules.along(2),
    aten.tril: batch_rules.along(None, last=2),
    aten.triu: batch_rules.along(None, last=2),
    aten.gather: _gather,
    aten.scatter: _scatter_along,
    aten.scatter_add: _scatter_along,
    aten.scatter_reduce: _scatter_along,
    aten.index_select: _index_select,
    aten.scatter_: _scatter_along,
    aten.scatter_add_: _scatter_along,
    aten.scatter_reduce_: _scatter_along,
    aten.repeat: repeat,
    aten.diagonal: diagonal,
    aten.diagonal_copy: diagonal,
    aten.diagonal_backward: diagonal_backward,
    aten.unfold: unfold,
    aten.unfold_copy: unfold,
    aten.unfold_backward: unfold_backward,
    **{op: index_along for op in (
        aten.index_fill, aten.index_fill_, aten.index_copy, aten.index_copy_, aten.index_add, aten.index_add_,
    )},
}


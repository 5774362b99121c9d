"""Rules for the views op family."""

from __future__ import annotations

import torch

from ..interpreters import batch_rules, batching, shape_rules
from ..interpreters.batching import Batched, Chunked, LabelFn, coupling
from ..ir import Aval, Eqn

aten = torch.ops.aten


# Batch rules for this family's ops (see stagetorch/interpreters/batching.py).

_gather_along = batch_rules.along(1)


def _gather(eqn: Eqn, label: LabelFn) -> Chunked:
    """``gather(input, dim, index)``. With a shared input (class weights looked up by per-example
    targets) each row of the output reads the input where the same row of the index points: exact per
    chunk of the index, whatever ``dim`` is."""
    index = eqn.args[2]
    if label(eqn.args[0]) is None and (lab := label(index)) is not None:
        return Chunked((lab,))
    return _gather_along(eqn, label)


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
    aten.scatter: batch_rules.along(1),
    aten.scatter_add: batch_rules.along(1),
    aten.scatter_reduce: batch_rules.along(1),
    aten.index_select: batch_rules.along(1),
}


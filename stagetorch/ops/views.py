"""Rules for the views op family."""

from __future__ import annotations

import torch

from ..ir import Aval
from . import _batch, _memory, _shape  # noqa: F401

aten = torch.ops.aten


# Shape rules: op -> rule(*args with Avals, **kwargs) -> Aval | tuple[Aval, ...]
SHAPE: dict = {
    aten.view: _shape.view,
    aten._unsafe_view: _shape.view,
    aten.expand: _shape.expand,
    aten.permute: _shape.permute,
    aten.transpose.int: _shape.transpose,
    aten.unsqueeze: _shape.unsqueeze,
    aten.squeeze: _shape.squeeze,
    aten.select.int: _shape.select,
    aten.slice.Tensor: _shape.slice_,
    aten.split.Tensor: _shape.split,
    aten.constant_pad_nd: _shape.constant_pad,
    aten.cat: _shape.cat,
    aten.stack: _shape.stack,
    aten.select_backward: lambda grad, sizes, dim, index: Aval(tuple(sizes), grad.dtype, grad.device),
    aten.slice_backward: lambda grad, sizes, dim, start, end, step: Aval(tuple(sizes), grad.dtype, grad.device),
}



# Memory rules: op -> rule(eqn) -> transient workspace bytes
MEMORY: dict = {
}



# Batch rules: op -> rule(eqn, label) -> Chunked (see stagetorch/batching.py)
BATCH: dict = {
    aten.view: _batch.view,
    aten._unsafe_view: _batch.view,
    aten.reshape: _batch.view,
    aten.expand: _batch.expand,
    aten.permute: _batch.permute,
    aten.t: _batch.transpose,
    aten.transpose: _batch.transpose,
    aten.unsqueeze: _batch.unsqueeze,
    aten.squeeze: _batch.squeeze,
    aten.select.int: _batch.select,
    aten.slice.Tensor: _batch.slice_,
    aten.select_backward: _batch.select_backward,
    aten.slice_backward: _batch.slice_backward,
    aten.split: _batch.split,
    aten.split_with_sizes: _batch.split,
    aten.unbind: _batch.split,
    aten.cat: _batch.cat,
    aten.stack: _batch.stack,
    aten.constant_pad_nd: _batch.constant_pad_nd,
    # Copying variants of the views above.
    aten.view_copy: _batch.view,
    aten.expand_copy: _batch.expand,
    aten.alias_copy: _batch.elementwise,
    aten.squeeze_copy: _batch.squeeze,
    aten.unsqueeze_copy: _batch.unsqueeze,
    aten.unsafe_split: _batch.split,
    aten.split_with_sizes_copy: _batch.split,
    aten.flip: _batch.along(1),
    aten.roll: _batch.along(2),
    aten.tril: _batch.along(None, last=2),
    aten.triu: _batch.along(None, last=2),
    aten.gather: _batch.along(1),
    aten.scatter: _batch.along(1),
    aten.scatter_add: _batch.along(1),
    aten.scatter_reduce: _batch.along(1),
    aten.index_select: _batch.along(1),
}


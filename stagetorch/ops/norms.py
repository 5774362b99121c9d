"""Rules for the norms op family."""

from __future__ import annotations

import torch

from . import _batch, _memory, _shape  # noqa: F401

aten = torch.ops.aten

# Shape rules: op -> rule(*args with Avals, **kwargs) -> Aval | tuple[Aval, ...]
SHAPE: dict = {
}



# Memory rules: op -> rule(eqn) -> transient workspace bytes
MEMORY: dict = {
}



# Batch rules: op -> rule(eqn, label) -> Chunked (see stagetorch/batching.py)
BATCH: dict = {
    aten.native_layer_norm: _batch.per_example(outputs=("b", "b", "b")),
    aten.native_layer_norm_backward: _batch.per_example(outputs=("b", "sum", "sum")),
    # N, the batch size, is an argument of group norm and its backward.
    aten.native_group_norm: _batch.per_example(outputs=("b", "b", "b"), batch_size_args=(3,)),
    aten.native_group_norm_backward: _batch.per_example(outputs=("b", "sum", "sum"), batch_size_args=(5,)),
    aten.native_batch_norm: _batch.batch_norm(training_arg=5, outputs=("b", None, None)),
    aten._native_batch_norm_legit_no_training: _batch.batch_norm(training_arg=None, outputs=("b", None, None)),
    aten._native_batch_norm_legit: _batch.batch_norm(training_arg=5, outputs=("b", None, None)),
    aten.native_batch_norm_backward: _batch.batch_norm(training_arg=7, outputs=("b", "sum", "sum")),
    aten.cudnn_batch_norm: _batch.batch_norm(training_arg=5, outputs=("b", None, None, None)),
    aten.miopen_batch_norm: _batch.batch_norm(training_arg=5, outputs=("b", None, None)),
}


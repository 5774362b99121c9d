"""Rules for the embedding op family."""

from __future__ import annotations

import torch

from ..ir import Aval
from . import _batch, _memory, _shape  # noqa: F401

aten = torch.ops.aten


# Shape rules: op -> rule(*args with Avals, **kwargs) -> Aval | tuple[Aval, ...]
SHAPE: dict = {
    aten.embedding: lambda weight, indices, *args: Aval(indices.shape + weight.shape[1:], weight.dtype, weight.device),
    aten.embedding_dense_backward: lambda grad, indices, num_weights, *args: Aval(
        (num_weights, grad.shape[-1]), grad.dtype, grad.device
    ),
}



# Memory rules: op -> rule(eqn) -> transient workspace bytes
MEMORY: dict = {
}



# Batch rules: op -> rule(eqn, label) -> Chunked (see stagetorch/batching.py)
BATCH: dict = {
    aten.embedding: _batch.embedding,
    aten.embedding_dense_backward: _batch.embedding_dense_backward,
}


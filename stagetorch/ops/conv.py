"""Rules for the conv op family."""

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
    aten.convolution: _batch.per_example(outputs=("b",)),
    aten.convolution_backward: _batch.per_example(outputs=("b", "sum", "sum")),
}


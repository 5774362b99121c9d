"""Rules for the reductions op family."""

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
    aten.sum.dim_IntList: _batch.reduction("sum"),
    aten.sum.default: _batch.reduction("sum", dims_arg=None, keepdim_arg=None),
    aten.mean.dim: _batch.mean_reduction(),
    aten.mean.default: _batch.mean_reduction(dims_arg=None, keepdim_arg=None),
    aten.amax: _batch.reduction("max"),
    aten.amin: _batch.reduction("min"),
}


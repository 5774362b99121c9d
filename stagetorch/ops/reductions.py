"""Rules for the reductions op family."""

from __future__ import annotations

import torch

from . import _batch, _memory, _shape  # noqa: F401

aten = torch.ops.aten

# Shape rules: op -> rule(*args with Avals, **kwargs) -> Aval | tuple[Aval, ...]
SHAPE: dict = {
    aten.sum.dim_IntList: _shape.reduce("sum"),
    aten.sum.default: _shape.reduce("sum", dims_arg=None, keepdim_arg=None),
    aten.mean.dim: _shape.reduce("mean", float_out=True),
    aten.mean.default: _shape.reduce("mean", dims_arg=None, keepdim_arg=None, float_out=True),
    aten.amax: _shape.reduce("amax"),
    aten.amin: _shape.reduce("amin"),
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
    aten.max.default: _batch.reduction("max", dims_arg=None, keepdim_arg=None),
    aten.min.default: _batch.reduction("min", dims_arg=None, keepdim_arg=None),
    # Reductions and scans along a dim other than the batch's.
    aten.max.dim: _batch.along(1, keepdim=2, reduces=True),
    aten.min.dim: _batch.along(1, keepdim=2, reduces=True),
    aten.median.dim: _batch.along(1, keepdim=2, reduces=True),
    aten.nanmedian.dim: _batch.along(1, keepdim=2, reduces=True),
    aten.mode: _batch.along(1, default=-1, keepdim=2, reduces=True),
    aten.kthvalue: _batch.along(2, default=-1, keepdim=3, reduces=True),
    aten.prod.dim_int: _batch.along(1, keepdim=2, reduces=True),
    aten.logsumexp: _batch.along(1, keepdim=2, reduces=True),
    aten.var.correction: _batch.along(1, keepdim="keepdim", reduces=True),
    aten.std.correction: _batch.along(1, keepdim="keepdim", reduces=True),
    aten.var_mean.correction: _batch.along(1, keepdim="keepdim", reduces=True),
    aten.std_mean.correction: _batch.along(1, keepdim="keepdim", reduces=True),
    aten.norm.ScalarOpt_dim: _batch.along(2, keepdim=3, reduces=True),
    aten.linalg_vector_norm: _batch.along(2, keepdim=3, reduces=True),
    aten.aminmax: _batch.along("dim", keepdim="keepdim", reduces=True),
    aten.cumsum: _batch.along(1),
    aten.cumprod: _batch.along(1),
    aten.cummax: _batch.along(1),
    aten.cummin: _batch.along(1),
    aten.logcumsumexp: _batch.along(1),
    aten.sort.default: _batch.along(1, default=-1),
    aten.sort.stable: _batch.along("dim", default=-1),
    aten.topk: _batch.along(2, default=-1),
}


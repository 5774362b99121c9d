"""Rules for the pooling op family."""

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
    **{op: _batch.per_example() for op in (
        aten.max_pool2d_with_indices, aten.max_pool2d_with_indices_backward, aten.max_pool3d_with_indices,
        aten.max_pool3d_with_indices_backward, aten.avg_pool2d, aten.avg_pool2d_backward, aten.avg_pool3d,
        aten.avg_pool3d_backward, aten._adaptive_avg_pool2d, aten._adaptive_avg_pool2d_backward,
        aten._adaptive_avg_pool3d, aten._adaptive_avg_pool3d_backward, aten.adaptive_max_pool2d,
        aten.adaptive_max_pool2d_backward, aten.max_unpool2d, aten.upsample_nearest2d,
        aten.upsample_nearest2d_backward, aten.upsample_bilinear2d, aten.upsample_bilinear2d_backward,
    )},
}


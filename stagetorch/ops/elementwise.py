"""Rules for the elementwise op family."""

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
    # Shape-preserving ops without torch's pointwise tag (tagged ones get _batch.elementwise by default).
    **{op: _batch.elementwise for op in (
        aten._to_copy, aten.copy_, aten.detach, aten.alias, aten.lift_fresh_copy, aten.fill_, aten.zero_,
        aten.where, aten.masked_fill, aten.masked_fill_, aten.rsub, aten.ones_like, aten.zeros_like,
        aten.empty_like, aten.full_like, aten.rand_like, aten.randn_like, aten.leaky_relu_backward,
        aten.hardtanh_backward, aten.elu_backward, aten.contiguous, aten.clone,
    )},
    # Factories that take a tensor only for its dtype and device: same output in every chunk.
    **{op: _batch.same_in_every_chunk for op in (
        aten.new_empty_strided, aten.new_empty, aten.new_zeros, aten.new_ones, aten.new_full,
    )},
    aten.hardswish: _batch.elementwise,
    aten.log_sigmoid_forward: _batch.elementwise,
    aten.fill: _batch.elementwise,
}


"""Rules for the losses op family."""

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
    aten.nll_loss_forward: _batch.nll_loss_forward,
    aten.nll_loss_backward: _batch.nll_loss_backward,
    aten.nll_loss2d_forward: _batch.nll_loss_forward,
    aten.nll_loss2d_backward: _batch.nll_loss_backward,
    aten.mse_loss: _batch.reduction_loss(reduction_arg=2),
    aten.mse_loss_backward: _batch.reduction_loss(reduction_arg=3, backward=True),
    aten.smooth_l1_loss: _batch.reduction_loss(reduction_arg=2),
    aten.smooth_l1_loss_backward: _batch.reduction_loss(reduction_arg=3, backward=True),
    aten.huber_loss: _batch.reduction_loss(reduction_arg=2),
    aten.huber_loss_backward: _batch.reduction_loss(reduction_arg=3, backward=True),
    aten.binary_cross_entropy: _batch.reduction_loss(reduction_arg=3),
    aten.binary_cross_entropy_backward: _batch.reduction_loss(reduction_arg=4, backward=True),
    aten.binary_cross_entropy_with_logits: _batch.reduction_loss(reduction_arg=4),
    aten.soft_margin_loss: _batch.reduction_loss(reduction_arg=2),
    aten.soft_margin_loss_backward: _batch.reduction_loss(reduction_arg=3, backward=True),
}


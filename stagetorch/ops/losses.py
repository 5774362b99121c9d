"""Rules for the losses op family."""

from __future__ import annotations

import torch

from ..errors import ShapeError
from ..ir import Aval
from . import _batch, _memory, _shape  # noqa: F401

aten = torch.ops.aten


def nll_loss_forward(x: Aval, target: Aval, weight: Aval | None, reduction: int, ignore_index: int) -> tuple[Aval, Aval]:
    """(N, C) log-probabilities against (N,) class indices; or (C,) against ()."""
    if x.ndim not in (1, 2) or target.ndim != x.ndim - 1 or (x.ndim == 2 and target.shape[0] != x.shape[0]):
        raise ShapeError(f"aten.nll_loss_forward: input {x} and target {target} do not line up")
    out = (x.shape[0],) if reduction == 0 and x.ndim == 2 else ()
    return Aval(out, x.dtype, x.device), Aval((), x.dtype, x.device)

# Shape rules: op -> rule(*args with Avals, **kwargs) -> Aval | tuple[Aval, ...]
SHAPE: dict = {
    aten.nll_loss_forward: nll_loss_forward,
    aten.nll_loss_backward: lambda grad, x, *args: Aval(x.shape, x.dtype, x.device),
    aten.mse_loss: lambda x, y, reduction=1: Aval(
        _shape.broadcast_shapes("mse_loss", x, y) if reduction == 0 else (), _shape.result_dtype(x, y), x.device
    ),
    aten.mse_loss_backward: lambda grad, x, y, reduction: Aval(x.shape, x.dtype, x.device),
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


"""Rules for the losses op family."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..batching import Chunked, Global, LabelFn, Prepass, Reduced, coupling, elementwise
from ..errors import ShapeError
from ..ir import Aval, Eqn, Var
from . import _shape

aten = torch.ops.aten


def nll_loss_forward(x: Aval, target: Aval, weight: Aval | None, reduction: int, ignore_index: int) -> tuple[Aval, Aval]:
    """(N, C) log-probabilities against (N,) class indices; or (C,) against ()."""
    if x.ndim not in (1, 2) or target.ndim != x.ndim - 1 or (x.ndim == 2 and target.shape[0] != x.shape[0]):
        raise ShapeError(f"aten.nll_loss_forward: input {x} and target {target} do not line up")
    out = (x.shape[0],) if reduction == 0 and x.ndim == 2 else ()
    return Aval(out, x.dtype, x.device), Aval((), x.dtype, x.device)

# Batch rules for this family's ops (see stagetorch/batching.py).

_NONE, _MEAN, _SUM = 0, 1, 2  # at::Reduction


def reduction_loss(*, reduction_arg: int, backward: bool = False) -> Callable[[Eqn, LabelFn], Chunked]:
    """Losses with a ``reduction`` argument (mse, smooth_l1, huber, bce...), forward or backward.

    ``mean`` is rewritten as the chunk's ``sum`` divided by the full batch's element count, which is exact.
    """

    def rule(eqn: Eqn, label: LabelFn) -> Chunked:
        reduction = eqn.args[reduction_arg] if len(eqn.args) > reduction_arg else eqn.kwargs.get("reduction", _MEAN)
        inner = elementwise(eqn, label)
        lab = inner.out[0]
        if reduction == _NONE:
            return inner
        x = eqn.args[1] if backward else eqn.args[0]
        count = x.aval.numel

        def call(n: int) -> tuple[Any, tuple, dict]:
            args, kwargs = list(eqn.args), dict(eqn.kwargs)
            if len(args) > reduction_arg:
                args[reduction_arg] = _SUM
            else:
                kwargs["reduction"] = _SUM
            if reduction == _SUM:
                return eqn.prim, tuple(args), kwargs
            return _divided(eqn.prim, count), tuple(args), kwargs

        if backward:
            return Chunked((lab,), call=call, slice=inner.slice)
        return Chunked((Reduced("sum"),), call=call, slice=inner.slice)

    return rule


def _divided(prim: Any, count: int) -> Callable[..., torch.Tensor]:
    def divided(*args: Any, **kwargs: Any) -> torch.Tensor:
        return prim(*args, **kwargs) / count

    divided.__name__ = f"{getattr(prim, '__name__', 'op')}_sum_over_{count}"
    return divided


def _nll_total_weight(target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int) -> torch.Tensor:
    keep = target != ignore_index
    if weight is None:
        return keep.sum().to(torch.float32)
    return torch.where(keep, weight[target.clamp(min=0)], 0).sum()


def _nll_partial(prim: Any, normalise: bool) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    def nll_loss_partial(x: torch.Tensor, target: torch.Tensor, weight: Any, ignore_index: int, total: torch.Tensor):
        out, _ = prim(x, target, weight, _SUM, ignore_index)
        total = total.to(out.dtype)
        return (out / total if normalise else out), total

    return nll_loss_partial


def nll_loss_forward_batch_rule(eqn: Eqn, label: LabelFn) -> Chunked:
    """Count-normalised: a mean over the non-ignored targets (or their class weights), divided by the *global*
    total weight, which a pre-pass over the targets computes before the chunk loop. The backward reads that
    total too (for ``sum`` it ignores it), so it is global for both reductions."""
    x, target, weight, reduction, ignore_index = eqn.args[:5]
    lab = label(x) or label(target)
    if lab.dim != 0 or lab.outer != 1:
        raise coupling(eqn, "has its batch off dim 0", "keep the batch on dim 0 of the loss input")
    cut = {
        v: lab
        for v in (x, target)
        if label(v) is None and v.aval.ndim and v.aval.shape[0] == lab.extent(label.batch)
    }
    if reduction == _NONE:
        return Chunked((lab, None), slice=cut)
    if x.aval.ndim == 1:
        raise coupling(eqn, "reduces a single unbatched example", "give the loss a batch dim")
    total = eqn.outvars[1]
    partial = _nll_partial(eqn.prim, normalise=reduction == _MEAN)

    def call(n: int) -> tuple[Any, tuple, dict]:
        return partial, (x, target, weight, ignore_index, total), {}

    return Chunked(
        (Reduced("sum"), Global()),
        call=call,
        slice=cut,
        prepass={1: Prepass(_nll_total_weight, (target, weight, ignore_index))},
    )


def nll_loss_backward_batch_rule(eqn: Eqn, label: LabelFn) -> Chunked:
    """Exact per chunk: the global total weight arrives as an argument. A shared operand of the batch's
    extent is cut to the chunk (the per-example grad_output of an unreduced loss, computed once)."""
    x, target = eqn.args[1], eqn.args[2]
    lab = label(x) or label(target)
    if lab is None or lab.dim != 0:
        raise coupling(eqn, "has its batch off dim 0", "keep the batch on dim 0 of the loss input")
    cut = {
        v: lab
        for v in (eqn.args[0], x, target)
        if isinstance(v, Var) and label(v) is None and v.aval.ndim and v.aval.shape[0] == lab.extent(label.batch)
    }
    return Chunked((lab,), slice=cut)


# Shape rules: op -> rule(*args with Avals, **kwargs) -> Aval | tuple[Aval, ...]
SHAPE: dict = {
    aten.nll_loss_forward: nll_loss_forward,
    aten.nll_loss_backward: lambda grad, x, *args: Aval(x.shape, x.dtype, x.device),
    aten.mse_loss: lambda x, y, reduction=1: Aval(
        _shape.broadcast_shapes("mse_loss", x, y) if reduction == 0 else (), _shape.result_dtype(x, y), x.device
    ),
    aten.mse_loss_backward: lambda grad, x, y, reduction: Aval(x.shape, x.dtype, x.device),
}


# Batch rules: op -> rule(eqn, label) -> Chunked (see stagetorch/batching.py)
BATCH: dict = {
    aten.nll_loss_forward: nll_loss_forward_batch_rule,
    aten.nll_loss_backward: nll_loss_backward_batch_rule,
    aten.nll_loss2d_forward: nll_loss_forward_batch_rule,
    aten.nll_loss2d_backward: nll_loss_backward_batch_rule,
    aten.mse_loss: reduction_loss(reduction_arg=2),
    aten.mse_loss_backward: reduction_loss(reduction_arg=3, backward=True),
    aten.smooth_l1_loss: reduction_loss(reduction_arg=2),
    aten.smooth_l1_loss_backward: reduction_loss(reduction_arg=3, backward=True),
    aten.huber_loss: reduction_loss(reduction_arg=2),
    aten.huber_loss_backward: reduction_loss(reduction_arg=3, backward=True),
    aten.binary_cross_entropy: reduction_loss(reduction_arg=3),
    aten.binary_cross_entropy_backward: reduction_loss(reduction_arg=4, backward=True),
    aten.binary_cross_entropy_with_logits: reduction_loss(reduction_arg=4),
    aten.soft_margin_loss: reduction_loss(reduction_arg=2),
    aten.soft_margin_loss_backward: reduction_loss(reduction_arg=3, backward=True),
}


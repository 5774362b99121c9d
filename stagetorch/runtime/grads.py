"""Installing gradients on the caller's parameters after a staged step ran: ``.grad`` left as autograd's
AccumulateGrad would leave it (set, replaced, added into in place, or cleared).

It runs on real tensors after every program of the step has run: it knows nothing of graphs, programs or
plans, only the (input position, gradient) pairs a step returns and what its trace said of each ``.grad``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["accumulate_grad", "grad_to_install", "install_grads"]


def grad_to_install(param: torch.Tensor, grad: torch.Tensor, fresh: bool = False) -> torch.Tensor:
    """The tensor autograd's AccumulateGrad would make ``param.grad`` from ``grad`` where ``.grad`` is None:
    ``grad`` itself, or a copy laid out as ``param`` (the one allocation of installing a gradient).
    ``fresh``: ``grad`` is known to live in storage of its own (not a view of an input)."""
    if grad.stride() != param.stride() or (
        not fresh and grad.untyped_storage().data_ptr() == param.untyped_storage().data_ptr()
    ):
        return torch.empty_strided(param.shape, param.stride(), dtype=param.dtype, device=param.device).copy_(grad)
    return grad


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor, fresh: bool = False) -> None:
    """What autograd's AccumulateGrad does for a dense leaf: set ``.grad`` or add into it in place.
    ``fresh``: ``grad`` is known to live in storage of its own (not a view of an input)."""
    if param.grad is None:
        param.grad = grad_to_install(param, grad, fresh)
    else:
        with torch.no_grad():
            param.grad.add_(grad)


def install_grads(
    inputs: list, grads: Sequence[tuple[int, torch.Tensor]], zeros: Sequence[torch.Tensor],
    grad_params: Sequence[int] = (), assign_grads: Sequence[int] = (), clear_grads: Sequence[int] = (),
) -> None:
    """Leave each ``.grad`` as the eager step would after a staged step ran: ``grads`` are the (input
    position, gradient) pairs it returned; ``grad_params`` the positions whose ``.grad`` it read, fed as
    ``zeros`` (parallel) where it was None, which then become that ``.grad``; ``assign_grads`` those whose
    ``.grad`` it replaces, ``clear_grads`` those it sets to None.

    The only allocations, a copy of a gradient laid out otherwise than its parameter where no ``.grad`` will
    be there to add into, are made before any ``.grad`` changes: failing to make one leaves every ``.grad`` as
    it was (the rest assigns, or adds in place)."""
    fed = {i for i in grad_params if inputs[i].grad is None} if grad_params else ()
    assigned = set(assign_grads) if assign_grads else ()
    ready = []  # (parameter, gradient, laid out as the parameter)
    installed = set()  # the ids of the gradients installed as they are
    for i, g in grads:
        param = inputs[i]
        if i in assigned or (param.grad is None and i not in fed):
            g = grad_to_install(param, g)
            if id(g) in installed:
                # One gradient for two parameters (the oneDNN LSTM's backward returns one bias gradient for
                # both biases): autograd's AccumulateGrad copies a gradient another edge still holds (views of
                # one storage it installs as they are), so each ``.grad`` is a tensor of its own, which an
                # in-place clip or accumulation touches once.
                g = torch.empty_strided(param.shape, param.stride(), dtype=param.dtype, device=param.device).copy_(g)
            installed.add(id(g))
            ready.append((param, g, True))
        else:
            ready.append((param, g, False))
    for i, zero in zip(grad_params, zeros):
        if inputs[i].grad is None:
            inputs[i].grad = zero  # the zeros fed for it, which the step wrote
    for i in assign_grads:
        inputs[i].grad = None
    for param, g, laid_out in ready:
        if param.grad is None:
            param.grad = g if laid_out else grad_to_install(param, g, fresh=True)
        else:
            with torch.no_grad():
                param.grad.add_(g)
    for i in clear_grads:
        inputs[i].grad = None

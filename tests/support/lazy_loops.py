"""Training loops in one-line mode against eager, and the seed program: the helpers the lazy-mode tests share."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from budgets import KernelBatchSizes

import stagetorch
from stagetorch.lazymode import recording


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))


def batches(n, batch=10, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 12, generator=g), torch.randint(0, 3, (batch,), generator=g)) for _ in range(n)]


def run_loop(model, data, step, one_line, **lazy_options):
    """``step(i, model, x, y) -> loss`` for each batch, with zero_grad, backward and an SGD step; returns the
    losses and the gradients of every step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for i, (x, y) in enumerate(data):
        if one_line:
            x, y = stagetorch.lazy(x, y, batch=0, **lazy_options)
        optimizer.zero_grad()
        loss = step(i, model, x, y)
        loss.backward()
        losses.append(loss.item())
        grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        optimizer.step()
    return losses, grads


def assert_same_loop(step, n=4, model_fn=mlp, **lazy_options):
    recording.RECORDINGS.clear()
    model = model_fn()
    reference = copy.deepcopy(model)
    data = batches(n)
    got = run_loop(model, data, step, True, **lazy_options)
    expected = run_loop(reference, data, step, False)
    for a, b in zip(got[0], expected[0]):
        assert abs(a - b) <= 1e-5 * abs(b) + 1e-7
    for gs, es in zip(got[1], expected[1]):
        for g, e in zip(gs, es):
            assert (g is None) == (e is None)
            if g is not None:
                assert type(g) is torch.Tensor and torch.allclose(g, e, rtol=1e-5, atol=1e-7)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-7)


def assert_same_grads(model, reference, clear=False):
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6)
        if clear:
            p.grad = q.grad = None


class RealKernelBatchSizes(KernelBatchSizes):
    """Batch sizes the real kernels saw (the recording of an op on lazy tensors runs no kernel)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(isinstance(a, stagetorch.LazyTensor) for a in args):
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def seed_program(model, x, y, **lazy_options):
    """The seed project's README program with the one line added."""
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    (x, y) = stagetorch.lazy(x, y, batch=0, **lazy_options)
    optimizer.zero_grad()
    out = model(x)
    loss = loss_fn(out, y)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    optimizer.step()
    return loss.item(), grads


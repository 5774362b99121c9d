"""Budgets that force chunks, and what the kernels saw: the helpers the chunking tests share."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import stagetorch


class KernelBatchSizes(TorchDispatchMode):
    """Records the leading dim of the first tensor argument of every ATen call (what the kernels saw)."""

    def __init__(self, ops: tuple = ()):
        super().__init__()
        self.ops = ops
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in self.ops:
            self.sizes.append(args[0].shape[0] if func.overloadpacket is not torch.ops.aten.addmm else args[1].shape[0])
        return func(*args, **(kwargs or {}))


def budget_for(staged: stagetorch.Staged, *args, chunks: int = 3) -> int:
    """The largest budget (in 3% steps down from the whole batch's peak) that splits into >= ``chunks``."""
    budget = staged.plan(*args).full_batch_peak_bytes * 2
    while budget > 1024:
        staged.memory_budget = budget
        plan = staged.plan(*args)
        if len(plan.chunk_sizes) >= chunks:
            return budget
        budget = int(budget * 0.97)
    raise AssertionError("no budget gives enough chunks")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def train_chunked_against_eager(step_of, model: torch.nn.Module, batches, *, chunks: int = 3, tol: float = 1e-12):
    """``step_of(model)`` (a step that calls ``backward``) trained under ``jit`` with a budget forcing at least
    ``chunks`` chunks, beside eager on a copy, SGD with momentum stepping outside the call, one step per batch:
    the losses and the parameters after every step agree within ``tol``. Returns the staged step."""
    import copy

    reference = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference))
    staged = stagetorch.jit(step_of(model))
    eager = step_of(reference)
    for batch in batches:
        budget_for(staged, *batch, chunks=chunks)
        assert len(staged.plan(*batch).chunk_sizes) >= chunks
        losses = []
        for o, run in ((opt, staged), (ref_opt, eager)):
            o.zero_grad()
            losses.append(run(*batch))
            o.step()
        assert rel(losses[0].detach(), losses[1].detach()) < tol
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert rel(p.detach(), q.detach()) < tol, name
    return staged

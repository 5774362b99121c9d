"""A budget set to force chunks, and a model's state compared with a reference's: the helpers the staging
tests share."""

from __future__ import annotations

import torch
import torch.nn as nn

import stagetorch


def budget_for(staged: stagetorch.Staged, *args, chunks: int = 3) -> None:
    """Set the largest budget (in 3% steps down from the whole batch's peak) that splits into >= ``chunks``."""
    staged.memory_budget = None  # the previous call's budget may not fit this one (its optimizer state is new)
    budget = staged.plan(*args).full_batch_peak_bytes * 2
    while budget > 1024:
        staged.memory_budget = budget
        if len(staged.plan(*args).chunk_sizes) >= chunks:
            return
        budget = int(budget * 0.97)
    raise AssertionError("no budget gives enough chunks")


def assert_same_state(model: nn.Module, reference: nn.Module, tol: float = 1e-5) -> None:
    """Every parameter, .grad and buffer of ``model`` equals ``reference``'s."""
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=tol, atol=tol, msg=lambda m, name=name: f"{name}: {m}")
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=tol, atol=tol, msg=lambda m, name=name: f"{name}.grad: {m}")
    for (name, b), c in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b, c, rtol=tol, atol=tol, msg=lambda m, name=name: f"{name}: {m}")


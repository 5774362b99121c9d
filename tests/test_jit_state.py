"""Staged steps that read or write Python-side state, over several calls against the same loop in eager
PyTorch, unchunked and in >= 3 chunks: values the step reads (guards), optimizers inside the step, ``.grad``
read inside the step, batch-wide normalisers, and the state a failed step must leave as it was."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stagetorch

BATCH = 24
CALLS = 3


def budget_for(staged: stagetorch.Staged, *args, chunks: int = 3) -> None:
    """Set the largest budget (in 3% steps down from the whole batch's peak) that splits into >= ``chunks``."""
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


# -- a failed step restores what it wrote ---------------------------------------------------------------------

_FAIL = {"above": 10**9}


@torch.library.custom_op("stagetorch_test::fail_above", mutates_args=())
def fail_above(x: torch.Tensor) -> torch.Tensor:
    """Identity that fails for more than ``_FAIL["above"]`` examples: a kernel failing mid-step."""
    if x.shape[0] > _FAIL["above"]:
        raise RuntimeError(f"injected failure at {x.shape[0]} examples")
    return x.clone()


@fail_above.register_fake
def _(x):
    return torch.empty_like(x)


fail_above.register_autograd(lambda ctx, grad: grad, setup_context=lambda ctx, inputs, output: None)
stagetorch.ops.register(torch.ops.stagetorch_test.fail_above, batch=stagetorch.ops.per_example())


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor | None]:
    out = {n: t.detach().clone() for n, t in model.state_dict().items()}
    out.update({f"{n}.grad": None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
    return out


def _assert_unchanged(model: nn.Module, before: dict) -> None:
    after = _snapshot(model)
    for name, t in before.items():
        assert (t is None) == (after[name] is None), name
        if t is not None:
            assert torch.equal(t, after[name]), f"{name} changed by a failed step"


@pytest.mark.parametrize("chunked", [False, True], ids=["unchunked", "chunked"])
def test_a_failure_after_the_batchnorm_update_restores_its_running_statistics(chunked):
    # The BatchNorm normalises a learned table (the same for every example), so the step can still be chunked.
    torch.manual_seed(0)
    encoder, table, norm, head = nn.Linear(5, 4), nn.Parameter(torch.randn(6, 4)), nn.BatchNorm1d(4), nn.Linear(4, 3)
    model = nn.ModuleList([encoder, norm, head])

    def step(x, y):
        codes = norm(table)
        h = torch.ops.stagetorch_test.fail_above(encoder(x) @ codes.T @ codes)
        loss = F.cross_entropy(head(h), y)
        loss.backward()
        return loss

    x, y = torch.randn(BATCH, 5), torch.randint(0, 3, (BATCH,))
    staged = stagetorch.jit(step)
    staged(x, y)  # a first step that succeeds: .grad and the running statistics hold something
    if chunked:
        budget_for(staged, x, y)
    before = _snapshot(model)
    before["table.grad"] = table.grad.clone()
    _FAIL["above"] = max(staged.plan(x, y).chunk_sizes) - 1
    try:
        with pytest.raises(RuntimeError, match="injected failure"):
            staged(x, y)
    finally:
        _FAIL["above"] = 10**9
    _assert_unchanged(model, {k: v for k, v in before.items() if k != "table.grad"})
    assert torch.equal(table.grad, before["table.grad"])

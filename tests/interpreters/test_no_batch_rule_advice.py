"""The refusal of an op with no batch rule shows the one-line ``per_example`` registration as the fix: for the
dim the op's per-example operands have the batch on (``batch_dim=1`` gives ``per_example(dim=1)``; it said
``per_example()``, dim 0, whatever the dim), and none where they disagree. The call it shows is the fix: once
registered, the step runs in chunks as eager."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stagetorch
from tests.support.budgets import budget_for, rel


def _twice(name: str, arity: int = 1):
    """``torch.ops.stagetorch_test.<name>``: ``2 * x`` (plus ``y.t()``), a custom op stagetorch has no rule for."""
    if arity == 1:
        def run(x: torch.Tensor) -> torch.Tensor:
            return 2 * x
    else:
        def run(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return 2 * x + y.t()

    op = torch.library.custom_op(f"stagetorch_test::{name}", mutates_args=())(run)
    op.register_fake(lambda x, *rest: torch.empty_like(x))
    op.register_autograd(lambda ctx, grad: (2 * grad, grad.t()) if arity > 1 else 2 * grad,
                         setup_context=lambda ctx, inputs, output: None)
    return getattr(torch.ops.stagetorch_test, name)


@pytest.mark.parametrize("batch_dim", [0, 1])
def test_the_advice_names_the_dim_the_batch_is_on_and_is_the_fix(batch_dim):
    op = _twice(f"no_rule_twice_dim{batch_dim}")
    torch.manual_seed(0)
    model = nn.Linear(4, 4).double()

    def step(x):  # x: (B, 4), or (4, B) with batch_dim=1
        h = model(x if batch_dim == 0 else x.t())
        h = op(h if batch_dim == 0 else h.t().contiguous())  # the op sees the batch on dim batch_dim
        loss = h.square().sum()
        loss.backward()
        return loss

    x = torch.randn(8, 4, dtype=torch.double)
    x = x if batch_dim == 0 else x.t().contiguous()
    staged = stagetorch.jit(step, batch_dim=batch_dim)
    staged.memory_budget = 1024
    with pytest.raises(stagetorch.UnsupportedOpError) as err:
        staged(x)
    msg = str(err.value)
    advice = "per_example(dim=1)" if batch_dim else "per_example()"
    assert f"stagetorch.ops.register(torch.ops.stagetorch_test.no_rule_twice_dim{batch_dim}, batch=stagetorch.ops.{advice})" in msg, msg
    assert f"along dim {batch_dim}" in msg, msg

    stagetorch.ops.register(op, batch=stagetorch.ops.per_example(dim=batch_dim))  # the advice, as shown
    stagetorch.clear_caches()
    staged = stagetorch.jit(step, batch_dim=batch_dim)
    budget_for(staged, x, chunks=2)
    assert len(staged.plan(x).chunk_sizes) >= 2
    model.zero_grad()
    loss = staged(x)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    expected = step(x)
    assert rel(loss.detach(), expected.detach()) < 1e-12
    for g, p in zip(grads, model.parameters()):
        assert rel(g, p.grad) < 1e-12


def test_operands_batched_on_different_dims_get_no_per_example_advice():
    op = _twice("no_rule_twice_mixed", arity=2)
    model = nn.Linear(4, 4).double()

    def step(x):  # (4, B) and (B, 4): the batch on dims 1 and 0
        h = model(x)
        loss = op(h.t().contiguous(), h).square().sum()
        loss.backward()
        return loss

    x = torch.randn(64, 4, dtype=torch.double)
    staged = stagetorch.jit(step)
    staged.memory_budget = 1024
    with pytest.raises(stagetorch.UnsupportedOpError) as err:
        staged(x)
    msg = str(err.value)
    assert "different dims (0, 1)" in msg and "per_example(" not in msg, msg
    assert "stagetorch.ops.register(torch.ops.stagetorch_test.no_rule_twice_mixed, batch=...)" in msg, msg

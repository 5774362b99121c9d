"""A batch on a dim other than the first (``batch_dim=1``): a chunk cut along it is not dense, and a view the
step recorded on the whole batch (``nn.Linear`` on a 3-D input flattens its leading dims) cannot be taken of
it. The chunk is copied dense, as eager's ``reshape`` copies, and the plan counts the copy."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from memtrack import allocator_peak

import stagetorch


def _step(model: nn.Module):
    def step(a: torch.Tensor, mix: bool) -> torch.Tensor:
        h = model(a)
        loss = (h.softmax(1) if mix else h).square().mean()
        loss.backward()
        return loss

    return step


@pytest.mark.parametrize("mix", [False, True], ids=["per-example", "cut"])
def test_batch_dim_1_through_linear_in_chunks_equals_eager(mix: bool) -> None:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 4))
    eager_model, staged_model = copy.deepcopy(base), copy.deepcopy(base)
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=0.1, momentum=0.9)
    staged_opt = torch.optim.SGD(staged_model.parameters(), lr=0.1, momentum=0.9)
    staged = stagetorch.jit(_step(staged_model), batch_dim=1, static_argnums=(1,))
    x0 = torch.randn(6, 32, 4)
    staged.memory_budget = staged.plan(x0, mix).full_batch_peak_bytes // 3
    for i in range(3):
        x = torch.randn(6, 32, 4) * (1 + i)
        assert len(staged.plan(x, mix).chunk_sizes) > 1
        for opt in (eager_opt, staged_opt):
            opt.zero_grad()
        want = _step(eager_model)(x, mix)
        got = staged(x, mix)
        torch.testing.assert_close(got, want)
        for p, q in zip(staged_model.parameters(), eager_model.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
        eager_opt.step()
        staged_opt.step()


def test_batch_dim_1_chunk_copy_is_planned() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 16))
    x = torch.randn(8, 64, 16)
    staged = stagetorch.jit(_step(model), batch_dim=1, static_argnums=(1,))
    staged.memory_budget = staged.plan(x, False).full_batch_peak_bytes // 3
    staged(x, False)  # staged, and .grad made: the measured call holds it, as the plan now says
    model.zero_grad(set_to_none=False)
    plan = staged.plan(x, False)
    resident = [*model.parameters(), *(p.grad for p in model.parameters()), x]
    peak, _ = allocator_peak(staged, resident, x, False)
    assert len(plan.chunk_sizes) > 1
    assert plan.peak - 4096 <= peak <= plan.peak + 4096, (peak, plan.peak)
    assert peak <= staged.memory_budget

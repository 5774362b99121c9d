"""BatchNorm in training mode under a memory budget (issue 38 item 3): its batch statistics couple the
examples, so the batch cannot be chunked. Below every schedule the error names the smallest budget that
runs the step and how; at that budget the step runs and equals eager, several optimizer steps in a loop."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stagetorch
from stagetorch.devices import format_bytes
from stagetorch.errors import BatchStatisticsError

BATCH = 8


def _block(c_in: int, c_out: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())


def bn_cnn() -> nn.Module:
    """Four convolution + BatchNorm blocks, then a pooled classifier: each layer's statistics depend on the
    layers before it."""
    torch.manual_seed(0)
    blocks = [_block(3, 8), _block(8, 8), _block(8, 8), _block(8, 8)]
    return nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10)).double()


def _batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + k)
    return torch.randn(BATCH, 3, 12, 12, generator=g, dtype=torch.float64), torch.randint(0, 10, (BATCH,), generator=g)


def _step_of(model: nn.Module, opt: torch.optim.Optimizer):
    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    return step


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same(model: nn.Module, reference: nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)  # running mean/var, num_batches_tracked


@pytest.mark.parametrize("remat", ["auto", False])
@pytest.mark.parametrize("fraction", [0.3, 0.6])
def test_below_every_schedule_the_error_names_the_smallest_budget_that_runs(remat, fraction):
    model = bn_cnn()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    staged, eager = stagetorch.jit(_step_of(model, opt), remat=remat), _step_of(reference, ref_opt)

    def train(k: int) -> None:
        x, y = _batch(k)
        for m in (model, reference):
            m.train(k != 2)  # eval mode (its running statistics, chunked) between steps in training mode
        loss = staged(x, y)
        expected = eager(x, y)
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-10, atol=1e-12)
        _assert_same(model, reference)
        opt.step()
        ref_opt.step()

    train(0)  # a first step whole: later calls hold each old .grad beside the program, as steady steps do
    x, y = _batch(1)
    full = staged.plan(x, y).full_batch_peak_bytes
    staged.memory_budget = int(full * fraction)
    before = _state(model)
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(BatchStatisticsError) as info:
        staged(x, y)
    error = info.value
    assert isinstance(error, stagetorch.BatchCouplingError)
    smallest = error.smallest_budget
    message = str(error)
    assert f"the smallest budget that runs it is {format_bytes(smallest)}" in message
    assert f"raise memory_budget to at least {format_bytes(smallest)}" in message
    assert "test_batchnorm_cut.py:" in message and "(model.0.1)" in message  # the user's line and module
    assert ("with recomputation" in message) == (remat == "auto")
    if remat == "auto":
        assert smallest < full  # recomputation runs below the whole batch's peak
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))

    # At the budget named (copied from the message: the bytes it shows are enough), three SGD steps with
    # momentum, switching to eval mode and back between them, equal eager's.
    staged.memory_budget = format_bytes(smallest)
    for k in range(1, 4):
        train(k)


def test_a_budget_just_below_the_named_one_still_raises():
    model = bn_cnn()
    staged = stagetorch.jit(_step_of(model, torch.optim.SGD(model.parameters(), lr=0.1)))
    x, y = _batch(0)
    staged.memory_budget = staged.plan(x, y).full_batch_peak_bytes // 3
    with pytest.raises(BatchStatisticsError) as info:
        staged.plan(x, y)
    staged.memory_budget = int(info.value.smallest_budget * 0.97)
    with pytest.raises(BatchStatisticsError) as again:
        staged.plan(x, y)
    assert again.value.smallest_budget == info.value.smallest_budget

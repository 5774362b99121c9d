"""BatchNorm in training mode under a memory budget (issue 38 item 3): its batch statistics couple the
examples. Below what recomputation needs, the step runs in passes over chunks, one per level of those
statistics (stagetorch.planning.multipass); below every schedule the error names the smallest budget that runs the
step and how. Each against eager: several optimizer steps in a loop, train() and eval() between them."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stagetorch
from stagetorch.devices.budget import format_bytes
from stagetorch.errors import BatchStatisticsError
from stagetorch.planning.multipass import PassesPlan

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


def _pair(model: nn.Module, remat: str | bool = "auto"):
    """The model staged and a copy run eagerly, each with SGD and momentum, and a step that trains both and
    compares them (the staged step's loss, every .grad, the parameters and buffers after)."""
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    staged, eager = stagetorch.jit(_step_of(model, opt), remat=remat), _step_of(reference, ref_opt)

    def train(k: int, batch=_batch) -> None:
        x, y = batch(k)
        for m in (model, reference):
            m.train(k != 2)  # eval mode (its running statistics, chunked) between steps in training mode
        loss = staged(x, y)
        expected = eager(x, y)
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-10, atol=1e-12)
        _assert_same(model, reference)
        opt.step()
        ref_opt.step()

    return staged, train


@pytest.mark.parametrize("fraction", [0.6, 0.25])
def test_below_recomputation_batchnorm_statistics_are_summed_over_chunks_in_passes(fraction):
    """Below what recomputation needs (0.7x of the whole step's peak), the step runs in passes over chunks:
    the loss, every .grad, running_mean, running_var and num_batches_tracked equal eager's, three SGD steps
    with momentum, an eval-mode step between."""
    model = bn_cnn()
    staged, train = _pair(model)
    train(0)  # whole: later calls hold each old .grad beside the program, as steady steps do
    x, y = _batch(1)
    staged.memory_budget = int(staged.plan(x, y).full_batch_peak_bytes * fraction)
    plan = staged.plan(x, y)
    assert isinstance(plan, PassesPlan) and plan.chunked
    assert len(plan.passes.splits) == 9  # 4 levels forward, 4 backward, then the step
    assert plan.peak <= staged.memory_budget
    for k in range(1, 4):
        train(k)


def test_below_every_schedule_the_error_names_the_smallest_budget_that_runs():
    model = bn_cnn()
    staged, train = _pair(model)
    train(0)
    x, y = _batch(1)
    staged.memory_budget = staged.plan(x, y).full_batch_peak_bytes // 50
    before = _state(model)
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(BatchStatisticsError) as info:
        staged(x, y)
    error = info.value
    assert isinstance(error, stagetorch.BatchCouplingError)
    smallest = error.smallest_budget
    message = str(error)
    assert f"the smallest budget any schedule fits is {format_bytes(smallest)}, in 9 passes over chunks of 1" in message
    assert f"raise memory_budget to at least {format_bytes(smallest)}" in message
    assert "planning/test_multipass.py:" in message and "(model.0.1)" in message  # the user's line and module
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))

    # At the budget named (copied from the message: the bytes it shows are enough): equal to eager.
    staged.memory_budget = format_bytes(smallest)
    for k in range(1, 4):
        train(k)
    staged.memory_budget = int(smallest * 0.97)  # and a little less does not run
    with pytest.raises(BatchStatisticsError):
        staged(x, y)


def test_without_recomputation_the_error_names_the_whole_batch():
    """remat=False: no recomputation, so no passes either (they re-run the forward O(L^2) times): below the
    whole step, the error names the whole batch's budget, which runs and equals eager."""
    model = bn_cnn()
    staged, train = _pair(model, remat=False)
    train(0)
    x, y = _batch(1)
    full = staged.plan(x, y).full_batch_peak_bytes
    staged.memory_budget = int(full * 0.6)
    with pytest.raises(BatchStatisticsError) as info:
        staged(x, y)
    smallest = info.value.smallest_budget
    assert f"the smallest budget any schedule fits is {format_bytes(smallest)}, the whole batch at once" in str(info.value)
    assert smallest > full
    staged.memory_budget = format_bytes(smallest)
    for k in range(1, 4):
        train(k)


def test_the_plan_and_the_memory_report_say_the_step_runs_in_passes():
    model = bn_cnn()
    x, y = _batch(0)
    step = _step_of(model, torch.optim.SGD(model.parameters(), lr=0.1))
    full = stagetorch.jit(step).plan(x, y).full_batch_peak_bytes
    report = stagetorch.memory(step, memory_budget=full // 4)(x, y)
    assert "9 chunked passes" in report.schedule.plan and "BatchNorm" in report.schedule.plan
    assert report.schedule.extra_flops > 2 * report.schedule.base_flops  # O(L^2): the prefixes run again
    assert max(report.schedule.live) <= report.schedule.peak_bytes
    assert all(p.grad is None for p in model.parameters())


def test_batchnorm1d_over_features_and_a_layer_without_affine_or_running_statistics():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(12, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32),
        nn.BatchNorm1d(32, affine=False, track_running_stats=False), nn.Tanh(), nn.Linear(32, 5),
    ).double()
    staged, train = _pair(model)

    def batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(k)
        return torch.randn(64, 12, generator=g, dtype=torch.float64), torch.randint(0, 5, (64,), generator=g)

    train(0, batch)
    staged.memory_budget = staged.plan(*batch(1)).full_batch_peak_bytes // 10
    with pytest.raises(BatchStatisticsError) as info:  # (the weights are most of this step)
        staged.plan(*batch(1))
    assert "in 5 passes over chunks of 1 example(s)" in str(info.value)
    staged.memory_budget = info.value.smallest_budget
    assert isinstance(staged.plan(*batch(1)), PassesPlan)
    for k in (1, 3):  # (step 2 in eval mode: the unaffine layer has no running statistics to use)
        train(k, batch)


def test_in_one_line_mode_the_error_names_the_smallest_budget_that_runs():
    """The one-line mode does not run passes: below recomputation, the error names its budget."""
    model = bn_cnn()
    reference = copy.deepcopy(model)
    x, y = _batch(0)
    full = stagetorch.jit(_step_of(model, torch.optim.SGD(model.parameters(), lr=0.1))).plan(x, y).full_batch_peak_bytes
    model.zero_grad(set_to_none=True)
    lx, ly = stagetorch.lazy(x, y, batch=0, memory_budget=full // 50)
    with pytest.raises(BatchStatisticsError) as info:
        F.cross_entropy(model(lx), ly).backward()
    smallest = info.value.smallest_budget
    assert f"the smallest budget any schedule fits is {format_bytes(smallest)}, with recomputation" in str(info.value)
    lx, ly = stagetorch.lazy(x, y, batch=0, memory_budget=format_bytes(smallest))
    F.cross_entropy(model(lx), ly).backward()
    F.cross_entropy(reference(x), y).backward()
    _assert_same(model, reference)


def test_dropout_keeps_the_step_out_of_passes():
    """The passes re-run the per-example work, and dropout's draws are not replayed: such a step does not run
    in passes; below recomputation the error names recomputation's budget, at which it equals eager."""
    torch.manual_seed(0)
    model = nn.Sequential(_block(3, 8), nn.Dropout(0.3), _block(8, 8), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, 10)).double()
    reference = copy.deepcopy(model)
    staged, eager = stagetorch.jit(_step_of(model, torch.optim.SGD(model.parameters(), lr=0.1))), _step_of(
        reference, torch.optim.SGD(reference.parameters(), lr=0.1))
    x, y = _batch(0)
    full = staged.plan(x, y).full_batch_peak_bytes
    for seed in (1, 2, 3):
        if seed == 2:  # (after a first step: the later calls hold each old .grad beside the program)
            staged.memory_budget = full // 4
            with pytest.raises(BatchStatisticsError, match="with recomputation") as info:
                staged(x, y)
            staged.memory_budget = info.value.smallest_budget
        torch.manual_seed(seed)
        loss = staged(x, y)
        torch.manual_seed(seed)
        torch.testing.assert_close(loss, eager(x, y).detach(), rtol=1e-10, atol=1e-12)
        _assert_same(model, reference)


def test_in_float32_the_passes_are_close_to_eager():
    """float32, activations far from zero mean: the variance from two sums (shifted by the running mean) is
    close to the kernel's, three steps."""
    model = bn_cnn().float()
    reference = copy.deepcopy(model)
    staged = stagetorch.jit(_step_of(model, torch.optim.SGD(model.parameters(), lr=0.1)))
    eager = _step_of(reference, torch.optim.SGD(reference.parameters(), lr=0.1))
    for k in range(3):
        x, y = _batch(k)
        x = x.float() * 2 + 3
        if k == 1:
            staged.memory_budget = staged.plan(x, y).full_batch_peak_bytes // 2
            assert isinstance(staged.plan(x, y), PassesPlan)
        torch.testing.assert_close(staged(x, y), eager(x, y).detach(), rtol=1e-5, atol=1e-5)
        for a, b in zip([*model.parameters(), *model.buffers()], [*reference.parameters(), *reference.buffers()]):
            torch.testing.assert_close(a.grad if a.is_floating_point() and a.requires_grad else a,
                                       b.grad if b.is_floating_point() and b.requires_grad else b, rtol=1e-4, atol=1e-5)

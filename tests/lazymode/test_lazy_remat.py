"""Recomputation in one-line mode: ``stagetorch.lazy(..., memory_budget=..., remat="auto" | False)``.

Training loops as users write them (the lazy line, the model, the loss, backward, an optimizer step),
against the same loop in eager PyTorch and against lazy without recomputation, under budgets that only
recomputation can meet. Each test runs in every lazy mode (record, replay, express: see conftest.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from memtrack import AllocatorPeak
from remat_models import mlp_chain

import stagetorch
from stagetorch.devices.budget import parse_bytes
from stagetorch.errors import OutOfMemoryError
from stagetorch.planning.budget import SAFETY_MARGIN
from stagetorch.planning.remat_search import RematPlan
from stagetorch.runtime.executable import Executable
from stagetorch.transforms.rng import ReplayRandom

pytestmark = pytest.mark.usefixtures("lazy_mode")

MiB = 2**20


# For mlp_chain() over [2, 512, 64]: the whole step needs 6.9 MiB, one example at a time 4.1 MiB; with
# recomputation 2 chunks of one example fit in 2.3 MiB. So 3 MiB is a budget only recomputation can meet.
# (At 2.6 MiB the 12 B the pow backward's wrapped 2.0 takes moved the recompute frontier, and the whole batch
# recomputing more became the cheaper plan: 2.4 MiB is a budget where chunks of one, recomputing, win.)
ONLY_REMAT = "2.4MiB"
CHUNKS_ALONE = "5MiB"  # chunks of one example, no recomputation: the same chunks as under ONLY_REMAT


@pytest.fixture
def plans(monkeypatch):
    """The plan of every flush that ran (as memtrack's lazy path records them; a recomputing plan runs
    through an inner Executable, whose own plan is not the flush's)."""
    ran: list = []
    depth = [0]
    run = Executable.run

    def recorded(self, inputs, plan, **kwargs):
        depth[0] += 1
        try:
            out = run(self, inputs, plan, **kwargs)
        finally:
            depth[0] -= 1
        if not depth[0]:
            ran.append(plan)
        return out

    monkeypatch.setattr(Executable, "run", recorded)
    return ran


def train(model, batches, optimizer, lrs, lazy_options=None):
    """The user's loop: ``lazy_options`` None is eager PyTorch, else the one lazy line with those options.
    The learning rate changes between steps. Returns the losses and the gradients of each step."""
    losses, grads = [], []
    for (x,), lr in zip(batches, lrs):
        for group in optimizer.param_groups:
            group["lr"] = lr
        if lazy_options is not None:
            x = stagetorch.lazy(x, **lazy_options)
        optimizer.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        grads.append([p.grad.clone() for p in model.parameters()])
    return losses, grads


def _equal(a, b):
    return a[0] == b[0] and all(map(torch.equal, (g for s in a[1] for g in s), (g for s in b[1] for g in s)))


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adam])
def test_a_loop_only_recomputation_fits_equals_the_same_chunks_without_it(optimizer, plans):
    """Three steps, batch 2: every flush recomputes, in chunks of one example, and gives the bits of lazy
    without recomputation in the same chunks (under a larger budget), and eager's values to rounding."""
    torch.manual_seed(0)
    model = mlp_chain()
    batches = [(torch.randn(2, 512, 64),) for _ in range(3)]
    lrs = [0.1, 0.05, 0.02]
    models = [model, copy.deepcopy(model), copy.deepcopy(model)]
    runs = [
        train(m, batches, optimizer(m.parameters(), lr=0.1), lrs, options)
        for m, options in zip(models, [
            dict(memory_budget=ONLY_REMAT), dict(memory_budget=CHUNKS_ALONE, remat=False), None,
        ])
    ]
    remat_plans, chunk_plans = plans[:3], plans[3:]
    assert all(isinstance(p, RematPlan) and p.extra_flops > 0 and p.chunk_sizes == (1, 1) for p in remat_plans)
    assert all(not isinstance(p, RematPlan) and p.chunk_sizes == (1, 1) for p in chunk_plans)
    assert _equal(runs[0], runs[1])
    assert all(map(torch.equal, models[0].parameters(), models[1].parameters()))
    for (loss, grads), (expected_loss, expected_grads) in zip(zip(*runs[0]), zip(*runs[2])):
        assert loss == pytest.approx(expected_loss, rel=1e-5)
        for g, e in zip(grads, expected_grads):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)


def test_one_example_that_does_not_fit_is_bit_exact_against_eager(plans):
    """Batch 1 cannot be chunked: recomputation alone fits it, and the loop equals eager PyTorch bit for bit."""
    torch.manual_seed(0)
    model = mlp_chain()
    reference = copy.deepcopy(model)
    batches = [(torch.randn(1, 512, 64),) for _ in range(3)]
    lrs = [0.1, 0.05, 0.1]
    budget = "2MiB"  # one example needs 4.1 MiB without recomputation
    lazy = train(model, batches, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), lrs, dict(memory_budget=budget))
    eager = train(reference, batches, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9), lrs)
    assert all(isinstance(p, RematPlan) and p.peak <= parse_bytes(budget) for p in plans) and len(plans) == 3
    assert _equal(lazy, eager)
    assert all(map(torch.equal, model.parameters(), reference.parameters()))


def dropout_chain(n: int = 8, d: int = 64) -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Dropout(0.3)) for _ in range(n)])


def test_dropout_under_recomputation_draws_the_same_masks_and_leaves_the_same_generator(plans):
    """The same seed gives the same result with and without recomputation, and the generator ends each
    step where eager's does: at the smallest budget, dropout is recomputed under the generator state saved
    before it, which draws the same masks and puts the generator back."""
    torch.manual_seed(0)
    model = dropout_chain()
    reference = copy.deepcopy(model)
    x = torch.randn(1, 1024, 64)
    with pytest.raises(OutOfMemoryError) as info:
        model(stagetorch.lazy(x, memory_budget=1024)).square().mean().backward()
    model.zero_grad(set_to_none=True)
    plans.clear()
    budget = info.value.smallest_budget
    assert budget < 0.5 * _no_recompute_peak(model, x)
    for step in range(3):
        results, states = [], []
        for m, options in ((model, dict(memory_budget=budget)), (reference, None)):
            torch.manual_seed(step)
            m.zero_grad(set_to_none=True)
            loss = m(x if options is None else stagetorch.lazy(x, **options)).square().mean()
            loss.backward()
            results.append((loss.item(), [p.grad.clone() for p in m.parameters()]))
            states.append(torch.get_rng_state())
        assert results[0][0] == results[1][0] and all(map(torch.equal, results[0][1], results[1][1])), step
        assert torch.equal(*states), step
    assert isinstance(plans[-1], RematPlan) and plans[-1].extra_flops > 0
    assert any(isinstance(e.prim, ReplayRandom) for e in plans[-1].recompute.graph.eqns)
    assert len(plans) == 3 and plans[-1].peak <= budget


def _no_recompute_peak(model, x):
    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        return loss

    return stagetorch.jit(step, memory_budget="1GiB", remat=False).plan(x).full_batch_peak_bytes


def conv_bn(n: int = 6, c: int = 8) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, c, 3, padding=1),
        *[nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU()) for _ in range(n)],
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 3),
    )


def test_batchnorm_statistics_after_three_steps_equal_eager(plans):
    """BatchNorm in training couples the examples, so the step cannot be chunked: recomputation alone
    fits it, and the running statistics (updated once per step, never in the recomputation) and
    ``num_batches_tracked`` after three SGD steps equal eager's."""
    torch.manual_seed(0)
    model = conv_bn()
    reference = copy.deepcopy(model)
    batches = [torch.randn(4, 3, 24, 24) for _ in range(3)]
    budget = int(0.8 * _no_recompute_peak(model, batches[0]))
    with pytest.raises(stagetorch.errors.BatchCouplingError):
        model(stagetorch.lazy(batches[0], memory_budget=budget, remat=False)).square().mean().backward()
    model.zero_grad(set_to_none=True)
    plans.clear()
    for m, options in ((model, dict(memory_budget=budget)), (reference, None)):
        optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
        for x in batches:
            optimizer.zero_grad()
            m(x if options is None else stagetorch.lazy(x, **options)).square().mean().backward()
            optimizer.step()
    assert len(plans) == 3 and all(isinstance(p, RematPlan) and not p.chunked for p in plans)
    for ours, theirs in zip(model.modules(), reference.modules()):
        if isinstance(ours, nn.BatchNorm2d):
            assert torch.equal(ours.running_mean, theirs.running_mean)
            assert torch.equal(ours.running_var, theirs.running_var)
            assert ours.num_batches_tracked.item() == theirs.num_batches_tracked.item() == 3
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_nothing_fits_names_the_smallest_budget_and_changes_nothing():
    torch.manual_seed(0)
    model = mlp_chain()
    x = torch.randn(1, 512, 64)
    before = copy.deepcopy(model)
    with pytest.raises(OutOfMemoryError, match="smallest budget any schedule fits is") as info:
        model(stagetorch.lazy(x, memory_budget="256KiB")).square().mean().backward()
    assert all(map(torch.equal, model.parameters(), before.parameters()))
    assert all(p.grad is None for p in model.parameters())
    named = str(info.value).split("fits is ")[1].split(" (")[0]
    # ... and that budget runs, within itself. The message rounds to 0.1 MiB (down as often as up).
    smallest = parse_bytes(named.replace(" ", "")) + (MiB // 20 if named.endswith("MiB") else 0)
    assert smallest <= 2 * MiB  # a budget test_one_example_that_does_not_fit_is_bit_exact_against_eager runs in
    with AllocatorPeak([*model.parameters(), x]) as tracker:
        loss = model(stagetorch.lazy(x, memory_budget=smallest)).square().mean()
        loss.backward()
    assert tracker.peak <= smallest
    # Without recomputation, the error chunking alone gives.
    model.zero_grad(set_to_none=True)
    with pytest.raises(OutOfMemoryError, match="not even one example fits") as info:
        model(stagetorch.lazy(x, memory_budget=ONLY_REMAT, remat=False)).square().mean().backward()
    assert "Recomputing" not in str(info.value)
    assert all(p.grad is None for p in model.parameters())


def test_a_retry_at_the_named_budget_then_the_optimizer_step_is_eagers():
    """The retry loop users write around an OutOfMemoryError: catch it, keep it (to log), run the step again
    at ``error.smallest_budget``, then ``optimizer.step()`` — three steps against eager. The failed step's
    session is still reachable from the kept error; the optimizer's pre-step flush ran it again, with the
    budget it had failed under, and raised the old error at ``optimizer.step()``."""
    torch.manual_seed(0)
    model = mlp_chain(6, 32).double()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    budget, errors, failed = 64 * 1024, [], []
    for _ in range(3):
        x = torch.randn(4, 64, 32, dtype=torch.float64)
        for _attempt in range(2):
            opt.zero_grad()
            try:
                loss = model(stagetorch.lazy(x, memory_budget=budget)).square().mean()
                loss.backward()
                break
            except OutOfMemoryError as e:
                errors.append(e)  # kept: its traceback holds the failed step's lazy tensors
                failed.append(loss)
                budget = e.smallest_budget
        opt.step()
        ref_opt.zero_grad()
        expected = reference(x).square().mean()
        expected.backward()
        ref_opt.step()
        torch.testing.assert_close(loss.item(), expected.item(), rtol=1e-12, atol=0)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)
    assert len(errors) >= 1
    # The failed step's loss never ran; its parameters have changed since: reading it is refused.
    with pytest.raises(stagetorch.errors.ModifiedInputError, match="changed in place before the op ran"):
        failed[0].item()


@pytest.mark.lazy_modes("record")
def test_bad_remat_values_are_refused():
    with pytest.raises(ValueError, match="remat must be"):
        stagetorch.lazy(torch.randn(2, 3), remat=True)
    with pytest.raises(ValueError, match="remat must be"):
        stagetorch.lazy(torch.randn(2, 3), remat="always")


def _measured_lazy_step(model, x, plans, **options):
    """(measured peak, plan) of one lazy step, from the lazy line to ``loss.item()``."""
    model.zero_grad(set_to_none=True)
    with AllocatorPeak([*model.parameters(), x]) as tracker:
        loss = model(stagetorch.lazy(x, **options)).square().mean()
        loss.backward()
        loss.item()
    return tracker.peak, plans[-1]


@pytest.mark.parametrize("batch, budget", [(1, "2MiB"), (2, ONLY_REMAT)])
def test_measured_peak_of_a_recomputing_lazy_step_is_the_plans(batch, budget, plans):
    """The live-storage tracker's peak over a whole lazy step is at most the budget and within 2% of the
    flush's predicted peak, whole and chunked, recorded and repeated. The same chunks without recomputation
    are predicted to the byte (the chunk graphs once counted each chunk's input view as a new tensor, one
    example's input too many); recomputation may add no error beyond 2%."""
    torch.manual_seed(0)
    model = mlp_chain()
    x = torch.randn(batch, 512, 64)
    if batch > 1:
        peak, plan = _measured_lazy_step(model, x, plans, memory_budget=CHUNKS_ALONE, remat=False)
        assert plan.chunk_sizes == (1, 1) and not isinstance(plan, RematPlan)
        assert abs(plan.peak - peak) <= 64, (peak, plan)  # the allocator also sees a wrapped scalar's 4-12 bytes
    for step in range(2):  # the second step replays (or runs express) what the first recorded
        peak, plan = _measured_lazy_step(model, x, plans, memory_budget=budget)
        assert isinstance(plan, RematPlan) and plan.chunk_sizes == (1,) * batch
        assert peak <= plan.peak + 64 and plan.peak <= parse_bytes(budget), (step, peak, plan)
        assert plan.peak - peak <= 0.02 * peak, (step, peak, plan)


def test_the_copies_a_flush_keeps_to_restore_batchnorm_fit_the_budget(plans):
    """A flush that updates BatchNorm's statistics copies them first (to restore them if it fails), beside
    the program: the budget is planned less those copies, so at the smallest budget the error names, the
    measured peak (copies included) is within it. A wide BatchNorm on two examples: the statistics are a
    sixth of the step's bytes, more than the plan's margin."""
    torch.manual_seed(0)
    model = nn.BatchNorm1d(1 << 16)
    x = torch.randn(2, 1 << 16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # BatchNorm cannot run in chunks: the whole batch (3.9 MiB) and the copies (512 KiB) must fit.
    with pytest.raises(stagetorch.errors.StagingError, match="copies of the 2 input") as raised:
        model(stagetorch.lazy(x, memory_budget="64KiB")).square().mean().backward()
    budget = raised.value.smallest_budget
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the failed flush changed nothing
    model.zero_grad(set_to_none=True)
    # At the allocator (it ran 116 KiB over this budget while the plan left out the kernels' per-thread
    # buffers: a BatchNorm1d over two examples reduces through 2 x threads x C floats, 1 MiB here).
    with AllocatorPeak([*model.parameters(), *model.buffers(), x]) as tracker:
        loss = model(stagetorch.lazy(x, memory_budget=budget)).square().mean()
        loss.backward()
        loss.item()
    copies = 2 * (1 << 16) * 4
    assert copies >= SAFETY_MARGIN * budget  # (the budget named is rounded up to 5.0 MiB: the copies are its tenth)
    assert plans[-1].held_bytes == copies and plans[-1].peak <= budget  # the plan's peak counts the copies
    assert tracker.peak <= budget, (tracker.peak, budget)
    assert abs(tracker.peak - plans[-1].peak) <= 64, (tracker.peak, plans[-1].peak)

"""The rule of one-line mode: a lazy program's observable results equal eager's, step by step.

Each class of deferred-evaluation bug that issue 14 lists, as a seven-step training loop run twice, once with
``stagetorch.lazy`` (with and without a budget that forces chunks) and once in plain PyTorch; every value the
loop observes is compared, step by step. Where eager is legal but deferring cannot reproduce it, a named
error is raised and the state (parameters, ``.grad``, buffers) is left as it was.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from lazy_loops import RealKernelBatchSizes, batches, mlp

import stagetorch
from stagetorch.lazymode import recording
from stagetorch.lazymode.mode import Mode

pytestmark = pytest.mark.usefixtures("lazy_mode")

STEPS = 7
BUDGETS = [None, 16_000]  # 16 kB: the MLP's batch of 64 runs in two chunks (checked below)
BATCH = 64


def run(step, one_line, budget=None, model_fn=mlp, n=STEPS, state_fn=dict):
    """``step(i, model, x, y, state) -> list of observed values`` in a loop with SGD; returns every step's
    observations (tensors made real and cloned), the final parameters and the final state."""
    torch.manual_seed(0)
    model = model_fn()
    state = state_fn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for i, (x, y) in enumerate(batches(n, batch=BATCH)):
        if one_line:
            x, y = stagetorch.lazy(x, y, batch=0, memory_budget=budget)
        optimizer.zero_grad()
        observed = step(i, model, x, y, state)
        optimizer.step()
        seen.append([_real(v) for v in observed])
    return seen, [p.detach().clone() for p in model.parameters()], state


def _real(v):
    if isinstance(v, stagetorch.LazyTensor):
        v = v.value()
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def assert_same(step, budget=None, **kwargs):
    recording.RECORDINGS.clear()
    got, params, _ = run(step, True, budget, **kwargs)
    expected, expected_params, _ = run(step, False, **kwargs)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert len(a) == len(b)
        for u, v in zip(a, b):
            if isinstance(v, torch.Tensor):
                assert type(u) is torch.Tensor and u.shape == v.shape, (i, u, v)
                assert torch.allclose(u, v, rtol=1e-5, atol=1e-6), (i, u, v)
            else:
                assert u == pytest.approx(v, rel=1e-5, abs=1e-6), (i, u, v)
    for p, q in zip(params, expected_params):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6)


def test_the_budget_forces_chunks():
    x, y = batches(1, batch=BATCH)[0]
    model = mlp()
    with RealKernelBatchSizes((torch.ops.aten.addmm,)) as seen:
        F.cross_entropy(model(stagetorch.lazy(x, batch=0, memory_budget=BUDGETS[1])), y).backward()
    assert max(seen.sizes) < BATCH, seen.sizes


# 1. An in-place op on a real tensor with a lazy operand is computed at once.


@pytest.mark.parametrize("budget", BUDGETS)
def test_in_place_into_a_real_tensor_with_a_lazy_operand(budget):
    def state():
        return {"ema": torch.zeros(()), "bank": torch.zeros(BATCH, 4)}

    def step(i, model, x, y, s):
        loss = F.cross_entropy(model(x), y)
        s["ema"].mul_(0.9).add_(loss.detach() * 0.1)  # a real tensor, a lazy operand
        ema_now = s["ema"].clone()  # read at once: a real op on a real tensor
        s["bank"][:, :2] = model[0](x).detach()[:, :2] * 2  # a slice of a real tensor
        bank_now = s["bank"].sum()
        loss.backward()
        return [loss, ema_now, bank_now]

    assert_same(step, budget, state_fn=state)


@pytest.mark.parametrize("budget", BUDGETS)
def test_an_optimizer_step_on_gradients_from_autograd_grad(budget):
    def step(i, model, x, y, s):
        loss = F.cross_entropy(model(x), y)
        grads = torch.autograd.grad(loss, list(model.parameters()))
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        torch.optim.SGD(model.parameters(), lr=0.05).step()  # in place on the parameters, lazy operands
        weight_now = model[0].weight.sum()  # the parameter, read at once
        return [loss, weight_now]

    assert_same(step, budget)


# 2. A 0-d tensor consumed as a Python number is guarded by its value.


@pytest.mark.parametrize("budget", BUDGETS)
def test_indexing_by_a_zero_dim_tensor_whose_value_changes(budget):
    def step(i, model, x, y, s):
        out = model(x)
        t = torch.tensor(i % 3)
        picked = out[:, t]  # __index__ reads t's value
        loss = F.cross_entropy(out, y) + picked.square().mean()
        loss.backward()
        return [loss, picked]

    assert_same(step, budget)


# 3. A real tensor a recorded op read is guarded by its version counter.


@pytest.mark.parametrize("budget", BUDGETS)
def test_a_parameter_changed_in_place_before_backward_raises_with_state_untouched(budget):
    recording.RECORDINGS.clear()
    model = mlp()
    for i, (x, y) in enumerate(batches(STEPS, batch=BATCH)):
        x, y = stagetorch.lazy(x, y, batch=0, memory_budget=budget)
        model.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if i == 3:
            with torch.no_grad():
                model[2].bias.add_(0.1)  # legal in eager: the loss was computed with the old bias
            before = [p.detach().clone() for p in model.parameters()]
            with pytest.raises(stagetorch.ModifiedInputError, match=r"test_lazy_eager_rule.py:\d+"):
                loss.backward()
            assert all(p.grad is None for p in model.parameters())
            assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
            continue
        loss.backward()
        assert all(type(p.grad) is torch.Tensor for p in model.parameters())


@pytest.mark.parametrize("budget", BUDGETS)
def test_a_parameter_changed_after_a_read_is_fine(budget):
    def step(i, model, x, y, s):
        loss = F.cross_entropy(model(x), y)
        first = loss.item()  # the forward ran: changing a parameter now changes nothing it computed
        with torch.no_grad():
            model[2].bias.add_(0.01)
        loss.backward()
        return [first, loss, model[2].bias.grad]

    assert_same(step, budget)


@pytest.mark.parametrize("budget", BUDGETS)
def test_a_parameter_read_again_after_a_flush_and_changed_before_its_op_raises(budget):
    """A value read runs the first forward; a second forward reads the same parameters again, and one is
    changed in place before that forward ran: it raises, as it does for the first forward (it computed with
    the new value: the parameter was bound before the flush and its version not taken again)."""
    recording.RECORDINGS.clear()
    model = mlp()
    for x, y in batches(STEPS, batch=BATCH):
        x, y = stagetorch.lazy(x, y, batch=0, memory_budget=budget)
        F.cross_entropy(model(x), y).item()
        loss = F.cross_entropy(model(x), y)
        with torch.no_grad():
            model[2].bias.add_(0.1)
        with pytest.raises(stagetorch.ModifiedInputError, match=r"test_lazy_eager_rule.py:\d+"):
            loss.item()


# 4. A value from a finished step is usable anywhere.


@pytest.mark.parametrize("budget", BUDGETS)
def test_a_running_total_across_steps(budget):
    def step(i, model, x, y, s):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        s["total"] = s.get("total", 0) + loss.detach()  # a lazy tensor of the previous step's session
        s["outs"] = [*s.get("outs", []), model(x).detach()]
        return [s["total"], torch.stack(s["outs"]).mean(0)]

    assert_same(step, budget)


@pytest.mark.parametrize("budget", BUDGETS)
def test_outputs_of_a_second_loop_read_after_it(budget):
    """A second model of the same shapes replays the first loop's recording; outputs kept from its steps
    and read after the loop."""
    recording.RECORDINGS.clear()
    for seed in (0, 3):
        model = mlp(seed)
        reference = copy.deepcopy(model)
        kept, expected = [], []
        for x, y in batches(STEPS, batch=BATCH):
            out = model(stagetorch.lazy(x, batch=0, memory_budget=budget))
            F.cross_entropy(out, y).backward()
            kept.append(out)
            ref = reference(x)
            F.cross_entropy(ref, y).backward()
            expected.append(ref.detach())
        for a, b in zip(kept, expected):
            assert torch.allclose(a.value(), b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("budget", BUDGETS)
def test_a_new_call_after_backward_in_a_replayed_step(budget):
    def step(i, model, x, y, s):
        out = model(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        accuracy = (out.argmax(1) == y).float().mean()  # after backward: a call the recording may lack
        extra = model[0](x).sum() if i % 2 else loss * 2  # alternates
        return [loss, accuracy, extra]

    assert_same(step, budget)


def _autograd_grad_loop(one_line, budget, log_previous, momentum, n=4):
    """Gradient logging around ``torch.autograd.grad``: each step clones the previous step's ``.grad`` (a lazy
    tensor of the step before's session) before ``zero_grad()``, assigns the new gradients to ``.grad`` and
    steps SGD with momentum (its buffer, made by the first step, is a lazy tensor of that step's session).
    Returns the losses, the logged gradients and the parameters after each step."""
    torch.manual_seed(0)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    seen = []
    for x, y in batches(n, batch=BATCH):
        if one_line:
            x, y = stagetorch.lazy(x, y, batch=0, memory_budget=budget)
        loss = F.cross_entropy(model(x), y)
        grads = torch.autograd.grad(loss, list(model.parameters()))
        logged = [p.grad.clone() if log_previous and p.grad is not None else None for p in model.parameters()]
        optimizer.zero_grad()
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        optimizer.step()
        seen.append((
            _real(loss), [None if g is None else _real(g) for g in logged], [p.detach().clone() for p in model.parameters()],
        ))
    return seen


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("momentum", [0.9, 0.0])
@pytest.mark.parametrize("log_previous", [True, False], ids=["logged", "not-logged"])
def test_autograd_grad_assigned_to_grad_with_momentum_and_the_previous_grad_logged(log_previous, momentum, budget):
    """Issue 43: with the previous ``.grad`` cloned (recorded in the older session) and SGD's momentum buffer a
    lazy tensor of the first step, reading the buffer for ``buf.mul_(momentum).add_(grad)`` peeked at the
    older session, leaving its ``mul_`` pending; the next step's peek computed it again from the buffer
    before the real ``add_`` wrote into it, and the parameters drifted from the third step on. A value of
    an older session read by a newer one's call runs that session's pending work whole first."""
    recording.RECORDINGS.clear()
    got = _autograd_grad_loop(True, budget, log_previous, momentum)
    expected = _autograd_grad_loop(False, None, log_previous, momentum)
    for i, ((loss, logged, params), (loss0, logged0, params0)) in enumerate(zip(got, expected)):
        assert type(loss) is torch.Tensor and torch.allclose(loss, loss0, rtol=1e-5, atol=1e-6), i
        for g, g0 in zip(logged, logged0):
            assert (g is None) == (g0 is None), i
            assert g is None or torch.allclose(g, g0, rtol=1e-5, atol=1e-6), i
        for p, p0 in zip(params, params0):
            assert torch.allclose(p, p0, rtol=1e-5, atol=1e-6), (i, (p - p0).abs().max())


# 5. A failed step leaves nothing behind.


def _bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


@pytest.mark.parametrize("grads_before", [False, True])
def test_a_failed_step_leaves_parameters_grads_and_buffers(grads_before):
    """BatchNorm in training mode couples the batch: a budget that forces chunks raises BatchCouplingError.
    The parameters, their .grad (absent, or a real one) and the buffers are as before the step; a step with
    enough memory then equals eager."""
    recording.RECORDINGS.clear()
    model = _bn_model()
    reference = copy.deepcopy(model)
    for i, (x, y) in enumerate(batches(STEPS, batch=BATCH)):
        if grads_before:
            for m in (model, reference):
                F.cross_entropy(m(x[:2].clone()), y[:2]).backward()
        params = [p.detach().clone() for p in model.parameters()]
        grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        buffers = [b.clone() for b in model.buffers()]
        if i % 2:
            lx, ly = stagetorch.lazy(x, y, batch=0, memory_budget=BUDGETS[1])
            with pytest.raises(stagetorch.BatchCouplingError):
                F.cross_entropy(model(lx), ly).backward()
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
            for p, g in zip(model.parameters(), grads):
                assert (p.grad is None) == (g is None)
                assert g is None or (type(p.grad) is torch.Tensor and torch.equal(p.grad, g))
            assert all(torch.equal(b, c) for b, c in zip(model.buffers(), buffers))
        else:
            lx, ly = stagetorch.lazy(x, y, batch=0)
            F.cross_entropy(model(lx), ly).backward()
            F.cross_entropy(reference(x), y).backward()
            for p, q in zip(model.parameters(), reference.parameters()):
                assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6)
            for b, c in zip(model.buffers(), reference.buffers()):
                assert torch.allclose(b.float(), c.float(), rtol=1e-5, atol=1e-6)
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)


# 6. Deterministic plans.


def test_the_same_shapes_and_budget_always_give_the_same_plan(caplog):
    import models

    recording.RECORDINGS.clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))
    outcomes = []
    for i in range(STEPS):
        x, y = torch.randn(64, 32), torch.randint(0, 4, (64,))
        lx, ly = stagetorch.lazy(x, y, batch=0, memory_budget=14_000)
        try:
            with caplog.at_level(logging.INFO, logger="stagetorch"):
                caplog.clear()
                loss = F.cross_entropy(model(lx), ly)
                loss.backward()
                outcomes.append(("ran", tuple(r.getMessage() for r in caplog.records)))
        except stagetorch.OutOfMemoryError:
            outcomes.append(("oom", ()))
        model.zero_grad()
        if i == 2:
            (model(stagetorch.lazy(x, batch=0)) * 2).sum().backward()  # another program in between
            model.zero_grad()
    del models
    assert len({o[0] for o in outcomes}) == 1, outcomes
    assert len(set(outcomes[1:])) == 1, outcomes


# 7. A wrong shape raises ShapeError without torch's log.


def test_a_shape_error_prints_no_torch_log(capfd, caplog):
    x = stagetorch.lazy(torch.randn(4, 3))
    with caplog.at_level(logging.DEBUG), pytest.raises(stagetorch.ShapeError, match=r"test_lazy_eager_rule.py:\d+"):
        x @ torch.randn(4, 3)
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    assert [r for r in caplog.records if r.name.startswith("torch")] == []


# 8. Kernel-selecting global state is in the key; hooks run as in eager.


@pytest.mark.parametrize("budget", BUDGETS)
def test_deterministic_algorithms_switched_between_steps(budget, recorded, lazy_mode):
    before = torch.are_deterministic_algorithms_enabled()
    counts = []

    def step(i, model, x, y, s):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        counts.append(len(recorded))
        torch.use_deterministic_algorithms(i + 1 in (3, 4))  # from the next step's lazy(...) on
        return [loss]

    try:
        assert_same(step, budget)
    finally:
        torch.use_deterministic_algorithms(before)
    # Step 3 runs another program: it is recorded, not replayed from steps 0-2; step 5 replays those again.
    lazy = counts[:STEPS]
    if lazy_mode >= Mode.REPLAY:
        assert lazy[3] > lazy[2] and lazy[4] == lazy[3] and lazy[6] == lazy[5] == lazy[4], lazy


@pytest.mark.parametrize("budget", BUDGETS)
def test_a_logging_hook_on_a_real_intermediate_runs_every_step(budget):
    calls = []

    def step(i, model, x, y, s):
        w = model[0].weight * 1.0  # real, with an autograd node
        w.register_hook(lambda g: calls.append((i, tuple(g.shape))))  # runs no op
        loss = F.cross_entropy(model[2](model[1](F.linear(x, w, model[0].bias))), y)
        loss.backward()
        return [loss]

    assert_same(step, budget)
    lazy, eager = calls[: len(calls) // 2], calls[len(calls) // 2 :]
    assert lazy == eager and len(eager) == STEPS

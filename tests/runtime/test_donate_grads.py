"""``jit(donate_grads=True)`` (issue 25): a step that calls ``zero_grad()`` inside frees the previous step's
``.grad`` when the call starts, as eager frees it at the ``zero_grad()``, instead of holding it until its
program has run. Against the same loop in eager, unchunked and in >= 3 chunks; what a failed step leaves
(the donated ``.grad`` None, everything else exactly as before); a retry in smaller chunks after running out
of memory; and a ``.grad`` the step reads before it clears it, which is not dropped. The allocator's view is
in tests/interpreters/test_memory.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from injected import identity_op
from staged_state import budget_for

import stagetorch
from stagetorch.planning.budget import SAFETY_MARGIN

BATCH = 24
_FAIL = {"above": 10**9, "error": RuntimeError, "raised": 0}


def _fail_above(x: torch.Tensor) -> None:
    """Raise ``_FAIL["error"]`` for more than ``_FAIL["above"]`` examples: a kernel failing mid-step (with
    ``torch.OutOfMemoryError``, a chunk too large for the device)."""
    if x.shape[0] > _FAIL["above"]:
        _FAIL["raised"] += 1
        raise _FAIL["error"](f"injected failure at {x.shape[0]} examples")


identity_op("donate_fail_above", _fail_above)


@pytest.fixture(autouse=True)
def _no_failure():
    yield
    _FAIL.update(above=10**9, error=RuntimeError, raised=0)


OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    model.register_buffer("steps", torch.zeros((), dtype=torch.float64))
    return model


def _trained(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the optimizer steps (and its zero_grad() clears): all but the first bias, whose
    ``.grad`` the step adds into (a ``.grad`` that is not donated)."""
    return [p for n, p in model.named_parameters() if n != "0.bias"]


def _step(model: nn.Module, opt: torch.optim.Optimizer, after: bool = False):
    def step(x, y):
        opt.zero_grad()
        with torch.no_grad():
            model.steps.add_(1)  # a buffer written in place, before anything can fail
        loss = F.cross_entropy(model(x if after else torch.ops.stagetorch_test.donate_fail_above(x)), y)
        loss.backward()
        opt.step()
        if after:  # a forward after the update: a failure there comes after the weights moved
            return loss, torch.ops.stagetorch_test.donate_fail_above(model(x))
        return loss

    return step


def _data():
    return torch.randn(BATCH, 5, dtype=torch.float64), torch.randint(0, 3, (BATCH,))


def _assert_same(model, opt, reference, ref_opt, tol, when=""):
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=tol, atol=tol, msg=lambda m, name=name: f"{when} {name}: {m}")
        assert (p.grad is None) == (q.grad is None), f"{when} {name}.grad"
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=tol, atol=tol, msg=lambda m, name=name: f"{when} {name}.grad: {m}")
    torch.testing.assert_close(model.steps, reference.steps, rtol=0, atol=0)
    for p, q in zip(model.parameters(), reference.parameters()):
        if p not in opt.state and q not in ref_opt.state:
            continue  # (indexing a defaultdict would add the parameter to the optimizer's state)
        assert opt.state[p].keys() == ref_opt.state[q].keys()
        for key, value in ref_opt.state[q].items():
            torch.testing.assert_close(opt.state[p][key], value, rtol=tol, atol=tol, msg=lambda m, key=key: f"{when} {key}: {m}")


def _grad_bytes(params) -> int:
    return sum(p.grad.untyped_storage().nbytes() for p in params if p.grad is not None)


@pytest.mark.parametrize("chunked", [False, True], ids=["unchunked", "chunked"])
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_a_training_loop_with_donated_grads_matches_eager_every_step(kind, chunked):
    """Five steps, the learning rate set from Python before each (a new program each time), a gradient hook
    and a buffer updated in place: parameters, ``.grad`` and optimizer state equal eager's after every step,
    and from the second step on the plan drops the previous ``.grad`` instead of holding it."""
    model, reference = _model(), _model()
    for m in (model, reference):
        m[2].weight.register_hook(lambda g: g.clamp(-0.05, 0.05))
    opt, ref_opt = OPTIMIZERS[kind](_trained(model)), OPTIMIZERS[kind](_trained(reference))
    staged = stagetorch.jit(_step(model, opt), donate_grads=True)
    eager = _step(reference, ref_opt)
    # Staged Adam runs torch's capturable formulation (its bias corrections from the step-count tensor):
    # updates agree to float32's rounding.
    tol = 1e-6 if kind == "adamw" else 1e-11
    for call, lr in enumerate([0.1, 0.05, 0.05, 0.02, 0.01]):
        for o in (opt, ref_opt):
            for group in o.param_groups:
                group["lr"] = lr * (0.1 if kind == "adamw" else 1)
        x, y = _data()
        if chunked:
            budget_for(staged, x, y)
        plan = staged.plan(x, y)
        assert len(plan.chunk_sizes) >= 3 if chunked else len(plan.chunk_sizes) == 1
        assert plan.donated_bytes == _grad_bytes(_trained(model)) and (plan.donated_bytes > 0) == (call > 0)
        if call:
            assert "donate_grads=True" in str(plan)
        expected = eager(x, y)
        loss = staged(x, y)
        torch.testing.assert_close(loss, expected.detach(), rtol=tol, atol=tol)
        _assert_same(model, opt, reference, ref_opt, tol, f"call {call}:")
    assert all(p.grad is not None for p in model.parameters())


def test_the_plan_and_the_memory_report_leave_the_donated_grads_out():
    """The default holds the old ``.grad`` beside the program (``held``); ``donate_grads=True`` drops it:
    ``plan.held_bytes`` falls by its bytes, ``plan.donated_bytes`` says them, and ``stagetorch.memory``
    plans the same way (its peak the plan's, its note naming the ``.grad`` dropped)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = _step(model, opt)
    x, y = _data()
    stagetorch.jit(step)(x, y)  # the .grad and momentum the next call finds
    grads = _grad_bytes(model.parameters())
    kept, donated = stagetorch.jit(step).plan(x, y), stagetorch.jit(step, donate_grads=True).plan(x, y)
    assert kept.held_bytes - donated.held_bytes == grads and kept.donated_bytes == 0
    assert donated.donated_bytes == grads and donated.peak == kept.peak - grads
    report = stagetorch.memory(step, donate_grads=True)(x, y)
    default = stagetorch.memory(step)(x, y)
    assert report.peak_bytes == donated.peak and default.peak_bytes == kept.peak
    assert default.by_category["held"] - report.by_category.get("held", 0) == grads
    assert "drops the old .grad of 4 parameter(s)" in report.note and "donate_grads" not in default.note
    # A budget the step fits whole in only without the old .grad: the default chunks, the report with
    # donate_grads=True runs it whole, as jit(donate_grads=True) would.
    budget = int((donated.peak - donated.held_bytes) / (1 - SAFETY_MARGIN)) + donated.held_bytes + 64
    assert len(stagetorch.jit(step, memory_budget=budget).plan(x, y).chunk_sizes) > 1
    budgeted = stagetorch.memory(step, donate_grads=True, memory_budget=budget)(x, y)
    assert budgeted.schedule.peak_bytes == donated.peak and len(budgeted.schedule.chunk_sizes) == 1
    assert "donate_grads=True" in budgeted.schedule.plan
    with pytest.raises(TypeError, match="donate_grads must be True or False"):
        stagetorch.jit(step, donate_grads="yes")


def _snapshot(model, opt) -> dict:
    out = {n: t.detach().clone() for n, t in model.state_dict().items()}
    out.update({f"{n}.grad": None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
    out["optimizer"] = copy.deepcopy(opt.state_dict())
    return out


@pytest.mark.parametrize("donate", [False, True], ids=["kept", "donated"])
@pytest.mark.parametrize("where", ["forward", "forward_chunked", "after_the_update"])
def test_a_failed_step_leaves_the_donated_grads_none_and_the_rest_as_it_was(where, donate):
    """An exception in the forward (unchunked, or in the last of >= 3 chunks), or in a forward after the
    optimizer's update: parameters, the buffer, optimizer state and the ``.grad`` the step adds into are bitwise
    as before; the ``.grad`` ``zero_grad()`` would have cleared is None with ``donate_grads=True`` (as after
    eager's ``zero_grad()``), and as before without it."""
    model = _model()
    opt = torch.optim.AdamW(_trained(model), lr=0.01, weight_decay=0.1)
    staged = stagetorch.jit(_step(model, opt, after=where == "after_the_update"), donate_grads=donate)
    x, y = _data()
    staged(x, y)
    staged(x, y)  # the program that updates the optimizer's state in place
    if where == "forward_chunked":
        budget_for(staged, x, y)
    sizes = staged.plan(x, y).chunk_sizes
    before = _snapshot(model, opt)
    _FAIL["above"] = max(sizes) - 1
    with pytest.raises(RuntimeError, match="injected failure"):
        staged(x, y)
    _FAIL["above"] = 10**9
    after = _snapshot(model, opt)
    donated = {f"{n}.grad" for n, p in model.named_parameters() if n != "0.bias"} if donate else set()
    assert donated == {"0.weight.grad", "2.weight.grad", "2.bias.grad"} or not donate
    for name, t in before.items():
        if name == "optimizer":
            torch.testing.assert_close(after[name], t, rtol=0, atol=0)
        elif name in donated:
            assert after[name] is None, f"{name} was kept"
        else:
            assert after[name] is not None and torch.equal(t, after[name]), f"{name} changed by a failed step"
    # And the loop goes on as eager's would after a zero_grad(): the next step is right.
    reference = copy.deepcopy(model)
    for p, q in zip(model.parameters(), reference.parameters()):
        q.grad = None if p.grad is None else p.grad.clone()
    ref_opt = torch.optim.AdamW(_trained(reference), lr=0.01, weight_decay=0.1)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # (load_state_dict shares the step count)
    expected = _step(reference, ref_opt, after=where == "after_the_update")(x, y)
    got = staged(x, y)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    _assert_same(model, opt, reference, ref_opt, 1e-6)


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_running_out_of_memory_is_retried_in_smaller_chunks_with_donated_grads(chunked):
    """The device runs out of memory on every chunk of the plan's size (on the whole batch, unchunked):
    the step is redone in smaller chunks, which need nothing from the dropped ``.grad``, and gives eager's
    parameters, ``.grad`` and optimizer state."""
    model, reference = _model(), _model()
    opt, ref_opt = OPTIMIZERS["adamw"](_trained(model)), OPTIMIZERS["adamw"](_trained(reference))
    staged, eager = stagetorch.jit(_step(model, opt), donate_grads=True), _step(reference, ref_opt)
    x, y = _data()
    torch.testing.assert_close(staged(x, y), eager(x, y).detach(), rtol=1e-6, atol=1e-6)
    if chunked:
        budget_for(staged, x, y)
    plan = staged.plan(x, y)
    assert plan.donated_bytes == _grad_bytes(_trained(model)) > 0
    expected = eager(x, y)
    _FAIL.update(above=max(plan.chunk_sizes) - 1, error=torch.OutOfMemoryError)
    loss = staged(x, y)
    assert _FAIL["raised"] >= 1  # it did run out, and was redone
    assert max(staged.plan(x, y).chunk_sizes) < max(plan.chunk_sizes)  # later plans use the size that ran
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-6, atol=1e-6)
    _assert_same(model, opt, reference, ref_opt, 1e-6)


def _reading_step(model, opt, order):
    def step(x, y):
        if order == "clip_then_zero":  # clips the .grad it was given, steps with it, then clears it
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
            opt.zero_grad()
        loss = F.cross_entropy(model(torch.ops.stagetorch_test.donate_fail_above(x)), y)
        loss.backward()
        if order == "accumulate_clip_step_zero":  # adds into the .grad it was given, clips, steps, clears
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
            opt.zero_grad()
        return loss

    return step


@pytest.mark.parametrize("order", ["clip_then_zero", "accumulate_clip_step_zero"])
def test_a_grad_the_step_reads_before_clearing_it_is_not_dropped(order):
    """A ``.grad`` the step reads first (clips, adds into) is an input of the program: ``donate_grads=True``
    keeps it until the program has run, so a failed step leaves it exactly as it was, and the step is
    eager's."""
    model, reference = _model(), _model()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference))
    staged, eager = stagetorch.jit(_reading_step(model, opt, order), donate_grads=True), _reading_step(reference, ref_opt, order)
    for call in range(3):
        x, y = _data()
        for m in (model, reference):  # the .grad the step is given (an earlier micro-batch's)
            F.cross_entropy(m(x[:8]), y[:8]).backward()
        plan = staged.plan(x, y)
        assert plan.donated_bytes == 0 and plan.held_bytes >= _grad_bytes(model.parameters()) > 0
        if call == 1:  # a failed step first: the .grad it was given is still there, bit for bit
            before = _snapshot(model, opt)
            _FAIL["above"] = BATCH - 1
            with pytest.raises(RuntimeError, match="injected failure"):
                staged(x, y)
            _FAIL["above"] = 10**9
            after = _snapshot(model, opt)
            for name, t in before.items():
                if name == "optimizer":
                    torch.testing.assert_close(after[name], t, rtol=0, atol=0)
                else:
                    assert t is not None and torch.equal(t, after[name]), f"{name} changed by a failed step"
        torch.testing.assert_close(staged(x, y), eager(x, y).detach(), rtol=1e-10, atol=1e-10)
        _assert_same(model, opt, reference, ref_opt, 1e-10, f"call {call}:")

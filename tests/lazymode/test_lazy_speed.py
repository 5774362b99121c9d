"""What the one-line step's hot path keeps from one step to the next, and what makes it stop: each cache of
issue 27's one-line work, with the change that must invalidate it. Every loop runs against plain PyTorch."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from lazy_loops import assert_same_loop, batches, mlp

import stagetorch
from stagetorch.devices import budget as devices
from stagetorch.lazymode import recording, session

pytestmark = pytest.mark.usefixtures("lazy_mode")


def test_a_flush_keeps_what_each_step_keeps_alive():
    """The backward's flush is found by the values it must keep: a hidden state held past backward() on
    some steps and not on others is an output of the flush exactly on the steps that hold it (a flush
    looked up by its equations alone would give the steps that hold it none, or keep it on every step)."""
    recording.RECORDINGS.clear()
    model = mlp()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer0 = torch.optim.SGD(reference.parameters(), lr=0.1)
    for i, (x, y) in enumerate(batches(6)):
        keep = i in (2, 3, 5)  # not on the first steps, which record and first replay the flush
        x0 = x
        x, y = stagetorch.lazy(x, y, batch=0)
        optimizer.zero_grad()
        optimizer0.zero_grad()
        h = model[1](model[0](x))
        h0 = reference[1](reference[0](x0))
        loss = F.cross_entropy(model[2](h), y)
        if not keep:
            del h  # dropped before backward(): its flush need not keep it
        loss.backward()
        F.cross_entropy(reference[2](h0), y).backward()
        if keep:
            assert torch.allclose(h.sum(), h0.sum().detach(), rtol=1e-5), i  # its value after backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), i
        optimizer.step()
        optimizer0.step()


def test_a_parameter_replaced_by_another_object_is_read():
    """A layer's weight replaced by another Parameter of the same shape: the express replay's kept view of
    the old weight (``weight.t()`` in linear) is not used for the new one."""
    def step(i, model, x, y):
        if i == 2:
            model[0].weight = nn.Parameter(torch.randn(16, 12, generator=torch.Generator().manual_seed(i)))
        return F.cross_entropy(model(x), y)

    assert_same_loop(step, n=4)


def test_the_budget_of_a_flush_follows_free_memory_per_device(monkeypatch):
    """free_memory keeps each device's type, not its answer: the host's free memory is read again after its
    time to live, and a budget given is parsed each call."""
    devices._HOST_FREE[:] = [float("-inf"), 0]
    monkeypatch.setattr(devices.os, "sysconf", lambda name: {"SC_AVPHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}[name])
    assert devices.free_memory(torch.device("cpu")) == 4096 * 1000
    assert devices.free_memory("cpu", "1MiB") == 1 << 20
    monkeypatch.setattr(devices.os, "sysconf", lambda name: {"SC_AVPHYS_PAGES": 7, "SC_PAGE_SIZE": 4096}[name])
    assert devices.free_memory("cpu") == 4096 * 1000  # within the time to live
    devices._HOST_FREE[0] = float("-inf")
    assert devices.free_memory(torch.device("cpu")) == devices.free_memory("cpu") == 4096 * 7


def test_the_optimizer_step_runs_a_metric_computed_after_backward_first():
    """A metric computed with the model after backward() (a second forward: calls on a session whose backward
    ran everything) and read after optimizer.step() is the one of the parameters before the step, as in eager:
    the optimizer's hook finds the session again although its backward left it with nothing pending."""
    model = mlp()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    optimizer0 = torch.optim.SGD(reference.parameters(), lr=0.5)
    for x, y in batches(5):
        x0, y0 = x, y
        x, y = stagetorch.lazy(x, y, batch=0)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        metric = F.cross_entropy(model(x), y, reduction="none")
        optimizer.step()
        optimizer0.zero_grad()
        F.cross_entropy(reference(x0), y0).backward()
        expected = F.cross_entropy(reference(x0), y0, reduction="none").detach()
        optimizer0.step()
        assert torch.allclose(metric, expected, rtol=1e-5, atol=1e-6)
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-6)


def test_the_optimizer_hook_walks_no_session_whose_calls_all_ran():
    """The optimizer's hook costs what is pending, not what is alive: losses kept across steps (their
    sessions alive) are not looked at once their backward ran every call; a call on one makes it pending
    again."""
    gc.collect()  # sessions earlier tests left in reference cycles, pending or not, are collected
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in batches(4):
        x, y = stagetorch.lazy(x, y, batch=0)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        assert len(session._PENDING) == 1  # this step's, with its forward not run yet
        loss.backward()
        assert not session._PENDING
        optimizer.step()
        losses.append(loss)
    live = sorted(session._SESSIONS, key=lambda s: s.serial)  # the sessions alive: the losses hold theirs
    assert len(live) == len(session._SESSIONS) >= 4 and losses[0]._session in live
    total = losses[0] * 2  # a call on the first session, long idle
    assert len(session._PENDING) == 1
    assert total.item() == 2 * losses[0].item()


class _Scaled(nn.Module):
    """Two layers with a buffer and a Python number between them: state a guard compares, of each kind."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(12, 16)
        self.out = nn.Linear(16, 3)
        self.register_buffer("shift", torch.zeros(16))
        self.scale = 1.0

    def forward(self, x):
        return self.out((F.relu(self.lin(x)) * self.scale + self.shift).to(self.out.weight.dtype))


def _strided(p: nn.Parameter) -> None:
    p.data = p.data.t().contiguous().t()  # the same object and values, column-major: other strides


# What a step loop may change between steps without a call that stagetorch sees (in place, or by a Python
# assignment). Each must make the next step's guard miss (or be read as the new value): never a silent reuse.
_CHANGES = {
    "a parameter in place": lambda m: m.lin.weight.mul_(0.5),
    "a buffer in place": lambda m: m.shift.add_(0.25),
    "a number attribute": lambda m: setattr(m, "scale", 2.0),
    "a parameter replaced": lambda m: setattr(m.lin, "weight", nn.Parameter(torch.randn(16, 12))),
    "a buffer of another dtype": lambda m: setattr(m, "shift", m.shift.double() + 0.5),
    "a buffer of another shape": lambda m: setattr(m, "shift", torch.full((1,), 0.5)),
    "a module replaced": lambda m: setattr(m, "out", nn.Linear(16, 3)),
    "requires_grad off": lambda m: m.lin.bias.requires_grad_(False),
    "a parameter's strides (.data)": lambda m: _strided(m.out.weight),
    "a parameter's storage (.data)": lambda m: setattr(m.lin.weight, "data", torch.randn(16, 12)),
}


@pytest.mark.parametrize("change", list(_CHANGES))
def test_every_guard_still_fires(change):
    """State changed between steps after the express replay started (step 3 of 6): each step still equals
    eager PyTorch's (loss, gradients and parameters), however the guards are cached."""

    def step(i, model, x, y):
        if i == 3:
            with torch.no_grad():
                torch.manual_seed(3)
                _CHANGES[change](model)
        return F.cross_entropy(model(x), y)

    assert_same_loop(step, n=6, model_fn=_Scaled)


class _Dispatched(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _small_classifier_step():
    """A seeded three-layer classifier, its training step, and a batch: the programs the binding tests stage."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))

    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    return model, step, x, y


@pytest.mark.lazy_modes("express")  # (no lazy tensor: one mode is enough)
def test_a_program_calls_a_binding_only_where_it_dispatches_the_op_alone(monkeypatch):
    """A staged program calls torch's Python bindings (torch.addmm) rather than each overload's boxed entry,
    where the binding dispatches that overload alone: the same ops, in the same order, with the same results
    as a program that calls every overload's own entry (ones_like's binding also detaches: not taken)."""
    from stagetorch.interpreters import eager as execute

    def run(bindings: bool):
        model, step, x, y = _small_classifier_step()
        staged = stagetorch.jit(step)
        staged(x, y)
        model.zero_grad()
        with _Dispatched() as seen:
            loss = staged(x, y)
        return seen.ops, loss, [p.grad for p in model.parameters()]

    ops, loss, grads = run(True)
    assert execute._ENTRIES and any(execute._ENTRIES.values())
    assert torch.ops.aten.detach.default not in ops
    monkeypatch.setattr(execute, "_ENTRIES", {})
    monkeypatch.setattr(execute, "_exact_binding", lambda *args: None)
    boxed_ops, boxed_loss, boxed_grads = run(False)
    assert ops == boxed_ops
    assert torch.equal(loss, boxed_loss)
    assert all(torch.equal(g, h) for g, h in zip(grads, boxed_grads))


@pytest.mark.lazy_modes("express")
def test_choosing_the_bindings_is_invisible_to_a_users_dispatch_mode(monkeypatch):
    """The meta calls that choose a program's bindings run with the user's dispatch modes put aside: a mode
    around a step's first call (which compiles the program) sees the same ops whether the bindings are chosen
    then or were chosen before."""
    from stagetorch.interpreters import eager as execute

    def first_call():
        model, step, x, y = _small_classifier_step()
        with _Dispatched() as seen:
            stagetorch.jit(step)(x, y)
        return seen.ops

    first_call()  # the process's other first-use caches warmed (a test run alone starts with none)
    monkeypatch.setattr(execute, "_ENTRIES", {})
    choosing = first_call()
    assert execute._ENTRIES
    assert first_call() == choosing  # (chosen before: no meta call)

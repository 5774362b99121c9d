"""Staged steps that read or write Python-side state, over several calls against the same loop in eager
PyTorch, unchunked and in >= 3 chunks: values the step reads (guards), optimizers inside the step, ``.grad``
read inside the step, batch-wide normalisers, and the state a failed step must leave as it was."""

from __future__ import annotations

import copy

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


# -- Python values the step reads -----------------------------------------------------------------------------

TEMPERATURE = 1.0
CONFIG = {"weight": 1.0}


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 8), nn.LayerNorm(8), nn.ReLU(), nn.Dropout(0.0), nn.Linear(8, 3))
        self.scale = 1.0

    def forward(self, x):
        return self.body(x) * self.scale / TEMPERATURE


def _loss_step(model, extra=lambda: 1.0):
    def step(x, y, weight=1.0):
        loss = F.cross_entropy(model(x), y) * CONFIG["weight"] * weight * extra()
        loss.backward()
        return loss

    return step


def _set_attr(path: str, values: list):
    def change(model: nn.Module, call: int) -> None:
        owner, _, name = path.rpartition(".")
        setattr(model.get_submodule(owner), name, values[call])

    return change


def _set_global(name: str, values: list):
    def change(model: nn.Module, call: int) -> None:
        if isinstance(globals()[name], dict):
            globals()[name]["weight"] = values[call]
        else:
            globals()[name] = values[call]

    return change


CHANGES = {
    "module_attribute": _set_attr(".scale", [1.0, 4.0, 0.5]),
    "dropout_p": _set_attr("body.3.p", [0.0, 0.5, 0.9]),
    "layernorm_eps": _set_attr("body.1.eps", [1e-5, 10.0, 1e-5]),
    "global_float": _set_global("TEMPERATURE", [1.0, 3.0, 0.25]),
    "global_dict_item": _set_global("CONFIG", [1.0, 0.3, 2.0]),
}


@pytest.fixture
def restore_globals():
    saved = TEMPERATURE, dict(CONFIG)
    yield
    globals()["TEMPERATURE"] = saved[0]
    CONFIG.clear()
    CONFIG.update(saved[1])


def _loop(model, step, reference_step, reference, x, y, change, chunked, staged_step=None):
    """CALLS calls of the staged and the eager step, ``change(call)`` applied before each; all state compared."""
    staged = staged_step or stagetorch.jit(step)
    for call in range(CALLS):
        change(call)
        torch.manual_seed(call)
        expected = reference_step(x, y)
        if chunked:
            budget_for(staged, x, y)
        torch.manual_seed(call)
        loss = staged(x, y)
        if chunked:
            assert len(staged.plan(x, y).chunk_sizes) >= 3
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6, msg=lambda m, call=call: f"call {call}: {m}")
        assert_same_state(model, reference)
    return staged


@pytest.mark.usefixtures("restore_globals")
@pytest.mark.parametrize("chunked", [False, True], ids=["unchunked", "chunked"])
@pytest.mark.parametrize("what", list(CHANGES))
def test_a_python_value_the_step_reads_is_read_again_when_it_changes(what, chunked):
    model = Scaled()
    reference = copy.deepcopy(model)
    x, y = torch.randn(BATCH, 5), torch.randint(0, 3, (BATCH,))

    def change(call):
        CHANGES[what](model, call)
        CHANGES[what](reference, call)

    _loop(model, _loss_step(model), _loss_step(reference), reference, x, y, change, chunked)


@pytest.mark.parametrize("chunked", [False, True], ids=["unchunked", "chunked"])
def test_closure_cells_and_default_arguments_are_guarded(chunked):
    model = Scaled()
    reference = copy.deepcopy(model)
    x, y = torch.randn(BATCH, 5), torch.randint(0, 3, (BATCH,))
    factor = [1.0]

    def make(m):
        k = 2.0
        step = _loss_step(m, lambda: factor[0] * k)

        def outer(x, y, w=1.0):
            nonlocal k
            return step(x, y, w)

        def set_k(v):
            nonlocal k
            k = v

        return outer, set_k

    step, set_k = make(model)
    eager, set_k_eager = make(reference)

    def change(call):
        factor[0] = [1.0, 2.0, 3.0][call]
        for f, s in ((step, set_k), (eager, set_k_eager)):
            s([2.0, 0.5, 5.0][call])
            f.__defaults__ = ([1.0, 1.0, 7.0][call],)

    _loop(model, step, eager, reference, x, y, change, chunked)


def test_a_change_restages_with_a_log_that_names_it_and_a_value_seen_before_reuses_its_program(caplog, restore_globals):
    model = Scaled()
    x, y = torch.randn(BATCH, 5), torch.randint(0, 3, (BATCH,))
    staged = stagetorch.jit(_loss_step(model))
    staged(x, y)
    with caplog.at_level("INFO", logger="stagetorch"):
        model.body[3].p = 0.5
        globals()["TEMPERATURE"] = 2.0
        staged(x, y)
    assert "step: staging again (2 programs now), as these changed: model.body.3.p 0.0 -> 0.5; TEMPERATURE 1.0 -> 2.0" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="stagetorch"):
        model.body[3].p = 0.0
        globals()["TEMPERATURE"] = 1.0
        staged(x, y)
        model.scale = 2  # an int where a float was: traced apart (an int tensor would get another dtype)
        staged(x, y)
    assert "staging again (3 programs now), as these changed: model.scale 1.0 -> 2" in caplog.text
    assert len(staged._cache) == 3


def test_a_value_that_changes_every_call_warns_after_eight_programs(caplog):
    model = Scaled()
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    staged = stagetorch.jit(_loss_step(model))
    with caplog.at_level("INFO", logger="stagetorch"):
        for k in range(9):
            model.scale = float(k)
            staged(x, y)
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "staged 8 times" in warnings[0].message and "model.scale 6.0 -> 7.0" in warnings[0].message

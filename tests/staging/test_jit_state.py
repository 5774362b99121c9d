"""Staged steps that read or write Python-side state, over several calls against the same loop in eager
PyTorch, unchunked and in >= 3 chunks: values the step reads (guards), optimizers inside the step, ``.grad``
read inside the step, batch-wide normalisers, and the state a failed step must leave as it was."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from injected import identity_op
from staged_state import assert_same_state, budget_for

import stagetorch

BATCH = 24
CALLS = 3


# -- a failed step restores what it wrote ---------------------------------------------------------------------

_FAIL = {"above": 10**9}


def _fail_above(x: torch.Tensor) -> None:
    """Fail for more than ``_FAIL["above"]`` examples: a kernel failing mid-step."""
    if x.shape[0] > _FAIL["above"]:
        raise RuntimeError(f"injected failure at {x.shape[0]} examples")


identity_op("fail_above", _fail_above)


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
    model.zero_grad()
    with caplog.at_level("INFO", logger="stagetorch"):
        model.body[3].p = 0.5
        globals()["TEMPERATURE"] = 2.0
        staged(x, y)
    assert "step: staging again (2 programs now), as these changed: model.body.3.p 0.0 -> 0.5; TEMPERATURE 1.0 -> 2.0" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="stagetorch"):
        model.body[3].p = 0.0
        globals()["TEMPERATURE"] = 1.0
        model.zero_grad()
        staged(x, y)
        model.zero_grad()
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
            model.zero_grad()
            model.scale = float(k)
            staged(x, y)
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "staged 8 times" in warnings[0].message and "model.scale 6.0 -> 7.0" in warnings[0].message



def test_the_grad_mode_is_part_of_the_key_so_a_training_step_under_no_grad_fails_as_in_eager(caplog):
    """A program staged with grad enabled holds a backward; replaying it under ``no_grad`` would hand back
    gradients eager PyTorch refuses to compute. Under ``no_grad`` the step stages again and fails as eager does;
    a forward-only function gives the same values in both modes, from two programs."""
    model = _mlp()
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    staged = stagetorch.jit(_loss_step(model))
    staged(x, y)
    grads = [p.grad.clone() for p in model.parameters()]
    with torch.no_grad(), pytest.raises(RuntimeError) as staged_error, caplog.at_level("INFO", logger="stagetorch"):
        staged(x, y)
    assert "the grad mode (torch.is_grad_enabled() is now False)" in caplog.text
    with torch.no_grad(), pytest.raises(RuntimeError) as eager_error:
        _loss_step(model)(x, y)
    assert str(staged_error.value) == str(eager_error.value)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))

    forward = stagetorch.jit(lambda x: model(x).softmax(-1))
    with torch.no_grad():
        torch.testing.assert_close(forward(x), model(x).softmax(-1), rtol=0, atol=0)
    torch.testing.assert_close(forward(x), model(x).softmax(-1).detach(), rtol=0, atol=0)
    assert len(forward._cache) == 2



def _normalise_grad(p: torch.Tensor) -> None:
    p.grad.div_(p.grad.norm())


def _add_hooks(model: nn.Module) -> list:
    """Hooks as training code uses them: nonlinear, so a hook run per chunk (or dropped) gives other numbers."""
    return [
        model[0].weight.register_hook(lambda g: g.clamp(-0.01, 0.01)),
        model[2].weight.register_post_accumulate_grad_hook(_normalise_grad),
        model[2].register_full_backward_hook(lambda mod, grad_in, grad_out: (grad_in[0].tanh(),)),
        model[0].register_forward_hook(lambda mod, args, out: out * 2),
    ]


@pytest.mark.parametrize("chunked", [False, True], ids=["unchunked", "chunked"])
def test_hooks_on_parameters_and_modules_are_staged_and_match_eager_over_steps(chunked):
    model = _mlp().double()
    twin = copy.deepcopy(model)
    _add_hooks(model), _add_hooks(twin)
    staged = stagetorch.jit(_loss_step(model))
    for call in range(CALLS):  # no zero_grad: the post-accumulate hook sees the gradient accumulated so far
        x, y = torch.randn(BATCH, 5, dtype=torch.float64), torch.randint(0, 3, (BATCH,))
        if chunked and call == 0:
            budget_for(staged, x, y)
        loss = staged(x, y)
        expected = _loss_step(twin)(x, y)
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
    assert len(staged._cache) == 1


def test_a_hook_added_or_removed_after_staging_stages_again(caplog):
    model = _mlp().double()
    twin = copy.deepcopy(model)
    staged = stagetorch.jit(_loss_step(model))
    x, y = torch.randn(BATCH, 5, dtype=torch.float64), torch.randint(0, 3, (BATCH,))
    for phase in ("none", "hooked", "removed"):
        if phase == "hooked":
            handles = _add_hooks(model) + [torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: o)]
            twin_handles = _add_hooks(twin)
        if phase == "removed":
            for h in handles + twin_handles:
                h.remove()
        model.zero_grad(), twin.zero_grad()
        with caplog.at_level("INFO", logger="stagetorch"):
            loss = staged(x, y)
        torch.testing.assert_close(loss, _loss_step(twin)(x, y).detach(), rtol=1e-12, atol=1e-12)
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
    assert "the hooks on its modules or parameters (one added or removed)" in caplog.text
    # Three programs: torch leaves ``_is_full_backward_hook = True`` on a module after its hook is removed.
    assert len(staged._cache) == 3


# -- optimizers and .grad inside the step ----------------------------------------------------------------------

OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "sgd_nesterov_decay": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "sgd_foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5, foreach=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
}


def _mlp():
    return nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3))


def _optimizer_step(model, opt, clip=0.05):
    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        return loss

    return step


@pytest.mark.parametrize("chunked", [False, True], ids=["unchunked", "chunked"])
@pytest.mark.parametrize("clip", [0.05, None], ids=["clipped", "plain"])
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_an_optimizer_inside_the_step_updates_weights_and_state_as_eager(kind, chunked, clip):
    model = _mlp().double()  # float64: Adam's normalised updates amplify float32's chunk-order rounding
    reference = copy.deepcopy(model)
    opt, ref_opt = OPTIMIZERS[kind](model.parameters()), OPTIMIZERS[kind](reference.parameters())
    sched, ref_sched = (torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (opt, ref_opt))
    # Without clipping, step() reads the .grad that backward() just made (a copy the trace must keep).
    staged = stagetorch.jit(_optimizer_step(model, opt, clip))
    eager = _optimizer_step(reference, ref_opt, clip)
    x, y = torch.randn(BATCH, 5, dtype=torch.float64), torch.randint(0, 3, (BATCH,))
    # Adam staged runs torch's capturable formulation, which takes its bias corrections from the float32
    # step-count tensor (eager's reads it as a Python float): updates agree to float32's rounding, ~1e-7.
    tol = 1e-6 if kind.startswith("adam") else 1e-11
    for call in range(4):
        expected = eager(x, y)
        if chunked:
            budget_for(staged, x, y)
            # The plan of this call: after it, the optimizer's new state is held beside the next program.
            assert len(staged.plan(x, y).chunk_sizes) >= 3
        loss = staged(x, y)
        torch.testing.assert_close(loss, expected.detach(), rtol=tol, atol=tol)
        assert_same_state(model, reference, tol)
        for p, q in zip(model.parameters(), reference.parameters()):
            assert opt.state[p].keys() == ref_opt.state[q].keys()
            for key, value in ref_opt.state[q].items():
                torch.testing.assert_close(opt.state[p][key], value, rtol=tol, atol=tol, msg=lambda m, key=key, call=call: f"call {call} {key}: {m}")
        sched.step()
        ref_sched.step()
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] < 0.01 * (1 if kind.startswith("adam") else 10)



@pytest.mark.parametrize("chunked", [False, True], ids=["unchunked", "chunked"])
def test_a_write_to_a_weight_that_needs_no_gradient_runs_after_the_chunks_have_read_the_weight(chunked):
    """AdamW's decay ``p.mul_(1 - lr * wd)`` reads no gradient; hoisted before the chunk loop with the other
    batch-independent work, every chunk's forward read the decayed weight (loss off by ~6e-5 at call 0)."""
    model = _mlp().double()
    twin = copy.deepcopy(model)

    def step_of(model):
        def step(x, y):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            with torch.no_grad():
                model[0].weight.mul_(0.5)
                model[2].bias.add_(model[0].weight.sum())
            return loss

        return step

    staged = stagetorch.jit(step_of(model))
    for call in range(CALLS):
        x, y = torch.randn(BATCH, 5, dtype=torch.float64), torch.randint(0, 3, (BATCH,))
        if chunked and call == 0:
            budget_for(staged, x, y)
        torch.testing.assert_close(staged(x, y), step_of(twin)(x, y).detach(), rtol=1e-12, atol=1e-12)
        assert_same_state(model, twin, 1e-12)



class _Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.calls = _mlp(), 0

    def forward(self, x):
        self.calls += 1
        return self.body(x)


@pytest.mark.parametrize("update", ["scheduler", "counter"])
def test_a_step_that_changes_python_state_while_staged_is_refused_and_the_state_put_back(update):
    """A scheduler.step() inside the function runs at the trace only, and moves the lr the program is keyed
    on: the next call restaged and stepped it again, a plan() in between stepped it a third time."""
    model = _Counting() if update == "counter" else _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if update == "scheduler":
            sched.step()
        return loss

    before = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(BATCH, 5), torch.randint(0, 3, (BATCH,))
    with pytest.raises(stagetorch.UnsupportedOpError) as error:
        stagetorch.jit(step)(x, y)
    message = str(error.value)
    assert "changed Python-side state while stagetorch staged it" in message and "test_jit_state.py:" in message
    assert ("opt.param_groups[0]['lr'] 0.1 -> 0.05" if update == "scheduler" else "model.calls 0 -> 1") in message
    assert opt.param_groups[0]["lr"] == 0.1 and sched.last_epoch == 0 and getattr(model, "calls", 0) == 0
    assert all(torch.equal(p, b) and p.grad is None for p, b in zip(model.parameters(), before)) and not opt.state


def test_an_optimizer_that_cannot_be_staged_gets_a_named_error_and_changes_nothing():
    model = _mlp()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    x, y = torch.randn(BATCH, 5), torch.randint(0, 3, (BATCH,))
    F.cross_entropy(model(x), y).backward()
    before = _snapshot(model)
    state = copy.deepcopy(opt.state_dict())
    with pytest.raises(stagetorch.UnsupportedOpError, match=r"(?s)Adagrad.step at staging/test_jit_state.py:\d+ cannot be staged.*outside the staged function"):
        stagetorch.jit(_optimizer_step(model, opt))(x, y)
    _assert_unchanged(model, before)
    assert "step" not in vars(opt)
    torch.testing.assert_close(opt.state_dict(), state, rtol=0, atol=0)


def _clip_step(model, zero=None):
    def step(x, y):
        if zero == "before":
            model.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        if zero == "after":
            model.zero_grad()
        return loss, norm, model[0].weight.grad.sum() if zero != "after" else norm

    return step


@pytest.mark.parametrize("chunked", [False, True], ids=["unchunked", "chunked"])
@pytest.mark.parametrize("zero", [None, "before", "after"], ids=["accumulating", "zero_grad_first", "zero_grad_last"])
def test_grad_read_inside_the_step_sees_the_accumulated_gradient(zero, chunked):
    model = _mlp()
    reference = copy.deepcopy(model)
    staged, eager = stagetorch.jit(_clip_step(model, zero)), _clip_step(reference, zero)
    x, y = torch.randn(BATCH, 5), torch.randint(0, 3, (BATCH,))
    for call in range(CALLS):
        expected = eager(x, y)
        if chunked:
            budget_for(staged, x, y)
        got = staged(x, y)
        if chunked:
            assert len(staged.plan(x, y).chunk_sizes) >= 3
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6, msg=lambda m, call=call: f"call {call}: {m}")
        assert_same_state(model, reference)



@pytest.mark.parametrize("chunked", [False, True], ids=["unchunked", "chunked"])
def test_a_step_returning_grad_and_outputs_kept_across_steps_match_eager(chunked):
    """``return loss, logits, p.grad``: the accumulated .grad must stay in the program (it was dropped as a
    plain accumulation: a raw KeyError), and outputs kept from earlier steps must not change."""
    model = _mlp().double()
    twin = copy.deepcopy(model)

    def step_of(model):
        def step(x, y):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            loss.backward()
            return loss, logits, model[0].weight.grad

        return step

    staged, kept = stagetorch.jit(step_of(model)), []
    for call in range(CALLS):  # no zero_grad: .grad accumulates
        x, y = torch.randn(BATCH, 5, dtype=torch.float64), torch.randint(0, 3, (BATCH,))
        if chunked and call == 0:
            budget_for(staged, x, y)
        got, expected = staged(x, y), step_of(twin)(x, y)
        assert got[2] is model[0].weight.grad  # the .grad itself, as eager returns it
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e.detach(), rtol=1e-12, atol=1e-12)
        kept.append([(g, g.clone()) for g in got[:2]])
    assert all(torch.equal(g, copy) for step in kept for g, copy in step)


def test_a_step_that_only_accumulates_into_grad_stages_one_program_without_grad_inputs():
    model = _mlp()
    x, y = torch.randn(BATCH, 5), torch.randint(0, 3, (BATCH,))

    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    staged = stagetorch.jit(step)
    reference = copy.deepcopy(model)
    for _ in range(CALLS):
        staged(x, y)
        F.cross_entropy(reference(x), y).backward()
    assert_same_state(model, reference)
    (entry,) = staged._cache.values()
    assert "grad" not in entry.traced.graph.roles and not entry.traced.grad_params


def test_the_memory_report_of_a_step_with_adamw_covers_its_state_and_update():
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    x, y = torch.randn(8, 256), torch.randint(0, 256, (8,))
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def plain(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    plain_peak = stagetorch.memory(plain)(x, y).peak_bytes
    first = stagetorch.memory(_optimizer_step(model, opt))(x, y).peak_bytes
    # The first step creates both moments (two copies of the parameters) and keeps them.
    assert first >= plain_peak + 2 * param_bytes
    staged = stagetorch.jit(_optimizer_step(model, opt))
    staged(x, y)
    later = stagetorch.memory(_optimizer_step(model, opt))(x, y)
    assert later.peak_bytes >= plain_peak + 2 * param_bytes
    assert all(p.grad is not None for p in model.parameters()) and len(opt.state) == 4


# -- batch-wide normalisers ------------------------------------------------------------------------------------

NORMALISERS = {
    "weighted_sum_over_sum_of_weights": lambda per, w: (per * w).sum() / w.sum(),
    "mean_over_mean_of_mask": lambda per, w: (per * w).mean() / w.mean(),
    "count_of_valid_examples": lambda per, w: (per * w).sum() / (w > 0).sum(),
    "normalised_weights_first": lambda per, w: (per * (w / w.sum())).sum(),
    "label_smoothing": lambda per, w: per.mean(),  # per is label-smoothed (see below)
    # torch's mean over class weights looked up by target (a gather of a shared tensor by per-example index)
    "class_weights_and_smoothing": None,
}
CLASS_WEIGHTS = torch.tensor([1.0, 2.0, 0.5])


@pytest.mark.parametrize("chunked", [False, True], ids=["unchunked", "chunked"])
@pytest.mark.parametrize("form", list(NORMALISERS))
def test_batch_wide_normalisers_are_exact_in_chunks(form, chunked):
    model = _mlp()
    reference = copy.deepcopy(model)

    def make(m):
        def step(x, y, w):
            logits = m(x)
            if form == "class_weights_and_smoothing":
                loss = F.cross_entropy(logits, y, weight=CLASS_WEIGHTS, label_smoothing=0.1)
            else:
                per = F.cross_entropy(logits, y, reduction="none", label_smoothing=0.2 if form == "label_smoothing" else 0.0)
                loss = NORMALISERS[form](per, w)
            loss.backward()
            # What a training loop logs besides the loss: accuracy, through argmax over the classes.
            return loss, (logits.argmax(-1) == y).float().mean()

        return step

    staged, eager = stagetorch.jit(make(model)), make(reference)
    x, y = torch.randn(BATCH, 5), torch.randint(0, 3, (BATCH,))
    for call in range(CALLS):
        w = (torch.rand(BATCH) > 0.3).float() * (call + 1)
        expected = eager(x, y, w)
        if chunked:
            budget_for(staged, x, y, w)
        loss = staged(x, y, w)
        if chunked:
            assert len(staged.plan(x, y, w).chunk_sizes) >= 3
        torch.testing.assert_close(loss[0], expected[0].detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(loss[1], expected[1], rtol=1e-6, atol=1e-7)  # a float32 mean, chunked
        assert_same_state(model, reference)


def test_a_normaliser_of_a_normalised_value_is_refused_by_name_not_a_raw_error():
    model = _mlp()

    def step(x, y, w):
        per = F.cross_entropy(model(x), y, reduction="none") * (w / w.sum())
        loss = (per / per.sum()).pow(2).sum()
        loss.backward()
        return loss

    x, y, w = torch.randn(BATCH, 5), torch.randint(0, 3, (BATCH,)), torch.rand(BATCH)
    staged = stagetorch.jit(step, memory_budget=1)
    with pytest.raises(stagetorch.BatchCouplingError, match="depends on another batch-wide value"):
        staged(x, y, w)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("chunked", [False, True], ids=["unchunked", "chunked"])
@pytest.mark.parametrize("kind", ["sgd_foreach", "adamw"])
def test_a_step_failing_after_the_optimizer_restores_weights_grads_and_optimizer_state(kind, chunked):
    model = _mlp()
    opt = OPTIMIZERS[kind](model.parameters())
    update = _optimizer_step(model, opt)

    def step(x, y):
        loss = update(x, y)
        return loss, torch.ops.stagetorch_test.fail_above(model(x))  # fails after the weights moved

    x, y = torch.randn(BATCH, 5), torch.randint(0, 3, (BATCH,))
    staged = stagetorch.jit(step)
    staged(x, y)
    staged(x, y)  # the program that updates existing state in place
    if chunked:
        # A forward after the step cannot share the chunk loop with the backward before it: refused by name.
        with pytest.raises(stagetorch.BatchCouplingError, match="an optimizer inside the step has already stepped"):
            budget_for(staged, x, y)
        step = update
        staged = stagetorch.jit(lambda x, y: step(torch.ops.stagetorch_test.fail_above(x), y))
        staged(x, y)
        staged(x, y)
        budget_for(staged, x, y)
    before = _snapshot(model)
    state = copy.deepcopy(opt.state_dict())
    _FAIL["above"] = max(staged.plan(x, y).chunk_sizes) - 1
    try:
        with pytest.raises(RuntimeError, match="injected failure"):
            staged(x, y)
    finally:
        _FAIL["above"] = 10**9
    _assert_unchanged(model, before)
    torch.testing.assert_close(opt.state_dict(), state, rtol=0, atol=0)


@pytest.mark.parametrize("path", ["whole", "chunked", "one-line"])
def test_one_gradient_for_two_parameters_is_installed_as_two_grads(path):
    """The oneDNN LSTM's backward returns one bias gradient for both biases of a layer; eager's
    AccumulateGrad copies it, so ``bias_ih.grad`` and ``bias_hh.grad`` are tensors of their own. A staged step
    installed the same tensor as both: an in-place ``clip_grad_norm_`` then scaled it twice, and accumulating
    into held ``.grad`` added twice (silently wrong). A training loop with clipping, SGD, and accumulation over
    two steps before each update, against the same loop in eager."""
    torch.manual_seed(0)
    model = nn.LSTM(6, 8, num_layers=2, batch_first=True)
    reference = copy.deepcopy(model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, reference)]

    def step(m, x):
        out, _ = m(x)
        loss = out.square().mean()
        loss.backward()
        return loss

    staged = stagetorch.jit(lambda x: step(model, x))
    for i in range(6):
        x = torch.randn(BATCH, 5, 6)
        if path == "one-line":
            loss = step(model, stagetorch.lazy(x, batch=0))
        else:
            if path == "chunked" and i == 0:
                budget_for(staged, x)
            loss = staged(x)
        expected = step(reference, x)
        torch.testing.assert_close(loss.item(), expected.item(), rtol=1e-5, atol=1e-7)
        for m in (model, reference):
            assert m.bias_ih_l0.grad is not m.bias_hh_l0.grad
        if i % 2:  # two steps accumulated, then clipped in place and stepped
            for m in (model, reference):
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            assert_same_state(model, reference)
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
    assert_same_state(model, reference)

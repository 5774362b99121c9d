"""The state guard of a staged call (``stagetorch.staging.guards``): a warm call reuses the state walk of the call
before, and any change the walk could see makes it walk again and find what a fresh walk finds.

Each case below builds a step that reads one kind of state, walks it twice (the second reuses the first),
changes the state, and checks that the next walk is a new one equal to ``discover(...).tensors_and_key()``
(with a new key where the change is one a program is keyed on). The end-to-end tests run training loops
against eager with every reuse checked against a fresh walk (``guards.VERIFY``)."""

from __future__ import annotations

import copy
import functools

import models
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stagetorch
from stagetorch.staging import guards
from stagetorch.staging.guards import StateWalk, flatten_args
from stagetorch.staging.state import discover

TEMPERATURE = 1.0
CONFIG = {"weight": 1.0}


class Scaled(nn.Module):
    """Reads a float attribute, a list attribute and a module-level global in its forward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.norm = nn.BatchNorm1d(3)
        self.scale = 1.0
        self.sizes = [1, 2]
        self.tag = object()  # not a scalar: the key leaves it out

    def forward(self, x):
        return self.norm(self.fc(x)) * self.scale / TEMPERATURE


OFFSET = 0.5


class Shifted(Scaled):
    """A subclass whose forward reads another global."""

    def forward(self, x):
        return super().forward(x) + OFFSET


class Settings:
    """A user object the step reads through its closure."""

    def __init__(self):
        self.factor = 2.0


class Case:
    """A step over everything a state walk reads, and handles to change each part of it."""

    def __init__(self):
        self.model = Scaled()
        self.other = nn.Linear(4, 3)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.settings = Settings()
        self.extra = torch.randn(3)
        self.factors = [1.0]
        self.mixed = functools.partial(torch.mul, other=1.0)
        k = 2.0
        model, opt, settings, extra, factors, mixed = self.model, self.opt, self.settings, self.extra, self.factors, self.mixed

        def step(x, y, module=None, w=1.0, *, v=0.5):
            out = model(x) + extra * k * factors[0] * settings.factor * w * v * CONFIG["weight"]
            loss = F.cross_entropy(mixed(out), y)
            loss.backward()
            opt.step()
            return loss

        def other_step(x, y, module=None, w=1.0, *, v=0.5):  # the same closure, and a global besides
            out = model(x) + extra * k * factors[0] * settings.factor * w * v * TEMPERATURE
            loss = F.cross_entropy(mixed(out), y)
            loss.backward()
            opt.step()
            return loss

        def set_k(value):
            nonlocal k
            k = value

        self.step, self.other_step, self.set_k = step, other_step, set_k
        self.args = (torch.randn(6, 4), torch.randint(0, 3, (6,)), self.other)


def _set_global(name, value):
    globals()[name] = value


def _swap_attribute(m):
    """Delete the last attribute and add another holding the same object: same length, same values."""
    value = m.__dict__.pop("tag")
    m.renamed = value


def _replace_code(c):
    c.step.__code__ = c.other_step.__code__


# name -> (change, whether the key a program is staged under changes)
CHANGES = {
    "float attribute": (lambda c: setattr(c.model, "scale", 3.0), True),
    "float attribute set to an equal new float": (lambda c: setattr(c.model, "scale", float("1.0")), False),
    "list attribute appended to": (lambda c: c.model.sizes.append(3), True),
    "non-scalar attribute set to None": (lambda c: setattr(c.model, "tag", None), True),
    "non-scalar attribute replaced": (lambda c: setattr(c.model, "tag", object()), False),
    "attribute renamed": (lambda c: _swap_attribute(c.model), False),
    "attribute added": (lambda c: setattr(c.model.fc, "alpha", 0.5), True),
    "eval mode": (lambda c: c.model.eval(), True),
    "module class changed": (lambda c: setattr(c.model, "__class__", Shifted), True),
    "dropout-like attribute of a child": (lambda c: setattr(c.model.norm, "momentum", 0.5), True),
    "requires_grad flipped": (lambda c: c.model.fc.bias.requires_grad_(False), True),
    "dtype changed in place (.data)": (lambda c: setattr(c.model.fc.weight, "data", c.model.fc.weight.data.double()), True),
    "strides changed in place (.data)": (lambda c: setattr(c.model.fc.weight, "data", c.model.fc.weight.data.t().contiguous().t()), True),
    "parameter replaced by one of the same shape": (lambda c: setattr(c.model.fc, "weight", nn.Parameter(torch.randn(3, 4))), True),
    "buffer replaced": (lambda c: setattr(c.model.norm, "running_mean", torch.zeros(3)), True),
    "child module replaced": (lambda c: setattr(c.model, "norm", nn.BatchNorm1d(3)), True),
    "forward hook on a module": (lambda c: c.model.fc.register_forward_hook(lambda m, a, o: o), True),
    "hook on a parameter": (lambda c: c.model.fc.weight.register_hook(lambda g: g), True),
    "post-accumulate hook on a parameter": (lambda c: c.model.fc.bias.register_post_accumulate_grad_hook(lambda p: None), True),
    "global module hook": (lambda c: c.hooks.append(torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: o)), True),
    "closure cell rebound": (lambda c: c.set_k(5.0), True),
    "list item in the closure": (lambda c: c.factors.__setitem__(0, 3.0), True),
    "user object attribute": (lambda c: setattr(c.settings, "factor", 4.0), True),
    "global read by the step": (lambda c: CONFIG.__setitem__("weight", 2.0), True),
    "global read by a module's forward": (lambda c: _set_global("TEMPERATURE", 2.0), True),
    "default argument": (lambda c: setattr(c.step, "__defaults__", (None, 3.0)), True),
    "keyword-only default": (lambda c: c.step.__kwdefaults__.__setitem__("v", 0.25), True),
    "code replaced": (_replace_code, True),
    "partial keyword": (lambda c: c.mixed.keywords.__setitem__("other", 2.0), True),
    "optimizer learning rate": (lambda c: c.opt.param_groups[0].__setitem__("lr", 0.01), True),
    "optimizer state created": (lambda c: c.opt.state[c.model.fc.weight].__setitem__("momentum_buffer", torch.zeros(3, 4)), True),
    "optimizer param group added": (lambda c: c.opt.add_param_group({"params": [nn.Parameter(torch.randn(2))]}), True),
    "module argument": (lambda c: setattr(c, "args", (*c.args[:2], nn.Linear(4, 3))), True),
}


@pytest.fixture
def restore_globals():
    saved = TEMPERATURE, dict(CONFIG)
    yield
    _set_global("TEMPERATURE", saved[0])
    CONFIG.clear()
    CONFIG.update(saved[1])


def _walk(walk: StateWalk, c: Case):
    leaves = flatten_args(c.args, {})[0]
    return walk.walk(c.step, c.args, {}, leaves)


def _fresh(c: Case):
    return discover(c.step, c.args, {}).tensors_and_key()


@pytest.mark.usefixtures("restore_globals")
@pytest.mark.parametrize("what", list(CHANGES))
def test_a_change_walks_again_and_finds_what_a_fresh_walk_finds(what):
    c = Case()
    c.hooks = []
    walk = StateWalk()
    _, tensors, key = _walk(walk, c)
    assert _walk(walk, c)[2] is key and walk.walks == 1  # nothing changed: the same walk
    change, keyed = CHANGES[what]
    change(c)
    try:
        _, now_tensors, now_key = _walk(walk, c)
        assert walk.walks == 2, f"{what}: the guard held"
        fresh_tensors, fresh_key = _fresh(c)
        assert now_key == fresh_key and [id(t) for t in now_tensors] == [id(t) for t in fresh_tensors]
        assert (now_key != key) == keyed
        assert _walk(walk, c)[2] is now_key and walk.walks == 2  # and holds again
    finally:
        for h in c.hooks:
            h.remove()


def test_a_warm_staged_step_walks_its_state_once():
    model, make = models.seed_mlp()
    staged = stagetorch.jit(models.train_step(model))
    x, y = make(8)
    for _ in range(5):
        model.zero_grad()
        staged(x, y)
    assert staged._walk.walks == 1
    model.eval()
    staged(x, y)
    staged(x, y)
    assert staged._walk.walks == 2 and len(staged._cache) == 2


@pytest.mark.parametrize("keyed", [False, True], ids=["same_key", "alternating_key"])
def test_a_guard_that_fails_on_every_call_rests(keyed):
    """An object set anew on a module every step is checked by the guard and left out of the key; a value
    that alternates changes the key on every call. After two misses in a row the walk runs without a guard
    (as every call did before guards existed) for a while, and finds what a fresh walk finds."""
    model, make = models.seed_mlp()
    staged = stagetorch.jit(models.train_step(model))
    x, y = make(8)
    for call in range(10):
        if keyed:
            model.train(call % 2 == 0)
        else:
            model.last_batch = object()
        staged(x, y)
        assert staged._last_key[2] == discover(staged.fn, (x, y), {}).tensors_and_key()[1]
    assert staged._walk._rest > 0 and len(staged._cache) == (2 if keyed else 1)


def test_a_lazy_tensor_in_the_closure_is_walked_on_every_call():
    """What a lazy tensor holds can change while it stays the same object: no guard stands for it."""
    model, make = models.seed_mlp()
    x, y = make(8)
    shift = stagetorch.lazy(torch.zeros(8, 10), batch=0) * 1.0

    def step(x, y):
        loss = F.cross_entropy(model(x) + shift, y)
        loss.backward()
        return loss

    staged = stagetorch.jit(step)
    staged(x, y)
    staged(x, y)
    assert staged._walk.walks == 2


def test_clear_caches_drops_the_guards():
    model, make = models.seed_mlp()
    staged = stagetorch.jit(models.train_step(model))
    staged(*make(8))
    assert staged._walk._last is not None
    stagetorch.clear_caches()
    assert staged._walk._last is None


def test_the_plain_call_flattens_as_pytree_does():
    import torch.utils._pytree as pytree

    x, p = torch.randn(2), nn.Parameter(torch.randn(3))
    for args, kwargs in [((x, p), {}), ((x,), {"y": x}), ((x, [p]), {}), ((x, 3), {}), ((), {})]:
        leaves, spec = flatten_args(args, kwargs)
        want_leaves, want_spec = pytree.tree_flatten((args, kwargs))
        assert spec == want_spec and all(a is b for a, b in zip(leaves, want_leaves)) and len(leaves) == len(want_leaves)


@pytest.fixture
def verify(monkeypatch):
    monkeypatch.setattr(guards, "VERIFY", True)


@pytest.mark.usefixtures("verify")
def test_a_training_loop_that_changes_its_state_between_steps_matches_eager():
    """Learning rates, train/eval, requires_grad, hooks and a module attribute changed between steps of a
    step with SGD inside: every reuse of a walk is checked against a fresh one, every step against eager."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.Dropout(0.0), nn.ReLU(), nn.Linear(16, 3))
    twin = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, twin)]

    def make(m, opt):
        def step(x, y):
            opt.zero_grad()
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            return loss

        return step

    staged, eager = stagetorch.jit(make(model, opts[0])), make(twin, opts[1])
    x, y = torch.randn(12, 5), torch.randint(0, 3, (12,))
    handles = []
    for call in range(12):
        for m, opt in ((model, opts[0]), (twin, opts[1])):
            if call == 3:
                for g in opt.param_groups:
                    g["lr"] = 0.05
            if call == 5:
                m.eval()
            if call == 6:
                m.train()
            if call == 7:
                m[0].bias.requires_grad_(False)
            if call == 8:
                handles.append(m[3].register_forward_hook(lambda mod, a, out: out * 0.5))
            if call == 10:
                m[1].p = 0.0  # an equal value, a new object
        torch.testing.assert_close(staged(x, y), eager(x, y).detach(), rtol=1e-5, atol=1e-6)
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    for h in handles:
        h.remove()
    assert staged._walk.walks < 12


@pytest.mark.usefixtures("verify")
@pytest.mark.parametrize("optimizer", [False, True], ids=["step", "step_with_sgd_momentum"])
def test_a_model_moved_to_channels_last_after_its_first_step_stages_again_and_matches_eager(optimizer):
    """``model.to(memory_format=torch.channels_last)`` keeps every parameter and swaps its data: shapes,
    dtypes and identities stay, the strides do not. The key and the guard hold strides, so the next call
    stages again; before, it ran the program staged for contiguous weights, whose views of them failed
    ("view size is not compatible with input tensor's size and stride")."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 8 * 8, 10)
    )
    reference = copy.deepcopy(model)

    def step_of(m):
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) if optimizer else None

        def step(x, y):
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            if opt is not None:
                opt.step()
                opt.zero_grad()
            return loss

        return step

    staged, eager = stagetorch.jit(step_of(model)), step_of(reference)
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    for k in range(3):
        if k == 1:
            model.to(memory_format=torch.channels_last)
            reference.to(memory_format=torch.channels_last)
        torch.testing.assert_close(staged(x, y), eager(x, y), rtol=0, atol=0)
        for p, q in zip(model.parameters(), reference.parameters()):
            assert p.stride() == q.stride()
            torch.testing.assert_close(p, q, rtol=0, atol=0)
            assert (p.grad is None) == (q.grad is None)
            if p.grad is not None:
                assert p.grad.stride() == q.grad.stride()
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
                p.grad = q.grad = None
    assert len(staged._cache) == 2

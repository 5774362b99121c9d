"""The steps the staged program must run in no more memory than eager does (issue 25): every test model's
training step (tests/support/models.py, tests/support/remat_models.py), a weight-decay penalty, and optimizers inside the
step (per element and foreach; a later step and the first, which makes the state). ``peaks(name)``
measures eager and staged (whole batch, unchunked) at the allocator."""

from __future__ import annotations

from collections.abc import Callable

import models
import remat_models
import torch
import torch.nn as nn
import torch.nn.functional as F
from memtrack import allocator_peak

import stagetorch


def _classifier(factory: Callable, batch: int = 16):
    def build():
        model, make_batch = factory()
        return model, models.train_step(model), make_batch(batch), None

    return build


def _gpt2():
    model, make_batch = models.gpt2()
    return model, models.gpt2_step(model), make_batch(8), None


def _seed(factory: Callable):
    def build():
        model, x = factory()
        return model, remat_models.step_of(model), (x,), None

    return build


def _penalty():
    """The issue's case: a penalty on every parameter, whose backward adds two contributions per weight."""
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))

    def step(x, y):
        loss = F.cross_entropy(model(x), y) + 1e-3 * sum((p * p).sum() for p in model.parameters())
        loss.backward()
        return loss

    return model, step, (torch.randn(16, 784), torch.randint(0, 10, (16,))), None


def _optimizer(make: Callable):
    """6 x (Linear(512) + GELU), batch 64, the optimizer stepped inside the step (its state already made)."""

    def build():
        model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(512, 512), nn.GELU())])
        opt = make(model.parameters())

        def step(x, y):
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            return loss

        return model, step, (torch.randn(64, 512), torch.randn(64, 512)), opt

    return build


CASES: dict[str, Callable] = {
    **{f"models.{k}": _classifier(f) for k, f in models.CLASSIFIERS.items()},
    "models.cnn_batchnorm": _classifier(lambda: models.cnn("batch")),
    "models.gpt2": _gpt2,
    **{f"remat_models.{k}": _seed(f) for k, f in remat_models.SEEDS.items()},
    "penalty": _penalty,
    "sgd_momentum_inside": _optimizer(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
    "adamw_inside": _optimizer(lambda ps: torch.optim.AdamW(ps, lr=1e-3)),
}
# Foreach optimizers (the default on CUDA) and first steps, which make the optimizer's state.
_OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False),
    "sgd_momentum_foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
    "sgd_nesterov_foreach": lambda ps: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4, foreach=True
    ),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "adam_foreach": lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True),
}
CASES.update({f"{k}_inside": _optimizer(f) for k, f in _OPTIMIZERS.items() if k.endswith("_foreach")})
# The first step: measured on its first call (staged: its program staged beforehand, as a plan does).
FIRST_STEP = {f"{k}_inside_first_step" for k in _OPTIMIZERS}
CASES.update({f"{k}_inside_first_step": _optimizer(f) for k, f in _OPTIMIZERS.items()})


def _resident(model: nn.Module, opt, args) -> list[torch.Tensor]:
    out = [*model.parameters(), *model.buffers(), *args]
    out += [p.grad for p in model.parameters() if p.grad is not None]
    if opt is not None:
        out += [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return out


def _measure(step: Callable, model: nn.Module, opt, args, first: bool = False) -> int:
    """The allocator peak of the step's second call (the first makes the optimizer's state), from .grad
    cleared: what an eager training loop holds. ``first``: of its first call (a staged step is staged
    first: its plan, which traces it, runs nothing)."""
    if not first:
        step(*args)
    elif hasattr(step, "plan"):
        step.plan(*args)
    model.zero_grad(set_to_none=True)
    peak, _ = allocator_peak(step, _resident(model, opt, args), *args)
    model.zero_grad(set_to_none=True)
    return peak


def peaks(name: str) -> tuple[int, int]:
    """(eager, staged) allocator peaks of case ``name``, on two models made alike from one seed."""
    torch.manual_seed(0)
    model, step, args, opt = CASES[name]()
    first = name in FIRST_STEP
    eager = _measure(step, model, opt, args, first)
    torch.manual_seed(0)
    model, step, args, opt = CASES[name]()
    staged = _measure(stagetorch.jit(step, memory_budget=1 << 60), model, opt, args, first)
    return eager, staged

"""The one-line step's hot path after lazyspeed5 (issue 27): what a step skips now, and what makes it stop.
Every loop runs against plain PyTorch."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stagetorch
from stagetorch.lazymode import backward, recording
from stagetorch.runtime.executable import Executable

pytestmark = pytest.mark.usefixtures("lazy_mode")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(6, 12, generator=g), torch.randint(0, 3, (6,), generator=g)


@pytest.mark.lazy_modes("express")
def test_an_express_backward_skips_the_full_path_and_equals_eager(monkeypatch):
    """``loss.backward()`` of an express step runs the taped backward from its guard, without the session's
    backward (the full path, patched here to count); a backward with arguments the tape did not see
    (``retain_graph=True``) is refused by that guard and takes the full path. Gradients equal eager's."""
    recording.RECORDINGS.clear()
    model, reference = _mlp(), _mlp()
    calls = []
    full = backward.BackwardSkip.backward
    monkeypatch.setattr(backward.BackwardSkip, "backward", lambda self, *a: calls.append(1) or full(self, *a))
    for i in range(6):
        x, y = _batch(i)
        model.zero_grad()
        reference.zero_grad()
        retain = i == 4
        F.cross_entropy(model(stagetorch.lazy(x, batch=0)), y).backward(retain_graph=retain or None)
        F.cross_entropy(reference(x), y).backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
        # the first two steps record and tape; the later ones go by the guard, but the step that retains
        assert len(calls) == (i + 1 if i < 2 else 3 if i >= 4 else 2), (i, len(calls))


def test_a_plan_is_reused_for_the_same_budget_and_made_again_after_a_cap():
    """``Planner.plan_call`` hands back its last plan for the same budget and held bytes, with no planning;
    what changes plans (a chunk cap learned from a run that ran out of memory) makes it plan again, and the
    next steps run in chunks under the cap with eager's gradients."""
    recording.RECORDINGS.clear()
    model, reference = _mlp(), _mlp()
    x, y = _batch(0)
    lx = stagetorch.lazy(x, batch=0)
    F.cross_entropy(model(lx), y).backward()
    flushes = lx._session.recording.flushes.values()
    executable = next(v[0] for v in flushes if isinstance(v, tuple) and v and isinstance(v[0], Executable))
    planner = executable.planner
    held, why = executable.restoring
    budget = 1 << 30
    first = planner.plan_call(budget, held, why)
    assert planner.plan_call(budget, held, why) is first and not first.chunked
    planner.learn(2)
    capped = planner.plan_call(budget, held, why)
    assert capped is not first and capped.chunked and max(capped.chunk_sizes) <= 2
    model.zero_grad()
    F.cross_entropy(model(stagetorch.lazy(x, batch=0)), y).backward()
    F.cross_entropy(reference(x), y).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.lazy_modes("express", "replay")
def test_lazy_tensors_are_on_the_host_under_another_default_device():
    """Lazy tensors of host inputs are made without ``device=`` (the constructor's default, the host):
    under ``torch.device("meta")`` as the default device they, and those the express replay makes, are still
    on the host, with eager's values."""
    recording.RECORDINGS.clear()
    model, reference = _mlp(), _mlp()
    for i in range(4):
        x, y = _batch(i)
        with torch.device("meta") if i >= 2 else torch.device("cpu"):
            lx, ly = stagetorch.lazy(x, y, batch=0)
            h = model[0](lx)
            loss = F.cross_entropy(model[2](model[1](h)), ly)
        assert lx.device == ly.device == h.device == loss.device == torch.device("cpu")
        assert not lx.requires_grad and h.requires_grad
        expected = F.cross_entropy(reference(x), y)
        assert loss.item() == expected.item()
        loss.backward()
        expected.backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
            p.grad = q.grad = None

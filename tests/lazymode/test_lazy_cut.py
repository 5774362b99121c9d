"""One-line mode cuts where jit cuts (issue 43): a contrastive step over in-batch negatives, whose examples
meet at ``a @ b.T``, runs under ``stagetorch.lazy`` with a budget below what its whole batch (or its whole batch
recomputing) needs, cut there as ``jit`` cuts it (stagetorch.planning.cut). Several SGD steps with momentum, in
every lazy mode, against eager at float64."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import stagetorch
from stagetorch.lazymode import recording
from stagetorch.planning.cut import CutPlan
from stagetorch.runtime.executable import Executable

pytestmark = pytest.mark.usefixtures("lazy_mode")

BATCH, IMG, TXT, HIDDEN, EMBED = 64, 12, 10, 80, 8


class DualEncoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.image = torch.nn.Sequential(torch.nn.Linear(IMG, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, EMBED))
        self.text = torch.nn.Sequential(torch.nn.Linear(TXT, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, EMBED))
        self.log_scale = torch.nn.Parameter(torch.tensor(2.5))  # the learned temperature

    def forward(self, images, texts):
        a, b = F.normalize(self.image(images), dim=-1), F.normalize(self.text(texts), dim=-1)
        logits = a @ b.T * self.log_scale.exp()  # the examples meet
        target = torch.arange(a.shape[0])
        return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2


def batches(steps):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, IMG, generator=g, dtype=torch.float64), torch.randn(BATCH, TXT, generator=g, dtype=torch.float64))
        for _ in range(steps)
    ]


def jit_floor(model, images, texts) -> int:
    """The smallest budget jit runs the step in without recomputation (cut, one example per chunk), as its
    error says it."""

    def step(images, texts):
        loss = model(images, texts)
        loss.backward()
        return loss

    staged = stagetorch.jit(step, memory_budget=1024, remat=False)
    with pytest.raises(stagetorch.OutOfMemoryError, match="smallest budget that runs this step") as info:
        staged.plan(images, texts)
    return info.value.smallest_budget


def loop(model, data, budget=None):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for images, texts in data:
        if budget is not None:
            images, texts = stagetorch.lazy(images, texts, batch=0, memory_budget=budget, remat=False)
        optimizer.zero_grad()
        loss = model(images, texts)
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
    return losses, [p.detach().clone() for p in model.parameters()]


def test_a_contrastive_step_under_a_budget_is_cut_as_jit_cuts_it(lazy_mode, monkeypatch):
    recording.RECORDINGS.clear()
    torch.manual_seed(0)
    model = DualEncoder().double()
    reference = copy.deepcopy(model)
    data = batches(4)
    budget = int(jit_floor(copy.deepcopy(model), *data[0]) * 1.3)
    plans = []
    run = Executable.run

    def seen(self, inputs, plan, **kwargs):
        plans.append(plan)
        return run(self, inputs, plan, **kwargs)

    monkeypatch.setattr(Executable, "run", seen)
    losses, params = loop(model, data, budget)
    expected_losses, expected_params = loop(reference, data)
    assert losses == pytest.approx(expected_losses, rel=1e-10)
    for p, q in zip(params, expected_params):
        assert torch.allclose(p, q, rtol=1e-9, atol=1e-12), (p - q).abs().max()
    cuts = [p for p in plans if isinstance(p, CutPlan)]
    assert len(cuts) == len(data), plans  # every step's flush at backward() was cut
    assert all(max(p.chunk_sizes) < BATCH for p in cuts), [p.chunk_sizes for p in cuts]

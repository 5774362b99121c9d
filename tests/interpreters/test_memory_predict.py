"""``report.predict(b)`` is never under the allocator: a small conv net whose grouped convolution's backward
books a oneDNN workspace (not affine in the batch: its blocking and kernel follow the shapes), reported at
batch 16, 2 and 1, predicts the step at 8 as the step staged at 8 says, and the run at 8 takes no more."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from memtrack import AllocatorPeak

import stagetorch
from stagetorch.interpreters.memory import CATEGORIES


def _conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1, groups=2),
        nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(512, 10),
    )


def _data(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(b)
    return torch.randn(b, 3, 16, 16, generator=g), torch.randint(0, 10, (b,), generator=g)


@pytest.mark.parametrize("at", [16, 2, 1])
def test_predict_is_the_step_staged_at_that_batch_and_never_under_the_allocator(at):
    model = _conv_net()

    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    report = stagetorch.memory(step)(*_data(at))
    workspace = CATEGORIES.index("workspace")
    assert any(row[workspace] for row in report.live), "the grouped convolution's backward books no workspace"
    staged_at_8 = stagetorch.memory(step)(*_data(8)).peak_bytes
    assert report.predict(8) == staged_at_8, (report.predict(8), staged_at_8)
    x, y = _data(8)
    staged = stagetorch.jit(step)
    with AllocatorPeak([*model.parameters(), x, y]) as run:
        staged(x, y)
    assert run.peak <= report.predict(8), (run.peak, report.predict(8))

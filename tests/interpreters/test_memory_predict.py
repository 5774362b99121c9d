"""``report.predict(b)`` is never under the allocator: a small conv net whose grouped convolution's backward
books a oneDNN workspace (not affine in the batch: its blocking and kernel follow the shapes), reported at
batch 16, 2 and 1, predicts the step at 8 as the step staged at 8 says, and the run at 8 takes no more."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from budgets import train_chunked_against_eager
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


# -- issue 43: memory() on every step jit runs ----------------------------------------------------------------
# Steps that stage at their own batch only: a batch-sized tensor they do not receive, or their batch size
# written as a number. The report used to re-stage them at other batch sizes by slicing the arguments alone,
# and raised (ShapeError 48 vs 96, or the probe's own error) where jit runs them.

B, C = 96, 5
PRIOR = torch.rand(B, C, generator=torch.Generator().manual_seed(3))  # a batch-sized global


def _global(model):
    return lambda x, y: (F.log_softmax(model(x), 1) * PRIOR).sum(1).mean()


def _buffer(model):
    model.register_buffer("prior", PRIOR.clone())
    return lambda x, y: (F.log_softmax(model(x), 1) * model.prior).sum(1).mean()


def _closure(model):
    prior = PRIOR.clone()[:, 0]
    return lambda x, y: -(F.log_softmax(model(x), 1).gather(1, y[:, None])[:, 0] * prior).mean()


def _python_list(model):
    values = PRIOR[:, 0].tolist()
    return lambda x, y: -(F.log_softmax(model(x), 1).gather(1, y[:, None])[:, 0] * torch.tensor(values)).mean()


def _literal_reshape(model):
    return lambda x, y: F.cross_entropy(model(x.reshape(96, -1)), y)


ONE_BATCH_ONLY = {"global": _global, "buffer": _buffer, "closure": _closure, "python_list": _python_list,
                  "literal_reshape": _literal_reshape}


def _trained(loss_of):
    def step(x, y):
        loss = loss_of(x, y)
        loss.backward()
        return loss

    return step


@pytest.mark.parametrize("row", list(ONE_BATCH_ONLY))
def test_memory_reports_every_step_jit_runs(row):
    torch.manual_seed(0)
    model = nn.Linear(8, C)
    step = _trained(ONE_BATCH_ONLY[row](model))
    x, y = torch.randn(B, 8), torch.randint(0, C, (B,))
    graph = stagetorch.jit(step).graph(x, y)
    report = stagetorch.memory(step)(x, y)  # no .grad yet: the call holds nothing beside its program
    assert report.peak_bytes == stagetorch.interpreters.memory.peak_bytes(graph)
    assert not report.per_example_known and "per-example split is unknown" in report.note
    assert "per-example split unknown" in str(report)
    assert report.predict(B) == report.peak_bytes
    with pytest.raises(stagetorch.StagingError, match=r"(?s)costs the step at batch 96 only, not at 48.*What to do:"):
        report.predict(48)
    if row != "literal_reshape":
        assert "is not an argument" in report.note and "test_memory_predict.py:" in report.note
    # and jit runs it, in chunks, as eager trains
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(B, 8, generator=g), torch.randint(0, C, (B,), generator=g)) for _ in range(3)]
    train_chunked_against_eager(lambda m: _trained(ONE_BATCH_ONLY[row](m)), nn.Linear(8, C), batches, tol=1e-5)


def test_memory_still_splits_a_batch_sized_tensor_made_from_the_batch_size():
    """A factory sized by ``x.shape[0]`` follows the arguments: the probes stage, the split is known."""
    torch.manual_seed(0)
    model = nn.Linear(8, C)
    step = _trained(lambda x, y: -(F.log_softmax(model(x), 1).gather(1, y[:, None])[:, 0]
                                   * torch.linspace(0, 1, x.shape[0])).mean())
    x, y = torch.randn(B, 8), torch.randint(0, C, (B,))
    report = stagetorch.memory(step)(x, y)
    assert report.per_example_bytes > 0 and report.linear and "split is unknown" not in report.note

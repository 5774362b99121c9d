"""Issue 43: batch rules for ops that per-example user code reaches (repeat, take, scatter_add_, index_fill,
index_add, index_copy, cdist, diagonal, unfold, cumprod's backward, searchsorted, multi_margin_loss).

Each case is a small model and a training step written as eager code a user would write; it is trained for
three SGD-with-momentum steps under ``jit`` with a budget forcing at least three chunks, against the same loop
in eager (float64). Where an op truly mixes the examples, the step must be refused by name.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from budgets import budget_for, train_chunked_against_eager
from torch import nn

import stagetorch

B, D = 13, 6


def _batches(make):
    torch.manual_seed(1)
    return [make() for _ in range(3)]


def _xy():
    return torch.randn(B, D, dtype=torch.float64), torch.randn(B, dtype=torch.float64)


def _repeat(model, x, y):
    h = model(x)
    r = h[:, None].repeat(1, 4, 1)  # (B, 4, D)
    s = h.sum(1)[:, None].repeat(1, 4)  # the y[:, None].repeat(1, 4)
    return ((r * r).mean((1, 2)) + s.mean(1) - y).pow(2).mean()


_TABLE = torch.randn(40, dtype=torch.float64)


def _take(model, x, y):
    h = model(x)
    ids = (x.abs() * 7).long() % 40  # per-example positions into a shared table
    w = model.weight.flatten()
    picked = w.take(ids % w.numel()) + _TABLE.take(ids)
    return ((h * picked).sum(1) - y).pow(2).mean()


def _scatter_add_(model, x, y):
    h = model(x)
    idx = (x.abs() * 3).long() % D  # per-example targets, within each example's row
    out = torch.zeros_like(h)
    out.scatter_add_(1, idx, h)
    acc = h.clone()
    acc.scatter_add_(1, idx, h * 2)  # into a per-example tensor, in place
    return ((out * acc).sum(1) - y).pow(2).mean()


_COLS = torch.tensor([0, 2, 5])


def _index_fill(model, x, y):
    h = model(x)
    return (h.index_fill(1, _COLS, 0.5).sum(1) - y).pow(2).mean()


def _index_add(model, x, y):
    h = model(x)
    picked = h.index_select(1, _COLS)  # backward: index_add into zeros
    added = h.index_add(1, _COLS, picked * 3)
    return ((picked.sum(1) + added.pow(2).sum(1)) - y).pow(2).mean()


def _index_copy(model, x, y):
    h = model(x)
    src = torch.tanh(h[:, :3])
    return (h.index_copy(1, _COLS, src).pow(2).sum(1) - y).pow(2).mean()


_CENTRES = torch.randn(5, D, dtype=torch.float64)


def _cdist(model, x, y):
    h = model(x)
    d1 = torch.cdist(h, _CENTRES)  # rows of x1 per example against a shared x2
    d2 = torch.cdist(h.view(B, 2, 3), x.view(B, 2, 3))  # batched cdist, both per example
    d3 = torch.cdist(h, model.weight)  # against a parameter
    return (d1.sum(1) + d2.sum((1, 2)) + d3.mean(1) - y).pow(2).mean()


def _diagonal(model, x, y):
    h = model(x)
    m = h[:, :, None] * h[:, None, :]  # (B, D, D)
    return (m.diagonal(dim1=1, dim2=2).sum(1) + m.diagonal(1, 1, 2).sum(1) - y).pow(2).mean()


def _unfold(model, x, y):
    h = model(x)
    w = h.unfold(1, 3, 2)  # (B, 2, 3): windows along the feature dim
    return (w.prod(2).sum(1) - y).pow(2).mean()


def _cumprod(model, x, y):
    h = model(x)
    h = h * (h > 0.3)  # zeros: cumprod's backward takes its scatter_ route
    return (h.cumprod(1).sum(1) - y).pow(2).mean()


_EDGES = torch.linspace(-2, 2, 9, dtype=torch.float64)


def _searchsorted(model, x, y):
    h = model(x)
    bucket = torch.searchsorted(_EDGES, x.contiguous())  # shared sorted sequence, per-example values
    return ((h * bucket).sum(1) - y).pow(2).mean()


def _multi_margin(model, x, y):
    h = model(x)
    target = (y.abs() * 3).long() % D
    w = torch.linspace(0.5, 1.5, D, dtype=torch.float64)
    return F.multi_margin_loss(h, target) + F.multi_margin_loss(h, target, p=2, margin=0.5, weight=w, reduction="sum")


class _Bags(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.mean = nn.EmbeddingBag(20, 32, mode="mean")
        self.sum = nn.EmbeddingBag(20, 32, mode="sum")
        self.max = nn.EmbeddingBag(20, 32, mode="max")


def _embedding_bag(model, x, y):
    ids = (x.abs() * 9).long() % 20  # each example's own bag of D indices
    h = model.lin(x)
    w = torch.sigmoid(h)  # per-sample weights (sum mode), trained through
    pairs = ids.view(B, 2, 3).flatten(1)  # the same indices, two bags of 3 per example
    bags = model.mean(ids) + model.sum(ids, per_sample_weights=w) + model.max(ids)
    two = model.sum(pairs.view(-1), torch.arange(0, B * D, 3), per_sample_weights=w.flatten()).view(B, 2, 32)
    outer = bags[:, :, None] * bags[:, None, :]  # activations large enough for the budget to force chunks
    return (outer.tanh().mean((1, 2)) + h.sum(1) * bags.mean(1) + two.pow(2).sum((1, 2)) - y).pow(2).mean()


CASES = {
    "repeat": _repeat,
    "take": _take,
    "scatter_add_": _scatter_add_,
    "index_fill": _index_fill,
    "index_add": _index_add,
    "index_copy": _index_copy,
    "cdist": _cdist,
    "diagonal": _diagonal,
    "unfold": _unfold,
    "cumprod_backward": _cumprod,
    "searchsorted": _searchsorted,
    "multi_margin_loss": _multi_margin,
    "embedding_bag": _embedding_bag,
}

MODELS = {"embedding_bag": _Bags}


@pytest.mark.parametrize("name", sorted(CASES))
def test_trains_in_chunks_as_eager(name):
    loss_of = CASES[name]

    def step_of(model):
        def step(x, y):
            loss = loss_of(model, x, y)
            loss.backward()
            return loss

        return step

    torch.manual_seed(0)
    model = MODELS.get(name, lambda: nn.Linear(D, D))().double()
    train_chunked_against_eager(step_of, model, _batches(_xy))


def _refused(fn, *args):
    """The error chunking ``fn`` meets: a coupling that names the op (at a budget of one byte, the planner's
    error carries it)."""
    staged = stagetorch.jit(fn, memory_budget=1)
    with pytest.raises(stagetorch.StagingError) as info:
        staged.plan(*args)
    return str(info.value)


def test_index_ops_along_the_batch_dim_are_refused_by_name():
    """An index along the batch dim moves rows between examples: refused, naming the op."""
    x = torch.randn(B, D, dtype=torch.float64)
    rows = torch.tensor([0, 3])
    for name, fn in {
        "index_fill": lambda x: x.index_fill(0, rows, 1.0).sum(),
        "index_add": lambda x: x.index_add(0, rows, torch.ones(2, D, dtype=x.dtype)).sum(),
        "index_copy": lambda x: x.index_copy(0, rows, torch.ones(2, D, dtype=x.dtype)).sum(),
        "take": lambda x: x.take(torch.tensor([0, 7, 20])).sum(),
        "repeat": lambda x: x.repeat(2, 1).sum(),
        "_cdist_forward": lambda x: torch.cdist(x.t(), torch.ones(3, B, dtype=x.dtype)).sum(),
        "multi_margin_loss": lambda x: F.multi_margin_loss(x.t(), torch.zeros(D, dtype=torch.long)),
    }.items():
        msg = _refused(fn, x)
        assert f"aten.{name}" in msg and "would change the result" in msg and "What to do" in msg, msg


def test_embedding_bags_of_unequal_sizes_are_refused_when_they_run():
    """Offsets that are not each example's own equal bags: no chunk can tell its bags, refused by name."""
    bag = nn.EmbeddingBag(20, 32, mode="sum").double()

    def step(ids):
        offsets = torch.tensor([0, 1] + [3 * i for i in range(1, B - 1)])  # bag 0 of 1 index, bag 1 of 2
        out = bag(ids.view(-1), offsets)
        loss = (out[:, :, None] * out[:, None, :]).tanh().sum()
        loss.backward()
        return loss

    ids = torch.randint(0, 20, (B, 3))
    staged = stagetorch.jit(step)
    budget_for(staged, ids)
    with pytest.raises(stagetorch.BatchCouplingError, match="embedding bag's offsets are not equal bags"):
        staged(ids)
    assert bag.weight.grad is None

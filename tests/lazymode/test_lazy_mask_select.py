"""A boolean mask selecting per-example losses, ``l[mask].mean()``, under ``stagetorch.lazy`` with a budget that
needs chunks (issue 43). The selection's size follows from the mask alone: the session computes only the mask
(a peek) and records ``l[positions]``, as jit stages a mask it knows, so the step's forward and backward are one
program, cut where the examples meet as jit cuts it. Before, ``l[mask]`` ran for real: the whole forward was
flushed mid-step, every activation autograd saved held for the whole batch, and the backward's own program
(cut at the selection's ``index_put``) had no room for one example at jit's budget (OutOfMemoryError "Examples
meet at aten.index_put ... backward of IndexBackward0"). Three steps against eager at float64: loss, every
``.grad``, the parameters, and the chunks each backward ran in."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import stagetorch
from stagetorch.planning.cut import CutPlan
from stagetorch.runtime.executable import Executable

B, D, H, C = 19, 8, 32, 5
CAPTURED = torch.rand(B, generator=torch.Generator().manual_seed(5)) > 0.4  # a mask the step closes over

WEIGHTS = 0.5 + torch.rand(B, generator=torch.Generator().manual_seed(6), dtype=torch.float64)

MASKS = {
    "argument": lambda x, y, m: m > 0.5,
    "input": lambda x, y, m: x[:, 0] > -0.5,
    "labels": lambda x, y, m: (y != 1).to(torch.uint8).bool(),
    "captured": lambda x, y, m: CAPTURED,
}


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.Tanh(), torch.nn.Linear(H, C)).double()


def batches(steps: int = 3) -> list:
    g = torch.Generator().manual_seed(1)
    # (each step's mask selects another number of examples: the recording's selection is replayed or recorded again)
    return [(torch.randn(B, D, generator=g, dtype=torch.float64), torch.randint(0, C, (B,), generator=g),
             torch.rand(B, generator=g, dtype=torch.float64)) for _ in range(steps)]


def train(net, data, mask, budget=None, weighted=None):
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    record = []
    for x, y, m in data:
        if budget is not None:
            x, y, m = stagetorch.lazy(x, y, m, batch=0, memory_budget=budget, remat=False)
        optimizer.zero_grad()
        out = net(x)
        l = F.cross_entropy(out, y, reduction="none")
        loss = l[mask(x, y, m)].mean() if weighted is None else (l[mask(x, y, m)] * weighted[mask(x, y, m)]).mean()
        loss.backward()
        record.append((loss.item(), [p.grad.clone() for p in net.parameters()]))
        optimizer.step()
    return record, [p.detach().clone() for p in net.parameters()]


def jit_budget(net, x, y, m) -> int:
    """A budget at which jit runs the step, its mask an argument (jit refuses to read a captured one on the
    host: it may change between calls), in >= 3 chunks."""

    def step(x, y, m):
        loss = F.cross_entropy(net(x), y, reduction="none")[m > 0.5].mean()
        loss.backward()
        return loss

    staged = stagetorch.jit(step, remat=False)
    whole = staged.plan(x, y, m).full_batch_peak_bytes
    for fraction in (0.7, 0.6, 0.5):
        staged.memory_budget = int(whole * fraction)
        if len(staged.plan(x, y, m).chunk_sizes) >= 3:
            return staged.memory_budget
    raise AssertionError("jit does not chunk this step")


@pytest.mark.parametrize("weighted", [False, True], ids=["mean", "captured_weights"])
@pytest.mark.parametrize("mask", list(MASKS))
def test_a_mask_selecting_per_example_losses_runs_in_chunks_as_eager(mask, weighted, lazy_mode, monkeypatch):
    """``captured_weights``: the mask also selects from a real tensor the step closes over (the selection of a
    real tensor by a lazy mask runs for real, once the mask is computed)."""
    weighted = WEIGHTS if weighted else None
    data = batches()
    net, reference = model(), model()
    budget = jit_budget(copy.deepcopy(net), *data[0])
    plans = []
    run = Executable.run

    def seen(self, inputs, plan, **kwargs):
        plans.append(plan)
        return run(self, inputs, plan, **kwargs)

    monkeypatch.setattr(Executable, "run", seen)
    got, params = train(net, data, MASKS[mask], budget, weighted)
    monkeypatch.setattr(Executable, "run", run)
    expected, expected_params = train(reference, data, MASKS[mask], weighted=weighted)
    for (loss, grads), (want, want_grads) in zip(got, expected):
        assert loss == pytest.approx(want, rel=1e-12)
        for g, w in zip(grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-13)
    for p, q in zip(params, expected_params):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-13)
    # every step's forward and backward ran as one program, cut at the selection, in chunks on both sides
    cuts = [p for p in plans if isinstance(p, CutPlan)]
    assert len(cuts) == len(data), plans
    assert all(len(p.chunk_sizes) >= 2 and len(p.before_sizes) >= 2 for p in cuts), [
        (p.before_sizes, p.chunk_sizes) for p in cuts
    ]


COLUMNS = torch.tensor([True, False, True, True, False])  # a shared mask over the classes, not the batch


def train_columns(net, data, run=None):
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.05)
    record = []
    for x, y, m in data:
        optimizer.zero_grad()
        loss = run(x) if run is not None else columns_step(net, x, COLUMNS)
        record.append((loss.item(), [p.grad.clone() for p in net.parameters()]))
        optimizer.step()
    return record, [p.detach().clone() for p in net.parameters()]


def columns_step(net, x, mask):
    loss = net(x)[:, mask].pow(2).mean()
    loss.backward()
    return loss


def test_a_shared_mask_beside_the_batch_chunks_without_a_cut_in_jit(monkeypatch):
    check_columns("jit", monkeypatch)


def test_a_shared_mask_beside_the_batch_chunks_without_a_cut_in_lazy(lazy_mode, monkeypatch):
    check_columns("lazy", monkeypatch)


def check_columns(front, monkeypatch):
    """``out[:, mask]``, the mask shared and over a dim that is not the batch's: each chunk selects the same
    columns. Its backward, ``index_put`` of the mask into zeros, was refused as examples meeting ("indexes with
    a boolean mask, whose positions depend on the data"), so jit and lazy cut the step there and recomputed its
    forward; it now runs in plain chunks (issue 43)."""
    data = batches()
    net, reference = model(), model()
    plans = []
    run = Executable.run

    def seen(self, inputs, plan, **kwargs):
        plans.append(plan)
        return run(self, inputs, plan, **kwargs)

    staged = stagetorch.jit(lambda x, m: columns_step(net, x, m), remat=False, batch_argnums=(0,))
    whole = staged.plan(data[0][0], COLUMNS).full_batch_peak_bytes
    budget = int(whole * 0.6)
    monkeypatch.setattr(Executable, "run", seen)
    if front == "jit":
        staged.memory_budget = budget
        got, params = train_columns(net, data, lambda x: staged(x, COLUMNS))
    else:
        got, params = train_columns(
            net, data, lambda x: columns_step(net, stagetorch.lazy(x, batch=0, memory_budget=budget, remat=False), COLUMNS)
        )
    monkeypatch.setattr(Executable, "run", run)
    expected, expected_params = train_columns(reference, data)
    for (loss, grads), (want, want_grads) in zip(got, expected):
        assert loss == pytest.approx(want, rel=1e-12)
        for g, w in zip(grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-13)
    for p, q in zip(params, expected_params):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-13)
    chunked = [p for p in plans if len(getattr(p, "chunk_sizes", ())) >= 2]
    assert len(chunked) == len(data) and not any(isinstance(p, CutPlan) for p in plans), plans

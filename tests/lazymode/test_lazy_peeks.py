"""Peeks in a row: a write into a real tensor after each layer (an MoE router's token counts) makes one-line
mode compute what the write reads mid-step, without the flush (``_Session._peek``). From the second step
on each peek starts from the values the one before it kept, not from the last flush: the peeks' work grows
with the depth, not with its square. Every step against the same loop in plain PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stagetorch
from stagetorch.lazymode import recording
from stagetorch.lazymode.mode import Mode
from stagetorch.lazymode.session import _Session
from stagetorch.runtime.executable import Executable

pytestmark = pytest.mark.usefixtures("lazy_mode")

E = 8  # the "experts" each layer counts its rows by


class Routed(nn.Module):
    """Narrow inputs, wide layers: what a peek computes (the layers' activations) outweighs what the
    flush at backward() needs at the least (the inputs, the parameters and their gradients)."""

    def __init__(self, layers: int):
        super().__init__()
        self.embed = nn.Linear(4, 64)
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(layers))
        self.router = nn.Linear(64, E)

    def forward(self, x):
        h, loss, counts = self.embed(x), 0, []
        for layer in self.layers:
            h = torch.tanh(layer(h)) + h
            ids = self.router(h).argmax(-1)
            tokens = torch.zeros(E, dtype=h.dtype).scatter_add_(0, ids, torch.ones_like(h[:, 0]))  # a write: runs at once
            counts.append(tokens)
            loss = loss + (self.router(h).softmax(-1) * tokens).sum() / h.shape[0]
        return loss + h.square().mean(), counts


@pytest.mark.parametrize("budget", [None, 3000 * 1024], ids=["whole", "chunked"])
def test_peeks_in_a_row_start_from_the_one_before(budget, lazy_mode, monkeypatch):
    """Each write's peek is forced (as where the flush would keep an MoE layer's sorted rows). Four AdamW
    steps: the counts each write made, the losses and the gradients equal eager's; from the second step on
    every peek after the first computes one layer's equations, where the first step's peeks grew by a
    layer each; under the budget they run in chunks, the values kept cut per chunk."""
    monkeypatch.setattr(_Session, "_peeks", lambda self, executable, device: True)
    peeks, chunks = [], []
    run = Executable.run

    def counted(self, inputs, plan, **kwargs):
        peeks.append(len(self.graph.eqns))
        chunks.append(len(plan.chunk_sizes))
        return run(self, inputs, plan, **kwargs)

    monkeypatch.setattr(Executable, "run", counted)
    recording.RECORDINGS.clear()
    torch.manual_seed(0)
    model = Routed(4).double()
    reference = copy.deepcopy(model)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.05) for m in (model, reference)]
    sizes, chunked = [], []
    for _ in range(4):
        x = torch.randn(2048, 4, dtype=torch.float64)
        peeks.clear(), chunks.clear()
        loss, counts = model(stagetorch.lazy(x, batch=0, memory_budget=budget, remat=False))
        loss.backward()
        sizes.append(peeks[:4])  # the four peeks (the flush at backward() follows)
        chunked.append(chunks[:4])
        loss0, counts0 = reference(x)
        loss0.backward()
        assert [c.tolist() for c in counts] == [c.tolist() for c in counts0]
        assert torch.allclose(loss.detach(), loss0.detach(), rtol=1e-12)
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.allclose(p.grad, q.grad, rtol=1e-9, atol=1e-12)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    first, later = sizes[0], sizes[1:]
    assert first[1] < first[2] < first[3], first  # from the last flush: a layer more each
    if lazy_mode is Mode.RECORD:  # a session that records has no peeks of an earlier step to learn from
        assert all(s == first for s in later), sizes
    else:  # one layer's equations each, fewer than the second peek's from the flush
        assert all(s[0] == first[0] and s[1] == s[2] == s[3] < first[1] for s in later), sizes
    if budget is not None:
        assert all(c > 1 for step in chunked for c in step), chunked


# A value read twice with work pending between (issue 43): the second read asked the flush for a value computed
# already (an input, or a value an earlier flush kept), and the peek it made had that value as its output
# without making or reading it (KeyError from the generated program). Each spelling, several SGD steps with
# momentum, whole and in chunks, against eager.

B, D = 64, 12


class GlobalAttentionMask(nn.Module):
    """Longformer's ``is_index_global_attn.flatten().any().item()``, then ``.nonzero()`` of the same mask with
    another layer recorded between."""

    def __init__(self):
        super().__init__()
        self.local, self.glob, self.head = nn.Linear(D, 32), nn.Linear(32, 32), nn.Linear(32, 3)

    def forward(self, x, ids, y):
        h = torch.tanh(self.local(x))
        is_global = h[:, 0] > 0
        if is_global.flatten().any().item():  # a flush: the mask is kept
            g = self.glob(h)  # pending when the mask is read again
            nonzero = is_global.nonzero()  # run for real on the mask's value
            h = h + g * is_global[:, None] * (nonzero.shape[0] / h.shape[0])
        return F.cross_entropy(self.head(h), y)


class RenormedEmbedding(nn.Module):
    """``nn.Embedding(max_norm=...)`` after another lazy op: ``embedding_renorm_`` writes the real weight, reading
    the lazy ids (an input)."""

    def __init__(self):
        super().__init__()
        self.embed, self.proj, self.head = nn.Embedding(20, 32, max_norm=1.0), nn.Linear(D, 32), nn.Linear(32, 3)

    def forward(self, x, ids, y):
        h = torch.tanh(self.proj(x))  # pending when the renorm reads the ids
        return F.cross_entropy(self.head(h + self.embed(ids)), y)


class LabelsThroughUnique(nn.Module):
    """Labels mapped to their rank among the batch's classes: ``torch.unique(ids)`` (run for real on the ids,
    an input) with the model's forward pending, then ``torch.searchsorted`` (which has no batch rule, so only
    whole) or the same ranks counted by comparison."""

    searchsorted = True

    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(D, 32), nn.Linear(32, 20)

    def forward(self, x, ids, y):
        logits = self.head(torch.tanh(self.body(x)))  # pending when unique reads the ids
        classes = torch.unique(ids)
        ranks = torch.searchsorted(classes, ids) if self.searchsorted else (classes < ids[:, None]).sum(1)
        return F.cross_entropy(logits, ranks)


class LabelsRankedByComparison(LabelsThroughUnique):
    searchsorted = False


READ_TWICE = {
    "global-mask": GlobalAttentionMask, "max-norm": RenormedEmbedding, "unique-searchsorted": LabelsThroughUnique,
    "unique": LabelsRankedByComparison,
}
READ_TWICE_BUDGET = 36_000  # each step's flush at backward() runs a batch of 64 in chunks (checked below)


def _read_twice_loop(model, one_line, budget, steps=4):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(B, D, generator=g)
        ids = torch.randint(0, 20, (B,), generator=g) * (torch.arange(B) % 2)  # ids and labels per example
        y = torch.randint(0, 3, (B,), generator=g)
        if one_line:
            x, ids, y = stagetorch.lazy(x, ids, y, batch=0, memory_budget=budget)
        optimizer.zero_grad()
        loss = model(x, ids, y)
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(("name", "budget"), [
    *((name, None) for name in READ_TWICE),
    *((name, READ_TWICE_BUDGET) for name in READ_TWICE if name != "unique-searchsorted"),  # (no batch rule)
])
def test_a_value_read_twice_with_work_pending_between(name, budget, lazy_mode):
    recording.RECORDINGS.clear()
    torch.manual_seed(0)
    model = READ_TWICE[name]()
    reference = copy.deepcopy(model)
    runs = []
    run = Executable.run

    def counted(self, inputs, plan, **kwargs):
        runs.append(len(plan.chunk_sizes))
        return run(self, inputs, plan, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Executable, "run", counted)
        losses, params = _read_twice_loop(model, True, budget)
    expected_losses, expected_params = _read_twice_loop(reference, False, None)
    assert losses == pytest.approx(expected_losses, rel=1e-5, abs=1e-7)
    for p, q in zip(params, expected_params):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), (p - q).abs().max()
    if budget is not None:
        assert max(runs) > 1, runs  # the step's flush ran in chunks

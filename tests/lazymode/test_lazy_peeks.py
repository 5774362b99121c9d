"""Peeks in a row: a write into a real tensor after each layer (an MoE router's token counts) makes one-line
mode compute what the write reads mid-step, without the flush (``_Session._peek``). From the second step
on each peek starts from the values the one before it kept, not from the last flush: the peeks' work grows
with the depth, not with its square. Every step against the same loop in plain PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

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

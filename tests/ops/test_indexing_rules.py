"""Advanced indexing, batch-position indices and factories the batch fills, chunked exactly.

Each step is the pattern as real model code writes it (transformers' mask functions, ``logits[arange(B),
labels]``, ``shift_tokens_right``, position tables); each runs in >= 3 uneven chunks and its loss and every
``.grad`` are compared with the same step run whole in eager PyTorch. Removing the batch rule it needs turns
each into an ``UnsupportedOpError`` or a ``BatchCouplingError`` (the last tests say which).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from budgets import budget_for, rel

import stagetorch
from stagetorch import registry

B, S, H, V = 10, 6, 8, 13


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.pos = nn.Parameter(torch.randn(S, H))
        self.qkv = nn.Linear(H, 3 * H)
        self.out = nn.Linear(H, V)


def _mask_attention(m: Tiny, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """transformers' ``sdpa_mask``: ``padding_mask[batch_idx, kv_idx]`` over an ``arange(B)`` of the batch;
    without a padding mask, the causal mask expanded to the batch (shared by every example)."""
    b = ids.shape[0]
    batch_idx = torch.arange(b)[:, None, None, None]
    kv_idx = torch.arange(S)[None, None, None, :]
    q_idx = torch.arange(S)[None, None, :, None]
    causal = kv_idx <= q_idx
    allowed = causal.expand(b, 1, S, S) if mask is None else mask.bool()[batch_idx, kv_idx] & causal
    x = m.emb(ids) + m.pos[torch.arange(S).repeat(b, 1)]  # a position table read through a shared index
    q, k, v = m.qkv(x).view(b, S, 3, 1, H).permute(2, 0, 3, 1, 4)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).squeeze(1)


def masked_lm(m: Tiny):
    def step(ids, mask, labels):
        logits = m.out(_mask_attention(m, ids, mask))
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss.backward()
        return loss

    return step


def picked_logits(m: Tiny):
    """The log-likelihood of each example's label read with ``logits[arange(B), labels]``."""

    def step(ids, mask, labels):
        logits = m.out(_mask_attention(m, ids, mask)[:, 0]).log_softmax(-1)
        loss = -logits[torch.arange(ids.shape[0]), labels[:, 0].clamp_min(0)].mean()
        loss.backward()
        return loss

    return step


def shifted_decoder(m: Tiny):
    """``shift_tokens_right``: ``new_zeros(ids.shape)`` written with per-example slices, and ``torch.zeros(B, S)``
    filled the same way; attention under a causal mask expanded to the batch, passed as ``attn_mask=``."""

    def step(ids, mask, labels):
        shifted = ids.new_zeros(ids.shape)
        shifted[:, 1:] = ids[:, :-1].clone()
        shifted[:, 0] = 2
        weights = torch.zeros(ids.shape[0], S, dtype=torch.float64)
        weights[:, :] = mask
        logits = m.out(_mask_attention(m, shifted, None))
        loss = (F.cross_entropy(logits.transpose(1, 2), labels.clamp_min(0), reduction="none") * weights).sum()
        loss.backward()
        return loss

    return step


def batch_of(b: int = B) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (b, S), generator=g)
    mask = torch.ones(b, S, dtype=torch.long)
    for i in range(b):
        mask[i, S - i % 3 :] = 0  # padded at the end of some rows
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def run_chunked(step_of, model: nn.Module, batch: tuple) -> tuple[torch.Tensor, nn.Module]:
    staged = stagetorch.jit(step_of(model), remat=False)
    budget_for(staged, *batch)
    plan = staged.plan(*batch)
    assert len(plan.chunk_sizes) >= 3 and len(set(plan.chunk_sizes)) > 1, plan
    return staged(*batch), model


@pytest.mark.parametrize("step_of", [masked_lm, picked_logits, shifted_decoder])
def test_chunked_equals_eager(step_of):
    torch.manual_seed(0)
    model = Tiny().double()
    reference = copy.deepcopy(model)
    batch = batch_of()
    expected = step_of(reference)(*batch)
    got, model = run_chunked(step_of, model, batch)
    assert rel(got, expected) < 1e-12
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert rel(p.grad, q.grad) < 1e-12, name


def test_several_steps_with_an_optimizer_and_a_changing_mask():
    """A training loop: the mask's padding changes every step (same shapes), SGD steps outside the call."""
    torch.manual_seed(0)
    model = Tiny().double()
    reference = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference))
    staged = stagetorch.jit(masked_lm(model), remat=False)
    for step in range(3):
        ids, mask, labels = batch_of()
        mask = mask.roll(step, 0)
        labels = ids.masked_fill(mask == 0, -100)
        budget_for(staged, ids, mask, labels)
        losses = []
        for o, run in ((opt, staged), (ref_opt, masked_lm(reference))):
            o.zero_grad()
            losses.append(run(ids, mask, labels))
            o.step()
        assert rel(*losses) < 1e-12
    for p, q in zip(model.parameters(), reference.parameters()):
        assert rel(p.detach(), q.detach()) < 1e-12


def test_index_of_other_examples_is_refused_when_it_runs():
    """``x[perm]`` reads other examples' rows: the chunked run refuses, and leaves .grad as it was."""
    torch.manual_seed(0)
    model = nn.Linear(H, 1).double()
    perm = torch.randperm(B)

    def step(x):
        loss = (model(x[perm]).squeeze(1) * torch.arange(B)).sum()
        loss.backward()
        return loss

    x = torch.randn(B, H, dtype=torch.float64)
    staged = stagetorch.jit(step, remat=False)
    budget_for(staged, x)
    with pytest.raises(stagetorch.BatchCouplingError, match="other than each example's own"):
        staged(x)
    assert model.weight.grad is None


@pytest.mark.parametrize(
    ("op", "step_of", "error"),
    [
        (torch.ops.aten.index.Tensor, masked_lm, stagetorch.UnsupportedOpError),
        (torch.ops.aten.index_put, picked_logits, stagetorch.UnsupportedOpError),
    ],
)
def test_the_rule_is_what_makes_it_chunk(monkeypatch, op, step_of, error):
    monkeypatch.setattr(registry.lookup(op), "batch", None)
    stagetorch.clear_caches()
    model = Tiny().double()
    with pytest.raises(error):
        run_chunked(step_of, model, batch_of())
    stagetorch.clear_caches()


def test_without_the_factory_promotion_the_shifted_write_is_refused(monkeypatch):
    from stagetorch.interpreters import batching

    monkeypatch.setattr(batching, "_into_factory", lambda *args: None)
    stagetorch.clear_caches()
    with pytest.raises(stagetorch.BatchCouplingError, match="updates a tensor shared by the whole batch"):
        run_chunked(shifted_decoder, Tiny().double(), batch_of())
    stagetorch.clear_caches()


def test_without_cutting_a_keyword_mask_the_chunk_fails(monkeypatch):
    from stagetorch.interpreters import batch_rules

    monkeypatch.setattr(batch_rules, "_argument", lambda eqn, i: eqn.args[i] if i < len(eqn.args) else None)
    stagetorch.clear_caches()
    with pytest.raises(RuntimeError):
        run_chunked(shifted_decoder, Tiny().double(), batch_of())
    stagetorch.clear_caches()

"""Host reads in one-line mode: the patterns of ``test_host_reads.py`` (``labels.ne(-100).sum().item()`` as a
number, ``if (mask == 0).any():``, ``int(lengths.max())`` as a size, LayerDrop's ``torch.rand([]) < p``) under
``stagetorch.lazy``, whole and in >= 3 chunks, several SGD steps against eager PyTorch with the same seeds:
losses, every ``.grad``, the layers taken, and the generator's state after the step.

LayerDrop draws outside the lazy tensors between the draws the step records (dropout's masks): each recorded
draw takes its numbers when it is called, as eager's does (``stagetorch/lazymode/draws.py``), so the whole step
equals eager with dropout on; in chunks, dropout draws per chunk and LayerDrop still takes eager's layers."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from host_read_steps import PATTERNS, B, D, LayerDropNet, features, labels_of, seq2seq_step
from staged_state import assert_same_state
from torch import nn

import stagetorch
from stagetorch.runtime.executable import Executable

LAZY_PATTERNS = ["item-count", "any-mask", "int-max-size", "layerdrop"]


class MaskedLayerDropNet(nn.Module):
    """Every pattern in one model: a host check of the attention mask, LayerDrop with dropout, and the count
    of labelled tokens used as a Python number."""

    def __init__(self, dropout: float = 0.2, layerdrop: float = 0.4, layers: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(50, D)
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(layers))
        self.head = nn.Linear(D, 50)
        self.dropout, self.layerdrop = dropout, layerdrop

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        if (attention_mask == 0).any():
            h = h * attention_mask[..., None]
        for layer in self.layers:
            if self.training and torch.rand([]) < self.layerdrop:
                continue
            h = h + F.dropout(torch.tanh(layer(h)), self.dropout, self.training)
        n = labels.ne(-100).sum().item()
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum") / n


def token_batch(k: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(k)
    ids = torch.randint(0, 50, (B, 8), generator=g)
    mask = torch.ones(B, 8, dtype=torch.long)
    if k % 2 == 0:
        mask[:: 3, 8 - 1 - k % 4 :] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def loss_step(model: nn.Module) -> Callable:
    def step(*batch):
        loss = model(*batch)
        loss.backward()
        return loss

    return step


def lazy_budget(make_step: Callable, model: nn.Module, batch: tuple, chunks: int = 3) -> int:
    """The largest budget (in 15% steps down from the whole step's largest flush) at which a lazy step's
    largest flush runs in >= ``chunks`` chunks (without recomputation)."""
    plans: list = []
    run = Executable.run

    def counted(self, inputs, plan, **kwargs):
        plans.append(plan)
        return run(self, inputs, plan, **kwargs)

    budget = None
    with pytest.MonkeyPatch.context() as m:
        m.setattr(Executable, "run", counted)
        while budget is None or budget > 1024:
            plans.clear()
            torch.manual_seed(0)
            try:
                make_step(copy.deepcopy(model))(*stagetorch.lazy(*batch, batch=0, memory_budget=budget, remat=False))
            except stagetorch.OutOfMemoryError:
                break
            if max(len(p.chunk_sizes) for p in plans) >= chunks:
                return budget
            budget = int((budget or max(p.peak for p in plans)) * 0.85)
    raise AssertionError("no budget gives enough chunks")


def run_lazy_against_eager(make_step: Callable, make_model: Callable, batch_of: Callable, chunked: bool,
                           exact: bool = True, steps: int = 3) -> None:
    """``steps`` lazy steps and eager ones, each after an SGD update, each from the same seed."""
    model = make_model()
    reference = copy.deepcopy(model)
    budget = lazy_budget(make_step, model, batch_of(0)) if chunked else None
    lazy_step, eager = make_step(model), make_step(reference)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    for k in range(steps):
        batch = batch_of(k)
        torch.manual_seed(k)
        loss = lazy_step(*stagetorch.lazy(*batch, batch=0, memory_budget=budget, remat=False))
        loss = None if loss is None else loss.detach().clone()
        after = torch.get_rng_state()
        torch.manual_seed(k)
        expected = eager(*batch)
        assert torch.equal(after, torch.get_rng_state()), "the lazy step left the generator elsewhere than eager"
        for p, q in zip(model.parameters(), reference.parameters()):
            assert (p.grad is None) == (q.grad is None), "the lazy step took other layers than eager"
        if exact:
            if loss is not None:
                torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
            assert_same_state(model, reference)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()


@pytest.mark.parametrize("name", LAZY_PATTERNS)
def test_host_read_under_lazy_whole_equals_eager(name, lazy_mode):
    """Dropout included: LayerDrop's draws and dropout's masks take eager's numbers."""
    run_lazy_against_eager(*PATTERNS[name], chunked=False)


@pytest.mark.parametrize("name", LAZY_PATTERNS)
def test_host_read_under_lazy_in_chunks_equals_eager(name, lazy_mode):
    make_step, make_model, batch_of = PATTERNS[name]
    if name == "layerdrop":  # in chunks dropout draws per chunk: LayerDrop alone here
        make_model = lambda: LayerDropNet(dropout=0.0)  # noqa: E731
    run_lazy_against_eager(make_step, make_model, batch_of, chunked=True)


def test_every_pattern_in_one_model_whole_equals_eager(lazy_mode):
    run_lazy_against_eager(loss_step, MaskedLayerDropNet, token_batch, chunked=False)


def test_every_pattern_in_one_model_in_chunks_takes_eagers_layers(lazy_mode):
    """Dropout's masks drawn per chunk are another sample than eager's: the layers LayerDrop takes and the
    generator after the step are eager's; without dropout the step equals eager."""
    run_lazy_against_eager(loss_step, MaskedLayerDropNet, token_batch, chunked=True, exact=False)
    run_lazy_against_eager(loss_step, lambda: MaskedLayerDropNet(dropout=0.0), token_batch, chunked=True)


class LateDrawNet(nn.Module):
    """Draws outside the lazy tensors after its dropout only when ``late`` is set."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer, self.head = nn.Linear(D, D), nn.Linear(D, 5)
        self.late = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(self.layer(x), 0.3, self.training)
        if self.late and torch.rand([]) < 0.5:
            h = h * 2
        return self.head(h)


@pytest.mark.lazy_modes("replay", "express")
def test_a_draw_outside_that_the_recording_did_not_make_warns_and_the_next_steps_are_eagers(lazy_mode):
    """A replay of a recording without draws outside the lazy tensors draws at the flush only; a step that
    draws outside after all differs from eager and says so, and the steps after it take eager's numbers."""
    model = LateDrawNet()
    reference = copy.deepcopy(model)
    x, labels = features(0, B, D), labels_of(0).clamp(min=0)
    for k in range(4):
        model.late = reference.late = k >= 1
        torch.manual_seed(k)
        lx, ly = stagetorch.lazy(x, labels, batch=0)
        if k == 1:
            with pytest.warns(RuntimeWarning, match="differ from eager's"):
                loss = F.cross_entropy(model(lx), ly)
                loss.backward()
        else:
            loss = F.cross_entropy(model(lx), ly)
            loss.backward()
        torch.manual_seed(k)
        expected = F.cross_entropy(reference(x), labels)
        expected.backward()
        if k != 1:
            torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-6, atol=1e-7)
            assert_same_state(model, reference)
        model.zero_grad()
        reference.zero_grad()


def _transformers_layerdrop(name: str) -> nn.Module:
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "opt":
        config = T.OPTConfig(hidden_size=16, num_hidden_layers=4, num_attention_heads=2, ffn_dim=32, vocab_size=50,
                             max_position_embeddings=64, word_embed_proj_dim=16, dropout=0.1, layerdrop=0.4)
        return T.OPTForCausalLM(config).double().train()
    config = T.BartConfig(d_model=16, encoder_layers=3, decoder_layers=3, encoder_attention_heads=2,
                          decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=50,
                          max_position_embeddings=64, dropout=0.1, encoder_layerdrop=0.4, decoder_layerdrop=0.4)
    return T.BartForConditionalGeneration(config).double().train()


@pytest.mark.parametrize("name", ["opt", "bart"])
def test_transformers_layerdrop_with_dropout_whole_equals_eager(name, lazy_mode):
    """transformers' own LayerDrop (``torch.rand([]) < self.layerdrop`` per layer) beside its dropout: the same
    layers and masks as eager, three steps."""
    run_lazy_against_eager(seq2seq_step, lambda: _transformers_layerdrop(name), token_batch, chunked=False)

"""Host reads that stage: values a step reads on the host that depend only on its integer arguments, on
constants or on the default generator (``if (mask == 0).any():``, ``labels.ne(-100).sum().item()``,
``int(lengths.max())``, ``torch.unique(labels)``, ``nonzero`` then a gather, LayerDrop's ``torch.rand([]) <
p``) are computed for real when the step is called, and pick the program staged for their outcome. Each
pattern runs several steps with an optimizer, whole and in >= 3 chunks, against eager PyTorch with the same
seed: losses, every ``.grad``, the parameters after the update, and the generator's state after the step.
``index_put`` with per-example values (``x[:, idx] = v``, the backward of ``logits[:, classes]``) chunks
exactly too."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from host_read_steps import (
    CLASSES,
    PATTERNS,
    B,
    D,
    LayerDropNet,
    count_step,
    features,
    labels_of,
    mlp,
    seq2seq_step,
)
from staged_state import assert_same_state, budget_for
from torch import nn

import stagetorch
from stagetorch.staging import guards

SELECTS = {"nonzero-gather", "bool-mask"}


def run_against_eager(make_step: Callable, make_model: Callable, batch_of: Callable, chunks: int, steps: int = 4,
                      seeds: int = 0) -> stagetorch.Staged:
    """``steps`` calls of the staged step and of eager, each after an SGD update, each from the same seed."""
    model = make_model()
    reference = copy.deepcopy(model)
    staged, eager = stagetorch.jit(make_step(model)), make_step(reference)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    for k in range(steps):
        batch = batch_of(k)
        if chunks > 1:
            torch.manual_seed(seeds + k)  # the program the call picks depends on the draws
            budget_for(staged, *batch, chunks=chunks)
        torch.manual_seed(seeds + k)
        loss = staged(*batch)
        after = torch.get_rng_state()
        torch.manual_seed(seeds + k)
        expected = eager(*batch)
        assert torch.equal(after, torch.get_rng_state()), "the staged step drew other numbers than eager"
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
        assert_same_state(model, reference)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        assert_same_state(model, reference)
    return staged


@pytest.mark.parametrize("name", PATTERNS)
def test_host_read_stages_whole_batch_equal_to_eager(name):
    staged = run_against_eager(*PATTERNS[name], chunks=1)
    (outcomes,) = staged._cache.values()
    assert isinstance(outcomes, guards.Outcomes)  # a program per outcome, not one traced per call


@pytest.mark.parametrize("name", [n for n in PATTERNS if n not in SELECTS])
def test_host_read_stages_in_chunks_equal_to_eager(name):
    make_step, make_model, batch_of = PATTERNS[name]
    if name == "layerdrop":  # under chunking dropout draws its masks per chunk: LayerDrop alone here
        make_model = lambda: LayerDropNet(dropout=0.0)  # noqa: E731
    run_against_eager(make_step, make_model, batch_of, chunks=3)


@pytest.mark.parametrize("name", sorted(SELECTS))
def test_selecting_examples_on_the_host_is_cut_where_the_examples_meet(name):
    """Selecting examples (``x[mask]``, ``nonzero`` then a gather) mixes them across the batch, so it cannot
    run in plain chunks: below the whole batch's peak the step is cut where the examples meet (issue 38's
    cut), and a budget below every cut says the smallest that runs, leaving the model as it was; that budget
    runs and equals eager."""
    make_step, make_model, batch_of = PATTERNS[name]
    model = make_model()
    reference = copy.deepcopy(model)
    staged = stagetorch.jit(make_step(model))
    batch = batch_of(1)
    full = staged.plan(*batch).full_batch_peak_bytes
    staged.memory_budget = full // 3
    with pytest.raises(stagetorch.OutOfMemoryError) as err:
        staged(*batch)
    assert "where the examples meet" in str(err.value) and err.value.smallest_budget < full
    assert_same_state(model, reference)
    staged.memory_budget = err.value.smallest_budget
    loss = staged(*batch)
    torch.testing.assert_close(loss, make_step(reference)(*batch).detach(), rtol=1e-5, atol=1e-6)
    assert_same_state(model, reference)


def test_layerdrop_takes_the_layers_eager_takes():
    """The same seed skips the same layers: the staged step's output is eager's, which another choice of
    layers would not give."""
    model = LayerDropNet(layers=6, dropout=0.0)
    staged = stagetorch.jit(lambda x: model(x))
    x = features(0, B, D)
    outs = []
    for seed in range(6):
        torch.manual_seed(seed)
        out = staged(x)
        torch.manual_seed(seed)
        torch.testing.assert_close(out, model(x))
        outs.append(out)
    assert any(not torch.allclose(outs[0], o) for o in outs[1:])
    (outcomes,) = staged._cache.values()
    assert 1 < len(outcomes) <= 6


def test_same_outcome_reuses_its_program_and_a_new_one_stages_with_a_log_line(caplog):
    model = mlp()
    staged = stagetorch.jit(count_step(model))
    x = features(0, B, D)
    first, second = labels_of(0), labels_of(3)
    assert first.ne(-100).sum() != second.ne(-100).sum()
    with caplog.at_level(logging.INFO, logger="stagetorch"):
        for labels in (first, first, second, first, second):
            staged(x, labels)
    (outcomes,) = staged._cache.values()
    assert len(outcomes) == 2
    grew = [r.getMessage() for r in caplog.records if "read on the host" in r.getMessage()]
    assert len(grew) == 1 and "host_read_steps.py" in grew[0] and "2 programs" in grew[0]


def test_programs_per_outcome_are_bounded(monkeypatch):
    monkeypatch.setattr(guards, "MAX_OUTCOMES", 2)
    model, reference = mlp(), mlp()
    staged, eager = stagetorch.jit(count_step(model)), count_step(reference)
    x = features(0, B, D)
    for k in (0, 1, 2, 3, 0):
        labels = labels_of(k)
        torch.testing.assert_close(staged(x, labels), eager(x, labels).detach())
        assert_same_state(model, reference)
    (outcomes,) = staged._cache.values()
    assert len(outcomes) == 2


def test_host_read_of_an_activation_stays_a_concretization_error_naming_the_line():
    model = mlp()

    def step(x):
        loss = model(x).pow(2).mean()
        if loss.item() < 1e-3:  # early stopping inside the step
            return loss
        loss.backward()
        return loss

    with pytest.raises(stagetorch.ConcretizationError) as err:
        stagetorch.jit(step)(features(0, B, D))
    msg = str(err.value)
    assert "test_host_reads.py:" in msg and "if loss.item() < 1e-3" in msg
    assert "depends on the parameters" in msg and "early stopping" in msg
    assert all(p.grad is None for p in model.parameters())


def test_float_input_that_requires_grad_is_not_read_on_the_host_and_the_error_names_it():
    """A float argument that needs no gradient is known at call time (the ``float-*`` patterns above, issue
    43); one that requires grad is not, and the refusal names it rather than "the parameters"."""
    model = mlp()

    def step(x):
        if x.sum() > 0:
            x = x * 2
        return model(x).sum()

    with pytest.raises(stagetorch.ConcretizationError, match=r"depends on the argument x \(which requires grad\):"):
        stagetorch.jit(step)(features(0, B, D).requires_grad_())


def test_a_read_of_an_activation_names_the_parameters_it_depends_on():
    model = mlp()

    def step(x, mask):
        h = model(x) * mask[:, None]
        if (h == 0).any():  # the activation: not known at call time
            h = h + 1
        return h.sum()

    with pytest.raises(stagetorch.ConcretizationError) as err:
        stagetorch.jit(step)(features(0, B, D), torch.ones(B))
    msg = str(err.value)
    assert "depends on the parameters model.0.weight, model.0.bias, model.2.weight and 1 more:" in msg, msg
    assert "mask" not in msg.splitlines()[0] and "What to do:" in msg


# -- index_put with per-example values -------------------------------------------------------------------------

INDEX = torch.tensor([0, 2, 4])


def columns_step(model: nn.Module) -> Callable:
    def step(x):
        loss = model(x)[:, INDEX].logsumexp(-1).mean()  # backward: index_put of per-example rows into zeros
        loss.backward()
        return loss

    return step


def assign_into_copy_step(model: nn.Module) -> Callable:
    def step(x):
        h = model(x)
        out = h.clone()
        out[:, INDEX] = h[:, :3] * 2
        loss = out.pow(2).mean()
        loss.backward()
        return loss

    return step


def assign_into_zeros_step(model: nn.Module) -> Callable:
    def step(x):
        h = model(x).view(x.shape[0], CLASSES, 1).expand(-1, -1, 2)
        buffer = torch.zeros(x.shape[0], 7, 2)
        buffer[:, torch.tensor([6, 1, 3])] = h[:, :3]
        loss = buffer.sum(-1).pow(2).mean()
        loss.backward()
        return loss

    return step


@pytest.mark.parametrize("make_step", [columns_step, assign_into_copy_step, assign_into_zeros_step],
                         ids=["logits[:, idx]", "copy[:, idx] = v", "zeros[:, idx] = v"])
@pytest.mark.parametrize("chunks", [1, 3])
def test_index_put_with_per_example_values_equals_eager(make_step, chunks):
    run_against_eager(make_step, mlp, lambda k: (features(k, B, D),), chunks=chunks, steps=3)


def relabel_step(model: nn.Module) -> Callable:
    def step(x, labels):
        labels = labels.clone()
        labels[labels == 2] = -100  # x[mask] = value: an elementwise fill, per example
        loss = F.cross_entropy(model(x), labels, ignore_index=-100)
        loss.backward()
        return loss

    return step


@pytest.mark.parametrize("chunks", [1, 3])
def test_assigning_one_value_through_a_mask_equals_eager(chunks):
    run_against_eager(relabel_step, mlp, lambda k: (features(k, B, D), labels_of(k)), chunks=chunks, steps=3)


# -- a transformers model with LayerDrop -----------------------------------------------------------------------

def bart(dropout: float) -> nn.Module:
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = tf.BartConfig(
        vocab_size=97, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
        encoder_layerdrop=0.5, decoder_layerdrop=0.5, dropout=dropout, attention_dropout=dropout,
        activation_dropout=dropout,
    )
    model = tf.BartForConditionalGeneration(config)
    model.train()
    return model


def opt(dropout: float) -> nn.Module:
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = tf.OPTConfig(
        vocab_size=97, hidden_size=32, num_attention_heads=4, ffn_dim=64, num_hidden_layers=4, word_embed_proj_dim=32,
        max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=1, layerdrop=0.5, dropout=dropout,
    )
    model = tf.OPTForCausalLM(config)
    model.train()
    return model


def seq2seq_batch(k: int) -> tuple[torch.Tensor, ...]:
    ids = torch.randint(3, 97, (6, 12), generator=torch.Generator().manual_seed(k))
    mask = torch.ones_like(ids)
    mask[k % 6, 8:] = 0
    return ids, mask, ids.clone()


@pytest.mark.parametrize(("make_model", "chunks"), [(bart, 1), (bart, 3), (opt, 1)], ids=["BART", "BART-chunked", "OPT"])
def test_transformers_layerdrop_in_training_equals_eager_with_the_same_seed(make_model, chunks):
    """transformers' own LayerDrop (``torch.rand([]) < self.layerdrop``, still so in 5.24). Whole: with the
    model's dropout on (its draws interleave with LayerDrop's). Chunked: dropout draws per chunk, so LayerDrop
    alone."""
    run_against_eager(seq2seq_step, lambda: make_model(0.1 if chunks == 1 else 0.0), seq2seq_batch, chunks=chunks,
                      steps=3 if chunks == 1 else 2, seeds=10)


def test_ctc_with_length_tensors_stages_and_equals_eager():
    """Issue 43: CTC with tensor lengths. Its alignment table's shape follows from its lengths' values, which
    the fake kernel cannot read (a data-dependent shape); its shape rule stages the widest the padded targets
    allow (``ops/losses.py``, ``ctc_loss_shape``), which only the backward reads. It was refused as a host read;
    chunked runs: tests/end_to_end/test_ctc_chunks.py."""
    torch.manual_seed(0)
    model = nn.Linear(5, 6)

    def step(x, targets, input_lengths, target_lengths):
        log_probs = F.log_softmax(model(x), -1).transpose(0, 1)
        loss = F.ctc_loss(log_probs, targets, input_lengths, target_lengths)
        loss.backward()
        return loss

    args = (torch.randn(3, 12, 5), torch.randint(1, 6, (3, 4)), torch.tensor([12, 10, 9]), torch.tensor([4, 2, 3]))
    expected = step(*args).detach()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    got = stagetorch.jit(step)(*args)
    torch.testing.assert_close(got.detach(), expected)
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g)

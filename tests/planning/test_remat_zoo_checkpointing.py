"""Recomputation against transformers' own checkpointing on the zoo's padded tiny configs (issue 44, item 3).

``tests/end_to_end/test_transformers_zoo.py``'s models (2 layers, hidden 32, float64) on their padded batch of 7 x 16
tokens: at a budget of exactly the peak of ``gradient_checkpointing_enable()`` (non-reentrant), measured at the
allocator, ``remat="auto"`` plans, runs within the budget and its own prediction, and three AdamW steps give the
eager step's loss, every ``.grad`` and the parameters after. The per-block checkpoint sets (the ends of each layer
of a ``ModuleList``, and of each layer's attention) are among the frontier's candidates, and the least of them is
no higher than checkpointing's peak. The other zoo models: ``tools/probes/remat_vs_checkpointing.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from memtrack import AllocatorPeak
from transformer_zoo import assert_same, make_batch, make_model, step_of

import stagetorch
from stagetorch.planning.budget import usable
from stagetorch.planning.remat_frontier import block_checkpoints, frontier
from stagetorch.planning.remat_simulator import Simulator, point
from stagetorch.transforms.remat import candidates

pytest.importorskip("transformers")


def _resident(model: torch.nn.Module, batch: dict) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers(), *batch.values()]


def checkpointing_peak(model: torch.nn.Module, batch: dict) -> int:
    """The allocator's peak of the eager step under ``gradient_checkpointing_enable(use_reentrant=False)``, with no
    ``.grad`` before it (after a first step, so that what transformers makes once is made)."""
    step = step_of(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        try:
            step(**batch)
            model.zero_grad(set_to_none=True)
            with AllocatorPeak(_resident(model, batch)) as measured:
                step(**batch)
        finally:
            model.gradient_checkpointing_disable()
            model.zero_grad(set_to_none=True)
    return measured.peak


# The zoo models whose step plans and runs three times within ~5 s each here (2-core VM); the rest, in the probe.
CI = ["bert", "distilbert", "gpt2", "opt", "t5", "vit"]


@pytest.mark.parametrize("name", CI)
def test_remat_auto_fits_at_checkpointings_peak_and_trains_as_eager(name):
    model, reference = make_model(name), make_model(name)
    batch = make_batch(name)
    budget = checkpointing_peak(model, batch)
    staged = stagetorch.jit(step_of(model), memory_budget=budget, remat="auto")
    eager = step_of(reference)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        plan = staged.plan(**batch)
        assert plan.peak <= usable(budget), plan
        with AllocatorPeak(_resident(model, batch)) as measured:
            loss = staged(**batch)
        assert measured.peak <= budget, (measured.peak, budget)
        assert abs(measured.peak - plan.peak) <= 0.02 * plan.peak, (measured.peak, plan)
        assert_same(model, reference, loss, eager(**batch).detach())
        opt.step()
        ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)


def _one_long_example(name: str) -> dict:
    """One example of 96 tokens, its last 26 padding (the zoo's recomputation test): it cannot be chunked."""
    batch = make_batch(name, b=1, s=96, padded=False)
    batch["attention_mask"][0, 70:] = 0
    if batch["labels"].dim() == 2:  # a language model's (a classifier's are one per example)
        batch["labels"][0, 70:] = -100
    return batch


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_the_per_block_sets_peak_below_checkpointing(name):
    """One example of 96 tokens, which cannot be chunked: the least of the per-block sets is below the measured peak
    of checkpointing. (Llama's layer output is read by the next layer's RMSNorm through a float32 copy, so the
    backward never reads it: until the set kept the candidates made from it instead, it kept no boundary between
    layers and recomputed both at once, 1.27x checkpointing's peak.)"""
    model = make_model(name)
    batch = _one_long_example(name)
    ckpt = checkpointing_peak(model, batch)
    graph = stagetorch.jit(step_of(model)).graph(**batch)
    cands = candidates(graph)
    sim = Simulator(graph, cands)
    assert min(point(sim, k).peak_bytes for k in block_checkpoints(graph, cands)) < 0.99 * ckpt


def test_a_decoder_layers_per_block_set_keeps_its_self_attention_output():
    """BART's decoder layer runs two attentions. Per-layer checkpointing (and the per-block set that keeps only the
    layers' ends) rebuilds the layer's self-attention to remake the cross-attention's input, and holds it, mask
    and all, through the cross-attention's backward: 1.04x checkpointing's measured peak, predicted. With the
    self-attention's output kept too, each attention is recomputed just before its own backward: below
    checkpointing's peak, and no higher than any other set of the frontier."""
    model = make_model("bart")
    batch = _one_long_example("bart")
    ckpt = checkpointing_peak(model, batch)
    graph = stagetorch.jit(step_of(model)).graph(**batch)
    cands = candidates(graph)
    sim = Simulator(graph, cands)
    sets = block_checkpoints(graph, cands)
    assert len(sets) == 4
    layers, with_outside, attention, _ = (point(sim, k).peak_bytes for k in sets)
    assert attention < ckpt < with_outside, (attention, ckpt, with_outside)
    assert attention < 0.95 * min(layers, with_outside)
    assert min(p.peak_bytes for p in frontier(graph)) <= attention

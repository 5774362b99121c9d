"""Recomputation on `transformers` models against what their users already have, ``gradient_checkpointing_enable()``.

Tiny configs (``transformer_models``, at 4 layers and 256 tokens here to keep the suite quick: hidden 64,
their own dropout on), one example, float32, CPU; the bench runs 8 layers and 512 tokens. At the smallest budget stagetorch accepts, the step's peak measured at the allocator is at
most transformers' per-layer checkpointing's, and the step is bit for bit the step without recomputation:
loss, every ``.grad`` and the generator's state after it (dropout is recomputed by replaying its draws).
Step times are in ``tools/measure/bench_transformers.py``.
"""

from __future__ import annotations

import pytest
import torch
from transformer_models import (
    MODELS,
    allocator_peak,
    checkpointing,
    model_and_batch,
    smallest_budget,
    step_of,
)

import stagetorch
from stagetorch.planning.remat_search import RematPlan
from stagetorch.transforms.remat import recomputed_eqns
from stagetorch.transforms.rng import ReplayRandom

pytest.importorskip("transformers")

SMALL = dict(layers=4, tokens=256)


def _checkpointed_and_smallest(model, batch):
    """The step, checkpointing's peak at the allocator, and the step staged at its smallest budget with its plan.

    The smallest budget of the step that is measured: one with no .grad yet. (Asked with the checkpointed
    step's .grad still there, the plan counts them as held, since the step adds into them, and the budget
    came out 0.7 MB larger than the measured step needs: that was the "6% above checkpointing" once recorded.)"""
    step = step_of(model)
    with checkpointing(model):
        step(**batch)
        checkpointed = allocator_peak(step, model, batch)
    staged = stagetorch.jit(step)
    model.zero_grad(set_to_none=True)
    staged.memory_budget = smallest_budget(staged, batch)
    return step, checkpointed, staged, staged.plan(**batch)


# Every zoo model with gradient_checkpointing_enable(). (BART's least plan ran 1.045x checkpointing while the
# planner's chain of segments was cut per stack, encoder then decoder, and not per layer: issue 24.)
@pytest.mark.parametrize("name", MODELS)
def test_the_smallest_budget_runs_below_gradient_checkpointing_and_bit_exact(name):
    model, batch = model_and_batch(name, **SMALL)
    step, checkpointed, staged, plan = _checkpointed_and_smallest(model, batch)
    assert isinstance(plan, RematPlan) and plan.peak <= staged.memory_budget
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):  # GPT-2's, BERT's
        assert any(isinstance(e.prim, ReplayRandom) for e in recomputed_eqns(plan.recompute.graph))
    measured = allocator_peak(staged, model, batch)
    assert measured <= checkpointed, (measured, checkpointed)
    assert measured <= staged.memory_budget

    # Bit for bit the step without recomputation, the generator included.
    results = []
    for fn in (staged, stagetorch.jit(step, remat=False)):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(11)
        loss = fn(**batch)
        results.append((loss, [p.grad for p in model.parameters()], torch.get_rng_state()))
    (loss, grads, state), (expected, expected_grads, expected_state) = results
    assert torch.equal(loss, expected) and torch.equal(state, expected_state)
    assert all(map(torch.equal, grads, expected_grads))


def test_an_attention_mask_at_batch_one_recomputes():
    """With an (all-ones) attention_mask, one example stages and recomputes as without (chunking such a batch
    is another matter: the mask functions index by batch position)."""
    model, batch = model_and_batch("Llama", mask=True, **SMALL)
    step = step_of(model)
    staged = stagetorch.jit(step)
    # The smallest budget of the step that is measured: one with no .grad yet. (Asked with the checkpointed
    # step's .grad still there, the plan counts them as held, since the step adds into them, and the budget
    # came out 0.7 MB larger than the measured step needs: that was the "6% above checkpointing" once recorded.)
    model.zero_grad(set_to_none=True)
    staged.memory_budget = smallest_budget(staged, batch)
    assert isinstance(staged.plan(**batch), RematPlan)
    model.zero_grad(set_to_none=True)
    loss = staged(**batch)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    expected = stagetorch.jit(step, remat=False)(**batch)
    assert torch.equal(loss, expected) and all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))


def test_opt_at_a_long_sequence_runs_below_gradient_checkpointing():
    """OPT at the bench's 8 layers x 512 tokens: its least two-level set held a layer's q, k, v and fc1
    outputs, recomputed to rebuild the next layer's input, until that layer's own backward (1.13x
    checkpointing's peak), and its per-layer set held an ``addmm``'s input gradient beside the whole layer's
    recomputation (recomputed before the weight gradient that reads the input, not before the node: 1.02x
    until the descent below the frontier tried ``hoist``)."""
    model, batch = model_and_batch("OPT", layers=8, tokens=512)
    step, checkpointed, staged, plan = _checkpointed_and_smallest(model, batch)
    staged(**batch)
    measured = allocator_peak(staged, model, batch)
    assert measured <= checkpointed, (measured, checkpointed)
    assert abs(measured - plan.peak) <= 0.02 * measured


@pytest.mark.parametrize("name, tokens", [("BERT", 512), ("OPT", 512), ("BART", 512), ("BERT", 256)])
def test_the_smallest_budget_recomputes_about_one_forward_of_the_layers(name, tokens):
    """At the bench's size (8 layers x 512 tokens), the least-peak plan recomputes about what per-layer
    checkpointing does, the layers' forward once: its step is then no slower. (It recomputed 1.62x that for
    BERT and 1.47x for OPT, stepping 1.27x and 1.21x checkpointing's time: the planner's chain and dynamic
    program cut BERT mid-layer, and the descent below the frontier dropped checkpoints for 1% of peak.
    BART's, and BERT's at 256 tokens, was the frontier's least-peak two-level set, 1.15x and 1.08x, until the
    search below the frontier repaired the sets just above it to that peak: 0.87x and 1.00x, at a peak no
    higher.)"""
    from transformers.modeling_layers import GradientCheckpointingLayer

    from stagetorch.interpreters.flops import eqn_flops

    model, batch = model_and_batch(name, tokens=tokens)
    staged = stagetorch.jit(step_of(model))
    graph = staged.graph(**batch)
    layers = [f"model.{n}" for n, m in model.named_modules() if isinstance(m, GradientCheckpointingLayer)]
    assert len(layers) == 8
    forward = sum(eqn_flops(e) for e in graph.eqns if not e.source.backward
                  and any(e.source.module == n or e.source.module.startswith(n + ".") for n in layers))
    staged.memory_budget = smallest_budget(staged, batch)
    plan = staged.plan(**batch)
    assert isinstance(plan, RematPlan) and plan.chunk_sizes == (1,)
    assert plan.extra_flops <= 1.05 * forward, plan.extra_flops / forward


def test_the_frontier_holds_sets_hoisted_where_that_lowers_their_peak():
    """A frontier set recomputed before each autograd node's first equation (``remat(hoist=True)``) where
    that lowers its peak, at the same FLOPs, so that a budget between gets it as it is: OPT at 8 layers x
    256 tokens, whose least-peak sets are lower hoisted (a Linear's recomputed input is not made beside the
    input gradient its node made first). Its smallest budget then recomputes 0.62 of the layers' forward
    (0.88 while only the descent below the frontier tried ``hoist``), at a lower peak."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    from stagetorch.interpreters.flops import eqn_flops
    from stagetorch.interpreters.memory import peak_bytes
    from stagetorch.planning.remat_frontier import frontier
    from stagetorch.planning.remat_simulator import Simulator, point

    model, batch = model_and_batch("OPT", layers=8, tokens=256)
    staged = stagetorch.jit(step_of(model))
    graph = staged.graph(**batch)
    points = frontier(graph)
    hoisted = [p for p in points if p.sim is not None and p.sim.hoist]
    assert hoisted
    plain = Simulator(graph, points[1].cands)
    for p in hoisted:
        assert point(plain, p.keep, p.transient).peak_bytes > p.peak_bytes
        assert peak_bytes(p.graph) == p.peak_bytes  # the pass recomputes as the simulator costed it
    layers = [f"model.{n}" for n, m in model.named_modules() if isinstance(m, GradientCheckpointingLayer)]
    forward = sum(eqn_flops(e) for e in graph.eqns if not e.source.backward
                  and any(e.source.module == n or e.source.module.startswith(n + ".") for n in layers))
    staged.memory_budget = smallest_budget(staged, batch)
    plan = staged.plan(**batch)
    assert plan.extra_flops <= 0.7 * forward, plan.extra_flops / forward

"""FSDP2 (``fully_shard``) under ``jit(process_group=)``, on gloo processes, against one process on the global batch.

Each rank shards its own copy of a model (a float64 MLP whose layers' rows do not divide by the group's size,
so FSDP2 pads them; tiny transformers models on padded, attention-masked sequences: GPT-2 with tied
embeddings, Llama with grouped-query attention and rotary positions, BERT as a masked LM) with
``fully_shard`` per layer or block and at the root, takes its shard of a global batch (sizes uneven, one
rank possibly empty), and runs three AdamW steps under ``stagetorch.jit(step, memory_budget=..., process_group=)``
with a budget below the step's unchunked peak. The same rank also runs a plain copy of the model on the whole
global batch eagerly: the losses and the parameters (gathered from the shards) must agree to float rounding.
Every rank's allocator peak (the profiler's allocation events) must lie under its plan and its budget. A
deeper MLP at the smallest budget recomputes; every case counts which gradients were reduce-scattered as
partial sums. The refusals (jit without process_group=, mixed precision, lazy on a fully_shard-ed model)
leave the shards and their .grad as they were.
"""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from gloo_workers import result, spawn
from memtrack import AllocatorPeak

import stagetorch
from stagetorch.parallel.fsdp import Units

CASES = {}
# How gloo_workers.spawn runs the cases: each gets the world size; 30 s for a collective and 180 s for each
# case's result; the time each took; a barrier before the processes leave the group.
LAUNCH = {"argument": "world", "collective_timeout": 30, "result_timeout": 180, "timed": True, "barrier": True}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 33), nn.Tanh(), nn.Linear(33, 17), nn.Tanh(), nn.Linear(17, 5)).double()


def gpt2() -> nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.GPT2Config(vocab_size=97, n_embd=32, n_head=4, n_layer=2, n_positions=16, bos_token_id=0,
                           eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return tf.GPT2LMHeadModel(config).double().train()


def deep_mlp() -> nn.Module:
    """Deeper and narrower than mlp(), for examples of 512 rows: a chunk of one example's activations dwarf
    the parameters (whose gradients' reduce-scatter is a floor no chunking or recompute lowers)."""
    torch.manual_seed(0)
    layers = [nn.Linear(7, 32), nn.Tanh()]
    for _ in range(4):
        layers += [nn.Linear(32, 32), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(32, 5)).double()


def llama() -> nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                            bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
    return tf.LlamaForCausalLM(config).double().train()


def bert() -> nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0, pad_token_id=0)
    return tf.BertForMaskedLM(config).double().train()


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The units fully_shard makes below the root: each decoder block or encoder layer, each Linear."""
    if hasattr(model, "transformer"):  # GPT-2
        return list(model.transformer.h)
    if hasattr(model, "bert"):
        return list(model.bert.encoder.layer)
    if hasattr(model, "model"):  # Llama
        return list(model.model.layers)
    return [m for m in model if isinstance(m, nn.Linear)]


def shard_model(model: nn.Module, reshard_after_forward: bool) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in _blocks(model):
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    return fully_shard(model, reshard_after_forward=reshard_after_forward)


def mlp_batch(n: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    # 48 rows an example: the activations, not the parameters, are what a budget below the peak must cut.
    return torch.randn(n, 48, 7, dtype=torch.float64, generator=g), torch.randint(0, 5, (n, 48), generator=g)


def gpt2_batch(n: int) -> tuple[torch.Tensor, ...]:
    """Token ids, an attention mask and labels: sequences right-padded after a random length (labels -100)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 97, (n, 16), generator=g)
    lengths = torch.randint(4, 17, (n, 1), generator=g)
    mask = (torch.arange(16).expand(n, 16) < lengths).long()
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def long_batch(n: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 512, 7, dtype=torch.float64, generator=g), torch.randint(0, 5, (n, 512), generator=g)


def bert_batch(n: int) -> tuple[torch.Tensor, ...]:
    """gpt2_batch's padded sequences, a third of the real tokens masked ([MASK] = 1) and labelled (-100 else)."""
    ids, mask, _ = gpt2_batch(n)
    g = torch.Generator().manual_seed(2)
    picked = (torch.rand(ids.shape, generator=g) < 0.34) & (mask == 1)
    picked[:, 0] = True  # every sequence has a label
    labels = ids.masked_fill(~picked, -100)
    return ids.masked_fill(picked, 1), mask, labels


def mlp_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def gpt2_loss(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=mask, labels=labels).loss


# The transformers models' loss reads the same keywords (input_ids, attention_mask, labels).
MODELS = {"mlp": (mlp, mlp_batch, mlp_loss), "deep_mlp": (deep_mlp, long_batch, mlp_loss),
          "gpt2": (gpt2, gpt2_batch, gpt2_loss),
          "llama": (llama, gpt2_batch, gpt2_loss), "bert": (bert, bert_batch, gpt2_loss)}


def train(name: str, sizes: list[int], reshard_after_forward: bool, smallest_budget: bool = False) -> dict:
    """Three AdamW steps of the FSDP2 model under jit (each rank its shard of ``sizes``), and of a plain copy
    on the whole batch; the budget of every rank with examples is halfway between the smallest it fits
    (chunks of one example) and its unchunked plan's peak, or (``smallest_budget``) that smallest."""
    make, batch, loss_fn = MODELS[name]
    rank = dist.get_rank()
    reference = make()
    model = shard_model(copy.deepcopy(reference), reshard_after_forward)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    whole = batch(sum(sizes))
    mine = tuple(t.split(sizes)[rank] for t in whole)

    def step(*args):
        loss = loss_fn(model, *args)
        loss.backward()
        return loss

    # GPT-2 with remat=False: chunks alone (the joint planner's search for recompute sets on GPT-2 takes most
    # of a minute on a CI core); the MLP's planner may recompute (the default), and chooses chunks.
    staged = stagetorch.jit(step, process_group=dist.group.WORLD, memory_budget=2**40,
                            remat="auto" if "mlp" in name else False)
    unchunked = staged.plan(*mine)
    staged.memory_budget, smallest = 1024, None
    try:
        staged.plan(*mine)
    except stagetorch.errors.OutOfMemoryError as e:
        smallest = e.smallest_budget  # this rank's (None on an empty rank, which fits any budget)
    if smallest is not None:  # the smallest budget the error names fits (the reduce-scatter's floor too)
        staged.memory_budget = smallest
        staged.plan(*mine)
    # (A rank of one example fits no less than its whole shard: there the smallest budget, its safety margin in.)
    staged.memory_budget = (unchunked.peak if smallest is None else smallest if smallest_budget
                            else max(smallest, (smallest + unchunked.peak) // 2))
    out = {"losses": [], "ref_losses": [], "peaks": [], "budget": staged.memory_budget,
           "unchunked": unchunked.peak, "unchunked_chunks": unchunked.chunk_sizes}
    plan = staged.plan(*mine)
    out["chunks"] = plan.chunk_sizes
    out["recomputes"] = getattr(plan, "recompute", None) is not None
    if smallest_budget:  # the smallest budget chunks alone fit: above this one
        alone = stagetorch.jit(step, process_group=dist.group.WORLD, memory_budget=1024, remat=False)
        try:
            alone.plan(*mine)
        except stagetorch.errors.OutOfMemoryError as e:
            out["chunks_alone_fit"] = e.smallest_budget
    out["planned"] = plan.peak
    # How many of FSDP2's gradients each step reduce-scatters as partial sums, and how many come back whole
    # (all-reduced by the chunk loop's merge, each rank cutting its rows): counted where they are scattered.
    out["partial_and_whole"] = counts = []
    scatter_all = Units.scatter_all

    def counted(self, grads):
        counts.append((sum(1 for *_, partial in grads if partial), sum(1 for *_, partial in grads if not partial)))
        return scatter_all(self, grads)

    Units.scatter_all = counted
    for i in range(3):
        opt.zero_grad()
        shards = [p.to_local() for p in model.parameters()]
        # The allocator's peak of the first and the last step (the profiler is slow: not every step).
        with AllocatorPeak([*shards, *mine]) if i != 1 else contextlib.nullcontext() as tracker:
            loss = staged(*mine)
        if i != 1:
            out["peaks"].append(tracker.peak)
        opt.step()
        out["losses"].append(loss.item())
        ref_opt.zero_grad()
        ref_loss = loss_fn(reference, *whole)
        ref_loss.backward()
        ref_opt.step()
        out["ref_losses"].append(ref_loss.item())
    Units.scatter_all = scatter_all
    out["params"] = [p.full_tensor().detach().numpy() for p in model.parameters()]  # a collective, in order
    out["ref_params"] = [p.detach().numpy() for p in reference.parameters()]
    out["memory"] = str(staged.fsdp_memory)
    out["float64_loss"] = loss.dtype == torch.float64
    return out


@case
def mlp_reshard(world: int) -> dict:
    return train("mlp", [11, 19] if world == 2 else [5, 9, 0, 13], True)


@case
def mlp_keep_and_empty_rank(world: int) -> dict:
    return train("mlp", [24, 0] if world == 2 else [8, 0, 7, 9], False)


@case
def mlp_recompute(world: int) -> dict:
    """At the smallest budget each rank fits, which the planner reaches only by recomputing activations in
    the backward (chunks alone need more: test_recompute_under_fsdp2)."""
    return train("deep_mlp", [3, 2], True, smallest_budget=True) if world == 2 else {}


@case
def gpt2_reshard(world: int) -> dict:
    return train("gpt2", [3, 5] if world == 2 else [2, 3, 0, 3], True)


@case
def gpt2_keep(world: int) -> dict:
    return train("gpt2", [5, 2], False) if world == 2 else {}


@case
def llama_reshard(world: int) -> dict:
    return train("llama", [3, 5], True) if world == 2 else {}


@case
def bert_reshard(world: int) -> dict:
    return train("bert", [5, 3], True) if world == 2 else {}


@case
def accumulates(world: int) -> dict:
    """Three steps without zero_grad (the second with the same shards, the third with half of each: staged
    again), no optimizer: the sharded .grad is the sum of the three global batches' gradients."""
    reference = mlp()
    model = shard_model(copy.deepcopy(reference), True)
    sizes = [5, 9]
    whole = mlp_batch(sum(sizes))
    mine = tuple(t.split(sizes)[dist.get_rank()] for t in whole)
    halves = tuple(torch.cat([part[: len(part) // 2] for part in t.split(sizes)]) for t in whole)

    def step(x, y):
        loss = mlp_loss(model, x, y)
        loss.backward()
        return loss

    staged = stagetorch.jit(step, process_group=dist.group.WORLD)
    staged(*mine)
    staged(*mine)
    staged(*(t[: len(t) // 2] for t in mine))
    for batch in (whole, whole, halves):
        mlp_loss(reference, *batch).backward()
    return {"grads": [p.grad.full_tensor().numpy() for p in model.parameters()],
            "ref_grads": [p.grad.numpy() for p in reference.parameters()]}


@case
def refusals(world: int) -> dict:
    """Refused by name, on every rank, before anything changes: a fully_shard-ed model under jit without
    process_group=, one whose MixedPrecisionPolicy gathers its parameters in another dtype, and the one-line
    mode (lazy) on fully_shard-ed models."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = shard_model(mlp(), True)
    mixed = mlp().float()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for layer in mixed:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mp_policy=policy)
    fully_shard(mixed, mp_policy=policy)
    x, y = mlp_batch(4)
    out = {}
    for name, net, kwargs, args in [("no_group", model, {}, (x, y)),
                                    ("mixed", mixed, {"process_group": dist.group.WORLD}, (x.float(), y))]:
        def step(x, y, net=net):
            loss = mlp_loss(net, x, y)
            loss.backward()
            return loss

        try:
            stagetorch.jit(step, **kwargs)(*args)
            out[name] = None
        except stagetorch.errors.UnsupportedOpError as e:
            out[name] = str(e)
        out[name + "_untouched"] = all(p.grad is None for p in net.parameters())
    out.update(lazy_refusals(model, x, y))
    return out


class KeywordsOnly(nn.Module):
    """The MLP called with keywords alone (as transformers models are: model(input_ids=...))."""

    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, *, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def lazy_refusals(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    """The one-line mode on fully_shard-ed models (with and without process_group=; the batch positional or
    a keyword): refused by name at the call, before FSDP2's hooks gather anything: the shards, their .grad
    and FSDP2's state unchanged (the model then trains eagerly as before)."""
    from torch.distributed.fsdp import fully_shard

    keywords = KeywordsOnly()
    for layer in keywords.net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(keywords)
    out = {}
    for name, net, kwargs, call in [
        ("lazy", model, {"process_group": dist.group.WORLD}, lambda net, lx: net(lx)),
        ("lazy_no_group", model, {}, lambda net, lx: net(lx)),
        ("lazy_keywords", keywords, {"process_group": dist.group.WORLD}, lambda net, lx: net(x=lx)),
    ]:
        before = [p.to_local().clone() for p in net.parameters()]
        try:
            lx, ly = stagetorch.lazy(x, y, memory_budget="1GiB", **kwargs)
            F.cross_entropy(call(net, lx).flatten(0, 1), ly.flatten()).backward()
            out[name] = None
        except stagetorch.errors.UnsupportedOpError as e:
            out[name] = str(e)
        out[name + "_untouched"] = (all(p.grad is None for p in net.parameters())
                                    and all(torch.equal(b, p.to_local()) for b, p in zip(before, net.parameters())))
        # FSDP2's state as it was: an eager step (its own all-gathers and reduce-scatter) runs and fills .grad.
        F.cross_entropy(call(net, x).flatten(0, 1), y.flatten()).backward()
        out[name + "_eager_after"] = all(p.grad is not None for p in net.parameters())
        net.zero_grad(set_to_none=True)
    return out


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> dict:
    return spawn(str(tmp_path_factory.mktemp("fsdp2") / "store"), 2, CASES, **LAUNCH)


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> dict:
    return spawn(str(tmp_path_factory.mktemp("fsdp4") / "store"), 4, CASES, ["mlp_reshard"], **LAUNCH)


def check_exact_and_within(got: dict) -> None:
    """The global batch's losses and parameters after three AdamW steps, to float64 rounding; the measured
    peak (of the last step) under the plan and the plan under the budget, which is below the unchunked peak."""
    # transformers computes the loss in float32 (its logits cast up to float, here down): to that rounding.
    np.testing.assert_allclose(got["losses"], got["ref_losses"], rtol=1e-12 if got["float64_loss"] else 1e-6)
    for p, q in zip(got["params"], got["ref_params"], strict=True):
        np.testing.assert_allclose(p, q, rtol=1e-9, atol=1e-12)
    if sum(got["chunks"]):
        # Under a budget below its unchunked peak, a rank with examples runs them in chunks, or recomputes.
        assert got["budget"] < got["unchunked"], (got["budget"], got["unchunked"])
        assert len(got["chunks"]) > 1 or got["recomputes"], got["chunks"]
    first, last = got["peaks"]
    assert got["planned"] <= got["budget"] and first <= got["budget"] and last <= got["budget"], got
    # The plan counts the largest unit's all-gather output and, on gloo, one copy of a reduce-scatter input:
    # measured 0.64-1.0 of the plan on torch 2.13 (an empty rank's plan is a chunk of one's). The measurement
    # cannot see a free made on gloo's worker thread (it drops the last reference to a collective's buffer
    # when it finishes after the caller): memtrack's AllocatorPeak drops such a block when its address is
    # allocated again, not before, so phantoms can remain at the peak: measured up to 1.10x on torch 2.11,
    # where storage weak references show every all-gather output freed when unshard() returns. Within 15%
    # here, and under the budget always (the assertion above).
    assert max(first, last) <= got["planned"] * 1.15, (got["peaks"], got["planned"], got["memory"])


@pytest.mark.parametrize("name", ["mlp_reshard", "mlp_keep_and_empty_rank", "gpt2_reshard", "gpt2_keep",
                                  "llama_reshard", "bert_reshard"])
@pytest.mark.parametrize("rank", [0, 1])
def test_two_ranks_exact_within_budget(two, name, rank):
    got = result(two, name, rank)
    check_exact_and_within(got)


# Every gradient is reduce-scattered as this rank's partial sum, also those the step makes after the chunk
# loop by a transpose or a view of its sum (a Linear's weight and bias), but where the post phase adds two
# sums: GPT-2's and BERT's tied embedding and output weights, and one more each (all-reduced whole then, each
# rank cutting its rows: the same result). Before, the merge all-reduced every transposed or viewed gradient
# whole (the MLP's 6 of 6, Llama's 20 of 21, BERT's 29 of 42), its flat buffer live where Llama's and BERT's
# peaks reached 1.06x and 1.11x their plans (as measured then: the profiler's missed frees included).
WHOLE = {"mlp_reshard": 0, "mlp_keep_and_empty_rank": 0, "mlp_recompute": 0, "gpt2_reshard": 2, "gpt2_keep": 2,
         "llama_reshard": 0, "bert_reshard": 2}


@pytest.mark.parametrize("name", list(WHOLE))
@pytest.mark.parametrize("rank", [0, 1])
def test_gradients_reduce_scattered_as_partial_sums(two, name, rank):
    counts = result(two, name, rank)["partial_and_whole"]
    assert len(counts) == 3 and all(whole == WHOLE[name] and partial > 0 for partial, whole in counts), counts


@pytest.mark.parametrize("rank", [0, 1])
def test_recompute_under_fsdp2(two, rank):
    """A budget below what chunks alone fit: the plan recomputes, and is exact and within it."""
    got = result(two, "mlp_recompute", rank)
    assert got["recomputes"] and got["budget"] < got["chunks_alone_fit"], got
    check_exact_and_within(got)


# Four ranks run the MLP alone (uneven shards, one rank empty): GPT-2 on four processes passed too, but their
# four imports of transformers on CI's two cores take most of this file's time budget.
@pytest.mark.parametrize("name", ["mlp_reshard"])
@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_four_ranks_exact_within_budget(four, name, rank):
    check_exact_and_within(result(four, name, rank))


@pytest.mark.parametrize("rank", [0, 1])
def test_gradients_accumulate_into_the_shards(two, rank):
    got = result(two, "accumulates", rank)
    for g, e in zip(got["grads"], got["ref_grads"], strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("rank", [0, 1])
def test_refused_by_name(two, rank):
    got = result(two, "refusals", rank)
    assert got["no_group"] is not None and "fully_shard" in got["no_group"] and "process_group=" in got["no_group"]
    assert got["mixed"] is not None and "MixedPrecisionPolicy" in got["mixed"] and "What to do" in got["mixed"]
    assert got["no_group_untouched"] and got["mixed_untouched"]
    for name, module in [("lazy", "Sequential"), ("lazy_no_group", "Sequential"), ("lazy_keywords", "KeywordsOnly")]:
        message = got[name]
        assert message is not None, name
        assert "stagetorch.lazy" in message and "fully_shard" in message and f"a {module} sharded" in message, message
        assert "What to do" in message and "stagetorch.jit(step, process_group=" in message, message
        assert got[name + "_untouched"] and got[name + "_eager_after"], name

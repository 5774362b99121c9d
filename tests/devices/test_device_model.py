"""Planning for a GPU by name from any machine (issue 44): the device table, steps staged on fake CUDA tensors
(real CPU inputs, CPU and meta-device modules), the planner's CUDA branch with the card's caching allocator and
cuBLAS workspace (no monkeypatch of ``on_cuda``), ``stagetorch.memory(step, device=...)``'s report, and the
refusal to run a step planned for a card this process does not have. No test here needs a GPU.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

import stagetorch
from stagetorch.devices.catalog import (
    Device,
    PlanOnlyDeviceError,
    UnknownDeviceError,
    cublas_workspace,
    device_named,
    known_devices,
)
from stagetorch.interpreters.memory import peak_bytes
from stagetorch.planning.chunks import plan_chunks
from stagetorch.planning.reserved import on_cuda, predict_reserved, uses_cublas

MiB, GiB = 2**20, 2**30
TRACE = Path(__file__).parents[1] / "support" / "data" / "cuda-traces" / "gpt2-124M-16x512-chunked-h200.trace.json.gz"


def mlp_step(width: int = 2048):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))

    def step(x, y):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    return model, step, (torch.randn(512, 256), torch.randint(0, 4, (512,)))


def tiny_gpt2(meta: bool = False):
    """transformers' GPT-2 (4 layers, 64 wide), labels padded with -100, and its step."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=512, n_positions=128, n_embd=64, n_layer=4, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    if meta:
        with torch.device("meta"):
            model = GPT2LMHeadModel(config)
    else:
        model = GPT2LMHeadModel(config)

    def step(ids, labels):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        return loss

    ids = torch.randint(0, 512, (16, 128))
    labels = ids.clone()
    labels[:, 100:] = -100
    return model, step, (ids, labels)


# -- the table ---------------------------------------------------------------------------------------------


def test_the_table_knows_the_common_gpus_and_their_figures():
    assert {"H100-80GB", "H100-94GB", "H200", "A100-40GB", "A100-80GB", "L4", "A10G", "RTX-4090", "RTX-3090", "T4",
            "V100-16GB", "V100-32GB"} <= set(known_devices())
    h100, t4, h200 = device_named("H100-80GB"), device_named("T4"), device_named("H200")
    assert h100.capability == (9, 0) and t4.capability == (7, 5)
    assert h200.capacity_bytes == pytest.approx(139.8 * GiB, rel=1e-3)  # as torch reported it on the project's H200
    assert h100.workspace_bytes == 32 * MiB and t4.workspace_bytes == 4 * MiB  # Hopper's measured 32 MiB
    assert h100.fraction == 1.0 and h100.allocator == {} and not h100.local
    assert h100.usable_bytes == h100.capacity_bytes - h100.context_bytes
    assert 0 < h100.context_bytes < GiB  # an estimate, said so in the module


@pytest.mark.parametrize("spelled", ["h100-80gb", "H100 80GB", "H100_80GB", "nvidia h100 80gb", "H100"])
def test_a_name_is_found_whatever_its_case_spaces_and_dashes(spelled):
    assert device_named(spelled).name == "H100-80GB"


def test_an_unknown_name_is_a_named_error_listing_the_known_ones():
    with pytest.raises(UnknownDeviceError, match="no GPU named 'B200'") as e:
        device_named("B200")
    assert "H100-80GB" in str(e.value) and "T4" in str(e.value) and "What to do" in str(e.value)
    with pytest.raises(UnknownDeviceError):
        stagetorch.jit(lambda x: x, device="GTX-970")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_means_this_processs_own_gpu_and_says_when_there_is_none():
    with pytest.raises(UnknownDeviceError, match="torch sees none"):
        device_named("cuda")


def test_allocator_settings_fraction_and_cublas_config():
    dev = device_named("A100-40GB", "expandable_segments:True")
    assert dev.allocator == {"expandable_segments": True}
    assert dev.with_fraction(0.5).usable_bytes == int(0.5 * dev.capacity_bytes)
    assert cublas_workspace((9, 0), {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == 32 * MiB
    assert cublas_workspace((8, 0), {"CUBLAS_WORKSPACE_CONFIG": ":4096:2:16:8"}) == 8 * MiB + 128 * 1024
    with pytest.raises(ValueError):
        Device("x", GiB, 0, (8, 0), fraction=1.5)


# -- staging on fake CUDA tensors --------------------------------------------------------------------------


def test_a_step_for_a_named_device_is_staged_on_fake_cuda_tensors_and_leaves_real_state_alone():
    model, step, args = mlp_step()
    before = [p.detach().clone() for p in model.parameters()]
    staged = stagetorch.jit(step, device="H100-80GB")
    graph = staged.graph(*args)
    assert graph.device.type == "cuda" and on_cuda(graph)
    assert {v.aval.device.type for v in graph.vars()} == {"cuda"}
    assert uses_cublas(graph)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_calling_a_step_planned_for_a_card_this_process_lacks_is_refused_by_name():
    model, step, args = mlp_step()
    staged = stagetorch.jit(step, device="T4")
    with pytest.raises(PlanOnlyDeviceError, match="can be planned and reported, not run"):
        staged(*args)
    assert all(p.grad is None for p in model.parameters())


def test_a_model_built_on_the_meta_device_is_planned_without_its_weights():
    _, real_step, args = tiny_gpt2()
    _, meta_step, _ = tiny_gpt2(meta=True)
    real = stagetorch.jit(real_step, device="T4", remat=False).plan(*args)
    meta = stagetorch.jit(meta_step, device="T4", remat=False).plan(*args)
    assert meta.chunk_sizes == real.chunk_sizes and meta.peak == real.peak
    assert meta.reserved_bytes == real.reserved_bytes is not None


# -- the planner's CUDA branch ----------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["H100-80GB", "T4"])
def test_chunks_are_sized_so_reserved_bytes_with_the_cublas_workspace_fit_the_budget(device):
    """No monkeypatch: the graph is on (fake) CUDA. Under a budget between the smallest plan and the whole
    batch, the chunks are the largest whose predicted reserved bytes (inputs, the card's cuBLAS workspace, the
    step) fit; one example more per chunk would not."""
    _, step, args = tiny_gpt2()
    dev = device_named(device)
    whole = stagetorch.jit(step, device=device, remat=False).plan(*args)
    assert whole.chunk_sizes == (16,) and whole.reserved_bytes >= whole.peak + dev.workspace_bytes
    budget = int(0.55 * whole.reserved_bytes)
    staged = stagetorch.jit(step, memory_budget=budget, device=device, remat=False)
    plan = staged.plan(*args)
    planner = staged._stage(args, {})[0].executable.planner
    assert plan.chunked and planner.device == dev
    reserved = predict_reserved(planner.graph, plan.chunk_sizes, planner.split(), workspace=dev.workspace_bytes)
    assert reserved.max_reserved == plan.reserved_bytes <= plan.budget_bytes
    assert "cuBLAS workspace included" in plan.reason
    # The tensors alone allow chunks at least this large; where they allow larger ones, the next larger chunk's
    # plan is predicted to reserve more than the budget.
    def chunks(cap):
        return plan_chunks(planner.graph, planner.split, 16, budget, peak_bytes, planner._full_peak, cap=cap)

    by_tensors = max(chunks(None).chunk_sizes)
    assert max(plan.chunk_sizes) <= by_tensors
    larger = next((chunks(c) for c in range(max(plan.chunk_sizes) + 1, by_tensors + 1)
                   if chunks(c).chunk_sizes != plan.chunk_sizes), None)
    if larger is not None:  # the next larger chunking the tensors allow reserves more than the budget
        assert predict_reserved(planner.graph, larger.chunk_sizes, planner.split(),
                                workspace=dev.workspace_bytes).max_reserved > budget


def test_the_same_step_planned_for_two_cards_differs_only_where_the_cards_do():
    """The graph, its tensors' peak and the chunks a budget allows by tensors are the card's own business only
    through the cuBLAS workspace (32 MiB on Hopper, 4 MiB on a T4) and the allocator settings."""
    _, step, args = tiny_gpt2()
    h100 = stagetorch.jit(step, device="H100-80GB", remat=False)
    t4 = stagetorch.jit(step, device="T4", remat=False)
    a, b = h100.plan(*args), t4.plan(*args)
    assert str(h100.graph(*args)) == str(t4.graph(*args))
    assert a.peak == b.peak and a.chunk_sizes == b.chunk_sizes == (16,)
    # Only the workspaces differ: 32 MiB takes a segment of its own, 4 MiB is cut from a 20 MiB segment whose
    # rest the step reuses.
    assert 0 < a.reserved_bytes - b.reserved_bytes <= 28 * MiB
    planners = [s._stage(args, {})[0].executable.planner for s in (h100, t4)]
    without = [predict_reserved(p.graph, (16,)).max_reserved for p in planners]
    assert without[0] == without[1]
    assert a.reserved_bytes == predict_reserved(planners[0].graph, (16,), workspace=32 * MiB).max_reserved
    assert b.reserved_bytes == predict_reserved(planners[1].graph, (16,), workspace=4 * MiB).max_reserved
    assert a.budget_bytes == device_named("H100-80GB").usable_bytes and b.budget_bytes == device_named("T4").usable_bytes
    expandable = stagetorch.jit(step, device=device_named("T4", "expandable_segments:True"), remat=False).plan(*args)
    assert expandable.peak == b.peak and expandable.reserved_bytes <= b.reserved_bytes
    planner = stagetorch.jit(step, device=device_named("T4", "expandable_segments:True"), remat=False)
    planner.plan(*args)
    assert planner._stage(args, {})[0].executable.planner.device.allocator == {"expandable_segments": True}


def test_a_budget_above_the_card_is_planned_as_the_card():
    _, step, args = mlp_step()
    plan = stagetorch.jit(step, memory_budget="100GiB", device="T4").plan(*args)
    assert plan.budget_bytes == device_named("T4").usable_bytes


def test_the_h200_trace_step_planned_for_the_h200_by_name_predicts_its_reserved_bytes():
    """GPT-2 124M (16 x 512, fp32) built on the meta device, planned for "H200" under the trace's 4 GiB from
    this CPU-only machine: the chunks the H200 ran, and the reserved bytes the H200's allocator held, to the byte
    (the 32 MiB cuBLAS workspace now counted by the planner itself)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    with gzip.open(TRACE) as f:
        trace = json.load(f)
    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    x = torch.zeros(16, 512, dtype=torch.long)

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    plan = stagetorch.jit(step, memory_budget=trace["budget_bytes"], device="H200", remat=False).plan(x)
    assert plan.chunk_sizes == tuple(trace["plan_chunk_sizes"])
    assert plan.peak == pytest.approx(trace["plan_peak"], rel=1e-3)
    assert plan.reserved_bytes == pytest.approx(trace["max_reserved"], rel=0.01)
    assert plan.reserved_bytes >= trace["max_reserved"] * 0.999


# -- the report --------------------------------------------------------------------------------------------


def test_memory_with_a_device_reports_allocated_reserved_and_the_largest_batches():
    _, step, args = mlp_step()
    report = stagetorch.memory(step, device="T4", memory_budget="200MiB")(*args)
    fit = report.device
    assert fit.device.name == "T4" and fit.batch == 512 and fit.budget_bytes == 200 * MiB
    assert fit.max_reserved_bytes >= fit.max_allocated_bytes >= report.peak_bytes
    assert fit.workspace_bytes == 4 * MiB
    # At the largest batch said to fit whole, the planner runs it whole, its reserved bytes within the budget;
    # at a quarter more, it does not.
    def plan_at(b):
        x = torch.randn(b, 256)
        y = torch.randint(0, 4, (b,))
        return stagetorch.jit(step, device="T4", memory_budget="200MiB", remat=False).plan(x, y)

    at = plan_at(fit.largest_whole)
    assert fit.largest_whole > 512 and at.chunk_sizes == (fit.largest_whole,) and at.reserved_bytes <= 200 * MiB
    assert plan_at(fit.largest_whole * 5 // 4).chunked
    assert fit.largest_chunked >= fit.largest_recomputing >= fit.largest_whole
    assert not isinstance(fit.plan, Exception) and fit.plan.chunk_sizes == (512,)
    text = str(report)
    assert "max reserved" in text and "Largest batch that fits" in text and "T4" in text


def test_memory_with_a_device_on_a_meta_gpt2_under_a_small_budget_gives_the_chunked_plan():
    _, step, args = tiny_gpt2(meta=True)
    whole = stagetorch.jit(step, device="H100-80GB", remat=False).plan(*args)
    report = stagetorch.memory(step, device="H100-80GB", memory_budget=int(0.6 * whole.reserved_bytes),
                               remat=False)(*args)
    fit = report.device
    assert fit.max_reserved_bytes > fit.budget_bytes  # whole, it does not fit
    assert fit.largest_whole is not None and fit.largest_whole < 16
    assert fit.plan.chunked and fit.plan.reserved_bytes <= fit.budget_bytes
    assert fit.largest_chunked > 16


def _gqa_llama_step():
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                                      attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)

    def step(ids: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    return step


def test_a_named_card_stages_attention_with_the_kernel_cuda_picks_for_it():
    """Grouped-query attention in float32: CPU's flash kernel keeps no attention weights, CUDA (torch 2.11-2.13)
    takes the math path and keeps the [B, H, L, L] weights and softmax for the backward; in bfloat16 on sm80+ it
    takes flash. The plan for a card follows the card's kernel, not the host's."""
    step = _gqa_llama_step()
    ids = torch.randint(0, 256, (2, 256))
    cpu = stagetorch.memory(step)(ids).peak_bytes
    card = stagetorch.memory(step, device="H100-80GB")(ids).peak_bytes
    weights = 2 * 8 * 256 * 256 * 4  # one layer's [B, H, L, L] float32 attention weights
    assert card >= cpu + weights, (card, cpu)


def test_cuda_autocast_planned_for_a_card_on_a_torch_without_a_gpu_is_refused_by_name():
    """On CPU fake tensors CUDA's autocast casts nothing but attention: the step would fail on mixed dtypes or
    be planned at float32's bytes. Refused by name, with what to do, and the same step without autocast plans."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the trace runs on fake CUDA tensors, which CUDA's autocast casts")
    import transformers

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64,
                                                                 n_positions=32, bos_token_id=1, eos_token_id=2))

    def step(ids: torch.Tensor, autocast: bool) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    ids = torch.randint(0, 64, (2, 32))
    with pytest.raises(stagetorch.UnsupportedOpError, match=r"autocast\('cuda'\)[\s\S]*What to do"):
        stagetorch.jit(step, device="H100-80GB", static_argnums=(1,)).plan(ids, True)
    assert stagetorch.jit(step, device="H100-80GB", static_argnums=(1,)).plan(ids, False).chunk_sizes == (2,)

"""The model of PyTorch's CUDA caching allocator (stagetorch.devices.cuda_allocator), on CPU.

Ground truth: a real allocator trace of a chunked GPT-2 124M step on an H200 (tests/support/data/cuda-traces/, see its
README), and hand-worked cases of each rule of ``c10/cuda/CUDACachingAllocator.cpp``.
"""

from __future__ import annotations

import bisect
import copy
import gzip
import json
from pathlib import Path

import memtrack
import models
import pytest
import torch
from memtrack import budget_between

import stagetorch
import stagetorch.planning.planner as planner_module
from stagetorch.devices.cuda_allocator import (
    AllocatorOutOfMemory,
    CachingAllocatorModel,
    allocator_settings,
    replay,
    rounded,
    segment_size,
)
from stagetorch.interpreters.memory import allocation_events
from stagetorch.ir import Var
from stagetorch.planning.reserved import predict_reserved, resident_events

MiB = 1 << 20
TRACE = Path(__file__).parents[1] / "support" / "data" / "cuda-traces" / "gpt2-124M-16x512-chunked-h200.trace.json.gz"


# -- the real trace ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trace() -> dict:
    with gzip.open(TRACE) as f:
        return json.load(f)


def gpt2_parameter_bytes(layers: int = 12, width: int = 768, vocab: int = 50257, positions: int = 1024) -> list[int]:
    """The bytes of GPT2LMHeadModel's fp32 parameters in the order ``model.to("cuda")`` moves them (module by
    module, each module's own parameters; lm_head's weight is wte's)."""
    block = [width, width, width * 3 * width, 3 * width, width * width, width,  # ln_1, attn.c_attn, attn.c_proj
             width, width, width * 4 * width, 4 * width, 4 * width * width, width]  # ln_2, mlp.c_fc, mlp.c_proj
    return [4 * n for n in [vocab * width, positions * width, *block * layers, width, width]]


def resident_model(trace: dict, addresses: list[int] = ()) -> CachingAllocatorModel:
    """A model holding what the trace's process held before the call: GPT-2's parameters moved to the GPU,
    then the 16 x 512 int64 input ids."""
    model = CachingAllocatorModel(addresses=addresses)
    for nbytes in gpt2_parameter_bytes():
        model.alloc(nbytes)
    model.alloc(16 * 512 * 8)
    assert model.allocated == trace["resident_before_call"]
    return model


def resident_segments(trace: dict) -> dict[int, tuple[int, int]]:
    """The segments the process held before the call, by address: (size, bytes the residents held in it),
    read from the segments held at the end less what the trace left allocated in each."""
    made = {e[1] for e in trace["events"] if e[0] == "segment_alloc"}
    segments = {s["address"]: s for s in trace["segments_at_end"]}
    starts = sorted(segments)
    live: dict[int, int] = {}
    for action, address, size, _ in trace["events"]:
        if action == "alloc":
            live[address] = rounded(size)
        elif action == "free_requested":
            del live[address]
    in_segment: dict[int, int] = {}
    for address, size in live.items():
        start = starts[bisect.bisect_right(starts, address) - 1]
        in_segment[start] = in_segment.get(start, 0) + size
    return {a: (s["total_size"], s["allocated_size"] - in_segment.get(a, 0)) for a, s in segments.items() if a not in made}


def test_parameters_moved_to_the_gpu_make_the_segments_the_trace_started_with(trace):
    """GPT-2's 148 parameters and its input, allocated in order, give the 21 segments (one 148 MiB for wte, one
    2 MiB small segment, 19 of 20 MiB) the process held before the call, each as full."""
    model = resident_model(trace)
    assert sorted((size, used) for _, size, used in model.segments()) == sorted(resident_segments(trace).values())
    assert model.reserved == sum(size for size, _ in resident_segments(trace).values()) == 555_745_280


def _driver_addresses(trace: dict) -> list[int]:
    """The addresses the driver gave, in the order the model asks for segments: the resident segments' (each
    to a segment the model fills alike), then those the trace allocated."""
    free = {}
    for address, key in resident_segments(trace).items():
        free.setdefault(key, []).append(address)
    # The default driver hands out addresses downwards: the model's segments by falling address are in the
    # order it asked for them.
    order = [free[(size, used)].pop() for _, size, used in sorted(resident_model(trace).segments(), reverse=True)]
    return order + [e[1] for e in trace["events"] if e[0] == "segment_alloc"]


def test_the_trace_replayed_lands_every_allocation_where_the_gpu_put_it(trace):
    """Fed the trace's allocations and frees after its residents, with the driver's addresses for its segments,
    the model puts each of the 4,899 allocations at the address the H200's allocator did, asks for the same 100
    segments in the same order, and ends holding the same segments, each as full."""
    model = resident_model(trace, _driver_addresses(trace))
    handles = {}
    for action, address, size, _ in trace["events"]:
        if action == "alloc":
            handles[address] = model.alloc(size)
            assert handles[address] == address
        elif action == "free_completed":
            model.free(handles.pop(address))
    stats = model.stats()
    assert stats.segment_allocs[21:] == tuple(e[2] for e in trace["events"] if e[0] == "segment_alloc")
    assert model.segments() == sorted((s["address"], s["total_size"], s["allocated_size"]) for s in trace["segments_at_end"])
    assert stats.max_reserved == trace["max_reserved"] == 4_206_886_912
    assert stats.max_allocated == trace["max_allocated"] == 3_826_284_032


def test_the_trace_replayed_with_the_models_own_addresses_reserves_the_same(trace):
    """Without the driver's addresses (best fit's ties broken by the model's own), replay() of the trace's events
    reserves exactly what the GPU did, and allocates exactly its peak."""
    stats = replay(trace["events"], resident_model(trace))
    assert stats.segment_allocs[21:] == tuple(e[2] for e in trace["events"] if e[0] == "segment_alloc")
    assert stats.max_reserved == trace["max_reserved"]
    assert stats.max_allocated == trace["max_allocated"]
    assert stats.segment_frees == () and stats.retries == 0


def test_expandable_segments_on_the_trace_reserve_within_one_percent_of_allocated(trace):
    """The same allocations with ``expandable_segments:True``: reserved over allocated falls from 1.10 to under
    1.01 (the issue measured 1.006-1.024 on the GPU with it), 348 MiB less."""
    model = CachingAllocatorModel(expandable_segments=True)
    for nbytes in [*gpt2_parameter_bytes(), 16 * 512 * 8]:
        model.alloc(nbytes)
    stats = replay(trace["events"], model)
    assert stats.reserved_over_allocated < 1.01
    assert trace["max_reserved"] - stats.max_reserved > 340 * MiB


# -- each rule, by hand ------------------------------------------------------------------------------------


def test_requests_are_rounded_to_512_bytes():
    assert [rounded(n) for n in (0, 1, 512, 513, 1536)] == [512, 512, 512, 1024, 1536]
    model = CachingAllocatorModel()
    model.alloc(1)
    assert (model.allocated, model.reserved) == (512, 2 * MiB)


@pytest.mark.parametrize("request_bytes, segment", [
    (1, 2 * MiB), (MiB, 2 * MiB), (MiB + 1, 20 * MiB), (10 * MiB - 512, 20 * MiB), (10 * MiB, 10 * MiB),
    (10 * MiB + 1, 12 * MiB), (296 * MiB + 5, 298 * MiB),
])
def test_segment_sizes(request_bytes, segment):
    """Small requests (up to 1 MiB) get 2 MiB segments, large ones under 10 MiB 20 MiB, larger ones their own
    size rounded up to 2 MiB."""
    assert segment_size(rounded(request_bytes)) == segment
    model = CachingAllocatorModel()
    model.alloc(request_bytes)
    assert model.stats().segment_allocs == (segment,)


def test_the_small_pool_packs_a_segment_to_the_last_512_bytes():
    """A small block splits whenever at least 512 bytes are left: 1 MiB, 1 MiB - 512 and 512 fill one segment."""
    model = CachingAllocatorModel()
    for n in (MiB, MiB - 512, 512):
        model.alloc(n)
    assert (model.allocated, model.reserved) == (2 * MiB, 2 * MiB)
    model.alloc(512)
    assert model.reserved == 4 * MiB


def test_a_large_block_splits_only_when_more_than_1_mib_is_left():
    """9 MiB in a 20 MiB segment leaves 11 MiB, split off; 10.5 MiB in those 11 leaves 0.5 MiB, which stays in the
    block (allocated counts it); a 19.5 MiB request gets a 20 MiB segment of its own, whole."""
    model = CachingAllocatorModel()
    model.alloc(9 * MiB)
    assert (model.allocated, model.reserved) == (9 * MiB, 20 * MiB)
    model.alloc(10 * MiB + MiB // 2)
    assert (model.allocated, model.reserved) == (20 * MiB, 20 * MiB)
    model.alloc(19 * MiB + MiB // 2)
    assert (model.allocated, model.reserved) == (40 * MiB, 40 * MiB)


def test_best_fit_takes_the_smallest_cached_block_that_fits():
    model = CachingAllocatorModel()
    twelve, fourteen = model.alloc(12 * MiB), model.alloc(14 * MiB)
    model.free(fourteen)
    model.free(twelve)
    assert model.alloc(11 * MiB) == twelve
    assert model.alloc(13 * MiB) == fourteen
    assert model.reserved == 26 * MiB


def test_a_block_cached_on_one_stream_is_not_reused_on_another():
    model = CachingAllocatorModel()
    model.free(model.alloc(12 * MiB, stream=0))
    model.alloc(12 * MiB, stream=1)
    assert model.reserved == 24 * MiB


def test_freed_neighbours_merge_and_best_fit_breaks_ties_by_address():
    """Three 4 MiB blocks cut from one 20 MiB segment: freeing the first two merges them into 8 MiB at the
    segment's start, which ties with the 8 MiB free tail and wins by its lower address."""
    model = CachingAllocatorModel()
    a, b, _ = (model.alloc(4 * MiB) for _ in range(3))
    assert b == a + 4 * MiB
    model.free(a)
    model.free(b)
    assert model.alloc(8 * MiB) == a
    assert model.reserved == 20 * MiB


def test_a_segment_whose_blocks_are_all_freed_is_whole_again_and_can_be_released():
    model = CachingAllocatorModel()
    blocks = [model.alloc(n) for n in (4 * MiB, 2 * MiB, 5 * MiB)]
    for h in reversed(blocks):
        model.free(h)
    assert model.segments() == [(blocks[0], 20 * MiB, 0)]
    model.release_cached_blocks()
    assert (model.reserved, model.max_reserved, model.stats().segment_frees) == (0, 20 * MiB, (20 * MiB,))


def test_max_split_size_keeps_oversize_blocks_whole_and_for_requests_near_their_size():
    """With max_split_size 30 MiB: a cached 40 MiB block is not cut for a 5 MiB request; a 32 MiB request
    takes it whole (within 20 MiB of it); a 19 MiB-smaller one (60 MiB block, 35 MiB request) does not."""
    model = CachingAllocatorModel(max_split_size=30 * MiB)
    forty = model.alloc(40 * MiB)
    model.free(forty)
    model.alloc(5 * MiB)
    assert model.reserved == 60 * MiB
    assert model.alloc(32 * MiB) == forty
    assert model.allocated == 5 * MiB + 40 * MiB
    model.free(model.alloc(60 * MiB))
    model.alloc(35 * MiB)
    assert model.stats().segment_allocs == (40 * MiB, 20 * MiB, 60 * MiB, 36 * MiB)


def test_without_max_split_size_a_large_cached_block_is_cut_for_any_large_request():
    model = CachingAllocatorModel()
    big = model.alloc(40 * MiB)
    model.free(big)
    assert model.alloc(5 * MiB) == big
    assert model.reserved == 40 * MiB


def test_at_the_memory_limit_cached_segments_are_released_and_the_request_retried():
    model = CachingAllocatorModel(memory_limit=40 * MiB)
    model.free(model.alloc(12 * MiB))
    model.alloc(30 * MiB)
    stats = model.stats()
    assert (stats.reserved, stats.max_reserved, stats.segment_frees, stats.retries) == (30 * MiB, 30 * MiB, (12 * MiB,), 1)


def test_at_the_memory_limit_oversize_blocks_go_first_and_only_as_many_as_needed():
    """release_available_cached_blocks: with max_split_size set, the smallest cached oversize block of at least
    max(request, max_split_size) is released before anything else."""
    model = CachingAllocatorModel(max_split_size=30 * MiB, memory_limit=100 * MiB)
    forty, fifty = model.alloc(40 * MiB), model.alloc(50 * MiB)
    model.free(forty)
    model.free(fifty)
    model.alloc(15 * MiB)
    stats = model.stats()
    assert stats.segment_frees == (40 * MiB,) and stats.retries == 0
    assert stats.reserved == 50 * MiB + 16 * MiB


def test_out_of_memory_when_nothing_cached_can_be_released():
    model = CachingAllocatorModel(memory_limit=20 * MiB)
    model.alloc(8 * MiB)  # its segment's free 12 MiB is split off, so the segment cannot be released
    with pytest.raises(AllocatorOutOfMemory, match="cannot get"):
        model.alloc(16 * MiB)


# -- expandable segments -----------------------------------------------------------------------------------


def test_expandable_segments_grow_one_segment_per_pool_by_pages():
    """Small blocks map 2 MiB pages, large ones 20 MiB pages, each pool one segment growing at its end: two 5 MiB
    blocks share the first large page, a 30 MiB one takes the 10 MiB left and one more page."""
    model = CachingAllocatorModel(expandable_segments=True)
    model.alloc(1000)
    a = model.alloc(5 * MiB)
    b = model.alloc(5 * MiB)
    c = model.alloc(30 * MiB)
    assert (b, c) == (a + 5 * MiB, a + 10 * MiB)
    assert model.stats().segment_allocs == (2 * MiB, 20 * MiB, 20 * MiB)
    assert sorted(size for _, size, _ in model.segments()) == [2 * MiB, 40 * MiB]
    assert model.allocated == 1024 + 40 * MiB


def test_expandable_segments_split_every_remainder():
    """A 19.5 MiB block in a 20 MiB page: the 0.5 MiB left is split off, where the default allocator leaves it in
    the block (and counts it allocated)."""
    for expandable, allocated in ((True, 19 * MiB + MiB // 2), (False, 20 * MiB)):
        model = CachingAllocatorModel(expandable_segments=expandable)
        model.alloc(19 * MiB + MiB // 2)
        assert (model.allocated, model.reserved) == (allocated, 20 * MiB)


def test_expandable_segments_reuse_freed_pages_before_mapping_more():
    model = CachingAllocatorModel(expandable_segments=True)
    blocks = [model.alloc(15 * MiB) for _ in range(4)]  # 60 MiB: three pages
    model.free(blocks[1])
    model.free(blocks[2])
    assert model.alloc(30 * MiB) == blocks[1]
    assert model.reserved == 60 * MiB


def test_expandable_segments_hand_free_pages_back():
    """release_cached_blocks unmaps the whole pages inside free blocks and keeps the pages a live block touches."""
    model = CachingAllocatorModel(expandable_segments=True)
    keep = model.alloc(5 * MiB)
    model.free(model.alloc(50 * MiB))  # pages 1-3 (with the 15 MiB left in page 1)
    assert model.reserved == 60 * MiB
    model.release_cached_blocks()
    assert model.reserved == 20 * MiB and model.segments() == [(keep, 20 * MiB, 5 * MiB)]
    model.free(keep)
    model.release_cached_blocks()
    assert model.reserved == 0 and model.segments() == []


# -- a planned step's allocation order ---------------------------------------------------------------------


def tiny_gpt2() -> tuple:
    """A transformers GPT-2 of 4 layers, 64 wide, and its training step on 16 x 128 tokens."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=512, n_positions=128, n_embd=64, n_layer=4, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    return model, models.gpt2_step(model), torch.randint(0, 512, (16, 128))


def staged_plan(step, x, fraction: float, labels=None):
    """``jit(step)`` under a budget ``fraction`` of the way from its smallest plan to the whole batch (chunked,
    not recomputing), its plan for ``(x, labels)`` (labels: ``x``) and its planner."""
    args = (x, x if labels is None else labels)
    budget = budget_between(stagetorch.jit(step, remat=False), args, fraction)
    staged = stagetorch.jit(step, memory_budget=budget, remat=False)
    plan = staged.plan(*args)
    entry, _, _ = staged._stage(args, {})
    return staged, plan, entry.executable.planner


def profiled_allocations(fn, *args) -> list[tuple[str, int, int]]:
    """The allocations and frees of CPU memory that ``fn(*args)`` makes, in order, as the profiler records
    torch's allocator (frees of blocks allocated before it left out)."""
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with profiler:
        fn(*args)
    tag = torch._C._profiler._EventType.Allocation
    tree = profiler.profiler.kineto_results.experimental_event_tree()
    seen = sorted((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.ptr)
                  for e in memtrack._events(tree) if e.tag == tag and e.extra_fields.device.type == "cpu")
    events, mine = [], set()
    for _, size, ptr in seen:
        if size > 0:
            mine.add(ptr)
            events.append(("alloc", ptr, size))
        elif ptr in mine:
            mine.discard(ptr)
            events.append(("free", ptr, 0))
    return events


@pytest.mark.parametrize("fraction, padded", [(0.1, False), (0.4, True)])
def test_the_plans_allocation_order_predicts_what_the_run_would_reserve(fraction, padded):
    """The CPU analogue of the GPU trace: a tiny GPT-2's chunked step run by jit, its every allocation recorded
    by the profiler and replayed through the caching allocator model, reserves what the model predicts from
    the plan's own allocation order (predict_reserved), to the byte (measured: chunks of [2]*8, and [6, 6, 4]
    with padded labels; 1.07x and 1.63x allocated: 2 MiB small segments dominate a model this small), and
    allocates its peak within 0.1%."""
    _, step, x = tiny_gpt2()
    labels = x.clone()
    if padded:
        labels[:, 100:] = -100
        labels[3, 50:] = -100
    staged, plan, planner = staged_plan(step, x, fraction, labels)
    assert plan.chunked and planner.split().globals  # the loss's count of labels: a pre-pass runs first
    predicted = predict_reserved(planner.graph, plan.chunk_sizes, planner.split())
    ran = replay([*resident_events(planner.graph), *profiled_allocations(staged, x, labels)])
    assert predicted.max_reserved == pytest.approx(ran.max_reserved, rel=0.01)
    assert predicted.max_allocated == pytest.approx(ran.max_allocated, rel=1e-3)
    assert predicted.reserved_over_allocated > 1


def test_a_whole_batch_plans_allocation_order_predicts_what_it_would_reserve():
    _, step, x = tiny_gpt2()
    staged = stagetorch.jit(step, remat=False)
    entry, _, _ = staged._stage((x, x), {})
    graph = entry.executable.planner.graph
    predicted = predict_reserved(graph, (16,))
    ran = replay([*resident_events(graph), *profiled_allocations(staged, x, x)])
    assert predicted.max_reserved == pytest.approx(ran.max_reserved, rel=0.01)
    assert predicted.max_allocated == pytest.approx(ran.max_allocated, rel=1e-3)


def test_on_cuda_the_planner_keeps_the_predicted_reserved_bytes_under_the_budget(monkeypatch):
    """A graph on CUDA (the device injected into the planner: a CPU build cannot make CUDA tensors) is planned in
    smaller chunks than its tensors alone allow ([4, 4, 4, 4] against [6, 6, 4]), the largest whose predicted
    reserved bytes fit the budget; the step still equals eager."""
    model, step, x = tiny_gpt2()
    _, plain, planner = staged_plan(step, x, 0.4)
    assert predict_reserved(planner.graph, plain.chunk_sizes, planner.split()).max_reserved > plain.budget_bytes
    monkeypatch.setattr(planner_module, "on_cuda", lambda graph: True)
    staged, on_device, planner = staged_plan(step, x, 0.4)
    largest = max(on_device.chunk_sizes)
    assert on_device.budget_bytes == plain.budget_bytes and largest < max(plain.chunk_sizes)
    assert predict_reserved(planner.graph, on_device.chunk_sizes, planner.split()).max_reserved <= on_device.budget_bytes
    assert "caching allocator will reserve" in on_device.reason

    reference = copy.deepcopy(model)
    models.gpt2_step(reference)(x, x)
    staged(x, x)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)


def test_the_plan_of_the_traced_gpt2_step_predicts_the_h200s_reserved_bytes(trace):
    """The trace's own step staged on CPU (GPT-2 124M, 16 x 512, budget 4 GiB; its parameters allocated, never
    read: nothing runs) is planned as on the GPU, [3, 3, 3, 3, 3, 1], and its plan's allocation order fed to the
    model predicts the H200's max reserved within 1% (-0.8%: the 32 MiB cuBLAS workspace, which no plan
    holds); with that workspace, to the byte. Max allocated within 1% too."""
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives lm_head a storage of its own
    x = torch.zeros(16, 512, dtype=torch.long)

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    staged = stagetorch.jit(step, memory_budget=trace["budget_bytes"], remat=False)
    plan = staged.plan(x)
    assert plan.chunk_sizes == tuple(trace["plan_chunk_sizes"])
    assert plan.peak == pytest.approx(trace["plan_peak"], rel=1e-4)
    entry, _, _ = staged._stage((x,), {})
    planner = entry.executable.planner
    predicted = predict_reserved(planner.graph, plan.chunk_sizes, planner.split())
    assert predicted.max_reserved == pytest.approx(trace["max_reserved"], rel=0.01)
    assert predicted.max_allocated == pytest.approx(trace["max_allocated"], rel=0.01)
    with_cublas = predict_reserved(planner.graph, plan.chunk_sizes, planner.split(), workspace=32 * MiB)
    assert with_cublas.max_reserved == trace["max_reserved"]


def test_allocation_events_follow_the_memory_interpreters_schedule():
    """Each storage allocated where it is made, its kernel's workspace inside its equation, freed after its last
    use; the output is kept."""
    def f(x):
        y = x * 2
        z = y + 1
        return z.sum()

    graph = stagetorch.make_ir(f)(torch.ones(256, 256))
    y, z, total = (e.outvars[0] for e in graph.eqns)
    events = [(action, key if isinstance(key, Var) else "workspace", size) for action, key, size in allocation_events(graph, final=False)]
    made = [event for event in events if event[1] != "workspace"]
    assert made == [("alloc", y, 256 * 256 * 4), ("alloc", z, 256 * 256 * 4), ("free", y, 0), ("alloc", total, 4), ("free", z, 0)]
    for k, event in enumerate(events):
        if event[:2] == ("alloc", "workspace"):
            assert events[k + 1][:2] == ("free", "workspace")


def test_allocator_settings_are_read_from_the_environment():
    assert allocator_settings({}) == {}
    assert allocator_settings({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}) == {"expandable_segments": True}
    assert allocator_settings({"PYTORCH_ALLOC_CONF": "max_split_size_mb:128, garbage_collection_threshold:0.6,"
                                                     "max_non_split_rounding_mb:64"}) == {
        "max_split_size": 128 * MiB, "max_non_split_rounding": 64 * MiB}

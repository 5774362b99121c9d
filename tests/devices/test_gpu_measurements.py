"""Plans for a GPU, made on CPU, against what a real GPU's allocator measured (issue 44).

Ground truth: ``tests/support/data/gpu-measurements.json``, the H200 rows of ``h200-measurements.md`` (a ResNet-ish
CNN at 64x3x224x224 and GPT-2 124M at 8x512, fp32, every path, torch 2.11) and the allocator trace of a chunked
GPT-2 124M step at 16x512 (``cuda-traces/``). Each row is re-planned here for the H200 on CPU and must come out
allocated within 1% (convolutions: 5%) and reserved within 3% of what the GPU measured, never under.

How the step is staged for the GPU here: traced on CPU fake tensors with CUDA's attention kernel chosen for
the H200 (``sdpa_dispatch(devices=("cpu",))``: memory-efficient attention for these fp32 steps, its backward
op included), then every value's device set to ``cuda`` (:func:`on_cuda`), so that the CUDA rules apply (the
caching allocator's rounding and segments, cuDNN's convolution workspaces, attention's, cuBLAS's resident
workspaces). For these fp32 steps the op choices are then the GPU's (no autocast). A CPU-only build cannot run
autograd over fake CUDA tensors (it aborts the process creating a CUDA leaf's gradient accumulator, and
Python indexing raises), which is why the values are moved after the trace. Staging for a named device is
device44's route (``stagetorch.memory(step, device="H200")``); the tests written against it are at the end,
expected to fail until it lands.

Rows of paths whose program at the measured commit (f68f244) is not today's plan are kept as data and
checked as far as they can be: the recomputing and lazy rows ran a recompute set chosen by the planner of
that commit (not re-planned here); the chunked rows are costed at the measured chunk count.

Runtime: ~30-60 s on a shared 2-core machine (four GPT-2 124M traces on fake tensors, ~1 s each; the allocator
model ~1-2 s per plan).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stagetorch
from stagetorch.devices.cuda_allocator import CachingAllocatorModel, replay
from stagetorch.interpreters.batching import Batched
from stagetorch.interpreters.chunked import even_chunks
from stagetorch.interpreters.memory import peak_bytes
from stagetorch.ir import Aval, Graph, Var
from stagetorch.ops.kernels import cuda_blas
from stagetorch.ops.kernels.cuda_sdpa import CudaProps, sdpa_dispatch
from stagetorch.planning.planner import Planner
from stagetorch.planning.reserved import resident_events, step_events

DATA = Path(__file__).parents[1] / "support" / "data" / "gpu-measurements.json"
MEASURED = json.loads(DATA.read_text())
H200 = tuple(MEASURED["capability"])
# cuBLAS's and cuBLASLt's workspaces on an H200 with default settings: resident from the first matmul on.
WORKSPACES = cuda_blas.resident_workspaces(H200, env={})


def rows(model: str, path: str) -> dict:
    (row,) = [r for r in MEASURED["rows"] if r["model"] == model and r["path"] == path]
    return row


# -- the steps the GPU ran (bench/cuda_memory_check.py at f68f244) ---------------------------------------------


def resnet(width: int = 64) -> nn.Module:
    def block(c: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.GroupNorm(8, c), nn.ReLU(),
                             nn.Conv2d(c, c, 3, padding=1), nn.GroupNorm(8, c))

    return nn.Sequential(nn.Conv2d(3, width, 7, 2, 3), nn.ReLU(), *[block(width) for _ in range(4)],
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 1000))


def gpt2_124m() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    return transformers.GPT2LMHeadModel(config)


def on_cuda(graph: Graph) -> Graph:
    """``graph`` with every value on ``cuda:0`` (in place): CUDA's memory rules on the graph CPU traced."""
    cuda = torch.device("cuda", 0)
    seen: set[int] = set()

    def move(v: object) -> None:
        if isinstance(v, Var) and id(v) not in seen:
            seen.add(id(v))
            v.aval = Aval(v.aval.shape, v.aval.dtype, cuda)

    for v in graph.invars:
        move(v)
    for e in graph.eqns:
        for a in (*e.args, *e.kwargs.values(), *e.outvars):
            move(a)
    for v in graph.outvars:
        move(v)
    return graph


@functools.cache
def staged_for_h200(model_name: str, state: str = "none") -> tuple[Graph, Planner]:
    """The row's step staged for the H200. ``state``: "none" (no .grad before the call), "grads" (a .grad held
    that the step adds into: the accumulating row) or "optimizer" (AdamW stepping inside after ``zero_grad()``,
    its moments made by an earlier step, the previous .grad held: the optimizer-inside rows)."""
    torch.manual_seed(0)
    model = resnet() if model_name == "resnet-ish" else gpt2_124m()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4) if state == "optimizer" else None
    if state != "none":
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
            if optimizer is not None:
                optimizer.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p),
                                      "exp_avg_sq": torch.zeros_like(p)}
    if model_name == "resnet-ish":
        x, y = torch.randn(64, 3, 224, 224), torch.randint(0, 1000, (64,))
    else:
        batch = 16 if model_name == "gpt2-124M-16x512" else 8
        x = y = torch.randint(0, 50257, (batch, 512))

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if optimizer is not None:
            optimizer.zero_grad()
        if model_name == "resnet-ish":
            loss = F.cross_entropy(model(x), y)
        else:
            loss = model(input_ids=x, labels=y).loss
        loss.backward()
        if optimizer is not None:
            optimizer.step()
        return loss

    # CUDA's attention kernel for the H200 (fp32: memory-efficient), staged on CPU fake tensors with its backward
    with sdpa_dispatch(CudaProps(capability=H200), devices=("cpu",)):
        graph = on_cuda(stagetorch.make_ir(step)(x, y))
    args = [v for v, r in zip(graph.invars, graph.roles) if r == "arg"]
    return graph, Planner(graph, {v: Batched(0) for v in args}, x.shape[0], cut_coupled=True)


@pytest.fixture(scope="module")
def resnet_step() -> tuple[Graph, Planner]:
    return staged_for_h200("resnet-ish")


@pytest.fixture(scope="module")
def gpt2_step() -> tuple[Graph, Planner]:
    return staged_for_h200("gpt2-124M")


def predicted(graph: Graph, planner: Planner, chunk_sizes: tuple[int, ...]):
    """The allocator model's statistics for the step run in ``chunk_sizes`` on an H200: the graph's inputs, then
    cuBLAS's workspaces (kept from the first matmul on), then the step's allocations in program order."""
    split = planner.split() if len(chunk_sizes) > 1 else None
    events = [*resident_events(graph), *[("alloc", ("cublas", i), n) for i, n in enumerate(WORKSPACES)],
              *step_events(graph, chunk_sizes, split)]
    return replay(events, CachingAllocatorModel())


def allocated_like_the_table(graph: Graph, planner: Planner, chunk_sizes: tuple[int, ...], held: int = 0) -> int:
    """What the table counts: the call's own peak (the workspaces were there before it) plus the resident state,
    ``held`` bytes of it (a previous .grad) beside the graph's inputs."""
    return predicted(graph, planner, chunk_sizes).max_allocated - sum(WORKSPACES) + held


def held_grads(graph: Graph) -> int:
    """The bytes of the .grad each parameter holds before the call (one per parameter, its size)."""
    return sum(v.aval.nbytes for v, role in zip(graph.invars, graph.roles) if role == "param")


def check(pred: int, measured: int, tolerance: float) -> None:
    error = (pred - measured) / measured
    assert 0 <= error <= tolerance, f"predicted {pred:,} vs measured {measured:,}: {100 * error:+.2f}%"


# -- whole steps ---------------------------------------------------------------------------------------------


def test_resnet_whole_step_on_h200_within_5_percent_never_under(resnet_step: tuple[Graph, Planner]) -> None:
    """The CNN's plan was 5.3% under the H200 (cuDNN's workspaces uncounted): with the bound it is over, by little."""
    graph, planner = resnet_step
    row = rows("resnet-ish", "whole")
    pred = allocated_like_the_table(graph, planner, (64,))
    check(pred, row["allocated"], 0.05)
    # the tensors alone are the plan the table measured, to the byte, and 5.3% under
    assert peak_bytes(graph, workspaces=False) == row["plan_then"]
    assert row["plan_then"] < 0.95 * row["allocated"]


def test_gpt2_whole_step_on_h200_within_1_percent_never_under(gpt2_step: tuple[Graph, Planner]) -> None:
    graph, planner = gpt2_step
    row = rows("gpt2-124M", "whole")
    check(allocated_like_the_table(graph, planner, (8,)), row["allocated"], 0.01)


@pytest.mark.parametrize("model_name,tolerance", [("resnet-ish", 0.05), ("gpt2-124M", 0.01)])
@pytest.mark.parametrize("path", ["accumulating", "optimizer inside", "optimizer inside, donate_grads"])
def test_rows_with_state_on_h200(model_name: str, tolerance: float, path: str) -> None:
    """The rows that hold a .grad (and AdamW's moments) beside the step: the previous .grad held to the end of the
    call, or dropped before the program runs (``donate_grads``)."""
    graph, planner = staged_for_h200(model_name, "grads" if path == "accumulating" else "optimizer")
    row = rows(model_name, path)
    held = 0 if path.endswith("donate_grads") else held_grads(graph)
    check(allocated_like_the_table(graph, planner, (row["batch"][0],), held), row["allocated"], tolerance)


def test_gpt2_is_staged_with_the_h200s_attention_kernel(gpt2_step: tuple[Graph, Planner]) -> None:
    """fp32 on an H200: memory-efficient attention, forward and backward, in each of the 12 layers."""
    graph, _ = gpt2_step
    ops = [str(e.prim) for e in graph.eqns]
    assert ops.count("aten._scaled_dot_product_efficient_attention.default") == 12
    assert ops.count("aten._scaled_dot_product_efficient_attention_backward.default") == 12
    assert not any("for_cpu" in op for op in ops)


def test_gpt2_tensors_alone_are_under_the_allocator(gpt2_step: tuple[Graph, Planner]) -> None:
    """Why the allocator's model, not the tensors' peak, is what is compared: the logits' 823 MB blocks reuse
    cached blocks whose remainder is not split off, which max_memory_allocated counts."""
    graph, _ = gpt2_step
    assert peak_bytes(graph) < rows("gpt2-124M", "whole")["allocated"]


# -- the allocator trace's step (16 x 512 in chunks of 3, under a 4 GiB cap) ---------------------------------


def test_trace_step_allocated_within_1_percent_and_reserved_within_3_percent_never_under() -> None:
    graph, planner = staged_for_h200("gpt2-124M-16x512")
    trace = MEASURED["trace"]
    stats = predicted(graph, planner, tuple(trace["chunks"]))
    check(stats.max_allocated, trace["max_allocated"], 0.01)
    check(stats.max_reserved, trace["max_reserved"], 0.03)
    assert stats.max_reserved == trace["max_reserved"]  # to the byte, with both of cuBLAS's workspaces
    without = replay([*resident_events(graph), *step_events(graph, tuple(trace["chunks"]), planner.split())],
                     CachingAllocatorModel())
    assert without.max_reserved < trace["max_reserved"]  # the workspaces are what the plan missed


# -- chunked rows: the chunk count measured, costed as today's executor runs it -----------------------------


def test_gpt2_chunked_row_within_1_percent(gpt2_step: tuple[Graph, Planner]) -> None:
    graph, planner = gpt2_step
    row = rows("gpt2-124M", "chunked")
    sizes = tuple(even_chunks(8, -(-8 // row["chunks"])))
    pred = allocated_like_the_table(graph, planner, sizes)
    assert abs(pred - row["allocated"]) <= 0.01 * row["allocated"], (pred, row["allocated"])


@pytest.mark.xfail(strict=True, reason="GPT-2 8x512 in chunks of 3: predicted 0.5% under the row measured at "
                   "f68f244 (whose executor may have held more; the 16x512 trace's chunks of 3, at a later commit, "
                   "are predicted 24 KB over). Needs a GPU run of today's executor.")
def test_gpt2_chunked_row_never_under(gpt2_step: tuple[Graph, Planner]) -> None:
    graph, planner = gpt2_step
    row = rows("gpt2-124M", "chunked")
    sizes = tuple(even_chunks(8, -(-8 // row["chunks"])))
    check(allocated_like_the_table(graph, planner, sizes), row["allocated"], 0.01)


@pytest.mark.xfail(strict=True, reason="ResNet-ish in 3 chunks: today's costing of chunks of 22 is 8% under the "
                   "row measured at f68f244, whose own plan (1,428,801,856) is not today's chunk cost (1,313,196,368 "
                   "without workspaces): the executor of that commit held more than today's plan of it. Needs a GPU "
                   "run of today's executor.")
def test_resnet_chunked_row_within_5_percent_never_under(resnet_step: tuple[Graph, Planner]) -> None:
    graph, planner = resnet_step
    row = rows("resnet-ish", "chunked")
    sizes = tuple(even_chunks(64, -(-64 // row["chunks"])))
    check(allocated_like_the_table(graph, planner, sizes), row["allocated"], 0.05)


def test_every_row_is_data() -> None:
    """The file holds every row of the table, each a step a CPU-side test can re-plan."""
    assert len(MEASURED["rows"]) == 14
    assert {r["path"] for r in MEASURED["rows"]} == {
        "whole", "chunked", "recomputing", "lazy", "optimizer inside", "optimizer inside, donate_grads", "accumulating"}
    for r in MEASURED["rows"]:
        assert r["allocated"] > 0 and r["reserved_process"] >= r["allocated"] - 2**30


# -- device44's route: staging on fake CUDA tensors for a named device ----------------------------------------



@pytest.mark.parametrize("model_name", ["resnet-ish", "gpt2-124M"])
def test_route_whole_step_for_h200(model_name: str) -> None:
    torch.manual_seed(0)
    if model_name == "resnet-ish":
        model = resnet()
        x, y = torch.randn(64, 3, 224, 224), torch.randint(0, 1000, (64,))

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss
        tolerance = 0.05
    else:
        model = gpt2_124m()
        x = y = torch.randint(0, 50257, (8, 512))

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = model(input_ids=x, labels=y).loss
            loss.backward()
            return loss
        tolerance = 0.01
    report = stagetorch.memory(step, device="H200")(x, y)
    # The caching allocator's predicted max allocated (the cuBLAS workspaces and unsplit block remainders
    # included), the figure torch.cuda.max_memory_allocated measured.
    check(report.device.max_allocated_bytes, rows(model_name, "whole")["allocated"], tolerance)

"""Measures: bytes and collectives per step of jit/lazy(process_group=) against DDP, two gloo ranks. Last run: 2026-11-23.

Per-step communication of ``jit(fn, process_group=)`` and ``lazy(..., process_group=)`` against
DistributedDataParallel (issue 16).

Two gloo processes on CPU, the same token model and the same uneven shards (37/63 sequences, -100 padding);
each rank counts the bytes it hands to collectives per step (DDP: its gradient buckets, through a comm
hook; stagetorch: every collective it calls), the number of collectives, the median step time, and the
gradient's error against one process on the global batch.

Run: python -m pytest bench/bench_distributed.py -s   (or: python bench/bench_distributed.py)
"""

from __future__ import annotations

import contextlib
import queue
import statistics
import tempfile
import time
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import stagetorch
from stagetorch.parallel import data_parallel as sdist

V, T, D, H = 1000, 16, 128, 512
SHARDS = (37, 63)
STEPS, WARMUP = 20, 3


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(V, D), nn.Linear(D, H), nn.GELU(), nn.Linear(H, D), nn.Linear(D, V))


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    n = sum(SHARDS)
    x = torch.randint(0, V, (n, T), generator=g)
    y = torch.randint(0, V, (n, T), generator=g)
    y[torch.arange(T).expand(n, T) >= torch.randint(1, T + 1, (n, 1), generator=g)] = -100
    return x, y


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1), ignore_index=-100)


class Counter:
    def __init__(self) -> None:
        self.bytes = 0
        self.calls = 0

    def add(self, t: torch.Tensor) -> None:
        self.bytes += t.numel() * t.element_size()
        self.calls += 1


def _timed(step, model: nn.Module, counter: Counter) -> dict:
    times = []
    for i in range(WARMUP + STEPS):
        if i == WARMUP:
            counter.bytes = counter.calls = 0
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {
        "bytes": counter.bytes / STEPS,
        "calls": counter.calls / STEPS,
        "ms": statistics.median(times[WARMUP:]) * 1e3,
        "grads": [p.grad.clone() for p in model.parameters()],
    }


def _ddp(rank: int, x: torch.Tensor, y: torch.Tensor) -> dict:
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    counter = Counter()

    def hook(state, bucket):  # noqa: ANN001, ANN202 (DDP checks the annotations, which are strings here)
        counter.add(bucket.buffer())
        return allreduce_hook(None, bucket)

    ddp.register_comm_hook(None, hook)
    return _timed(lambda: loss_of(ddp, x, y).backward(), model, counter)


@contextlib.contextmanager
def _counting(counter: Counter) -> Iterator[None]:
    """Count every tensor stagetorch hands to a collective (all-reduce, all-gather)."""
    all_reduce, all_gather = dist.all_reduce, sdist._all_gather

    def counted_reduce(t: torch.Tensor, *args, **kwargs):
        counter.add(t)
        return all_reduce(t, *args, **kwargs)

    def counted_gather(out: torch.Tensor, t: torch.Tensor, *args, **kwargs):
        counter.add(t)
        return all_gather(out, t, *args, **kwargs)

    dist.all_reduce, sdist._all_gather = counted_reduce, counted_gather
    try:
        yield
    finally:
        dist.all_reduce, sdist._all_gather = all_reduce, all_gather


def _staged(rank: int, x: torch.Tensor, y: torch.Tensor, fraction: float | None) -> dict:
    """A staged step; with ``fraction``, this rank's budget is that fraction of its whole shard's peak."""
    model = make_model()
    counter = Counter()

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_of(model, x, y)
        loss.backward()
        return loss

    staged = stagetorch.jit(step, process_group=dist.group.WORLD)
    plan = staged.plan(x, y)  # a collective: every rank plans
    if fraction is not None:
        staged.memory_budget = int(plan.peak_bytes[0] * fraction)
    plan = staged.plan(x, y)
    with _counting(counter):
        out = _timed(lambda: staged(x, y), model, counter)
    out["chunks"] = len(plan.chunk_sizes)
    out["budget"] = staged.memory_budget
    return out


def _lazy(rank: int, x: torch.Tensor, y: torch.Tensor, budget: int | None) -> dict:
    """The same step written eagerly on ``stagetorch.lazy`` inputs, within ``budget``."""
    model = make_model()
    counter = Counter()
    chunks = []

    def step() -> None:
        lx, ly = stagetorch.lazy(x, y, process_group=dist.group.WORLD, memory_budget=budget)
        loss_of(model, lx, ly).backward()
        executable = next(
            v[0] for v in lx._session.recording.flushes.values() if isinstance(v, tuple) and v and hasattr(v[0], "shard_plans")
        )
        chunks[:] = [len(p.chunk_sizes) for p in executable.shard_plans.values()]

    with _counting(counter):
        out = _timed(step, model, counter)
    out["chunks"] = max(chunks)
    return out


def _worker(rank: int, store: str, results: mp.Queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        x, y = (t.split(list(SHARDS))[rank] for t in make_batch())
        out = {"ddp": _ddp(rank, x, y), "stagetorch": _staged(rank, x, y, None)}
        # Rank 1 with 40% of what its shard needs at once: chunked, rank 0 not.
        out["stagetorch, rank 1 chunked"] = _staged(rank, x, y, 0.4 if rank == 1 else None)
        out["lazy"] = _lazy(rank, x, y, None)
        out["lazy, rank 1 chunked"] = _lazy(rank, x, y, out["stagetorch, rank 1 chunked"]["budget"])
        # The latency of one small collective (a status exchange), what each extra one costs a step.
        group = sdist.ShardGroup(dist.group.WORLD)
        times = []
        for _ in range(200):
            start = time.perf_counter()
            group.check(None)
            times.append(time.perf_counter() - start)
        out["status_us"] = statistics.median(times[20:]) * 1e6
        results.put((rank, {k: v if k == "status_us" else {**v, "grads": [g.numpy() for g in v["grads"]]} for k, v in out.items()}))
    finally:
        dist.destroy_process_group()


def measure() -> list[str]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, f"{tmp}/store", results)) for r in range(2)]
        for p in procs:
            p.start()
        got: dict = {}
        while len(got) < len(procs):
            try:
                rank, value = results.get(timeout=5)
                got[rank] = value
            except queue.Empty:
                if not all(p.is_alive() for p in procs):
                    raise RuntimeError("a worker died; its traceback is above") from None
        for p in procs:
            p.join()
    reference = make_model()
    loss_of(reference, *make_batch()).backward()
    params = sum(p.numel() * p.element_size() for p in reference.parameters())
    lines = [
        f"model: {params / 2**20:.2f} MiB of float32 parameters; shards {SHARDS} sequences of {T} tokens, "
        f"-100 padding; {STEPS} steps after {WARMUP}",
        "| mode | rank | chunks | bytes sent / step | collectives / step | median step | max grad error vs global |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode in [m for m in got[0] if m != "status_us"]:
        for rank in (0, 1):
            r = got[rank][mode]
            error = max(
                float((torch.from_numpy(g) - p.grad).norm() / p.grad.norm()) for g, p in zip(r["grads"], reference.parameters())
            )
            lines.append(
                f"| {mode} | {rank} | {r.get('chunks', 1)} | {r['bytes']:,.0f} | {r['calls']:.0f} | {r['ms']:.1f} ms | {error:.1e} |"
            )
    lines.append(f"one status exchange (an all-gather of 7 int64): median {got[0]['status_us']:.0f} us on rank 0")
    return lines


def _bytes_per_step_against_ddp():
    print("\n" + "\n".join(measure()))


def test_bytes_per_step_against_ddp(benchmark):
    benchmark.pedantic(_bytes_per_step_against_ddp, rounds=1, iterations=1)


if __name__ == "__main__":
    print("\n".join(measure()))


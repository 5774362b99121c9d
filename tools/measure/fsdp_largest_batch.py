"""Measures: the largest batch per rank that trains within a memory budget under FSDP2 (issue 45).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tools/measure/fsdp_largest_batch.py \
        [--budget 40MiB] [--layers 4] [--cap 256]

A transformers GPT-2 (128 wide, ``--layers`` blocks, 64-token padded sequences, no dropout), ``fully_shard`` per
block and at the root, on 2 gloo processes. For each way of training a step (forward, ``backward()``) --
FSDP2 alone; FSDP2 with transformers' ``gradient_checkpointing_enable()`` (non-reentrant); FSDP2 under
``stagetorch.jit(step, process_group=..., memory_budget=budget)`` -- the largest number of sequences per rank
(the same on both ranks) whose step's peak, measured at the allocator (tests/support/memtrack.py's
AllocatorPeak: the CPU profiler's allocation events, the shards and the batch resident), stays within the
budget; searched by doubling from 1 and bisecting, up to ``--cap``. stagetorch's step must also plan within
the budget (its plan is what keeps it there). Both ranks take every decision together (an all-reduce of
"fits"). Rank 0 prints a markdown row per way; every rank its peaks at the largest batch.
"""

from __future__ import annotations

import argparse
import contextlib

import _paths  # noqa: F401  (tools/_paths.py: the tree and tests/support on sys.path)
import torch
import torch.distributed as dist
import transformers
from memtrack import AllocatorPeak
from torch.distributed.fsdp import fully_shard

import stagetorch
from stagetorch.devices.budget import parse_bytes
from stagetorch.interpreters.memory import format_bytes

SEQ = 64


def model(layers: int, checkpointing: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=1000, n_embd=128, n_head=4, n_layer=layers, n_positions=SEQ,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    m = transformers.GPT2LMHeadModel(config).train()
    if checkpointing:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for block in m.transformer.h:
        fully_shard(block)
    return fully_shard(m)


def batch(n: int, rank: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1234 + rank)
    ids = torch.randint(0, 1000, (n, SEQ), generator=g)
    mask = (torch.arange(SEQ) < torch.randint(8, SEQ + 1, (n, 1), generator=g)).long()
    return ids, mask, ids.masked_fill(mask == 0, -100)


def peak_of(way: str, n: int, budget: int, layers: int) -> int | None:
    """This rank's measured peak of one step of ``n`` sequences (the second step: the first made FSDP2's
    lazy state), or None where stagetorch plans it over the budget."""
    net = model(layers, way == "checkpointing")
    rank = dist.get_rank()

    def step(ids, mask, labels):
        loss = net(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        return loss

    run = step
    if way == "stagetorch":
        run = stagetorch.jit(step, process_group=dist.group.WORLD, memory_budget=budget, remat="auto")
    args = batch(n, rank)
    peak = None
    for i in range(2):
        for p in net.parameters():
            p.grad = None
        if way == "stagetorch":
            try:
                run.plan(*args)
                fits = torch.tensor(1)
            except stagetorch.errors.OutOfMemoryError:
                fits = torch.tensor(0)
            dist.all_reduce(fits, op=dist.ReduceOp.MIN)
            if not fits.item():
                return None
        shards = [p.to_local() for p in net.parameters()]
        with AllocatorPeak([*shards, *args]) if i == 1 else contextlib.nullcontext() as tracker:
            run(*args)
        if i == 1:
            peak = tracker.peak
    return peak


def largest(way: str, budget: int, layers: int, cap: int) -> tuple[int, int | None]:
    """The largest per-rank batch within ``budget`` on every rank (0: not even one), and this rank's peak there."""
    seen: dict[int, int | None] = {}

    def fits(n: int) -> bool:
        seen[n] = peak_of(way, n, budget, layers)
        ok = torch.tensor(int(seen[n] is not None and seen[n] <= budget))
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return bool(ok.item())

    if not fits(1):
        return 0, seen[1]
    lo, hi = 1, 2
    while hi <= cap and fits(hi):
        lo, hi = hi, 2 * hi
    if hi > cap:
        return lo, seen[lo]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, seen[lo]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="40MiB")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--cap", type=int, default=256)
    options = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    budget = parse_bytes(options.budget)
    rank = dist.get_rank()
    rows = []
    for way in ("fsdp2", "checkpointing", "stagetorch"):
        n, peak = largest(way, budget, options.layers, options.cap)
        print(f"rank {rank} {way}: largest {n} per rank, peak there {format_bytes(peak or 0)}", flush=True)
        rows.append((way, n, peak))
    if rank == 0:
        print(f"\n| way (GPT-2 128x{options.layers}, {SEQ} tokens, 2 gloo ranks) | largest batch per rank within "
              f"{format_bytes(budget)} | rank 0's peak there |\n|---|---|---|")
        for way, n, peak in rows:
            shown = f"{n}" + (f" (the cap, {options.cap})" if n >= options.cap else "")
            print(f"| {way} | {shown} | {format_bytes(peak or 0)} |", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

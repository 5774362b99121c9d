"""Measures: docs/distributed.md's FSDP2 example, every rank's allocator peak per step against its plan and budget.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tools/measure/fsdp_doc_peaks.py

The page's script (GPT-2 128x4, shards of 12 and 20 sequences of 64 tokens, budgets 40 and 24 MiB), three
AdamW steps under ``jit(process_group=)``; each step's peak is the CPU profiler's allocation events over the
call (tests/support/memtrack.py's AllocatorPeak, the shards and the batch resident). Then the same shards
under FSDP2 alone (one forward and backward, hooks and all), measured alike. Each rank prints its lines.
"""

from __future__ import annotations

import _paths  # noqa: F401  (tools/_paths.py: the tree and tests/support on sys.path)
import torch
import torch.distributed as dist
import transformers
from memtrack import AllocatorPeak
from torch.distributed.fsdp import fully_shard

import stagetorch


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=1000, n_embd=128, n_head=4, n_layer=4, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    m = transformers.GPT2LMHeadModel(config)
    for block in m.transformer.h:
        fully_shard(block)
    return fully_shard(m)


def batch(rank: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    n = 12 if rank == 0 else 20
    ids = torch.randint(0, 1000, (n, 64), generator=generator)
    mask = (torch.arange(64) < torch.randint(8, 65, (n, 1), generator=generator)).long()
    return ids, mask, ids.masked_fill(mask == 0, -100)


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    mib = 2**20
    for way in ("stagetorch", "fsdp2"):
        net = model()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)

        def step(ids, mask, labels, net=net):
            loss = net(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            return loss

        staged = stagetorch.jit(step, process_group=dist.group.WORLD,
                                memory_budget="24MiB" if rank == 1 else "32MiB")
        run = staged if way == "stagetorch" else step
        generator = torch.Generator().manual_seed(1234 + rank)
        for i in range(3):
            args = batch(rank, generator)
            opt.zero_grad()
            plan = staged.plan(*args) if way == "stagetorch" else None
            shards = [p.to_local() for p in net.parameters()]
            with AllocatorPeak([*shards, *args]) as tracker:
                loss = run(*args)
            opt.step()
            said = (f", chunks {plan.chunk_sizes}, planned {plan.peak / mib:.2f} MiB, budget {staged.memory_budget}"
                    if plan is not None else "")
            print(f"rank {rank} {way} step {i}: loss {loss.item():.4f}, peak {tracker.peak / mib:.2f} MiB{said}"
                  + (f"; {staged.fsdp_memory}" if plan is not None and i == 0 else ""), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A lazy step over a ``torch.distributed`` process group: ``lazy(x, y, process_group=group)``.

Each rank passes its shard; the session records for the *global* batch (the lazy tensors have its shape:
``x.shape[0]`` is every rank's examples together, as inside a step staged by ``jit(process_group=)``), and
its flush runs this rank's examples through :meth:`stagetorch.runtime.executable.Executable.run_shard`, so a mean's count,
a loss's normaliser and every gradient are the global batch's. The collectives are jit's: the shard sizes
(with a signature of the arguments) when ``lazy`` is called, the plan agreement (with a signature of the
program), then the merges, at every flush. A per-example value a flush made holds this rank's rows; a later
flush that reads it (the backward after a value read) takes it as batched, like the inputs.

Every rank must flush the same programs in the same order (the same script): a value read on one rank only
makes every rank raise ``RankMismatchError`` at the next flush rather than wait. This module knows how a
session's inputs and flush look under a process group, not how it records.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from ..errors import OutOfMemoryError, UnsupportedOpError
from ..interpreters.batching import Batched
from ..ir import Var
from ..parallel.data_parallel import ShardGroup, Signature
from ..planning.chunks import Plan
from ..runtime.executable import Executable
from ..staging.source import user_frame

__all__ = ["LazyShard", "start", "run"]



@attrs.define(eq=False)
class LazyShard:
    """This rank's part of a lazy step's global batch: where its examples sit, and whether it ran."""

    group: ShardGroup
    local: int  # this rank's examples
    offset: int  # the first of them in the global batch
    batch: int  # the global batch
    # The batch labels of the per-example values earlier flushes made: a later flush reads this rank's rows.
    labels: dict[Var, Batched] = attrs.field(factory=dict)

    def metas(self, tensors: Sequence[torch.Tensor], dim: int) -> list[tuple]:
        """The metadata of each input as its lazy tensor has it: the global batch, contiguous."""
        out = []
        for t in tensors:
            shape = list(t.shape)
            shape[dim % t.ndim] = self.batch
            stride = torch.empty(shape, device="meta").stride()
            out.append((torch.Size(shape), stride, t.dtype, t.device, False))
        return out


def start(tensors: Sequence[torch.Tensor], dim: int, process_group: Any, local: Callable[[], int]) -> LazyShard:
    """Agree with the other ranks on the global batch (one all-gather, which also compares the calls);
    ``local()`` checks the arguments and returns this rank's batch size. Every rank raises if one cannot."""
    group = ShardGroup(process_group)
    caller = user_frame(2)
    where = f"{caller.f_code.co_filename.rsplit('/', 1)[-1]}:{caller.f_lineno}" if caller is not None else "?"
    def describe() -> tuple[int, Signature]:
        n = local()
        for i, t in enumerate(tensors):
            if t.requires_grad:
                raise UnsupportedOpError(
                    f"stagetorch.lazy: argument {i} requires grad; with process_group= the batched arguments "
                    "must be data (detach them, or make the differentiated tensor after lazy())."
                )
        shapes = [tuple("N" if d == dim % t.ndim else s for d, s in enumerate(t.shape)) for t in tensors]
        return n, Signature(
            the_call=f"stagetorch.lazy at {where}",
            the_argument_structure=f"{len(tensors)} tensors, batch={dim}",
            the_argument_dtypes=str([str(t.dtype).removeprefix("torch.") for t in tensors]),
            the_argument_shapes=str(shapes).replace("'N'", "N"),
        )

    sizes = group.global_sizes(describe, "stagetorch.lazy")
    n = sizes[group.rank]
    return LazyShard(group, n, sum(sizes[: group.rank]), sum(sizes))


def run(shard: LazyShard, executable: Executable, inputs: list, budget: int) -> list:
    """A flush, on this rank's examples; **returns** its outputs (reductions global, per-example values this
    rank's rows, whose batch labels later flushes read). Every rank raises if one cannot run (no plan fits),
    or if the ranks recorded different programs (a value read on one rank only, say)."""
    plan = executable.shard_plan(shard.local, budget)
    shard.group.check(plan if isinstance(plan, OutOfMemoryError) else None, executable.signature())
    assert isinstance(plan, Plan)
    executable.plan_log.say(f"lazy (rank {shard.group.rank})", plan)
    outs = executable.run_shard(inputs, plan, shard.offset, shard.group)[0]
    analysis = executable.split().analysis
    labels = analysis.labels
    for v in executable.graph.outvars:
        # (A shared value paired with the examples is whole on every rank, not this rank's rows.)
        if isinstance(labels.get(v), Batched) and v not in analysis.spanning:
            shard.labels[v] = labels[v]
    return outs

"""Data parallel over a ``torch.distributed`` process group: every process runs its shard of one global batch.

A step staged with ``process_group=`` is staged for the *global* batch (every rank's shard, in rank order)
and each rank runs only its own examples, as chunks of that batch. The chunked executor already makes a
chunk's share exact: a mean is a sum divided by the global count, a count-normalised loss divides by a
normaliser that a pre-pass sums over the chunks. Across ranks the same holds once the partials are summed
over the group too, so a step's collectives are:

1. an all-gather of the shard sizes (the global batch and this rank's offset in it);
2. an all-gather of "my plan fits" (every rank plans for its own memory; if one cannot, all raise);
3. after each pre-pass, one all-reduce of the batch-wide normalisers (a loss's total weight);
4. after the chunk loop, one bucketed all-reduce of the reductions (gradients, the loss).

Nothing runs a collective inside the chunk loop, so a chunk that runs out of memory is redone locally.
Each merge is preceded by a one-integer-per-rank status exchange, so a rank that fails mid-step still
takes part in what the others wait for and every rank raises instead of waiting for a timeout.

This module knows the chunked executor, the planner and ``torch.distributed``; it knows nothing of the
front ends that call it.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist

from ..errors import (
    BatchCouplingError,
    OutOfMemoryError,
    RankMismatchError,
    ShapeError,
    StagingError,
    UnsupportedOpError,
)
from ..interpreters.chunked import Split, run_chunked
from ..interpreters.memory import peak_bytes
from ..ir import Aval, Graph, Var
from ..planning.chunks import Plan, chunked_peak, plan_chunks
from ..staging.state import State
from . import fsdp

__all__ = ["ShardGroup", "Signature", "plan_shard", "run_shard", "global_aval", "LaidOutAval", "staging"]

# Gradients are all-reduced in buckets of this many bytes, DDP's default.
BUCKET_BYTES = 25 * 2**20

_OK, _OOM, _FAILED = 0, 1, 2

# The exchanges of a step, in order (a status record says which one a rank is at).
_SIZES, _PLAN, _MERGE = 1, 2, 3
_PHASES = {_SIZES: "the exchange of shard sizes", _PLAN: "the agreement on plans", _MERGE: "a merge of partials"}
_HASHES = 4  # a signature's hashes in a status record


class Signature:
    """What must be the same on every rank, by aspect (``"the argument dtypes"``: a description); sent as
    a few hashes in a status exchange, and described in full only when they differ."""

    def __init__(self, **parts: str):
        assert len(parts) <= _HASHES
        self.parts = {k.replace("_", " "): v for k, v in parts.items()}
        self._hashes: list[int] | None = None

    def hashes(self) -> list[int]:
        # zlib's CRC, not hash(): Python salts str hashes per process.
        if self._hashes is None:
            values = [zlib.crc32(v.encode()) for v in self.parts.values()]
            self._hashes = values + [0] * (_HASHES - len(values))
        return self._hashes

_REDUCE_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}

# torch 2.13 renamed all_gather_into_tensor (and warns on the old name); torch 2.11 has only that.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ShardGroup:
    """A process group as the staged step uses it: the collectives of one step, in a fixed order."""

    def __init__(self, group: Any):
        self.group = group
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        # NCCL moves CUDA tensors only; gloo moves CPU tensors (and CUDA ones through a copy).
        backend = dist.get_backend(self.group)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def _gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        mine = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        every = torch.empty(self.size * len(values), dtype=torch.int64, device=self.device)
        _all_gather(every, mine, group=self.group)
        return every.view(self.size, len(values)).tolist()

    def _exchange(
        self, phase: int, error: BaseException | None, examples: int = 0, signature: Signature | None = None
    ) -> list[int]:
        """One status exchange (an all-gather of a record of the same width at every exchange, so that ranks
        at different exchanges see it rather than wait): where this rank is, whether it failed, its number
        of examples and the hashes of what must agree. **Returns** every rank's ``examples``."""
        code = _OK if error is None else _OOM if isinstance(error, (OutOfMemoryError, torch.OutOfMemoryError)) else _FAILED
        hashes = signature.hashes() if signature is not None else [0] * _HASHES
        rows = self._gather_ints([phase, code, examples, *hashes])
        codes = [r[1] for r in rows]
        if any(codes):
            self._raise(error, codes)
        if len({r[0] for r in rows}) > 1:
            where = ", ".join(f"rank {r} at {_PHASES[row[0]]}" for r, row in enumerate(rows))
            raise StagingError(
                f"the ranks of the process group are out of step ({where}): one ran a step (or a lazy "
                "flush) the others did not.\nWhat to do: make every rank run the same steps, in the same order."
            ) from error
        if any(r[3:] != rows[0][3:] for r in rows):
            self._mismatch(signature)
        return [r[2] for r in rows]

    def shard_sizes(self, local: int | BaseException, signature: Signature | None = None) -> list[int]:
        """Every rank's number of examples (one all-gather). ``local`` is an error when this rank could not
        tell its own: then every rank raises. ``signature`` (the arguments' structure, dtypes and non-batch
        shapes, the step's identity) must be the same on every rank, or every rank raises
        :class:`~stagetorch.errors.RankMismatchError`."""
        error = local if isinstance(local, BaseException) else None
        return self._exchange(_SIZES, error, 0 if error is not None else local, signature)

    def global_sizes(self, describe: Callable[[], tuple[int, Signature]], what: str) -> list[int]:
        """Every rank's number of examples. ``describe()`` checks this rank's arguments and returns its
        example count and the call's signature; if it raises on any rank, the signatures differ or the global
        batch is empty, every rank raises (``what`` names the caller in the last message)."""
        try:
            local, signature = describe()
        except Exception as e:
            self.shard_sizes(e)
            raise
        sizes = self.shard_sizes(local, signature)
        if sum(sizes) == 0:
            raise ShapeError(f"{what}: the global batch is empty: every rank of the process group passed 0 examples ({sizes})")
        return sizes

    def check(self, error: BaseException | None, signature: Signature | None = None) -> None:
        """Agree that every rank may go on (one all-gather): if any rank failed, every rank raises; if the
        ``signature`` (the staged program's) differs, every rank raises ``RankMismatchError``."""
        self._exchange(_PLAN, error, 0, signature)

    def _raise(self, error: BaseException | None, codes: list[int]) -> None:
        # Every rank knows someone failed, so all take part in sharing the messages, and all raise the same.
        messages: list[Any] = [None] * self.size
        mine = None if error is None else (f"{type(error).__name__}: {error}", getattr(error, "smallest_budget", None))
        dist.all_gather_object(messages, mine, group=self.group)
        failed = [r for r, c in enumerate(codes) if c]
        text = "; ".join(f"rank {r} of {self.size}: {(messages[r] or ('failed',))[0].rstrip('.')}" for r in failed)
        if all(codes[r] == _OOM for r in failed):
            oom = OutOfMemoryError(
                f"{text}.\nEvery rank stopped before changing parameters or .grad. What to do: give that rank a "
                "larger memory_budget or fewer examples (shards may differ in size)."
            )
            # The smallest memory_budget each rank that ran out named, and this rank's own (None on a rank that fitted).
            oom.smallest_budgets = {r: messages[r][1] for r in failed if messages[r] and messages[r][1] is not None}
            oom.smallest_budget = oom.smallest_budgets.get(self.rank)
            raise oom from error
        raise StagingError(
            f"the step failed on {text}.\nEvery rank stopped before changing parameters or .grad."
        ) from error

    def _mismatch(self, signature: Signature | None) -> None:
        # Every rank saw the hashes differ: all share their descriptions (rare, so the object collective's
        # cost does not matter) and raise the same error, naming the first rank that differs from rank 0.
        every: list[Any] = [None] * self.size
        dist.all_gather_object(every, None if signature is None else signature.parts, group=self.group)
        first = every[0] or {}
        for r, parts in enumerate(every[1:], 1):
            for aspect, text in (parts or {}).items():
                if first.get(aspect) != text:
                    raise RankMismatchError(
                        f"rank {r} of {self.size} differs from rank 0 in {aspect}: rank 0 has {first.get(aspect)}, "
                        f"rank {r} has {text}.\nEvery rank stopped before changing parameters or .grad. What to "
                        "do: call the step on every rank with arguments of the same structure, dtypes and shapes "
                        "but the batch dimension (and the same Python values), so that every rank stages the "
                        "same program."
                    )
        raise RankMismatchError(f"the ranks of the process group staged different programs ({every}).")

    def merge(self, values: dict[Var, torch.Tensor], kinds: dict[Var, str]) -> None:
        """All-reduce, in place, every reduction partial in ``values`` (by its kind: sum, max, min), in
        buckets of at most ``BUCKET_BYTES`` per dtype, all in flight at once. ``values`` must be in the
        same order on every rank."""
        self._exchange(_MERGE, None)
        groups: dict[tuple, list[torch.Tensor]] = {}
        for v, x in values.items():
            kind = kinds.get(v)
            if kind in _REDUCE_OPS:
                groups.setdefault((kind, x.dtype, x.device), []).append(x)
        pending = []
        for (kind, _, _), tensors in sorted(groups.items(), key=lambda kv: (kv[0][0], str(kv[0][1]), str(kv[0][2]))):
            for bucket in _buckets(tensors):
                flat = torch.cat([t.reshape(-1) for t in bucket])
                moved = flat.to(self.device)
                work = dist.all_reduce(moved, op=getattr(dist.ReduceOp, _REDUCE_OPS[kind]), group=self.group, async_op=True)
                pending.append((work, moved, bucket))
        for work, moved, bucket in pending:
            work.wait()
            for t, part in zip(bucket, moved.to(bucket[0].device).split([t.numel() for t in bucket])):
                t.copy_(part.view_as(t))


def _buckets(tensors: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > BUCKET_BYTES:
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket


@attrs.frozen
class LaidOutAval(Aval):
    """An aval and the strides of a tensor of it: a global batch the tracer stages for a rank's shard, laid
    out as the shard is."""

    strides: tuple[int, ...] = attrs.field(default=(), converter=tuple)


def global_aval(x: torch.Tensor, dim: int, batch: int) -> LaidOutAval:
    """The aval ``x`` would have if its batch ``dim`` held the global ``batch``, with the strides of a dense
    tensor laid out as ``x`` (its dims in the order of ``x``'s strides: a channels-last shard stands for a
    channels-last global batch)."""
    if x.requires_grad:
        raise UnsupportedOpError(
            f"a batched argument of shape {tuple(x.shape)} requires grad; with process_group= the batched "
            "arguments must be data (detach them, or keep the differentiated tensor inside the function)."
        )
    shape = list(x.shape)
    shape[dim] = batch
    order = sorted(range(x.ndim), key=lambda d: -x.stride(d))  # outermost first; ties in the order of the dims
    strides = [0] * x.ndim
    step = 1
    for d in reversed(order):
        strides[d] = step
        step *= max(shape[d], 1)
    return LaidOutAval(tuple(shape), x.dtype, x.device, tuple(strides))


def _positions(split: Split) -> dict[Var, tuple[int, int]]:
    """Each value the split's graph makes, by (equation, output): an order every rank shares."""
    return {v: (i, j) for i, e in enumerate(split.graph.eqns) for j, v in enumerate(e.outvars) if v is not None}


def merge_signature(split: Split) -> tuple:
    """What :func:`run_shard` all-reduces, merge by merge, in order: (kind, aval) per partial. Every rank
    must merge the same: a rank that recomputes runs another graph's split, whose merges may differ (a
    recomputed normaliser is one more global), and its collectives would not match the others'."""
    made_by = {v: e for e in split.graph.eqns for v in e.outvars if v is not None}
    position = _positions(split)
    makes = [split.normaliser_pass] if split.globals else []
    makes += [split.reduction_pass] if split.reduced_for_globals else []
    merges = []
    for make in [*makes, split.body]:
        results = sorted(make(1).results, key=lambda r: position.get(r[0], (-1, 0)))
        # Each partial named by what made it (its op and source line), so that two of one shape cannot swap.
        merges.append(tuple(
            (kind, str(v.aval), str(made_by[v].source) if v in made_by else "")
            for v, kind in results if kind in _REDUCE_OPS
        ))
    return tuple(merges)


def plan_shard(split: Split, graph: Graph, examples: int, budget: int) -> Plan:
    """Chunk sizes for this rank's ``examples`` within its own ``budget``; raises ``OutOfMemoryError``.

    The shard always runs through the split graphs (its counts are the global batch's), so the whole shard
    at once is costed as one chunk of it. A rank with no examples is planned at a chunk of one's peak (it
    runs none, and is never refused). The global batch's inputs are counted as resident, which is
    conservative for a rank that holds a small shard.
    """
    if examples == 0:
        # It runs no chunk, but what runs around the chunks (the shared values, the zero accumulators, the
        # merges): bounded by a chunk of one example's peak, which is what its plan says it may reach.
        return Plan(0, (0,), (0,), budget, 0, "This rank has no examples: it adds zero to every sum.",
                    phase_peak_bytes=chunked_peak(split, 1, peak_bytes))
    whole = chunked_peak(split, examples, peak_bytes)
    return plan_chunks(graph, lambda: split, examples, budget, peak_bytes, whole)


def run_shard(
    split: Split,
    inputs: list[torch.Tensor],
    sizes: Sequence[int],
    offset: int,
    group: ShardGroup,
    *,
    on_chunk: Callable[[int, int], None] | None = None,
    undo: Any = None,
    keep_partial: Collection[int] = (),
) -> tuple[list, list[tuple[int, torch.Tensor]], set[int]]:
    """Run this rank's examples ``[offset, offset + sum(sizes))`` of the staged global batch in chunks of
    ``sizes``, merging the reductions with the other ranks'. ``undo``: as
    :func:`~stagetorch.interpreters.chunked.run_chunked`'s. ``keep_partial``: input positions whose gradient
    the caller reduces itself (FSDP2's reduce-scatter): each that is a partial sum of the chunk loop which
    nothing after the loop reads is left out of the all-reduce.

    **Returns** outputs and gradients, global, and the positions of ``keep_partial`` whose gradient came
    back as this rank's partial sum (the others were merged, or made after the merge alike on every rank)."""
    merges = 1 + bool(split.globals) + bool(split.reduced_for_globals)
    kept = {v: i for i, v in split.graph.grads if i in keep_partial} if keep_partial else {}
    if kept:
        kept = _partial_sources(split.post, kept)
    partial: set[int] = set()
    done = 0
    merging = False
    # Every rank must lay its partials out in the same order; the executor's follows sets of Vars, whose
    # order is each process's own. By the equation that makes each and its place among that equation's
    # outputs: two outputs of one equation (a convolution's weight and bias gradients) tied on the
    # equation alone, and went in each rank's own order: all-reduced crosswise, wrong (found by a probe).
    position = _positions(split)

    def merge(values: dict[Var, torch.Tensor], kinds: dict[Var, str]) -> None:
        nonlocal done, merging
        merging = True
        if kept and done == merges - 1:  # the chunk loop's merge: FSDP2's gradients stay partial sums
            partial.update(i for v, i in kept.items() if v in values)
            values = {v: x for v, x in values.items() if v not in kept}
        group.merge(dict(sorted(values.items(), key=lambda item: position[item[0]])), kinds)
        merging = False
        done += 1

    try:
        outs, grads, _ = run_chunked(split, inputs, sizes, on_chunk=on_chunk, offset=offset, combine=merge, undo=undo)
        return outs, grads, partial
    except Exception as e:
        # The other ranks wait in the next status exchange: take part with this failure, so that every
        # rank raises now. A failure inside a merge (another rank's, or the collective's) is already shared.
        if merging or done == merges:
            raise
        group.check(e)
        raise


# Ops that only lay a tensor out anew: applied to each rank's partial sum, their result is the partial sum of
# what they make of the global one (a Linear weight's gradient is the transpose of the loop's sum).
_LAYOUT_OPS = frozenset({
    torch.ops.aten.t.default, torch.ops.aten.view.default, torch.ops.aten.reshape.default,
    torch.ops.aten._unsafe_view.default, torch.ops.aten.permute.default, torch.ops.aten.transpose.int,
    torch.ops.aten.squeeze.dim, torch.ops.aten.unsqueeze.default,
})


def _partial_sources(post: Graph, grads: dict[Var, int]) -> dict[Var, int]:
    """The loop results that may stay partial sums for the gradients ``grads`` (Var -> input position): a
    gradient the post phase does not make or read, or the loop's sum a chain of layout ops in the post phase
    turns into it, read by nothing else there."""
    made = {o: e for e in post.eqns for o in e.outvars}
    outputs = set(post.outvars)  # a loop result the post phase hands on as it is must be the global one
    readers: dict[Var, int] = {}
    for e in post.eqns:
        for v in e.invars:
            readers[v] = readers.get(v, 0) + 1
    out = {}
    for v, i in grads.items():
        cur = v
        while cur in made:
            e = made[cur]
            ins = list(e.invars)
            if e.prim not in _LAYOUT_OPS or len(ins) != 1 or len(e.outvars) != 1:
                break
            if readers.get(cur, 0) != (0 if cur is v else 1) or (cur is not v and cur in outputs):
                break
            cur = ins[0]
        if cur in made:  # not a loop result (or not by layout ops alone): merged
            continue
        if readers.get(cur, 0) != (0 if cur is v else 1) or (cur is not v and cur in outputs):
            continue
        out[cur] = i
    return out


@contextlib.contextmanager
def staging(state: State, process_group: Any) -> Iterator[None]:
    """While tracing: a ``DistributedDataParallel`` wrapper is traced as the module it wraps (its reduction
    is the group's merge) when the step has a process group, and refused otherwise; ``SyncBatchNorm`` in
    training is refused, since it couples the examples of every rank and chunk. A ``fully_shard``-ed module
    (FSDP2) is staged without FSDP2's forward hooks, on the parameters the caller gathered
    (:func:`stagetorch.parallel.fsdp.gathered`), and refused where they are not."""
    wrappers = []
    sharded: list[torch.nn.Module] = []  # FSDP2 units, gathered by the caller: staged without their hooks
    units_of = fsdp.unit_class()
    seen: set[int] = set()
    for name, root in state.modules:
        for sub_name, m in root.named_modules():
            if id(m) in seen:
                continue
            seen.add(id(m))
            where = ".".join(p for p in (name, sub_name) if p) or type(m).__name__
            if isinstance(m, torch.nn.SyncBatchNorm) and m.training and _coupled(process_group):
                raise BatchCouplingError(
                    f"{where} is a SyncBatchNorm in training mode: it normalises with statistics of the whole "
                    "global batch, so running it in shards and chunks would change the result.\nWhat to do: use "
                    "GroupNorm or LayerNorm, or put the normalisation layers in eval mode (model.eval())."
                )
            if units_of is not None and isinstance(m, units_of):
                fsdp.refuse_sharded(where, m, process_group)
                sharded.append(m)
            if isinstance(m, torch.nn.parallel.DistributedDataParallel):
                if process_group is None:
                    raise UnsupportedOpError(
                        f"{where} is wrapped in DistributedDataParallel, whose gradient averaging stagetorch "
                        "cannot stage.\nWhat to do: pass process_group= to stagetorch.jit (e.g. "
                        f"process_group={where}.process_group): the step then reduces the gradients of the global "
                        "batch exactly, and the wrapper is traced as the module it wraps."
                    )
                wrappers.append(m)
    # An instance attribute shadows the class's forward (nn.Module's setattr would register a submodule).
    for m in wrappers:
        object.__setattr__(m, "forward", m.module)
    try:
        with fsdp.hooks_off(sharded):
            yield
    finally:
        for m in wrappers:
            object.__delattr__(m, "forward")


def _coupled(process_group: Any) -> bool:
    if process_group is not None:
        return True
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

"""A staged graph ready to run on real inputs: :class:`Executable`, which every front end (``jit``, ``lazy``)
runs its programs through, unchunked when the batch fits, else in exact chunks, recomputing where its
:class:`~stagetorch.planner.Planner` says so.

An Executable compiles and runs; it decides nothing about memory. Its caller gets the plan for a budget from
the executable's planner and hands it down; the executable runs that plan (:mod:`stagetorch.execute`,
:mod:`stagetorch.chunking`, :mod:`stagetorch.distributed`) and tells the planner what ran
(:meth:`~stagetorch.planner.Planner.remember`).
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable
from typing import Any

import torch

from . import distributed
from .batching import Batched
from .chunking import Split, is_oom, run_chunked
from .costing import allocated
from .cutting import CutPlan, run_cut
from .errors import BatchCouplingError, OutOfMemoryError
from .execute import Program, Undo
from .ir import Graph, Var, op_name
from .passes import writes
from .planner import COPIES, Planner
from .planning import Plan
from .remat_planning import RematPlan

__all__ = ["Executable"]

log = logging.getLogger("stagetorch")


class Executable:
    """A staged graph ready to run on real inputs: unchunked when the batch fits, else in exact chunks.

    Front ends (``jit``, ``lazy``) build one per staged program, get the plan for their budget from its
    :attr:`planner` and call :meth:`run` with it. The compiled program is made on first use and kept; the
    plans, per budget, are its :attr:`planner`'s (a ``cap`` or ``remat``
    given here is the planner's). A plan that recomputes runs through an Executable of the recomputing
    graph, which shares that graph's planner.
    """

    def __init__(
        self, graph: Graph, batched: dict[Var, Batched], batch: int, consts: list[torch.Tensor] | None = None,
        *, cap: int | None = None, remat: bool = False, planner: Planner | None = None, cut_coupled: bool = False,
    ):
        self.graph = graph
        self.batched = batched
        self.batch = batch
        self.consts = [] if consts is None else consts
        self.planner = (
            Planner(graph, batched, batch, cap=cap, remat=remat, cut_coupled=cut_coupled) if planner is None else planner
        )
        self._program: Program | None = None
        self._mutated: list[int] | None = None  # see the ``mutated`` property
        self._guarded: list[int] | None = None  # see the ``guarded`` property
        self._restoring: tuple[int, list[str]] | None = None  # see the ``restoring`` property
        # The Executables of the recomputing graphs the planner chose, each with that graph's planner.
        self._inner: dict[Graph, Executable] = {}
        self._signature: distributed.Signature | None = None

    @property
    def mutated(self) -> list[int]:
        """Positions of the inputs the program updates in place: the caller's state a failed run restores."""
        if self._mutated is None:
            self._mutated = _mutated_inputs(self.graph)
        return self._mutated

    @property
    def guarded(self) -> list[int]:
        """Positions of the inputs a run copies before it writes them, to restore them if it fails: those it
        writes outside its commit (see :func:`stagetorch.execute.commit_plan`). An optimizer stepped last
        is a commit and copies nothing; a forward's BatchNorm statistics are copied."""
        if self._guarded is None:
            position = {v: i for i, v in enumerate(self.graph.invars)}
            roots = {v.root: i for v, i in position.items()}
            saved = self.program.commit.saved_inputs
            self._guarded = sorted({roots[v.root] for v in saved if v.root in roots})
        return self._guarded

    @property
    def restore_bytes(self) -> int:
        """Bytes of the copies a run makes of the inputs it writes outside its commit, beside the program
        (none when it writes none there). A caller that plans for its own budget leaves them out of it."""
        return self.restoring[0]

    @property
    def restoring(self) -> tuple[int, list[str]]:
        """What a run holds beside the program: the bytes of its copies (:attr:`restore_bytes`) and why, as
        :meth:`~stagetorch.planner.Planner.plan_call` takes them (fixed by the graph: kept)."""
        if self._restoring is None:
            device = self.graph.device
            copied = {v: allocated(v.aval.nbytes, device) for v in (self.graph.invars[i] for i in self.guarded)}
            self._restoring = (sum(copied.values()), [COPIES.format(len(self.guarded))])
        return self._restoring

    @property
    def program(self) -> Program:
        if self._program is None:
            self._program = Program(self.graph, final=True)
        return self._program

    # What the planner holds, as front ends and tests read it off the Executable.

    @property
    def cap(self) -> int | None:
        """The largest chunk known to run (see :meth:`~stagetorch.planner.Planner.remember`)."""
        return self.planner.cap

    @property
    def remat(self) -> bool:
        """Whether the planner may recompute forward values in the backward where the batch does not fit."""
        return self.planner.remat

    @remat.setter
    def remat(self, value: bool) -> None:
        self.planner.remat = value

    @property
    def shard_plans(self) -> dict[tuple, Plan | OutOfMemoryError]:
        return self.planner.shard_plans

    def split(self) -> Split:
        """The graph split for chunking, which the planner costs and :meth:`run` runs."""
        return self.planner.split()

    def plan(self, budget: int) -> Plan:
        """The plan a run within ``budget`` bytes follows (the planner's, kept per budget)."""
        return self.planner.plan(budget)

    def shard_plan(self, examples: int, budget: int) -> Plan | OutOfMemoryError:
        """This rank's plan for its ``examples`` of the global batch the graph is staged for, within its own
        ``budget`` less the copies a run makes (``restore_bytes``): see
        :meth:`~stagetorch.planner.Planner.shard_plan`."""
        # run_shard copies what the program writes outside its commit, beside it
        return self.planner.shard_plan(examples, budget, *self.restoring)

    def _for(self, graph: Graph) -> Executable:
        """The Executable of a recomputing graph the planner chose (same inputs, that graph's planner)."""
        planner = self.planner.recomputing(graph)
        inner = self._inner.get(graph)
        if inner is None or inner.planner is not planner:  # the planner starts afresh once it sees its inputs
            inner = self._inner[graph] = Executable(graph, self.batched, self.batch, self.consts, planner=planner)
        return inner

    def run(
        self, inputs: list, plan: Plan, *, on_chunk: Callable[[int, int], None] | None = None, name: str = "step"
    ) -> tuple[list, list[tuple[int, torch.Tensor]]]:
        """Run on real ``inputs`` (parallel to ``graph.invars``) as ``plan`` says: the plan the caller got
        from this executable's :attr:`planner` (:meth:`~stagetorch.planner.Planner.plan_call`, or
        :meth:`plan`) for its budget.

        **Returns** the flat outputs and the (input position, gradient) pairs to accumulate into ``.grad``.
        If anything fails, inputs the program updates in place (parameters, buffers, ``.grad``, optimizer
        state) are restored first: from the copies its programs took before writing them, or untouched
        because the failure came before the commit that writes them (:func:`~stagetorch.execute.commit_plan`).
        If the device runs out of memory where the plan said the step fits, the step is redone in smaller
        chunks, and later plans use the chunk size that ran (:meth:`~stagetorch.planner.Planner.remember`).
        """
        if self.planner.overlap is None:  # a caller that planned without the inputs: later plans count it
            self.planner.see_inputs(inputs)
        if isinstance(plan, RematPlan) and plan.recompute is not None and plan.recompute.graph is not self.graph:
            # The recomputing graph runs in the chunks the plan gives (its planner's, at the same budget).
            inner = self._for(plan.recompute.graph)
            result = inner.run(inputs, plan, on_chunk=on_chunk, name=name)
            self.planner.learn(inner.planner.cap)  # if it ran out of memory: plan again with what ran
            return result
        if isinstance(plan, CutPlan):  # a step whose examples meet, cut there (stagetorch.cutting)
            log.info("stagetorch: %s: %s", name, plan)
            undo = Undo(inputs[i] for i in self.mutated)
            try:
                return run_cut(plan.cut, inputs, plan, undo)
            except BaseException:
                undo.restore()
                raise
        mutated = self._mutated  # (the properties' values once made, read directly: a step's hot path)
        if mutated is None:
            mutated = self.mutated
        if not mutated and len(plan.chunk_sizes) == 1:  # one call, nothing to restore if it fails
            program = self._program
            if program is None:
                program = self.program
            try:
                return program.run(inputs)
            except Exception as e:
                if not is_oom(e) or self.batch == 1:
                    raise
                return self._recover(inputs, e, on_chunk, name)
        undo = Undo(inputs[i] for i in mutated)
        try:
            if plan.chunked:
                log.info("stagetorch: %s: %s", name, plan)
                outs, grads, ran = run_chunked(self.split(), inputs, plan.chunk_sizes, on_chunk=on_chunk, undo=undo)
                self.planner.remember(plan.chunk_sizes, ran, name)
                return outs, grads
            return self.program.run(inputs, undo)
        except Exception as e:
            undo.restore()
            if not is_oom(e) or plan.chunked or self.batch == 1:
                raise
            return self._recover(inputs, e, on_chunk, name)
        except BaseException:
            undo.restore()
            raise

    def signature(self) -> distributed.Signature:
        """The staged program as the ranks of a process group compare it: its ops and their shapes."""
        if self._signature is None:
            g = self.graph
            made = {v: i for i, e in enumerate(g.eqns) for v in e.outvars if v is not None}
            text = "\n".join(f"{op_name(e.prim)} {[str(v.aval) for v in e.outvars if v is not None]}" for e in g.eqns)
            # Which values it outputs, too: the merges all-reduce the reductions among them.
            text += f"\n{[made.get(v, -1) if isinstance(v, Var) else -2 for v in g.outvars]}"
            last = f", the last at {g.eqns[-1].source}" if g.eqns else ""
            self._signature = distributed.Signature(
                the_staged_program=f"{len(g.eqns)} ops{last} (hash {zlib.crc32(text.encode()):08x}), "
                f"{len(g.invars)} inputs, {len(g.outvars)} outputs"
            )
        return self._signature

    def run_shard(
        self, inputs: list, plan: Plan, offset: int, group: distributed.ShardGroup,
        *, on_chunk: Callable[[int, int], None] | None = None,
    ) -> tuple[list, list[tuple[int, torch.Tensor]]]:
        """Run this rank's shard (examples ``[offset, offset + plan.batch)`` of the global batch) as
        :func:`stagetorch.distributed.run_shard` does, under ``plan`` (recomputing if it says so). **Returns**
        the outputs and gradients, global; if anything fails, inputs the program updates in place are
        restored first."""
        recompute = plan.recompute if isinstance(plan, RematPlan) else None
        split = self.split() if recompute is None else self._for(recompute.graph).split()
        undo = Undo(inputs[i] for i in self.mutated)
        try:
            return distributed.run_shard(split, inputs, plan.chunk_sizes, offset, group, on_chunk=on_chunk, undo=undo)
        except BaseException:
            undo.restore()
            raise

    def _recover(self, inputs: list, error: Exception, on_chunk: Any, name: str) -> tuple[list, list]:
        """The whole batch ran out of memory although the plan said it fits (the inputs it wrote already
        restored): redo it in two halves (and smaller, if those fail too)."""
        try:
            split = self.split()
        except BatchCouplingError as coupled:
            raise error from coupled
        half = self.batch // 2
        undo = Undo(inputs[i] for i in self.mutated)
        try:
            outs, grads, ran = run_chunked(split, inputs, [half, self.batch - half], on_chunk=on_chunk, undo=undo)
        except BaseException:
            undo.restore()
            raise
        self.planner.remember((self.batch,), ran, name)
        return outs, grads


def _mutated_inputs(graph: Graph) -> list[int]:
    """Positions of inputs that some equation writes in place (a buffer update, an in-place op on an arg,
    BatchNorm's running statistics though its schema does not say so: see :func:`stagetorch.passes.writes`)."""
    roots = {v: i for i, v in enumerate(graph.invars)}
    out: list[int] = []
    for e in graph.eqns:
        for x in writes(e):
            i = roots.get(x.root)
            if i is not None and i not in out:
                out.append(i)
    return out


"""A staged graph ready to run on real inputs: :class:`Executable`, which every front end (``jit``, ``lazy``)
runs its programs through, unchunked when the batch fits, else in exact chunks, recomputing where planned.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from . import _gc, distributed
from .batching import Batched, analyze
from .chunking import Split, is_oom, run_chunked
from .costing import allocated, peak_bytes
from .devices import bytes_ceiling, format_bytes
from .errors import BatchCouplingError, OutOfMemoryError, StagingError, UnsupportedOpError
from .execute import Program, Undo
from .ir import Graph, Var, op_name
from .passes import writes
from .planning import SAFETY_MARGIN, Plan, chunked_peak, plan_chunks
from .remat_planning import Recompute, RematPlan, frontier, plan_joint

__all__ = ["Executable", "held_beside", "COPIES"]

log = logging.getLogger("stagetorch")


@attrs.define
class Executable:
    """A staged graph ready to run on real inputs: unchunked when the batch fits, else in exact chunks.

    Front ends (``jit``, ``lazy``) build one per staged program and call :meth:`run`. The compiled program,
    the chunked split and the plan per budget are made on first use and kept. With ``remat``, a step that
    does not fit whole may recompute forward values in the backward (see :mod:`stagetorch.remat_planning`);
    such a plan runs through an Executable of the recomputing graph.
    """

    graph: Graph
    batched: dict[Var, Batched]
    batch: int
    consts: list[torch.Tensor] = attrs.field(factory=list)
    _program: Program | None = None
    _split: Split | None = None
    plans: dict[int, Plan] = attrs.field(factory=dict)
    _mutated: list[int] | None = None  # see the ``mutated`` property
    _guarded: list[int] | None = None  # see the ``guarded`` property
    _full_peak: int | None = None
    # The largest chunk known to run: set when a larger one ran out of memory, so later calls plan with it.
    cap: int | None = None
    # Bytes the graph counts twice because two of its inputs are views of one storage (known at the first run).
    _overlap: int | None = None
    remat: bool = False
    # The Executables of the recomputing graphs the joint planner made from this one, and its frontier.
    _inner: dict[Graph, Executable] = attrs.field(factory=dict)
    _merge_ok: dict[Graph, bool] = attrs.field(factory=dict)  # see _merges_as_planned
    _points: list[Recompute] | None = None
    # With a process group: this rank's plan per (shard size, budget), or the error that says none fits.
    shard_plans: dict[tuple, Plan | OutOfMemoryError] = attrs.field(factory=dict)
    _signature: distributed.Signature | None = None

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
        device = self.graph.device
        return sum({v: allocated(v.aval.nbytes, device) for v in (self.graph.invars[i] for i in self.guarded)}.values())

    @property
    def program(self) -> Program:
        if self._program is None:
            self._program = Program(self.graph, final=True)
        return self._program

    def split(self) -> Split:
        if self._split is None:
            self._split = Split(analyze(self.graph, self.batched, self.batch))
            if self._overlap:
                self._split.input_overlap = self._overlap
        return self._split

    @_gc.paused()  # the planner builds recomputing graphs and chunk graphs: many objects that all stay alive
    def plan(self, budget: int) -> Plan:
        # The device's free memory moves a little between calls: re-plan only when the answer can change.
        # The whole graph is costed once; a budget it fits in reuses one plan.
        if self._full_peak is None:
            self._full_peak = peak_bytes(self.graph) - (self._overlap or 0)
        fits = self._full_peak <= budget * (1 - SAFETY_MARGIN) and self.cap is None
        # Chunked plans are kept per budget to about 0.4% (its top 9 bits).
        key = -1 if fits else budget >> max(budget.bit_length() - 9, 0) << max(budget.bit_length() - 9, 0)
        if key not in self.plans:
            if self.remat and not fits and _owns_its_inputs(self.graph):
                self.plans[key] = plan_joint(
                    self.graph, budget, lambda g, peak=None: self._chunk_plan(g, budget, peak), self._floor, self._frontier,
                    batch=self.batch,
                )
            else:
                self.plans[key] = plan_chunks(
                    self.graph, self.split, self.batch, budget, peak_bytes, self._full_peak, cap=self.cap
                )
        return self.plans[key]

    def _frontier(self) -> list[Recompute]:
        if self._points is None:
            self._points = frontier(self.graph)
        return self._points

    def _for(self, graph: Graph) -> Executable:
        """The Executable of a recomputing graph the joint planner made from this one (same inputs)."""
        if graph not in self._inner:
            self._inner[graph] = Executable(
                graph, self.batched, self.batch, self.consts, cap=self.cap, overlap=self._overlap
            )
        return self._inner[graph]

    def _chunk_plan(self, graph: Graph, budget: int, peak: int | None = None) -> Plan:
        """The chunk plan of ``graph`` (this one, or a recomputing graph made from it, whose whole-batch
        ``peak`` the joint planner may know: its simulation costs it as the memory interpreter does)."""
        if graph is self.graph:
            return plan_chunks(self.graph, self.split, self.batch, budget, peak_bytes, self._full_peak, cap=self.cap)
        inner = self._for(graph)
        if peak is not None and inner._full_peak is None:
            inner._full_peak = peak - (self._overlap or 0)
        # A chunk that ran out of memory here is not tried for a recomputing graph either (it needs no more).
        if self.cap is not None and (inner.cap is None or inner.cap > self.cap):
            inner.cap = self.cap
            inner.plans.clear()
        return inner.plan(budget)

    def _floor(self, graph: Graph) -> int:
        """The fewest bytes ``graph`` runs in: one example per chunk, or the whole batch if that is less (a
        batch of one, whose chunked form only adds copies) or if it cannot be split."""
        whole = peak_bytes(graph) - (self._overlap or 0)
        if self.batch == 1:
            return whole
        try:
            return min(whole, chunked_peak(self.split() if graph is self.graph else self._for(graph).split(), 1, peak_bytes))
        except (BatchCouplingError, UnsupportedOpError):
            return whole

    def _shard_floor(self, graph: Graph) -> int:
        """The fewest bytes ``graph`` runs a shard in: one example per chunk (a shard always runs through the
        split graphs, even whole: see :func:`distributed.plan_shard`). A recompute set a shard may not run
        (:meth:`_merges_as_planned`) has no floor."""
        if not self._merges_as_planned(graph):
            return 1 << 62
        return chunked_peak(self.split() if graph is self.graph else self._for(graph).split(), 1, peak_bytes)

    def _merges_as_planned(self, graph: Graph) -> bool:
        """Whether a shard running ``graph`` (this graph or one recomputing) all-reduces the same partials,
        in the same order, as one running this graph: ranks choose their recompute sets apart, by their own
        budgets, and their collectives must match (a recomputed normaliser is one more merged value)."""
        if graph is self.graph:
            return True
        if graph not in self._merge_ok:
            self._merge_ok[graph] = distributed.merge_signature(self._for(graph).split()) == distributed.merge_signature(self.split())
        return self._merge_ok[graph]

    def run(
        self, inputs: list, budget: int, *, on_chunk: Callable[[int, int], None] | None = None, name: str = "step"
    ) -> tuple[list, list[tuple[int, torch.Tensor]]]:
        """Run on real ``inputs`` (parallel to ``graph.invars``) within ``budget`` bytes.

        **Returns** the flat outputs and the (input position, gradient) pairs to accumulate into ``.grad``.
        If anything fails, inputs the program updates in place (parameters, buffers, ``.grad``, optimizer
        state) are restored first: from the copies its programs took before writing them, or untouched
        because the failure came before the commit that writes them (:func:`~stagetorch.execute.commit_plan`).
        If the device runs out of memory where the plan said the step fits, the step is redone in smaller
        chunks, and later calls plan with the chunk size that ran.
        """
        if self._overlap is None:
            self._see_inputs(inputs)
        plan = self.plan(budget)
        if isinstance(plan, RematPlan) and plan.recompute is not None:
            inner = self._for(plan.recompute.graph)
            result = inner.run(inputs, budget, on_chunk=on_chunk, name=name)
            if inner.cap is not None and inner.cap != self.cap:  # it ran out of memory: plan again with what ran
                self.cap = inner.cap
                self.plans.clear()
            return result
        mutated = self.mutated
        if not mutated and len(plan.chunk_sizes) == 1:  # one call, nothing to restore if it fails
            try:
                return self.program.run(inputs)
            except Exception as e:
                if not is_oom(e) or self.batch == 1:
                    raise
                return self._recover(inputs, e, on_chunk, name)
        undo = Undo(inputs[i] for i in mutated)
        try:
            if plan.chunked:
                log.info("stagetorch: %s: %s", name, plan)
                outs, grads, ran = run_chunked(self.split(), inputs, plan.chunk_sizes, on_chunk=on_chunk, undo=undo)
                self._remember(plan.chunk_sizes, ran, name)
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

    def shard_plan(self, examples: int, budget: int) -> Plan | OutOfMemoryError:
        """This rank's plan for its ``examples`` of the global batch the graph is staged for, within its own
        ``budget`` less the copies a run makes (``restore_bytes``): chunks, and with ``remat`` recomputation
        where the smallest chunk does not fit (or it is cheaper). **Returns** the ``OutOfMemoryError`` that
        says none fits (every rank must learn it first)."""
        held = self.restore_bytes  # run_shard copies what the program writes outside its commit, beside it
        budget = max(budget - held, 0)
        # Plans are kept per budget to about 0.4% (its top 9 bits), as plan() keeps them (a plan made for
        # a budget up to 0.4% larger is within this one's safety margin); an error only for its own budget:
        # the smallest budget it names may lie in the same 0.4%, and must plan.
        shift = max(budget.bit_length() - 9, 0)
        key = (examples, budget >> shift << shift)
        plan = self.shard_plans.get((examples, budget, "error")) or self.shard_plans.get(key)
        if plan is None:

            def chunk_plan(graph: Graph, peak: int | None = None) -> Plan:
                split = self.split() if graph is self.graph else self._for(graph).split()
                if not self._merges_as_planned(graph):
                    raise OutOfMemoryError("this recompute set merges other partials than the other ranks'")
                return distributed.plan_shard(split, graph, examples, budget)

            try:
                if self.remat and _owns_its_inputs(self.graph):
                    plan = plan_joint(self.graph, budget, chunk_plan, self._shard_floor, self._frontier)
                else:
                    plan = chunk_plan(self.graph)
            except OutOfMemoryError as e:
                plan = held_beside(e, held, [COPIES.format(len(self.guarded))])
            except (BatchCouplingError, UnsupportedOpError) as e:
                # A shard runs through the split graphs at any budget: no budget runs a step that cannot be
                # split, so the chunk planner's own error, without the smallest budget recomputation names.
                cause = e.__cause__
                raise (cause if type(cause) is type(e) else e) from None
            self.shard_plans[(examples, budget, "error") if isinstance(plan, OutOfMemoryError) else key] = plan
        return plan

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

    def _see_inputs(self, inputs: list) -> None:
        """Inputs that are views of one storage (a weight and its transpose handed to a lazy flush) are
        separate values in the graph: the plan counts their storage once."""
        groups: dict[int, dict[Var, int]] = {}
        for v, x in zip(self.graph.invars, inputs):
            if isinstance(x, torch.Tensor) and x.device.type != "meta":
                groups.setdefault(x.untyped_storage().data_ptr(), {})[v.root] = v.root.owned_nbytes
        overlap = sum(sum(g.values()) - max(g.values()) for g in groups.values() if len(g) > 1)
        self._overlap = overlap
        if overlap:
            self.plans.clear()
            self._inner.clear()
            self._full_peak = None
            if self._split is not None:
                self._split.input_overlap = overlap

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
        self._remember((self.batch,), ran, name)
        return outs, grads

    def _remember(self, planned: Sequence[int], ran: Sequence[int], name: str) -> None:
        if max(ran) >= max(planned):
            return
        self.cap = max(ran)
        self.plans.clear()
        log.warning(
            "stagetorch: %s: out of memory where the plan said a chunk of %d fits; ran in chunks of at most %d, "
            "and later calls will too", name, max(planned), self.cap,
        )


def _owns_its_inputs(graph: Graph) -> bool:
    """Whether every input lives in storage the graph itself names. A lazy flush can read a view of a value
    an earlier flush made, whose base is not in the graph: the recomputation planner numbers only the
    graph's own vars (``remat_planning._Simulator``), so such a flush is only chunked."""
    own = set(graph.vars())
    return all(v.root in own for v in graph.invars)


# Why a call holds bytes beside its program, as held_beside says it.
COPIES = "copies of the {} input(s) the step updates in place, to restore them if it fails"


def held_beside(error: StagingError, held: int, why: list[str]) -> StagingError:
    """``error`` (about a budget too small for the program) with what the call holds beside the program,
    ``held`` bytes for the reasons ``why``, added to the smallest budget it names; as it is if it names
    none or nothing is held."""
    if not held or error.smallest_budget is None:
        return error
    wider = type(error)(
        f"{error} Besides the program, this call holds {format_bytes(held)} ({'; '.join(why)}), which the "
        f"budgets above leave out: the smallest memory_budget this call fits in is "
        f"{format_bytes(bytes_ceiling(error.smallest_budget + held))}."
    )
    wider.smallest_budget = error.smallest_budget + held
    return wider



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


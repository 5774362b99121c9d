"""The planner: how one staged graph runs within a budget.

A :class:`Planner` belongs to one staged graph. Given a budget, and what the call holds beside the program
(the copies it keeps to restore a failed step, each ``.grad`` the step replaces or adds into), it returns
the plan: the chunk sizes and, with ``remat``, the recompute set (chosen by
:func:`stagetorch.planning.remat_search.plan_joint`; the chunks of each candidate sized by
:func:`stagetorch.planning.chunks.plan_chunks`). It keeps its plans per budget, the planners of the recomputing
graphs it chose among, and what runs taught it: the largest chunk known to run (``cap``) and, below chunks
of one, the largest program budget (``ceiling``), both learned when a run ran out of memory
(:meth:`Planner.shrink`), and on CUDA what the first run measured beyond its plan (``calibration``). What a
program learned outlives its planner (:func:`recall`): a step staged again, or a one-line step recorded
again, plans with it.

It runs nothing. A budget goes down: a front end (:mod:`~stagetorch.runtime.staged`: the step's budget and what the
call holds; the one-line mode's flush: the budget and the copies a run keeps) -> :meth:`Planner.plan_call`
-> :mod:`~stagetorch.planning.remat_search` and :mod:`~stagetorch.planning.chunks` -> :mod:`~stagetorch.interpreters.memory`. The plan
comes back to the front end, which hands it to :meth:`stagetorch.runtime.executable.Executable.run`; what a run
learns comes back to the planner as a call from the executable (:meth:`Planner.shrink`,
:meth:`Planner.calibrate`), never as a call up from a lower module.
"""

from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Sequence

import attrs
import torch

from ..devices.budget import bytes_ceiling, format_bytes
from ..devices.catalog import Device
from ..errors import (
    BatchCouplingError,
    BatchStatisticsError,
    OutOfMemoryError,
    StagingError,
    UnsupportedOpError,
)
from ..interpreters.batching import Batched, analyze
from ..interpreters.chunked import Split
from ..interpreters.memory import allocated, peak_bytes
from ..ir import Graph, Var, op_name
from ..parallel import data_parallel as distributed
from ..transforms.batch_norm_sums import as_batch_sums
from ..utils import caches, collector
from . import budget as margin
from . import plans
from .chunks import Plan, base_bytes, chunked_peak, plan_chunks
from .cut import Cut, cut_floor, find_cut, plan_cut
from .multipass import Passes, PassesPlan, find_passes, passes_floor, plan_passes
from .remat_frontier import chunk_frontier, frontier
from .remat_search import plan_joint
from .remat_simulator import Recompute
from .reserved import fit_reserved, on_cuda

__all__ = ["Planner", "held_beside", "recall", "remember", "COPIES"]

log = logging.getLogger("stagetorch")


def _saying_where(short: OutOfMemoryError, coupled: BatchCouplingError) -> OutOfMemoryError:
    """The cut's error (no budget below ``short``'s smallest runs the step cut where its examples meet) with
    why the analysis found them meeting there and what it advised (``coupled``): where that is a batch on the
    wrong dim, moving it is the real fix, and the cut's error alone would only ask for more memory."""
    why, _, fix = str(coupled).partition("\nWhat to do: ")
    said = f"{short}\nWhy they meet there: {why.split(chr(10))[0]}"
    if fix:
        said += f"\nOr, if they should not meet there: {fix.split(chr(10))[0].split('. Recomputing ')[0].rstrip('.')}."
    return OutOfMemoryError(said).copy_from(short)


@attrs.define
class Planner:
    """The plans of one staged graph: per budget, its chunk sizes, and with ``remat`` what it recomputes.

    The chunked split, the whole graph's peak, the recompute frontier and each plan are made on first use
    and kept; a plan is made again only when the budget moves by more than about 0.4%, or when what ran
    says it must be (:meth:`shrink`, :meth:`calibrate`).
    """

    graph: Graph
    batched: dict[Var, Batched]
    batch: int
    # The largest chunk known to run: set when a larger one ran out of memory, so later calls plan with it.
    cap: int | None = None
    # The largest program budget known to run, once chunks of one ran out of memory (plans recompute below it).
    ceiling: int | None = None
    # Bytes a CUDA run needed beyond its plan (the allocator's segments, library workspaces): later plans
    # leave them out of the budget. None until the first run on CUDA measured it.
    calibration: int | None = None
    remat: bool = False
    # Whether a step whose examples meet may be cut there (:mod:`stagetorch.planning.cut`): jit's steps.
    cut_coupled: bool = False
    # Whether BatchNorm in training may run in passes (:mod:`stagetorch.planning.multipass`); None: as
    # ``cut_coupled`` (jit's steps). One-line mode cuts but has no passes (untested there).
    passes_coupled: bool | None = None
    # Bytes the graph counts twice because two of its inputs are views of one storage, less the bytes of the
    # storages its inputs view that it does not count (negative then; known at the first run: see
    # :meth:`see_inputs`).
    overlap: int | None = None
    # The CUDA device the plans are for (a :class:`~stagetorch.devices.catalog.Device`: its allocator settings
    # and cuBLAS workspace); None: this process's own (the graph's device).
    device: Device | None = None
    plans: dict[int, Plan] = attrs.field(factory=dict)
    # With a process group: this rank's plan per (shard size, budget), or the error that says none fits.
    shard_plans: dict[tuple, Plan | OutOfMemoryError] = attrs.field(factory=dict)
    _split: Split | None = None
    # The step cut where its examples meet; False: no cut helps; the error that says why it cannot be cut.
    _cut: Cut | StagingError | bool | None = None
    # A cut found where the examples meet that needs no less than the whole batch at once (its coupled part is
    # most of the step): what the error below every schedule names (see _no_cut_helps).
    _useless_cut: Cut | None = None
    # The step in passes per level of its batch-wide values (BatchNorm in training); False: none helps.
    _passes: Passes | bool | None = None
    _full_peak: int | None = None
    # The last (plan, held, budget, donated) of plan_call and the plan it returned for them: reused while they stay.
    _called: tuple = (None, 0, 0, 0, None)
    # The planners of the recomputing graphs the joint planner made from this one, and its frontier.
    _inner: dict[Graph, Planner] = attrs.field(factory=dict)
    _merge_ok: dict[Graph, bool] = attrs.field(factory=dict)  # see _merges_as_planned
    _points: list[Recompute] | None = None
    _chunk_points: dict[tuple[int, int | None], list[tuple[Recompute, int, int]]] = attrs.field(factory=dict)
    _chunk_frontiers: dict[int, list[Recompute]] = attrs.field(factory=dict)  # frontier() of a chunk's graph, by size

    def split(self) -> Split:
        """The graph split for chunking (the shared, body and post graphs), which the executor runs too."""
        if self._split is None:
            self._split = Split(analyze(self.graph, self.batched, self.batch))
            if self.overlap:
                self._split.input_overlap = self.overlap
        return self._split

    def plan(self, budget: int) -> Plan:
        """The plan for the program alone within ``budget`` bytes (what the call holds beside it left out)."""
        if self._full_peak is not None and -1 in self.plans and self._fits(budget):
            return self.plans[-1]  # a step that fits, as most do: nothing to plan (and no pause of the collector)
        return self._plan(budget)

    def _fits(self, budget: int) -> bool:
        """The whole graph runs at once within ``budget`` (its margin kept; no smaller chunk learned)."""
        return margin.fits(self._full_peak, budget) and self.cap is None

    @collector.paused()  # the planner builds recomputing graphs and chunk graphs: many objects that all stay alive
    def _plan(self, budget: int) -> Plan:
        # The device's free memory moves a little between calls: re-plan only when the answer can change.
        # The whole graph is costed once; a budget it fits in reuses one plan.
        if self._full_peak is None:
            self._full_peak = peak_bytes(self.graph) - (self.overlap or 0)
        fits = self._fits(budget)
        # Chunked plans are kept per budget to about 0.4% (its top 9 bits); so is every plan on CUDA, where the
        # caching allocator's segments can make a whole batch that fits by its tensors not fit.
        key = -1 if fits and not on_cuda(self.graph) else margin.bucket(budget)
        if key not in self.plans:
            try:
                if self.remat and not fits and _owns_its_inputs(self.graph):
                    self.plans[key] = plan_joint(
                        self.graph, budget, lambda g, peak=None: self._chunk_plan(g, budget, peak), self._floor,
                        self.frontier, batch=self.batch, chunk_points=self.chunk_frontier,
                    )
                else:
                    self.plans[key] = self._chunks_within_reserved(budget)
            except BatchCouplingError as coupled:
                # BatchNorm in training, where nothing else fits: its statistics summed over the chunks, in
                # passes that recompute (remat="auto" only: O(L^2) forward work for L layers).
                passes_ok = self.cut_coupled if self.passes_coupled is None else self.passes_coupled
                in_passes = isinstance(coupled, BatchStatisticsError) and passes_ok and self.remat
                passes = self.passes() if in_passes else None
                if passes is not None:
                    self.plans[key] = self._plan_passes(passes, budget, coupled)
                    return self.plans[key]
                # When the analysis raises BatchCouplingError and a cut exists, plan the cut.
                cut = self.cut(coupled) if self.cut_coupled else None
                if cut is None:
                    if self.cut_coupled and self._useless_cut is not None:
                        raise self._no_cut_helps(coupled, self._useless_cut, budget) from None
                    raise
                try:
                    self.plans[key] = plan_cut(cut, budget, self._full_peak, self.cap, coupled.smallest_budget)
                except OutOfMemoryError as short:
                    raise _saying_where(short, coupled) from None
        return self.plans[key]

    def _chunks_within_reserved(self, budget: int) -> Plan:
        """The chunk plan within ``budget``; on CUDA, in chunks small enough that what the caching allocator is
        predicted to reserve fits it too (:func:`~stagetorch.planning.reserved.fit_reserved`): a memory fraction
        caps the allocator's segments, not the tensors cut from them."""
        def chunks(cap: int | None) -> Plan:
            return plan_chunks(self.graph, self.split, self.batch, budget, peak_bytes, self._full_peak, cap=cap)

        plan = chunks(self.cap)
        if not on_cuda(self.graph):
            return plan
        fitted = fit_reserved(plan, self.graph, self.split, budget, lambda cap: chunks(min(cap, self.cap or cap)),
                              self.device)
        cap = max(fitted.chunk_sizes)
        if fitted is not plan and (self.cap is None or cap < self.cap):  # capped for its segments, not by a run
            said = f" Chunks are at most {cap} examples: a larger one ran out of memory in an earlier call."
            fitted = attrs.evolve(fitted, reason=fitted.reason.replace(
                said, f" Chunks are at most {cap} examples: the caching allocator's segments for a larger one "
                "would not fit."))
        return fitted

    def cut(self, coupled: BatchCouplingError) -> Cut | None:
        """The step cut where its examples meet (:mod:`stagetorch.planning.cut`), or None when nothing couples
        them or the cut runs in no less memory than the whole batch (the coupled part is most of the step).
        Raises ``coupled``, the analysis's error, with why the step cannot be cut, when it cannot."""
        if self._cut is None:
            try:
                found = find_cut(self.graph, self.batched, self.batch)
                useful = found is not None and cut_floor(found) < peak_bytes(self.graph) - (self.overlap or 0)
                self._cut = found if useful else False
                self._useless_cut = found if not useful else None
            except StagingError as why:
                self._cut = why
        if isinstance(self._cut, StagingError):
            error = type(coupled)(f"{coupled}\nIt cannot be cut where its examples meet either: {self._cut}")
            raise error.copy_from(coupled) from None  # with the smallest budget recomputation alone names
        return self._cut or None

    def _no_cut_helps(self, coupled: BatchCouplingError, cut: Cut, budget: int) -> OutOfMemoryError:
        """Below the whole batch's peak, where the examples meet and cutting the step there needs no less
        (``cut``, not useful): the budget is what is wrong, and the error names the smallest that runs, as the
        cut's own error does (issue 43), with where the examples meet."""
        whole = margin.smallest_budget(self._full_peak)
        floor = margin.smallest_budget(cut_floor(cut))
        best = min(whole, floor, coupled.smallest_budget or whole)
        how = ("the whole batch at once" if best == whole else
               "cut where the examples meet, one example per chunk" if best == floor else "recomputing, unchunked")
        first = str(coupled).split("\n", 1)[0]
        error = OutOfMemoryError(
            f"no schedule fits a budget of {format_bytes(budget)}: {first} {cut.describe()} Cut there, one example "
            f"per chunk needs {format_bytes(floor)} in all, no less than the whole batch at once "
            f"({format_bytes(whole)}). The smallest budget that runs this step is {format_bytes(best)} ({how}). "
            "What to do: raise memory_budget to at least that, or use a smaller batch."
        )
        return error.copy_from(coupled, smallest_budget=best)

    # (bnorm, issue 38 item 3) BatchNorm in training in passes over the chunks.
    def passes(self) -> Passes | None:
        """The step in chunked passes per level of its batch-wide values, BatchNorm in training written as
        batch sums (:mod:`stagetorch.planning.multipass`), or None when it cannot run so or runs in no less memory
        than the whole batch."""
        if self._passes is None:
            try:
                found = find_passes(as_batch_sums(self.graph), self.batched, self.batch)
            except StagingError as why:
                log.debug("stagetorch: BatchNorm's statistics cannot be summed over chunks here: %s", why)
                found = None
            whole = peak_bytes(self.graph) - (self.overlap or 0)
            self._passes = found if found is not None and passes_floor(found) < whole else False
        return self._passes or None

    def _plan_passes(self, passes: Passes, budget: int, coupled: BatchStatisticsError) -> PassesPlan:
        """The plan in passes within ``budget``; below it, ``coupled`` naming the smallest budget that runs
        (the passes', or recomputation's where less)."""
        try:
            return plan_passes(passes, budget, self._full_peak, self.cap)
        except OutOfMemoryError as below:
            smallest = min(below.smallest_budget, coupled.smallest_budget or below.smallest_budget)
            raise BatchStatisticsError(*coupled.args).copy_from(coupled, smallest_budget=smallest) from None

    def plan_call(
        self, budget: int, held: int, why: list[str], inputs: Sequence | None = None, donated: int = 0
    ) -> Plan:
        """A call's plan: the program planned in the call's ``budget`` less the ``held`` bytes the call holds
        beside it (for the reasons ``why``), which the plan's peak counts. ``inputs``: the call's real inputs
        (parallel to ``graph.invars``), whose shared storage the plan counts once (:meth:`see_inputs`, on the
        first call). ``donated``: bytes of the old ``.grad`` the call drops before the program runs
        (``jit(donate_grads=True)``), which the plan says it leaves out (``Plan.donated_bytes``). **Returns**
        the plan (the program's budget on it: ``Plan.program_budget_bytes``), which the caller hands to
        :meth:`stagetorch.runtime.executable.Executable.run`; an error about the budget says what ``memory_budget``
        the whole call would fit in."""
        if self.overlap is None and inputs is not None:
            self.see_inputs(inputs)
        program_budget = max(margin.beside(budget, held, self.calibration), 0)
        if self.ceiling is not None:
            program_budget = min(program_budget, self.ceiling)
        called = self._called
        if budget == called[2] and held == called[1] and donated == called[3] and called[0] is not None:
            # The same call as the last (a step loop's flush, its budget read from the same free memory):
            # the same plan, while nothing that makes plans changed (see _forget, which those paths call).
            return called[4]
        try:
            plan = self.plan(program_budget)
            last, last_held, last_budget, last_donated, evolved = self._called
            if plan is not last or held != last_held or budget != last_budget or donated != last_donated:
                evolved = attrs.evolve(plan, held_bytes=held, budget_bytes=budget, donated_bytes=donated,
                                       program_budget_bytes=program_budget, whole_program_bytes=self._full_peak)
                self._called = (plan, held, budget, donated, evolved)
            return evolved
        except BatchStatisticsError as e:
            raise self._below_every_schedule(held_beside(e, held, why), budget, held, why) from None
        except StagingError as e:
            wider = held_beside(e, held, why)
            if wider is e:
                raise
            raise wider from e

    # (bnorm, issue 38 item 3) BatchNorm in training: the error names the smallest budget that runs and how.
    def _below_every_schedule(
        self, coupled: BatchStatisticsError, budget: int, held: int, why: list[str] = ()
    ) -> BatchStatisticsError:
        """``coupled`` (the batch statistics of a BatchNorm in training keep the batch whole) said as what the
        user can do: the smallest ``memory_budget`` that runs the call (``held`` bytes beside the program
        included) and the schedule it runs, planned here, so that the budget named is one that plans."""
        smallest = coupled.smallest_budget
        if smallest is None:  # no recomputation (remat=False): the whole batch at once is the only schedule
            smallest = margin.smallest_budget(peak_bytes(self.graph)) + held
        smallest = bytes_ceiling(smallest)
        try:
            plan = self.plan(max(min(margin.beside(smallest, held, self.calibration), self.ceiling or smallest), 0))
        except StagingError:
            how = ""
        else:
            how = f", {plans.schedule_of(plan)}"
        if held:
            how += f" (with the {format_bytes(held)} this call holds beside the program: {'; '.join(why)})"
        first = str(coupled).split("\n", 1)[0]
        error = BatchStatisticsError(
            f"{first}\nNo schedule runs this step within memory_budget={format_bytes(budget)}: the smallest budget "
            f"any schedule fits is {format_bytes(smallest)}{how}. BatchNorm in training mode couples the examples at "
            f"{coupled.source}: each layer normalises with statistics of the whole batch, which depend on the "
            f"layers before it, {_statistics_schedule(self._passes)}.\n"
            f"What to do: raise memory_budget to at least {format_bytes(smallest)}, or use a smaller batch; or put "
            "the BatchNorm layers in eval mode (model.eval()), or use GroupNorm or LayerNorm, which run in exact "
            "chunks at any budget."
        )
        return error.copy_from(coupled, smallest_budget=smallest)

    def frontier(self) -> list[Recompute]:
        """The recompute sets the joint planner chooses among (see :func:`stagetorch.planning.remat_frontier.frontier`)."""
        if self._points is None:
            self._points = frontier(self.graph)
        return self._points

    def chunk_frontier(self, n: int, usable: int | None = None) -> list[tuple[Recompute, int, int]]:
        """Recompute sets chosen for chunks of ``n`` examples, each with the peak of a chunked run's first
        chunk predicted by its chunk's graph, and a bound on a later chunk's
        (:func:`stagetorch.planning.remat_frontier.chunk_frontier`); with ``usable``, also its sets just above those
        bytes repaired so that a later chunk's bound fits them."""
        key = (n, usable)
        if key not in self._chunk_points:
            split = self.split()
            body = split.body(n)
            # As planning._peaks: what the run holds for every chunk, beside the chunk's own peak; a later
            # chunk holds the accumulators too, beside an own peak no larger than the first chunk's (which
            # makes the partials that a later one adds into them).
            beside = base_bytes(split) + body.held_bytes[0] - sum(v.aval.nbytes for v in body.first.invars)
            acc = body.held_bytes[1]
            if n not in self._chunk_frontiers:
                self._chunk_frontiers[n] = frontier(body.first)
            fit = None if usable is None else usable - beside - acc
            self._chunk_points[key] = [(q, peak + beside, peak + beside + acc) for q, peak in chunk_frontier(
                self.frontier()[0], body.first, body.vars, fit, self._chunk_frontiers[n])]
        return self._chunk_points[key]

    def recomputing(self, graph: Graph) -> Planner:
        """The planner of a recomputing graph the joint planner made from this one (same inputs)."""
        if graph not in self._inner:
            self._inner[graph] = Planner(graph, self.batched, self.batch, cap=self.cap, overlap=self.overlap,
                                         device=self.device)
        return self._inner[graph]

    def _split_of(self, graph: Graph) -> Split:
        return self.split() if graph is self.graph else self.recomputing(graph).split()

    def _chunk_plan(self, graph: Graph, budget: int, peak: int | None = None) -> Plan:
        """The chunk plan of ``graph`` (this one, or a recomputing graph made from it, whose whole-batch
        ``peak`` the joint planner may know: its simulation costs it as the memory interpreter does)."""
        if graph is self.graph:  # on CUDA, in chunks whose predicted reserved bytes fit too
            return self._chunks_within_reserved(budget)
        inner = self.recomputing(graph)
        if peak is not None and inner._full_peak is None:
            inner._full_peak = peak - (self.overlap or 0)
        # A chunk that ran out of memory here is not tried for a recomputing graph either (it needs no more).
        if self.cap is not None and (inner.cap is None or inner.cap > self.cap):
            inner.cap = self.cap
            inner.plans.clear()
        return inner.plan(budget)

    def _floor(self, graph: Graph) -> int:
        """The fewest bytes ``graph`` runs in: one example per chunk, or the whole batch if that is less (a
        batch of one, whose chunked form only adds copies) or if it cannot be split."""
        whole = peak_bytes(graph) - (self.overlap or 0)
        if self.batch == 1:
            return whole
        try:
            return min(whole, chunked_peak(self._split_of(graph), 1, peak_bytes))
        except (BatchCouplingError, UnsupportedOpError):
            return whole

    def _shard_floor(self, graph: Graph) -> int:
        """The fewest bytes ``graph`` runs a shard in: one example per chunk (a shard always runs through the
        split graphs, even whole: see :func:`distributed.plan_shard`). A recompute set a shard may not run
        (:meth:`_merges_as_planned`) has no floor."""
        if not self._merges_as_planned(graph):
            return 1 << 62
        return chunked_peak(self._split_of(graph), 1, peak_bytes)

    def _merges_as_planned(self, graph: Graph) -> bool:
        """Whether a shard running ``graph`` (this graph or one recomputing) all-reduces the same partials,
        in the same order, as one running this graph: ranks choose their recompute sets apart, by their own
        budgets, and their collectives must match (a recomputed normaliser is one more merged value)."""
        if graph is self.graph:
            return True
        if graph not in self._merge_ok:
            self._merge_ok[graph] = distributed.merge_signature(self.recomputing(graph).split()) == distributed.merge_signature(self.split())
        return self._merge_ok[graph]

    def shard_plan(self, examples: int, budget: int, held: int, why: list[str]) -> Plan | OutOfMemoryError:
        """This rank's plan for its ``examples`` of the global batch the graph is staged for, within its own
        ``budget`` less the ``held`` bytes the run keeps beside the program (for the reasons ``why``): chunks,
        and with ``remat`` recomputation where the smallest chunk does not fit (or it is cheaper). **Returns**
        the ``OutOfMemoryError`` that says none fits (every rank must learn it first)."""
        budget = max(margin.beside(budget, held), 0)
        # Plans are kept per budget to about 0.4% (its top 9 bits), as plan() keeps them (a plan made for
        # a budget up to 0.4% larger is within this one's safety margin); an error only for its own budget:
        # the smallest budget it names may lie in the same 0.4%, and must plan.
        key = (examples, margin.bucket(budget))
        plan = self.shard_plans.get((examples, budget, "error")) or self.shard_plans.get(key)
        if plan is None:

            def chunk_plan(graph: Graph, peak: int | None = None) -> Plan:
                split = self._split_of(graph)
                if not self._merges_as_planned(graph):
                    raise OutOfMemoryError("this recompute set merges other partials than the other ranks'")
                return distributed.plan_shard(split, graph, examples, budget)

            try:
                if self.remat and _owns_its_inputs(self.graph):
                    plan = plan_joint(self.graph, budget, chunk_plan, self._shard_floor, self.frontier)
                else:
                    plan = chunk_plan(self.graph)
            except OutOfMemoryError as e:
                plan = held_beside(e, held, why)
            except (BatchCouplingError, UnsupportedOpError) as e:
                # A shard runs through the split graphs at any budget: no budget runs a step that cannot be
                # split, so the chunk planner's own error, without the smallest budget recomputation names.
                cause = e.__cause__
                raise (cause if type(cause) is type(e) else e) from None
            self.shard_plans[(examples, budget, "error") if isinstance(plan, OutOfMemoryError) else key] = plan
        return plan

    def see_inputs(self, inputs: Sequence) -> None:
        """Learn from a call's real ``inputs`` (parallel to ``graph.invars``) what the allocator holds for them
        that the graph's values do not say: views of one storage (a weight and its transpose handed to a lazy
        flush), separate values whose storage the plans count once, and a view of a larger storage (a slice
        of a parameter, ``pos[:, :T]``, handed to a lazy flush without its base), whose whole storage the
        allocator holds while the plans would count the view's bytes alone (:meth:`see_overlap`); and the
        leaves of a real autograd graph an input hangs from (a parameter whose lookup ran for real before a lazy
        flush, ``wpe(position_ids)``): held while the program runs, their gradients made after it."""
        groups: dict[int, tuple[torch.Tensor, dict[Var, int]]] = {}
        for v, x in zip(self.graph.invars, inputs):
            if isinstance(x, torch.Tensor) and x.device.type != "meta":
                storage = x.untyped_storage()
                groups.setdefault(storage.data_ptr(), (x, {}))[1][v.root] = allocated(v.root.owned_nbytes, x.device)
        for leaf in _graph_leaves(inputs):
            if leaf.device.type != "meta":
                groups.setdefault(leaf.untyped_storage().data_ptr(), (leaf, {}))
        self.see_overlap(sum(
            sum(counted.values()) - allocated(x.untyped_storage().nbytes(), x.device) for x, counted in groups.values()
        ))

    def see_overlap(self, overlap: int) -> None:
        """Learn the bytes the graph counts twice because inputs are views of one storage (the executor
        measures them on the first run): the plans made without them are dropped."""
        self.overlap = overlap
        self._forget()
        if overlap:
            self.plans.clear()
            self._inner.clear()
            self._full_peak = None
            if self._split is not None:
                self._split.input_overlap = overlap

    def _forget(self) -> None:
        """What makes plans changed (the overlap of the inputs, the largest chunk known to run): plan_call's
        last answer is not reused."""
        self._called = (None, 0, 0, 0, None)

    def shrink(self, failed: Plan) -> bool:
        """A run of ``failed`` ran out of memory where it said the step fits: plan one step smaller from now
        on. That is the next chunking with one chunk more (16 examples: 16, 8, 6, 4, 3, 2, 1: never a halving
        that overshoots, 3 -> 1), then, once chunks of one ran out, recomputing below the failed plan's peak.
        **Returns** False where nothing smaller is left to try (chunks of one, no recomputation)."""
        largest = max(failed.chunk_sizes)
        if largest > 1:
            self.learn(min(largest - 1, math.ceil(self.batch / (math.ceil(self.batch / largest) + 1))))
            return True
        if not self.remat:
            return False
        # A budget whose usable part (the plan's margin kept) ends a byte below the failed program's peak.
        self.ceiling = margin.budget_below(max(*failed.peak_bytes, failed.phase_peak_bytes))
        self.learn(1)
        self.plans.clear()
        self._forget()
        return True

    def learn(self, cap: int | None) -> None:
        """A chunk of more than ``cap`` examples ran out of memory: plan again with it."""
        if cap is not None and cap != self.cap:
            self.cap = cap
            self.plans.clear()
            self._forget()

    def calibrate(self, needed: int, planned: int) -> None:
        """The first run on CUDA needed ``needed`` bytes (the allocator's, as the budget counts them) where
        its plan said ``planned``: later plans leave the difference out of the budget, if it was more."""
        self.calibration = max(needed - planned, 0)
        if self.calibration:
            self.plans.clear()
            self._forget()

    def lesson(self) -> tuple:
        """What runs taught this planner, as :func:`recall` gives it to a later planner of the same program."""
        return self.cap, self.ceiling, self.calibration

    def teach(self, lesson: tuple) -> None:
        self.cap, self.ceiling, self.calibration = lesson
        self.plans.clear()
        self._forget()


# What programs learned, by what they are (program_key): a step staged again, a one-line step recorded again
# (each recording builds its own executables), plans with what an earlier run of the same program learned.
_LESSONS: dict[tuple, tuple] = {}
caches.on_clear(_LESSONS.clear)


def program_key(graph: Graph, batch: int) -> tuple:
    """What a program is, as far as its memory goes: its ops and their results' shapes, its batch, its device."""
    text = "\n".join(f"{op_name(e.prim)} {[str(v.aval) for v in e.outvars if v is not None]}" for e in graph.eqns)
    return graph.device, batch, len(graph.eqns), zlib.crc32(text.encode())


def remember(planner: Planner) -> None:
    """Keep what ``planner`` learned for later planners of its program (:func:`recall`)."""
    _LESSONS[program_key(planner.graph, planner.batch)] = planner.lesson()


def recall(planner: Planner) -> None:
    """Give ``planner`` what an earlier planner of the same program learned, if any did."""
    if _LESSONS:
        lesson = _LESSONS.get(program_key(planner.graph, planner.batch))
        if lesson is not None:
            planner.teach(lesson)


def _owns_its_inputs(graph: Graph) -> bool:
    """Whether every input lives in storage the graph itself names. A lazy flush can read a view of a value
    an earlier flush made, whose base is not in the graph: the recomputation planner numbers only the
    graph's own vars (:class:`~stagetorch.planning.remat_simulator.Simulator`), so such a flush is only chunked."""
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
    # What else the error says (a chunk-local result: see chunking), its smallest budget with what is held.
    return wider.copy_from(error, smallest_budget=error.smallest_budget + held)


def _statistics_schedule(passes: Passes | bool | None) -> str:
    """What BatchNorm's statistics let run, as the error below every schedule says it."""
    if isinstance(passes, Passes):
        return (f"so the batch runs in chunks only in {len(passes.splits)} passes over them, one per level of "
                "those statistics, forward and backward")
    return "so the batch can be neither run in chunks nor cut where its examples meet"


def _graph_leaves(inputs: Sequence) -> list[torch.Tensor]:
    """The leaves (``AccumulateGrad``'s tensors) of the real autograd graphs ``inputs`` hang from."""
    stack = [x.grad_fn for x in inputs if isinstance(x, torch.Tensor) and x.grad_fn is not None]
    seen: set = set()
    leaves = []
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        leaf = getattr(fn, "variable", None)
        if isinstance(leaf, torch.Tensor):
            leaves.append(leaf)
        stack.extend(f for f, _ in fn.next_functions)
    return leaves

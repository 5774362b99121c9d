"""A staged graph ready to run on real inputs: :class:`Executable`, which every front end (``jit``, ``lazy``)
runs its programs through, unchunked when the batch fits, else in exact chunks, recomputing where its
:class:`~stagetorch.planning.planner.Planner` says so.

An Executable compiles and runs; it decides nothing about memory. Its caller gets the plan for a budget from
the executable's planner and hands it down; the executable runs that plan (:mod:`stagetorch.interpreters.eager`,
:mod:`stagetorch.interpreters.chunked`, :mod:`stagetorch.parallel.data_parallel`) and tells the planner what ran: a plan that ran
out of memory (:meth:`~stagetorch.planning.planner.Planner.shrink`: the executable then runs the planner's next, smaller
plan, and the program keeps what it learned, :func:`~stagetorch.planning.planner.remember`), and on CUDA what the
first run measured (:meth:`~stagetorch.planning.planner.Planner.calibrate`).
"""

from __future__ import annotations

import logging
import traceback
import zlib
from collections.abc import Callable, Sequence

import torch

from ..devices import budget as devices
from ..devices.catalog import Device
from ..errors import OutOfMemoryError, StagingError
from ..interpreters.batching import Batched
from ..interpreters.chunked import Split, is_oom, run_chunked
from ..interpreters.eager import Program
from ..interpreters.memory import allocated
from ..interpreters.undo import Undo
from ..ir import Graph, Var, op_name
from ..parallel import data_parallel as distributed
from ..planning import plans
from ..planning.chunks import Plan
from ..planning.planner import COPIES, Planner, recall, remember
from ..transforms.schedule import writes
from .plan_log import PlanLog, emit

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
        passes_coupled: bool | None = None, device: Device | None = None,
    ):
        self.graph = graph
        self.batched = batched
        self.batch = batch
        self.consts = [] if consts is None else consts
        if planner is None:
            planner = Planner(
                graph, batched, batch, cap=cap, remat=remat, cut_coupled=cut_coupled, passes_coupled=passes_coupled,
                device=device,
            )
            recall(planner)  # what an earlier run of this program learned (a step staged or recorded again)
        self.planner = planner
        self._program: Program | None = None
        self._mutated: list[int] | None = None  # see the ``mutated`` property
        self._guarded: list[int] | None = None  # see the ``guarded`` property
        self._restoring: tuple[int, list[str]] | None = None  # see the ``restoring`` property
        # The Executables of the recomputing graphs the planner chose, each with that graph's planner.
        self._inner: dict[Graph, Executable] = {}
        self._signature: distributed.Signature | None = None
        self._resident: int | None = None  # see resident_bytes
        self._on_cuda = devices.device_type(graph.device) == "cuda"  # (its first run calibrates: _calibrated)
        # Where run() says its plans: once, then only a change (a front end shares one among its programs).
        self.plan_log = PlanLog()

    @property
    def mutated(self) -> list[int]:
        """Positions of the inputs the program updates in place: the caller's state a failed run restores."""
        if self._mutated is None:
            self._mutated = _mutated_inputs(self.graph)
        return self._mutated

    @property
    def guarded(self) -> list[int]:
        """Positions of the inputs a run copies before it writes them, to restore them if it fails: those it
        writes outside its commit (see :func:`stagetorch.transforms.commit.commit_plan`). An optimizer stepped last
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
        :meth:`~stagetorch.planning.planner.Planner.plan_call` takes them (fixed by the graph: kept)."""
        if self._restoring is None:
            device = self.graph.device
            copied = {v: allocated(v.aval.nbytes, device) for v in (self.graph.invars[i] for i in self.guarded)}
            self._restoring = (sum(copied.values()), [COPIES.format(len(self.guarded))])
        return self._restoring

    def resident_bytes(self, inputs: list) -> int:
        """Bytes the allocator already holds for ``inputs`` on the program's device (each storage once), which
        the plans count: made on the first call (later calls' inputs are laid out the same)."""
        if not inputs:
            return 0
        if self._resident is None:
            kind = self.graph.device.type
            storages = {
                x.untyped_storage().data_ptr(): allocated(x.untyped_storage().nbytes(), x.device)
                for x in inputs if isinstance(x, torch.Tensor) and x.device.type == kind
            }
            self._resident = sum(storages.values())
        return self._resident

    @property
    def program(self) -> Program:
        if self._program is None:
            self._program = Program(self.graph, final=True)
        return self._program

    # What the planner holds, as front ends and tests read it off the Executable.

    @property
    def cap(self) -> int | None:
        """The largest chunk known to run (see :meth:`~stagetorch.planning.planner.Planner.shrink`)."""
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

    def shard_plan(self, examples: int, budget: int, beside: tuple[int, list[str]] = (0, [])) -> Plan | OutOfMemoryError:
        """This rank's plan for its ``examples`` of the global batch the graph is staged for, within its own
        ``budget`` less the copies a run makes (``restore_bytes``) and what the caller holds ``beside`` the
        program (bytes, why: FSDP2's shards): see :meth:`~stagetorch.planning.planner.Planner.shard_plan`."""
        # run_shard copies what the program writes outside its commit, beside it
        held, why = self.restoring
        return self.planner.shard_plan(examples, budget, held + beside[0], why + beside[1])

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
        from this executable's :attr:`planner` (:meth:`~stagetorch.planning.planner.Planner.plan_call`, or
        :meth:`plan`) for its budget.

        **Returns** the flat outputs and the (input position, gradient) pairs to accumulate into ``.grad``.
        If anything fails, inputs the program updates in place (parameters, buffers, ``.grad``, optimizer
        state) are restored first: from the copies its programs took before writing them, or untouched
        because the failure came before the commit that writes them (:func:`~stagetorch.transforms.commit.commit_plan`).
        If the device runs out of memory where the plan said the step fits, the step is redone as the
        planner's next smaller plan until one runs (:meth:`_recover`); later plans start from that one.
        On CUDA the first run of a program measures the allocator against its plan (:meth:`_calibrated`).
        """
        if self.planner.overlap is None:  # a caller that planned without the inputs: later plans count it
            self.planner.see_inputs(inputs)
        self.plan_log.say(name, plan)
        if on_chunk is not None:  # a retried step reports only the examples beyond those it reported
            on_chunk = _Progress(on_chunk)
        if self._on_cuda and self.planner.calibration is None:
            return self._calibrated(inputs, plan, on_chunk, name)
        try:
            return self._attempt(inputs, plan, on_chunk, name)
        except Exception as e:
            if not is_oom(e):
                raise
            failed = e  # (recovered outside this block: the error being handled holds the failed attempt's frames)
        return self._recover(inputs, plan, failed, on_chunk, name)

    def _attempt(
        self, inputs: list, plan: Plan, on_chunk: Callable[[int, int], None] | None, name: str
    ) -> tuple[list, list[tuple[int, torch.Tensor]]]:
        """One run of ``plan``; if it fails, the inputs it wrote are restored and the error raised."""
        recomputing = plans.recompute_graph(plan)
        if recomputing is not None and recomputing is not self.graph:
            # The recomputing graph runs in the chunks the plan gives (its planner's, at the same budget).
            return self._for(recomputing)._attempt(inputs, plan, on_chunk, name)
        if plans.runs_apart(plan):
            # A step whose examples meet, cut there (stagetorch.planning.cut), or whose BatchNorm statistics are
            # summed over the chunks in passes (stagetorch.planning.multipass).
            undo = Undo(inputs[i] for i in self.mutated)
            try:
                return plans.run_apart(plan, inputs, undo)
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
            return program.run(inputs)
        undo = Undo(inputs[i] for i in mutated)
        try:
            if plan.chunked:
                # A chunk that runs out of memory ends the attempt: the next plan is the planner's (_recover).
                outs, grads, _ = run_chunked(
                    self.split(), inputs, plan.chunk_sizes, on_chunk=on_chunk, undo=undo, retry=False
                )
                return outs, grads
            return self.program.run(inputs, undo)
        except BaseException:
            undo.restore()
            raise

    def _recover(
        self, inputs: list, plan: Plan, error: Exception, on_chunk: Callable[[int, int], None] | None, name: str
    ) -> tuple[list, list]:
        """``plan`` ran out of memory (``error``; the inputs it wrote already restored): free what the failed
        attempt held, and run the planner's next smaller plan (:meth:`~stagetorch.planning.planner.Planner.shrink`:
        one chunk more each time, then recomputation), until one runs. The program keeps what ran
        (:func:`~stagetorch.planning.planner.remember`): later calls, and later one-line steps, start from it. Where
        nothing smaller is left (chunks of one, no recomputation; a batch that cannot be split), ``error`` is
        raised, and the planner forgets what this call tried."""
        before = self.planner.lesson()
        failures = 1
        while True:
            _release(error, self.graph.device)
            if not self.planner.shrink(plan):
                break
            try:
                plan = self.planner.plan_call(plan.budget_bytes, plan.held_bytes, [], donated=plan.donated_bytes)
            except StagingError:  # no smaller plan fits (or the batch cannot be split)
                break
            emit(logging.DEBUG, "stagetorch: %s: out of memory (%d); trying %s", name, failures, plan)
            try:
                result = self._attempt(inputs, plan, on_chunk, name)
            except Exception as e:
                if not is_oom(e):
                    self.planner.teach(before)
                    raise
                error, failures = e, failures + 1
                continue
            remember(self.planner)
            emit(
                logging.WARNING,
                "stagetorch: %s: out of memory %d time(s) where the plan said the step fits; it ran in chunks "
                "[%s]%s, and later calls will too", name, failures, "+".join(map(str, plan.chunk_sizes)),
                " recomputing" if plans.recomputes(plan) else "",
            )
            self.plan_log.why = "a larger plan ran out of memory"
            return result
        self.planner.teach(before)
        raise error

    def _calibrated(
        self, inputs: list, plan: Plan, on_chunk: Callable[[int, int], None] | None, name: str
    ) -> tuple[list, list]:
        """The first run of this program on CUDA, measured: the bytes it needed at the allocator as the budget
        counts them (:func:`stagetorch.devices.budget.cuda_budget`: its allocated peak, or its reserved peak where it
        made segments) against its plan's peak. Later plans
        carry the difference (:meth:`~stagetorch.planning.planner.Planner.calibrate`), said once in the log."""
        device = self.graph.device
        before = devices.cuda_memory(device)
        devices.reset_peaks(device)
        try:
            result = self._attempt(inputs, plan, on_chunk, name)
        except Exception as e:
            if not is_oom(e):
                raise
            failed = e
        else:
            after = devices.cuda_memory(device)
            # What the budget counted as the step's own: its inputs, and what the call holds beside the program
            # that was allocated before it ran (the .grad it replaces or adds into; not the copies it makes).
            others = before.allocated - self.resident_bytes(inputs) - max(plan.held_bytes - self.restore_bytes, 0)
            needed = after.peak_allocated - others
            if after.peak_reserved > before.reserved:
                # It made segments: the bytes they hold beyond its tensors (the budget counted the cached ones
                # as free) are its too. (Without new segments the reserved peak is the cache it started with.)
                needed = max(needed, after.peak_reserved - others)
            self.planner.calibrate(needed, plan.peak)
            remember(self.planner)
            log.info(
                "stagetorch: %s: on %s the first run needed %s (%s allocated at its peak) for a plan of %s: "
                "later plans leave %s more room", name, device, devices.format_bytes(needed),
                devices.format_bytes(after.peak_allocated - others), devices.format_bytes(plan.peak),
                devices.format_bytes(self.planner.calibration),
            )
            return result
        # Its peaks are the failed attempt's: the next run, of the plan the recovery found, is measured instead.
        return self._recover(inputs, plan, failed, on_chunk, name)

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
        *, on_chunk: Callable[[int, int], None] | None = None, keep_partial: Sequence[int] = (),
    ) -> tuple[list, list[tuple[int, torch.Tensor]], set[int]]:
        """Run this rank's shard (examples ``[offset, offset + plan.batch)`` of the global batch) as
        :func:`stagetorch.parallel.data_parallel.run_shard` does, under ``plan`` (recomputing if it says so). **Returns**
        the outputs and gradients, global but those of ``keep_partial`` that came back as this rank's partial
        sums (their positions, the third item); if anything fails, inputs the program updates in place are
        restored first."""
        recompute = plans.recompute_of(plan)
        split = self.split() if recompute is None else self._for(recompute.graph).split()
        undo = Undo(inputs[i] for i in self.mutated)
        try:
            return distributed.run_shard(split, inputs, plan.chunk_sizes, offset, group, on_chunk=on_chunk, undo=undo,
                                         keep_partial=keep_partial)
        except BaseException:
            undo.restore()
            raise


class _Progress:
    """Reports the examples of a retried step only beyond those already reported (a progress bar's total)."""

    def __init__(self, on_chunk: Callable[[int, int], None]):
        self.on_chunk, self.reported = on_chunk, 0

    def __call__(self, start: int, n: int) -> None:
        if start + n > self.reported:
            self.on_chunk(self.reported, start + n - self.reported)
            self.reported = start + n


def _release(error: BaseException, device: torch.device) -> None:
    """Free what a failed attempt held: the tensors its frames hold through ``error``'s traceback (kept for the
    error's report, without them), and on CUDA the segments the caching allocator keeps for them."""
    traceback.clear_frames(error.__traceback__)
    cause = error.__cause__
    if cause is not None:
        traceback.clear_frames(cause.__traceback__)
    if devices.device_type(device) == "cuda":
        torch.cuda.empty_cache()


def _mutated_inputs(graph: Graph) -> list[int]:
    """Positions of inputs that some equation writes in place (a buffer update, an in-place op on an arg,
    BatchNorm's running statistics though its schema does not say so: see :func:`stagetorch.transforms.schedule.writes`)."""
    roots = {v: i for i, v in enumerate(graph.invars)}
    out: list[int] = []
    for e in graph.eqns:
        for x in writes(e):
            i = roots.get(x.root)
            if i is not None and i not in out:
                out.append(i)
    return out


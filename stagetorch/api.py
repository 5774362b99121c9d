"""The public entry points that stage a function: ``make_ir``, ``eval_shape`` and ``jit``.

``jit`` caches one staged program per input signature and runs it with the chunked executor, which runs
the whole batch at once when it fits.
"""

from __future__ import annotations

import functools
import logging
import weakref
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
import torch.utils._pytree as pytree

from . import _caches, _gc, distributed, shapes
from .batching import Batched, analyze
from .chunking import Split, is_oom, run_chunked
from .costing import MemoryReport, Schedule, allocated, peak_bytes, timeline
from .costing import report as costing_report
from .devices import bytes_ceiling, format_bytes, free_memory
from .errors import BatchCouplingError, OutOfMemoryError, ShapeError, StagingError, UnsupportedOpError
from .execute import Program, Undo, accumulate_grad, install_grads
from .flops import graph_flops
from .guards import StateWalk, flatten_args
from .ir import Aval, Eqn, Graph, Var, op_name
from .passes import writes
from .planning import SAFETY_MARGIN, Plan, body_peaks, chunked_peak, plan_chunks
from .remat import RECOMPUTED, recomputed_eqns
from .remat_planning import Recompute, RematPlan, frontier, plan_joint
from .tracing import State, Traced, arg_names, discover, held_values, leaf_names, trace

__all__ = ["make_ir", "eval_shape", "jit", "Staged", "memory", "Executable", "clear_caches"]

log = logging.getLogger("stagetorch")


def _signature(leaves: list, static: set[int], leaf_argnum: list[int] | None) -> tuple:
    sig = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and (leaf_argnum is None or leaf_argnum[i] not in static):
            sig.append((leaf.shape, leaf.dtype, leaf.device, leaf.requires_grad))
        else:
            try:
                hash(leaf)
                sig.append(("static", type(leaf), leaf))
            except TypeError:
                sig.append(("static-id", id(leaf)))
    return tuple(sig)


def _grad_or_zeros(t: torch.Tensor) -> torch.Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)


def _grad_storages(inputs: list, positions: Sequence[int]) -> dict[int, int]:
    """The bytes of the ``.grad`` storages of ``inputs`` at ``positions``, by storage (each counted once)."""
    out = {}
    for i in positions:
        g = inputs[i].grad
        if g is not None:
            out[g.untyped_storage().data_ptr()] = g.untyped_storage().nbytes()
    return out


def _leaf_argnums(args: Sequence, kwargs: dict) -> list[int]:
    out = []
    for i, a in enumerate(args):
        out += [i] * len(pytree.tree_leaves(a))
    for a in kwargs.values():
        out += [-1] * len(pytree.tree_leaves(a))
    return out


def _named_args(fn: Callable, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """(name, value) for every argument, positional first, in the order the tracer flattens them."""
    return list(zip(arg_names(fn, len(args)), args)) + list(kwargs.items())


def make_ir(fn: Callable, *, static_argnums: Sequence[int] = ()) -> Callable[..., Graph]:
    """Stage ``fn`` and return its :class:`~stagetorch.Graph`, forward and backward.

    ``make_ir(fn)(*args, **kwargs)`` traces ``fn`` on abstract copies of the arguments; no real tensor is
    read or changed. Print the result to read the staged program.
    """

    @functools.wraps(fn)
    def staged(*args: Any, **kwargs: Any) -> Graph:
        return trace(fn, args, kwargs, static_argnums=static_argnums).graph

    return staged


def eval_shape(fn: Callable, *, static_argnums: Sequence[int] = ()) -> Callable[..., Any]:
    """``fn``'s outputs as :class:`~stagetorch.Aval`, in the same structure, without running it."""

    @functools.wraps(fn)
    def shaped(*args: Any, **kwargs: Any) -> Any:
        graph = trace(fn, args, kwargs, static_argnums=static_argnums).graph
        outs = [o.value if not isinstance(o, Aval) and hasattr(o, "value") else o for o in shapes.infer(graph)]
        return pytree.tree_unflatten(outs[: graph.out_tree.num_leaves], graph.out_tree)

    return shaped


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

    def plan(self, budget: int) -> Plan:
        full = self._full_peak
        if full is not None and self.cap is None and full <= budget * (1 - SAFETY_MARGIN) and -1 in self.plans:
            return self.plans[-1]  # a step that fits, as most do: nothing to plan (and no pause of the collector)
        return self._plan(budget)

    @_gc.paused()  # the planner builds recomputing graphs and chunk graphs: many objects that all stay alive
    def _plan(self, budget: int) -> Plan:
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


@attrs.define
class _Entry:
    traced: Traced
    executable: Executable
    # Positions of the inputs whose .grad the step adds into after the program (see Staged._held).
    added: list[int] | None = None


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


# As dynamo's recompile limit: this many programs for one function means some value changes every call.
_MANY_PROGRAMS = 8


class Staged:
    """A function staged by :func:`jit`. Call it like the function; inspect it with ``graph``/``plan``."""

    def __init__(
        self,
        fn: Callable,
        *,
        batch_dim: int = 0,
        batch_argnums: Sequence[int] | None = None,
        static_argnums: Sequence[int] = (),
        memory_budget: int | str | None = None,
        progress: bool = False,
        process_group: Any = None,
        remat: str | bool = "auto",
    ):
        if remat not in ("auto", False):
            raise ValueError(f"remat must be \"auto\" or False, not {remat!r}")
        self.remat = remat == "auto"
        self.fn = fn
        self.process_group = process_group
        self.progress = progress
        self.batch_dim = batch_dim
        self.batch_argnums = None if batch_argnums is None else tuple(batch_argnums)
        self.static_argnums = tuple(static_argnums)
        self.memory_budget = memory_budget
        self._cache: dict[tuple, _Entry] = {}
        self._caps: dict[int, int] = {}  # batch size -> the largest chunk that ran after an out-of-memory error
        self._last_key: tuple | None = None
        self._last_entry: _Entry | None = None
        self._walk = StateWalk()  # discover and tensors_and_key, made again only when what they read changed
        self._planned: tuple = (None, 0, 0, None)  # the last (plan, held, budget) of _step_plan and its result
        functools.update_wrapper(self, fn)
        _STAGED.add(self)

    def _log_restage(self, old: tuple, new: tuple, state: State) -> None:
        """Say why a call stages again: what changed since the previous call's program."""
        why = []
        if old[0] != new[0] or old[1] != new[1]:
            why.append("the arguments (their structure, shapes, dtypes or static values)")
        why += state.changes(old[2], new[2])
        if old[4] != new[4]:
            why.append(f"the grad mode (torch.is_grad_enabled() is now {new[4]})")
        name = getattr(self.fn, "__name__", "step")
        log.info("stagetorch: %s: staging again (%d programs now), as these changed: %s", name, len(self._cache) + 1,
                 "; ".join(why) or "nothing nameable")
        if len(self._cache) + 1 == _MANY_PROGRAMS:
            log.warning(
                "stagetorch: %s has been staged %d times: a value it reads changes between calls (last: %s). "
                "Pass a value that changes every step as a tensor argument, or read it outside the function.",
                name, _MANY_PROGRAMS, "; ".join(why))

    def _stage(self, args: tuple, kwargs: dict, global_batch: int | None = None) -> tuple[_Entry, list, State]:
        """The cached staged program for these arguments, and its real inputs. With ``global_batch`` (a
        process group's), the program is staged for the batched arguments holding that many examples."""
        leaves, tree = flatten_args(args, kwargs)
        held = held_values(leaves, lambda: leaf_names(self.fn, args, kwargs))
        if held is not leaves:  # a lazy tensor: the step reads the real tensor it holds
            leaves = held
            args, kwargs = pytree.tree_unflatten(leaves, tree)
        state, state_tensors, state_key = self._walk.walk(self.fn, args, kwargs, leaves)
        static = set(self.static_argnums)
        argnums = _leaf_argnums(args, kwargs) if static or self.batch_argnums is not None else None
        # The grad mode decides what the tracer records (a forward under no_grad has no backward to stage).
        key = (tree, _signature(leaves, static, argnums), state_key, global_batch, torch.is_grad_enabled())
        last = self._last_key
        if last is not None and state_key is last[2] and tree is last[0] and key == last:
            entry = self._last_entry  # the same key objects as the call before: no hash of the whole key
        else:
            entry = self._cache.get(key)
        if entry is None:
            if self._last_key is not None:
                self._log_restage(self._last_key, key, state)
            batched_leaves, batch = self._batch_leaves(args, kwargs, allow_empty=global_batch is not None)
            traced_args, traced_kwargs = args, kwargs
            if global_batch is not None:
                batch = global_batch
                traced_args, traced_kwargs = _map_batched(
                    self, args, kwargs, lambda x, dim: distributed.global_aval(x, dim, global_batch)
                )
            restore = state.snapshot()
            with distributed.staging(state, self.process_group):
                traced = trace(self.fn, traced_args, traced_kwargs, static_argnums=self.static_argnums, state=state)
            self._check_unchanged(state, state_key, args, kwargs, restore)
            graph = traced.graph
            arg_vars = [v for v, r in zip(graph.invars, graph.roles) if r == "arg"]
            batched = {v: Batched(dim) for v, (is_batched, dim) in zip(arg_vars, batched_leaves) if is_batched}
            # A chunk size that ran out of memory for another signature of this step is not tried again.
            entry = _Entry(
                traced,
                Executable(graph, batched, batch, traced.consts, cap=self._caps.get(batch), remat=self.remat),
            )
            self._cache[key] = entry
        self._last_key, self._last_entry = key, entry
        if argnums is None:
            inputs = [x for x in leaves if isinstance(x, torch.Tensor)]
        else:
            inputs = [x for x, a in zip(leaves, argnums) if isinstance(x, torch.Tensor) and a not in static]
        inputs += state_tensors
        inputs += [_grad_or_zeros(inputs[i]) for i in entry.traced.grad_params]
        inputs += entry.executable.consts
        return entry, inputs, state

    def _check_unchanged(self, state: State, key: tuple, args: tuple, kwargs: dict, restore: Callable) -> None:
        """Refuse a function that changes, while it is staged, a Python value its programs are keyed on.

        The trace runs the function's Python once; a later call reuses the program and runs none of it. A
        ``scheduler.step()`` or ``self.calls += 1`` inside the function would then happen once per trace,
        not once per call, and move the key it is cached under: silently wrong hyperparameters."""
        after = discover(self.fn, args, kwargs).tensors_and_key()[1]
        if after == key:
            return
        changed = state.changes(key, after)
        restore()
        name = getattr(self.fn, "__name__", "the function")
        code = getattr(self.fn, "__code__", None)
        where = f" (defined at {code.co_filename}:{code.co_firstlineno})" if code is not None else ""
        raise UnsupportedOpError(
            f"{name}{where} changed Python-side state while stagetorch staged it: {'; '.join(changed) or 'its state'}. "
            "Python code runs only when a function is staged, not on every call, so such an update (an LR "
            "scheduler's step(), a counter on a module) would happen once per program instead of once per step. "
            "What to do: make the update outside the staged function (call scheduler.step() after the step "
            "returns), or keep the value in a tensor. The values it changed have been put back."
        )

    def _batch_leaves(
        self, args: tuple, kwargs: dict, allow_empty: bool = False
    ) -> tuple[list[tuple[bool, int]], int]:
        """For each tensor leaf of the non-static arguments: is it batched, and along which dim; and the batch
        size. Raises a clear error for a batch dim out of range, mismatched batch sizes or an empty batch
        (unless ``allow_empty``: a process group's rank may hold no examples)."""
        static = set(self.static_argnums)
        chosen = None if self.batch_argnums is None else set(self.batch_argnums)
        if chosen is not None:
            for i in chosen:
                if i >= len(args) or not any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(args[i])):
                    raise TypeError(
                        f"batch_argnums names argument {i}, which is not a tensor (or pytree of tensors) "
                        f"in this call of {getattr(self.fn, '__name__', 'the function')}"
                    )
        names = _named_args(self.fn, args, kwargs)
        out, sizes = [], []
        for argnum, (name, tree) in enumerate(names):
            for path, leaf in pytree.tree_flatten_with_path(tree)[0]:
                if not isinstance(leaf, torch.Tensor) or argnum in static:
                    continue
                is_batched = chosen is None or argnum in chosen
                dim = self.batch_dim
                if is_batched:
                    where = name + pytree.keystr(path)
                    if not -leaf.ndim <= dim < leaf.ndim:
                        raise ShapeError(
                            f"batch_dim={dim} is out of range for argument {where} with shape {tuple(leaf.shape)}; "
                            "pass batch_dim=... or leave this argument out of batch_argnums"
                        )
                    dim %= leaf.ndim
                    sizes.append((where, leaf.shape[dim]))
                out.append((is_batched, dim))
        if len({n for _, n in sizes}) > 1:
            listed = ", ".join(f"{w}: {n}" for w, n in sizes)
            raise ShapeError(f"the batched arguments disagree on the batch size ({listed}); batch_dim={self.batch_dim}")
        batch = sizes[0][1] if sizes else 1
        if sizes and batch == 0 and not allow_empty:
            raise ShapeError(f"the batch is empty: {sizes[0][0]} has 0 examples along batch_dim={self.batch_dim}")
        return out, batch

    def graph(self, *args: Any, **kwargs: Any) -> Graph:
        """The staged program for these arguments (staging it if needed)."""
        return self._stage(args, kwargs)[0].traced.graph

    def plan(self, *args: Any, **kwargs: Any) -> Plan:
        """How a call with these arguments would run: chunk sizes, predicted peaks, and why.

        With a ``process_group`` this is this rank's plan for its shard, and a collective: call it on every
        rank, with every rank's shard. If no schedule fits on some rank, every rank raises the same
        ``OutOfMemoryError`` (``smallest_budget``: this rank's, None where it fitted), as the call does, so
        that a retry keeps the ranks in step.
        """
        if self.process_group is not None:
            group = distributed.ShardGroup(self.process_group)
            entry, _, plan, _ = self._shard(group, args, kwargs)
            group.check(plan if isinstance(plan, OutOfMemoryError) else None, entry.executable.signature())
            return plan
        entry, inputs, _ = self._stage(args, kwargs)
        return self._step_plan(entry, inputs)[1]

    def _budget(self, executable: Executable) -> int:
        return free_memory(executable.graph.device, self.memory_budget)

    def _held(self, entry: _Entry, inputs: list) -> tuple[int, list[str]]:
        """What a call holds beside the program while it runs, and why: the copies of the inputs it writes
        outside its commit (kept to restore them if the step fails: BatchNorm's statistics; an optimizer's
        parameters and moments only where something that can fail runs after its update), each
        ``.grad`` the step replaces or clears (the old one lives until the program has run), and each
        ``.grad`` it adds into after the program (gradient accumulation). Without them an optimizer step
        inside ``jit`` ran up to 35% over its plan, and an accumulating step over its budget."""
        executable, traced = entry.executable, entry.traced
        copies = {inputs[i].untyped_storage().data_ptr(): inputs[i].untyped_storage().nbytes() for i in executable.guarded}
        old = _grad_storages(inputs, (*traced.assign_grads, *traced.clear_grads))
        if entry.added is None:
            fed = {*traced.grad_params, *traced.assign_grads, *traced.clear_grads}
            entry.added = [i for i, _ in executable.graph.grads if i not in fed]
        added = _grad_storages(inputs, entry.added)
        why = [COPIES.format(len(copies))] if copies else []
        why += [f"the old .grad of {len(old)} parameter(s), which the step replaces"] if old else []
        why += [f"the .grad of {len(added)} parameter(s), which the step adds into"] if added else []
        return sum({**copies, **old, **added}.values()), why

    def _step_plan(self, entry: _Entry, inputs: list) -> tuple[int, Plan]:
        """The budget the program is planned in, and its plan: the step's budget less what the call holds
        beside the program (:meth:`_held`), which the plan's peak counts. An error about the budget then
        says what ``memory_budget`` would fit."""
        executable = entry.executable
        held, why = self._held(entry, inputs)
        whole = self._budget(executable)
        budget = max(whole - held, 0)
        try:
            plan = executable.plan(budget)
            last, last_held, last_whole, evolved = self._planned
            if plan is not last or held != last_held or whole != last_whole:
                evolved = attrs.evolve(plan, held_bytes=held, budget_bytes=whole)
                self._planned = (plan, held, whole, evolved)
            return budget, evolved
        except StagingError as e:
            wider = held_beside(e, held, why)
            if wider is e:
                raise
            raise wider from e

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.process_group is not None:
            return self._call_sharded(args, kwargs)
        entry, inputs, _ = self._stage(args, kwargs)
        executable = entry.executable
        budget, plan = self._step_plan(entry, inputs)
        name = getattr(self.fn, "__name__", "step")
        outs, grads = executable.run(inputs, budget, on_chunk=self._progress(plan), name=name)
        if executable.cap is not None:
            self._caps[executable.batch] = executable.cap
        traced = entry.traced
        first = len(inputs) - len(executable.consts) - len(traced.grad_params)
        install_grads(inputs, grads, inputs[first:], traced.grad_params, traced.assign_grads, traced.clear_grads)
        n = traced.graph.out_tree.num_leaves
        for (opt, p, key), value in zip(traced.state_outs, outs[n:]):
            opt.state[p][key] = value
        return pytree.tree_unflatten(outs[:n], traced.graph.out_tree)

    def _shard(self, group: distributed.ShardGroup, args: tuple, kwargs: dict) -> tuple:
        """Stage this rank's shard as part of the global batch and plan it for this rank's budget (two
        collectives). **Returns** the entry, its real inputs, the plan or the ``OutOfMemoryError`` that
        says none fits, and the shard's offset in the global batch."""
        def describe() -> tuple[int, distributed.Signature]:
            leaves, local = self._batch_leaves(args, kwargs, allow_empty=True)
            return local, self._signature(args, kwargs, leaves)

        sizes = group.global_sizes(describe, getattr(self.fn, "__name__", "the step"))
        local = sizes[group.rank]
        # The program is the global batch's, staged on contiguous stand-ins; the shard runs on what it cuts.
        args, kwargs = _map_batched(self, args, kwargs, lambda x, dim: x.contiguous())
        entry, inputs, _ = self._stage(args, kwargs, global_batch=sum(sizes))
        plan = entry.executable.shard_plan(local, self._budget(entry.executable))
        return entry, inputs, plan, sum(sizes[: group.rank])

    def _signature(self, args: tuple, kwargs: dict, leaves: list[tuple[bool, int]]) -> distributed.Signature:
        """What every rank's call must share: the step, the arguments' structure, their dtypes, and their
        shapes but the batch dimension (``leaves``: each tensor's (batched, dim), from ``_batch_leaves``)."""
        flat, tree = pytree.tree_flatten((args, kwargs))
        static = set(self.static_argnums)
        argnums = _leaf_argnums(args, kwargs)
        tensors = [x for x, a in zip(flat, argnums) if isinstance(x, torch.Tensor) and a not in static]
        shapes = [
            tuple("N" if batched and d == dim else n for d, n in enumerate(x.shape))
            for x, (batched, dim) in zip(tensors, leaves)
        ]
        code = getattr(self.fn, "__code__", None)
        where = f" ({code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno})" if code is not None else ""
        return distributed.Signature(
            the_step=f"{getattr(self.fn, '__qualname__', type(self.fn).__name__)}{where}",
            the_argument_structure=f"{tree} with leaves {[type(x).__name__ for x in flat]}",
            the_argument_dtypes=str([str(x.dtype).removeprefix("torch.") for x in tensors]),
            the_argument_shapes=str(shapes).replace("'N'", "N"),
        )

    def _call_sharded(self, args: tuple, kwargs: dict) -> Any:
        """One data-parallel step: this rank's shard of a global batch (see ``stagetorch.distributed``)."""
        group = distributed.ShardGroup(self.process_group)
        entry, inputs, plan, offset = self._shard(group, args, kwargs)
        traced = entry.traced
        if traced.state_outs or traced.grad_params or traced.assign_grads or traced.clear_grads:
            # Every rank staged the same program, so every rank raises here: no collective is left waiting.
            raise UnsupportedOpError(
                f"{getattr(self.fn, '__name__', 'the step')} reads or sets .grad, or steps an optimizer, inside a "
                "step staged with process_group=: the gradients are all-reduced after the staged program has run, "
                "so they would be this rank's alone. What to do: call clip_grad_norm_, opt.step() and "
                "opt.zero_grad() after the staged step returns (its .grad is then the global batch's)."
            )
        executable = entry.executable
        group.check(plan if isinstance(plan, OutOfMemoryError) else None, executable.signature())
        if plan.chunked or isinstance(plan, RematPlan):
            log.info("stagetorch: %s (rank %d): %s", getattr(self.fn, "__name__", "step"), group.rank, plan)
        outs, grads = executable.run_shard(inputs, plan, offset, group, on_chunk=self._progress(plan))
        for i, g in grads:
            accumulate_grad(inputs[i], g)
        return pytree.tree_unflatten(outs, executable.graph.out_tree)

    def _progress(self, plan: Plan) -> Any:
        if not self.progress:
            return None
        from tqdm.auto import tqdm

        bar = tqdm(total=plan.batch, unit="example", desc=getattr(self.fn, "__name__", "step"))

        def advance(start: int, n: int) -> None:
            bar.update(n)
            if start + n >= plan.batch:
                bar.close()

        return advance


_STAGED: weakref.WeakSet[Staged] = weakref.WeakSet()
_caches.on_clear(lambda: [s._cache.clear() for s in list(_STAGED)])


def clear_caches() -> None:
    """Forget every staged program and every module-level cache (traced op metadata, memory probes...).

    The next call of each staged function stages it again. Use it to free the memory the caches hold, or
    after changing something stagetorch cannot see (a custom op's rule re-registered under the same name).
    """
    _caches.clear_all()


def jit(
    fn: Callable | None = None,
    *,
    batch_dim: int = 0,
    batch_argnums: Sequence[int] | None = None,
    static_argnums: Sequence[int] = (),
    memory_budget: int | str | None = None,
    progress: bool = False,
    process_group: Any = None,
    remat: str | bool = "auto",
) -> Any:
    """Stage ``fn`` once per input signature and run the staged program.

    Usable bare (``@stagetorch.jit``) or with options (``@stagetorch.jit(memory_budget="2GiB")``).

    **Arguments**

    - ``batch_dim``: the batch dimension of every batched tensor argument.
    - ``batch_argnums``: which positional arguments carry the batch (default: every tensor argument).
    - ``static_argnums``: positional arguments that are Python values steering control flow; a new value
      stages a new program.
    - ``memory_budget``: bytes (or ``"512MiB"``) the step may use; default: the device's free memory.
      A batch whose step does not fit runs in chunks, combined exactly (see ``Staged.plan``).
    - ``progress``: show a progress bar over the chunks of a chunked step.
    - ``process_group``: a ``torch.distributed`` group (``torch.distributed.group.WORLD`` for all processes).
      Each rank passes its own shard of a global batch (shards may differ in size, or be empty); after
      the call every rank's ``.grad`` and the returned loss are those of the global batch, as one process
      running all shards concatenated in rank order would compute them. Each rank plans for its own
      ``memory_budget``. Per-example outputs are the rank's own examples. See the distributed docs page.
    - ``remat``: ``"auto"`` (default) lets a step that does not fit whole recompute forward values in the
      backward instead of keeping them, chosen together with the chunk size for the cheapest step that fits
      (the result is bit for bit the same); ``False`` only chunks. With a ``process_group`` each rank plans
      its own shard this way (ranks may differ in chunks and in what they recompute).

    **Returns** a :class:`Staged` callable.
    """
    options = dict(
        batch_dim=batch_dim,
        batch_argnums=batch_argnums,
        static_argnums=static_argnums,
        memory_budget=memory_budget,
        progress=progress,
        process_group=process_group,
        remat=remat,
    )
    if fn is None:
        return lambda f: Staged(f, **options)
    return Staged(fn, **options)


# ---------------------------------------------------------------------------------------------------------
# Memory reports: a front end over the memory interpreter.


def _live_totals(graph: Graph) -> list[int]:
    return [sum(row) for row in timeline(graph).live]


def memory(
    fn: Callable,
    *,
    batch_dim: int = 0,
    batch_argnums: Sequence[int] | None = None,
    static_argnums: Sequence[int] = (),
    memory_budget: int | str | None = None,
    remat: str | bool = "auto",
) -> Callable[..., MemoryReport]:
    """Cost ``fn`` before running it: ``stagetorch.memory(fn)(*args, **kwargs) -> MemoryReport``.

    The step is staged at the given batch and at other sizes: a half and a quarter of it (the batched
    arguments sliced along ``batch_dim``), or, below 4 examples, two, three and four times it (the batched
    arguments repeated: one example is often a program of its own), and at one example. The fixed and
    per-example parts come from the two largest; the third checks that the peak is affine in the batch.
    Nothing is run and no real tensor is touched.

    With a ``memory_budget`` (and ``remat`` as in :func:`jit`), the report's ``schedule`` says how the step
    would run under it: the chunk sizes, the predicted peak, what is recomputed and what that costs; its
    plot draws that program's live bytes. When no schedule fits, the error ``jit`` would raise is raised.
    """

    def cost(*args: Any, **kwargs: Any) -> MemoryReport:
        staged = Staged(
            fn, batch_dim=batch_dim, batch_argnums=batch_argnums, static_argnums=static_argnums,
            memory_budget=memory_budget, remat=remat,
        )
        rep = unbudgeted(staged, args, kwargs)
        return rep if memory_budget is None else attrs.evolve(rep, schedule=_schedule(staged, args, kwargs))

    def unbudgeted(staged: Staged, args: tuple, kwargs: dict) -> MemoryReport:
        leaves, batch = staged._batch_leaves(args, kwargs)
        entry, inputs, _ = staged._stage(args, kwargs)
        graph = entry.traced.graph
        held, why = staged._held(entry, inputs)
        held_note = f"Beside the program the call holds {format_bytes(held)}: {'; '.join(why)}." if held else ""

        def report(*a: Any, **k: Any) -> MemoryReport:
            return costing_report(*a, **k, held=held, held_note=held_note)

        if not any(b for b, _ in leaves):
            return report(graph, batch, True, "No argument carries a batch.")
        sizes = [batch // 2, batch // 4] if batch >= 4 else [2 * batch, 3 * batch, 4 * batch]
        totals = {batch: _live_totals(graph)}
        if 1 not in totals:
            try:
                totals[1] = _live_totals(_staged_at(staged, args, kwargs, 1))
            except ValueError as e:
                # The step's own code refuses one example, as eager would (BatchNorm in training mode needs
                # more than one value per channel): the report has no probe there, and checks the line
                # at three quarters of the batch instead.
                log.info("stagetorch: memory: %s not staged at one example: %s", getattr(fn, "__name__", "step"), e)
                sizes = [batch // 2, 3 * batch // 4] if batch >= 4 else sizes
        for b in sizes:
            if b not in totals:
                totals[b] = _live_totals(_staged_at(staged, args, kwargs, b))
        large, small, check = sorted({batch, *sizes}, reverse=True)[:3]
        peaks = {b: max(t) for b, t in totals.items()}
        slope = (peaks[large] - peaks[small]) / (large - small)
        line = (peaks[large] - slope * large, slope)
        def cost_at(b: int) -> int:
            return peak_bytes(_staged_at(staged, args, kwargs, b))

        if not len(totals[large]) == len(totals[small]) == len(totals[check]):
            return report(graph, batch, False, "The staged program changes with the batch size (control flow on "
                          "shapes): the per-example part is the line through the peaks at batches "
                          f"{small} and {large}, and predict() stages the step at the batch asked.",
                          line=line, probes=peaks, cost_at=cost_at)
        point_slope = tuple((x - y) / (large - small) for x, y in zip(totals[large], totals[small]))
        fixed = tuple(x - s * large for x, s in zip(totals[large], point_slope))
        worst = max(abs(a + s * check - q) for a, s, q in zip(fixed, point_slope, totals[check]))
        linear = worst <= 1e-3 * max(totals[check]) + 1024
        note = "" if linear else (
            f"The peak is not affine in the batch: staging at batch {check} differs by up to {format_bytes(worst)} "
            f"from the line through batches {small} and {large} (an op whose size grows faster than the batch, "
            "such as attention across examples, or a kernel whose workspace is padded); predict() stages the step "
            "at the batch asked."
        )
        # Below the smallest batch the lines were checked at, a point's bytes may bend: a kernel's workspace is
        # the larger of a fixed and a per-example part, or another kernel runs. predict() stages it there.
        return report(
            graph, batch, linear, note, (fixed, point_slope), line=line, probes=peaks, cost_at=cost_at,
            lines_from=check if linear else None,
        )

    return cost


def _schedule(staged: Staged, args: tuple, kwargs: dict) -> Schedule:
    """How ``staged`` would run these arguments under its budget, for the memory report: the plan ``jit``
    makes, what it recomputes, and the live bytes of the program one chunk runs."""
    entry, inputs, _ = staged._stage(args, kwargs)
    executable = entry.executable
    _, plan = staged._step_plan(entry, inputs)
    budget, held = plan.budget_bytes, plan.held_bytes
    recompute = plan.recompute if isinstance(plan, RematPlan) else None
    graph = executable.graph if recompute is None else recompute.graph
    if plan.chunked:
        split = executable.split() if recompute is None else executable._for(graph).split()
        body = split.body(max(plan.chunk_sizes)).rest
        # A later chunk as the run holds it: the chunk planner's peak for it, less the body's own peak,
        # is what the run holds around the body (inputs, shared values, accumulators); the call holds
        # ``held`` beside the whole run.
        around = body_peaks(split, split.body(max(plan.chunk_sizes)), peak_bytes)[1] - max(
            peak_bytes(body) - sum(v.aval.nbytes for v in body.invars), 0
        )
        body_inputs = sum(v.aval.nbytes for v in body.invars)
        live = [held + around + max(b - body_inputs, 0) for b in _live_totals(body)]
        program = body
    else:
        live = [held + b - (executable._overlap or 0) for b in _live_totals(graph)]
        program = graph
    recomputed = tuple(recomputed_eqns(graph))
    # Point i of a timeline is while equation i - 1 runs.
    marks = tuple(i + 1 for i, e in enumerate(program.eqns) if e.source.backward == RECOMPUTED)
    if recompute is None:
        return Schedule(budget, plan.peak, plan.chunk_sizes, (), (), (), (), 0, graph_flops(graph), live, marks, str(plan))
    made: dict[Var, Eqn] = {}  # root -> the equation that first made its storage
    for e in executable.graph.eqns:
        for v in e.outvars:
            if v is not None:
                made.setdefault(v.root, e)
    dropped = tuple(r for r in recompute.cands.roots if r not in recompute.keep)
    return Schedule(
        budget, plan.peak, plan.chunk_sizes, recomputed, dropped, tuple(made[r] for r in dropped),
        tuple(r for r in recompute.cands.roots if r in recompute.keep), plan.extra_flops, plan.base_flops, live,
        marks, str(plan),
    )


def _map_batched(staged: Any, args: tuple, kwargs: dict, f: Callable[[torch.Tensor, int], Any]) -> tuple[tuple, dict]:
    """The arguments with every batched tensor ``x`` replaced by ``f(x, its batch dim)``."""
    leaves_info, _ = staged._batch_leaves(args, kwargs, allow_empty=True)
    it = iter(leaves_info)
    static = set(staged.static_argnums)

    def resize(x: Any, argnum: int) -> Any:
        if not isinstance(x, torch.Tensor) or argnum in static:
            return x
        is_batched, dim = next(it)
        return f(x, dim) if is_batched else x

    new_args = tuple(pytree.tree_map(lambda x, i=i: resize(x, i), a) for i, a in enumerate(args))
    new_kwargs = {k: pytree.tree_map(lambda x: resize(x, -1), v) for k, v in kwargs.items()}
    return new_args, new_kwargs


def _staged_at(staged: Staged, args: tuple, kwargs: dict, b: int) -> Graph:
    """The step staged at ``b`` examples: the batched arguments sliced (views, no copy) or repeated."""

    def resize(x: torch.Tensor, dim: int) -> torch.Tensor:
        batch = x.shape[dim]
        if b <= batch:
            return x.narrow(dim, 0, b)
        return x.repeat_interleave(-(-b // batch), dim=dim).narrow(dim, 0, b)

    new_args, new_kwargs = _map_batched(staged, args, kwargs, resize)
    graph = staged.graph(*new_args, **new_kwargs)
    # A slice is a view of the whole batch; cost it as the batch of that size it stands for.
    for v, role in zip(graph.invars, graph.roles):
        if role == "arg" and v.base is None:
            v.storage_nbytes = v.aval.nbytes
    return graph

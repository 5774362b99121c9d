"""The public entry points that stage a function: ``make_ir``, ``eval_shape`` and ``jit``.

``jit`` caches one staged program per input signature and runs it with the chunked executor, which runs
the whole batch at once when it fits.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
import torch.utils._pytree as pytree

from . import shapes
from .batching import Batched, analyze
from .chunking import Split, run_chunked
from .costing import MemoryReport, peak_bytes, report, timeline
from .devices import format_bytes, free_memory
from .errors import BatchCouplingError, ShapeError, UnsupportedOpError
from .execute import Program, accumulate_grad
from .ir import Aval, Graph, Var
from .planning import SAFETY_MARGIN, Plan, _chunk_peak, plan_chunks
from .remat_planning import Recompute, RematPlan, frontier, plan_joint
from .tracing import State, Traced, arg_names, discover, trace

__all__ = ["make_ir", "eval_shape", "jit", "Staged", "memory", "Executable"]

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
        return pytree.tree_unflatten(outs, graph.out_tree)

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
    _mutated: list[int] | None = None
    _full_peak: int | None = None
    remat: bool = False
    _inner: dict[Graph, Executable] = attrs.field(factory=dict)
    _points: list[Recompute] | None = None

    @property
    def program(self) -> Program:
        if self._program is None:
            self._program = Program(self.graph)
        return self._program

    def split(self) -> Split:
        if self._split is None:
            self._split = Split(analyze(self.graph, self.batched, self.batch))
        return self._split

    def plan(self, budget: int) -> Plan:
        # The device's free memory moves a little between calls: re-plan only when the answer can change.
        # The whole graph is costed once; a budget it fits in reuses one plan.
        if self._full_peak is None:
            self._full_peak = peak_bytes(self.graph)
        fits = self._full_peak <= budget * (1 - SAFETY_MARGIN)
        # Chunked plans are kept per budget to about 0.4% (its top 9 bits).
        key = -1 if fits else budget >> max(budget.bit_length() - 9, 0) << max(budget.bit_length() - 9, 0)
        if key not in self.plans:
            if self.remat and not fits:
                self.plans[key] = plan_joint(
                    self.graph, budget, lambda g: self._chunk_plan(g, budget), self._floor, self._frontier
                )
            else:
                self.plans[key] = plan_chunks(self.graph, self.split, self.batch, budget, peak_bytes, self._full_peak)
        return self.plans[key]

    def _frontier(self) -> list[Recompute]:
        if self._points is None:
            self._points = frontier(self.graph)
        return self._points

    def _for(self, graph: Graph) -> Executable:
        """The Executable of a recomputing graph the joint planner made from this one (same inputs)."""
        if graph not in self._inner:
            self._inner[graph] = Executable(graph, self.batched, self.batch, self.consts)
        return self._inner[graph]

    def _chunk_plan(self, graph: Graph, budget: int) -> Plan:
        if graph is self.graph:
            return plan_chunks(self.graph, self.split, self.batch, budget, peak_bytes, self._full_peak)
        return self._for(graph).plan(budget)

    def _floor(self, graph: Graph) -> int:
        """The fewest bytes ``graph`` runs in: one example per chunk, or the whole batch if it cannot be split."""
        try:
            return _chunk_peak(self.split() if graph is self.graph else self._for(graph).split(), 1, peak_bytes)
        except (BatchCouplingError, UnsupportedOpError):
            return peak_bytes(graph)

    def run(
        self, inputs: list, budget: int, *, on_chunk: Callable[[int, int], None] | None = None, name: str = "step"
    ) -> tuple[list, list[tuple[int, torch.Tensor]]]:
        """Run on real ``inputs`` (parallel to ``graph.invars``) within ``budget`` bytes.

        **Returns** the flat outputs and the (input position, gradient) pairs to accumulate into ``.grad``.
        If anything fails, inputs the program updates in place (buffers) are restored first.
        """
        plan = self.plan(budget)
        if isinstance(plan, RematPlan) and plan.recompute is not None:
            return self._for(plan.recompute.graph).run(inputs, budget, on_chunk=on_chunk, name=name)
        mutated = self._mutated
        if mutated is None:
            mutated = self._mutated = _mutated_inputs(self.graph)
        if not mutated and len(plan.chunk_sizes) == 1:  # one call, nothing to restore if it fails
            return self.program.run(inputs)
        saved = [(inputs[i], inputs[i].clone()) for i in mutated]
        try:
            if plan.chunked:
                log.info("stagetorch: %s: %s", name, plan)
                outs, grads, _ = run_chunked(self.split(), inputs, plan.chunk_sizes, on_chunk=on_chunk)
                return outs, grads
            return self.program.run(inputs)
        except BaseException:
            with torch.no_grad():
                for t, copy in saved:
                    t.copy_(copy)
            raise


@attrs.define
class _Entry:
    traced: Traced
    executable: Executable


def device_of(graph: Graph) -> torch.device:
    """The device a graph's batch lives on: that of its first argument, else of its first input."""
    for v, role in zip(graph.invars, graph.roles or ["arg"] * len(graph.invars)):
        if role == "arg":
            return v.aval.device
    return graph.invars[0].aval.device if graph.invars else torch.device("cpu")


def _mutated_inputs(graph: Graph) -> list[int]:
    """Positions of inputs that some equation writes in place (a buffer update, an in-place op on an arg)."""
    roots = {v: i for i, v in enumerate(graph.invars)}
    out = []
    for e in graph.eqns:
        schema = getattr(e.prim, "_schema", None)
        if schema is None:
            continue
        for a, x in zip(schema.arguments, e.args):
            if a.alias_info is not None and a.alias_info.is_write and isinstance(x, Var):
                i = roots.get(x.root)
                if i is not None and i not in out:
                    out.append(i)
    return out


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
        remat: str | bool = "auto",
    ):
        if remat not in ("auto", False):
            raise ValueError(f"remat must be \"auto\" or False, not {remat!r}")
        self.remat = remat == "auto"
        self.fn = fn
        self.progress = progress
        self.batch_dim = batch_dim
        self.batch_argnums = None if batch_argnums is None else tuple(batch_argnums)
        self.static_argnums = tuple(static_argnums)
        self.memory_budget = memory_budget
        self._cache: dict[tuple, _Entry] = {}
        functools.update_wrapper(self, fn)

    def _stage(self, args: tuple, kwargs: dict) -> tuple[_Entry, list, State]:
        state = discover(self.fn, args, kwargs)
        state_tensors, state_key = state.tensors_and_key()
        leaves, tree = pytree.tree_flatten((args, kwargs))
        static = set(self.static_argnums)
        argnums = _leaf_argnums(args, kwargs) if static or self.batch_argnums is not None else None
        key = (tree, _signature(leaves, static, argnums), state_key)
        entry = self._cache.get(key)
        if entry is None:
            batched_leaves, batch = self._batch_leaves(args, kwargs)
            traced = trace(self.fn, args, kwargs, static_argnums=self.static_argnums, state=state)
            graph = traced.graph
            arg_vars = [v for v, r in zip(graph.invars, graph.roles) if r == "arg"]
            batched = {v: Batched(dim) for v, (is_batched, dim) in zip(arg_vars, batched_leaves) if is_batched}
            entry = _Entry(traced, Executable(graph, batched, batch, traced.consts, remat=self.remat))
            self._cache[key] = entry
        if argnums is None:
            inputs = [x for x in leaves if isinstance(x, torch.Tensor)]
        else:
            inputs = [x for x, a in zip(leaves, argnums) if isinstance(x, torch.Tensor) and a not in static]
        inputs += state_tensors
        inputs += entry.executable.consts
        return entry, inputs, state

    def _batch_leaves(self, args: tuple, kwargs: dict) -> tuple[list[tuple[bool, int]], int]:
        """For each tensor leaf of the non-static arguments: is it batched, and along which dim; and the batch
        size. Raises a clear error for a batch dim out of range, mismatched batch sizes or an empty batch."""
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
        if sizes and batch == 0:
            raise ShapeError(f"the batch is empty: {sizes[0][0]} has 0 examples along batch_dim={self.batch_dim}")
        return out, batch

    def graph(self, *args: Any, **kwargs: Any) -> Graph:
        """The staged program for these arguments (staging it if needed)."""
        return self._stage(args, kwargs)[0].traced.graph

    def plan(self, *args: Any, **kwargs: Any) -> Plan:
        """How a call with these arguments would run: chunk sizes, predicted peaks, and why."""
        entry, inputs, _ = self._stage(args, kwargs)
        return entry.executable.plan(self._budget(entry.executable))

    def _budget(self, executable: Executable) -> int:
        return free_memory(device_of(executable.graph), self.memory_budget)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        entry, inputs, _ = self._stage(args, kwargs)
        executable = entry.executable
        budget = self._budget(executable)
        name = getattr(self.fn, "__name__", "step")
        outs, grads = executable.run(inputs, budget, on_chunk=self._progress(executable.plan(budget)), name=name)
        for i, g in grads:
            accumulate_grad(inputs[i], g)
        return pytree.tree_unflatten(outs, entry.traced.graph.out_tree)

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


def jit(
    fn: Callable | None = None,
    *,
    batch_dim: int = 0,
    batch_argnums: Sequence[int] | None = None,
    static_argnums: Sequence[int] = (),
    memory_budget: int | str | None = None,
    progress: bool = False,
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
    - ``remat``: ``"auto"`` (default) lets a step that does not fit whole recompute forward values in the
      backward instead of keeping them, chosen together with the chunk size for the cheapest step that fits
      (the result is bit for bit the same); ``False`` only chunks.

    **Returns** a :class:`Staged` callable.
    """
    options = dict(
        batch_dim=batch_dim,
        batch_argnums=batch_argnums,
        static_argnums=static_argnums,
        memory_budget=memory_budget,
        progress=progress,
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
) -> Callable[..., MemoryReport]:
    """Cost ``fn`` before running it: ``stagetorch.memory(fn)(*args, **kwargs) -> MemoryReport``.

    The step is staged at the given batch and at two smaller ones (the batched arguments sliced along
    ``batch_dim``); the fixed and per-example parts come from those peaks, and a third size checks that the
    peak is affine in the batch. Nothing is run and no real tensor is touched.
    """

    def cost(*args: Any, **kwargs: Any) -> MemoryReport:
        staged = Staged(fn, batch_dim=batch_dim, batch_argnums=batch_argnums, static_argnums=static_argnums)
        leaves, batch = staged._batch_leaves(args, kwargs)
        graph = staged.graph(*args, **kwargs)
        if batch < 4 or not any(b for b, _ in leaves):
            return report(graph, batch, True, "Too few examples to separate the per-example part.")
        totals = {batch: _live_totals(graph)}
        for b in (batch // 2, batch // 4):
            small_args, small_kwargs = _sliced(staged, args, kwargs, b)
            small = staged.graph(*small_args, **small_kwargs)
            # The slices are views of the whole batch; cost them as the batch of that size they stand for.
            for v, role in zip(small.invars, small.roles):
                if role == "arg" and v.base is None:
                    v.storage_nbytes = v.aval.nbytes
            totals[b] = _live_totals(small)
        half, quarter = batch // 2, batch // 4
        if not len(totals[batch]) == len(totals[half]) == len(totals[quarter]):
            return report(graph, batch, False, "The staged program changes with the batch size (control flow on "
                           "shapes), so the per-example part cannot be separated.")
        slope = tuple((x - y) / (batch - half) for x, y in zip(totals[batch], totals[half]))
        fixed = tuple(x - s * batch for x, s in zip(totals[batch], slope))
        worst = max(abs(a + s * quarter - q) for a, s, q in zip(fixed, slope, totals[quarter]))
        linear = worst <= 1e-3 * max(totals[quarter]) + 1024
        note = "" if linear else (
            f"The peak is not affine in the batch: staging at batch {quarter} differs by up to {format_bytes(worst)} "
            f"from the line through batches {half} and {batch} (an op whose size grows faster than the batch, "
            "such as attention across examples)."
        )
        return report(graph, batch, linear, note, (fixed, slope))

    return cost


def _sliced(staged: Any, args: tuple, kwargs: dict, b: int) -> tuple[tuple, dict]:
    leaves_info, _ = staged._batch_leaves(args, kwargs)
    it = iter(leaves_info)
    static = set(staged.static_argnums)

    def cut(x: Any, argnum: int) -> Any:
        if not isinstance(x, torch.Tensor) or argnum in static:
            return x
        is_batched, dim = next(it)
        return x.narrow(dim, 0, b) if is_batched else x

    new_args = tuple(pytree.tree_map(lambda x, i=i: cut(x, i), a) for i, a in enumerate(args))
    new_kwargs = {k: pytree.tree_map(lambda x: cut(x, -1), v) for k, v in kwargs.items()}
    return new_args, new_kwargs

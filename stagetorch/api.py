"""The public entry points: ``jit``, ``memory``, ``make_ir``, ``eval_shape`` and ``clear_caches``.

``jit`` returns a :class:`~stagetorch.runtime.staged.Staged`, which caches one staged program per input signature
and runs it through an :class:`~stagetorch.runtime.executable.Executable`: the whole batch at once when it fits,
else in exact chunks, recomputing where its planner says so.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, overload

import attrs
import torch
import torch.utils._pytree as pytree

from .devices.budget import format_bytes
from .errors import StagingError
from .interpreters import shapes
from .interpreters.flops import graph_flops
from .interpreters.memory import MemoryReport, Schedule, peak_bytes, timeline
from .interpreters.memory import report as costing_report
from .ir import Aval, Eqn, Graph, SourceInfo, Var, iter_vars
from .planning import plans
from .planning.chunks import body_peaks
from .runtime.executable import Executable
from .runtime.fit import device_fit
from .runtime.staged import Staged, grad_storages, map_batched
from .staging.tracer import trace
from .transforms.remat import RECOMPUTED, recomputed_eqns
from .utils import caches

__all__ = ["make_ir", "eval_shape", "jit", "Staged", "memory", "Executable", "clear_caches"]

log = logging.getLogger("stagetorch")


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




def clear_caches() -> None:
    """Forget every staged program and every module-level cache (traced op metadata, memory probes...).

    The next call of each staged function stages it again. Use it to free the memory the caches hold, or
    after changing something stagetorch cannot see (a custom op's rule re-registered under the same name).
    """
    caches.clear_all()


@overload
def jit(
    fn: Callable,
    *,
    batch_dim: int = 0,
    batch_argnums: Sequence[int] | None = None,
    static_argnums: Sequence[int] = (),
    memory_budget: int | str | None = None,
    progress: bool = False,
    process_group: Any = None,
    remat: str | bool = "auto",
    donate_grads: bool = False,
    device: str | Any = None,
) -> Staged: ...


@overload
def jit(
    fn: None = None,
    *,
    batch_dim: int = 0,
    batch_argnums: Sequence[int] | None = None,
    static_argnums: Sequence[int] = (),
    memory_budget: int | str | None = None,
    progress: bool = False,
    process_group: Any = None,
    remat: str | bool = "auto",
    donate_grads: bool = False,
    device: str | Any = None,
) -> Callable[[Callable], Staged]: ...


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
    donate_grads: bool = False,
    device: str | Any = None,
) -> Staged | Callable[[Callable], Staged]:
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
    - ``donate_grads``: ``False`` (default) keeps each ``.grad`` a ``zero_grad()`` inside the step replaces
      until the staged program has run, so that a step that fails (an exception, or running out of memory)
      leaves every ``.grad`` exactly as it was; the call holds them beside the program, and the plan counts
      them. ``True`` frees them when the call starts, as eager PyTorch frees them at ``zero_grad()``, like
      ``jax.jit(donate_argnums=...)``: each ``.grad`` the step replaces or clears *without reading it first*
      is set to None before the program runs (a ``.grad`` the step clips, adds into or returns is kept). The
      step then peaks where eager does, one set of gradients lower; a step that fails leaves those ``.grad``
      None, as eager's would after its ``zero_grad()``, and parameters, buffers, optimizer state and every
      other ``.grad`` exactly as they were. Gradient accumulation (a step that adds into ``.grad``) is not
      affected. See "What a failed step leaves" in the chunking docs.
    - ``device``: the CUDA device to plan for: a GPU by name (``"H100-80GB"``, ``"A100-40GB"``, ``"T4"``...: see
      ``stagetorch.devices.catalog``), ``"cuda"`` for this process's own, or a ``Device``. A named card this
      process does not run on is planned from any machine: the step is staged on fake CUDA tensors (its
      arguments, parameters and buffers as fakes of the same shapes and dtypes; a model built on the meta
      device works) and planned for that card's memory, caching allocator and cuBLAS workspace;
      ``.plan(*args)`` and ``stagetorch.memory`` answer, and calling it raises ``PlanOnlyDeviceError``. See
      the "Will it fit?" docs page.

    **Returns** a :class:`Staged` callable (with ``fn`` left out, a decorator that makes one). Its
    ``.plan(*args)`` says how a call with those arguments would run (chunks, predicted peak, why) without
    running it. The ``stagetorch`` logger says the plan in one line at INFO on the first call (chunks, predicted
    peak of the budget, the whole batch's peak), and again only when it changes, saying why (another batch size,
    another budget, the step staged again, a chunk that ran out of memory); the full plan at DEBUG.

    **Raises** (on the call, not here): :class:`BatchShapeError` (a ``ValueError``: ``batch_dim`` out of range
    for an argument, batched arguments that disagree on the batch size, an empty batch), :class:`NotATensorError`
    (a ``TypeError``: ``batch_argnums`` names an argument that is not a tensor), :class:`ShapeError` (shapes that
    do not match, at the user's line),
    :class:`ConcretizationError` (Python control flow on a value that depends on the parameters),
    :class:`UnsupportedOpError` (an op stagetorch cannot stage or chunk exactly), :class:`BatchCouplingError`
    (examples meet where the batch must be split), :class:`OutOfMemoryError` (no plan fits ``memory_budget``;
    it names the smallest that does). A step that raises leaves parameters, buffers and ``.grad`` as they were.

    **Example**

    ```python
    @stagetorch.jit(memory_budget="2GiB")
    def train_step(x, y):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    print(train_step.plan(x, y))   # how it will run
    loss = train_step(x, y)        # model's .grad as one full-batch step would leave it
    ```
    """
    options = dict(
        batch_dim=batch_dim,
        batch_argnums=batch_argnums,
        static_argnums=static_argnums,
        memory_budget=memory_budget,
        progress=progress,
        process_group=process_group,
        remat=remat,
        donate_grads=donate_grads,
        device=device,
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
    donate_grads: bool = False,
    device: str | Any = None,
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
    With ``donate_grads=True`` the report costs the step as ``jit(donate_grads=True)`` runs it: without the
    old ``.grad`` it drops before its program runs (the report's note says how many bytes).
    With a ``device`` (as in :func:`jit`: ``"H100-80GB"``), the step is staged on fake CUDA tensors and the
    report's ``device`` says what that card holds: the predicted max allocated and max reserved bytes, and the
    largest batch that fits whole, in chunks and recomputing (:class:`~stagetorch.runtime.fit.DeviceFit`).
    """

    def cost(*args: Any, **kwargs: Any) -> MemoryReport:
        staged = Staged(
            fn, batch_dim=batch_dim, batch_argnums=batch_argnums, static_argnums=static_argnums,
            memory_budget=memory_budget, remat=remat, donate_grads=donate_grads, device=device,
        )
        # Its probes stage the step at other batch sizes: that is no retrace to warn of (said at DEBUG).
        staged.restage_log_level = logging.DEBUG
        rep = unbudgeted(staged, args, kwargs)
        if memory_budget is not None:
            rep = attrs.evolve(rep, schedule=_schedule(staged, args, kwargs))
        if staged.device is not None:
            rep = attrs.evolve(rep, device=device_fit(staged, rep, args, kwargs))
        return rep

    def unbudgeted(staged: Staged, args: tuple, kwargs: dict) -> MemoryReport:
        leaves, batch = staged._batch_leaves(args, kwargs)
        entry, inputs, _ = staged._stage(args, kwargs)
        graph = entry.traced.graph
        held, why = staged._held(entry, inputs)
        held_note = f"Beside the program the call holds {format_bytes(held)}: {'; '.join(why)}." if held else ""
        dropped = [i for i in staged._donated(entry) if inputs[i].grad is not None]
        donated_note = (
            f"The call drops the old .grad of {len(dropped)} parameter(s) "
            f"({format_bytes(sum(grad_storages(inputs, dropped).values()))}), which the step replaces or clears "
            "without reading it, before its program runs (donate_grads=True): they are not counted." if dropped else ""
        )

        def report(*a: Any, **k: Any) -> MemoryReport:
            rep = costing_report(*a, **{**k, "held": held, "held_note": held_note})
            return attrs.evolve(rep, note=f"{rep.note} {donated_note}".strip()) if donated_note else rep

        if not any(b for b, _ in leaves):
            return report(graph, batch, True, "No argument carries a batch.")

        def unprobed(why: str, src: SourceInfo | None = None) -> MemoryReport:
            # The report jit's own graph gives: the peak at this batch, with no per-example split.
            where = f" (at {src})" if src is not None else ""
            note = (f"The per-example split is unknown: {why}{where}, so the step was not staged at other batch "
                    f"sizes; the peak is that of the program jit runs at batch {batch}, and predict() answers "
                    "only there.")

            def refuse(b: int) -> int:
                raise StagingError(
                    f"stagetorch.memory: the report costs the step at batch {batch} only, not at {b}: {why}{where}."
                    "\nWhat to do: ask stagetorch.memory(step) with a batch of that size, or pass the batch-sized "
                    "tensor to the step as an argument (and write its batch size as x.shape[0])."
                )

            return attrs.evolve(report(graph, batch, False, note, cost_at=refuse), per_example_known=False)

        elsewhere = _batch_from_elsewhere(entry.executable)
        if elsewhere is not None:
            return unprobed(*elsewhere)
        sizes = [batch // 2, batch // 4] if batch >= 4 else [2 * batch, 3 * batch, 4 * batch]
        whole = timeline(graph)
        totals = {batch: [sum(row) for row in whole.live]}
        try:
            if 1 not in totals:
                try:
                    totals[1] = _live_totals(_staged_at(staged, args, kwargs, 1))
                except ValueError as e:
                    # The step's own code refuses one example, as eager would (BatchNorm in training mode needs
                    # more than one value per channel): the report has no probe there, and checks the line
                    # at three quarters of the batch instead.
                    log.debug("stagetorch: memory: %s not staged at one example: %s", getattr(fn, "__name__", "step"), e)
                    sizes = [batch // 2, 3 * batch // 4] if batch >= 4 else sizes
            for b in sizes:
                if b not in totals:
                    totals[b] = _live_totals(_staged_at(staged, args, kwargs, b))
        except (StagingError, RuntimeError, ValueError, IndexError, TypeError) as e:
            # The step stages at its own batch only (it writes the batch size as a number, ``x.reshape(96, -1)``,
            # or reads a tensor of that size it does not receive): jit runs it; the report says what it knows.
            first = str(e).strip().splitlines()[0].rstrip(":") if str(e).strip() else type(e).__name__
            log.debug("stagetorch: memory: %s not staged at another batch: %s", getattr(fn, "__name__", "step"), e)
            return unprobed(f"the step does not stage at another batch size than {batch} (it may write its batch "
                            f"size as a number, or read a tensor of that size it does not receive: {first})")
        large, small, check = sorted({batch, *sizes}, reverse=True)[:3]
        checks = [check]
        if whole.lifetimes.ruled or whole.lifetimes.workspaces:
            # A rule's bytes may be rounded (oneDNN's RNN workspace to pages): lines through even batches
            # can agree where odd ones leave them. One odd batch between the two largest checks them too.
            odd = next((o for o in range(large - 1, small, -1) if o % 2 and o not in totals), None)
            if odd is not None:
                totals[odd] = _live_totals(_staged_at(staged, args, kwargs, odd))
                checks.append(odd)
        peaks = {b: max(t) for b, t in totals.items()}
        slope = (peaks[large] - peaks[small]) / (large - small)
        line = (peaks[large] - slope * large, slope)
        def cost_at(b: int) -> int:
            return peak_bytes(_staged_at(staged, args, kwargs, b))

        if len({len(totals[b]) for b in (large, small, *checks)}) > 1:
            return report(graph, batch, False, "The staged program changes with the batch size (control flow on "
                          "shapes): the per-example part is the line through the peaks at batches "
                          f"{small} and {large}, and predict() stages the step at the batch asked.",
                          line=line, probes=peaks, cost_at=cost_at)
        point_slope = tuple((x - y) / (large - small) for x, y in zip(totals[large], totals[small]))
        fixed = tuple(x - s * large for x, s in zip(totals[large], point_slope))
        off = {b: max(abs(a + s * b - q) for a, s, q in zip(fixed, point_slope, totals[b])) for b in checks}
        worst_at = max(checks, key=lambda b: off[b] - 1e-3 * max(totals[b]))
        worst = off[worst_at]
        linear = all(off[b] <= 1e-3 * max(totals[b]) + 1024 for b in checks)
        note = "" if linear else (
            f"The peak is not affine in the batch: staging at batch {worst_at} differs by up to {format_bytes(worst)} "
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
    plan = staged._step_plan(entry, inputs)
    budget, held = plan.budget_bytes, plan.held_bytes
    recompute = plans.recompute_of(plan)
    graph = executable.graph if recompute is None else recompute.graph
    phases = plans.phase_graphs(plan)
    if phases is not None:  # cut where the examples meet, or (bnorm) in passes: their programs one after another
        live = [held + b for g in phases for b in _live_totals(g)]
        return Schedule(budget, plan.peak, plan.chunk_sizes, plans.recomputed_names(plan), (), (), (),
                        plans.flops(plan, 0)[0], graph_flops(graph), live, (), str(plan))
    if plan.chunked:
        split = executable.split() if recompute is None else executable.planner.recomputing(graph).split()
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
        live = [held + b - (executable.planner.overlap or 0) for b in _live_totals(graph)]
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
        tuple(r for r in recompute.cands.roots if r in recompute.keep), *plans.flops(plan, graph_flops(graph)), live,
        marks, str(plan),
    )


def _batch_from_elsewhere(executable: Executable) -> tuple[str, SourceInfo] | None:
    """Why the step's peak cannot be staged at other batch sizes by slicing its arguments, and where: a
    tensor the step does not receive (a global, a buffer, a closed-over tensor; not a parameter, whose size
    may match the batch's by chance) that the batch analysis pairs with the examples, found back from the
    values it pairs through the operands of the batch's extent. It keeps the whole batch's size whatever the
    arguments' (and may even broadcast against one example). None where there is none, or where the step
    cannot be chunked at all."""
    try:
        analysis = executable.split().analysis
    except StagingError:
        return None
    graph = analysis.graph
    roles = dict(zip(graph.invars, graph.roles or ["arg"] * len(graph.invars)))
    names = dict(zip(graph.invars, graph.names or [""] * len(graph.invars)))
    makers = {v: e for e in graph.eqns for v in e.outvars if v is not None}
    for v, lab in analysis.spanning.items():
        extent, todo, seen = lab.extent(analysis.batch), [v], set()
        while todo:
            w = todo.pop()
            if w in seen:
                continue
            seen.add(w)
            if roles.get(w, "arg") not in ("arg", "param"):
                reader = next((e for e in graph.eqns if w in iter_vars((e.args, e.kwargs))), None)
                what = f"the {'tensor' if roles[w] == 'const' else roles[w]} {names.get(w) or ''}".rstrip()
                why = (f"the step reads {what} ({w.aval}), which has the batch's size {extent} and is not an "
                       "argument")
                return why, reader.source if reader is not None else SourceInfo()
            e = makers.get(w)
            if e is not None:  # back through the operands that carry the batch's extent
                todo.extend(x for x in iter_vars((e.args, e.kwargs)) if extent in x.aval.shape)
    return None


def _staged_at(staged: Staged, args: tuple, kwargs: dict, b: int) -> Graph:
    """The step staged at ``b`` examples: the batched arguments sliced (views, no copy) or repeated."""

    def resize(x: torch.Tensor, dim: int) -> torch.Tensor:
        batch = x.shape[dim]
        if b <= batch:
            return x.narrow(dim, 0, b)
        return x.repeat_interleave(-(-b // batch), dim=dim).narrow(dim, 0, b)

    new_args, new_kwargs = map_batched(staged, args, kwargs, resize)
    graph = staged.graph(*new_args, **new_kwargs)
    # A slice is a view of the whole batch; cost it as the batch of that size it stands for.
    for v, role in zip(graph.invars, graph.roles):
        if role == "arg" and v.base is None:
            v.storage_nbytes = v.aval.nbytes
    return graph

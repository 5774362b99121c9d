"""The memory interpreter: how many bytes a Graph holds at each equation, and at its peak.

The schedule is the eager interpreter's, :func:`stagetorch.transforms.schedule.liveness`: inputs resident; each storage
allocated at its first definition (views, in-place results and aliases share their base's storage) and freed
after the last use of any value living in it; outputs and accumulated gradients kept to the end; equations
nobody needs not run. Memory rules in the registry add what tensor sizes
do not show (transient workspace). On CUDA, sizes are rounded as the caching allocator rounds them.

A step's last program commits an optimizer's update as :func:`stagetorch.transforms.commit.commit_plan` lays it out
(one workspace for its temporaries, allocated before its first write): costed as such.

It knows the IR, the registry, the passes' schedule and the commit's layout; it runs nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import torch
from torch._prims_common import compute_elementwise_output_strides

from ..devices.budget import format_bytes
from ..ir import Eqn, Graph, SourceInfo, Var, contiguous_strides, op_name
from ..registry import slot
from ..transforms.commit import commit_plan, may_commit
from ..transforms.schedule import Liveness, liveness, scheduled
from ..utils import collector

__all__ = [
    "CATEGORIES", "MemoryEffect", "effect", "workspace", "Layouts", "allocated", "Lifetimes", "Timeline", "timeline", "peak_bytes", "Schedule",
    "MemoryReport", "report", "CommitCost", "commit_cost", "allocation_events",
]

# "optimizer": an optimizer's state the step reads or makes (it steps inside the staged function; a first step
# makes its moments); "workspace": what kernels allocate inside themselves while they run, and the one
# allocation an optimizer's commit makes for its temporaries (:func:`stagetorch.transforms.commit.commit_plan`), held
# from its first write to the end of the program; "held": what the call holds beside the program (each .grad
# it adds into or replaces, restore copies), in reports only.
CATEGORIES = (
    "parameters", "buffers", "optimizer", "inputs", "gradients", "activations", "temporaries", "workspace", "held",
)

_CUDA_BLOCK = 512  # the caching allocator rounds every block up to a multiple of 512 bytes


def allocated(nbytes: int, device: torch.device) -> int:
    """The bytes the device's allocator takes for a tensor of ``nbytes`` (CUDA rounds blocks up to 512)."""
    if device.type == "cuda" and nbytes:
        return -(-nbytes // _CUDA_BLOCK) * _CUDA_BLOCK
    return nbytes


@attrs.frozen
class MemoryEffect:
    """What a memory rule may say beyond a plain number: transient ``workspace`` bytes held while the op
    runs, and the true size of outputs whose abstract value understates them (``{outvar index: bytes}``,
    e.g. an opaque workspace tensor that a fake kernel reports as empty)."""

    workspace: int = 0
    outputs: dict = attrs.field(factory=dict)


def _rule(e: Eqn, name: str, rules: dict | None) -> Callable[..., Any] | None:
    """The registry's ``name`` rule for ``e``'s op; ``rules`` memoises the look-ups (by slot and op)."""
    if rules is None:
        return slot(e.prim, name)
    key = (name, e.prim)
    if key not in rules:
        rules[key] = slot(e.prim, name)
    return rules[key]


def _memory_effect(e: Eqn, rules: dict | None) -> MemoryEffect:
    rule = _rule(e, "memory", rules)
    if rule is None:
        return _NO_EFFECT
    out = rule(e)
    return out if isinstance(out, MemoryEffect) else MemoryEffect(int(out))


# Ops whose CPU and CUDA kernels return a new, contiguous tensor whatever their inputs' strides.
_CONTIGUOUS_OUT = {
    torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm,
    torch.ops.aten._unsafe_view, torch.ops.aten.zeros, torch.ops.aten.ones, torch.ops.aten.empty, torch.ops.aten.full,
    torch.ops.aten.native_layer_norm_backward,
}


class Layouts:
    """``layouts(v)``: the strides ``v`` of ``graph`` has when the graph runs, where the IR says them, else
    None. A value the tracer saw carries its strides (``Var.strides``: the tracer's fake tensors are laid
    out as the kernels lay theirs, see :mod:`stagetorch.ops.layout_rules`; a staged function is staged again for
    arguments laid out otherwise), and so do a chunk's inputs and the values a pass makes from one whose
    strides it knows. For a value a pass made without them, this follows it back to the op that made its
    storage: one of :data:`_CONTIGUOUS_OUT` makes it contiguous, a pointwise op over operands of its shape
    lays it out as TensorIterator does, and each view on the way (``view``, ``transpose``, ``permute``...) is
    replayed on a meta tensor of those strides. Any other is unknown. For workspace rules that depend on an
    argument's layout (a kernel that copies a strided argument); unknown must be read as the costlier case."""

    def __init__(self, graph: Graph):
        self._graph = graph
        self._makers: dict[Var, Eqn] | None = None
        self._memo: dict[Var, tuple[int, ...] | None] = {}

    def __call__(self, v: Var) -> tuple[int, ...] | None:
        if v.strides is not None:
            return v.strides
        if v in self._memo:
            return self._memo[v]
        if self._makers is None:
            self._makers = {o: e for e in self._graph.eqns for o in e.outvars if o is not None}
        e = self._makers.get(v)
        out = None if e is None else self._fresh(e, v) if v.base is None else self._view(e, v)
        self._memo[v] = out
        return out

    def _fresh(self, e: Eqn, v: Var) -> tuple[int, ...] | None:
        packet = getattr(e.prim, "overloadpacket", None)
        contiguous = contiguous_strides(v.aval.shape)
        if packet in _CONTIGUOUS_OUT:
            return contiguous
        if torch.Tag.pointwise in getattr(e.prim, "tags", ()) and all(x.aval.shape == v.aval.shape for x in e.invars):
            strides = [self(x) for x in e.invars]
            if not strides or any(s is None for s in strides):
                return None
            if all(s == contiguous for s in strides):
                return contiguous
            metas = [torch.empty_strided(x.aval.shape, s, dtype=x.aval.dtype, device="meta") for x, s in zip(e.invars, strides)]
            return tuple(compute_elementwise_output_strides(*metas))
        return None

    def _view(self, e: Eqn, v: Var) -> tuple[int, ...] | None:
        x = e.args[0] if e.args else None
        # ATen ops only (a view, or an in-place op of one tensor): a Python function a pass put in the graph
        # is not run, even on meta tensors.
        if not isinstance(e.prim, torch._ops.OpOverload) or not isinstance(x, Var) or len(e.invars) != 1 or v not in e.outvars:
            return None
        strides = self(x)
        if strides is None:
            return None
        try:
            meta = torch.empty_strided(x.aval.shape, strides, dtype=x.aval.dtype, device="meta")
            out = e.prim(meta, *e.args[1:], **e.kwargs)
        except Exception:  # noqa: BLE001 - not a plain view op: unknown
            return None
        outs = out if isinstance(out, (tuple, list)) else (out,)
        got = outs[e.outvars.index(v)] if e.outvars.index(v) < len(outs) else None
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(v.aval.shape):
            return None
        return tuple(got.stride())


def _unknown(v: Var) -> None:
    return None


def workspace(e: Eqn, rules: dict | None = None, layouts: Callable[[Var], Any] | None = None) -> int | None:
    """The bytes ``e``'s kernel allocates inside itself beyond its outputs, by the registry's workspace rule
    (None: the op has none). Held only while the equation runs. ``layouts``: the strides of ``e``'s
    arguments where known (:class:`Layouts`), for a rule marked ``reads_layouts`` (called ``rule(e, layouts)``)."""
    rule = _rule(e, "workspace", rules)
    if rule is None:
        return None
    if getattr(rule, "reads_layouts", False):
        return int(rule(e, layouts or _unknown))
    return int(rule(e))


def effect(e: Eqn, rules: dict | None = None, layouts: Callable[[Var], Any] | None = None) -> MemoryEffect:
    """The registry's memory and workspace rules for ``e``'s op applied to ``e`` (no rule: no effect beyond
    its outputs). ``rules``: the rules looked up so far (a caller's memo over one graph); ``layouts``: see
    :func:`workspace`."""
    eff = _memory_effect(e, rules)
    extra = workspace(e, rules, layouts)
    return eff if not extra else attrs.evolve(eff, workspace=eff.workspace + extra)


_NO_EFFECT = MemoryEffect()


@attrs.frozen
class CommitCost:
    """What a program's commit (:func:`stagetorch.transforms.commit.commit_plan`) allocates otherwise than one
    tensor per equation: before equation ``eqn`` runs, one ``spaces`` allocation per device (bytes before
    rounding, device), held to the end of the program, which ``placed`` outputs (the commit's temporaries)
    live in; and, beside it, the storage of each ``early`` output (a first step's momentum buffer: a tensor
    the program keeps, filled at its own equation). Indices are the graph's equations."""

    eqn: int
    spaces: tuple[tuple[int, torch.device], ...]
    placed: frozenset[Var]
    early: tuple[Var, ...]


def commit_cost(graph: Graph, schedule: Liveness | None = None) -> CommitCost | None:
    """The commit of ``graph`` run as a step's last program (``Program(graph, final=True)``), in the
    graph's own equations; None when it has none (it writes no input in a tail that cannot fail)."""
    schedule = schedule if schedule is not None else liveness(graph)
    if not may_commit(graph, schedule):
        return None
    run = scheduled(graph, schedule)
    commit = commit_plan(run)
    if commit.start is None:
        return None
    steps = [i for i, runs in enumerate(schedule.runs) if runs]  # run.eqns[k] is graph.eqns[steps[k]]
    placed = frozenset(v for k in commit.places for v in run.eqns[k].outvars if v is not None)
    early = tuple(run.eqns[k].outvars[0] for k in commit.fresh)
    spaces = tuple((b, d) for d, b in commit.workspace.items() if b)
    return CommitCost(steps[commit.start], spaces, placed, early)


@attrs.frozen
class Lifetimes:
    """When each storage a run allocates is live, so that the peak can be summed again for other sizes of
    the same storages (the planner's chunk graphs for another chunk size: same schedule, other shapes).

    Parallel lists, one entry per root in order of allocation (inputs first), then one per equation with a
    workspace rule (its kernel's workspace, live in that equation's row only) and one per device of a
    commit's workspace (live from its first write to the end), in order: ``nbytes`` as the tensor sizes
    (or the workspace rule) say, before the allocator's rounding, ``rounded`` whether the device's allocator
    rounds it, ``start`` and ``end`` the first and last timeline row it is live in. ``rows``: the rows the
    peak is taken over (before the first equation, and each equation that runs). ``ruled``: a memory rule
    added bytes that sizes alone do not give (an output's true size, an opaque workspace), so :meth:`peak`
    does not apply.
    """

    nbytes: list[int]
    rounded: list[bool]
    start: list[int]
    end: list[int]
    rows: list[int]
    ruled: bool
    workspaces: int = 0  # how many entries, at the end, are workspaces

    def peak(self, nbytes: np.ndarray) -> int:
        """The timeline's peak with each root holding ``nbytes`` (parallel to :attr:`nbytes`, before rounding)."""
        assert not self.ruled
        nbytes = np.asarray(nbytes, dtype=np.int64)
        sizes = np.where(self.rounded, -(-nbytes // _CUDA_BLOCK) * _CUDA_BLOCK, nbytes)
        end = np.asarray(self.end, dtype=np.int64)
        delta = np.zeros(max(int(end.max(initial=0)), self.rows[-1]) + 2, dtype=np.int64)
        np.add.at(delta, self.start, sizes)
        np.add.at(delta, end + 1, -sizes)
        return int(np.cumsum(delta)[self.rows].max())


@attrs.frozen
class Timeline:
    """Live bytes by category after each equation (index 0 is before the first), and where the peak is.

    ``live[i][c]`` is the bytes of category ``CATEGORIES[c]`` live while equation ``i - 1`` runs (its
    inputs, outputs and workspace all held). ``owners`` maps each root var to (category, bytes, equation
    that made it); ``peak_live`` lists the roots live at the peak; ``lifetimes`` when each root is live.
    """

    live: list[tuple[int, ...]]
    peak_bytes: int
    peak_index: int
    peak_live: list[Var]
    owners: dict[Var, tuple[str, int, int]]
    peak_workspace: int
    lifetimes: Lifetimes
    # The storages the program makes and keeps to its end (its outputs, accumulated gradients): never freed by it.
    kept: frozenset[Var] = frozenset()


@collector.paused()  # a row and a list per equation, all kept: the collector's passes would find nothing
def timeline(graph: Graph, workspaces: bool = True, final: bool = True) -> Timeline:
    """Walk ``graph`` in program order, along the schedule the executor runs
    (:func:`stagetorch.transforms.schedule.liveness`), and record live bytes by category. An equation that does not run
    (dead, or an alias of a value already held) adds nothing; its row repeats the one before.
    ``workspaces=False`` leaves out the registry's workspace rules: tensor sizes alone. ``final``: the graph
    runs as a step's last program, whose commit (an optimizer stepped last) allocates its temporaries in
    one workspace and a first step's buffers with it (:func:`commit_cost`); else each where it is made. A
    program that is not the last (a chunk, the shared phase) has no commit; costed as final, one whose tail
    writes its inputs is over-estimated (the workspace holds at least the temporaries live at once, longer)."""
    roles = graph.roles or ["arg"] * len(graph.invars)
    cat_of_role = {"param": "parameters", "buffer": "buffers", "arg": "inputs", "const": "inputs"}
    schedule = liveness(graph)
    storage = schedule.storage
    grad_roots = {storage(v) for _, v in graph.grads}
    # The outputs past the user's are the state an optimizer stepped inside makes (a first step's moments).
    made_state = graph.outvars[graph.out_tree.num_leaves:] if graph.out_tree is not None else ()
    state_roots = {storage(v) for v in made_state if isinstance(v, Var)}
    commit = commit_cost(graph, schedule) if final else None
    placed = commit.placed if commit is not None else frozenset()
    commit_ws = 0  # bytes of the commit's workspace, once allocated
    n = len(graph.eqns)
    last = schedule.last_use
    index = {c: k for k, c in enumerate(CATEGORIES)}
    live = [0] * len(CATEGORIES)
    owners: dict[Var, tuple[str, int, int]] = {}
    # Per root, in order of allocation: its bytes before rounding, and the rows it is live in (ended as freed).
    raw: list[int] = []
    start: list[int] = []
    ended: dict[Var, int] = {}
    ruled = False
    # (bytes, rounded, first row, last row) of each workspace rule's answer and of a commit's workspace
    ws_entries: list[tuple[int, bool, int, int]] = []
    names = graph.names or [""] * len(graph.invars)
    for v, role, name in zip(graph.invars, roles, names):
        r = v.root
        if r not in owners:
            size = allocated(r.owned_nbytes, r.aval.device)
            # The tracer names an optimizer's state "<optimizer>.state[<i>][<key>]".
            cat = "optimizer" if role == "const" and ".state[" in name else cat_of_role.get(role, "inputs")
            owners[r] = (cat, size, -1)
            live[index[owners[r][0]]] += size
            raw.append(r.owned_nbytes)
            start.append(0)
    frees: list[list[Var]] = [[] for _ in range(n + 1)]
    for r, i in last.items():
        if owners.get(r, ("", 0, 0))[2] != -1 and r not in placed:
            frees[i].append(r)
    rows = [tuple(live)]
    ran = [0]
    rules: dict = {}
    layouts = Layouts(graph)
    peak, peak_index, peak_ws = sum(live), 0, 0
    for i, e in enumerate(graph.eqns):
        if not schedule.runs[i]:
            rows.append(tuple(live))
            continue
        eff = _memory_effect(e, rules)
        ruled = ruled or eff is not _NO_EFFECT
        extra = workspace(e, rules, layouts) if workspaces else None
        ran.append(i + 1)
        if commit is not None and i == commit.eqn:
            # The commit's one allocation, before its first write: its workspace, held to the end, and the
            # tensors it keeps that a first step makes (filled at their own equations).
            for nbytes, device in commit.spaces:
                size = allocated(nbytes, device)
                commit_ws += size
                live[index["workspace"]] += size
                ws_entries.append((nbytes, device.type == "cuda", i + 1, n))
            for v in commit.early:
                r = storage(v)
                if r not in owners:
                    made = next(k for k in range(i, n) if v in graph.eqns[k].outvars)
                    cat = "optimizer" if r in state_roots else "activations"
                    owners[r] = (cat, allocated(r.owned_nbytes, r.aval.device), made)
                    live[index[cat]] += owners[r][1]
                    raw.append(r.owned_nbytes)
                    start.append(i + 1)
        for j, v in enumerate(e.outvars):
            if v is None:
                continue
            r = storage(v)
            if r in owners or r in placed:
                continue
            if r in state_roots:
                cat = "optimizer"
            else:
                cat = "gradients" if r in grad_roots else ("temporaries" if e.source.backward else "activations")
            nbytes = eff.outputs.get(j, r.owned_nbytes)
            size = allocated(nbytes, r.aval.device)
            raw.append(nbytes)
            start.append(i + 1)
            owners[r] = (cat, size, i)
            live[index[cat]] += size
            if r not in last:  # never read, never kept: dies as soon as the op returns
                frees[i].append(r)
        ws = eff.workspace
        if extra is not None:
            device = next((v.aval.device for v in e.outvars if v is not None), torch.device("cpu"))
            ws_entries.append((extra, device.type == "cuda", i + 1, i + 1))
            ws += allocated(extra, device)
        total = sum(live) + ws
        row = list(live)
        row[index["workspace"]] += ws
        rows.append(tuple(row))
        if total > peak:
            peak, peak_index, peak_ws = total, i + 1, ws + commit_ws
        for r in frees[i]:
            cat, size, _ = owners[r]
            live[index[cat]] -= size
            ended[r] = i + 1
    end = [ended.get(r, n) for r in owners]
    rounded = [r.aval.device.type == "cuda" for r in owners]
    lifetimes = Lifetimes(
        raw + [w[0] for w in ws_entries], rounded + [w[1] for w in ws_entries], start + [w[2] for w in ws_entries],
        end + [w[3] for w in ws_entries], ran, ruled, len(ws_entries),
    )
    # The roots live at the peak, from their lifetimes (a copy of the live set at each new peak would cost
    # the square of a forward pass's length).
    peak_live = [r for r, a, b in zip(owners, start, end) if a <= peak_index <= b]
    kept = frozenset(r for r, (_, _, made) in owners.items() if made >= 0 and r not in ended)
    return Timeline(rows, peak, peak_index, peak_live, owners, peak_ws, lifetimes, kept)


def allocation_events(graph: Graph, final: bool = True) -> list[tuple[str, Any, int]]:
    """The order in which running ``graph`` allocates and frees storage, as a device's allocator sees it (for
    :mod:`stagetorch.devices.cuda_allocator`): ``("alloc", key, bytes)`` when a storage is made (bytes before any
    rounding; an equation's outputs, then its kernel's workspace), ``("free", key, 0)`` when it goes (the
    workspace as its equation ends, each storage after its last use). The graph's inputs are not in it (they
    exist before it runs), nor the frees of what it keeps to its end (:attr:`Timeline.kept`) or of a commit's
    workspace (held to the end). Keys are the storages' root vars, and ``("workspace", i)`` for the ``i``-th
    workspace. ``final`` as in :func:`timeline`."""
    t = timeline(graph, final=final)
    life, roots = t.lifetimes, list(t.owners)
    at: dict[int, list[tuple[str, Any, int]]] = {}
    ends: dict[int, list[tuple[str, Any, int]]] = {}
    for k, (nbytes, start, end) in enumerate(zip(life.nbytes, life.start, life.end)):
        if start == 0:
            continue
        key = roots[k] if k < len(roots) else ("workspace", k - len(roots))
        at.setdefault(start, []).append(("alloc", key, nbytes))
        if k >= len(roots):
            if start == end:  # a kernel's workspace goes as its equation ends; a commit's is held to the end
                at[start].append(("free", key, 0))
        elif key not in t.kept:
            ends.setdefault(end, []).append(("free", key, 0))
    return [ev for row in sorted({*at, *ends}) for ev in (*at.get(row, ()), *ends.get(row, ()))]


def peak_bytes(graph: Graph, workspaces: bool = True) -> int:
    """The most bytes live at once when the eager interpreter runs ``graph`` (``workspaces=False``: the
    tensors alone, without what kernels allocate inside themselves)."""
    return timeline(graph, workspaces).peak_bytes


# ---------------------------------------------------------------------------------------------------------
# The report.


@attrs.frozen
class Schedule:
    """How a step runs under a memory budget: the plan's chunks and predicted peak, and what it recomputes.

    ``recomputed`` are the equations the recomputing program runs a second time in the backward, ``dropped``
    the forward values (root vars of the staged graph) it recomputes instead of keeping and ``made_by`` the
    forward equation that made each, ``kept`` the checkpoints; ``extra_flops`` is what the recomputation adds to the step's ``base_flops``. ``live`` is
    the live bytes (all categories) at each point of the program one chunk runs, as the run holds them
    (with the inputs, accumulators and shared values of the whole run), the whole batch when it is not
    chunked; ``marks`` are the points of ``live`` where a recomputed equation runs. ``plan`` is the plan's
    own description.
    """

    budget_bytes: int
    peak_bytes: int
    chunk_sizes: tuple[int, ...]
    recomputed: tuple[Eqn, ...]
    dropped: tuple[Var, ...]
    made_by: tuple[Eqn, ...]
    kept: tuple[Var, ...]
    extra_flops: int
    base_flops: int
    live: list[int]
    marks: tuple[int, ...]
    plan: str

    def __str__(self) -> str:
        sizes = "+".join(map(str, self.chunk_sizes))
        lines = [
            f"Under a budget of {format_bytes(self.budget_bytes)}: {len(self.chunk_sizes)} chunk(s) [{sizes}], "
            f"predicted peak {format_bytes(self.peak_bytes)}."
        ]
        if not self.recomputed:
            lines.append("Nothing is recomputed.")
            return "\n".join(lines)
        ops: dict[str, int] = {}
        for e in self.recomputed:
            ops[op_name(e.prim)] = ops.get(op_name(e.prim), 0) + 1
        listed = ", ".join(f"{n} x {op}" for op, n in sorted(ops.items(), key=lambda kv: -kv[1]))
        lines.append(
            f"Recomputes {len(self.recomputed)} op(s) in the backward ({listed}): {self.extra_flops / 1e6:.1f} "
            f"MFLOP more than the step's {self.base_flops / 1e6:.1f} ({self.extra_flops / max(self.base_flops, 1):.1%}); "
            f"{len(self.dropped)} forward value(s) recomputed, {len(self.kept)} checkpoint(s) kept."
        )
        lines.append("Recomputed values:")
        lines += [f"  {op_name(e.prim)} -> {v.aval}  # {e.source}" for v, e in zip(self.dropped[:10], self.made_by)]
        if len(self.dropped) > 10:
            lines.append(f"  ... and {len(self.dropped) - 10} more")
        return "\n".join(lines)


@attrs.frozen
class MemoryReport:
    """What a staged step needs: its peak, how that grows with the batch, and where the bytes go.

    ``peak_bytes = fixed_bytes + per_example_bytes * batch``: the line through the peaks at the two largest
    batches costed (exact at those when ``linear``). ``by_category``, ``by_op`` and ``by_module`` break down
    the bytes live at the peak; ``peak_source`` is the user's line of the equation at which the peak occurs.
    ``probes`` holds the peak at every batch size that was costed. ``schedule``, when the report was asked
    for a memory budget, is how the step runs under it (chunks, recomputation, predicted peak).
    """

    peak_bytes: int
    fixed_bytes: float
    per_example_bytes: float
    batch: int
    linear: bool
    note: str
    by_category: dict[str, int]
    by_op: dict[str, int]
    by_module: dict[str, int]
    peak_op: str
    peak_source: SourceInfo
    live: list[tuple[int, ...]]
    peak_index: int
    point_fixed: tuple[float, ...] = ()
    point_per_example: tuple[float, ...] = ()
    probes: dict[int, int] = attrs.field(factory=dict)
    # Costs the step at another batch size (it holds the arguments it stages from): at every batch when the
    # peak is not affine in the batch, where no line predicts it, and below ``lines_from`` otherwise.
    cost_at: Callable[[int], int] | None = attrs.field(default=None, eq=False, repr=False)
    schedule: Schedule | None = None
    # The smallest batch the per-point lines were checked at; None: at every batch.
    lines_from: int | None = None
    # False where the step could be staged at its own batch only (a batch-sized tensor it does not receive,
    # its batch size written as a number): ``fixed_bytes`` is then the peak, ``per_example_bytes`` 0, and
    # ``predict`` answers at ``batch`` only (the note says why).
    per_example_known: bool = True
    # With ``stagetorch.memory(step, device=...)``: what the step holds on that CUDA device, max allocated and
    # max reserved, and the largest batch that fits it whole, in chunks and recomputing
    # (:class:`stagetorch.runtime.fit.DeviceFit`).
    device: Any = None

    def predict(self, batch: int) -> int:
        """The peak for another batch size: exact at a batch that was costed, at any batch when the peak is
        not affine in the batch or the program has a kernel workspace, and below the batches the lines were
        checked at (the step is costed there: a kernel's workspace that is the larger of a fixed and a
        per-example part bends there); else every program point's live bytes are affine in the batch, and the
        peak is the largest of them (the point where it occurs can move as the batch grows)."""
        below = self.lines_from is not None and batch < self.lines_from
        # A kernel's workspace is not affine in the batch (oneDNN's blocking and its kernel choice follow the
        # shapes: a grouped convolution's backward at 8 examples took 4.6% more than the lines from 16 said): a
        # program with one is staged at the batch asked, so predict is what the plan at that batch says.
        workspace = CATEGORIES.index("workspace")
        bends = not self.linear or below or any(row[workspace] for row in self.live)
        if batch not in self.probes and self.cost_at is not None and bends:
            self.probes[batch] = self.cost_at(batch)
        if batch in self.probes:
            return self.probes[batch]
        if not self.point_fixed:
            return int(round(self.fixed_bytes + self.per_example_bytes * batch))
        return int(round(max(a + b * batch for a, b in zip(self.point_fixed, self.point_per_example))))

    def __str__(self) -> str:
        split = (
            f": fixed {format_bytes(self.fixed_bytes)} + {format_bytes(self.per_example_bytes)} per example"
            + ("" if self.linear else " (NOT linear in the batch; see note)")
            if self.per_example_known else " (per-example split unknown; see note)"
        )
        lines = [
            f"Peak {format_bytes(self.peak_bytes)} at batch {self.batch}{split}",
            f"Peak at {self.peak_op}  # {self.peak_source}",
        ]
        if self.note:
            lines.append(self.note)
        for title, table in (("category", self.by_category), ("op", self.by_op), ("module", self.by_module)):
            rows = sorted(table.items(), key=lambda kv: -kv[1])[:10]
            width = max((len(k) for k, _ in rows), default=8)
            lines.append(f"\nLive at the peak, by {title}:")
            lines += [f"  {k:<{width}}  {format_bytes(v):>10}  {100 * v / max(self.peak_bytes, 1):5.1f}%" for k, v in rows]
        if self.schedule is not None:
            lines.append("\n" + str(self.schedule))
        if self.device is not None:
            lines.append("\n" + str(self.device))
        return "\n".join(lines)

    def plot(self, path: str) -> str:
        """Save a stacked plot of live bytes across the program, by category, with the peak marked; with a
        ``schedule``, a second panel draws the live bytes of the program that runs under the budget (one
        chunk, recomputing) over those of the whole batch without recomputation, recomputed equations marked."""
        try:
            import matplotlib
        except ImportError as e:
            raise ImportError(
                'MemoryReport.plot draws with matplotlib, which is an optional extra of stagetorch: '
                'pip install "stagetorch[plot]" (or pip install matplotlib)'
            ) from e

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = 1 if self.schedule is None else 2
        fig, axes = plt.subplots(rows, 1, figsize=(10, 4.5 * rows), squeeze=False)
        self._plot_categories(axes[0][0])
        if self.schedule is not None:
            self._plot_schedule(axes[1][0], self.schedule)
        fig.tight_layout()
        fig.savefig(path, dpi=120 if rows == 1 else 90)
        plt.close(fig)
        return path

    def _plot_categories(self, ax: Any) -> None:
        xs = list(range(len(self.live)))
        series = [[row[c] / 2**20 for row in self.live] for c in range(len(CATEGORIES))]
        ax.stackplot(xs, series, labels=CATEGORIES, step="post")
        ax.axvline(self.peak_index, color="black", linestyle="--", linewidth=1)
        ax.annotate(
            f"peak {format_bytes(self.peak_bytes)}\n{self.peak_op}",
            (self.peak_index, self.peak_bytes / 2**20),
            xytext=(5, -30),
            textcoords="offset points",
            fontsize=8,
        )
        ax.set_xlabel("equation (program order, forward then backward)")
        ax.set_ylabel("live MiB")
        ax.set_title(f"stagetorch memory: batch {self.batch}")
        ax.legend(loc="upper left", fontsize=8)

    def _plot_schedule(self, ax: Any, s: Schedule) -> None:
        mib = 2**20
        ax.step(range(len(self.live)), [sum(row) / mib for row in self.live], where="post", color="0.55",
                label=f"batch {self.batch} at once, no recomputation (peak {format_bytes(self.peak_bytes)})")
        chunk = max(s.chunk_sizes)
        what = f"one chunk of {chunk}" if len(s.chunk_sizes) > 1 else f"batch {self.batch} at once"
        ax.step(range(len(s.live)), [b / mib for b in s.live], where="post", color="tab:blue",
                label=f"{what}, {'recomputing' if s.recomputed else 'no recomputation'} (peak {format_bytes(max(s.live))})")
        if s.marks:
            ax.plot(list(s.marks), [s.live[i] / mib for i in s.marks], "|", color="tab:red", markersize=9,
                    label=f"recomputed equation ({len(s.marks)})")
        ax.axhline(s.budget_bytes / mib, color="black", linestyle="--", linewidth=1,
                   label=f"budget {format_bytes(s.budget_bytes)}")
        ax.set_xlabel("equation (program order, forward then backward)")
        ax.set_ylabel("live MiB")
        extra = f", +{s.extra_flops / max(s.base_flops, 1):.1%} FLOPs" if s.recomputed else ""
        ax.set_title(f"under the budget: {len(s.chunk_sizes)} chunk(s), predicted peak {format_bytes(s.peak_bytes)}{extra}")
        ax.set_ylim(bottom=0)
        ax.legend(loc="upper left", fontsize=8)


def _totals(t: Timeline) -> list[int]:
    return [sum(row) for row in t.live]


def report(
    graph: Graph,
    batch: int,
    linear: bool,
    note: str,
    points: tuple[tuple[float, ...], tuple[float, ...]] = ((), ()),
    line: tuple[float, float] | None = None,
    probes: dict[int, int] | None = None,
    cost_at: Callable[[int], int] | None = None,
    lines_from: int | None = None,
    held: int = 0,
    held_note: str = "",
) -> MemoryReport:
    """The report for ``graph`` staged at ``batch``. ``line`` is (fixed, per example) through the peaks;
    ``points`` the same per program point, when the program is the same at every batch costed (all of
    the program's own bytes). ``held``: bytes the call holds beside the program at every batch, added to
    every point and peak (category "held"); ``held_note`` says what they are."""
    t = timeline(graph)
    fixed, per_example = line if line is not None else (float(t.peak_bytes), 0.0)
    fixed += held
    if held:
        points = (tuple(a + held for a in points[0]), points[1])
        note = f"{note} {held_note}".strip()
        if cost_at is not None:
            program_at = cost_at

            def cost_at(b: int) -> int:
                return program_at(b) + held
    by_category: dict[str, int] = {c: 0 for c in CATEGORIES}
    by_op: dict[str, int] = {}
    by_module: dict[str, int] = {}
    for r in t.peak_live:
        cat, size, i = t.owners[r]
        by_category[cat] += size
        if i >= 0:
            e = graph.eqns[i]
            by_op[op_name(e.prim)] = by_op.get(op_name(e.prim), 0) + size
            module = e.source.module or ("(backward)" if e.source.backward else "(top level)")
            by_module[module] = by_module.get(module, 0) + size
        else:
            by_module["(inputs and state)"] = by_module.get("(inputs and state)", 0) + size
    by_category["workspace"] = t.peak_workspace
    by_category["held"] = held
    at = graph.eqns[t.peak_index - 1] if t.peak_index > 0 else None
    k = CATEGORIES.index("held")
    live = [row[:k] + (row[k] + held,) + row[k + 1:] for row in t.live] if held else t.live
    return MemoryReport(
        peak_bytes=t.peak_bytes + held,
        fixed_bytes=fixed,
        per_example_bytes=per_example,
        batch=batch,
        linear=linear,
        note=note,
        by_category={k: v for k, v in by_category.items() if v},
        by_op=by_op,
        by_module=by_module,
        peak_op=op_name(at.prim) if at is not None else "(inputs)",
        peak_source=at.source if at is not None else SourceInfo(),
        live=live,
        peak_index=t.peak_index,
        point_fixed=points[0],
        point_per_example=points[1],
        probes={b: p + held for b, p in {batch: t.peak_bytes, **(probes or {})}.items()},
        cost_at=cost_at,
        lines_from=lines_from,
    )

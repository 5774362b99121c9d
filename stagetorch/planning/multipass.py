"""Running a step in passes, one per level of batch-wide values: BatchNorm's statistics, in exact chunks.

The chunked executor runs one level of batch-wide values that per-example work reads (a loss's normaliser)
by a pre-pass over the chunks. A BatchNorm in training, written as batch sums (:mod:`stagetorch.transforms.batch_norm_sums`),
needs a level per layer: layer 2's sums are over values normalised with layer 1's statistics; and its
backward two sums per layer (of the gradient, and of the gradient times the normalised input), each over
gradients that the layers after it normalised with theirs.

The **level** of a batch-wide value (one the batch analysis says per-example work reads:
``BatchAnalysis.needs_global``) is one more than the highest level among the batch-wide values it depends
on. The step runs as one chunked pass per level, each an ordinary Graph over the step's inputs and the
lower levels' values (found in the graph by what each value reads, not by recognising a layer), whose
outputs are that level's values; then a last chunked pass, the whole step with every batch-wide value as an
input, which makes the results and the gradients and writes what the step updates (running statistics)
once. Each pass is split and checked by the same batch analysis as any step: exact wherever it runs.

A pass before the last runs per-example work that the last runs again: where that work draws random numbers
(dropout: the draws are not replayed) or writes the step's inputs, the step is not run in passes.

Cost: a pass per level re-runs the per-example work its values depend on (for L BatchNorm layers, L passes
over forward prefixes and L forward-and-backward passes: O(L^2) forward work); memory: one chunk of one pass
at a time, and the batch-wide values (per-channel vectors).

This module knows the IR, the batch analysis and the chunked executor; the planner costs it with
:func:`plan_passes`, the executable runs it with :func:`run_passes`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from ..devices.budget import format_bytes
from ..errors import BatchCouplingError, OutOfMemoryError
from ..interpreters.batching import BatchAnalysis, Batched, analyze
from ..interpreters.chunked import Split, run_chunked
from ..interpreters.flops import graph_flops
from ..interpreters.memory import peak_bytes
from ..interpreters.undo import Undo
from ..ir import Graph, Literal, Var, op_name
from ..transforms.schedule import writes
from . import budget as margin
from .chunks import Plan, chunked_peak, plan_chunks
from .cut import draws_random, phase_graph, stand_in_for

__all__ = ["Passes", "PassesPlan", "find_passes", "plan_passes", "run_passes"]


@attrs.define(eq=False)
class Passes:
    """A step run as one chunked pass per level of its batch-wide values, then a last pass (``final``)."""

    graph: Graph
    batched: dict[Var, Batched]
    batch: int
    # Per level: its graph (inputs: the step's, then the lower levels' values) and the step's vars it makes.
    levels: list[tuple[Graph, list[Var]]]
    final: Graph  # inputs: the step's, then every level's values; outputs: the step's results
    finals: list[Var]  # the step's vars ``final`` outputs, parallel to its outvars

    @functools.cached_property
    def splits(self) -> list[Split]:
        """The chunked splits of the level passes, then of the last pass."""
        return [Split(analyze(g, self.batched, self.batch)) for g, _ in self.levels] + [
            Split(analyze(self.final, self.batched, self.batch))
        ]

    @property
    def carried(self) -> list[Var]:
        """The batch-wide values, every level's, in the order the passes make them."""
        return [v for _, made in self.levels for v in made]

    @property
    def carried_bytes(self) -> int:
        return sum(v.aval.nbytes for v in self.carried)

    def describe(self) -> str:
        return (
            f"The step's batch-wide values (BatchNorm's statistics) depend on each other in {len(self.levels)} "
            f"level(s): it runs in {len(self.levels) + 1} chunked passes, one per level, each re-running the "
            f"per-example work that level depends on, then the whole step with every batch-wide value known "
            f"({format_bytes(self.carried_bytes)} of them)."
        )


def _levels(analysis: BatchAnalysis) -> dict[Var, int]:
    """The level of each batch-wide value per-example work reads: the passes over the chunks that must run
    before it is known. A reduction over the examples is known one pass after the per-example values it
    reduces can be made; those need every batch-wide value they read known first; a value made from
    batch-wide values alone (a mean from a sum, a variance from two sums) is known when they are. A value
    read for its shape alone (``ones_like(loss)``: the analysis's placeholders) is not waited for."""
    labels = analysis.labels
    known: dict[Var, int] = {}  # per-example value: the passes before a chunk can make it; else: before it is known
    for i, e in enumerate(analysis.graph.eqns):
        shape_only = analysis.placeholders.get(i, {})
        before = max((known.get(v, 0) for v in e.invars if v not in shape_only), default=0)
        for v in writes(e):  # what reads the target afterwards reads what the write read
            known[v.root] = max(known.get(v.root, 0), before)
        reads_examples = any(isinstance(labels.get(v), Batched) for v in e.invars)
        for v in e.outvars:
            if v is not None:
                made_whole = reads_examples and not isinstance(labels.get(v), Batched)
                known[v] = before + 1 if made_whole else before
    return {v: known[v] for v in _carried(analysis)}


def _carried(analysis: BatchAnalysis) -> list[Var]:
    """The batch-wide values the passes hand on: those per-example work reads, each as the value it views
    (a gradient of a sum over the batch is a per-channel value expanded to the batch's shape: the pass
    that reads it expands it again)."""
    out = []
    for v in analysis.needs_global:
        while v.base is not None and not isinstance(analysis.labels.get(v.base), Batched):
            v = v.base
        out.append(v)
    return _unique(out)


def find_passes(graph: Graph, batched: dict[Var, Batched], batch: int) -> Passes | None:
    """The step as passes per level of its batch-wide values, or None when it has fewer than two levels (the
    chunked executor's own pre-pass runs one). Raises the batch analysis's error when a pass cannot be
    chunked exactly."""
    analysis = analyze(graph, batched, batch)
    level = _levels(analysis)
    if len(set(level.values())) < 2:
        return None
    roles = list(graph.roles) if graph.roles else ["arg"] * len(graph.invars)
    stand_ins: dict[Var, Var] = {}
    levels: list[tuple[Graph, list[Var]]] = []
    for k in sorted(set(level.values())):
        made = [v for v in level if level[v] == k]
        lower = dict(stand_ins)
        g, _ = phase_graph(graph, set(), lower, made, roles + ["arg"] * len(lower))
        _check_runs_again(g, {v.root for v in graph.invars})
        levels.append((g, made))
        stand_ins.update((v, stand_in_for(v)) for v in made)
    inputs = {v.root for v in graph.invars}
    updates = {i for i, e in enumerate(graph.eqns) if any(v.root in inputs for v in writes(e))}
    finals = _unique([v for v in graph.outvars if isinstance(v, Var)] + [v for _, v in graph.grads])
    final, _ = phase_graph(graph, updates, stand_ins, finals, roles + ["arg"] * len(stand_ins))
    passes = Passes(graph, batched, batch, levels, final, finals)
    passes.splits  # noqa: B018 (each pass analysed now: a pass that cannot be chunked raises here)
    return passes


def _check_runs_again(g: Graph, inputs: set[Var]) -> None:
    """Raise :class:`BatchCouplingError` where a pass before the last, which the last runs again, draws random
    numbers (the draws are not replayed) or writes the step's inputs (it would write them once per pass)."""
    for e in g.eqns:
        if draws_random(e):
            why, fix = "draws random numbers", "use no dropout in a step whose BatchNorm statistics need passes"
        elif any(v.root in inputs for v in writes(e)):
            why, fix = "writes an input of the step in place", "make the update outside the staged function"
        else:
            continue
        raise BatchCouplingError(
            f"{op_name(e.prim)} at {e.source} {why} in per-example work that the passes over the chunks run more "
            f"than once, so the step cannot run in passes.\nWhat to do: {fix}, or a budget that recomputation fits."
        )


def _unique(vs: list[Var]) -> list[Var]:
    return list(dict.fromkeys(vs))


@attrs.frozen
class PassesPlan(Plan):
    """A plan that runs the step in passes per level of its batch-wide values (:class:`Passes`), each pass
    in ``chunk_sizes`` chunks; ``extra_flops``: what the passes re-run beyond the step."""

    passes: Passes | None = None
    extra_flops: int = 0


def passes_floor(passes: Passes) -> int:
    """The fewest bytes the passes run in: one example per chunk (each pass holds the values of the levels
    before it: they are its inputs)."""
    return max(chunked_peak(split, 1, peak_bytes) for split in passes.splits)


def plan_passes(passes: Passes, budget: int, full_peak: int, cap: int | None = None) -> PassesPlan:
    """The passes' plan within ``budget`` bytes: every pass in the chunks of the pass that needs the
    smallest. Raises :class:`OutOfMemoryError` saying the smallest budget that runs when none fits."""
    graphs = [g for g, _ in passes.levels] + [passes.final]
    try:
        plans = [
            plan_chunks(g, lambda k=k: passes.splits[k], passes.batch, budget, peak_bytes, cap=cap)
            for k, g in enumerate(graphs)
        ]
    except OutOfMemoryError:
        floor = margin.smallest_budget(passes_floor(passes))
        error = OutOfMemoryError(
            f"no schedule fits a budget of {format_bytes(budget)}: {passes.describe()} One example per chunk needs "
            f"{format_bytes(floor)}."
        )
        error.smallest_budget = floor
        raise error from None
    sizes = min((p.chunk_sizes for p in plans), key=max)
    peaks = [chunked_peak(split, max(sizes), peak_bytes) for split in passes.splits]
    base = graph_flops(passes.graph.eqns)
    extra = max(sum(graph_flops(g.eqns) for g in graphs) - base, 0)  # (the passes run no dead code)
    reason = (
        f"{passes.describe()} Each pass runs in the chunks [{'+'.join(map(str, sizes))}]; the passes re-run "
        f"{extra / 1e6:.1f} MFLOP beyond the step's {base / 1e6:.1f}."
    )
    return PassesPlan(
        passes.batch, tuple(sizes), tuple(max(peaks) for _ in sizes), budget, full_peak, reason, max(peaks),
        passes=passes, extra_flops=extra,
    )


def run_passes(
    passes: Passes, inputs: Sequence[torch.Tensor], plan: PassesPlan, undo: Undo | None = None
) -> tuple[list, list[tuple[int, torch.Tensor]]]:
    """Run the step as ``plan`` says. **Returns** the flat outputs and the (input position, gradient) pairs."""
    graph = passes.graph
    if undo is not None:
        # The copies that restore what the last pass writes are taken before the first: the plan counts them
        # (``held_bytes``) through every pass.
        written = {v.root for e in passes.final.eqns for v in writes(e)}
        for v, x in zip(graph.invars, inputs):
            if v.root in written and isinstance(x, torch.Tensor):
                undo.save(x)
    env: dict[Var, Any] = dict(zip(graph.invars, inputs))
    carried: list[torch.Tensor] = []
    for split in passes.splits[:-1]:
        outs, _, _ = run_chunked(split, [*inputs, *carried], plan.chunk_sizes, undo=undo)
        carried += outs
    outs, _, _ = run_chunked(passes.splits[-1], [*inputs, *carried], plan.chunk_sizes, undo=undo)
    env.update(zip(passes.finals, outs))
    finals = [v.value if isinstance(v, Literal) else env[v] for v in graph.outvars]
    return finals, [(i, env[v]) for i, v in graph.grads]

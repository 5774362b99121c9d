"""Cutting a step where its examples meet: a contrastive loss over in-batch negatives, run in exact chunks.

The batch analysis refuses a step whose per-example values meet across examples (``img @ txt.T``): no chunk
can compute its share of that product alone. But where they meet only through small values (embeddings),
the step runs exactly in three phases, as GradCache does by hand for one loss at a time:

- ``before``: the per-example part up to the **cut values** (the per-example values the coupling reads), in
  chunks, keeping only the cut values for the whole batch (no activations);
- ``coupled``: the part where examples meet, and its backward down to the cut values' gradients, on the
  whole batch (small: it reads embeddings, not activations);
- ``after``: the per-example part again, in chunks: its forward recomputed, back-propagating the gradients
  the coupled part handed over (``reentry`` values) into the parameters' gradients.

The cut is found in the staged graph, not by recognising a loss: each equation falls in a phase by what it
reads. An equation whose batch rule refuses its per-example inputs is where examples meet (``where``); what
reads its results in the forward is coupled too, and so is a backward equation that reads what the coupled
forward read or made (its saved values: the backward of the coupled part). Another backward equation that
reads coupled values (gradients) is ``after`` when its batch rule accepts them as per-example (each has
exactly one dim of the batch's size), else coupled; whatever feeds the coupled part is coupled. Each phase is an ordinary Graph; ``before`` and ``after`` are run
by the chunked executor on their own batch analysis, so a phase that could not be chunked exactly is refused
by the same rules as any step. Exactness does not depend on the classification: the coupled part runs whole,
and the chunked parts only where their analysis proves them exact.

This module knows the IR, the batch analysis and the chunked executor; the planner costs a :class:`Cut` with
:func:`plan_cut`, the executable runs it with :func:`run_cut`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from ..devices.budget import format_bytes
from ..errors import BatchCouplingError, OutOfMemoryError, UnsupportedOpError
from ..interpreters.batching import Batched, LabelFn, analyze, rule_for
from ..interpreters.chunked import Split, even_chunks, run_chunked, slice_examples
from ..interpreters.eager import Program
from ..interpreters.flops import graph_flops
from ..interpreters.memory import peak_bytes
from ..interpreters.undo import Undo
from ..ir import Eqn, Graph, Literal, Var, op_name
from ..transforms.schedule import draws_random, writes
from ..utils.tree import map_leaves
from . import budget as margin
from .chunks import Plan, bytes_of, chunked_peak, plan_chunks

__all__ = ["Cut", "CutPlan", "find_cut", "plan_cut", "run_cut", "draws_random", "phase_graph", "stand_in_for"]

# The phase of an equation: what it reads decides it (see the module docstring).
SHARED, BEFORE, COUPLED, AFTER = "shared", "before", "coupled", "after"
_ORDER = {SHARED: 0, BEFORE: 1, COUPLED: 2, AFTER: 3}


@attrs.define(eq=False)
class Cut:
    """A step cut where its examples meet: three graphs over the step's inputs and what they hand on."""

    graph: Graph
    batched: dict[Var, Batched]
    batch: int
    before: Graph  # inputs: the step's; outputs: the cut values, then the step's results it makes
    coupled: Graph  # inputs: the step's and the cut values; outputs: the reentry values, then results
    after: Graph  # inputs: the step's and the reentry values; outputs: the step's results it makes
    after_batched: dict[Var, Batched]
    cut_values: list[Var]  # the step's vars the coupled part reads from the per-example part
    reentry: list[Var]  # the step's vars the after part reads from the coupled part
    where: list[Eqn]  # the equations where per-example values first meet
    recomputed: list[Eqn]  # the per-example forward equations the after part runs again
    # The step's vars each graph outputs, parallel to its outvars (a view of an input stands in for some).
    results: dict[str, list[Var]] = attrs.field(factory=dict)
    # The schedule that keeps one chunk's activations from the before part to the after part, or None.
    kept: Kept | None = None

    @functools.cached_property
    def before_split(self) -> Split:
        return Split(analyze(self.before, self.batched, self.batch))

    @functools.cached_property
    def after_split(self) -> Split:
        return Split(analyze(self.after, self.after_batched, self.batch))

    @functools.cached_property
    def coupled_program(self) -> Program:
        return Program(self.coupled)

    @property
    def cut_bytes(self) -> int:
        """Bytes of the cut values for the whole batch: what the coupled part reads of the per-example part."""
        return sum(v.aval.nbytes for v in self.cut_values)

    def describe(self) -> str:
        first = self.where[0]
        more = f" (and {len(self.where) - 1} more)" if len(self.where) > 1 else ""
        values = ", ".join(str(v.aval) for v in self.cut_values)
        return (
            f"Examples meet at {op_name(first.prim)} at {first.source}{more}: the step is cut at {len(self.cut_values)} "
            f"per-example value(s) [{values}], {format_bytes(self.cut_bytes)} for the whole batch."
        )


@attrs.define(eq=False)
class Kept:
    """One chunk's activations kept across the coupled part, as GradCache implementations keep the last
    chunk's autograd graph: that chunk's forward runs once, not twice.

    ``before`` is the before part with the **saved values** (the per-example forward values the after part's
    backward reads) among its outputs; ``after`` is the after part reading them as inputs, its forward not
    run again. Both run on the last examples of the batch only; the other examples run as the cut runs them.
    """

    batch: int
    before: Graph  # outputs: the before part's, then the saved values
    before_batched: dict[Var, Batched]
    after: Graph  # inputs: the after part's, then the saved values' stand-ins
    after_batched: dict[Var, Batched]
    saved: list[Var]

    @functools.cached_property
    def before_split(self) -> Split:
        return Split(analyze(self.before, self.before_batched, self.batch))

    @functools.cached_property
    def after_split(self) -> Split:
        return Split(analyze(self.after, self.after_batched, self.batch))

    def saved_bytes(self, n: int) -> int:
        """Bytes of the saved values for ``n`` examples (each storage once; per-example, so linear in ``n``)."""
        return -(-bytes_of(self.saved) * n // self.batch)


def _needs_rows(v: Var, batch: int) -> int | None | bool:
    """The dim of ``v`` that can carry the batch when a coupled value is read per example: the only dim of the
    batch's size; ``None`` when it has none (a scalar: the same in every chunk); ``False`` when several do."""
    dims = [d for d, s in enumerate(v.aval.shape) if s == batch]
    if len(dims) > 1:
        return False
    return dims[0] if dims else None


def _try_rule(e: Eqn, labels: dict[Var, Any], batch: int, makers: dict[Var, Eqn]) -> tuple | None:
    """The output labels of ``e`` by its batch rule, or None when the rule refuses (examples meet there)."""
    rule = rule_for(e.prim)
    if rule is None:
        return None
    try:
        return rule(e, LabelFn(labels, batch, makers)).out
    except (BatchCouplingError, UnsupportedOpError):
        return None


def _classify(graph: Graph, batched: dict[Var, Batched], batch: int) -> tuple[list[str], list[int], dict[Var, Batched]]:
    """The phase of every equation, the equations where examples meet, and the label of each coupled value the
    after part reads per example."""
    eqns = graph.eqns
    makers = {v: e for e in eqns for v in e.outvars if v is not None}
    made_in: dict[Var, str] = {}  # var -> phase of the equation that made it
    written: dict[Var, str] = {}  # root -> latest phase that wrote it in place
    labels: dict[Var, Any] = dict(batched)  # Batched labels of per-example values, for the rules
    rows: dict[Var, Batched] = {}  # coupled values the after part reads per example
    phases: list[str] = []
    where: list[int] = []
    boundary = next((i for i, e in enumerate(eqns) if e.source.backward), len(eqns))

    def phase_of(v: Var) -> str:
        p = made_in.get(v, BEFORE if v in batched else SHARED)
        w = written.get(v.root)
        return p if w is None or _ORDER[w] <= _ORDER[p] else w

    saved: set[Var] = set()  # what the coupled forward reads and makes: what its backward reads

    for i, e in enumerate(eqns):
        reads = {phase_of(v) for v in e.invars}
        if i >= boundary and any(v in saved for v in e.invars):
            phase = COUPLED  # the backward of the coupled part
        elif AFTER in reads:
            phase = AFTER
        elif COUPLED in reads:
            phase = COUPLED if i < boundary else _per_example_again(e, labels, rows, made_in, batch, makers)
        elif BEFORE in reads:
            if any(isinstance(labels.get(v), Batched) for v in e.invars):
                out = _try_rule(e, labels, batch, makers)
                if out is None:
                    phase = COUPLED
                    where.append(i)
                else:
                    phase = BEFORE
                    labels.update((v, lab) for v, lab in zip(e.outvars, out) if v is not None and isinstance(lab, Batched))
            else:
                phase = BEFORE  # reads only values reduced over the batch (a loss term): the before part sums them
        else:
            phase = SHARED
        phases.append(phase)
        if phase == COUPLED and i < boundary:
            saved.update(v for v in e.invars if phase_of(v) == BEFORE)
            saved.update(v for v in e.outvars if v is not None)
        elif phase == COUPLED:
            saved.update(v for v in e.outvars if v is not None and v.base in saved)  # a view of one (``mat2.t()``)
        for v in e.outvars:
            if v is not None:
                made_in[v] = phase
        for v in writes(e):
            written[v.root] = max(written.get(v.root, SHARED), phase, key=_ORDER.__getitem__)
    # Nothing the coupled part reads may come from the after part (which runs last): what feeds it is coupled.
    producer = {v: i for i, e in enumerate(eqns) for v in e.outvars if v is not None}
    for i in reversed(range(len(eqns))):
        if phases[i] == COUPLED:
            for v in eqns[i].invars:
                j = producer.get(v)
                if j is not None and phases[j] == AFTER:
                    phases[j] = COUPLED
    return phases, where, rows


def _per_example_again(
    e: Eqn, labels: dict[Var, Any], rows: dict[Var, Batched], made_in: dict[Var, str], batch: int, makers: dict
) -> str:
    """A backward equation that reads coupled values: ``after`` when its batch rule takes them per example
    (each read along its one dim of the batch's size, as the after part will cut it) and it makes or reads a
    per-example value besides, else ``coupled``."""
    trial = dict(labels)
    for v in e.invars:
        if made_in.get(v) != COUPLED:
            continue
        dim = rows[v].dim if v in rows else _needs_rows(v, batch)
        if dim is False:
            return COUPLED
        if dim is not None:
            trial[v] = Batched(dim)
    if not any(isinstance(trial.get(v), Batched) for v in e.invars):
        return COUPLED
    out = _try_rule(e, trial, batch, makers)
    if out is None:
        return COUPLED
    if not any(isinstance(lab, Batched) for lab in out) and not any(isinstance(labels.get(v), Batched) for v in e.invars):
        return COUPLED  # a reduction of coupled values alone (the temperature's gradient): nothing to chunk
    rows.update((v, trial[v]) for v in e.invars if made_in.get(v) == COUPLED and isinstance(trial.get(v), Batched))
    return AFTER


def _refuse(e: Eqn, why: str, fix: str) -> BatchCouplingError:
    return BatchCouplingError(
        f"{op_name(e.prim)} at {e.source} {why}, so the step cannot be cut where its examples meet.\nWhat to do: {fix}."
    )


def phase_graph(
    graph: Graph, take: set[int], carried: dict[Var, Var], outs: list[Var], roles: list[str]
) -> tuple[Graph, list[int]]:
    """The equations ``take`` and the ancestors they need (not ``carried``: those are inputs), as a Graph over
    the step's inputs and the ``carried`` vars' stand-ins, with ``outs``. **Returns** it and every equation
    index it runs."""
    eqns = graph.eqns
    producer = {v: i for i, e in enumerate(eqns) for v in e.outvars if v is not None}
    writers: dict[Var, list[int]] = {}
    for i, e in enumerate(eqns):
        for v in writes(e):
            writers.setdefault(v.root, []).append(i)
    taken = set(take)
    stack = [(i, v) for i in take for v in eqns[i].invars] + [(len(eqns), v) for v in outs]
    while stack:
        reader, v = stack.pop()
        if v in carried:
            continue
        needed = [producer[v]] if v in producer else []
        needed += [w for w in writers.get(v.root, ()) if w < reader]  # an in-place write before the read
        for j in needed:
            if j not in taken:
                taken.add(j)
                stack.extend((j, x) for x in eqns[j].invars)
    order = sorted(taken)
    sub: dict[Var, Var] = dict(carried)
    new_eqns = []
    for i in order:
        e = eqns[i]
        outvars = []
        for v in e.outvars:
            if v is not None and v.base is not None and v.base in sub:  # a view of a value now an input
                sub[v] = Var(v.aval, sub[v.base], v.storage_nbytes, v.strides)
            outvars.append(None if v is None else sub.get(v, v))
        args, kwargs = map_leaves((e.args, e.kwargs), Var, lambda v: sub.get(v, v))
        new_eqns.append(attrs.evolve(e, args=args, kwargs=kwargs, outvars=tuple(outvars)))
    invars = list(graph.invars) + list(carried.values())
    return Graph(invars, new_eqns, [sub.get(v, v) for v in outs], roles=roles), order


def stand_in_for(v: Var) -> Var:
    """A phase's input for a value an earlier phase made: the whole batch's tensor, contiguous (the chunked
    executor concatenates the chunks' rows into a new tensor)."""
    return Var(v.aval)


def find_cut(graph: Graph, batched: dict[Var, Batched], batch: int) -> Cut | None:
    """The cut of a step whose examples meet, or None when nothing in it couples the examples or they meet
    inside the model: the coupled part would read a weight (more than a scalar parameter, such as a learned
    temperature), so cutting would run layers of the model on the whole batch. Raises
    :class:`BatchCouplingError` naming what keeps a coupled step from being cut."""
    phases, where, rows = _classify(graph, batched, batch)
    if not where:
        return None
    eqns = graph.eqns
    inputs = {v.root for v in graph.invars}
    for e in eqns:
        hit = next((v for v in writes(e) if v.root in inputs), None)
        if hit is not None:
            raise _refuse(e, "updates an input of the step in place (an optimizer step or BatchNorm's running "
                          "statistics inside the staged function)", "step the optimizer after the staged call, and use "
                          "no BatchNorm in training mode in a step whose examples meet")
    idx = {p: {i for i, q in enumerate(phases) if q == p} for p in (BEFORE, COUPLED, AFTER)}
    weights = {v for v, role in zip(graph.invars, graph.roles) if role in ("param", "buffer") and v.aval.numel > 1}
    if any(v.root in weights for i in idx[COUPLED] for v in eqns[i].invars):
        return None  # examples meet inside the model (an MoE router's sort), not in a loss over small values
    producer = {v: i for i, e in enumerate(eqns) for v in e.outvars if v is not None}
    finals = [v for v in graph.outvars if isinstance(v, Var)] + [v for _, v in graph.grads]

    def made_by(v: Var, phase: str) -> bool:
        return v in producer and phases[producer[v]] == phase

    cut_values = _unique(v for i in sorted(idx[COUPLED]) for v in eqns[i].invars if made_by(v, BEFORE))
    reentry = _unique(v for i in sorted(idx[AFTER]) for v in eqns[i].invars if made_by(v, COUPLED))
    roles = list(graph.roles) if graph.roles else ["arg"] * len(graph.invars)
    before_outs = cut_values + _unique(v for v in finals if made_by(v, BEFORE) and v not in cut_values)
    coupled_outs = reentry + _unique(
        v for v in finals if (made_by(v, COUPLED) or made_by(v, SHARED)) and v not in reentry
    )
    after_outs = _unique(v for v in finals if made_by(v, AFTER))
    before, _ = phase_graph(graph, set(), {}, before_outs, roles)
    kept = {v: stand_in_for(v) for v in cut_values}
    coupled, ran_coupled = phase_graph(graph, idx[COUPLED], kept, coupled_outs, roles + ["arg"] * len(kept))
    handed = {v: stand_in_for(v) for v in reentry}
    after, ran = phase_graph(graph, idx[AFTER], handed, after_outs, roles + ["arg"] * len(handed))
    for i in [*(i for i in ran_coupled if phases[i] in (BEFORE, AFTER)), *(i for i in ran if phases[i] == COUPLED)]:
        raise _refuse(eqns[i], "is needed by two parts of the step that run apart (through an in-place write)",
                      "write out of place here")
    recomputed = [eqns[i] for i in ran if phases[i] == BEFORE]
    for e in recomputed:
        if draws_random(e):
            raise _refuse(e, "draws random numbers in the per-example part, which the cut runs twice", "use no dropout "
                          "in the towers of a step whose examples meet (a later version replays the draws)")
    after_batched = dict(batched)
    for v, stand_in in handed.items():
        lab = rows.get(v)
        if lab is None and _needs_rows(v, batch) not in (None, False):
            lab = Batched(_needs_rows(v, batch))
        if lab is not None:
            after_batched[stand_in] = lab
    cut = Cut(graph, batched, batch, before, coupled, after, after_batched, cut_values, reentry,
              [eqns[i] for i in where], recomputed,
              {BEFORE: before_outs, COUPLED: coupled_outs, AFTER: after_outs})
    for part, name in ((lambda: cut.before_split, "the per-example part before the cut"),
                       (lambda: cut.after_split, "the per-example part after the cut")):
        try:
            part()
        except (BatchCouplingError, UnsupportedOpError) as e:
            raise type(e)(f"{e}\n(Found while cutting the step where its examples meet, in {name}.)") from None
    cut.kept = _keep(cut, phases, idx[AFTER], ran, handed, roles)
    return cut


def _keep(cut: Cut, phases: list[str], after_idx: set[int], ran: list[int], handed: dict[Var, Var], roles: list[str]) -> Kept | None:
    """The schedule that keeps one chunk's activations across the coupled part (:class:`Kept`), or None where
    the parts cannot run on two ranges of examples and merge exactly as chunks do: a pre-pass (a batch-wide
    value that per-example work reads), a post phase that writes in place (it runs once per range), a result
    concatenated under an outer dim, or a saved value that is not per-example."""
    eqns = cut.graph.eqns
    made_before = {v for i, e in enumerate(eqns) if phases[i] == BEFORE for v in e.outvars if v is not None}
    saved = _unique(v for i in ran if phases[i] != BEFORE for v in eqns[i].invars if v in made_before)
    if not saved:
        return None
    before_outs = cut.results[BEFORE]
    before, _ = phase_graph(cut.graph, set(), {}, before_outs + [v for v in saved if v not in before_outs], roles)
    stand_ins = {v: stand_in_for(v) for v in saved}
    after, ran_kept = phase_graph(cut.graph, after_idx, {**handed, **stand_ins}, cut.results[AFTER],
                                   roles + ["arg"] * (len(handed) + len(stand_ins)))
    if any(phases[i] == BEFORE for i in ran_kept):
        return None  # the after part would still recompute some of the forward
    kept = Kept(cut.batch, before, cut.batched, after, dict(cut.after_batched), saved)
    try:
        labels = kept.before_split.analysis.labels
        if not all(isinstance(labels.get(v), Batched) for v in saved):
            return None
        kept.after_batched.update((stand_ins[v], labels[v]) for v in saved)
        pairs = ((cut.before_split, kept.before_split), (cut.after_split, kept.after_split))
    except (BatchCouplingError, UnsupportedOpError):
        return None
    for split in (s for pair in pairs for s in pair):
        outer = any(getattr(split.analysis.labels.get(v), "outer", 1) != 1 for v in split.body_results)
        if split.globals or split.reduced_for_globals or outer or any(writes(e) for e in split.post.eqns):
            return None
    if not set(cut.before_split.body_results) <= set(kept.before_split.body_results):
        return None
    return kept if set(cut.after_split.body_results) == set(kept.after_split.body_results) else None


def _unique(vs: Any) -> list[Var]:
    out: list[Var] = []
    for v in vs:
        if v not in out:
            out.append(v)
    return out


# ---------------------------------------------------------------------------------------------------------
# Costing and running a cut.


@attrs.frozen
class CutPlan(Plan):
    """A plan that cuts the step where its examples meet: ``before_sizes`` chunks up to the cut values, the
    coupled part on the whole batch (peak ``coupled_peak_bytes``), then ``chunk_sizes`` chunks again
    (recomputing the per-example forward: ``extra_flops``)."""

    cut: Cut | None = None
    before_sizes: tuple[int, ...] = ()
    coupled_peak_bytes: int = 0
    extra_flops: int = 0
    # Examples of the last chunk whose activations are kept across the coupled part (:class:`Kept`): the last
    # of ``before_sizes`` and the first of ``chunk_sizes``; 0 when every chunk's forward is recomputed.
    kept_size: int = 0


def _results_bytes(cut: Cut) -> tuple[int, int]:
    """Bytes of the step's results the before and coupled parts make, held until the step ends."""
    made_before = sum(v.aval.nbytes for v in cut.before.outvars[len(cut.cut_values):] if isinstance(v, Var))
    made_coupled = sum(v.aval.nbytes for v in cut.coupled.outvars[len(cut.reentry):] if isinstance(v, Var))
    return made_before, made_coupled


def cut_floor(cut: Cut) -> int:
    """The fewest bytes the cut runs in: one example per chunk in both per-example parts."""
    made_before, made_coupled = _results_bytes(cut)
    return max(
        chunked_peak(cut.before_split, 1, peak_bytes),
        peak_bytes(cut.coupled) + made_before,
        chunked_peak(cut.after_split, 1, peak_bytes) + made_before + made_coupled,
    )


def plan_cut(cut: Cut, budget: int, full_peak: int, cap: int | None = None, smallest: int | None = None) -> CutPlan:
    """The cut's plan within ``budget`` bytes: chunk sizes for both per-example parts. ``smallest``: the
    smallest budget another schedule (recomputation alone) fits in, which an error names when less than the
    cut's. Raises :class:`OutOfMemoryError` saying the smallest budget that runs when none fits."""
    usable = margin.usable(budget)
    made_before, made_coupled = _results_bytes(cut)
    coupled_peak = peak_bytes(cut.coupled) + made_before
    try:
        if coupled_peak > usable:
            raise OutOfMemoryError("the coupled part does not fit")
        before = plan_chunks(cut.before, lambda: cut.before_split, cut.batch, budget, peak_bytes, cap=cap)
        held = margin.covering(made_before + made_coupled)
        after = plan_chunks(cut.after, lambda: cut.after_split, cut.batch, max(budget - held, 0), peak_bytes, cap=cap)
    except OutOfMemoryError:
        floor = margin.smallest_budget(cut_floor(cut))
        best = floor if smallest is None else min(floor, smallest)
        how = "cut where the examples meet, one example per chunk" if best == floor else "recomputing, unchunked"
        error = OutOfMemoryError(
            f"no schedule fits a budget of {format_bytes(budget)}: {cut.describe()} Cut there, the coupled part needs "
            f"{format_bytes(coupled_peak)} on the whole batch, and one example per chunk needs {format_bytes(floor)} in all. "
            f"The smallest budget that runs this step is {format_bytes(best)} ({how}). What to do: raise memory_budget "
            "to at least that, or use a smaller batch."
        )
        error.smallest_budget = best
        raise error from None
    extra = graph_flops(cut.recomputed)
    after_peaks = tuple(p + made_before + made_coupled for p in after.peak_bytes)
    phase_peak = max(before.peak, coupled_peak, after.phase_peak_bytes + made_before + made_coupled)
    kept = _kept_chunk(cut, before, after, usable, coupled_peak, made_before + made_coupled)
    before_sizes, after_sizes, kept_note = before.chunk_sizes, after.chunk_sizes, ""
    if kept is not None:
        n, kept_peak, rest_peak = kept
        rest = cut.batch - n
        before_sizes = (*even_chunks(rest, max(before.chunk_sizes)), n)
        after_sizes = (n, *even_chunks(rest, max(after.chunk_sizes)))
        after_peaks = (kept_peak, *(rest_peak for _ in after_sizes[1:]))
        phase_peak = max(phase_peak, kept_peak)
        extra = extra * rest // cut.batch
        kept_note = (f" The last {n} examples keep their activations across the coupled part "
                     f"({format_bytes(cut.kept.saved_bytes(n))}): their forward runs once.")
    sizes = "+".join(map(str, before_sizes))
    reason = (
        f"{cut.describe()} The per-example part runs in chunks [{sizes}] up to them, the coupled part on the "
        f"whole batch (peak {format_bytes(coupled_peak)}), then the per-example part again in chunks, its forward "
        f"recomputed ({extra / 1e6:.1f} MFLOP more).{kept_note}"
    )
    return CutPlan(
        cut.batch, after_sizes, after_peaks, budget, full_peak, reason, phase_peak,
        cut=cut, before_sizes=before_sizes, coupled_peak_bytes=coupled_peak, extra_flops=extra,
        kept_size=0 if kept is None else kept[0],
    )


def _kept_chunk(cut: Cut, before: Plan, after: Plan, usable: int, coupled_peak: int, held: int) -> tuple[int, int, int] | None:
    """The largest last chunk whose activations fit beside every part they are held across, no larger than
    the after part's chunks: (its size, the peak while its activations are held, the peak of the other chunks
    after it). None when no chunk of one example or more fits, or the cut has no such schedule.

    Bounds, not costed graphs: the kept before chunk holds what a before chunk does plus the saved values;
    the kept after chunk holds what an after chunk does (it only skips the forward) plus them; the other
    after chunks run beside the kept chunk's partials (its gradient accumulators)."""
    kept = cut.kept
    largest = min(max(after.chunk_sizes), cut.batch - 1)
    if kept is None or largest < 1:
        return None
    rest_peak = max(after.peak_bytes) + held + cut.after_split.body(max(after.chunk_sizes)).held_bytes[1]
    if rest_peak > usable:
        return None
    n = largest
    while n >= 1:
        saved = kept.saved_bytes(n)
        kept_peak = chunked_peak(cut.after_split, n, peak_bytes) + held + saved
        held_across = max(chunked_peak(cut.before_split, n, peak_bytes), coupled_peak) + saved
        if max(kept_peak, held_across) <= usable:
            return n, max(kept_peak, held_across), rest_peak
        n //= 2
    return None


def run_cut(
    cut: Cut, inputs: Sequence[torch.Tensor], plan: CutPlan, undo: Undo | None = None
) -> tuple[list, list[tuple[int, torch.Tensor]]]:
    """Run the step as ``plan`` cuts it. **Returns** the flat outputs and the (input position, gradient) pairs."""
    if plan.kept_size:
        return _run_kept(cut, inputs, plan, undo)
    graph = cut.graph
    env: dict[Var, Any] = dict(zip(graph.invars, inputs))
    made, _, _ = run_chunked(cut.before_split, inputs, plan.before_sizes, undo=undo)
    env.update(zip(cut.results[BEFORE], made))
    kept = [env[v] for v in cut.cut_values]
    program = cut.coupled_program
    made = program.outputs(program.run_env([*inputs, *kept], undo))
    del kept
    env.update(zip(cut.results[COUPLED], made))
    handed = [env[v] for v in cut.reentry]
    made, _, _ = run_chunked(cut.after_split, [*inputs, *handed], plan.chunk_sizes, undo=undo)
    env.update(zip(cut.results[AFTER], made))
    finals = [v.value if isinstance(v, Literal) else env[v] for v in graph.outvars]
    return finals, [(i, env[v]) for i, v in graph.grads]


def _run_kept(
    cut: Cut, inputs: Sequence[torch.Tensor], plan: CutPlan, undo: Undo | None
) -> tuple[list, list[tuple[int, torch.Tensor]]]:
    """:func:`run_cut` keeping the last chunk's activations (:class:`Kept`): each part runs on two ranges of
    examples, the partials of the one run first merged into the other's before its post phase, as chunks'."""
    kept, n = cut.kept, plan.kept_size
    assert kept is not None
    rest = cut.batch - n
    graph = cut.graph
    env: dict[Var, Any] = dict(zip(graph.invars, inputs))
    first: dict[Var, Any] = {}
    run_chunked(cut.before_split, inputs, plan.before_sizes[:-1], combine=_capture(first), undo=undo)
    made, _, _ = run_chunked(kept.before_split, _last(kept.before_split, inputs, n), [n], offset=rest,
                             combine=_merge(kept.before_split, first, earlier=True), undo=undo)
    del first
    by_var = dict(zip(kept.before.outvars, made))
    env.update(zip(cut.results[BEFORE], made))
    saved = [by_var[v] for v in kept.saved]
    del made, by_var
    program = cut.coupled_program
    made = program.outputs(program.run_env([*inputs, *(env[v] for v in cut.cut_values)], undo))
    env.update(zip(cut.results[COUPLED], made))
    handed = [env[v] for v in cut.reentry]
    last: dict[Var, Any] = {}
    run_chunked(kept.after_split, [*_last(kept.after_split, [*inputs, *handed], n), *saved], [n], offset=rest,
                combine=_capture(last), undo=undo)
    del saved
    made, _, _ = run_chunked(cut.after_split, [*inputs, *handed], plan.chunk_sizes[1:],
                             combine=_merge(cut.after_split, last, earlier=False), undo=undo)
    env.update(zip(cut.results[AFTER], made))
    finals = [v.value if isinstance(v, Literal) else env[v] for v in graph.outvars]
    return finals, [(i, env[v]) for i, v in graph.grads]


def _last(split: Split, values: Sequence[torch.Tensor], n: int) -> list[torch.Tensor]:
    """``values`` (parallel to the split graph's first inputs) with the per-example ones cut to the batch's
    last ``n`` examples: a range's inputs, as :func:`~stagetorch.interpreters.chunked.run_chunked` takes them with ``offset``."""
    labels, spanning, batch = split.analysis.labels, split.analysis.spanning, split.analysis.batch
    return [
        slice_examples(x, lab, batch - n, n) if isinstance(lab := labels.get(v), Batched) and v not in spanning else x
        for v, x in zip(split.graph.invars, values)
    ]


def _capture(into: dict[Var, Any]) -> Callable[[dict[Var, Any], dict[Var, str]], None]:
    """A ``combine`` for :func:`~stagetorch.interpreters.chunked.run_chunked` that keeps the range's partials."""
    return lambda held, kinds: into.update(held)


def _merge(split: Split, other: dict[Var, Any], earlier: bool) -> Callable[[dict[Var, Any], dict[Var, str]], None]:
    """A ``combine`` that merges ``other``'s partials (another range's; ``earlier``: its examples come first)
    into this range's, in place, as the chunk loop folds a chunk's."""

    def combine(held: dict[Var, Any], kinds: dict[Var, str]) -> None:
        for v, kind in kinds.items():
            x = other.get(v)
            if x is None or kind == "same":
                continue
            if kind == "cat":
                held[v] = torch.cat((x, held[v]) if earlier else (held[v], x), split.analysis.labels[v].dim)
            elif kind == "sum":
                held[v].add_(x)
            else:
                (torch.maximum if kind == "max" else torch.minimum)(held[v], x, out=held[v])

    return combine

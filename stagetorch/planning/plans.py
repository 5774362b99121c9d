"""The kinds of plan, told apart in one place.

A :class:`~stagetorch.planning.chunks.Plan` runs the staged program whole or in chunks; a
:class:`~stagetorch.planning.remat_search.RematPlan` runs a recomputing graph so; a
:class:`~stagetorch.planning.cut.CutPlan` runs three programs, cut where the examples meet; a
:class:`~stagetorch.planning.multipass.PassesPlan` runs the step in passes over its chunks. The front ends
(:class:`~stagetorch.runtime.executable.Executable`, :func:`stagetorch.memory`, the data-parallel and lazy
shards) and the planner ask here what a plan recomputes, whether it runs programs of its own (and run them),
what graphs its phases run, and how to say it: no other module checks which kind a plan is.

It knows the plan kinds and how a cut or passes run; it must not know executables, budgets or the planner's
state (a plan of the staged program itself runs through its executable, which owns its split and program).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..interpreters.undo import Undo
from ..ir import Eqn, Graph
from .chunks import Plan
from .cut import CutPlan, run_cut
from .multipass import PassesPlan, run_passes
from .remat_search import RematPlan
from .remat_simulator import Recompute

__all__ = ["recompute_of", "recompute_graph", "recomputes", "runs_apart", "run_apart", "phase_graphs",
           "recomputed_names", "schedule_of", "flops"]


def recompute_of(plan: Plan) -> Recompute | None:
    """What ``plan`` recomputes, or None (a plan without recomputation, or a recomputing one that keeps all)."""
    return plan.recompute if isinstance(plan, RematPlan) else None


def recompute_graph(plan: Plan) -> Graph | None:
    """The recomputing graph ``plan`` runs in its chunks, or None where it runs the staged program's own."""
    if isinstance(plan, RematPlan) and plan.recompute is not None:
        return plan.recompute.graph
    return None


def recomputes(plan: Plan) -> bool:
    """Whether ``plan`` runs a recompute set (as a log line says it: "recomputing")."""
    return isinstance(plan, RematPlan) and plan.recompute is not None


def runs_apart(plan: Plan) -> bool:
    """Whether ``plan`` runs programs of its own (:func:`run_apart`) rather than the staged program's, whole
    or in chunks: a step cut where its examples meet, or BatchNorm's statistics summed in passes."""
    return isinstance(plan, (CutPlan, PassesPlan))


def run_apart(plan: Plan, inputs: list, undo: Undo) -> tuple[list, list]:
    """Run a plan that :func:`runs_apart` on real ``inputs`` (the caller restores ``undo`` if it fails):
    the cut's three programs (:func:`~stagetorch.planning.cut.run_cut`), or the passes
    (:func:`~stagetorch.planning.multipass.run_passes`)."""
    if isinstance(plan, CutPlan):
        return run_cut(plan.cut, inputs, plan, undo)
    assert isinstance(plan, PassesPlan)
    return run_passes(plan.passes, inputs, plan, undo)


def phase_graphs(plan: Plan) -> Sequence[Graph] | None:
    """The graphs a plan that :func:`runs_apart` runs one after another, each as one chunk of it runs (the
    memory report's live bytes); None for a plan of the staged program."""
    if isinstance(plan, CutPlan):  # cut where the examples meet: the three programs one after another
        cut = plan.cut
        return [cut.before_split.body(max(plan.before_sizes)).first, cut.coupled,
                cut.after_split.body(max(plan.chunk_sizes)).first]
    if isinstance(plan, PassesPlan):  # (bnorm) BatchNorm's statistics summed over the chunks: pass after pass
        sizes = max(plan.chunk_sizes)
        return [split.body(sizes).first for split in plan.passes.splits]
    return None


def recomputed_names(plan: Plan) -> tuple[Eqn, ...]:
    """What a plan that :func:`runs_apart` recomputes: the equations the cut runs again (passes: none)."""
    return tuple(plan.cut.recomputed) if isinstance(plan, CutPlan) else ()


def schedule_of(plan: Plan) -> str:
    """How ``plan`` runs the step, as an error names it: in passes, recomputing, chunked, or the whole batch."""
    if isinstance(plan, CutPlan):
        return (f"cut where its examples meet ({len(plan.before_sizes)} chunk(s) up to the cut, the coupled part "
                f"whole, then {len(plan.chunk_sizes)} chunk(s))")
    if isinstance(plan, PassesPlan):
        return f"in {len(plan.passes.splits)} passes over chunks of {max(plan.chunk_sizes)} example(s)"
    recompute = getattr(plan, "recompute", None)
    chunks = f"in {len(plan.chunk_sizes)} chunks" if plan.chunked else "the whole batch at once"
    if recompute is None:
        return chunks
    return f"with recomputation ({recompute.dropped} op(s) recomputed in the backward, {chunks})"


def flops(plan: Plan, base: int) -> tuple[int, int]:
    """What ``plan`` costs in FLOPs: (what it runs beyond the step: its recomputation, or what a cut or the passes
    run again; the step's own), ``base`` for the step's own where the plan does not say it."""
    if isinstance(plan, RematPlan):
        return plan.extra_flops, plan.base_flops
    if isinstance(plan, (CutPlan, PassesPlan)):
        return plan.extra_flops, base
    return 0, base

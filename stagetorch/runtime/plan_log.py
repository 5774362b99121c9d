"""A step's plan in the ``stagetorch`` log: one short line at INFO the first time a step plans (its chunks, its
predicted peak against its budget, how it runs), and again only when the plan changes, saying why (another batch
size, another budget, the step staged again); the whole plan, with what it recomputes op by op, at DEBUG.

A line logged while a tqdm progress bar is on the terminal is written through ``tqdm.write`` (:func:`emit`), so
that it lands on a line of its own above the bar, not inside it. Nothing here adds a handler to any logger.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from ..devices.budget import format_bytes
from ..planning import plans
from ..planning.chunks import Plan

__all__ = ["PlanLog", "emit", "summary"]

log = logging.getLogger("stagetorch")


def _bars_on_screen() -> bool:
    """A tqdm bar is open (only where tqdm was imported: nothing is imported here)."""
    std = sys.modules.get("tqdm.std")
    bars = getattr(getattr(std, "tqdm", None), "_instances", ())
    return any(not getattr(bar, "disable", False) for bar in list(bars))


def _terminals() -> tuple:
    return sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__


def emit(level: int, msg: str, *args: Any) -> None:
    """Log ``msg % args`` on the ``stagetorch`` logger at ``level``, as ``log.log`` would. While a tqdm bar is
    open, a handler that writes to the terminal (a ``StreamHandler`` on ``sys.stdout`` or ``sys.stderr``) gets
    the formatted line through ``tqdm.write``, which clears the bars, writes it and draws them again; every
    other handler (a file, pytest's caplog) gets the record as usual. Levels, filters and formatters are the
    handlers' own, and no handler is added or swapped."""
    if not log.isEnabledFor(level):
        return
    if not _bars_on_screen():
        log.log(level, msg, *args)
        return
    from tqdm import tqdm

    fn, lno, func, _ = log.findCaller()
    record = log.makeRecord(log.name, level, fn, lno, msg, args, None, func)
    if log.disabled or not log.filter(record):
        return
    found = False
    logger: logging.Logger | None = log
    while logger is not None:
        for handler in logger.handlers:
            found = True
            if record.levelno < handler.level:
                continue
            stream = getattr(handler, "stream", None)
            if isinstance(handler, logging.StreamHandler) and stream is not None and stream in _terminals():
                if handler.filter(record):
                    tqdm.write(handler.format(record), file=stream)
            else:
                handler.handle(record)
        logger = logger.parent if logger.propagate else None
    last = logging.lastResort
    if not found and last is not None and record.levelno >= last.level:
        tqdm.write(last.format(record), file=sys.stderr)


def _how(plan: Plan) -> str:
    """How ``plan`` runs the step, in a few words: whole or in chunks, what it recomputes, cut or in passes."""
    if plans.runs_apart(plan):
        return f"{plans.schedule_of(plan)} [{'+'.join(map(str, plan.chunk_sizes))}]"
    how = f"in {len(plan.chunk_sizes)} chunks [{'+'.join(map(str, plan.chunk_sizes))}]" if plan.chunked else "whole"
    recompute = plans.recompute_of(plan)
    return how if recompute is None else f"{how}, recomputing {recompute.dropped} op(s)"


def summary(plan: Plan) -> str:
    """The plan in one short line: the batch, how it runs (chunks, recomputation, cut or passes), the predicted
    peak against the budget, and, where it runs otherwise, the whole batch's peak as :func:`stagetorch.memory`
    reports it (nothing recomputed, with what the call holds beside the program)."""
    line = (f"batch {plan.batch} {_how(plan)}: predicted peak {format_bytes(plan.peak)} of a "
            f"{format_bytes(plan.budget_bytes)} budget")
    if plan.chunked or plans.recomputes(plan) or plans.runs_apart(plan):
        line += f" (whole batch at once: {format_bytes(plan.whole_batch_bytes)}, as stagetorch.memory says)"
    return line


def _shape(plan: Plan) -> tuple:
    """What a plan's line says: a plan of the same shape under another budget or peak is not logged again."""
    return plan.batch, plan.chunk_sizes, _how(plan)


class PlanLog:
    """The plan lines of one step (a ``jit`` function, all its programs; a ``lazy`` program): :meth:`say`
    logs a plan at INFO when it is the first or its shape changed, and at DEBUG otherwise."""

    def __init__(self) -> None:
        self._last: Plan | None = None  # the last plan said
        self._said: Plan | None = None  # the last plan said at INFO
        # Why the next plan may differ ("the step was staged again"), said with it if it does.
        self.why: str | None = None

    def say(self, name: str, plan: Plan) -> None:
        """Log ``plan``, the plan a call of ``name`` runs."""
        if plan is self._last:  # the same plan as the call before: a step loop's hot path
            return
        self._last = plan
        said, why, self.why = self._said, self.why, None
        if said is not None and _shape(said) == _shape(plan):
            if log.isEnabledFor(logging.DEBUG):
                emit(logging.DEBUG, "stagetorch: %s: %s", name, plan)
            return
        self._said = plan
        if log.isEnabledFor(logging.INFO):
            if said is None:
                emit(logging.INFO, "stagetorch: %s: %s", name, summary(plan))
            else:
                emit(logging.INFO, "stagetorch: %s: the plan changed (%s): %s", name, _changed(said, plan, why),
                     summary(plan))
        if log.isEnabledFor(logging.DEBUG):
            emit(logging.DEBUG, "stagetorch: %s: %s", name, plan)


def _changed(old: Plan, new: Plan, why: str | None) -> str:
    """Why ``new`` differs from ``old``, in a few words: another batch size, another budget, or ``why`` (the step
    staged again, or a plan that ran out of memory)."""
    if old.batch != new.batch:
        return f"another batch size, {old.batch} -> {new.batch}"
    if old.budget_bytes != new.budget_bytes:
        return f"another budget, {format_bytes(old.budget_bytes)} -> {format_bytes(new.budget_bytes)}"
    return why or "the program changed"

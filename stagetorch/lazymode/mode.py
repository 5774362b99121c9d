"""How a lazy session runs a step: :class:`Mode`, and the switch that caps it.

A session is in one mode at a time, and only ever moves down: ``EXPRESS`` (replaying a taped recording's
torch-level calls without running them) to ``REPLAY`` (replaying the recording ATen call by ATen call,
below autograd) to ``RECORD`` (staging each ATen call on fake tensors). Every mode gives the same results;
the higher ones only skip work a recording already did.

:func:`force_mode` (or the environment variable ``STAGETORCH_LAZY_MODE``) caps the mode sessions start in:
``"record"`` makes every step record, ``"replay"`` never replays express, ``"express"`` is the default.
The test suite runs every lazy test under each, so the three paths are held to the same results.
"""

from __future__ import annotations

import contextlib
import enum
import os
from collections.abc import Iterator

__all__ = ["Mode", "force_mode", "ENV_VAR"]

ENV_VAR = "STAGETORCH_LAZY_MODE"


class Mode(enum.IntEnum):
    """What a session does with each call; ordered, so ``mode <= cap`` says whether a cap allows it."""

    RECORD = 0  # stage each ATen call on fake tensors (the first step, or one that differs)
    REPLAY = 1  # match each ATen call against the recording and reuse its step (the slow replay)
    EXPRESS = 2  # match each torch-level call against the tape and run none of them (the express replay)


def _parse(value: str | Mode) -> Mode:
    if isinstance(value, Mode):
        return value
    try:
        return Mode[value.strip().upper()]
    except KeyError:
        names = ", ".join(repr(m.name.lower()) for m in Mode)
        raise ValueError(f"stagetorch.lazy: unknown mode {value!r}; one of {names}") from None


_cap: Mode = _parse(os.environ.get(ENV_VAR, "express"))


def cap() -> Mode:
    """The highest mode a new session may start in."""
    return _cap


@contextlib.contextmanager
def force_mode(mode: str | Mode) -> Iterator[Mode]:
    """Cap the mode of the sessions started inside the block: ``"record"``, ``"replay"`` or ``"express"``.

    **Arguments**

    - ``mode``: a :class:`Mode` or its name. ``"record"``: every step records on fake tensors; ``"replay"``:
      a repeated step replays its recording ATen call by ATen call, never express; ``"express"``: no cap
      (the default).

    **Returns** a context manager; the cap before it is restored on exit.
    """
    global _cap
    before, _cap = _cap, _parse(mode)
    try:
        yield _cap
    finally:
        _cap = before

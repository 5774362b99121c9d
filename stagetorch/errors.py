"""The named errors stagetorch raises. Each says what happened, where in the user's code, and what to do."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, TypeVar

__all__ = [
    "StagingError",
    "ShapeError",
    "BatchShapeError",
    "NotATensorError",
    "ConcretizationError",
    "UnsupportedOpError",
    "BatchCouplingError",
    "BatchStatisticsError",
    "OutOfMemoryError",
    "ModifiedInputError",
    "UnknownDeviceError",
    "PlanOnlyDeviceError",
    "RankMismatchError",
]

_E = TypeVar("_E", bound="StagingError")


class StagingError(Exception):
    """Base class of every error stagetorch raises on purpose.

    ``smallest_budget``: on an error that a budget too small caused, the fewest bytes some plan fits in
    (None where not known or not about a budget).
    """

    smallest_budget: int | None = None

    def copy_from(self: _E, other: BaseException, **changes: Any) -> _E:
        """This error (one rebuilt from ``other`` with a longer message) saying all that ``other`` says beside
        its message (its attributes: ``smallest_budget``, ``source``, a chunk-local result), then ``changes``
        (``smallest_budget=``, say). **Returns** this error, to raise."""
        self.__dict__.update(vars(other))
        self.__dict__.update(changes)
        return self


class ShapeError(StagingError, ValueError):
    """An op was called with shapes (or dtypes) it cannot take."""


class BatchShapeError(ShapeError):
    """The arguments do not make a batch: the batch dim is out of range for one of them, they disagree on the
    batch size, or the batch is empty. ``jit`` and ``lazy`` raise it for the same mistakes, each naming its own
    keyword (``batch_dim=`` and ``batch=``). A ``ValueError`` too."""


class NotATensorError(StagingError, TypeError):
    """A value that must be a tensor is not: an argument of ``stagetorch.lazy``, or one that ``jit``'s
    ``batch_argnums`` names as carrying the batch. A ``TypeError`` too."""


class ConcretizationError(StagingError):
    """The staged function needs a tensor's *value* (``.item()``, ``if x.sum() > 0``, ``x[x > 0]``)."""


class UnsupportedOpError(StagingError):
    """An op that stagetorch has no rule for, and cannot derive one for."""


class BatchCouplingError(StagingError):
    """An op mixes the examples of a batch, so running the batch in chunks would change the result."""


class BatchStatisticsError(BatchCouplingError):
    """An op normalises with statistics of the whole batch (BatchNorm in training mode), so no chunk can run
    alone. ``source``: where in the user's code (file:line and module)."""

    source: str = ""


class OutOfMemoryError(StagingError, MemoryError):
    """Not even the smallest plan fits in the memory available."""


class ModifiedInputError(StagingError, RuntimeError):
    """A real tensor that a lazy op read was changed in place before that op ran (``stagetorch.lazy``)."""


class RankMismatchError(StagingError):
    """The ranks of a process group called a staged step with different arguments (structure, dtypes,
    non-batch shapes) or staged different programs, so their collectives would not match."""


# The front end that runs now ("jit": jit, memory, the integrations; "lazy": stagetorch.lazy's flushes), for
# the errors raised deep below it that tell the user which option to change: each names its own keyword.
_FRONT_END: contextvars.ContextVar[str] = contextvars.ContextVar("stagetorch_front_end", default="jit")


@contextlib.contextmanager
def front_end(name: str) -> Iterator[None]:
    """Within the block, errors name the keywords of front end ``name`` (``"jit"`` or ``"lazy"``)."""
    token = _FRONT_END.set(name)
    try:
        yield
    finally:
        _FRONT_END.reset(token)


def batch_keyword() -> str:
    """The option that sets the batch dim, as the front end running now spells it: ``batch_dim=...`` for
    ``jit`` (and ``memory``), ``batch=...`` for ``stagetorch.lazy``."""
    return "stagetorch.lazy(..., batch=...)" if _FRONT_END.get() == "lazy" else "batch_dim=..."


class UnknownDeviceError(StagingError, ValueError):
    """A device name that is not in the table of known GPUs (``stagetorch.devices.catalog.known_devices``)."""


class PlanOnlyDeviceError(StagingError, RuntimeError):
    """A step staged for a named device this process does not run on was called: it can only be planned and
    reported (``.plan(...)``, ``stagetorch.memory``), not run."""

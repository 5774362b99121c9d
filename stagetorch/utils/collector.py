"""Pausing Python's cyclic garbage collector around work that allocates many objects that all stay alive
(a trace, building a program): the collector's passes over them would find nothing."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No cyclic collection inside; usable as a decorator. Reference counting still frees as usual."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()

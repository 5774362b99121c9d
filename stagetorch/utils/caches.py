"""The module-level caches, and the one call that empties them all (``stagetorch.clear_caches``).

A module that keeps a cache registers how to empty it, at import; this module knows nothing else.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["on_clear", "clear_all"]

_CLEARERS: list[Callable[[], None]] = []


def on_clear(clear: Callable[[], None]) -> Callable[[], None]:
    """Register ``clear`` to run on :func:`clear_all`; returns it (usable as a decorator)."""
    _CLEARERS.append(clear)
    return clear


def clear_all() -> None:
    for clear in _CLEARERS:
        clear()

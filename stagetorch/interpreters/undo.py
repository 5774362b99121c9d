"""The record a failed step restores the caller's state from: :class:`Undo`.

A program saves into it what it writes of the caller's state outside its commit (where
:func:`stagetorch.transforms.commit.commit_plan` says a write needs a copy); the executable restores it when
the step fails. It holds real tensors and knows nothing of graphs, programs or plans.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["Undo"]


class Undo:
    """What a failed step puts back: a copy of each protected tensor (the caller's state the step writes),
    taken just before a program first writes it outside its commit, when the step is past its largest
    allocations (a forward's BatchNorm statistics are copied in the forward, an optimizer's state only
    where its update cannot be a commit). ``protected``: the tensors whose storage is the caller's."""

    def __init__(self, protected: Iterable[torch.Tensor] = ()):
        self.protected = {t.untyped_storage().data_ptr() for t in protected}
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def save(self, t: torch.Tensor) -> None:
        base = t if t._base is None else t._base
        key = base.untyped_storage().data_ptr()
        if key in self.protected and key not in self.saved:
            self.saved[key] = (base, base.clone())

    def restore(self) -> None:
        with torch.no_grad():
            for t, copy in self.saved.values():
                t.copy_(copy)
        self.saved.clear()

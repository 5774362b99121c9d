"""One-line mode: ``stagetorch.lazy(input, label, batch=0)`` and the rest of the script unchanged.

The mechanism, file by file (``docs/lazy.md`` walks through it):

- :mod:`.tensor`: the :class:`LazyTensor`, and where its calls go.
- :mod:`.session`: one ``lazy(...)`` call's state and its flush through ``api.Executable``.
- :mod:`.recording`: ATen calls staged on fake tensors, kept per input signature.
- :mod:`.replay`: the slow replay, ATen call by ATen call against a recording.
- :mod:`.backward` and :mod:`.autograd_graph`: ``loss.backward()``, and skipping the engine when it can.
- :mod:`.tape` and :mod:`.express`: the express replay of torch-level calls, matched by generated guards.
- :mod:`.mode`: how far a session may go (record, slow replay, express), and the switch that forces it.
"""

from .session import lazy
from .tensor import LazyTensor

__all__ = ["lazy", "LazyTensor"]

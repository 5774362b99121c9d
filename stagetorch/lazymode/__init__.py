"""One-line mode: ``stagetorch.lazy(input, label, batch=0)`` and the rest of the script unchanged.

The mechanism, file by file, bottom up: each imports only from the ones above it in this list, and the
session's classes are one chain of subclasses in the same order (``docs/lazy.md`` walks through it).

- :mod:`.mode`: how far a session may go (record, slow replay, express), and the switch that forces it.
- :mod:`.shard`: a step over a ``torch.distributed`` process group: the inputs and flush of a rank.
- :mod:`.tensor`: the :class:`LazyTensor`, and what it asks of its session (``SessionBase``).
- :mod:`.autograd_graph`: reading an autograd graph without running it.
- :mod:`.draws`: random ops that take their numbers at their call, in eager's order (:class:`stagetorch.transforms.rng.SetRngState` before each).
- :mod:`.recording`: ATen calls staged on fake tensors, kept per input signature (``RecordingSteps``).
- :mod:`.tape`: the express tape of torch-level calls, and the guards that match them.
- :mod:`.replay`: the slow replay, ATen call by ATen call against a recording (``SlowReplay``).
- :mod:`.express`: the express replay of the tape's calls (``ExpressReplay``).
- :mod:`.backward`: ``loss.backward()``, and skipping the engine when it can (``BackwardSkip``).
- :mod:`.session`: one ``lazy(...)`` call's state and its flush through ``executable.Executable``; :func:`lazy`.
"""

from .session import lazy
from .tensor import LazyTensor

__all__ = ["lazy", "LazyTensor"]

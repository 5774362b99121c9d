"""Measure the live-tensor peak of real PyTorch code: the ground truth the memory estimates are tested against.

A dispatch mode sees every tensor an ATen op returns, forward and backward. Each storage is counted once
from its first appearance until the last tensor on it dies (weak references fire when the C++ tensor goes,
since PyTorch keeps a tensor's Python object alive while C++ still holds it). Tensors alive before the step
(parameters, buffers, inputs, existing .grad) are counted as resident.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_DENSE = (torch.Tensor, torch.nn.Parameter)


class LivePeak(TorchDispatchMode):
    def __init__(self, resident: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.count: dict[int, int] = {}
        self.size: dict[int, int] = {}
        self.live = 0
        self.peak = 0
        self._refs: list = []
        for t in resident:
            self._see(t, keep=True)
        self.peak = self.live

    def _see(self, t: torch.Tensor, keep: bool = False) -> None:
        if type(t) not in _DENSE or t.device.type == "meta":  # fake and lazy tensors hold no memory
            return
        st = t.untyped_storage()
        key, nbytes = st.data_ptr(), st.nbytes()
        if not nbytes:
            return
        if key not in self.size:
            self.size[key] = nbytes
            self.count[key] = 0
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        if keep:
            self.count[key] += 1
            return
        self.count[key] += 1
        self._refs.append(weakref.ref(t, lambda _, key=key: self._drop(key)))

    def _drop(self, key: int) -> None:
        self.count[key] -= 1
        if self.count[key] == 0:
            self.live -= self.size.pop(key)
            del self.count[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and not isinstance(args[0], torch.Tensor):
            # Under a dispatch mode, .item() of a 0-dim tensor autograd made from a Python number arrives with
            # the number itself (torch 2.13); stagetorch.lazy reads such saved numbers.
            return args[0]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self._see(t)
        return out


def measured_peak(step: Callable, model: torch.nn.Module, *args: torch.Tensor) -> int:
    """The live-tensor peak of ``step(*args)`` run eagerly, with the model's state and the inputs resident."""
    resident = [*model.parameters(), *model.buffers(), *args]
    with LivePeak(resident) as tracker:
        step(*args)
    return tracker.peak

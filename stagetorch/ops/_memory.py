"""Generic memory rules (workspaces, allocator rounding) that the family tables reuse."""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..ir import Eqn
from ..memory import MemoryEffect


@functools.lru_cache(maxsize=256)
def _mkldnn_rnn_workspace_bytes(shapes: tuple, params: tuple) -> int:
    # oneDNN does not expose its RNN workspace size, and the fake kernel reports it as empty: run the real
    # CPU kernel once per shape on zeros and read the size it returns.
    args = [torch.zeros(s) for s in shapes]
    out = torch.ops.aten.mkldnn_rnn_layer.default(*args, *params)
    return out[3].untyped_storage().nbytes()


def mkldnn_rnn_layer(eqn: Eqn) -> MemoryEffect:
    tensors = eqn.args[:7]
    if any(getattr(t, "aval", None) is None or t.aval.device.type != "cpu" for t in tensors):
        return MemoryEffect()
    params: tuple[Any, ...] = tuple(tuple(p) if isinstance(p, list) else p for p in eqn.args[7:])
    size = _mkldnn_rnn_workspace_bytes(tuple(t.aval.shape for t in tensors), params)
    return MemoryEffect(outputs={3: size})

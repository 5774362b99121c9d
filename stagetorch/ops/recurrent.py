"""Rules for the recurrent op family: the CPU LSTM/GRU layer (oneDNN's ``mkldnn_rnn_layer``) and its backward.

The layer's input is (time, batch, features) and its hidden states are (batch, hidden).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import _caches
from ..batching import Chunked, LabelFn, Reduced, coupling
from ..costing import MemoryEffect
from ..errors import ShapeError
from ..ir import Aval, Eqn, Var

aten = torch.ops.aten


def mkldnn_rnn_layer(x: Aval, w_ih: Aval, w_hh: Aval, b_ih: Aval, b_hh: Aval, hx: Aval, cx: Aval, reverse: bool,
                     batch_sizes: list[int], mode: int, hidden_size: int, *args: Any) -> tuple[Aval, ...]:
    """One direction of one CPU LSTM layer: (output, hy, cy, workspace). oneDNN sizes its workspace when the
    kernel runs; the meta kernel reports it empty, and so does this rule (the memory rule measures it)."""
    if x.shape[-1] != w_ih.shape[-1] or hx.shape != cx.shape or hx.shape[-1] != hidden_size:
        raise ShapeError(
            f"aten.mkldnn_rnn_layer: input {x}, weight_ih {w_ih} and states {hx}, {cx} do not fit hidden size {hidden_size}"
        )
    return (
        Aval(x.shape[:-1] + (hidden_size,), x.dtype, x.device),
        hx,
        cx,
        Aval((0,), torch.uint8, x.device),
    )


def mkldnn_rnn_layer_backward(x: Aval, w_ih: Aval, w_hh: Aval, b_ih: Aval, b_hh: Aval, hx: Aval, cx: Aval,
                              *args: Any) -> tuple[Aval, ...]:
    """Gradients for the input, the four weights and the two initial states."""
    return x, w_ih, w_hh, b_ih, b_hh, hx, cx


@functools.lru_cache(maxsize=256)
def _mkldnn_rnn_workspace_bytes(shapes: tuple, params: tuple, grad_enabled: bool) -> int:
    # oneDNN does not expose its RNN workspace size, and the fake kernel reports it as empty: run the real
    # CPU kernel once per shape on zeros and read the size it returns. Under no_grad the kernel makes none.
    args = [torch.zeros(s) for s in shapes]
    with torch.set_grad_enabled(grad_enabled):
        out = torch.ops.aten.mkldnn_rnn_layer.default(*args, *params)
    return 0 if out[3] is None else out[3].untyped_storage().nbytes()


_caches.on_clear(_mkldnn_rnn_workspace_bytes.cache_clear)


def mkldnn_rnn_layer_memory(eqn: Eqn) -> MemoryEffect:
    tensors = eqn.args[:7]
    if any(getattr(t, "aval", None) is None or t.aval.device.type != "cpu" for t in tensors):
        return MemoryEffect()
    params: tuple[Any, ...] = tuple(tuple(p) if isinstance(p, list) else p for p in eqn.args[7:])
    size = _mkldnn_rnn_workspace_bytes(tuple(t.aval.shape for t in tensors), params, torch.is_grad_enabled())
    return MemoryEffect(outputs={3: size})


def _rnn_scratch(eqn: Eqn) -> int:
    """What oneDNN's LSTM layer allocates inside itself beyond its outputs (CPU): the bias summed, both
    weights reordered, the gates of every step and a scratchpad that grows with the hidden size and the
    batch. Fitted to the allocator on torch 2.13 (tests/test_workspace.py): within a few KiB of it."""
    x, w_ih, w_hh = (a.aval for a in eqn.args[:3])
    steps, batch = x.shape[0], x.shape[1]
    hidden = w_hh.shape[-1]
    gates = 4 * hidden * 4
    return gates + (w_ih.nbytes + w_hh.nbytes) + steps * batch * gates + 4 * hidden * (100 + batch)


def mkldnn_rnn_layer_workspace(eqn: Eqn) -> int:
    if eqn.args[0].aval.device.type != "cpu":
        return 0
    train = eqn.args[15]
    x, hidden = eqn.args[0].aval, eqn.args[2].aval.shape[-1]
    # Inference keeps more per-step state in its scratchpad than training does.
    return _rnn_scratch(eqn) + (0 if train else 6 * x.shape[1] * hidden * 4 + 4096)


def mkldnn_rnn_layer_backward_workspace(eqn: Eqn) -> int:
    if eqn.args[0].aval.device.type != "cpu":
        return 0
    w_ih, hidden = eqn.args[1].aval, eqn.args[2].aval.shape[-1]
    # The forward's scratch again, part of the input weight's gradient reordered, the gates' gradient reduced.
    return _rnn_scratch(eqn) + w_ih.nbytes // 2 + 256 * hidden


def _rnn_layer(outputs: Sequence[str | None], hidden_args: Sequence[int]) -> Callable[[Eqn, LabelFn], Chunked]:
    """mkldnn RNN layers: the sequence is (time, batch, features), hidden states are (batch, hidden).

    ``outputs`` names each outvar: ``"seq"`` batched on dim 1, ``"hidden"`` batched on dim 0, ``"sum"`` a
    weight gradient, ``None`` an opaque workspace that only this chunk's backward reads.
    """

    def rule(eqn: Eqn, label: LabelFn) -> Chunked:
        seq = label(eqn.args[0])
        if seq is None or seq.dim != 1:
            raise coupling(eqn, "runs a recurrent layer whose input is not batched on dim 1", "keep the batch whole")
        extent = seq.extent(label.batch)
        cut = {}
        for i in hidden_args:
            v = eqn.args[i]
            if isinstance(v, Var) and label(v) is None and v.aval.ndim and v.aval.shape[0] == extent:
                cut[v] = seq.moved(0)
        kinds = {"seq": seq, "hidden": seq.moved(0), "sum": Reduced("sum"), None: None}
        return Chunked(tuple(kinds[o] if v is not None else None for o, v in zip(outputs, eqn.outvars)), slice=cut)

    return rule


rnn_layer = _rnn_layer(("seq", "hidden", "hidden", None), hidden_args=(5, 6))


rnn_layer_backward = _rnn_layer(
    ("seq", "sum", "sum", "sum", "sum", "hidden", "hidden"), hidden_args=(5, 6, 8, 9, 11, 12)
)


SHAPE: dict = {
    aten.mkldnn_rnn_layer: mkldnn_rnn_layer,
    aten.mkldnn_rnn_layer_backward: mkldnn_rnn_layer_backward,
}

MEMORY: dict = {
    aten.mkldnn_rnn_layer: mkldnn_rnn_layer_memory,
}

WORKSPACE: dict = {
    aten.mkldnn_rnn_layer: mkldnn_rnn_layer_workspace,
    aten.mkldnn_rnn_layer_backward: mkldnn_rnn_layer_backward_workspace,
}

BATCH: dict = {
    aten.mkldnn_rnn_layer: rnn_layer,
    aten.mkldnn_rnn_layer_backward: rnn_layer_backward,
}


def _rnn_flops(x: Var, w_ih: Var, w_hh: Var) -> int:
    """Each step of each sequence multiplies its input and its hidden state by the gate weights."""
    tokens = x.aval.numel // x.aval.shape[-1]
    return 2 * tokens * (w_ih.aval.numel + w_hh.aval.numel)


# FLOP rules: op -> rule(eqn) -> int (see stagetorch/flops.py). The backward does the products twice over:
# once for the input and state gradients, once for the weight gradients.
FLOPS: dict = {
    aten.mkldnn_rnn_layer: lambda e: _rnn_flops(*e.args[:3]),
    aten.mkldnn_rnn_layer_backward: lambda e: 2 * _rnn_flops(*e.args[:3]),
}

# Kernel calls: op -> rule(eqn) -> int. A layer multiplies each step's hidden state apart (the input's
# product runs once for every step), and its backward does that twice over: its fixed price per call,
# paid again in each extra chunk, grows with the sequence.
CALLS: dict = {
    aten.mkldnn_rnn_layer: lambda e: e.args[0].aval.shape[0],
    aten.mkldnn_rnn_layer_backward: lambda e: 2 * e.args[0].aval.shape[0],
}

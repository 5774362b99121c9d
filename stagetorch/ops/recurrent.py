"""Rules for the recurrent op family: the CPU LSTM/GRU layer (oneDNN's ``mkldnn_rnn_layer``) and its backward.

The layer's input is (time, batch, features) and its hidden states are (batch, hidden).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import ShapeError
from ..interpreters.batching import Chunked, LabelFn, Reduced, coupling
from ..interpreters.memory import MemoryEffect
from ..ir import Aval, Eqn, Var
from ..utils import caches
from . import layout_rules

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


caches.on_clear(_mkldnn_rnn_workspace_bytes.cache_clear)


def mkldnn_rnn_layer_memory(eqn: Eqn) -> MemoryEffect:
    tensors = eqn.args[:7]
    if any(getattr(t, "aval", None) is None or t.aval.device.type != "cpu" for t in tensors):
        return MemoryEffect()
    params: tuple[Any, ...] = tuple(tuple(p) if isinstance(p, list) else p for p in eqn.args[7:])
    size = _mkldnn_rnn_workspace_bytes(tuple(t.aval.shape for t in tensors), params, torch.is_grad_enabled())
    return MemoryEffect(outputs={3: size})


def _rnn_scratch(eqn: Eqn) -> int:
    """What oneDNN's LSTM layer allocates inside itself beyond its outputs where the reference kernel's
    arithmetic below does not reach: inference (grad mode off) and bfloat16, which run oneDNN's brgemm
    kernels, whose scratchpad and blocked weights depend on the ISA. A fit to the allocator on torch 2.13's
    float32 training (AVX-512), kept from before that arithmetic: a bound, not checked on those paths."""
    x, w_ih, w_hh = (a.aval for a in eqn.args[:3])
    steps, batch = x.shape[0], x.shape[1]
    hidden = w_hh.shape[-1]
    gates = 4 * hidden * 4
    return gates + (w_ih.nbytes + w_hh.nbytes) + steps * batch * gates + 4 * hidden * (100 + batch)


# oneDNN 3.12's reference RNN (src/cpu/rnn/ref_rnn.cpp, rnn_utils.{hpp,cpp}), which runs every float32 LSTM
# that keeps a workspace: the forward of a training step and its backward (its brgemm kernels refuse f32
# training). What ATen's mkldnn_rnn_layer{,_backward} (aten/src/ATen/native/mkldnn/RNN.cpp) and ideep's
# lstm_forward_training / lstm_backward allocate around it, all freed inside the call:
# - the two biases summed (4 * hidden floats);
# - the weights reordered to the layout the primitive asks for: the forward wants them (input, gate, out)
#   with each input row padded to a good leading dimension (_good_ld of 4 * hidden), always a copy; the
#   backward wants PyTorch's own (gate, out, input) order with the input padded, a copy only where padding
#   changes the row (_good_ld(input) != input);
# - the backward's weight and bias gradients in the forward's layout, zeroed, then copied into ATen's;
# - the scratchpad: the gates of every step (of one step in a forward over 128 sequences or more), the
#   hidden state and its gradient, each page-aligned (rnn_utils::set_offsets), booked with 4 KiB of
#   alignment, and the per-layer pointer tables (memory_tracking: 128 B of alignment per entry);
# - in the backward, the output and final-state gradients made contiguous (zeros where None: the models
#   read the output only), and the initial cell state cloned where it shares the hidden state's storage.
_PAGE = 4096


def _good_ld(dim: int, itemsize: int = 4) -> int:
    """rnn_utils::get_good_ld: a leading dimension rounded up to 64 bytes, one cache line more where that is
    a multiple of 256 elements (4K aliasing)."""
    line = 64 // itemsize
    ld = -(-dim // line) * line
    return ld + line if ld % 256 == 0 else ld


def _pages(n: int) -> int:
    return -(-n // _PAGE) * _PAGE


def _onednn_lstm_scratchpad(steps: int, batch: int, hidden: int, backward: bool) -> int:
    """The scratchpad oneDNN's reference LSTM books for one layer and direction (float32, training)."""
    gate_steps = steps if backward or batch < 128 else 1  # merge_gemm_layer: one GEMM over all steps
    gates = gate_steps * batch * _good_ld(4 * hidden) * 4
    state = batch * _good_ld(hidden) * 4  # scratch_ht, and scratch_diff_ht (training)
    space = 0
    for size in (gates, state, state, 0):  # the last: the (LSTM-empty) cell scratch, rounding to a page
        space = _pages(space) + size
    pointers = 3 * (8 + 128) + (4 * 8 + 128)  # the weights' (layer, iter, projection) and the biases' tables
    return space + _PAGE + pointers


def _is_float32_cpu(eqn: Eqn) -> bool:
    x = eqn.args[0].aval
    return x.device.type == "cpu" and x.dtype == torch.float32


def _copied(v: Any, layouts: Any) -> int:
    """Bytes ``v.contiguous()`` allocates inside the kernel: a copy where ``v`` is not contiguous (unknown
    strides read as a copy)."""
    if not isinstance(v, Var):
        return 0
    dense = layout_rules.dense_in(v.aval.shape, layout_rules.strides_of(v, layouts), torch.contiguous_format)
    return 0 if dense else v.aval.nbytes


def mkldnn_rnn_layer_workspace(eqn: Eqn) -> int:
    if eqn.args[0].aval.device.type != "cpu":
        return 0
    x, hidden = eqn.args[0].aval, eqn.args[2].aval.shape[-1]
    # ATen runs oneDNN's training forward (a workspace kept) where grad mode is on, whatever ``train`` says;
    # the memory rule reads the same (mkldnn_rnn_layer_memory).
    if not torch.is_grad_enabled():
        # Inference keeps more per-step state in its scratchpad than training does.
        return _rnn_scratch(eqn) + 6 * x.shape[1] * hidden * 4 + 4096
    if not _is_float32_cpu(eqn):
        return _rnn_scratch(eqn)
    steps, batch, features = x.shape
    weights = (features + hidden) * _good_ld(4 * hidden) * 4
    return 16 * hidden + weights + _onednn_lstm_scratchpad(steps, batch, hidden, backward=False)


def mkldnn_rnn_layer_backward_workspace(eqn: Eqn, layouts: Any = None) -> int:
    if eqn.args[0].aval.device.type != "cpu":
        return 0
    x, hx, cx = eqn.args[0], eqn.args[5], eqn.args[6]
    steps, batch, features = x.aval.shape
    hidden = eqn.args[2].aval.shape[-1]
    if not _is_float32_cpu(eqn):
        w_ih = eqn.args[1].aval
        return _rnn_scratch(eqn) + w_ih.nbytes // 2 + 256 * hidden
    layouts = layouts or (lambda v: None)
    state = batch * hidden * 4
    # The output gradient and the final states' made contiguous, or zeros where None.
    grads = 0
    for v, nbytes in ((eqn.args[10], steps * state), (eqn.args[11], state), (eqn.args[12], state)):
        grads += nbytes if v is None else _copied(v, layouts)
    shared = isinstance(hx, Var) and isinstance(cx, Var) and hx.root is cx.root
    reordered = sum(4 * hidden * _good_ld(n) * 4 for n in (features, hidden) if _good_ld(n) != n)
    # The weight gradients in oneDNN's layout, and the bias gradient (16 * hidden), less the second bias
    # gradient: an output (counted with the outputs), cloned from the first after the peak.
    gradients = (features + hidden) * _good_ld(4 * hidden) * 4
    return (grads + (state if shared else 0) + 16 * hidden + reordered + gradients
            + _onednn_lstm_scratchpad(steps, batch, hidden, backward=True))


mkldnn_rnn_layer_backward_workspace.reads_layouts = True  # type: ignore[attr-defined]


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


# FLOP rules: op -> rule(eqn) -> int (see stagetorch/interpreters/flops.py). The backward does the products twice over:
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

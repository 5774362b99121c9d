"""Rules for the attention op family."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ShapeError
from ..ir import Aval
from . import _batch, _memory, _shape  # noqa: F401

aten = torch.ops.aten


def sdpa_cpu(q: Aval, k: Aval, v: Aval, *args: Any, **kwargs: Any) -> tuple[Aval, Aval]:
    """(batch..., heads, L, E) queries against (..., S, E) keys and (..., S, Ev) values."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ShapeError(f"aten._scaled_dot_product_flash_attention_for_cpu: expects 4-d q, k, v ({q}, {k}, {v})")
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2] or q.shape[0] != k.shape[0]:
        raise ShapeError(f"aten._scaled_dot_product_flash_attention_for_cpu: q, k, v do not line up ({q}, {k}, {v})")
    out = Aval(q.shape[:-1] + v.shape[-1:], q.dtype, q.device)
    return out, Aval(q.shape[:-1], torch.float32, q.device)


def sdpa_cpu_backward(grad: Aval, q: Aval, k: Aval, v: Aval, *args: Any, **kwargs: Any) -> tuple[Aval, Aval, Aval]:
    return q, k, v


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

# Shape rules: op -> rule(*args with Avals, **kwargs) -> Aval | tuple[Aval, ...]
SHAPE: dict = {
    aten._softmax: _shape.softmax("_softmax"),
    aten._log_softmax: _shape.softmax("_log_softmax"),
    aten._softmax_backward_data: lambda grad, out, dim, dtype: Aval(grad.shape, dtype, grad.device),
    aten._log_softmax_backward_data: lambda grad, out, dim, dtype: Aval(grad.shape, dtype, grad.device),
    aten._scaled_dot_product_flash_attention_for_cpu: sdpa_cpu,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: sdpa_cpu_backward,
    aten.mkldnn_rnn_layer: mkldnn_rnn_layer,
    aten.mkldnn_rnn_layer_backward: mkldnn_rnn_layer_backward,
}



# Memory rules: op -> rule(eqn) -> transient workspace bytes
MEMORY: dict = {
    aten.mkldnn_rnn_layer: _memory.mkldnn_rnn_layer,
}



# Batch rules: op -> rule(eqn, label) -> Chunked (see stagetorch/batching.py)
BATCH: dict = {
    # (batch, heads, sequence, features) layouts: every example attends within itself. A shared mask of
    # full batch extent is cut to the chunk.
    aten._scaled_dot_product_flash_attention_for_cpu: _batch.per_example(slice_args=(5,)),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _batch.per_example(slice_args=(8,)),
    aten._scaled_dot_product_flash_attention: _batch.per_example(),
    aten._scaled_dot_product_flash_attention_backward: _batch.per_example(),
    aten._scaled_dot_product_efficient_attention: _batch.per_example(slice_args=(3,)),
    aten._scaled_dot_product_efficient_attention_backward: _batch.per_example(slice_args=(3,)),
    aten._scaled_dot_product_cudnn_attention: _batch.per_example(slice_args=(3,)),
    aten._scaled_dot_product_cudnn_attention_backward: _batch.per_example(),
    # nn.TransformerEncoderLayer / nn.MultiheadAttention fast paths (eval, no grad, batch_first).
    aten._transformer_encoder_layer_fwd: _batch.per_example(),
    aten._native_multi_head_attention: _batch.per_example(),
    aten._softmax: _batch.softmax(dim_arg=1),
    aten._log_softmax: _batch.softmax(dim_arg=1),
    aten._softmax_backward_data: _batch.softmax(dim_arg=2),
    aten._log_softmax_backward_data: _batch.softmax(dim_arg=2),
    # The CPU LSTM/GRU layer: input (time, batch, features), hidden state (batch, hidden).
    aten.mkldnn_rnn_layer: _batch.rnn_layer,
    aten.mkldnn_rnn_layer_backward: _batch.rnn_layer_backward,
    aten._safe_softmax: _batch.softmax(dim_arg=1),
}


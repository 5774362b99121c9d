"""Rules for the attention op family."""

from __future__ import annotations

import torch

from . import _batch, _memory, _shape  # noqa: F401

aten = torch.ops.aten

# Shape rules: op -> rule(*args with Avals, **kwargs) -> Aval | tuple[Aval, ...]
SHAPE: dict = {
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


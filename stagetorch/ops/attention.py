"""Rules for the attention op family."""

from __future__ import annotations

from typing import Any

import torch

from .. import batching, flops
from ..errors import ShapeError
from ..ir import Aval
from . import _shape

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


# Shape rules: op -> rule(*args with Avals, **kwargs) -> Aval | tuple[Aval, ...]
SHAPE: dict = {
    aten._softmax: _shape.softmax("_softmax"),
    aten._log_softmax: _shape.softmax("_log_softmax"),
    aten._softmax_backward_data: lambda grad, out, dim, dtype: Aval(grad.shape, dtype, grad.device),
    aten._log_softmax_backward_data: lambda grad, out, dim, dtype: Aval(grad.shape, dtype, grad.device),
    aten._scaled_dot_product_flash_attention_for_cpu: sdpa_cpu,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: sdpa_cpu_backward,
}


# Batch rules: op -> rule(eqn, label) -> Chunked (see stagetorch/batching.py)
BATCH: dict = {
    # (batch, heads, sequence, features) layouts: every example attends within itself. A shared mask of
    # full batch extent is cut to the chunk.
    aten._scaled_dot_product_flash_attention_for_cpu: batching.per_example(slice_args=(5,)),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: batching.per_example(slice_args=(8,)),
    aten._scaled_dot_product_flash_attention: batching.per_example(),
    aten._scaled_dot_product_flash_attention_backward: batching.per_example(),
    aten._scaled_dot_product_efficient_attention: batching.per_example(slice_args=(3,)),
    aten._scaled_dot_product_efficient_attention_backward: batching.per_example(slice_args=(3,)),
    aten._scaled_dot_product_cudnn_attention: batching.per_example(slice_args=(3,)),
    aten._scaled_dot_product_cudnn_attention_backward: batching.per_example(),
    # nn.TransformerEncoderLayer / nn.MultiheadAttention fast paths (eval, no grad, batch_first).
    aten._transformer_encoder_layer_fwd: batching.per_example(),
    aten._native_multi_head_attention: batching.per_example(),
    aten._softmax: batching.softmax(dim_arg=1),
    aten._log_softmax: batching.softmax(dim_arg=1),
    aten._softmax_backward_data: batching.softmax(dim_arg=2),
    aten._log_softmax_backward_data: batching.softmax(dim_arg=2),
    aten._safe_softmax: batching.softmax(dim_arg=1),
}


# FLOP rules: op -> rule(eqn) -> int (see stagetorch/flops.py)
FLOPS: dict = {
    **{op: flops.attention_rule for op in (
        aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention,
        aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_cudnn_attention,
    )},
    **{op: flops.attention_backward_rule for op in (
        aten._scaled_dot_product_flash_attention_for_cpu_backward, aten._scaled_dot_product_flash_attention_backward,
        aten._scaled_dot_product_efficient_attention_backward, aten._scaled_dot_product_cudnn_attention_backward,
    )},
}

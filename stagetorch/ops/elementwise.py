"""Rules for the elementwise op family."""

from __future__ import annotations

import torch

from ..ir import Aval
from . import _batch, _memory, _shape  # noqa: F401

aten = torch.ops.aten


# Shape rules: op -> rule(*args with Avals, **kwargs) -> Aval | tuple[Aval, ...]
SHAPE: dict = {
    **{op: _shape.broadcast(op._qualified_op_name) for op in (
        aten.add, aten.sub, aten.mul, aten.rsub, aten.maximum, aten.minimum,
    )},
    aten.div: _shape.broadcast("div", float_out=True),
    aten.pow: _shape.broadcast("pow"),
    aten.where.self: lambda cond, a, b: Aval(
        _shape.broadcast_shapes("where", cond, a, b), _shape.broadcast("where")(a, b).dtype, a.device
    ),
    **{op: _shape.compare(op._qualified_op_name) for op in (aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge)},
    # Backward of an activation: shaped like the incoming gradient.
    **{op: _shape.broadcast(op._qualified_op_name) for op in (
        aten.threshold_backward, aten.gelu_backward, aten.tanh_backward, aten.sigmoid_backward,
        aten.silu_backward, aten.native_dropout_backward,
    )},
    **{op: _shape.same(op._qualified_op_name) for op in (
        aten.relu, aten.gelu, aten.tanh, aten.sigmoid, aten.silu, aten.neg, aten.exp, aten.log, aten.sqrt,
        aten.rsqrt, aten.abs, aten.clone, aten.detach, aten.alias, aten.masked_fill, aten.fill, aten.copy_,
        aten.zero_, aten.fill_, aten.lift_fresh_copy,
    )},
    **{op: _shape.same(op._qualified_op_name, dtype_arg="dtype") for op in (
        aten._to_copy, aten.ones_like, aten.zeros_like, aten.empty_like, aten.full_like,
    )},
}



# Memory rules: op -> rule(eqn) -> transient workspace bytes
MEMORY: dict = {
}



# Batch rules: op -> rule(eqn, label) -> Chunked (see stagetorch/batching.py)
BATCH: dict = {
    # Shape-preserving ops without torch's pointwise tag (tagged ones get _batch.elementwise by default).
    **{op: _batch.elementwise for op in (
        aten._to_copy, aten.copy_, aten.detach, aten.alias, aten.lift_fresh_copy, aten.fill_, aten.zero_,
        aten.where, aten.masked_fill, aten.masked_fill_, aten.rsub, aten.ones_like, aten.zeros_like,
        aten.empty_like, aten.full_like, aten.rand_like, aten.randn_like, aten.leaky_relu_backward,
        aten.hardtanh_backward, aten.elu_backward, aten.contiguous, aten.clone,
    )},
    # Factories that take a tensor only for its dtype and device: same output in every chunk.
    **{op: _batch.same_in_every_chunk for op in (
        aten.new_empty_strided, aten.new_empty, aten.new_zeros, aten.new_ones, aten.new_full,
    )},
    aten.hardswish: _batch.elementwise,
    aten.log_sigmoid_forward: _batch.elementwise,
    aten.fill: _batch.elementwise,
}


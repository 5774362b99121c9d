"""Rules for the elementwise op family."""

from __future__ import annotations

import torch

from .. import batching
from ..ir import Aval, Eqn
from . import _layout, _shape

aten = torch.ops.aten


def div(x: Aval, other: Aval | complex, *, rounding_mode: str | None = None) -> Aval:
    """True division makes integers float; floor and trunc division keep the operands' promoted dtype."""
    kind = _shape.Promotion.DEFAULT if rounding_mode else _shape.Promotion.INT_TO_FLOAT
    return _shape.broadcast("div", kind=kind)(x, other)


def where(cond: Aval, x: Aval, y: Aval) -> Aval:
    out = _shape.broadcast("where", tensors=3)(cond, x, y)
    return Aval(out.shape, _shape.result_dtype(x, y), out.device)


def masked_fill(x: Aval, mask: Aval, value: Aval | complex) -> Aval:
    """The mask broadcasts ``x`` out of place; the fill value never changes the dtype."""
    return Aval(_shape.broadcast_shapes("masked_fill", x, mask), x.dtype, x.device)


# Promotion kinds are torch's own, as its reference implementations (torch._refs) declare them.
_TO_FLOAT = _shape.Promotion.INT_TO_FLOAT

# Shape rules: op -> rule(*args with Avals, **kwargs) -> Aval | tuple[Aval, ...]
SHAPE: dict = {
    **{op: _shape.broadcast(op.__name__) for op in (
        aten.add, aten.sub, aten.mul, aten.rsub, aten.maximum, aten.minimum,
    )},
    aten.div: div,
    aten.pow: _shape.broadcast("pow", kind=_shape.Promotion.BOOL_TO_LONG),
    aten.where.self: where,
    aten.masked_fill: masked_fill,
    **{op: _shape.compare(op.__name__) for op in (aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge)},
    # Backward of an activation: shaped like the incoming gradient.
    **{op: _shape.broadcast(op.__name__) for op in (
        aten.threshold_backward, aten.gelu_backward, aten.tanh_backward, aten.sigmoid_backward,
        aten.silu_backward,
    )},
    # grad * mask * scale: a float scale makes an integer gradient float.
    aten.native_dropout_backward: _shape.broadcast("native_dropout_backward", tensors=3),
    **{op: _shape.broadcast(op.__name__, tensors=1, bool_ok=False) for op in (aten.relu, aten.gelu, aten.silu, aten.neg)},
    **{op: _shape.broadcast(op.__name__, tensors=1, kind=_TO_FLOAT) for op in (
        aten.tanh, aten.sigmoid, aten.exp, aten.log, aten.sqrt, aten.rsqrt,
    )},
    aten.abs: _shape.broadcast("abs", tensors=1, kind=_shape.Promotion.COMPLEX_TO_FLOAT, bool_ok=False),
    **{op: _shape.same(op.__name__) for op in (
        aten.clone, aten.detach, aten.alias, aten.fill, aten.copy_, aten.zero_, aten.fill_,
        aten.lift_fresh_copy,
    )},
    **{op: _shape.same(op.__name__, dtype_arg="dtype") for op in (
        aten._to_copy, aten.ones_like, aten.zeros_like, aten.empty_like, aten.full_like,
    )},
}


# Batch rules: op -> rule(eqn, label) -> Chunked (see stagetorch/batching.py)
BATCH: dict = {
    # Shape-preserving ops without torch's pointwise tag (tagged ones get batching.elementwise by default).
    **{op: batching.elementwise for op in (
        aten._to_copy, aten.copy_, aten.detach, aten.alias, aten.lift_fresh_copy, aten.fill_, aten.zero_,
        aten.where, aten.masked_fill, aten.masked_fill_, aten.rsub, aten.ones_like, aten.zeros_like,
        aten.empty_like, aten.full_like, aten.rand_like, aten.randn_like, aten.leaky_relu_backward,
        aten.hardtanh_backward, aten.elu_backward, aten.contiguous, aten.clone,
        # Activations' backwards torch does not tag pointwise (the forwards are tagged).
        aten.hardswish_backward, aten.hardsigmoid_backward, aten.mish_backward, aten.softplus_backward,
        aten.softshrink_backward, aten.hardshrink_backward, aten.log_sigmoid_backward,
    )},
    # Factories that take a tensor only for its dtype and device: same output in every chunk.
    **{op: batching.same_in_every_chunk for op in (
        aten.new_empty_strided, aten.new_empty, aten.new_zeros, aten.new_ones, aten.new_full,
    )},
    aten.hardswish: batching.elementwise,
    # PReLU: the weight broadcasts over the channels; the backward's weight gradient is per element, summed after.
    aten._prelu_kernel: batching.elementwise,
    aten._prelu_kernel_backward: batching.elementwise,
    aten.log_sigmoid_forward: batching.elementwise,
    aten.fill: batching.elementwise,
}


# Layout rules (see stagetorch/ops/_layout.py). With a 0-dim tensor operand these meta kernels return a
# contiguous tensor where the kernel (a TensorIterator) keeps the other operand's layout; over operands laid
# out otherwise than each other (a contiguous gradient and a channels-last activation) the activations'
# backward kernels, xlogy and xlog1py lay theirs out as TensorIterator does (the first operand's layout
# first) where the meta kernels take the last operand's; log_sigmoid's CPU kernel returns both its outputs
# contiguous where its meta kernel keeps the input's strides.
LAYOUT: dict = {
    aten.copysign.Tensor: _layout.elementwise,
    aten.div.Tensor_mode: _layout.elementwise,
    aten.floor_divide.default: _layout.elementwise,
    aten.hardswish_backward: _layout.elementwise,
    aten.elu_backward: _layout.elementwise,
    aten.softplus_backward: _layout.elementwise,
    aten.hardtanh_backward: _layout.elementwise,
    aten.hardsigmoid_backward: _layout.elementwise,
    aten.logit_backward: _layout.elementwise,
    aten.xlogy.Tensor: _layout.elementwise,
    aten.special_xlog1py.default: _layout.elementwise,
    aten.log_sigmoid_forward: _layout.all_contiguous(2, devices=("cpu",)),
}


# The dtype a Python number an op wraps as a 0-dim tensor takes (bool first: it is an int too).
_WRAPPED = ((bool, torch.bool), (int, torch.int64), (float, torch.float64), (complex, torch.complex128))


def wrapped_number_workspace(position: int):  # noqa: ANN201
    """An op whose CPU kernel wraps the Python number at argument ``position`` as a 0-dim tensor and casts
    it to the result's dtype, both freed inside the call: ``pow`` of a number to tensor powers
    (``pow.Scalar``; ``_foreach_pow.ScalarAndTensor``) and ``rsub.Scalar`` (``1 - t``), an optimizer's bias
    corrections (``1 - beta ** step``). 12 B at the allocator for a float32 result (the double and its
    float32 copy), 8 B for a float64 one. Adam and AdamW stepped inside a step peaked there, 12 B over the
    plan, where the commit was the step's peak."""

    def rule(e: Eqn) -> int:
        number, out = e.args[position], e.outvars[0]
        if out is None or out.aval.device.type != "cpu":
            return 0
        wrapped = next((dtype for kind, dtype in _WRAPPED if isinstance(number, kind)), None)
        if wrapped is None:
            return 0
        return wrapped.itemsize + (0 if out.aval.dtype == wrapped else out.aval.itemsize)

    return rule


WORKSPACE: dict = {
    aten.pow.Scalar: wrapped_number_workspace(0),
    aten._foreach_pow.ScalarAndTensor: wrapped_number_workspace(0),
    aten.rsub.Scalar: wrapped_number_workspace(1),
}

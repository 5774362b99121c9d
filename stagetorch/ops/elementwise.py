"""Rules for the elementwise op family."""

from __future__ import annotations

import torch

from ..interpreters import batch_rules, batching, shape_rules
from ..ir import Aval, Eqn, Var
from . import layout_rules

aten = torch.ops.aten


def div(x: Aval, other: Aval | complex, *, rounding_mode: str | None = None) -> Aval:
    """True division makes integers float; floor and trunc division keep the operands' promoted dtype."""
    kind = shape_rules.Promotion.DEFAULT if rounding_mode else shape_rules.Promotion.INT_TO_FLOAT
    return shape_rules.broadcast("div", kind=kind)(x, other)


def where(cond: Aval, x: Aval, y: Aval) -> Aval:
    out = shape_rules.broadcast("where", tensors=3)(cond, x, y)
    return Aval(out.shape, shape_rules.result_dtype(x, y), out.device)


def masked_fill(x: Aval, mask: Aval, value: Aval | complex) -> Aval:
    """The mask broadcasts ``x`` out of place; the fill value never changes the dtype."""
    return Aval(shape_rules.broadcast_shapes("masked_fill", x, mask), x.dtype, x.device)


# Promotion kinds are torch's own, as its reference implementations (torch._refs) declare them.
_TO_FLOAT = shape_rules.Promotion.INT_TO_FLOAT

# Shape rules: op -> rule(*args with Avals, **kwargs) -> Aval | tuple[Aval, ...]
SHAPE: dict = {
    **{op: shape_rules.broadcast(op.__name__) for op in (
        aten.add, aten.sub, aten.mul, aten.rsub, aten.maximum, aten.minimum,
    )},
    aten.div: div,
    aten.pow: shape_rules.broadcast("pow", kind=shape_rules.Promotion.BOOL_TO_LONG),
    aten.where.self: where,
    aten.masked_fill: masked_fill,
    **{op: shape_rules.compare(op.__name__) for op in (aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge)},
    # Backward of an activation: shaped like the incoming gradient.
    **{op: shape_rules.broadcast(op.__name__) for op in (
        aten.threshold_backward, aten.gelu_backward, aten.tanh_backward, aten.sigmoid_backward,
        aten.silu_backward,
    )},
    # grad * mask * scale: a float scale makes an integer gradient float.
    aten.native_dropout_backward: shape_rules.broadcast("native_dropout_backward", tensors=3),
    **{op: shape_rules.broadcast(op.__name__, tensors=1, bool_ok=False) for op in (aten.relu, aten.gelu, aten.silu, aten.neg)},
    **{op: shape_rules.broadcast(op.__name__, tensors=1, kind=_TO_FLOAT) for op in (
        aten.tanh, aten.sigmoid, aten.exp, aten.log, aten.sqrt, aten.rsqrt,
    )},
    aten.abs: shape_rules.broadcast("abs", tensors=1, kind=shape_rules.Promotion.COMPLEX_TO_FLOAT, bool_ok=False),
    **{op: shape_rules.same(op.__name__) for op in (
        aten.clone, aten.detach, aten.alias, aten.fill, aten.copy_, aten.zero_, aten.fill_,
        aten.lift_fresh_copy,
    )},
    **{op: shape_rules.same(op.__name__, dtype_arg="dtype") for op in (
        aten._to_copy, aten.ones_like, aten.zeros_like, aten.empty_like, aten.full_like,
    )},
}


# Batch rules: op -> rule(eqn, label) -> Chunked (see stagetorch/interpreters/batching.py)
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
    **{op: batch_rules.same_in_every_chunk for op in (
        aten.new_empty_strided, aten.new_empty, aten.new_zeros, aten.new_ones, aten.new_full,
    )},
    aten.hardswish: batching.elementwise,
    # PReLU: the weight broadcasts over the channels; the backward's weight gradient is per element, summed after.
    aten._prelu_kernel: batching.elementwise,
    aten._prelu_kernel_backward: batching.elementwise,
    aten.log_sigmoid_forward: batching.elementwise,
    aten.fill: batching.elementwise,
}


# Layout rules (see stagetorch/ops/layout_rules.py). With a 0-dim tensor operand these meta kernels return a
# contiguous tensor where the kernel (a TensorIterator) keeps the other operand's layout; over operands laid
# out otherwise than each other (a contiguous gradient and a channels-last activation) the activations'
# backward kernels, xlogy and xlog1py lay theirs out as TensorIterator does (the first operand's layout
# first) where the meta kernels take the last operand's; log_sigmoid's CPU kernel returns both its outputs
# contiguous where its meta kernel keeps the input's strides.
LAYOUT: dict = {
    aten.copysign.Tensor: layout_rules.elementwise,
    aten.div.Tensor_mode: layout_rules.elementwise,
    aten.floor_divide.default: layout_rules.elementwise,
    aten.hardswish_backward: layout_rules.elementwise,
    aten.elu_backward: layout_rules.elementwise,
    aten.softplus_backward: layout_rules.elementwise,
    aten.hardtanh_backward: layout_rules.elementwise,
    aten.hardsigmoid_backward: layout_rules.elementwise,
    aten.logit_backward: layout_rules.elementwise,
    aten.xlogy.Tensor: layout_rules.elementwise,
    aten.special_xlog1py.default: layout_rules.elementwise,
    aten.log_sigmoid_forward: layout_rules.all_contiguous(2, devices=("cpu",)),
}


# The dtype a Python number an op wraps as a 0-dim tensor takes (bool first: it is an int too).
_WRAPPED = ((bool, torch.bool), (int, torch.int64), (float, torch.float64), (complex, torch.complex128))


def _wrapped_dtype(number: object) -> torch.dtype | None:
    return next((dtype for kind, dtype in _WRAPPED if isinstance(number, kind)), None)


def _wrapped_peak(tensors: list[Aval], number: object, kind: shape_rules.Promotion) -> int:
    """What one CPU TensorIterator call over ``tensors`` and the Python ``number`` allocates inside itself:
    the number wrapped as a 0-dim tensor, its cast to the common dtype where that differs, and a cast of
    each tensor of another dtype (an int64 tensor times 0.5 computes in float32)."""
    wrapped = _wrapped_dtype(number)
    if wrapped is None or not tensors or tensors[0].device.type != "cpu":
        return 0
    common = shape_rules.result_dtype(*tensors, number, kind=kind)
    casts = sum(t.numel * common.itemsize for t in tensors if t.dtype != common)
    return wrapped.itemsize + (0 if common == wrapped else common.itemsize) + casts


def _cast_peak(tensors: list[Aval], kind: shape_rules.Promotion, inplace: bool = False, compares: bool = False) -> int:
    """What one CPU TensorIterator call over tensors of more than one dtype allocates inside itself: a copy
    of each operand of another dtype than the one it computes in, at the operand's own shape (broadcast
    operands and 0-dim ones alike: an int64 mask times a float32 tensor casts the mask to float32). In place
    (``tensors[0]`` the output), where that dtype is not the output's (``bf16.add_(f32)`` computes in
    float32), the result is computed into a temporary of the computing dtype too, then copied back; a
    comparison in place (``compares``) writes a bool ``self`` directly. A true division or ``atan2`` of
    integers computes in float32: both operands are cast, even of one dtype."""
    if any(t.device.type != "cpu" for t in tensors):  # a CUDA kernel casts as it reads (a CPU scalar too)
        return 0
    common = shape_rules.result_dtype(*tensors, kind=kind)
    casts = sum(t.numel * common.itemsize for t in tensors if t.dtype != common)
    if inplace and tensors[0].dtype not in (common, *((torch.bool,) if compares else ())):
        casts += tensors[0].numel * common.itemsize
    return casts


def _inplace(e: Eqn) -> bool:
    return e.prim._schema.name.endswith("_")


_COMPARES = frozenset(("eq_", "ne_", "lt_", "gt_", "le_", "ge_"))


def _compares(e: Eqn) -> bool:
    """A comparison in place: its kernel writes a bool ``self`` directly (no temporary)."""
    return e.prim._schema.name.removeprefix("aten::") in _COMPARES


def mixed_dtype_workspace(positions: tuple[int, ...] = (0, 1), kind: shape_rules.Promotion = shape_rules.Promotion.DEFAULT):  # noqa: ANN201
    """A pointwise op over the tensors at ``positions`` (its promoting operands: not ``where``'s condition),
    whose CPU kernel casts each one of another dtype than the common one before computing
    (:func:`_cast_peak`): ``mask * x`` with an int64 or bool mask, ``x.eq(y)`` across dtypes,
    ``torch.where(c, f32, f64)``, ``torch.maximum(bf16, f32)``. Measured at the allocator
    (tests/ops/test_workspace.py); a comparison computes in the operands' common dtype (its output is bool).
    All of one dtype: 0."""

    def rule(e: Eqn) -> int:
        tensors = [e.args[i].aval for i in positions if i < len(e.args) and isinstance(e.args[i], Var)]
        return _cast_peak(tensors, kind, _inplace(e), _compares(e)) if tensors else 0

    return rule


def wrapped_number_workspace(position: int, kind: shape_rules.Promotion = shape_rules.Promotion.DEFAULT):  # noqa: ANN201
    """An op whose CPU kernel wraps the Python number at argument ``position`` as a 0-dim tensor and casts
    it to the computation's dtype, both freed inside the call (:func:`_wrapped_peak`): the arithmetic and
    comparison ops on a tensor and a number (``x * 2``, ``x + 1.5``, ``x / 3``, ``x > 0``, ``x.mul_(beta)``:
    the ``.Tensor`` overloads with a number for ``other``, and the ``.Scalar`` ones), ``pow`` of a number
    to tensor powers and ``rsub`` (``1 - t``), an optimizer's bias corrections (``1 - beta ** step``). 12 B
    at the allocator for a float32 tensor and a number (the int64 or double and its float32 copy), 8 B for
    float64 and a float. A ``_foreach_`` op runs once per tensor of its list (with its number of a list of
    numbers), each making its output: the most of those, less the outputs made after it. Where the argument
    is a tensor, nothing is wrapped: 0. Adam and AdamW stepped inside a step peaked at such an op, 12 B over
    the plan."""

    def rule(e: Eqn) -> int:
        number = e.args[position] if position < len(e.args) else None
        tensors = [a.aval for a in e.args if isinstance(a, Var)]
        lists = [a for a in e.args if isinstance(a, (list, tuple)) and a and isinstance(a[0], Var)]
        how = kind
        if e.prim in (aten.div.Tensor_mode, aten.div_.Tensor_mode, aten.div.Scalar_mode, aten.div_.Scalar_mode):
            how = shape_rules.Promotion.DEFAULT if e.kwargs.get("rounding_mode") else _TO_FLOAT
        if isinstance(number, Var) and not lists:  # a tensor, not a number: its casts across dtypes alone
            return _cast_peak(tensors, how, _inplace(e))
        if not lists:
            return _wrapped_peak(tensors, number, how)
        # One call per tensor, each making its output before the next: the outputs after a call's peak are
        # not there yet (the workspace is counted beside all of them).
        numbers = number if isinstance(number, (list, tuple)) else [number] * len(lists[0])
        outs = [v.aval.nbytes if v is not None else 0 for v in e.outvars]
        later = [sum(outs[i + 1:]) for i in range(len(numbers))]
        peaks = [_wrapped_peak([*tensors, *(vs[i].aval for vs in lists)], n, how) - later[i]
                 for i, n in enumerate(numbers)]
        return max([0, *peaks])

    return rule


# Measured at the allocator (tests/ops/test_workspace.py): these wrap a number; ``pow.Tensor_Scalar``, ``clamp``
# (both cast an integer ``self`` a float number promotes: number_cast_workspace), ``masked_fill``, ``fill_``,
# ``lerp``, ``addcmul``/``addcdiv`` (their ``value``), ``hardtanh``, ``threshold``, ``leaky_relu`` and
# ``_foreach_pow.Scalar`` take theirs as a number inside the kernel.
_WRAPS_OTHER = (
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.add_.Tensor, aten.sub_.Tensor, aten.mul_.Tensor,
    aten.add.Scalar, aten.sub.Scalar, aten.mul.Scalar, aten.add_.Scalar, aten.sub_.Scalar, aten.mul_.Scalar,
    aten.rsub.Scalar, aten.div.Tensor_mode, aten.div_.Tensor_mode, aten.div.Scalar_mode, aten.div_.Scalar_mode,
    aten.remainder.Scalar, aten.remainder_.Scalar, aten.fmod.Scalar, aten.fmod_.Scalar, aten.floor_divide.Scalar,
    aten.floor_divide_.Scalar, aten.bitwise_and.Scalar, aten.bitwise_or.Scalar, aten.bitwise_xor.Scalar,
    aten.eq.Scalar, aten.ne.Scalar, aten.lt.Scalar, aten.gt.Scalar, aten.le.Scalar, aten.ge.Scalar,
    aten._foreach_add.Scalar, aten._foreach_sub.Scalar, aten._foreach_mul.Scalar, aten._foreach_add_.Scalar,
    aten._foreach_sub_.Scalar, aten._foreach_mul_.Scalar, aten._foreach_add.ScalarList,
    aten._foreach_sub.ScalarList, aten._foreach_mul.ScalarList, aten._foreach_add_.ScalarList,
    aten._foreach_sub_.ScalarList, aten._foreach_mul_.ScalarList,
)
# True division and the float-valued ops compute integers in the default float dtype.
_WRAPS_OTHER_TO_FLOAT = (
    aten.div.Tensor, aten.div_.Tensor, aten.div.Scalar, aten.div_.Scalar,
    aten.copysign.Scalar, aten.xlogy.Scalar_Other, aten.special_xlog1py.other_scalar,
    aten._foreach_div.Scalar, aten._foreach_div_.Scalar, aten._foreach_div.ScalarList, aten._foreach_div_.ScalarList,
)


def number_cast_workspace(positions: tuple[int, ...], kind: shape_rules.Promotion = shape_rules.Promotion.DEFAULT):  # noqa: ANN201
    """An op that reads the Python numbers at ``positions`` inside its kernel (nothing wrapped) but computes
    in the dtype they promote its tensor ``self`` to: the CPU kernel casts ``self`` first. An int64 or bool
    tensor ``** 0.5`` or clamped to ``0.5`` computes in float32 (a float32 copy of it), a bool tensor ``** 2``
    in int64; a float tensor: 0. Measured at the allocator (tests/ops/test_workspace.py)."""

    def rule(e: Eqn) -> int:
        x = e.args[0]
        if not isinstance(x, Var) or x.aval.device.type != "cpu":
            return 0
        numbers = [e.args[i] for i in positions if i < len(e.args) and _wrapped_dtype(e.args[i]) is not None]
        common = shape_rules.result_dtype(x.aval, *numbers, kind=kind)
        return 0 if common == x.aval.dtype else x.aval.numel * common.itemsize

    return rule


# Ops on two tensors (beside those above, whose tensor ``other`` takes _cast_peak), measured at the allocator:
# each casts an operand of another dtype to the common one. ``masked_fill`` (its value read as a number),
# ``copy_`` (casts element by element) and ``lerp`` (one dtype only) allocate none.
_CASTS = (
    aten.eq.Tensor, aten.ne.Tensor, aten.lt.Tensor, aten.gt.Tensor, aten.le.Tensor, aten.ge.Tensor,
    aten.eq_.Tensor, aten.ne_.Tensor, aten.lt_.Tensor, aten.gt_.Tensor, aten.le_.Tensor, aten.ge_.Tensor,
    aten.maximum.default, aten.minimum.default, aten.fmax.default, aten.fmin.default,
    aten.remainder.Tensor, aten.remainder_.Tensor, aten.fmod.Tensor, aten.fmod_.Tensor,
    aten.floor_divide.default, aten.floor_divide_.Tensor, aten.rsub.Tensor,
    aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.bitwise_xor.Tensor,
    aten.logical_and.default, aten.logical_or.default, aten.logical_xor.default,
)
_CASTS_TO_FLOAT = (
    aten.atan2.default, aten.atan2_.default, aten.hypot.default, aten.xlogy.Tensor, aten.copysign.Tensor,
    aten.special_xlog1py.default,
)

WORKSPACE: dict = {
    **{op: wrapped_number_workspace(1) for op in _WRAPS_OTHER},
    **{op: wrapped_number_workspace(1, _TO_FLOAT) for op in _WRAPS_OTHER_TO_FLOAT},
    aten.pow.Scalar: wrapped_number_workspace(0, shape_rules.Promotion.BOOL_TO_LONG),
    aten._foreach_pow.ScalarAndTensor: wrapped_number_workspace(0, shape_rules.Promotion.BOOL_TO_LONG),
    aten.remainder.Scalar_Tensor: wrapped_number_workspace(0),
    aten.xlogy.Scalar_Self: wrapped_number_workspace(0, _TO_FLOAT),
    aten.special_xlog1py.self_scalar: wrapped_number_workspace(0, _TO_FLOAT),
    **{op: mixed_dtype_workspace() for op in _CASTS},
    **{op: mixed_dtype_workspace(kind=_TO_FLOAT) for op in _CASTS_TO_FLOAT},
    aten.pow.Tensor_Tensor: mixed_dtype_workspace(kind=shape_rules.Promotion.BOOL_TO_LONG),
    aten.pow_.Tensor: mixed_dtype_workspace(kind=shape_rules.Promotion.BOOL_TO_LONG),
    aten.where.self: mixed_dtype_workspace((1, 2)),
    aten.pow.Tensor_Scalar: number_cast_workspace((1,)),  # bool ** True stays bool
    aten.clamp.default: number_cast_workspace((1, 2)),
    aten.clamp_min.default: number_cast_workspace((1,)),
    aten.clamp_max.default: number_cast_workspace((1,)),
    aten.addcmul.default: mixed_dtype_workspace((0, 1, 2)),
    aten.addcmul_.default: mixed_dtype_workspace((0, 1, 2)),
    aten.addcdiv.default: mixed_dtype_workspace((0, 1, 2)),
    aten.addcdiv_.default: mixed_dtype_workspace((0, 1, 2)),
}

"""Rules for the norms op family."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .. import batching
from ..batching import Chunked, LabelFn, coupling, per_example
from ..errors import ShapeError
from ..ir import Aval, Eqn
from . import _layout

aten = torch.ops.aten


def layer_norm(x: Aval, shape, weight, bias, eps):  # noqa: ANN001, ANN201
    k = len(shape)
    if tuple(x.shape[x.ndim - k :]) != tuple(shape):
        raise ShapeError(f"aten.native_layer_norm: normalized_shape {list(shape)} does not end input {x}")
    # Statistics of half-precision inputs are kept in float32, except by the CPU kernel (its meta kernel says
    # float32 there too; stagetorch follows what the kernel really returns).
    low_precision = x.dtype in (torch.float16, torch.bfloat16) and x.device.type != "cpu"
    stats = Aval(x.shape[: x.ndim - k] + (1,) * k, torch.float32 if low_precision else x.dtype, x.device)
    return x, stats, stats


def batch_norm(x: Aval, weight, bias, running_mean, running_var, training, momentum, eps):  # noqa: ANN001, ANN201
    """(out, save_mean, save_invstd). The CPU kernel saves no statistics in eval mode: empty tensors (its
    meta kernel says (C,), but stagetorch follows what the kernel really returns)."""
    if x.ndim < 2:
        raise ShapeError(f"aten.native_batch_norm: expects at least 2 dims, got {x}")
    channels = x.shape[1] if training or x.device.type != "cpu" else 0
    stats = Aval((channels,), x.dtype, x.device)
    return x, stats, stats


def group_norm(x: Aval, weight, bias, n, c, hw, groups, eps):  # noqa: ANN001, ANN201
    if c % groups:
        raise ShapeError(f"aten.native_group_norm: {c} channels do not split into {groups} groups")
    stats = Aval((n, groups), x.dtype, x.device)
    return x, stats, stats

# Batch rules for this family's ops (see stagetorch/batching.py).

def batch_norm_batch_rule(*, training_arg: int | None, outputs: Sequence[str | None]) -> Callable[[Eqn, LabelFn], Chunked]:
    """Batch norm: exact per chunk in eval mode (running statistics); training couples the examples."""
    inner = per_example(outputs=outputs)

    def rule(eqn: Eqn, label: LabelFn) -> Chunked:
        if training_arg is not None and eqn.args[training_arg]:
            raise coupling(
                eqn,
                "normalises with statistics of the whole batch (BatchNorm in training mode)",
                "use GroupNorm or LayerNorm, put the BatchNorm layers in eval mode (model.eval()), or run "
                "without chunking (a larger memory_budget)",
            )
        return inner(eqn, label)

    return rule


# Shape rules: op -> rule(*args with Avals, **kwargs) -> Aval | tuple[Aval, ...]
SHAPE: dict = {
    aten.native_batch_norm: batch_norm,
    aten._native_batch_norm_legit: batch_norm,
    aten.native_layer_norm: layer_norm,
    aten.native_layer_norm_backward: lambda grad, x, shape, mean, rstd, w, b, mask: tuple(
        a if m else None for a, m in zip((x, w, b), mask)
    ),
    aten.native_group_norm: group_norm,
    aten.native_group_norm_backward: lambda grad, x, mean, rstd, w, n, c, hw, groups, mask: tuple(
        a if m else None for a, m in zip((x, w, Aval((c,), x.dtype, x.device) if w is not None else None), mask)
    ),
}


# Batch rules: op -> rule(eqn, label) -> Chunked (see stagetorch/batching.py)
BATCH: dict = {
    aten.native_layer_norm: batching.per_example(outputs=("b", "b", "b")),
    aten.native_layer_norm_backward: batching.per_example(outputs=("b", "sum", "sum")),
    # N, the batch size, is an argument of group norm and its backward.
    aten.native_group_norm: batching.per_example(outputs=("b", "b", "b"), batch_size_args=(3,)),
    aten.native_group_norm_backward: batching.per_example(outputs=("b", "sum", "sum"), batch_size_args=(5,)),
    aten.native_batch_norm: batch_norm_batch_rule(training_arg=5, outputs=("b", None, None)),
    aten._native_batch_norm_legit_no_training: batch_norm_batch_rule(training_arg=None, outputs=("b", None, None)),
    aten._native_batch_norm_legit: batch_norm_batch_rule(training_arg=5, outputs=("b", None, None)),
    aten.native_batch_norm_backward: batch_norm_batch_rule(training_arg=7, outputs=("b", "sum", "sum")),
    aten.cudnn_batch_norm: batch_norm_batch_rule(training_arg=5, outputs=("b", None, None, None)),
    aten.miopen_batch_norm: batch_norm_batch_rule(training_arg=5, outputs=("b", None, None)),
}


# Layout rules: op -> rule(*args as the tracer holds them) -> the real kernel's strides per output (see
# stagetorch/ops/_layout.py). Batch norm's kernels allocate their output (the backward: the input's
# gradient) dense in the input's suggested memory format; its meta kernels keep the input's strides, so a
# BatchNorm1d over a transposed input would be traced as a transposed output. The backward's meta kernels
# also make the input's gradient when the output mask leaves it out (an input that needs no gradient):
# the kernel returns none, and a trace holding one costed a whole activation too many.
LAYOUT: dict = {
    **{op: _layout.in_input_format(0) for op in (
        aten.native_batch_norm, aten._native_batch_norm_legit, aten._native_batch_norm_legit_no_training,
        aten._batch_norm_with_update, aten._batch_norm_no_update,
    )},
    aten.native_batch_norm_backward: _layout.in_input_format(1, mask=9),
    aten.batch_norm_backward: _layout.in_input_format(1, mask=9),
}


# Workspace rules: op -> rule(eqn) -> bytes the kernel allocates inside itself (see stagetorch/costing.py).
# The CPU batch norm backward keeps an input-sized temporary, whatever the mask or mode (measured at the
# allocator: tests/test_workspace.py).
# The group norm backward, two floats per (example, channel).
WORKSPACE: dict = {
    aten.native_batch_norm_backward: lambda e: e.args[1].aval.nbytes if e.args[1].aval.device.type == "cpu" else 0,
    aten.native_group_norm_backward: lambda e: 8 * e.args[5] * e.args[6] if e.args[1].aval.device.type == "cpu" else 0,
}

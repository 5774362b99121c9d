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


def _batch_norm_cpu(x: Aval) -> tuple[int, int, int, int, bool]:
    """(channels, rows per channel, bytes of an element, of an accumulator, whether the kernel takes the
    "channels last" path) of a CPU batch norm over ``x``. ATen's CPU kernels (batch_norm_kernel.cpp) take
    that path for an input with one value per (example, channel) — BatchNorm1d over (N, C) — and reduce it
    through per-thread buffers of C accumulators. Half-precision inputs accumulate in float32."""
    c = x.shape[1]
    rows = x.numel // c if c else 0
    size = x.dtype.itemsize
    acc = 4 if x.dtype in (torch.float16, torch.bfloat16) else size
    return c, rows, size, acc, rows == x.shape[0]


def batch_norm_workspace(e: Eqn, training_arg: int | None) -> int:
    """The CPU forward: the per-channel scale and shift (2 x C accumulators); in training over (N, C), the
    statistics' per-thread buffers (T x C, where there are more rows than threads; half precision: T - 1
    buffers of float32, whatever the rows). A channels-last input of more dims takes that path too; the IR
    does not show it (its buffers are at most a few C)."""
    x = e.args[0].aval
    if x.device.type != "cpu" or x.numel == 0:
        return 0
    c, rows, size, acc, by_channel = _batch_norm_cpu(x)
    training = training_arg is not None and bool(e.args[training_arg])
    threads = torch.get_num_threads()
    buffers = 0
    if training and by_channel:
        if acc != size:
            buffers = (threads - 1) * c * acc
        elif rows > threads:
            buffers = threads * c * acc
    return 2 * c * acc + buffers


def batch_norm_backward_workspace(e: Eqn) -> int:
    """The CPU backward first makes and frees an input-sized temporary, whatever the mask or mode; over (N,
    C) it then reduces through two per-thread buffers of C accumulators (2 x T x C), with the inverse
    standard deviations in eval mode and ones for a missing weight (C each; half precision: 3 x C float32
    whatever the mode). The larger of the two is the kernel's peak (measured at the allocator:
    tests/test_workspace.py)."""
    x = e.args[1].aval
    if x.device.type != "cpu":
        return 0
    if x.numel == 0:
        return 0
    c, _, size, acc, by_channel = _batch_norm_cpu(x)
    if not by_channel:
        return x.nbytes
    buffers = 2 * torch.get_num_threads() * c * acc
    if acc != size:
        buffers += 3 * c * acc
    else:
        buffers += (0 if e.args[7] else c * acc) + (c * acc if e.args[2] is None else 0)
    return max(x.nbytes, buffers)


# Workspace rules: op -> rule(eqn) -> bytes the kernel allocates inside itself (see stagetorch/costing.py).
# The group norm backward, two floats per (example, channel).
WORKSPACE: dict = {
    aten.native_batch_norm: lambda e: batch_norm_workspace(e, 5),
    aten._native_batch_norm_legit: lambda e: batch_norm_workspace(e, 3 if len(e.args) == 6 else 5),  # .no_stats
    aten._native_batch_norm_legit_no_training: lambda e: batch_norm_workspace(e, None),
    aten.native_batch_norm_backward: batch_norm_backward_workspace,
    aten.native_group_norm_backward: lambda e: 8 * e.args[5] * e.args[6] if e.args[1].aval.device.type == "cpu" else 0,
}

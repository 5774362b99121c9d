"""Rules for the norms op family."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from ..errors import BatchStatisticsError, ShapeError
from ..interpreters import batch_rules
from ..interpreters.batch_rules import per_example
from ..interpreters.batching import Batched, Chunked, LabelFn, coupling
from ..ir import Aval, Eqn, Var
from . import layout_rules

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

# Batch rules for this family's ops (see stagetorch/interpreters/batching.py).

def _instance_norm(eqn: Eqn, label: LabelFn) -> Chunked | None:
    """Batch norm over a batch merged into its channels (``F.instance_norm`` views (B, C, L) as (1, B*C, L)):
    each channel's statistics are one example's, so it is per example, its saved statistics per example too.
    Only without running statistics or a weight (instance_norm's are repeated per example); else None."""
    backward = getattr(eqn.prim, "overloadpacket", eqn.prim) is aten.native_batch_norm_backward
    x = eqn.args[1] if backward else eqn.args[0]
    lab = label(x)
    if not isinstance(lab, Batched) or lab.dim != 1 or lab.outer != 1 or x.aval.shape[0] != 1:
        return None
    if any(isinstance(a, Var) for a in eqn.args[(2 if backward else 1) : 5]):
        return None
    stats = Batched(0, lab.k, 1)
    if backward:
        if any(label(v) != stats for v in eqn.args[5:7]):
            return None
        return Chunked(tuple(lab if j == 0 and v is not None else None for j, v in enumerate(eqn.outvars)))
    return Chunked(tuple(None if v is None else (lab if j == 0 else stats) for j, v in enumerate(eqn.outvars)))


def batch_norm_batch_rule(*, training_arg: int | None, outputs: Sequence[str | None]) -> Callable[[Eqn, LabelFn], Chunked]:
    """Batch norm: exact per chunk in eval mode (running statistics); training couples the examples."""
    inner = per_example(outputs=outputs)

    def rule(eqn: Eqn, label: LabelFn) -> Chunked:
        if training_arg is not None and eqn.args[training_arg] and (own := _instance_norm(eqn, label)) is not None:
            return own
        if training_arg is not None and eqn.args[training_arg]:
            # Named apart so that the planner can say, at a budget below every schedule, what does run.
            error = BatchStatisticsError(*coupling(
                eqn,
                "normalises with statistics of the whole batch (BatchNorm in training mode)",
                "use GroupNorm or LayerNorm, put the BatchNorm layers in eval mode (model.eval()), or run "
                "without chunking (a larger memory_budget)",
            ).args)
            error.source = str(eqn.source)
            raise error
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


# Batch rules: op -> rule(eqn, label) -> Chunked (see stagetorch/interpreters/batching.py)
BATCH: dict = {
    aten.native_layer_norm: batch_rules.per_example(outputs=("b", "b", "b")),
    aten.native_layer_norm_backward: batch_rules.per_example(outputs=("b", "sum", "sum")),
    # N, the batch size, is an argument of group norm and its backward.
    aten.native_group_norm: batch_rules.per_example(outputs=("b", "b", "b"), batch_size_args=(3,)),
    aten.native_group_norm_backward: batch_rules.per_example(outputs=("b", "sum", "sum"), batch_size_args=(5,)),
    aten.native_batch_norm: batch_norm_batch_rule(training_arg=5, outputs=("b", None, None)),
    aten._native_batch_norm_legit_no_training: batch_norm_batch_rule(training_arg=None, outputs=("b", None, None)),
    aten._native_batch_norm_legit: batch_norm_batch_rule(training_arg=5, outputs=("b", None, None)),
    aten.native_batch_norm_backward: batch_norm_batch_rule(training_arg=7, outputs=("b", "sum", "sum")),
    aten.cudnn_batch_norm: batch_norm_batch_rule(training_arg=5, outputs=("b", None, None, None)),
    aten.miopen_batch_norm: batch_norm_batch_rule(training_arg=5, outputs=("b", None, None)),
}


# Layout rules: op -> rule(*args as the tracer holds them) -> the real kernel's strides per output (see
# stagetorch/ops/layout_rules.py). Batch norm's kernels allocate their output (the backward: the input's
# gradient) dense in the input's suggested memory format; its meta kernels keep the input's strides, so a
# BatchNorm1d over a transposed input would be traced as a transposed output. The backward's meta kernels
# also make the input's gradient when the output mask leaves it out (an input that needs no gradient):
# the kernel returns none, and a trace holding one costed a whole activation too many.
LAYOUT: dict = {
    **{op: layout_rules.in_input_format(0) for op in (
        aten.native_batch_norm, aten._native_batch_norm_legit, aten._native_batch_norm_legit_no_training,
        aten._batch_norm_with_update, aten._batch_norm_no_update,
    )},
    aten.native_batch_norm_backward: layout_rules.in_input_format(1, mask=9),
    # Group norm's output, over a channels-last batch of one: the meta kernel gives the batch dim a stride
    # of C (8, 1, 96, 8), the kernel the dense one (1152, 1, 96, 8); its suggested format then differs.
    aten.native_group_norm: layout_rules.in_input_format(0),
    aten.batch_norm_backward: layout_rules.in_input_format(1, mask=9),
}


def _batch_norm_cpu(v: object, layouts) -> tuple[int, int, int, int, bool, bool]:  # noqa: ANN001
    """(channels, rows per channel, bytes of an element, of an accumulator, whether the kernel takes the
    "channels last" path, whether the input is dense in a layout the kernels know) of a CPU batch norm over
    ``v``. ATen's CPU kernels (batch_norm_kernel.cpp) take that path for an input with one value per
    (example, channel) — BatchNorm1d over (N, C) — or laid out channels-last (the IR's layouts show it:
    stagetorch.interpreters.memory.Layouts), and reduce it through per-thread buffers of C accumulators; an input
    neither contiguous nor channels-last (BatchNorm1d over a transposed activation) runs the generic
    TensorIterator path. Half-precision inputs accumulate in float32. Unknown strides: contiguous."""
    x = v.aval
    c = x.shape[1]
    rows = x.numel // c if c else 0
    size = x.dtype.itemsize
    acc = 4 if x.dtype in (torch.float16, torch.bfloat16) else size
    strides = layout_rules.strides_of(v, layouts)
    contiguous = strides is None or bool(layout_rules.dense_in(x.shape, strides, torch.contiguous_format))
    channels_last = not contiguous and x.ndim in (4, 5) and layout_rules.suggested(v, layouts) in layout_rules.CHANNELS_LAST and bool(
        layout_rules.dense_in(x.shape, strides, torch.channels_last if x.ndim == 4 else torch.channels_last_3d))
    return c, rows, size, acc, rows == x.shape[0] or channels_last, contiguous or channels_last


def batch_norm_workspace(e: Eqn, training_arg: int | None, layouts=None) -> int:  # noqa: ANN001
    """The CPU forward: the per-channel scale and shift (2 x C accumulators); in training over (N, C) or a
    channels-last input, the statistics' per-thread buffers (T x C, where there are more rows than threads;
    half precision: T - 1 buffers of float32, whatever the rows). Over an input laid out otherwise, one
    accumulator."""
    x = e.args[0].aval
    if x.device.type != "cpu" or x.numel == 0:
        return 0
    c, rows, size, acc, by_channel, dense = _batch_norm_cpu(e.args[0], layouts or _no_layouts)
    if not dense:
        return acc
    training = training_arg is not None and bool(e.args[training_arg])
    threads = torch.get_num_threads()
    buffers = 0
    if training and by_channel:
        if acc != size:
            buffers = (threads - 1) * c * acc
        elif rows > threads:
            buffers = threads * c * acc
    return 2 * c * acc + buffers


def batch_norm_backward_workspace(e: Eqn, layouts=None) -> int:  # noqa: ANN001
    """The CPU backward, where the input and the output gradient are both contiguous or both channels-last,
    first makes and frees an input-sized temporary, whatever the mask or mode; over (N, C) or channels-last
    it then reduces through two per-thread buffers of C accumulators (2 x T x C), with the inverse standard
    deviations in eval mode and ones for a missing weight (C each; half precision: 3 x C float32 whatever
    the mode). The larger of the two is the kernel's peak (measured at the allocator:
    tests/ops/test_workspace.py). Laid out otherwise than each other (a contiguous gradient reaching a
    channels-last activation's BatchNorm, a transposed BatchNorm1d input), the generic path keeps C
    accumulators."""
    x = e.args[1].aval
    if x.device.type != "cpu":
        return 0
    if x.numel == 0:
        return 0
    layouts = layouts or _no_layouts
    c, _, size, acc, by_channel, _ = _batch_norm_cpu(e.args[1], layouts)
    if not _both_dense(layouts, e.args[1], e.args[0]):
        return c * acc
    if not by_channel:
        return x.nbytes
    buffers = 2 * torch.get_num_threads() * c * acc
    if acc != size:
        buffers += 3 * c * acc
    else:
        buffers += (0 if e.args[7] else c * acc) + (c * acc if e.args[2] is None else 0)
    return max(x.nbytes, buffers)


def _no_layouts(v: object) -> None:
    return None


def _both_dense(layouts, x, grad) -> bool:  # noqa: ANN001
    """The input and the output gradient both contiguous, or both channels-last (unknown strides: so)."""
    xs, gs = layout_rules.strides_of(x, layouts), layout_rules.strides_of(grad, layouts)
    if xs is None or gs is None:
        return True
    formats = [torch.contiguous_format]
    if x.aval.ndim in (4, 5):
        formats.append(torch.channels_last if x.aval.ndim == 4 else torch.channels_last_3d)
    return any(layout_rules.dense_in(x.aval.shape, xs, f) and layout_rules.dense_in(grad.aval.shape, gs, f) for f in formats)


def group_norm_workspace(e: Eqn, layouts) -> int:  # noqa: ANN001
    """The CPU group norm forward over a channels-last input: two numbers per (example, channel)."""
    x = e.args[0]
    if x.aval.device.type != "cpu":
        return 0
    fmt = layout_rules.suggested(x, layouts)
    return 2 * e.args[3] * e.args[4] * x.aval.itemsize if fmt is None or fmt in layout_rules.CHANNELS_LAST else 0


def _copied_contiguous(v: object, layouts) -> int:  # noqa: ANN001
    """The bytes ``.contiguous()`` of ``v`` copies (unknown strides: copied)."""
    return 0 if layout_rules.dense_in(v.aval.shape, layout_rules.strides_of(v, layouts), torch.contiguous_format) else v.aval.nbytes


def layer_norm_workspace(e: Eqn, layouts) -> int:  # noqa: ANN001
    """The CPU layer norm forward makes its input contiguous: a copy of one laid out otherwise (a LayerNorm
    over a transposed activation)."""
    x = e.args[0]
    return _copied_contiguous(x, layouts) if x.aval.device.type == "cpu" else 0


def layer_norm_backward_workspace(e: Eqn, layouts) -> int:  # noqa: ANN001
    """The CPU layer norm backward makes the output gradient and the input contiguous (a copy of each laid
    out otherwise) and, for the weight's or the bias's gradient, reduces through two per-thread buffers of
    the normalized shape's size, in the accumulation type."""
    grad, x, shape = e.args[0], e.args[1], e.args[2]
    if x.aval.device.type != "cpu":
        return 0
    mask = e.args[7]
    size = math.prod(shape)
    rows = x.aval.numel // size if size else 0
    acc = 4 if x.aval.dtype in (torch.float16, torch.bfloat16) else x.aval.itemsize
    buffers = 2 * min(torch.get_num_threads(), max(rows, 1)) * size * acc if (mask[1] or mask[2]) and e.args[5] is not None else 0
    return _copied_contiguous(grad, layouts) + _copied_contiguous(x, layouts) + buffers


def _reading_layouts(rule):  # noqa: ANN001, ANN202
    rule.reads_layouts = True
    return rule


# Workspace rules: op -> rule(eqn[, layouts]) -> bytes the kernel allocates inside itself (see
# stagetorch/interpreters/memory.py).
WORKSPACE: dict = {
    aten.native_batch_norm: _reading_layouts(lambda e, layouts: batch_norm_workspace(e, 5, layouts)),
    aten._native_batch_norm_legit: _reading_layouts(  # .no_stats has no running statistics
        lambda e, layouts: batch_norm_workspace(e, 3 if len(e.args) == 6 else 5, layouts)),
    aten._native_batch_norm_legit_no_training: _reading_layouts(lambda e, layouts: batch_norm_workspace(e, None, layouts)),
    aten.native_batch_norm_backward: _reading_layouts(batch_norm_backward_workspace),
    aten.native_group_norm: _reading_layouts(group_norm_workspace),
    aten.native_layer_norm: _reading_layouts(layer_norm_workspace),
    aten.native_layer_norm_backward: _reading_layouts(layer_norm_backward_workspace),
    # The group norm backward: two numbers per (example, channel), in the input's dtype.
    aten.native_group_norm_backward: lambda e: 2 * e.args[5] * e.args[6] * e.args[1].aval.itemsize if e.args[1].aval.device.type == "cpu" else 0,
}

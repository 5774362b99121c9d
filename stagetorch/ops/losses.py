"""Rules for the losses op family."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import attrs
import torch

from ..errors import ShapeError, UnsupportedOpError
from ..interpreters import shape_rules
from ..interpreters.batching import Batched, Chunked, Global, LabelFn, Prepass, Reduced, coupling, elementwise
from ..interpreters.memory import MemoryEffect
from ..ir import Aval, Eqn, Var, op_name
from ..registry import slot
from .reductions import mean_bytes, partials_bytes

aten = torch.ops.aten


def nll_loss_forward(x: Aval, target: Aval, weight: Aval | None, reduction: int, ignore_index: int) -> tuple[Aval, Aval]:
    """(N, C) log-probabilities against (N,) class indices; or (C,) against ()."""
    if x.ndim not in (1, 2) or target.ndim != x.ndim - 1 or (x.ndim == 2 and target.shape[0] != x.shape[0]):
        raise ShapeError(f"aten.nll_loss_forward: input {x} and target {target} do not line up")
    out = (x.shape[0],) if reduction == 0 and x.ndim == 2 else ()
    return Aval(out, x.dtype, x.device), Aval((), x.dtype, x.device)

# Batch rules for this family's ops (see stagetorch/interpreters/batching.py).

_NONE, _MEAN, _SUM = 0, 1, 2  # at::Reduction


def _as_chunk_sum(eqn: Eqn, reduction_arg: int, reduction: int, count: int) -> Callable[[int], tuple[Any, tuple, dict]]:
    """A chunk's call of a reduced loss: its ``reduction`` set to ``sum``, and a ``mean`` divided by the whole
    batch's ``count`` (exact: the chunks' sums add up to the batch's)."""

    def call(n: int) -> tuple[Any, tuple, dict]:
        args, kwargs = list(eqn.args), dict(eqn.kwargs)
        if len(args) > reduction_arg:
            args[reduction_arg] = _SUM
        else:
            kwargs["reduction"] = _SUM
        return (eqn.prim if reduction == _SUM else _divided(eqn.prim, count)), tuple(args), kwargs

    return call


def reduction_loss(*, reduction_arg: int, backward: bool = False) -> Callable[[Eqn, LabelFn], Chunked]:
    """Losses with a ``reduction`` argument (mse, smooth_l1, huber, bce...), forward or backward.

    ``mean`` is rewritten as the chunk's ``sum`` divided by the full batch's element count, which is exact.
    """

    def rule(eqn: Eqn, label: LabelFn) -> Chunked:
        reduction = eqn.args[reduction_arg] if len(eqn.args) > reduction_arg else eqn.kwargs.get("reduction", _MEAN)
        inner = elementwise(eqn, label)
        lab = inner.out[0]
        if reduction == _NONE:
            return inner
        x = eqn.args[1] if backward else eqn.args[0]
        call = _as_chunk_sum(eqn, reduction_arg, reduction, x.aval.numel)

        if backward:
            return Chunked((lab,), call=call, slice=inner.slice)
        return Chunked((Reduced("sum"),), call=call, slice=inner.slice)

    return rule


class _Divided:
    """``prim(*args) / count``: a ``mean`` loss run on a chunk as the chunk's ``sum`` divided by the whole
    batch's element count (a backward's gradient likewise). It answers for its own workspace rule (the registry
    asks :meth:`stagetorch_rule`): the op's for a sum, plus the undivided result, freed once divided (with the
    storage a reduced loss keeps: :data:`_KEEPS_UNREDUCED`), and the division's number, wrapped as a 0-dim
    int64 tensor."""

    def __init__(self, prim: Any, count: int):
        self.prim, self.count = prim, count
        self.__name__ = f"{getattr(prim, '__name__', 'op')}_sum_over_{count}"

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.prim(*args, **kwargs) / self.count

    def __repr__(self) -> str:
        return self.__name__

    def stagetorch_rule(self, name: str) -> Callable[..., Any] | None:
        return self._workspace if name == "workspace" else None

    def _workspace(self, e: Eqn) -> int:
        inner, kept = slot(self.prim, "workspace"), slot(self.prim, "memory")
        out = e.outvars[0].aval
        undivided = kept(e).outputs.get(0, out.nbytes) if kept is not None else out.nbytes
        # The op's workspace is gone when the division makes the output: the larger of the two moments.
        return undivided + max((inner(e) if inner is not None else 0) - out.nbytes, 8 if out.device.type == "cpu" else 0)


def _divided(prim: Any, count: int) -> _Divided:
    return _Divided(prim, count)


# What the CPU loss kernels allocate (ATen's Loss.cpp and its structured kernels, torch 2.13; measured at the
# allocator: tests/ops/test_workspace.py). A reduced loss first computes the unreduced one, a tensor of the operands'
# broadcast shape ("unreduced" below), then reduces it (:func:`mean_bytes`, :func:`partials_bytes`).

def _reduction(e: Eqn, arg: int) -> int:
    return e.args[arg] if len(e.args) > arg else e.kwargs.get("reduction", _MEAN)


def _unreduced(e: Eqn) -> tuple[int, int]:
    """(elements, bytes) of the unreduced loss of ``e``'s first two operands, in the output's dtype."""
    x, y = e.args[0].aval, e.args[1].aval
    numel = math.prod(shape_rules.broadcast_shapes(op_name(e.prim), x, y))
    return numel, numel * e.outvars[0].aval.itemsize


def _reduced(reduction: int, numel: int, itemsize: int) -> int:
    if reduction == _NONE:
        return 0
    return (mean_bytes if reduction == _MEAN else partials_bytes)(numel, 1, itemsize)


def _casts(e: Eqn) -> int:
    """Bytes of the operands a CPU TensorIterator copies into the result's dtype (it casts by copying)."""
    dtype = e.outvars[0].aval.dtype
    return sum(a.aval.numel * dtype.itemsize for a in e.args[:2] if a.aval.dtype != dtype)


def loss_workspace(reduction_arg: int, kind: str) -> Callable[[Eqn], int]:
    """The workspace rule of a CPU loss kernel over operands 0 and 1, reduced per argument ``reduction_arg``.

    ``kind``: ``"structured"`` (mse, smooth_l1: the output is made at the unreduced shape and resized to 0-dim,
    keeping its storage, see :data:`_KEEPS_UNREDUCED`; the unreduced loss is a second tensor, and the operands
    are cast once per TensorIterator, two when reduced); ``"fresh"`` (huber: the unreduced loss, then its
    reduction in a new tensor); ``"in_place"`` (binary_cross_entropy, soft_margin_loss: the loss is computed
    in the output, whose storage keeps it, and the reduction copied in); ``"logits"``
    (binary_cross_entropy_with_logits: two tensors of the unreduced shape at once beside the loss)."""

    def rule(e: Eqn) -> int:
        if e.outvars[0].aval.device.type != "cpu":
            return 0
        reduction = _reduction(e, reduction_arg)
        numel, nbytes = _unreduced(e)
        itemsize = e.outvars[0].aval.itemsize
        reduced = _reduced(reduction, numel, itemsize)
        if kind == "structured":
            return _casts(e) * (1 if reduction == _NONE else 2) + (0 if reduction == _NONE else nbytes + reduced)
        if kind == "fresh":
            return 0 if reduction == _NONE else nbytes + reduced
        if kind == "in_place":
            return 0 if reduction == _NONE else itemsize + reduced
        return nbytes if reduction == _NONE else 2 * nbytes + reduced

    return rule


def keeps_unreduced(reduction_arg: int) -> Callable[[Eqn], MemoryEffect]:
    """The memory rule of a CPU loss kernel whose reduced, 0-dim result keeps the storage of the unreduced
    loss it was computed in (resized, not reallocated), for as long as the loss lives."""

    def rule(e: Eqn) -> MemoryEffect:
        if e.outvars[0].aval.device.type != "cpu" or _reduction(e, reduction_arg) == _NONE:
            return MemoryEffect()
        return MemoryEffect(outputs={0: _unreduced(e)[1]})

    return rule


def binary_cross_entropy_backward_workspace(e: Eqn) -> int:
    """A ``mean`` gradient is divided in place by the element count: the number wrapped as a float64 tensor
    and cast to the gradient's dtype (CPU)."""
    x = e.args[1].aval
    return 8 + x.itemsize if x.device.type == "cpu" and _reduction(e, 4) == _MEAN else 0


def soft_margin_loss_backward_workspace(e: Eqn) -> int:
    """``exp(-target * input)`` and the product before it: two tensors of the input's size (CPU)."""
    x = e.args[1].aval
    return 2 * x.nbytes if x.device.type == "cpu" else 0


def _nll_total_weight(target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int) -> torch.Tensor:
    keep = target != ignore_index
    if weight is None:
        return keep.sum().to(torch.float32)
    return torch.where(keep, weight[target.clamp(min=0)], 0).sum()


def _nll_partial(prim: Any, normalise: bool) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    def nll_loss_partial(x: torch.Tensor, target: torch.Tensor, weight: Any, ignore_index: int, total: torch.Tensor):
        out, _ = prim(x, target, weight, _SUM, ignore_index)
        total = total.to(out.dtype)
        return (out / total if normalise else out), total

    return nll_loss_partial


def nll_loss_forward_batch_rule(eqn: Eqn, label: LabelFn) -> Chunked:
    """Count-normalised: a mean over the non-ignored targets (or their class weights), divided by the *global*
    total weight, which a pre-pass over the targets computes before the chunk loop. The backward reads that
    total too (for ``sum`` it ignores it), so it is global for both reductions."""
    x, target, weight, reduction, ignore_index = eqn.args[:5]
    lab = label(x) or label(target)
    if lab.dim != 0 or lab.outer != 1:
        raise coupling(eqn, "has its batch off dim 0", "keep the batch on dim 0 of the loss input")
    cut = {
        v: lab
        for v in (x, target)
        if label(v) is None and v.aval.ndim and v.aval.shape[0] == lab.extent(label.batch)
    }
    if reduction == _NONE:
        return Chunked((lab, None), slice=cut)
    if x.aval.ndim == 1:
        raise coupling(eqn, "reduces a single unbatched example", "give the loss a batch dim")
    total = eqn.outvars[1]
    partial = _nll_partial(eqn.prim, normalise=reduction == _MEAN)

    def call(n: int) -> tuple[Any, tuple, dict]:
        return partial, (x, target, weight, ignore_index, total), {}

    return Chunked(
        (Reduced("sum"), Global()),
        call=call,
        slice=cut,
        prepass={1: Prepass(_nll_total_weight, (target, weight, ignore_index))},
    )


def nll_loss_backward_batch_rule(eqn: Eqn, label: LabelFn) -> Chunked:
    """Exact per chunk: the global total weight arrives as an argument. With ``reduction="none"`` the
    incoming gradient is per-example too (often a shared expand of ones: cut to the chunk)."""
    grad, x, target = eqn.args[:3]
    lab = label(x) or label(target)
    if lab is None or lab.dim != 0:
        raise coupling(eqn, "has its batch off dim 0", "keep the batch on dim 0 of the loss input")
    cut = {
        v: lab
        for v in (grad, x, target)
        if label(v) is None and v.aval.ndim and v.aval.shape[0] == lab.extent(label.batch)
    }
    return Chunked((lab,), slice=cut)


def multi_margin(*, backward: bool) -> Callable[[Eqn, LabelFn], Chunked]:
    """``multi_margin_loss(x, target, p, margin, weight, reduction)`` and its backward (``grad`` first): each row
    of ``x`` ``[N, C]`` against its own target, the class weights ``[C]`` looked up by it (read whole); ``mean``
    is over the ``N`` rows, run on a chunk as its ``sum`` divided by the whole batch's ``N``."""
    shift = 1 if backward else 0
    reduction_arg = 5 + shift

    def rule(eqn: Eqn, label: LabelFn) -> Chunked:
        x, target = eqn.args[shift], eqn.args[shift + 1]
        weight = eqn.args[shift + 4] if len(eqn.args) > shift + 4 else eqn.kwargs.get("weight")
        reduction = eqn.args[reduction_arg] if len(eqn.args) > reduction_arg else eqn.kwargs.get("reduction", _MEAN)
        lx, lt = label(x), label(target)
        grad = eqn.args[0] if backward else None
        lab = lx or lt or (label(grad) if grad is not None else None)
        if (
            lab is None or x.aval.ndim != 2 or lab.dim != 0 or (lx is not None and lt is not None and lx != lt)
            or (isinstance(weight, Var) and label(weight) is not None)
            or (reduction != _NONE and grad is not None and label(grad) is not None)
        ):
            raise coupling(eqn, "is per-example along the rows of a 2-D input only", "batch input and target on dim 0")
        if reduction == _NONE and grad is not None and label(grad) not in (None, lab):
            raise coupling(eqn, "pairs a gradient batched otherwise than its input", "batch them alike")
        cut = {v: lab for v in (x, target, grad) if isinstance(v, Var) and label(v) is None and v.aval.ndim}
        if any(v.aval.shape[0] != lab.extent(label.batch) for v in cut):
            raise coupling(eqn, "pairs a shared operand without a row per example with the examples", "batch it")
        whole = frozenset({weight}) if isinstance(weight, Var) else frozenset()
        if reduction == _NONE:
            return Chunked((lab,), slice=cut, whole=whole)
        call = _as_chunk_sum(eqn, reduction_arg, reduction, x.aval.shape[0])

        return Chunked((lab if backward else Reduced("sum"),), call=call, slice=cut, whole=whole)

    return rule


def _ctc_width(targets: Aval, target_lengths: Any) -> int:
    """The longest target CTC's alignment table has room for: the longest of ``target_lengths`` where they are
    Python ints; for length tensors (whose values the trace does not hold) the padded targets' width ``S`` of
    ``(N, S)``, or for concatenated ``(sum of lengths,)`` targets their total, each at least the longest."""
    if isinstance(target_lengths, (list, tuple)):
        return max((int(t) for t in target_lengths), default=0)
    return targets.shape[1] if targets.ndim == 2 else targets.shape[0]


def ctc_loss_shape(log_probs: Aval, targets: Aval, input_lengths: Any, target_lengths: Any, blank: int = 0,
                   zero_infinity: bool = False) -> tuple[Aval, Aval]:
    """``_ctc_loss``: each example's negative log-likelihood ``(N,)`` and the alignment table
    ``(N, T, 2 * width + 1)`` (:func:`_ctc_width`). The kernel sizes the table by the longest target it is given,
    which is data where the lengths are a tensor: there the shape is the most it can be (the memory interpreter
    counts that much), and only the backward reads it, which reads no column past an example's own targets."""
    if log_probs.ndim != 3:
        raise ShapeError(f"aten._ctc_loss: log_probs {log_probs} is not (T, N, C)")
    t, n = log_probs.shape[:2]
    width = _ctc_width(targets, target_lengths)
    return Aval((n,), log_probs.dtype, log_probs.device), Aval((n, t, 2 * width + 1), log_probs.dtype, log_probs.device)


# Shape rules: op -> rule(*args with Avals, **kwargs) -> Aval | tuple[Aval, ...]
SHAPE: dict = {
    aten.nll_loss_forward: nll_loss_forward,
    aten.nll_loss_backward: lambda grad, x, *args: Aval(x.shape, x.dtype, x.device),
    aten.mse_loss: lambda x, y, reduction=1: Aval(
        shape_rules.broadcast_shapes("mse_loss", x, y) if reduction == 0 else (), shape_rules.result_dtype(x, y), x.device
    ),
    aten.mse_loss_backward: lambda grad, x, y, reduction: Aval(x.shape, x.dtype, x.device),
    aten._ctc_loss: ctc_loss_shape,
    aten._ctc_loss_backward: lambda grad, log_probs, *args, **kwargs: Aval(log_probs.shape, log_probs.dtype, log_probs.device),
}


# Batch rules: op -> rule(eqn, label) -> Chunked (see stagetorch/interpreters/batching.py)

@attrs.frozen
class CtcTable(Batched):
    """CTC's alignment table in a chunk: a row per example, as wide as the chunk's longest target, so no slice
    of the whole batch's. It may not leave the chunk (a result the chunks' rows are concatenated into)."""

    chunk_local: ClassVar[bool] = True  # see stagetorch.interpreters.chunked._check_chunk_local


def _ctc_operands(eqn: Eqn, backward: bool) -> dict[str, Any]:
    names = ("grad",) * backward + ("log_probs", "targets", "input_lengths", "target_lengths")
    names += ("neg_log_likelihood", "log_alpha") if backward else ()
    return {name: eqn.args[i] if i < len(eqn.args) else eqn.kwargs.get(name) for i, name in enumerate(names)}


def ctc_loss_batch_rule(eqn: Eqn, label: LabelFn) -> Chunked:
    """``_ctc_loss`` and its backward: each example's loss and alignment table follow from its own column of
    ``log_probs`` ``(T, N, C)`` (batch at dim 1), its own row of padded targets ``(N, S)`` and its own lengths,
    so a chunk runs them on its own examples. The table is as wide as the chunk's longest target, narrower than
    the whole batch's; it never leaves the chunk (the backward reads it there, and reads no column past an
    example's own targets), and its shape as staged is the most it can be (:func:`ctc_loss_shape`). The
    reduction (``mean``: each loss over its target length, then the batch's mean) is ordinary ops after it.

    Refused by name: lengths given as Python lists (a chunk's share of a list is not an operand it can be cut
    from; jit's recorder stages them as tensors, so this is lazy's case) and concatenated 1-D targets (where a
    chunk's targets begin follows from the lengths' values)."""
    backward = eqn.prim in (aten._ctc_loss_backward.default, aten._ctc_loss_backward.Tensor)
    ops = _ctc_operands(eqn, backward)
    where = f"{op_name(eqn.prim)} at {eqn.source} (F.ctc_loss)"
    if any(isinstance(ops[k], (list, tuple)) for k in ("input_lengths", "target_lengths")):
        raise UnsupportedOpError(
            f"{where} has its input or target lengths as Python lists, and a chunk of the batch cannot be given "
            "its share of a list, so it cannot run in chunks.\nWhat to do: pass the lengths as tensors of "
            "shape (N,) (torch.tensor(lengths)), or run without chunking (a larger memory_budget)."
        )
    if ops["targets"].aval.ndim != 2:
        raise UnsupportedOpError(
            f"{where} has its targets concatenated into one 1-D tensor, where the targets of a chunk of the batch "
            "begin at a place that follows from the lengths' values, so it cannot run in chunks.\nWhat to do: "
            "pass padded 2-D targets of shape (N, S) (each row an example's target, padded to the longest), or "
            "run without chunking (a larger memory_budget)."
        )
    where_dim = {k: (1 if k == "log_probs" else 0) for k in ops}
    cut: dict = {}
    for k, v in ops.items():
        if not isinstance(v, Var):
            continue
        want = Batched(where_dim[k])
        lab = label(v)
        if lab is None:
            if v.aval.ndim <= where_dim[k] or v.aval.shape[where_dim[k]] != label.batch:
                raise coupling(eqn, f"reads {k} {v.aval} with no entry per example", f"give {k} one per example")
            cut[v] = want
        elif (lab.dim, lab.k, lab.outer) != (want.dim, 1, 1) or (k != "log_alpha" and type(lab) is not Batched):
            raise coupling(
                eqn, f"has the batch of {k} at dim {lab.dim} (k={lab.k}, outer={lab.outer})",
                f"keep the batch at dim {where_dim[k]} of {k}: log_probs (T, N, C), the rest (N, ...)",
            )
    out = (Batched(1),) if backward else (Batched(0), CtcTable(0))
    return Chunked(out, slice=cut)


BATCH: dict = {
    aten._ctc_loss: ctc_loss_batch_rule,
    aten._ctc_loss_backward: ctc_loss_batch_rule,
    aten.nll_loss_forward: nll_loss_forward_batch_rule,
    aten.nll_loss_backward: nll_loss_backward_batch_rule,
    aten.nll_loss2d_forward: nll_loss_forward_batch_rule,
    aten.nll_loss2d_backward: nll_loss_backward_batch_rule,
    aten.mse_loss: reduction_loss(reduction_arg=2),
    aten.mse_loss_backward: reduction_loss(reduction_arg=3, backward=True),
    aten.smooth_l1_loss: reduction_loss(reduction_arg=2),
    aten.smooth_l1_loss_backward: reduction_loss(reduction_arg=3, backward=True),
    aten.huber_loss: reduction_loss(reduction_arg=2),
    aten.huber_loss_backward: reduction_loss(reduction_arg=3, backward=True),
    aten.binary_cross_entropy: reduction_loss(reduction_arg=3),
    aten.binary_cross_entropy_backward: reduction_loss(reduction_arg=4, backward=True),
    aten.binary_cross_entropy_with_logits: reduction_loss(reduction_arg=4),
    aten.soft_margin_loss: reduction_loss(reduction_arg=2),
    aten.soft_margin_loss_backward: reduction_loss(reduction_arg=3, backward=True),
    aten.multi_margin_loss: multi_margin(backward=False),
    aten.multi_margin_loss_backward: multi_margin(backward=True),
}


# Memory rules: op -> rule(eqn) -> MemoryEffect (an output's true size: see keeps_unreduced).
_KEEPS_UNREDUCED = {aten.mse_loss: 2, aten.smooth_l1_loss: 2, aten.binary_cross_entropy: 3, aten.soft_margin_loss: 2}
MEMORY: dict = {op: keeps_unreduced(arg) for op, arg in _KEEPS_UNREDUCED.items()}


# Workspace rules: op -> rule(eqn) -> bytes the kernel allocates inside itself (see stagetorch/interpreters/memory.py).
def ctc_loss_backward_workspace(e: Eqn) -> int:
    """The backward's table of backward log-probabilities, made like the forward's alignment table (CPU and
    CUDA kernels alike: ``empty_like(log_alpha)``), counted at the table's staged (widest) shape."""
    log_alpha = e.args[6] if len(e.args) > 6 else e.kwargs["log_alpha"]
    return log_alpha.aval.nbytes


WORKSPACE: dict = {
    aten._ctc_loss_backward: ctc_loss_backward_workspace,
    aten.mse_loss: loss_workspace(2, "structured"),
    aten.smooth_l1_loss: loss_workspace(2, "structured"),
    aten.huber_loss: loss_workspace(2, "fresh"),
    aten.binary_cross_entropy: loss_workspace(3, "in_place"),
    aten.soft_margin_loss: loss_workspace(2, "in_place"),
    aten.binary_cross_entropy_with_logits: loss_workspace(4, "logits"),
    aten.binary_cross_entropy_backward: binary_cross_entropy_backward_workspace,
    aten.soft_margin_loss_backward: soft_margin_loss_backward_workspace,
}

"""Rules for the reductions op family."""

from __future__ import annotations

import torch

from ..interpreters import batch_rules, batching, shape_rules
from ..interpreters.batching import Chunked, LabelFn, coupling
from ..ir import Eqn, Var

aten = torch.ops.aten

GRAIN_SIZE = 32768  # at::internal::GRAIN_SIZE: below it, a CPU reduction runs on one thread


def partials_bytes(numel: int, out: int, itemsize: int) -> int:
    """What a CPU sum or mean of ``numel`` elements into ``out`` elements allocates for its threads: a
    reduction to one element over at least ``GRAIN_SIZE`` elements, on more than one thread, sums each
    thread's part into a buffer of one element per thread (``two_pass_reduction``, ATen's
    TensorIteratorReduce.cpp), in the output's dtype; a reduction to more elements splits the output instead."""
    threads = torch.get_num_threads()
    return threads * itemsize if out == 1 and numel >= GRAIN_SIZE and threads > 1 else 0


def mean_bytes(numel: int, out: int, itemsize: int) -> int:
    """What a CPU mean allocates beyond its output: the sum's partials, then (freed by then) the division by
    the count, a Python number wrapped as a float64 tensor and cast to the output's dtype."""
    return max(partials_bytes(numel, out, itemsize), 8 + itemsize)


def _reduction_workspace(mean: bool):  # noqa: ANN202
    def rule(e: Eqn) -> int:
        x, out = e.args[0].aval, e.outvars[0].aval
        if x.device.type != "cpu":
            return 0
        return (mean_bytes if mean else partials_bytes)(x.numel, out.numel, out.itemsize)

    return rule


# Shape rules: op -> rule(*args with Avals, **kwargs) -> Aval | tuple[Aval, ...]
SHAPE: dict = {
    aten.sum.dim_IntList: shape_rules.reduce("sum"),
    aten.sum.default: shape_rules.reduce("sum", dims_arg=None, keepdim_arg=None),
    aten.mean.dim: shape_rules.reduce("mean", float_out=True),
    aten.mean.default: shape_rules.reduce("mean", dims_arg=None, keepdim_arg=None, float_out=True),
    aten.amax: shape_rules.reduce("amax"),
    aten.amin: shape_rules.reduce("amin"),
}


def searchsorted(eqn: Eqn, label: LabelFn) -> Chunked:
    """``searchsorted(sorted_sequence, values, ..., sorter=)``: each row of values is searched in the matching
    row of the sequence (the last dim is searched; leading dims pair entry by entry), or every value in one 1-D
    sequence. A shared 1-D sequence (bucket edges) is read whole; a shared N-D one with the batch's extent pairs
    with the examples and is cut with its sorter; a batch along the searched dim is refused."""
    seq, values = eqn.args[0], eqn.args[1]
    sorter = eqn.kwargs.get("sorter", eqn.args[5] if len(eqn.args) > 5 else None)
    ls, lv = label(seq), label(values)
    if seq.aval.ndim == 1:
        if ls is not None:
            raise coupling(eqn, "searches a sequence along the batch dim", "search a sequence shared by the examples")
        return Chunked((lv,), whole=frozenset(v for v in (seq, sorter) if isinstance(v, Var)))
    lab = batching.agree(eqn, [lab for lab in (ls, lv) if lab is not None])
    if lab.dim >= seq.aval.ndim - 1:
        raise coupling(eqn, "searches along the batch dim", "keep the batch on a leading dim")
    cut = {v: lab for v in (seq, values, sorter) if isinstance(v, Var) and label(v) is None}
    if any(v.aval.shape[lab.dim] != lab.extent(label.batch) for v in cut):
        raise coupling(eqn, "pairs a shared sequence without a row per example with the examples", "batch it")
    return Chunked((lab,), slice=cut)


# Batch rules: op -> rule(eqn, label) -> Chunked (see stagetorch/interpreters/batching.py)
BATCH: dict = {
    aten.searchsorted.Tensor: searchsorted,
    aten.sum.dim_IntList: batch_rules.reduction("sum"),
    aten.sum.default: batch_rules.reduction("sum", dims_arg=None, keepdim_arg=None),
    aten.mean.dim: batch_rules.mean_reduction(),
    aten.mean.default: batch_rules.mean_reduction(dims_arg=None, keepdim_arg=None),
    aten.amax: batch_rules.reduction("max"),
    aten.amin: batch_rules.reduction("min"),
    aten.max.default: batch_rules.reduction("max", dims_arg=None, keepdim_arg=None),
    aten.min.default: batch_rules.reduction("min", dims_arg=None, keepdim_arg=None),
    # all/any over bools: a chunk's answer combines with the others' as a minimum/maximum does.
    aten.all.default: batch_rules.reduction("min", dims_arg=None, keepdim_arg=None),
    aten.all.dim: batch_rules.reduction("min"),
    aten.all.dims: batch_rules.reduction("min"),
    aten.any.default: batch_rules.reduction("max", dims_arg=None, keepdim_arg=None),
    aten.any.dim: batch_rules.reduction("max"),
    aten.any.dims: batch_rules.reduction("max"),
    # Reductions and scans along a dim other than the batch's.
    aten.max.dim: batch_rules.along(1, keepdim=2, reduces=True),
    aten.argmax: batch_rules.along(1, keepdim=2, reduces=True),
    aten.argmin: batch_rules.along(1, keepdim=2, reduces=True),
    aten.min.dim: batch_rules.along(1, keepdim=2, reduces=True),
    aten.median.dim: batch_rules.along(1, keepdim=2, reduces=True),
    aten.nanmedian.dim: batch_rules.along(1, keepdim=2, reduces=True),
    aten.mode: batch_rules.along(1, default=-1, keepdim=2, reduces=True),
    aten.kthvalue: batch_rules.along(2, default=-1, keepdim=3, reduces=True),
    aten.prod.dim_int: batch_rules.along(1, keepdim=2, reduces=True),
    aten.logsumexp: batch_rules.along(1, keepdim=2, reduces=True),
    aten.var.correction: batch_rules.along(1, keepdim="keepdim", reduces=True),
    aten.std.correction: batch_rules.along(1, keepdim="keepdim", reduces=True),
    aten.var_mean.correction: batch_rules.along(1, keepdim="keepdim", reduces=True),
    aten.std_mean.correction: batch_rules.along(1, keepdim="keepdim", reduces=True),
    aten.norm.ScalarOpt_dim: batch_rules.along(2, keepdim=3, reduces=True),
    aten.linalg_vector_norm: batch_rules.along(2, keepdim=3, reduces=True),
    aten.aminmax: batch_rules.along("dim", keepdim="keepdim", reduces=True),
    aten.cumsum: batch_rules.along(1),
    aten.cumprod: batch_rules.along(1),
    aten.cummax: batch_rules.along(1),
    aten.cummin: batch_rules.along(1),
    aten.logcumsumexp: batch_rules.along(1),
    aten.sort.default: batch_rules.along(1, default=-1),
    aten.sort.stable: batch_rules.along("dim", default=-1),
    aten.topk: batch_rules.along(2, default=-1),
}


# Workspace rules: op -> rule(eqn) -> bytes the kernel allocates inside itself (measured at the CPU allocator,
# float32 and float64, 1-3 threads: tests/ops/test_workspace.py).
WORKSPACE: dict = {
    aten.sum.default: _reduction_workspace(mean=False),
    aten.sum.dim_IntList: _reduction_workspace(mean=False),
    aten.mean.default: _reduction_workspace(mean=True),
    aten.mean.dim: _reduction_workspace(mean=True),
}

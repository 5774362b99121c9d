"""Rules for the embedding op family."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import BatchCouplingError
from ..interpreters.batching import Batched, Chunked, LabelFn, Reduced, coupling
from ..ir import Aval, Eqn, Var

aten = torch.ops.aten


# Batch rules for this family's ops (see stagetorch/interpreters/batching.py).

def embedding(eqn: Eqn, label: LabelFn) -> Chunked:
    weight, indices = eqn.args[0], eqn.args[1]
    if label(weight) is not None:
        raise coupling(eqn, "looks up a per-example table", "keep embedding tables shared")
    return Chunked((label(indices),), whole=frozenset({weight}))  # a table: no dim of it pairs with the examples


def embedding_renorm_(eqn: Eqn, label: LabelFn) -> Chunked:
    """``nn.Embedding(max_norm=...)``'s forward renormalises, in place in the parameter, the rows the batch's
    indices read. Each chunk renormalises its own examples' rows: a row is scaled from its own values alone, and
    once scaled its norm is no longer over ``max_norm``, so a later chunk reading it leaves it be; after the last
    chunk the weight is the whole batch's one renormalisation. The lookup that follows reads only its chunk's
    rows (the analysis refuses any other reader of the weight before every chunk has run), and the lookup's
    backward does not read the weight. (In float32 a renormalised row's norm can round to just over
    ``max_norm``; a row two chunks read is then scaled again, by about one ulp: eager's next step does the same.)"""
    weight, indices = eqn.args[0], eqn.args[1]
    if label(weight) is not None:
        raise coupling(eqn, "renormalises a per-example table", "keep embedding tables shared")
    if label(indices) is None:  # (not reached: an equation with no per-example input runs once, before the chunks)
        return Chunked((None,))
    return Chunked((None,), renorm=(weight, indices), whole=frozenset({weight}))


def embedding_dense_backward(eqn: Eqn, label: LabelFn) -> Chunked:
    scale_by_freq = eqn.args[4] if len(eqn.args) > 4 else eqn.kwargs.get("scale_grad_by_freq", False)
    if scale_by_freq:
        raise coupling(eqn, "scales gradients by token counts over the batch", "use scale_grad_by_freq=False")
    grad, indices = eqn.args[0], eqn.args[1]
    lab = label(grad)
    # The gradient's leading dims are the indices' dims: shared indices (token type ids expanded to the batch)
    # are cut to the chunk with it.
    cut = {indices: lab} if lab is not None and label(indices) is None and lab.dim < indices.aval.ndim else {}
    if lab is not None and label(indices) is None and not cut:
        raise coupling(eqn, "adds per-example gradients at shared positions that do not line up with them", "batch the indices")
    return Chunked((Reduced("sum"),), slice=cut)


def _arg(eqn: Eqn, i: int, name: str, default: Any) -> Any:
    return eqn.args[i] if len(eqn.args) > i else eqn.kwargs.get(name, default)


def _own_offsets(offsets: torch.Tensor, size: int, bags: int, last: int) -> torch.Tensor:
    """A chunk's offsets: the whole batch's must be ``0, size, 2*size, ...`` (equal bags, as EmbeddingBag makes
    for 2-D input), so the chunk's ``bags`` bags start at its first ``bags`` of them."""
    own = torch.arange(offsets.shape[0], device=offsets.device, dtype=offsets.dtype) * size
    if not torch.equal(offsets, own):
        raise BatchCouplingError(
            "An embedding bag's offsets are not equal bags of each example's own indices (0, L, 2L, ...), so a "
            "chunk cannot tell which bags are its examples' and running the batch in chunks would change the "
            "result.\nWhat to do: give every example the same number of indices (a 2-D input, padded with "
            "padding_idx), or run without chunking (a larger memory_budget)."
        )
    return offsets[: bags + last]


def _bag_chunk(prim: Any, size: int, last: int, at: int = 2) -> Callable[..., Any]:
    """``prim`` on a chunk, its offsets (argument ``at``, the indices just before them) the chunk's own."""

    def run(*args: Any, **kwargs: Any) -> Any:
        args = list(args)
        args[at] = _own_offsets(args[at], size, args[at - 1].shape[0] // size, last)
        return prim(*args, **kwargs)

    run.__name__ = f"{getattr(prim, '__name__', 'embedding_bag')}_of_own_bags"
    return run


def _bags(eqn: Eqn, label: LabelFn, indices: Var, offsets: Any, last: int) -> tuple[Batched, int, int]:
    """``(label of the indices, bags per example, indices per bag)``: the indices flat, each example's ``k``
    of them in a row, cut into equal bags by the offsets (shared: checked when it runs)."""
    li = label(indices)
    if li is None or li.dim != 0 or li.outer != 1 or not isinstance(offsets, Var) or label(offsets) is not None:
        raise coupling(
            eqn,
            "bags indices whose examples stagetorch cannot place (per-example offsets, or indices not each "
            "example's own run)",
            "pass EmbeddingBag a 2-D input (one row of indices per example), or run without chunking",
        )
    bags = offsets.aval.shape[0] - last
    if bags <= 0 or bags % label.batch or li.k % (bags // label.batch):
        raise coupling(eqn, "bags indices across the examples", "give every example whole bags of its own")
    per_row = bags // label.batch
    return li, per_row, li.k // per_row


def _bag_weights(eqn: Eqn, label: LabelFn, weights: Any, li: Batched) -> dict:
    if not isinstance(weights, Var):
        return {}
    lw = label(weights)
    if lw is not None and lw != li:
        raise coupling(eqn, "weights indices batched otherwise than they are", "batch them alike")
    return {weights: li} if lw is None else {}


def embedding_bag(eqn: Eqn, label: LabelFn) -> Chunked:
    """``_embedding_bag(weight, indices, offsets, scale_grad_by_freq, mode, sparse, per_sample_weights,
    include_last_offset, padding_idx)``: per example where each example's indices make its own equal bags
    (``nn.EmbeddingBag`` on 2-D input: flat indices, offsets ``0, L, 2L, ...``). The table is read whole; the
    offsets are read whole and the chunk's own bags taken from them when it runs (checked equal bags); shared
    per-sample weights pair with the indices and are cut with them. Outputs: one row per bag, the bag of each
    index (``offset2bag``, the chunk's own bag numbers, read only by the chunk's backward), the bag sizes, and
    the max mode's argmax."""
    weight, indices, offsets = eqn.args[0], eqn.args[1], eqn.args[2]
    if label(weight) is not None:
        raise coupling(eqn, "looks up a per-example table", "keep embedding tables shared")
    last = int(bool(_arg(eqn, 7, "include_last_offset", False)))
    li, per_row, size = _bags(eqn, label, indices, offsets, last)
    cut = _bag_weights(eqn, label, _arg(eqn, 6, "per_sample_weights", None), li)
    out = []
    for v in eqn.outvars:
        n = v.aval.shape[0] if v is not None and v.aval.ndim else 0
        if n == 0:
            out.append(None)
        elif n == per_row * label.batch:
            out.append(Batched(0, per_row))
        elif n == li.extent(label.batch):
            out.append(li)
        else:
            raise coupling(eqn, "returns a value whose batch dim stagetorch cannot place", "run without chunking")

    def call(n: int) -> tuple[Any, tuple, dict]:
        return _bag_chunk(eqn.prim, size, last), eqn.args, eqn.kwargs

    return Chunked(tuple(out), call=call, slice=cut, whole=frozenset({weight, offsets}))


def embedding_bag_backward(eqn: Eqn, label: LabelFn) -> Chunked:
    """``_embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, maximum_indices, num_weights,
    scale_grad_by_freq, mode, sparse, per_sample_weights, padding_idx)``: the table's gradient, per-example
    rows added into it, a partial sum per chunk (the chunk's own offsets, as its forward)."""
    if _arg(eqn, 7, "scale_grad_by_freq", False):
        raise coupling(eqn, "scales gradients by index counts over the batch", "use scale_grad_by_freq=False")
    if _arg(eqn, 9, "sparse", False):
        raise coupling(eqn, "makes a sparse gradient", "use sparse=False")
    indices, offsets = eqn.args[1], eqn.args[2]
    last = int(offsets.aval.shape[0] - 1 == eqn.args[4].aval.shape[0]) if isinstance(eqn.args[4], Var) else 0
    li, per_row, size = _bags(eqn, label, indices, offsets, last)
    cut = _bag_weights(eqn, label, _arg(eqn, 10, "per_sample_weights", None), li)
    for v in eqn.args[0], *eqn.args[3:6]:
        if isinstance(v, Var) and label(v) is None and v.aval.ndim and v.aval.numel:
            raise coupling(eqn, "reads per-bag values shared by the whole batch", "run without chunking")

    def call(n: int) -> tuple[Any, tuple, dict]:
        return _bag_chunk(eqn.prim, size, last), eqn.args, eqn.kwargs

    return Chunked((Reduced("sum"),), call=call, slice=cut, whole=frozenset({offsets}))


def embedding_bag_weights_backward(eqn: Eqn, label: LabelFn) -> Chunked:
    """``_embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode,
    padding_idx)``: the gradient of each index's weight, per example as its index (the chunk's own offsets)."""
    indices, offsets = eqn.args[2], eqn.args[3]
    if label(eqn.args[1]) is not None:
        raise coupling(eqn, "looks up a per-example table", "keep embedding tables shared")
    bags = eqn.args[0].aval.shape[0]
    last = int(offsets.aval.shape[0] - 1 == bags)
    li, per_row, size = _bags(eqn, label, indices, offsets, last)
    for v in (eqn.args[0], eqn.args[4]):
        if isinstance(v, Var) and label(v) is None and v.aval.ndim and v.aval.numel:
            raise coupling(eqn, "reads per-bag values shared by the whole batch", "run without chunking")

    def call(n: int) -> tuple[Any, tuple, dict]:
        return _bag_chunk(eqn.prim, size, last, at=3), eqn.args, eqn.kwargs

    return Chunked((li,), call=call, whole=frozenset({eqn.args[1], offsets}))


# Shape rules: op -> rule(*args with Avals, **kwargs) -> Aval | tuple[Aval, ...]
SHAPE: dict = {
    aten.embedding: lambda weight, indices, *args: Aval(indices.shape + weight.shape[1:], weight.dtype, weight.device),
    aten.embedding_dense_backward: lambda grad, indices, num_weights, *args: Aval(
        (num_weights, grad.shape[-1]), grad.dtype, grad.device
    ),
}


# Batch rules: op -> rule(eqn, label) -> Chunked (see stagetorch/interpreters/batching.py)
BATCH: dict = {
    aten.embedding: embedding,
    aten.embedding_dense_backward: embedding_dense_backward,
    aten.embedding_renorm_: embedding_renorm_,
    aten._embedding_bag: embedding_bag,
    aten._embedding_bag_forward_only: embedding_bag,
    aten._embedding_bag_backward: embedding_bag_backward,
    aten._embedding_bag_per_sample_weights_backward: embedding_bag_weights_backward,
}


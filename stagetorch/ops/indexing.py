"""Rules for advanced indexing: ``x[i, j]`` (``aten.index``), its backward (``index_put``), and the
batch-position indices real models build (``padding_mask[batch_arange, kv_idx]`` in transformers' mask
functions, ``logits[torch.arange(B), labels]``).

Advanced indexing places the broadcast shape of the index tensors where the indexed dims were (when they are
adjacent) or first (when they are not), so every dim of the output comes either from a dim of ``x`` that is not
indexed or from a dim of the broadcast indices. The batch rule follows the batch through that placement.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..batching import Batched, Chunked, LabelFn, coupling
from ..errors import BatchCouplingError
from ..ir import Eqn, Var

aten = torch.ops.aten


def _placement(x_ndim: int, indices: Sequence[Any]) -> tuple[int, list[int | None], int]:
    """``(first, x_to_out, width)``: the output dim where the broadcast indices start, each dim of ``x`` mapped
    to its output dim (``None`` for an indexed dim), and the broadcast indices' ndim."""
    indexed = [i for i, t in enumerate(indices) if t is not None]
    width = max(t.aval.ndim for t in indices if t is not None)
    adjacent = indexed == list(range(indexed[0], indexed[-1] + 1))
    first = indexed[0] if adjacent else 0
    x_to_out: list[int | None] = []
    out = 0 if adjacent else width
    for d in range(x_ndim):
        if d in indexed:
            x_to_out.append(None)
            if adjacent and d == indexed[0]:
                out += width
            continue
        x_to_out.append(out)
        out += 1
    return first, x_to_out, width


def _own_batch_rows(x: torch.Tensor, indices: list, dim: int, at: int) -> torch.Tensor:
    """``x[indices]`` where ``indices[dim]`` selects, along broadcast dim ``at``, each example's own row of the
    batch (``arange(B)`` there): on a chunk of ``n`` examples it selects rows ``0..n-1`` of the chunk."""
    full = indices[dim]
    batch = full.shape[at]
    shape = [1] * full.ndim
    shape[at] = batch
    own = torch.arange(batch, device=full.device, dtype=full.dtype).view(shape)
    if not torch.equal(full, own.expand_as(full)):
        raise BatchCouplingError(
            "An advanced index into the batch dim selects rows other than each example's own (a shuffle, a "
            "gather of other examples), so running the batch in chunks would change the result.\nWhat to do: "
            "reorder examples outside the staged function, or run without chunking (a larger memory_budget)."
        )
    n = x.shape[dim]
    local = list(indices)
    local[dim] = own.narrow(at, 0, n)
    return torch.ops.aten.index.Tensor(x, local)


def index(eqn: Eqn, label: LabelFn) -> Chunked:
    """``aten.index.Tensor(x, indices)``: exact per chunk when

    - the batch dim of ``x`` is not indexed and every index is shared (the batch dim passes through);
    - ``x`` is shared and the per-example indices carry the batch on one broadcast dim (a lookup table);
    - the batch dim of ``x`` is indexed by each example's own position (``arange(B)`` broadcast along one
      dim, as transformers' mask functions and ``logits[arange(B), labels]`` do), checked when it runs.
    """
    x, indices = eqn.args[0], list(eqn.args[1])
    first, x_to_out, width = _placement(x.aval.ndim, indices)
    extent_of = label.batch
    xl = label(x)
    tensors = [(d, t) for d, t in enumerate(indices) if isinstance(t, Var)]
    batched_idx = [(d, t, lab) for d, t in tensors if (lab := label(t)) is not None]

    def bdim(t: Var, lab_dim: int) -> int:
        """The broadcast dim of index ``t``'s dim ``lab_dim``."""
        return lab_dim + width - t.aval.ndim

    if xl is not None and (xl.dim >= len(indices) or indices[xl.dim] is None):
        if batched_idx:
            raise coupling(
                eqn,
                "indexes per-example values with per-example indices along another dim (every example would "
                "meet every other example's indices)",
                "index each example's own rows (with the batch on the same dim), or run without chunking",
            )
        return Chunked((Batched(x_to_out[xl.dim], xl.k, xl.outer),))

    if xl is None:
        placed = {(bdim(t, lab.dim), lab.k, lab.outer) for _, t, lab in batched_idx}
        if len(placed) > 1:
            raise coupling(eqn, "combines indices whose batch dims do not line up", "batch the indices the same way")
        at, k, outer = placed.pop()
        lab = Batched(first + at, k, outer)
        cut = _cut_shared(eqn, tensors, label, at, width, lab.extent(extent_of), k, outer)
        return Chunked((lab,), slice=cut)

    # The batch dim of x is indexed.
    own = indices[xl.dim]
    if xl.k != 1 or xl.outer != 1 or not isinstance(own, Var) or label(own) is not None:
        raise coupling(
            eqn,
            "indexes the batch dim with per-example positions",
            "index examples outside the staged function, or run without chunking (a larger memory_budget)",
        )
    rows = [d for d in range(own.aval.ndim) if own.aval.shape[d] == extent_of and extent_of != 1]
    if len(rows) != 1:
        raise coupling(
            eqn,
            "indexes the batch dim with a shared index that does not hold one position per example",
            "index examples outside the staged function, or run without chunking (a larger memory_budget)",
        )
    at = bdim(own, rows[0])
    for _, t, lab in batched_idx:
        if (bdim(t, lab.dim), lab.k, lab.outer) != (at, 1, 1):
            raise coupling(eqn, "combines indices whose batch dims do not line up", "batch the indices the same way")
    cut = _cut_shared(eqn, [(d, t) for d, t in tensors if t is not own], label, at, width, extent_of, 1, 1)
    dim = xl.dim

    def call(n: int) -> tuple[Any, tuple, dict]:
        return _own_batch_rows, (x, indices, dim, at), {}

    return Chunked((Batched(first + at),), call=call, slice=cut)


def _cut_shared(
    eqn: Eqn, tensors: list[tuple[int, Var]], label: LabelFn, at: int, width: int, extent: int, k: int, outer: int
) -> dict:
    """Shared indices that span the batch along broadcast dim ``at`` are cut to the chunk with it."""
    cut = {}
    for _, t in tensors:
        if label(t) is not None:
            continue
        own = at - (width - t.aval.ndim)
        if own >= 0 and t.aval.shape[own] == extent and extent != 1:
            cut[t] = Batched(own, k, outer)
    return cut


BATCH: dict = {
    aten.index.Tensor: index,
    aten._unsafe_index.Tensor: index,
}

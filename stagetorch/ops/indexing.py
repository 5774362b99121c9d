"""Rules for advanced indexing: ``x[i, j]`` (``aten.index``), its backward (``index_put``), and the
batch-position indices real models build (``padding_mask[batch_arange, kv_idx]`` in transformers' mask
functions, ``logits[torch.arange(B), labels]``).

Advanced indexing places the broadcast shape of the index tensors where the indexed dims were (when they are
adjacent) or first (when they are not), so every dim of the output comes either from a dim of ``x`` that is not
indexed or from a dim of the broadcast indices. The batch rule follows the batch through that placement.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from ..errors import BatchCouplingError
from ..interpreters.batching import Batched, Chunked, LabelFn, Reduced, arg_vars, coupling
from ..ir import Eqn, Var, op_name

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


def _masks(indices: list) -> list[Var]:
    return [t for t in indices if isinstance(t, Var) and t.aval.dtype in (torch.bool, torch.uint8)]


def _masks_beside_the_batch(eqn: Eqn, label: LabelFn) -> bool:
    """Whether every boolean index of ``eqn`` (``x[:, mask]``; its backward's ``index_put``) is one-dimensional
    and shared, selecting along one dim of ``x`` that is not the batch's: the same positions in every chunk,
    placed as an integer index of those positions would be. Where ``x`` is per-example, its batch dim is not
    indexed; where it is shared (the backward's zeros, an input), the values carry the batch along a dim of
    ``x`` no index touches (:func:`_values_rows`)."""
    x, indices = eqn.args[0], list(eqn.args[1])
    if any(t.aval.ndim != 1 or label(t) is not None for t in _masks(indices)):
        return False
    xl = label(x)
    if xl is not None:
        return xl.dim >= len(indices) or indices[xl.dim] is None
    return eqn.prim.overloadpacket is not aten.index and _values_rows(eqn, label) is not None and (
        _is_zeros(label, x) or label.maker(x) is None
    )


def _no_masks(eqn: Eqn, indices: list, label: LabelFn | None = None) -> None:
    """A boolean index stands for the positions of its true entries over several dims (data the rules do not
    see): only integer indices are placed, and masks :func:`_masks_beside_the_batch` accepts (given ``label``)."""
    if _masks(indices) and (label is None or not _masks_beside_the_batch(eqn, label)):
        raise coupling(
            eqn,
            "indexes with a boolean mask, whose positions depend on the data",
            "index with integer positions (mask.nonzero()), or run without chunking (a larger memory_budget)",
        )


def _local_indices(indices: list, dim: int, at: int, n: int, reads: str, where: str) -> list:
    """``indices`` for a chunk of ``n`` examples, where ``indices[dim]`` must hold each example's own position
    along broadcast dim ``at`` (``arange(B)`` there): it becomes ``arange(n)``, the chunk's own rows. ``where``:
    the op and the user's line, which a refusal names (the values are known only when the chunk runs)."""
    full = indices[dim]
    shape = [1] * full.ndim
    shape[at] = full.shape[at]
    own = torch.arange(full.shape[at], device=full.device, dtype=full.dtype).view(shape)
    if not torch.equal(full, own.expand_as(full)):
        raise BatchCouplingError(
            f"{where}: an advanced index into the batch dim {reads} rows other than each example's own (a shuffle, a "
            "gather of other examples), so running the batch in chunks would change the result.\nWhat to do: "
            "reorder examples outside the staged function, or run without chunking (a larger memory_budget)."
        )
    local = list(indices)
    local[dim] = own.narrow(at, 0, n)
    return local


def _own_batch_rows(x: torch.Tensor, indices: list, dim: int, at: int, where: str) -> torch.Tensor:
    """``x[indices]`` on a chunk, ``indices[dim]`` selecting each example's own row (see :func:`_local_indices`)."""
    return torch.ops.aten.index.Tensor(x, _local_indices(indices, dim, at, x.shape[dim], "selects", where))


def index(eqn: Eqn, label: LabelFn) -> Chunked:
    """``aten.index.Tensor(x, indices)``: exact per chunk when

    - the batch dim of ``x`` is not indexed and every index is shared (the batch dim passes through);
    - ``x`` is shared and the per-example indices carry the batch on one broadcast dim (a lookup table);
    - the batch dim of ``x`` is indexed by each example's own position (``arange(B)`` broadcast along one
      dim, as transformers' mask functions and ``logits[arange(B), labels]`` do), checked when it runs.
    """
    x, indices = eqn.args[0], list(eqn.args[1])
    _no_masks(eqn, indices, label)
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
            "indexes the batch dim with a shared index that does not hold one position per example (a "
            "selection of examples, x[mask] or x[mask.nonzero()], whose size the chunks do not share)",
            "keep every example and weight the ones to drop by zero ((loss_per_example * mask).sum() / "
            "mask.sum()), select examples outside the staged function, or run without chunking (a larger "
            "memory_budget)",
        )
    at = bdim(own, rows[0])
    for _, t, lab in batched_idx:
        if (bdim(t, lab.dim), lab.k, lab.outer) != (at, 1, 1):
            raise coupling(eqn, "combines indices whose batch dims do not line up", "batch the indices the same way")
    cut = _cut_shared(eqn, [(d, t) for d, t in tensors if t is not own], label, at, width, extent_of, 1, 1)
    dim = xl.dim

    def call(n: int) -> tuple[Any, tuple, dict]:
        return _own_batch_rows, (x, indices, dim, at), {"where": f"{op_name(eqn.prim)} at {eqn.source}"}

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


_ZEROS = (aten.zeros, aten.new_zeros, aten.zeros_like)


def _is_zeros(label: LabelFn, x: Var) -> bool:
    maker = label.maker(x)
    while maker is not None and maker.prim.overloadpacket in (aten.detach, aten.alias) and isinstance(maker.args[0], Var):
        maker = label.maker(maker.args[0])  # ``torch.zeros(n)`` is traced as zeros, then a detach
    return maker is not None and maker.prim.overloadpacket in _ZEROS


def _own_batch_rows_put(
    x: torch.Tensor, indices: list, values: torch.Tensor, accumulate: bool, dim: int, at: int, where: str
) -> torch.Tensor:
    """``x.index_put(indices, values, accumulate)`` on a chunk, ``indices[dim]`` writing each example's own row."""
    local = _local_indices(indices, dim, at, x.shape[dim], "writes", where)
    return torch.ops.aten.index_put.default(x, local, values, accumulate)


def _own_batch_rows_put_(
    x: torch.Tensor, indices: list, values: torch.Tensor, accumulate: bool, dim: int, at: int, where: str
) -> torch.Tensor:
    """:func:`_own_batch_rows_put` in place: into the chunk's rows of ``x``."""
    local = _local_indices(indices, dim, at, x.shape[dim], "writes", where)
    return torch.ops.aten.index_put_.default(x, local, values, accumulate)


def _values_rows(eqn: Eqn, label: LabelFn) -> Batched | None:
    """Where the batch of ``x.index_put(indices, values)`` lies in ``x`` when the values alone carry it (no index
    is per-example) along a dim of ``x`` that no index touches and that has the batch's extent; else None."""
    x, indices, values = eqn.args[0], list(eqn.args[1]), eqn.args[2]
    vl = label(values)
    if vl is None or any(label(t) is not None for t in indices if isinstance(t, Var)):
        return None
    _, x_to_out, width = _placement(x.aval.ndim, indices)
    result_ndim = len(x_to_out) - sum(o is None for o in x_to_out) + width
    at = vl.dim + result_ndim - values.aval.ndim  # values broadcast against x[indices], aligned right
    d = next((d for d, o in enumerate(x_to_out) if o is not None and o == at), None)
    if d is None or x.aval.shape[d] != vl.extent(label.batch):
        return None
    return Batched(d, vl.k, vl.outer)


def _into_own_zeros(x: torch.Tensor, indices: list, values: torch.Tensor, accumulate: bool, dim: int, vdim: int):
    """``x.index_put(indices, values, accumulate)`` on a chunk, ``x`` zeros whose ``dim`` holds the batch: the
    chunk's rows of it are zeros too, as many as the values have along ``vdim``."""
    return torch.ops.aten.index_put.default(x.narrow(dim, 0, values.shape[vdim]), indices, values, accumulate)


def _mask_fill(x: torch.Tensor, mask: torch.Tensor, value: torch.Tensor, in_place: bool) -> torch.Tensor:
    """``x[mask] = value`` (one value for every entry the mask selects) as the elementwise fill it is."""
    mask = mask.view(*mask.shape, *[1] * (x.ndim - mask.ndim))
    return x.masked_fill_(mask, value.reshape(())) if in_place else x.masked_fill(mask, value.reshape(()))


def _as_mask_fill(eqn: Eqn, label: LabelFn) -> Chunked | None:
    """``x[mask] = v`` with one boolean mask over the leading dims of ``x`` and one value (``labels[labels ==
    pad] = -100``): elementwise over ``x``, per example where ``x`` is, whatever the mask selects. None where
    the write is another."""
    x, indices, values = eqn.args[0], list(eqn.args[1]), eqn.args[2]
    accumulate = bool(eqn.args[3] if len(eqn.args) > 3 else eqn.kwargs.get("accumulate", False))
    mask = indices[0] if len(indices) == 1 else None
    if accumulate or not isinstance(mask, Var) or mask.aval.dtype is not torch.bool or not isinstance(values, Var):
        return None
    if values.aval.numel != 1 or label(values) is not None or mask.aval.shape != x.aval.shape[: mask.aval.ndim]:
        return None
    xl, ml = label(x), label(mask)
    cut = {}
    if xl is None and ml is not None:
        return None  # per-example positions written into a shared tensor: refused by the rules below
    if xl is not None and xl.dim < mask.aval.ndim and ml != xl:
        if ml is not None:
            return None
        cut[mask] = xl  # a shared mask over the whole batch: cut to the chunk with x
    in_place = eqn.prim.overloadpacket is aten.index_put_

    def call(n: int) -> tuple[Any, tuple, dict]:
        return _mask_fill, (x, mask, values, in_place), {}

    return Chunked((xl,), call=call, slice=cut)


def index_put(eqn: Eqn, label: LabelFn) -> Chunked:
    """``aten.index_put(x, indices, values, accumulate)`` (the backward of ``x[indices]``): exact per chunk when

    - the batch dim of ``x`` is not indexed, every index is shared, and the values carry the batch where
      ``x[indices]`` has it (or are shared);
    - ``x`` is made of zeros, ``accumulate`` is set and the values (and per-example indices) carry the batch on
      one broadcast index dim: each chunk scatters its own share and the shares sum (an embedding table's
      gradient by position ids);
    - ``x`` is per-example, or shared with one row per example, and its batch dim is indexed by each
      example's own position (the backward of ``logits[arange(B), labels]``);
    - ``x`` is shared, no index is per-example, and the values carry the batch along a dim of ``x`` that no
      index touches (``x[:, idx] = values``; the backward of ``logits[:, classes]``): ``x`` is cut to each
      chunk's rows.
    """
    fill = _as_mask_fill(eqn, label)
    if fill is not None:
        return fill
    x, indices, values = eqn.args[0], list(eqn.args[1]), eqn.args[2]
    accumulate = bool(eqn.args[3] if len(eqn.args) > 3 else eqn.kwargs.get("accumulate", False))
    _no_masks(eqn, indices, label)
    first, x_to_out, width = _placement(x.aval.ndim, indices)
    xl, vl = label(x), label(values)
    tensors = [(d, t) for d, t in enumerate(indices) if isinstance(t, Var)]
    batched_idx = [(t, lab) for _, t in tensors if (lab := label(t)) is not None]
    result_ndim = len(x_to_out) - sum(o is None for o in x_to_out) + width
    offset = result_ndim - values.aval.ndim  # values broadcast against x[indices], aligned right

    if xl is not None and (xl.dim >= len(indices) or indices[xl.dim] is None):
        if batched_idx or (vl is not None and (vl.dim + offset, vl.k, vl.outer) != (x_to_out[xl.dim], xl.k, xl.outer)):
            raise coupling(eqn, "writes values into per-example rows they do not line up with", "batch them alike")
        cut = {}
        if vl is None and values.aval.ndim > x_to_out[xl.dim] - offset >= 0:
            own = x_to_out[xl.dim] - offset
            if values.aval.shape[own] == xl.extent(label.batch) != 1:
                cut[values] = Batched(own, xl.k, xl.outer)
        return Chunked((xl,), slice=cut)

    extent = label.batch
    own_rows = _values_rows(eqn, label) if xl is None else None
    if own_rows is not None:
        # x shared, the values per-example along a dim of x that no index touches (``x[:, idx] = values``, the
        # backward of ``logits[:, classes]``): each chunk writes only its own rows of x.
        if _is_zeros(label, x):  # made in the step (autograd's new_zeros): the chunk's own zeros
            vdim = vl.dim

            def call(n: int) -> tuple[Any, tuple, dict]:
                return _into_own_zeros, (x, indices, values, accumulate, own_rows.dim, vdim), {}

            return Chunked((own_rows,), call=call)
        if label.maker(x) is None:  # an input of the step: cut to the chunk's rows
            return Chunked((own_rows,), slice={x: own_rows})
    dim = xl.dim if xl is not None else next(
        (d for d, t in tensors if label(t) is None and x.aval.shape[d] == extent and extent in t.aval.shape), None
    )
    if dim is None:
        # x is shared: which broadcast index dim carries the batch, the values' or a per-example index's.
        placed = {(lab.dim + width - t.aval.ndim, lab.k, lab.outer) for t, lab in batched_idx}
        if vl is not None:
            placed.add((vl.dim + offset - first, vl.k, vl.outer))
        if len(placed) != 1 or not 0 <= next(iter(placed))[0] < width:
            raise coupling(eqn, "scatters per-example values along dims that do not line up", "batch them alike")
        if not (accumulate and _is_zeros(label, x)):
            raise coupling(
                eqn,
                "writes per-example values into a tensor shared by the whole batch",
                "accumulate into zeros (index_put(..., accumulate=True)), or run without chunking",
            )
        at, k, outer = placed.pop()
        full = Batched(0, k, outer).extent(extent)
        cut = _cut_shared(eqn, tensors, label, at, width, full, k, outer)
        if vl is None:
            cut.update(_cut_shared(eqn, [(0, values)], label, first + at, result_ndim, full, k, outer))
        return Chunked((Reduced("sum"),), slice=cut)

    # The batch dim of x is indexed: by each example's own position.
    own = indices[dim] if dim < len(indices) else None
    rows = [d for d in range(own.aval.ndim) if own.aval.shape[d] == extent != 1] if isinstance(own, Var) else []
    if (xl is not None and (xl.k, xl.outer) != (1, 1)) or label(own) is not None or len(rows) != 1:
        raise coupling(
            eqn,
            "writes into the batch dim at per-example positions",
            "index examples outside the staged function, or run without chunking (a larger memory_budget)",
        )
    at = rows[0] + width - own.aval.ndim
    if (vl is not None and (vl.dim + offset - first, vl.k, vl.outer) != (at, 1, 1)) or any(
        (lab.dim + width - t.aval.ndim, lab.k, lab.outer) != (at, 1, 1) for t, lab in batched_idx
    ):
        raise coupling(eqn, "writes per-example values along dims that do not line up", "batch them alike")
    cut = _cut_shared(eqn, [(d, t) for d, t in tensors if t is not own], label, at, width, extent, 1, 1)
    if xl is None:
        cut[x] = Batched(dim)
    if vl is None:
        cut.update(_cut_shared(eqn, [(0, values)], label, first + at, result_ndim, extent, 1, 1))

    def call(n: int) -> tuple[Any, tuple, dict]:
        return _own_batch_rows_put, (x, indices, values, accumulate, dim, at), {"where": f"{op_name(eqn.prim)} at {eqn.source}"}

    return Chunked((Batched(dim),), call=call, slice=cut)


def index_put_(eqn: Eqn, label: LabelFn) -> Chunked:
    """``x.index_put_(indices, values, accumulate)``: in place into per-example rows as :func:`index_put`
    places them; into a shared tensor of zeros, ``accumulate`` set (a count over the batch, written
    ``zeros(n).index_put_(..., accumulate=True)``), each chunk's share is made apart and the shares sum."""
    fill = _as_mask_fill(eqn, label)
    if fill is not None:
        return fill
    if label(eqn.args[0]) is None and (rows := _values_rows(eqn, label)) is not None:
        # Per-example rows written into a shared tensor: the batch interpreter makes a fresh factory (``buf =
        # torch.zeros(B, ...)``) per chunk, and refuses any other shared tensor.
        return Chunked((rows,))
    decision = index_put(eqn, label)
    if isinstance(decision.out[0], Reduced):

        def call(n: int) -> tuple[Any, tuple, dict]:
            return aten.index_put.default, eqn.args, eqn.kwargs

        return Chunked(decision.out, call=call, slice=decision.slice, out_of_place=True)
    if decision.call is not None and label(eqn.args[0]) is not None:
        # Each example's own row of a per-example x (``h[torch.arange(B), y] = v``): written in place into the
        # chunk's rows, at the chunk's own positions.
        own = decision.call

        def call_in_place(n: int) -> tuple[Any, tuple, dict]:
            _, args, kwargs = own(n)
            return _own_batch_rows_put_, args, kwargs

        return attrs.evolve(decision, call=call_in_place)
    if decision.call is not None or label(eqn.args[0]) is None:
        raise coupling(
            eqn,
            "writes in place into rows of the batch dim chosen by an index",
            "use the out-of-place x.index_put(...) (or x[idx] = v on a per-example x), or run without chunking",
        )
    return decision


def _pairings_declared(rule: Callable[[Eqn, LabelFn], Chunked]) -> Callable[[Eqn, LabelFn], Chunked]:
    """``rule``, declaring every shared operand it does not cut read whole (``Chunked.whole``). Advanced
    indexing pairs no dim of ``x`` with the indices (``x[idx]`` looks ``x`` up: each example reads every row
    it names), only the indices with each other and the values with ``x[indices]``, by broadcasting; each
    branch of the rules above places every operand by that, cutting the ones that carry the batch."""

    def declared(eqn: Eqn, label: LabelFn) -> Chunked:
        decision = rule(eqn, label)
        operands = [v for _, v in arg_vars(eqn.args)] + [v for v in eqn.kwargs.values() if isinstance(v, Var)]
        shared = {v for v in operands if label(v) is None and v not in decision.slice}
        return attrs.evolve(decision, whole=decision.whole | shared)

    declared.__doc__ = rule.__doc__
    declared.__name__ = rule.__name__
    return declared


def take(eqn: Eqn, label: LabelFn) -> Chunked:
    """``x.take(index)``: ``x`` read as one flat sequence at the index's positions, the output shaped like the
    index. Per-example positions into a shared ``x`` (a table, a weight) are a lookup: ``x`` is read whole and
    the output carries the index's batch. The flat positions of a per-example ``x`` run across the examples, so
    no chunk can place them."""
    x, index = eqn.args[0], eqn.args[1]
    if label(x) is not None:
        raise coupling(
            eqn,
            "reads a per-example tensor at flat positions, which run across the examples",
            "take along a non-batch dim (x.take_along_dim(idx, dim=1), x.gather(1, idx)), or run without chunking",
        )
    return Chunked((label(index),), whole=frozenset({x}))


def put(eqn: Eqn, label: LabelFn) -> Chunked:
    """``x.put(index, source, accumulate)`` (the backward of :func:`take`: ``zeros_like(x).put_(index, grad,
    True)``): per-example positions and values added into a shared tensor of zeros, each chunk's share made
    apart and the shares summed (in place too, where nothing reads the zeros but through the result). Into a
    per-example ``x``, or without ``accumulate``, the flat positions cross the examples: refused."""
    x, index, source = eqn.args[0], eqn.args[1], eqn.args[2]
    accumulate = bool(eqn.args[3] if len(eqn.args) > 3 else eqn.kwargs.get("accumulate", False))
    li, ls = label(index), label(source)
    if label(x) is not None or not accumulate or not _is_zeros(label, x) or li is None or ls not in (None, li):
        raise coupling(
            eqn,
            "writes at flat positions, which run across the examples",
            "accumulate per-example values into zeros (zeros.put_(idx, v, accumulate=True)), or run without chunking",
        )
    cut = {}
    if ls is None:
        if source.aval.shape != index.aval.shape:
            raise coupling(eqn, "puts shared values that do not pair with the positions", "batch them alike")
        cut[source] = li
    in_place = eqn.prim.overloadpacket is aten.put_

    def call(n: int) -> tuple[Any, tuple, dict]:
        return aten.put.default, eqn.args, eqn.kwargs

    return Chunked((Reduced("sum"),), call=call if in_place else None, slice=cut, out_of_place=in_place,
                   whole=frozenset({x}))


# index_put by packet: ops/moe.py registers the routing's own use of it on the packet too, after this family,
# and hands every other use back to this table.
BATCH: dict = {
    aten.index.Tensor: _pairings_declared(index),
    aten._unsafe_index.Tensor: _pairings_declared(index),
    aten.index_put: _pairings_declared(index_put),
    aten._unsafe_index_put: _pairings_declared(index_put),
    aten.index_put_: _pairings_declared(index_put_),
    aten.take: take,
    aten.put: put,
    aten.put_: put,
}

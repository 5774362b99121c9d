"""Rules for mixture-of-experts layers: the grouped matrix product ``aten._grouped_mm`` that runs every
expert in one kernel, and the routing around it.

``_grouped_mm(a, b, offs)`` multiplies groups of rows (or columns) of one operand by one matrix each of the
other; ``offs`` holds the groups' cumulative ends. Its layouts:

- ``a [M, K]`` 2-d, ``b [G, K, N]`` 3-d: rows ``offs[g-1]:offs[g]`` of ``a`` times ``b[g]`` -> ``[M, N]``
  (an MoE layer's experts over its tokens, sorted by expert);
- ``a [G, M, K]`` 3-d, ``b [K, N]`` 2-d: ``a[g]`` times columns ``offs[g-1]:offs[g]`` of ``b`` -> ``[M, N]``;
- ``a [M, K]`` 2-d, ``b [K, N]`` 2-d: columns ``offs[g-1]:offs[g]`` of ``a`` times those rows of ``b``
  -> ``[G, M, N]`` (the expert weights' gradient: a sum over each expert's tokens);
- ``a [G, M, K]``, ``b [G, K, N]``, no ``offs``: a batched product -> ``[G, M, N]``.

Its meta kernel accepts bfloat16 only (the CUDA kernel's fast path), while the CPU kernel runs float32,
float16 and bfloat16: the shape rule here follows the kernel, and the tracer believes it where the meta
kernel refuses.

Routing, for chunked runs. An MoE layer sorts the (token, expert) pairs of the whole batch by expert, runs
each expert on its group of rows, and puts the rows back in token order. A chunk that runs the same code on
its own tokens sorts them into another order and forms other groups, yet every row it puts back equals the
whole batch's row for that token: each row of the sorted block is computed from its own token, its own
expert's weights and nothing else, a row's group being a function of its own expert id. The labels below
let the batch rules follow that argument op by op (each a :class:`~stagetorch.interpreters.batching.Batched`, so the
executor sizes them per chunk; the generic rules keep their class, and refuse to combine them with plainly
batched values):

- :class:`Routed`: a chunk's rows in the order its sort chose; never a slice of the whole batch's value,
  so it may only feed row-wise ops, the grouped product, and the ops that put rows back;
- :class:`Positions`: per row in batch order, its position among the routed rows (the inverse of the sort);
- :class:`GroupCounts`: the chunk's rows per expert (or their running sums, a grouped product's ``offs``).

Where a rule relies on what an index holds (``perm // top_k``, the sort's inverse, offsets counted from the
sorted ids), the label says which Var holds it, set by the rule of the op that computed it: a value computed
from it by any other op does not inherit the claim. Offsets counted by ``histc`` from the sorted ids (with
any bins: they are monotone in the id) put each row in the group of its own id. What only the data can say
(the inverse is written from ``arange``) is checked when a chunk runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import attrs
import torch

from ..errors import BatchCouplingError, ShapeError, UnsupportedOpError
from ..interpreters import batch_rules, batching
from ..interpreters.batching import Batched, Chunked, LabelFn, Reduced, coupling
from ..ir import Aval, Eqn, Var, op_name
from . import elementwise, indexing, reductions, views

aten = torch.ops.aten

_GROUPED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _refuse(why: str, *avals: Any) -> ShapeError:
    shapes = ", ".join(str(a) for a in avals if isinstance(a, Aval))
    return ShapeError(f"aten._grouped_mm: {why} ({shapes})")


def grouped_mm(a: Aval, b: Aval, offs: Aval | None = None, bias: Aval | None = None, out_dtype: Any = None) -> Aval:
    """The output of ``aten._grouped_mm`` in each of its four layouts, with the kernel's checks."""
    operands = (a, b, offs)
    if a.ndim not in (2, 3) or b.ndim not in (2, 3):
        raise _refuse("operands must be 2-d or 3-d", *operands)
    for name, x in (("mat_a", a), ("mat_b", b)):
        if x.dtype not in _GROUPED_DTYPES:
            raise _refuse(f"{name} must be float32, float16 or bfloat16, not {x.dtype}", *operands)
    if a.dtype != b.dtype:
        raise _refuse("operands must have the same dtype", *operands)
    if out_dtype is not None and out_dtype != a.dtype:
        raise _refuse(f"out_dtype {out_dtype} must be the operands' dtype", *operands)
    if bias is not None:
        raise _refuse("a bias is not supported", *operands)
    grouped = a.ndim == 2 or b.ndim == 2
    if grouped != (offs is not None):
        raise _refuse("offsets are needed exactly when an operand is 2-d", *operands)
    if offs is not None and (offs.ndim != 1 or offs.dtype != torch.int32):
        raise _refuse("offsets must be a 1-d int32 tensor", *operands)
    if a.shape[-1] != b.shape[-2]:
        raise _refuse(f"contraction dims differ: {a.shape[-1]} vs {b.shape[-2]}", *operands)
    if a.ndim == 2 and b.ndim == 2:
        shape: tuple[int, ...] = (offs.shape[0], a.shape[0], b.shape[1])
    elif a.ndim == 2:
        if offs.shape[0] != b.shape[0]:
            raise _refuse(f"{offs.shape[0]} offsets for {b.shape[0]} matrices", *operands)
        shape = (a.shape[0], b.shape[2])
    elif b.ndim == 2:
        if offs.shape[0] != a.shape[0]:
            raise _refuse(f"{offs.shape[0]} offsets for {a.shape[0]} matrices", *operands)
        shape = (a.shape[1], b.shape[1])
    else:
        if a.shape[0] != b.shape[0]:
            raise _refuse(f"batch sizes differ: {a.shape[0]} vs {b.shape[0]}", *operands)
        shape = (a.shape[0], a.shape[1], b.shape[2])
    return Aval(shape, a.dtype, a.device)


def grouped_mm_flops(eqn: Eqn) -> int:
    """Each output entry is one dot product over the contraction dim, except in the 2-d x 2-d layout, where
    the groups split the contraction dim between them (``M x K x N`` multiply-adds in all). Rows past
    ``offs[-1]`` are counted: the bound, reached when every row belongs to a group."""
    a, b = eqn.args[0], eqn.args[1]
    assert isinstance(a, Var) and isinstance(b, Var)
    out = eqn.outvars[0].aval.shape
    k = a.aval.shape[-1]
    if a.aval.ndim == 2 and b.aval.ndim == 2:
        return 2 * a.aval.numel * b.aval.shape[1]
    return 2 * math.prod(out) * k


# ---------------------------------------------------------------------------------------------------------
# Labels of routed values, and the batch rules that make and read them.


@attrs.frozen
class Routed(Batched):
    """A chunk's rows along ``dim`` in the order its sort chose: row ``r`` belongs to the row ``perm[r]`` of
    the sort's input (``perm``: the sort's indices, which name the routing).

    ``holds`` says what the value itself is, where a rule relies on it: ``("perm", v, d)`` when the Var ``v``
    holds ``perm // d``, ``("keys", v)`` when ``v`` holds the sorted ids (or a cast of them). The generic
    rules copy a label to what they compute, ``v`` and all; a rule believes ``holds`` of its argument ``x``
    only where ``v is x``."""

    chunk_local: ClassVar[bool] = True  # see stagetorch.interpreters.chunked._check_chunk_local
    perm: Any = None
    holds: Any = attrs.field(default=None, eq=False)  # what one value holds, not how the rows are laid out


@attrs.frozen
class Positions(Batched):
    """Per row in batch order, its position among the rows :class:`Routed` by ``perm`` (its inverse), held
    by the Var ``holds``."""

    chunk_local: ClassVar[bool] = True  # see stagetorch.interpreters.chunked._check_chunk_local
    perm: Any = None
    holds: Any = attrs.field(default=None, eq=False)


@attrs.frozen
class GroupCounts(Batched):
    """How many of a chunk's rows routed by ``perm`` go to each expert (``holds == ("counts", v)``: ``histc``
    of the sorted ids) or their running sums (``("offsets", v)``): ``size`` entries whatever the chunk."""

    chunk_local: ClassVar[bool] = True  # see stagetorch.interpreters.chunked._check_chunk_local
    perm: Any = None
    holds: Any = attrs.field(default=None, eq=False)
    size: int = 0

    def extent(self, batch: int) -> int:
        return self.size


_ROUTING = (Routed, Positions, GroupCounts)


def _routing(*labels: Any) -> bool:
    return any(isinstance(lab, _ROUTING) for lab in labels)


def _holds(lab: Any, x: Any, kind: str) -> tuple | None:
    """``lab.holds`` when it speaks of ``x`` itself and is of ``kind``."""
    holds = getattr(lab, "holds", None)
    return holds if isinstance(holds, tuple) and holds[0] == kind and holds[1] is x else None


def _delegate(table: dict, op: Any, eqn: Eqn, label: LabelFn) -> Chunked:
    """The rule another family gives ``op``, for values without routing labels."""
    rule = table.get(op) or table.get(getattr(op, "overloadpacket", op))
    if rule is None:
        raise UnsupportedOpError(
            f"{op_name(eqn.prim)} at {eqn.source} reads a per-example value, and stagetorch has no batch rule "
            "for it in this use.\nWhat to do: run without chunking (a larger memory_budget)."
        )
    return rule(eqn, label)


def _refused(why: str) -> BatchCouplingError:
    return BatchCouplingError(
        f"An MoE layer's routing {why}, so running the batch in chunks would change the result.\nWhat to do: run "
        "without chunking (a larger memory_budget)."
    )


def sort(eqn: Eqn, label: LabelFn) -> Chunked:
    """``sort`` over the batch dim of a 1-d value (a router's expert ids, one per (token, expert) pair): the
    chunk sorts its own rows; both outputs are :class:`Routed` by the indices."""
    x = eqn.args[0]
    lab = label(x)
    stable = eqn.prim is aten.sort.stable
    dim = eqn.kwargs.get("dim", -1) if stable else (eqn.args[1] if len(eqn.args) > 1 else eqn.kwargs.get("dim", -1))
    if lab is None or dim % max(x.aval.ndim, 1) != lab.dim:
        return _delegate(reductions.BATCH, eqn.prim, eqn, label)
    if _routing(lab) or x.aval.ndim != 1 or lab.outer != 1:
        raise coupling(
            eqn,
            "sorts along the batch dim of a value other than a 1-d list of per-example rows",
            "sort one key per row (a flat list of expert ids), or run without chunking (a larger memory_budget)",
        )
    values, perm = eqn.outvars
    routed = Routed(0, lab.k, 1, perm=perm)
    descending = eqn.kwargs.get("descending", False) if stable else (eqn.args[2] if len(eqn.args) > 2 else eqn.kwargs.get("descending", False))
    # Groups are counted in ascending order of id: descending ids would put rows in other experts' groups.
    keys = None if descending else ("keys", values)
    return Chunked((attrs.evolve(routed, holds=keys), attrs.evolve(routed, holds=("perm", perm, 1))))


def cast(eqn: Eqn, label: LabelFn) -> Chunked:
    """``_to_copy``: a cast of the sorted ids still holds them (``histc`` on CPU wants floats; expert ids are
    small integers, exact in any float type)."""
    x = eqn.args[0]
    lab = label(x)
    decision = _delegate(_ELEMENTWISE, eqn.prim, eqn, label)
    if _holds(lab, x, "keys") is not None and not eqn.outvars[0].aval.dtype.is_complex:
        return attrs.evolve(decision, out=(attrs.evolve(lab, holds=("keys", eqn.outvars[0])),))
    return decision


def floor_divide(eqn: Eqn, label: LabelFn) -> Chunked:
    """``perm // top_k``: a routed (token, expert) pair's token."""
    x, d = eqn.args[0], eqn.args[1]
    lab = label(x)
    decision = batching.elementwise(eqn, label)
    held = _holds(lab, x, "perm")
    if held is not None and isinstance(d, int) and not isinstance(d, bool) and d > 0:
        return attrs.evolve(decision, out=(attrs.evolve(lab, holds=("perm", eqn.outvars[0], held[2] * d)),))
    return decision


def count() -> Callable[[Eqn, LabelFn], Chunked]:
    """``histc``: over plainly batched values a count that chunks add up; over the sorted expert ids the
    chunk's own group sizes (a grouped product's ``offs`` to be)."""

    def rule(eqn: Eqn, label: LabelFn) -> Chunked:
        x = eqn.args[0]
        lab = label(x)
        if type(lab) is Batched:
            return Chunked((Reduced("sum"),))
        if isinstance(lab, Routed) and _holds(lab, x, "keys") is not None:
            counts = eqn.outvars[0]
            return Chunked((GroupCounts(0, perm=lab.perm, holds=("counts", counts), size=counts.aval.shape[0]),))
        raise coupling(eqn, "counts routed values other than the sorted expert ids", "count the sorted ids")

    return rule


def cumsum(eqn: Eqn, label: LabelFn) -> Chunked:
    """The running sum of the group sizes is the grouped product's ``offs``: the chunk's own."""
    x = eqn.args[0]
    lab = label(x)
    if isinstance(lab, GroupCounts) and _holds(lab, x, "counts") is not None:
        return Chunked((attrs.evolve(lab, holds=("offsets", eqn.outvars[0])),))
    if _routing(lab):
        raise coupling(eqn, "sums routed values other than the group sizes", "sum the counts of the sorted ids")
    return _delegate(reductions.BATCH, eqn.prim, eqn, label)


_ELEMENTWISE = elementwise.BATCH
_bmm_like = batch_rules.contraction("gmk,gkn->gmn")


def grouped_mm_batch(eqn: Eqn, label: LabelFn) -> Chunked:
    """``_grouped_mm`` over rows :class:`Routed` by one sort, with ``offs`` counted from the same sort's ids:
    2-d x 3-d gives routed rows (each row times its own expert); 2-d x 2-d (the expert weights' gradient) a sum
    over each expert's rows, which chunks add up. 3-d x 3-d is a batched product."""
    a, b = eqn.args[0], eqn.args[1]
    offs = eqn.args[2] if len(eqn.args) > 2 else eqn.kwargs.get("offs")
    if offs is None:
        return _bmm_like(eqn, label)
    la, lb, lo = label(a), label(b), label(offs)
    if not isinstance(lo, GroupCounts) or _holds(lo, offs, "offsets") is None:
        raise coupling(
            eqn,
            "groups rows by position with offsets not counted from the routing that ordered them",
            "sort the rows by expert id and count the offsets from the sorted ids (histc + cumsum), or run "
            "without chunking (a larger memory_budget)",
        )
    routed = [(lab, d) for lab, d in ((la, 0 if a.aval.ndim == 2 and b.aval.ndim == 3 else 1), (lb, 0)) if lab is not None]
    if any(not isinstance(lab, Routed) or lab.perm is not lo.perm or lab.dim != d for lab, d in routed):
        raise coupling(eqn, "multiplies rows in an order other than the routing's", "route the rows with one sort")
    if a.aval.ndim == 2 and b.aval.ndim == 3 and la is not None and lb is None:
        return Chunked((attrs.evolve(la, holds=None),))
    if a.aval.ndim == 2 and b.aval.ndim == 2 and la is not None and lb is not None:
        return Chunked((Reduced("sum"),))
    raise coupling(eqn, "groups per-example values in a layout stagetorch cannot chunk", "run without chunking")


def _one_index(eqn: Eqn, indices: list) -> Var:
    if len(indices) != 1 or not isinstance(indices[0], Var) or indices[0].aval.ndim != 1:
        raise coupling(eqn, "indexes routed rows with other than one flat index", "index with one flat index")
    return indices[0]


def index(eqn: Eqn, label: LabelFn) -> Chunked:
    """``x[i]`` around a routing: gathering each routed pair's token (``x[perm // top_k]``), looking up a
    shared table by routed ids, and putting routed rows back in token order (``y[inv_perm]``)."""
    x, indices = eqn.args[0], list(eqn.args[1])
    lx = label(x)
    lis = [label(t) for t in indices if isinstance(t, Var)]
    if not _routing(lx, *lis):
        return _delegate(indexing.BATCH, eqn.prim, eqn, label)
    idx = _one_index(eqn, indices)
    li = label(idx)
    rows = attrs.evolve(li, holds=None) if isinstance(li, Routed) else None
    if lx is None and rows is not None:
        return Chunked((rows,), whole=frozenset({x}))  # a table looked up by routed ids
    held = _holds(li, idx, "perm")
    if type(lx) is Batched and held is not None and lx.dim == 0 and lx.outer == 1 and li.k == lx.k * held[2]:
        return Chunked((rows,))
    if isinstance(lx, Routed) and isinstance(li, Positions) and li.holds is idx and li.perm is lx.perm and lx.dim == 0 and li.k == lx.k:
        return Chunked((Batched(0, li.k),))
    raise coupling(
        eqn,
        "indexes with a routed index other than each row's own (perm // top_k, or the sort's inverse)",
        "gather with perm // top_k and put rows back with the sort's inverse, or run without chunking",
    )


def _arange_into(dest: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``dest[perm] = arange(len)``, the inverse of a chunk's sort: the whole batch's ``arange`` is the
    chunk's positions ``0..rows-1``."""
    own = torch.arange(values.shape[0], device=values.device, dtype=values.dtype)
    if not torch.equal(values, own):
        raise _refused("writes values other than the positions 0, 1, 2, ... at its sorted indices")
    return dest.index_put_([idx], own[: idx.shape[0]])


def _scatter_rows(dest: torch.Tensor, idx: torch.Tensor, values: torch.Tensor, rows: int) -> torch.Tensor:
    """``dest.index_put([idx], values, accumulate=True)`` into zeros, at the chunk's size (``dest`` is the
    whole batch's zeros, made by a factory that is the same in every chunk)."""
    return aten.index_put.default(_zeros_at(dest, 0, rows), [idx], values, True)


def index_put(eqn: Eqn, label: LabelFn) -> Chunked:
    """``index_put`` around a routing: ``inv_perm[perm] = arange(n)`` (the sort's inverse) and the backward of
    the gathers in :func:`index`, which add rows into zeros."""
    dest, indices, values = eqn.args[0], list(eqn.args[1]), eqn.args[2]
    accumulate = eqn.args[3] if len(eqn.args) > 3 else eqn.kwargs.get("accumulate", False)
    ld, lv = label(dest), label(values)
    lis = [label(t) for t in indices if isinstance(t, Var)]
    if not _routing(ld, lv, *lis):
        return _delegate(indexing.BATCH, eqn.prim, eqn, label)
    idx = _one_index(eqn, indices)
    li = label(idx)
    held = _holds(li, idx, "perm")
    if not accumulate:
        if (
            held is not None and held[2] == 1 and isinstance(ld, Routed) and ld.perm is li.perm
            and lv is None and isinstance(values, Var) and values.aval.shape == idx.aval.shape
        ):

            def call(n: int) -> tuple[Any, tuple, dict]:
                return _arange_into, (dest, idx, values), {}

            # (the destination and the positions written are read whole: the call checks the positions)
            return Chunked((Positions(0, li.k, perm=li.perm, holds=eqn.outvars[0]),), call=call,
                           whole=frozenset({dest, values}))
        raise coupling(eqn, "writes at routed positions other than the sort's inverse", "write arange at the sort's indices")
    if ld is not None:
        raise coupling(eqn, "adds routed rows into per-example values", "add them into zeros")
    if isinstance(li, Positions) and li.holds is idx and type(lv) is Batched and lv.dim == 0 and lv.k == li.k:
        out: Batched = Routed(0, li.k, perm=li.perm)
    elif held is not None and isinstance(lv, Routed) and lv.perm is li.perm and lv.dim == 0 and li.k % held[2] == 0:
        out = Batched(0, li.k // held[2])
    else:
        raise coupling(
            eqn,
            "adds rows back at positions other than each routed row's own (perm // top_k, or the sort's inverse)",
            "add them back with their own sort's indices, or run without chunking",
        )
    if dest.aval.shape[0] != out.extent(label.batch):
        raise coupling(eqn, "adds routed rows into a tensor without a row per token", "add them into zeros with one row per token")

    def call(n: int) -> tuple[Any, tuple, dict]:
        return _scatter_rows, (dest, idx, values, out.extent(n)), {}

    return Chunked((out,), call=call, whole=frozenset({dest}))  # zeros, made at the chunk's size


def _zeros_at(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``x`` at ``size`` entries along ``dim``: where a factory the same in every chunk made it at the whole
    batch's size, it must be zeros (a gradient's start), and the chunk's are zeros too."""
    if x.shape[dim] == size:
        return x
    if bool(x.any()):
        raise BatchCouplingError(
            "A scatter into a tensor of the whole batch's size, not made of zeros, from per-example values: "
            "running the batch in chunks would change the result.\nWhat to do: scatter into zeros, or run "
            "without chunking (a larger memory_budget)."
        )
    shape = list(x.shape)
    shape[dim] = size
    return x.new_zeros(shape)


def _scatter_rows_of(prim: Any, dim: int, extent: int) -> Callable[..., torch.Tensor]:
    def run(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return prim(_zeros_at(x, dim, extent), *args, **kwargs)

    return run


def _scatter_into_zeros(prim: Any) -> Callable[..., torch.Tensor]:
    def run(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if bool(x.any()):
            raise BatchCouplingError(
                "A scatter_add over the batch dim into a tensor that is not zeros: each chunk would add it "
                "again.\nWhat to do: scatter into zeros and add the tensor after, or run without chunking."
            )
        return prim(x, *args, **kwargs)

    return run


def scatter(eqn: Eqn, label: LabelFn) -> Chunked:
    """``scatter``/``scatter_add(x, dim, index, src)`` with per-example ``index`` and ``src`` into a shared
    ``x``: along another dim each example's rows land in its own rows of ``x`` (the backward of ``topk``
    scatters into ``new_zeros`` of the whole batch's size); along the batch dim ``scatter_add`` into zeros
    counts over the batch (a router's tokens per expert), a sum the chunks add up; in place too, where nothing
    reads the zeros but through the result."""
    x, dim, index = eqn.args[0], eqn.args[1], eqn.args[2]
    lx, li = label(x), label(index)
    others = [label(v) for v in eqn.args[3:] if isinstance(v, Var)]
    if _routing(lx, li, *others) or lx is not None or li is None or x.aval.ndim != index.aval.ndim:
        return _delegate(views.BATCH, eqn.prim, eqn, label)
    dim %= x.aval.ndim
    if any(lab is not None and lab != li for lab in others):
        raise coupling(eqn, "scatters values batched otherwise than their index", "batch them alike")
    # A shared source pairs entry by entry with the index on every dim (``out[index[i][j]][j] = src[i][j]``):
    # its rows along the index's batch dim are the examples', cut to the chunk with the index.
    cut = {}
    for v in eqn.args[3:]:
        if isinstance(v, Var) and label(v) is None:
            if v.aval.shape[li.dim] != li.extent(label.batch):
                raise coupling(
                    eqn,
                    f"scatters a shared source whose dim {li.dim} ({v.aval.shape[li.dim]} entries) pairs entry by "
                    f"entry with the index's {li.extent(label.batch)} examples",
                    "give the source one row per example and pass it to the staged function as an argument "
                    "(batched), or run without chunking (a larger memory_budget)",
                )
            cut[v] = li
    if dim != li.dim:
        if x.aval.shape[li.dim] != li.extent(label.batch):
            raise coupling(eqn, "scatters per-example rows into a tensor without a row per example", "scatter into zeros shaped like the batch")

        def call(n: int) -> tuple[Any, tuple, dict]:
            return _scatter_rows_of(eqn.prim, li.dim, li.extent(n)), eqn.args, eqn.kwargs

        return Chunked((li,), call=call, slice={x: li, **cut})
    if eqn.prim.overloadpacket in (aten.scatter_add, aten.scatter_add_):
        # In place (``zeros(E).scatter_add_(...)``, transformers' load-balancing loss under an attention
        # mask), each chunk would add into the one shared tensor: the chunk's partial is made apart instead.
        in_place = eqn.prim.overloadpacket is aten.scatter_add_

        def call(n: int) -> tuple[Any, tuple, dict]:
            return _scatter_into_zeros(aten.scatter_add.default), eqn.args, eqn.kwargs

        # The zeros each chunk's share lands in are read whole (checked zeros when it runs).
        return Chunked((Reduced("sum"),), call=call, slice=cut, out_of_place=in_place, whole=frozenset({x}))
    raise coupling(eqn, "scatters over the batch dim, where a later example overwrites an earlier one", "use scatter_add")


SHAPE: dict = {aten._grouped_mm: grouped_mm}

FLOPS: dict = {aten._grouped_mm: grouped_mm_flops}

BATCH: dict = {
    aten._grouped_mm: grouped_mm_batch,
    aten.sort.default: sort,
    aten.sort.stable: sort,
    aten.histc: count(),
    aten.cumsum: cumsum,
    aten.index.Tensor: index,
    aten.index_put: index_put,
    aten.index_put_: index_put,
    aten.scatter.src: scatter,
    aten.scatter.value: scatter,
    aten.scatter_add: scatter,
    aten.scatter_add_: scatter,
    aten.floor_divide: floor_divide,
    aten._to_copy: cast,
}

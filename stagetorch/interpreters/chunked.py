"""The chunked executor: runs a Graph over a batch in chunks, combining them into the full-batch result.

From the batch analysis it splits the graph into three graphs: ``shared`` (run once, first), ``body`` (run
once per chunk, built for each chunk size by the equations' batch rules) and ``post`` (run once, after the
chunks, on the combined reductions). Each is an ordinary Graph that the eager interpreter runs and the
memory interpreter costs, so the plan is costed on exactly what runs.

Each chunk folds its results into the accumulators as soon as they are made. Nothing is written to a real
``.grad`` until every chunk has succeeded; a chunk that runs out of memory spoils the accumulators it has
added into, so the whole pass is dropped and redone in chunks of half that size: no gradient is counted twice.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from ..ir import Aval, Eqn, Graph, Literal, Var, contiguous_strides, iter_vars, restrided
from ..transforms.schedule import fold_partials, writes
from ..utils.tree import map_leaves
from .batching import BatchAnalysis, Batched, Global, Prepass, Reduced, coupling
from .eager import Program
from .undo import Undo

__all__ = ["Split", "run_chunked", "even_chunks", "is_oom", "ChunkOutOfMemory", "slice_examples"]

log = logging.getLogger("stagetorch")


def _chunk_aval(v: Var, label: Any, n: int) -> Aval:
    if isinstance(label, Batched):
        shape = list(v.aval.shape)
        shape[label.dim] = label.extent(n)
        return Aval(tuple(shape), v.aval.dtype, v.aval.device)
    return v.aval


def _chunk_var(v: Var, label: Any, n: int) -> Var:
    """A chunk's input cut from ``v``: a narrowed view of it, with its strides (or, where the cut is not
    dense, a copy laid out as ``v`` is: see :func:`_gapped`)."""
    aval = _chunk_aval(v, label, n)
    if _gapped(v, label):
        return Var(aval, strides=restrided(v.strides or contiguous_strides(v.aval.shape), v.aval.shape, aval.shape))
    return Var(aval, strides=v.strides)


def _gapped(v: Var, label: Any) -> bool:
    """Whether a chunk of ``v`` cut along its batch dim has gaps (a dim laid out outside the batch's, as with
    ``batch_dim=1``): the chunk is then copied dense, as the graph's views (recorded on the dense whole
    batch) need it to be and as eager PyTorch's ``reshape`` would copy it."""
    if not isinstance(label, Batched) or label.outer != 1:
        return False  # an outer-batched cut is made by a reshape, which copies where it must
    shape = v.aval.shape
    strides = v.strides or contiguous_strides(shape)
    return any(shape[d] != 1 and strides[d] > strides[label.dim] for d in range(len(shape)) if d != label.dim)


def _swap(table: dict[Var, Var], v: Var) -> Var:
    return table.get(v, v)


def _empty(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


@attrs.define
class BodyGraph:
    """The per-chunk programs for chunks of ``n`` examples and how their inputs are cut from the batch.

    A chunk folds each result into its accumulator as soon as the result's last reader has run, so no
    partial outlives its use. ``first`` runs the first chunk: it hands its partials over as the
    accumulators (a copy only for one that shares storage with an input or another result). ``rest`` runs
    every later chunk: the accumulators are its inputs and it adds into them in place. Per-example results
    are copied into the full tensor as they are produced, in both.
    """

    first: Graph
    rest: Graph
    # Per body invar: ("batch", original var, Batched) cut from a batched graph input; ("slice", var,
    # Batched) cut from a shared value; ("full", var) a shared or global value as it is; ("into", var,
    # Batched) this chunk's rows of the full per-example result; ("acc", var) an accumulator (``rest`` only).
    first_feeds: list[tuple]
    rest_feeds: list[tuple]
    # Per original var the chunks combine: how ("cat", "sum"/"max"/"min", "same").
    results: list[tuple[Var, str]]
    # The original vars ``first`` hands over as accumulators, parallel to its outvars.
    handed: list[Var]
    # The body values each chunk folds (the partials), parallel to ``results``.
    partials: list[Var]
    # Bytes held across the chunks: the full per-example results, and the accumulators with the values
    # kept as they are (those in storage of their own).
    held_bytes: tuple[int, int] = (0, 0)
    # Per original var the chunk's equations make or read, the chunk's var that stands for it (the joint
    # planner costs recompute sets on the chunk's graph: stagetorch.planning.remat_frontier.chunk_frontier).
    vars: dict[Var, Var] = attrs.field(factory=dict)
    _programs: dict[bool, Program] = attrs.field(factory=dict)

    def program(self, first: bool) -> Program:
        if first not in self._programs:
            self._programs[first] = Program(self.first if first else self.rest)
        return self._programs[first]


def _add_into(acc: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return acc.add_(x)


def _max_into(acc: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.maximum(acc, x, out=acc)


def _min_into(acc: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.minimum(acc, x, out=acc)


def _copy_into(rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return rows.copy_(x)


_FOLD = {"sum": _add_into, "max": _max_into, "min": _min_into, "cat": _copy_into}


def _combine_kind(label: Any) -> str:
    if isinstance(label, Batched):
        return "cat"
    if isinstance(label, Reduced):
        return label.kind
    return "same"


def _check_chunk_local(analysis: BatchAnalysis, results: list[Var]) -> None:
    """Refuse what would combine or cut a chunk-local value: one whose label says its rows are the chunk's
    own in an order the chunk chose (an MoE layer's tokens sorted by expert, ``chunk_local`` on the label's
    class). Such a value is no slice of the whole batch's, so it can be neither a result the chunks are
    concatenated into nor the rows a shared value is cut to."""
    labels, graph = analysis.labels, analysis.graph
    for i, decision in analysis.decisions.items():
        e = graph.eqns[i]
        if any(getattr(cut, "chunk_local", False) for cut in decision.slice.values()):
            raise coupling(
                e,
                "lines up a shared value against rows that each chunk orders its own way",
                "combine the reordered rows only with each other and with values of one row per token",
            )
        bad = next((v for v in e.outvars if v in results and getattr(labels.get(v), "chunk_local", False)), None)
        if bad is not None:
            error = coupling(
                e,
                "makes a result (an output, or a value read after the batch) whose rows each chunk orders its own "
                "way",
                "return values in token order (put reordered rows back first)",
            )
            error.chunk_local_result = True  # one-line mode computes only what a mid-step read needs instead
            raise error


class Split:
    """A graph split by its batch analysis into shared, body and post graphs."""

    def __init__(self, analysis: BatchAnalysis):
        self.analysis = analysis
        graph = analysis.graph
        self.graph = graph
        labels = analysis.labels
        body_idx = [i for i, p in enumerate(analysis.phases) if p == "body"]
        post_idx = [i for i, p in enumerate(analysis.phases) if p == "post"]
        shared_idx = [i for i, p in enumerate(analysis.phases) if p == "shared"]
        if not analysis.needs_global:  # (a pre-pass runs post equations before the chunks)
            shared_idx, post_idx = _writes_late(graph, shared_idx, post_idx, body_idx)

        final = [v for v in graph.outvars if isinstance(v, Var)] + [v for _, v in graph.grads]
        body_defined = {v for i in body_idx for v in graph.eqns[i].outvars if v is not None}
        body_reads = {v for i in body_idx for v in graph.eqns[i].invars}
        post_reads = {v for i in post_idx for v in graph.eqns[i].invars}

        # What the body hands on: reductions (combined), per-example finals (concatenated), and anything
        # post reads.
        self.body_results: list[Var] = []
        for v in [*final, *post_reads]:
            if v in body_defined and v not in self.body_results:
                self.body_results.append(v)
        _check_chunk_local(analysis, self.body_results)
        self.globals: list[Var] = [v for v in body_defined if isinstance(labels.get(v), Global)]
        self.body_idx = body_idx
        # Batch-wide values (a loss, a sum over examples) that per-example work reads: a pre-pass computes
        # them over every chunk first. Their own computation must not read one (that would need a pass per
        # level: BatchNorm-like coupling).
        self.needs_global = list(analysis.needs_global)
        self._global_post_idx = self._ancestors(post_idx, self.needs_global, "post")
        needed_reduced = [v for v in self.needs_global if isinstance(labels.get(v), Reduced)]
        for i in self._global_post_idx:
            # Each once, however many equations read it: a partial listed twice was summed twice.
            needed_reduced += [
                v for v in graph.eqns[i].invars if isinstance(labels.get(v), Reduced) and v not in needed_reduced
            ]
        self.reduced_for_globals = needed_reduced
        for i in self._ancestors(body_idx, needed_reduced, "body"):
            e = graph.eqns[i]
            read = next((v for v in e.invars if v in self.needs_global), None)
            if read is not None:
                raise coupling(
                    e,
                    "reads a value reduced over the whole batch that itself depends on another batch-wide value",
                    "make the per-example computation depend on at most one level of batch-wide values, or run "
                    "without chunking (a larger memory_budget)",
                )
        self.global_post = self._post_graph(
            self._global_post_idx, [v for v in self.needs_global if labels.get(v) == "post"]
        )
        self.shared = self._shared_graph(shared_idx, body_reads | post_reads | set(final))
        self.post = self._post_graph(post_idx, final)
        self._bodies: dict[int, BodyGraph] = {}
        self._prepasses: dict[tuple[str, int], BodyGraph] = {}
        self.batched_inputs = [v for v in graph.invars if isinstance(labels.get(v), Batched)]
        # Bytes of input storage the graph counts twice (inputs that are views of one storage at run time).
        self.input_overlap = 0

    # -- shared and post graphs ------------------------------------------------------------------------

    # Compiled on first run: a planner that costs a split it then does not choose never compiles them.
    @functools.cached_property
    def shared_program(self) -> Program:
        return Program(self.shared)

    @functools.cached_property
    def post_program(self) -> Program:
        return Program(self.post, final=True)  # the step's last program: its optimizer update is a commit

    def _shared_graph(self, idx: list[int], needed: set[Var]) -> Graph:
        g, an = self.graph, self.analysis
        eqns: list[Eqn] = []
        for i in idx:
            e = g.eqns[i]
            ph = an.placeholders.get(i)
            if ph:
                # ones_like(loss): stand an empty tensor of the loss's aval in for the loss.
                stand_in = {v: Var(a) for v, a in ph.items()}
                for v, s in stand_in.items():
                    eqns.append(Eqn(_empty, (v.aval.shape, v.aval.dtype, v.aval.device), {}, (s,), e.source))
                swap = functools.partial(_swap, stand_in)
                e = Eqn(e.prim, map_leaves(e.args, Var, swap), map_leaves(e.kwargs, Var, swap), e.outvars, e.source)
            eqns.append(e)
        defined = {v for e in eqns for v in e.outvars if v is not None}
        outs = [v for v in g.invars if v in needed] + [v for v in defined if v in needed]
        return Graph(list(g.invars), eqns, outs)

    def _post_graph(self, idx: list[int], final: list[Var]) -> Graph:
        g = self.graph
        eqns = [g.eqns[i] for i in idx]
        defined = {v for e in eqns for v in e.outvars if v is not None}
        reads = []
        for e in eqns:
            for v in e.invars:
                if v not in defined and v not in reads:
                    reads.append(v)
        outs = [v for v in final if v in defined]
        return Graph(reads, eqns, outs)

    def _cuts_of(self, v: Var) -> dict:
        for i, e in enumerate(self.graph.eqns):
            if v in e.outvars and i in self.analysis.decisions:
                return dict(self.analysis.decisions[i].slice)
        return {}

    def _ancestors(self, idx: list[int], targets: list[Var], phase: str) -> list[int]:
        """The equations among ``idx`` that ``targets`` depend on, in program order."""
        needed = set(targets)
        out = []
        for i in reversed(idx):
            e = self.graph.eqns[i]
            if any(v in needed for v in e.outvars if v is not None):
                out.append(i)
                needed |= set(e.invars)
        return sorted(out)

    # -- per-chunk graphs ------------------------------------------------------------------------------

    def body(self, n: int) -> BodyGraph:
        """The body for chunks of ``n`` examples (built once per size)."""
        if n not in self._bodies:
            self._bodies[n] = self._chunk_graph(n, self.body_idx, self.body_results, [])
        return self._bodies[n]

    def normaliser_pass(self, n: int) -> BodyGraph:
        """Per chunk, the partials of what rules compute from the inputs alone (a loss's total weight)."""
        key = ("normaliser", n)
        if key not in self._prepasses:
            extra: list[tuple[Var, Prepass]] = [(v, self.analysis.prepass[v]) for v in self.globals]
            idx = self._ancestors(self.body_idx, [x for _, p in extra for x in iter_vars(p.args)], "body")
            # The formula's arguments are cut as the equation that declared it cuts them.
            extra = [(v, attrs.evolve(p, cuts=self._cuts_of(v))) for v, p in extra]
            self._prepasses[key] = self._chunk_graph(n, idx, [], extra, reads_globals=False)
        return self._prepasses[key]

    def reduction_pass(self, n: int) -> BodyGraph:
        """Per chunk, the partials of the batch-wide reductions that per-example work reads (a loss value)."""
        key = ("reduction", n)
        if key not in self._prepasses:
            idx = self._ancestors(self.body_idx, self.reduced_for_globals, "body")
            self._prepasses[key] = self._chunk_graph(n, idx, self.reduced_for_globals, [], reads_globals=False)
        return self._prepasses[key]

    def _chunk_graph(
        self, n: int, idx: list[int], results: list[Var], extra: list[tuple[Var, Prepass]], reads_globals: bool = True
    ) -> BodyGraph:
        an, labels = self.analysis, self.analysis.labels
        batch_wide = set(self.needs_global) if reads_globals else set()
        mapping: dict[Var, Var] = {}
        feeds: list[tuple] = []
        invars: list[Var] = []
        sliced: dict[tuple[Var, Batched], Var] = {}
        sliced_globals: dict[Var, Var] = {}

        def feed(v: Var, cut: Batched | None = None) -> Var:
            lab = labels.get(v)
            if cut is not None:
                key = (v, cut)
                if key not in sliced:
                    s = _chunk_var(v, cut, n)
                    sliced[key] = s
                    invars.append(s)
                    feeds.append(("slice", v, cut, _gapped(v, cut)))
                return sliced[key]
            if v in batch_wide:
                if v not in sliced_globals:
                    sliced_globals[v] = Var(v.aval, strides=v.strides)
                    invars.append(sliced_globals[v])
                    feeds.append(("full", v))
                return sliced_globals[v]
            if v not in mapping:
                if isinstance(lab, Batched):  # a batched graph input, or a shared value paired with the examples
                    mapping[v] = _chunk_var(v, lab, n)
                    feeds.append(("slice" if v in an.spanning else "batch", v, lab, _gapped(v, lab)))
                else:
                    mapping[v] = Var(v.aval, strides=v.strides)
                    feeds.append(("full", v))
                invars.append(mapping[v])
            return mapping[v]

        eqns: list[Eqn] = []
        made: set[Var] = set()  # the values this chunk's equations make
        for i in idx:
            e = self.graph.eqns[i]
            decision = an.decisions[i]
            prim, args, kwargs = decision.call(n) if decision.call is not None else (e.prim, e.args, e.kwargs)

            def arg(v: Var, decision=decision) -> Var:
                if v in batch_wide:  # the pre-pass's value for the whole batch, not this chunk's partial
                    # (cut to the chunk where it has the batch's extent: a normaliser expanded to the batch)
                    return feed(v, decision.slice.get(v))
                cut = decision.slice.get(v)
                # A value fed whole to an earlier equation is still cut here where this rule asks (the batch
                # analysis refuses a cut of a value the chunk makes itself, or makes it per chunk instead).
                if v in mapping and (cut is None or v in made or isinstance(labels.get(v), Batched)):
                    return mapping[v]
                return feed(v, cut)

            # The arguments first: a view's base may be one of them, fed (whole, or cut to the chunk) only now.
            fed: dict[Var, Var] = {}

            def bind(v: Var, arg=arg, fed=fed) -> Var:
                fed[v] = arg(v)
                return fed[v]

            new_args, new_kwargs = map_leaves(args, Var, bind), map_leaves(kwargs, Var, bind)
            outvars = []
            for v in e.outvars:
                if v is None:
                    outvars.append(None)
                    continue
                lab = labels.get(v)
                base = (mapping.get(v.base) or fed.get(v.base)) if v.base is not None else None
                if decision.out_of_place:  # the call makes its result apart from the argument it wrote
                    base = None
                # (A var of no bytes, a layout token of stagetorch.transforms.rng, has none in a chunk either.)
                aval = _chunk_aval(v, lab, n)
                nv = Var(aval, base=base, storage_nbytes=0 if v.storage_nbytes == 0 else None,
                         strides=restrided(v.strides, v.aval.shape, aval.shape))
                outvars.append(nv)
            new = Eqn(prim, new_args, new_kwargs, tuple(outvars), e.source)
            for v, nv in zip(e.outvars, outvars):
                if v is not None:
                    mapping[v] = nv
                    made.add(v)
            eqns.append(new)
        outs: list[Var] = [mapping[v] for v in results]
        kinds = [(v, _combine_kind(labels.get(v))) for v in results]
        for v, p in extra:
            out = Var(v.aval)
            args = map_leaves(p.args, Var, lambda x, p=p: mapping.get(x) or feed(x, p.cuts.get(x)))
            eqns.append(Eqn(p.fn, args, {}, (out,), self.graph.eqns[0].source))
            outs.append(out)
            kinds.append((v, "sum"))
        return self._fold(n, invars, feeds, eqns, outs, kinds, mapping)

    def _fold(
        self, n: int, invars: list[Var], feeds: list[tuple], eqns: list[Eqn], outs: list[Var], kinds: list[tuple[Var, str]],
        mapping: dict[Var, Var],
    ) -> BodyGraph:
        """The first-chunk and later-chunk graphs (:func:`stagetorch.transforms.schedule.fold_partials`), with how their
        extra inputs (rows of per-example results, accumulators) are fed."""
        labels = self.analysis.labels
        folded = fold_partials(Graph(invars, eqns, outs), [kind for _, kind in kinds], _FOLD)

        def feeds_of(extra: list[tuple[str, int]]) -> list[tuple]:
            out = list(feeds)
            for role, k in extra:
                v = kinds[k][0]
                out.append(("into", v, labels[v]) if role == "into" else ("acc", v))
            return out

        cat = sum(v.aval.nbytes for v, kind in kinds if kind == "cat")  # the full results, not a chunk's
        return BodyGraph(
            folded.first, folded.rest, feeds_of(folded.first_extra), feeds_of(folded.rest_extra), kinds,
            [kinds[k][0] for k in folded.handed], outs, (cat, folded.acc_bytes), mapping,
        )


# ---------------------------------------------------------------------------------------------------------
# Running a split.


def _writes_late(graph: Graph, shared: list[int], post: list[int], body: list[int]) -> tuple[list[int], list[int]]:
    """Shared and post equations, with the shared writes to the graph's inputs that no chunk reads (AdamW's
    ``exp_avg_sq.mul_(beta2)`` and step count, which need no gradient) moved after the chunks, with what
    reads their results: run before the chunk loop, the step had to copy what they write (to restore it if a
    chunk fails) and hold the copy through every chunk; after it, they are the post program's commit."""
    inputs = {v.root for v in graph.invars}
    moved: list[int] = []
    made: set[Var] = set()  # vars the moved equations make, and the inputs they write (by root)
    for i in shared:
        e = graph.eqns[i]
        written = [x.root for x in writes(e) if x.root in inputs]
        if written or any(v in made or v.root in made for v in e.invars):
            moved.append(i)
            made.update(written)
            made.update(v for v in e.outvars if v is not None)
    if not moved:
        return shared, post
    for i in body:
        if any(v in made or v.root in made for v in graph.eqns[i].invars):
            return shared, post  # a chunk reads what they write: they must run before the chunks
    late = set(moved)
    return [i for i in shared if i not in late], sorted([*post, *moved])


def slice_examples(x: torch.Tensor, lab: Batched, start: int, n: int) -> torch.Tensor:
    """Examples ``[start, start + n)`` of ``x`` (a view when the batch is not under an outer dim)."""
    if lab.outer == 1:
        return x.narrow(lab.dim, start * lab.k, n * lab.k)
    inner = x.unflatten(lab.dim, (lab.outer, x.shape[lab.dim] // lab.outer))
    return inner.narrow(lab.dim + 1, start * lab.k, n * lab.k).flatten(lab.dim, lab.dim + 1)


@attrs.frozen
class _Run:
    """Which examples a pass covers: ``batch`` of them, the first being example ``offset`` of the batch the
    graph was staged for (a process's shard of a larger batch; 0 and all of it otherwise)."""

    batch: int
    offset: int = 0
    undo: Undo | None = None  # what the programs save before they write the caller's state


def _feed_values(feeds: list[tuple], env: dict[Var, Any], held: dict[Var, Any], start: int, n: int, run: _Run) -> list:
    vals = []
    for f in feeds:
        kind = f[0]
        if kind == "full":
            vals.append(env[f[1]])
        elif kind == "acc":
            vals.append(held[f[1]])
        elif kind == "into":
            vals.append(_rows(held, f[1], f[2], start, n, run.batch))
        else:  # "slice": a shared value spans the staged batch, this run's examples start at its offset
            x = slice_examples(env[f[1]], f[2], (run.offset if kind == "slice" else 0) + start, n)
            vals.append(x.contiguous() if f[3] else x)
    return vals


def _rows(held: dict[Var, Any], v: Var, lab: Batched, start: int, n: int, batch: int) -> torch.Tensor:
    """Examples ``[start, start + n)`` of the full per-example result ``v`` over the run's ``batch`` examples
    (allocated on first use)."""
    full = held.get(v)
    if full is None:
        shape = list(v.aval.shape)
        shape[lab.dim] = lab.extent(batch)
        full = held[v] = torch.empty(shape, dtype=v.aval.dtype, device=v.aval.device)
    if lab.outer == 1:
        return slice_examples(full, lab, start, n)
    # Under an outer dim the rows are not one view's worth: write them through an unflattened view.
    return _OuterRows(full, lab, start, n)


class _OuterRows:
    """Stands in for the rows of an outer-batched result: ``copy_`` writes them in place."""

    def __init__(self, full: torch.Tensor, lab: Batched, start: int, n: int):
        self.rows = full.unflatten(lab.dim, (lab.outer, -1)).narrow(lab.dim + 1, start * lab.k, n * lab.k)
        self.dim, self.outer = lab.dim, lab.outer

    def copy_(self, x: torch.Tensor) -> torch.Tensor:
        return self.rows.copy_(x.unflatten(self.dim, (self.outer, -1)))


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


class ChunkOutOfMemory(Exception):
    """A chunk of ``size`` examples ran out of memory (``__cause__`` is the device's error)."""

    def __init__(self, size: int):
        super().__init__(f"out of memory on a chunk of {size} examples")
        self.size = size


def _pass(
    make: Callable[[int], BodyGraph], env: dict[Var, Any], sizes: Sequence[int], on_chunk, run: _Run
) -> dict[Var, Any]:
    """Run a per-chunk graph over the batch once. Returns the combined results by original var."""
    held: dict[Var, Any] = {}
    start = 0
    for k, n in enumerate(sizes):
        body = make(n)
        first = k == 0
        program = body.program(first)
        try:
            feeds = body.first_feeds if first else body.rest_feeds
            env_out = program.run_env(_feed_values(feeds, env, held, start, n, run), run.undo)
        except Exception as e:
            if is_oom(e) and n > 1:
                raise ChunkOutOfMemory(n) from e
            raise
        if first:
            held.update(zip(body.handed, program.outputs(env_out)))
        del env_out
        if on_chunk is not None:
            on_chunk(start, n)
        start += n
    return held


def _loop(
    make: Callable[[int], BodyGraph],
    env: dict[Var, Any],
    sizes: Sequence[int],
    on_chunk: Callable[[int, int], None] | None,
    run: _Run,
    combine: Callable[[dict[Var, torch.Tensor], dict[Var, str]], None] | None,
    retry: bool = True,
) -> tuple[dict[Var, Any], list[int]]:
    """Run a per-chunk graph over the batch. The accumulators are written in place, so a chunk that runs
    out of memory spoils the pass: it is dropped whole and the batch redone in chunks of half that size
    (with ``retry``; else the ``ChunkOutOfMemory`` is raised, for the caller's planner to choose).
    ``combine`` then merges the results with those of the other parts of a sharded batch.
    Returns the combined results and the chunk sizes of the pass that succeeded."""
    sizes = list(sizes)
    reported = 0

    def progress(start: int, n: int) -> None:
        # A redone pass reports only examples beyond those already reported.
        nonlocal reported
        if on_chunk is not None and start + n > reported:
            on_chunk(reported, start + n - reported)
            reported = start + n

    while True:
        try:
            held = _pass(make, env, sizes, progress, run)
        except ChunkOutOfMemory as e:
            if not retry:
                raise
            half = e.size // 2
            # The caller warns once, with what it will do from now on.
            log.info(
                "stagetorch: out of memory on a chunk of %d examples; redoing the batch in chunks of at most %d",
                e.size, half,
            )
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            sizes = even_chunks(sum(sizes), half)
            continue
        if combine is not None:
            combine(held, dict(make(sizes[0]).results))
        return held, sizes


def even_chunks(batch: int, largest: int) -> list[int]:
    """Even chunks no larger than ``largest``, rounded up to a multiple of 8 where that still fits, so the
    last chunk is not tiny and kernels see friendly sizes."""
    count = math.ceil(batch / largest)
    size = math.ceil(batch / count)
    if size > 8 and math.ceil(size / 8) * 8 <= largest:
        size = math.ceil(size / 8) * 8
    sizes = [size] * (batch // size)
    if batch % size:
        sizes.append(batch % size)
    return sizes


def run_chunked(
    split: Split,
    inputs: Sequence[torch.Tensor],
    sizes: Sequence[int],
    *,
    on_chunk: Callable[[int, int], None] | None = None,
    offset: int = 0,
    combine: Callable[[dict[Var, torch.Tensor], dict[Var, str]], None] | None = None,
    undo: Undo | None = None,
    retry: bool = True,
) -> tuple[list, list[tuple[int, torch.Tensor]], list[int]]:
    """Run the split graph in chunks of ``sizes`` examples.

    ``offset`` and ``combine`` run a part of a larger batch (one process's shard): the batched inputs hold
    the examples ``[offset, offset + sum(sizes))`` of the batch the graph was staged for, and
    ``combine(values, kinds)`` merges, in place, the partials of the reductions over those examples with
    those of the other parts; it is called once after each pre-pass and once after the chunk loop.
    ``undo`` receives a copy of the caller's state each program writes outside its commit (see
    :class:`~stagetorch.interpreters.undo.Undo`): the caller restores it if the run fails. ``retry=False``: a chunk
    that runs out of memory raises ``ChunkOutOfMemory`` rather than redo the batch in halves.

    **Returns** the flat outputs, the (input position, gradient) pairs to accumulate, and the chunk sizes
    that actually ran (they differ from ``sizes`` after an out-of-memory retry).
    """
    g = split.graph
    run = _Run(sum(sizes), offset, undo)
    env: dict[Var, Any] = dict(zip(g.invars, inputs))
    shared = split.shared_program
    senv = shared.run_env(inputs, undo)
    env.update(zip(split.shared.outvars, shared.outputs(senv)))
    del senv

    if split.globals:
        partials, sizes = _loop(split.normaliser_pass, env, sizes, None, run, combine, retry)
        env.update(partials)
    if split.reduced_for_globals:
        partials, sizes = _loop(split.reduction_pass, env, sizes, None, run, combine, retry)
        env.update(partials)
        if split.global_post.eqns:
            batch_wide = split.global_post
            program = Program(batch_wide)
            values = program.outputs(program.run_env([env[v] for v in batch_wide.invars], undo))
            env.update(zip(batch_wide.outvars, values))

    combined, ran = _loop(split.body, env, sizes, on_chunk, run, combine, retry)
    env.update(combined)
    del combined

    post = split.post_program
    env.update(zip(split.post.outvars, post.outputs(post.run_env([env[v] for v in split.post.invars], undo))))

    outs = [v.value if isinstance(v, Literal) else env[v] for v in g.outvars]
    grads = [(i, env[v]) for i, v in g.grads]
    return outs, grads, ran

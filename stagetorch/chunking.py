"""The chunked executor: runs a Graph over a batch in chunks, combining them into the full-batch result.

From the batch analysis it splits the graph into three graphs: ``shared`` (run once, first), ``body`` (run
once per chunk, built for each chunk size by the equations' batch rules) and ``post`` (run once, after the
chunks, on the combined reductions). Each is an ordinary Graph that the eager interpreter runs and the
memory interpreter costs, so the plan is costed on exactly what runs.

Nothing is written to a real ``.grad`` until every chunk has succeeded; a chunk that runs out of memory is
dropped whole and redone in halves, so no gradient is counted twice.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from ._tree import map_leaves
from .batching import BatchAnalysis, Batched, Global, Prepass, Reduced, coupling
from .execute import Program
from .ir import Aval, Eqn, Graph, Literal, Var

__all__ = ["Split", "run_chunked"]

log = logging.getLogger("stagetorch")


def _chunk_aval(v: Var, label: Any, n: int) -> Aval:
    if isinstance(label, Batched):
        shape = list(v.aval.shape)
        shape[label.dim] = label.extent(n)
        return Aval(tuple(shape), v.aval.dtype, v.aval.device)
    return v.aval


def _swap(table: dict[Var, Var], v: Var) -> Var:
    return table.get(v, v)


def _empty(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


@attrs.define
class BodyGraph:
    """The per-chunk program for chunks of ``n`` examples and how its inputs are cut from the batch."""

    graph: Graph
    program: Program
    # Per body invar: ("batch", original var, Batched) cut from a batched graph input; ("slice", var,
    # Batched) cut from a shared value; ("full", var) a shared or global value as it is.
    feeds: list[tuple]
    # Per body outvar: the original var it computes and how chunks combine: "cat", "sum"/"max"/"min", "same".
    results: list[tuple[Var, str]]


def _combine_kind(label: Any) -> str:
    if isinstance(label, Batched):
        return "cat"
    if isinstance(label, Reduced):
        return label.kind
    return "same"


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
        self.globals: list[Var] = [v for v in body_defined if isinstance(labels.get(v), Global)]
        self.body_idx = body_idx
        # Batch-wide values (a loss, a sum over examples) that per-example work reads: a pre-pass computes
        # them over every chunk first. Their own computation must not read one (that would need a pass per
        # level: BatchNorm-like coupling).
        self.needs_global = list(analysis.needs_global)
        self._global_post_idx = self._ancestors(post_idx, self.needs_global, "post")
        needed_reduced = [v for v in self.needs_global if isinstance(labels.get(v), Reduced)]
        needed_reduced += [
            v for i in self._global_post_idx for v in graph.eqns[i].invars
            if isinstance(labels.get(v), Reduced) and v not in needed_reduced
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
        self.shared_program = Program(self.shared)
        self.post_program = Program(self.post)
        self._bodies: dict[int, BodyGraph] = {}
        self._prepasses: dict[tuple[str, int], BodyGraph] = {}
        self.batched_inputs = [v for v in graph.invars if isinstance(labels.get(v), Batched)]

    # -- shared and post graphs ------------------------------------------------------------------------

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
            idx = self._ancestors(self.body_idx, [x for _, p in extra for x in _vars_in(p.args)], "body")
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
                    s = Var(_chunk_aval(v, cut, n))
                    sliced[key] = s
                    invars.append(s)
                    feeds.append(("slice", v, cut))
                return sliced[key]
            if v in batch_wide:
                if v not in sliced_globals:
                    sliced_globals[v] = Var(v.aval)
                    invars.append(sliced_globals[v])
                    feeds.append(("full", v))
                return sliced_globals[v]
            if v not in mapping:
                if isinstance(lab, Batched):  # a batched graph input
                    mapping[v] = Var(_chunk_aval(v, lab, n))
                    feeds.append(("batch", v, lab))
                else:
                    mapping[v] = Var(v.aval)
                    feeds.append(("full", v))
                invars.append(mapping[v])
            return mapping[v]

        eqns: list[Eqn] = []
        for i in idx:
            e = self.graph.eqns[i]
            decision = an.decisions[i]
            prim, args, kwargs = decision.call(n) if decision.call is not None else (e.prim, e.args, e.kwargs)

            def arg(v: Var, decision=decision) -> Var:
                if v in batch_wide:  # the pre-pass's value for the whole batch, not this chunk's partial
                    # (cut to the chunk where it has the batch's extent: a normaliser expanded to the batch)
                    return feed(v, decision.slice.get(v))
                if v in mapping:
                    return mapping[v]
                return feed(v, decision.slice.get(v))

            outvars = []
            for v in e.outvars:
                if v is None:
                    outvars.append(None)
                    continue
                lab = labels.get(v)
                base = mapping.get(v.base) if v.base is not None else None
                nv = Var(_chunk_aval(v, lab, n), base=base)
                outvars.append(nv)
            new = Eqn(prim, map_leaves(args, Var, arg), map_leaves(kwargs, Var, arg), tuple(outvars), e.source)
            for v, nv in zip(e.outvars, outvars):
                if v is not None:
                    mapping[v] = nv
            eqns.append(new)
        outs: list[Var] = [mapping[v] for v in results]
        kinds = [(v, _combine_kind(labels.get(v))) for v in results]
        for v, p in extra:
            out = Var(v.aval)
            args = map_leaves(p.args, Var, lambda x, p=p: mapping.get(x) or feed(x, p.cuts.get(x)))
            eqns.append(Eqn(p.fn, args, {}, (out,), self.graph.eqns[0].source))
            outs.append(out)
            kinds.append((v, "sum"))
        g = Graph(invars, eqns, outs)
        return BodyGraph(g, Program(g), feeds, kinds)


def _vars_in(tree: Any) -> list[Var]:
    if isinstance(tree, Var):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [v for x in tree for v in _vars_in(x)]
    return []


# ---------------------------------------------------------------------------------------------------------
# Running a split.


def _cut(x: torch.Tensor, lab: Batched, start: int, n: int) -> torch.Tensor:
    """Examples ``[start, start + n)`` of ``x`` (a view when the batch is not under an outer dim)."""
    if lab.outer == 1:
        return x.narrow(lab.dim, start * lab.k, n * lab.k)
    inner = x.unflatten(lab.dim, (lab.outer, x.shape[lab.dim] // lab.outer))
    return inner.narrow(lab.dim + 1, start * lab.k, n * lab.k).flatten(lab.dim, lab.dim + 1)


def _feed_values(body: BodyGraph, env: dict[Var, Any], start: int, n: int) -> list:
    vals = []
    for f in body.feeds:
        if f[0] == "full":
            vals.append(env[f[1]])
        else:
            vals.append(_cut(env[f[1]], f[2], start, n))
    return vals


class _Combiner:
    """Accumulates chunk results: per-example values into preallocated full tensors, reductions in place."""

    def __init__(self, labels: dict[Var, Any]):
        self.labels = labels
        self.values: dict[Var, Any] = {}

    def add(self, results: list[tuple[Var, str]], outs: list, start: int, n: int) -> None:
        for (v, kind), x in zip(results, outs):
            if kind == "cat":
                lab = self.labels[v]
                full = self.values.get(v)
                if full is None:
                    full = torch.empty(v.aval.shape, dtype=x.dtype, device=x.device)
                    self.values[v] = full
                if lab.outer == 1:
                    _cut(full, lab, start, n).copy_(x)
                else:
                    rows = full.unflatten(lab.dim, (lab.outer, -1)).narrow(lab.dim + 1, start * lab.k, n * lab.k)
                    rows.copy_(x.unflatten(lab.dim, (lab.outer, -1)))
            elif kind == "same":
                self.values[v] = x
            elif v not in self.values:
                self.values[v] = x.clone()
            elif kind == "sum":
                self.values[v].add_(x)
            elif kind == "max":
                torch.maximum(self.values[v], x, out=self.values[v])
            elif kind == "min":
                torch.minimum(self.values[v], x, out=self.values[v])


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def _loop(
    split: Split,
    make: Callable[[int], BodyGraph | None],
    env: dict[Var, Any],
    sizes: Sequence[int],
    on_chunk: Callable[[int, int], None] | None,
) -> tuple[_Combiner, list[int]]:
    """Run a per-chunk graph over the batch; on OOM redo the failed chunk in halves. Returns what ran."""
    combiner = _Combiner(split.analysis.labels)
    pending = list(sizes)
    ran: list[int] = []
    start = 0
    while pending:
        n = pending.pop(0)
        body = make(n)
        try:
            outs = body.program.outputs(body.program.run_env(_feed_values(body, env, start, n)))
        except Exception as e:
            if not _is_oom(e) or n == 1:
                raise
            half = n // 2
            log.warning("stagetorch: out of memory on a chunk of %d examples; retrying as %d + %d", n, half, n - half)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            pending[:0] = [half, n - half]
            continue
        combiner.add(body.results, outs, start, n)
        ran.append(n)
        if on_chunk is not None:
            on_chunk(start, n)
        start += n
    return combiner, ran


def run_chunked(
    split: Split,
    inputs: Sequence[torch.Tensor],
    sizes: Sequence[int],
    *,
    on_chunk: Callable[[int, int], None] | None = None,
) -> tuple[list, list[tuple[int, torch.Tensor]], list[int]]:
    """Run the split graph in chunks of ``sizes`` examples.

    **Returns** the flat outputs, the (input position, gradient) pairs to accumulate, and the chunk sizes
    that actually ran (they differ from ``sizes`` after an out-of-memory retry).
    """
    g = split.graph
    env: dict[Var, Any] = dict(zip(g.invars, inputs))
    shared = split.shared_program
    senv = shared.run_env(inputs)
    env.update(zip(split.shared.outvars, shared.outputs(senv)))
    del senv

    if split.globals:
        partials, _ = _loop(split, split.normaliser_pass, env, sizes, None)
        env.update(partials.values)
    if split.reduced_for_globals:
        partials, _ = _loop(split, split.reduction_pass, env, sizes, None)
        env.update(partials.values)
        if split.global_post.eqns:
            batch_wide = split.global_post
            program = Program(batch_wide)
            values = program.outputs(program.run_env([env[v] for v in batch_wide.invars]))
            env.update(zip(batch_wide.outvars, values))

    combined, ran = _loop(split, split.body, env, sizes, on_chunk)
    env.update(combined.values)

    post = split.post_program
    env.update(zip(split.post.outvars, post.outputs(post.run_env([env[v] for v in split.post.invars]))))

    outs = [v.value if isinstance(v, Literal) else env[v] for v in g.outvars]
    grads = [(i, env[v]) for i, v in g.grads]
    return outs, grads, ran

"""The planner: chunk sizes for a staged step, from the memory model and the memory available.

It costs the graphs the chunked executor will run (the whole graph when it fits, else the shared, body
and post graphs), so a plan's predicted peak is the peak of what runs. It runs nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import numpy as np

from ..devices.budget import format_bytes
from ..errors import BatchCouplingError, OutOfMemoryError, UnsupportedOpError
from ..interpreters.chunked import BodyGraph, Split, even_chunks
from ..interpreters.memory import Lifetimes, peak_bytes, timeline
from ..ir import Graph, Var
from ..transforms.schedule import draws_random
from ..utils import collector
from . import budget as margin

__all__ = ["Plan", "plan_chunks", "chunked_peak", "body_peaks", "bytes_of", "base_bytes"]


@attrs.frozen
class Plan:
    """How a step will run: ``chunk_sizes`` (one entry when the whole batch fits), the predicted peak of
    each chunk, the budget planned against, and why."""

    batch: int
    chunk_sizes: tuple[int, ...]
    peak_bytes: tuple[int, ...]
    budget_bytes: int
    full_batch_peak_bytes: int
    reason: str
    # The peak of what runs once around the chunks (the shared phase, the post phase with every accumulator).
    phase_peak_bytes: int = 0
    # What the call holds beside the program the whole time it runs (each .grad it adds into or replaces, the
    # copies it keeps to restore a failed step); ``budget_bytes`` then covers them too.
    held_bytes: int = 0
    # The old .grad the call drops before the program runs (``jit(donate_grads=True)``): neither held nor
    # counted, freed where eager's ``zero_grad()`` frees it.
    donated_bytes: int = 0
    # The bytes the program was planned in: the call's budget less what it holds beside the program and what
    # a CUDA run measured beyond its plans (:meth:`~stagetorch.planning.planner.Planner.plan_call` sets it).
    program_budget_bytes: int | None = None
    # On CUDA: what the caching allocator is predicted to reserve for the program as planned, the cuBLAS
    # workspace included (:func:`~stagetorch.planning.reserved.fit_reserved`); None where not predicted.
    reserved_bytes: int | None = None
    # The staged program's own peak on the whole batch, nothing recomputed (:meth:`~stagetorch.planning.planner.
    # Planner.plan_call` sets it; ``full_batch_peak_bytes`` is that of the graph this plan runs, which may
    # recompute): with ``held_bytes``, what :func:`stagetorch.memory` reports as the step's peak.
    whole_program_bytes: int | None = None

    @property
    def whole_batch_bytes(self) -> int:
        """The step's peak on the whole batch at once, nothing recomputed, with what the call holds beside the
        program: the peak :func:`stagetorch.memory` reports (``whole_program_bytes`` where the planner set it,
        else ``full_batch_peak_bytes``)."""
        whole = self.full_batch_peak_bytes if self.whole_program_bytes is None else self.whole_program_bytes
        return whole + self.held_bytes

    @property
    def peak(self) -> int:
        """The predicted peak of the whole run, with what the call holds beside the program."""
        return max(*self.peak_bytes, self.phase_peak_bytes) + self.held_bytes

    @property
    def chunked(self) -> bool:
        return len(self.chunk_sizes) > 1

    def __str__(self) -> str:
        sizes = "+".join(map(str, self.chunk_sizes))
        peak = self.peak
        return (
            f"Plan: batch {self.batch} as {len(self.chunk_sizes)} chunk(s) [{sizes}], predicted peak "
            f"{format_bytes(peak)} of a {format_bytes(self.budget_bytes)} budget (whole batch at once, nothing "
            f"recomputed: {format_bytes(self.whole_batch_bytes)}, as stagetorch.memory reports it). {self.reason}"
            + (f" The call holds {format_bytes(self.held_bytes)} beside the program." if self.held_bytes else "")
            + (f" It drops the old .grad the step replaces or clears ({format_bytes(self.donated_bytes)}) before the "
               "program runs (donate_grads=True)." if self.donated_bytes else "")
        )


def bytes_of(vars: list[Var]) -> int:
    """Bytes of the storages ``vars`` live in, each counted once."""
    seen: set[Var] = set()
    total = 0
    for v in vars:
        r = v.root
        if r not in seen:
            seen.add(r)
            total += r.owned_nbytes
    return total


def base_bytes(split: Split) -> int:
    """Bytes held for the whole chunked run: every graph input and what the shared phase hands on."""
    return bytes_of([*split.graph.invars, *split.shared.outvars]) - split.input_overlap


def _batch_wide(split: Split, through: str = "body") -> int:
    """Bytes of the batch-wide values the pre-passes hand on, held from their pass to the end of the run
    (interpreters.chunked.run_chunked keeps them): the normaliser pass's (a loss's total weight) from the reduction pass
    on, and the reduction pass's (with what the global post phase makes of them) through the body and post.
    A chunk graph reads them as inputs, which its own peak leaves out."""
    held = list(split.globals)
    if through != "reduction" and split.reduced_for_globals:
        held += split.reduced_for_globals
        if split.global_post.eqns:
            held += [v for v in split.global_post.outvars if isinstance(v, Var)]
    return bytes_of(held)


def _own_peak(graph: Graph, cost: Callable[[Graph], int], feeds: list[tuple] = ()) -> int:
    """A per-chunk graph's peak less its inputs (they are counted as held by the run), except the chunks
    copied dense from their batch (a cut with gaps: ``interpreters.chunked``'s feeds say which), which the
    chunk allocates."""
    held = (v.aval.nbytes for v, f in zip(graph.invars, feeds or [()] * len(graph.invars)) if not _copied(f))
    return max(cost(graph) - sum(held), 0)


def _copied(feed: tuple) -> bool:
    return len(feed) > 3 and feed[0] in ("batch", "slice") and bool(feed[3])


def body_peaks(split: Split, body: BodyGraph, cost: Callable[[Graph], int]) -> tuple[int, int]:
    """Predicted peak of the run while ``body``'s first chunk runs, and while any later chunk does. The
    first chunk's partials become the accumulators, so they are counted in its own peak."""
    first, rest = _peaks(split, _parts(body, cost))
    return first + _batch_wide(split), rest + _batch_wide(split)


def _parts(body: BodyGraph, cost: Callable[[Graph], int]) -> tuple[int, int, int, int]:
    """What a chunk's peak is made of: the own peaks of ``body``'s first and later graphs, and its held
    bytes (full per-example results, accumulators)."""
    return (_own_peak(body.first, cost, body.first_feeds), _own_peak(body.rest, cost, body.rest_feeds), *body.held_bytes)


def _peaks(split: Split, parts: tuple[int, int, int, int]) -> tuple[int, int]:
    first, rest, cat, acc = parts
    base = base_bytes(split)
    return base + cat + first, base + cat + acc + rest


def _chunk_peaks(split: Split, n: int, cost: Callable[[Graph], int]) -> tuple[int, int]:
    """(first, later) chunk peaks for chunks of ``n``: the body's, or a pre-pass's where that is larger."""
    return _Sizes(split, cost).chunk_peaks(n)


def _phase_peak(split: Split, n: int, cost: Callable[[Graph], int]) -> int:
    """Peak of the phases that run once: the shared phase before the chunks, the post phase after them
    (with the accumulators and full results held)."""
    return _Sizes(split, cost).phase_peak(n)


def chunked_peak(split: Split, n: int, cost: Callable[[Graph], int]) -> int:
    """The predicted peak of a chunked run in chunks of ``n``: its chunks' and its once-only phases'."""
    return _Sizes(split, cost).chunked_peak(n)


class _Memo:
    """``cost`` remembered per graph for one planning: the search costs the same graphs several times, and a
    5,000-equation chunk body takes ~0.06 s to cost. When ``cost`` is the memory interpreter, the
    :class:`~stagetorch.interpreters.memory.Lifetimes` of each graph are kept too (see :class:`_Sizes`)."""

    def __init__(self, cost: Callable[[Graph], int]):
        self.cost = cost
        self.seen: dict[int, tuple[Graph, int, Lifetimes | None]] = {}

    def __call__(self, graph: Graph) -> int:
        return self._get(graph)[1]

    def lifetimes(self, graph: Graph) -> Lifetimes | None:
        return self._get(graph)[2]

    def _get(self, graph: Graph) -> tuple[Graph, int, Lifetimes | None]:
        hit = self.seen.get(id(graph))
        if hit is None:
            if self.cost is peak_bytes:
                t = timeline(graph)
                hit = (graph, t.peak_bytes, t.lifetimes)
            else:
                hit = (graph, self.cost(graph), None)
            self.seen[id(graph)] = hit  # the graph is held, so its id is not reused
        return hit


def _linear(small: Sequence[int], large: Sequence[int], a: int, b: int, affine: int = 0) -> tuple[np.ndarray, np.ndarray] | None:
    """Sizes measured for ``a`` and ``b`` examples as (fixed, per example) arrays: each the same at both, or
    the same multiple of each; None when one is neither. The last ``affine`` entries (kernel workspaces, a
    fixed part beside a per-example one) may be any line through the two."""
    x, y = np.asarray(small, dtype=np.int64), np.asarray(large, dtype=np.int64)
    if x.shape != y.shape:
        return None
    fixed = x == y
    exact = fixed | ((x * b == y * a) & (x % a == 0))
    if affine:
        slope = (y - x) // (b - a)
        lined = (np.arange(len(x)) >= len(x) - affine) & ((y - x) % (b - a) == 0)
        if not (exact | lined).all():
            return None
        per = np.where(fixed, 0, np.where(exact, x // max(a, 1), slope))
        return np.where(fixed, x, np.where(exact, 0, x - slope * a)), per
    if not exact.all():
        return None
    return np.where(fixed, x, 0), np.where(fixed, 0, x // a)


class _Sizes:
    """A split's chunk costs for any chunk size: the pieces of :func:`chunked_peak`, with chunk graphs built
    and costed for two sizes only (``samples``; none: every size is built and costed).

    A split's chunk graphs for ``n`` examples are the same equations for every ``n``: the batch rules only
    cut the batched dims, so each storage and each input holds either fixed bytes or a multiple of ``n``
    (a tensor whose batch dim is the chunk), and the schedule does not change. With the memory interpreter's
    :class:`~stagetorch.interpreters.memory.Lifetimes` of the graphs for both samples, the peak for another ``n`` is the
    same lifetimes summed with each storage's bytes for ``n``, exactly what building and costing that
    graph gives. A size is built and costed as it is where that does not hold: below 2 examples (a batch dim
    of 1 may change what a view aliases), with a memory rule in the graph (workspace that sizes do not
    show), or when the two samples' schedules or sizes do not agree with it. The planner's search then costs
    two chunk bodies per split instead of one per size it tries.
    """

    def __init__(self, split: Split, cost: Callable[[Graph], int], samples: tuple[int, int] | None = None):
        self.split = split
        self.cost = cost if isinstance(cost, _Memo) else _Memo(cost)
        self.samples = samples if samples is not None and min(samples) >= 2 and samples[0] != samples[1] else None
        self._models: dict[str, Callable[[int], tuple[int, int, int, int]] | None] = {}
        # A kernel's workspace was extrapolated along the line through the samples: a workspace that is the
        # larger of two lines may leave it, so the planner checks the sizes it chooses on built graphs.
        self.approximate = False

    def _make(self, kind: str) -> Callable[[int], BodyGraph]:
        return {"body": self.split.body, "normaliser": self.split.normaliser_pass,
                "reduction": self.split.reduction_pass}[kind]

    def parts(self, kind: str, n: int) -> tuple[int, int, int, int]:
        """:func:`_parts` of the ``kind`` chunk graph (body, or a pre-pass) for chunks of ``n``."""
        if self.samples is not None and n not in self.samples and n >= 2:
            if kind not in self._models:
                self._models[kind] = self._model(kind)
            model = self._models[kind]
            if model is not None:
                return model(n)
        return _parts(self._make(kind)(n), self.cost)

    def _model(self, kind: str) -> Callable[[int], tuple[int, int, int, int]] | None:
        """The ``kind`` chunk graph's parts as a function of the chunk size, from the two samples."""
        assert self.samples is not None
        a, b = self.samples
        small, large = self._make(kind)(a), self._make(kind)(b)
        held = _linear(small.held_bytes, large.held_bytes, a, b)
        graphs = []
        for x, y in ((small.first, large.first), (small.rest, large.rest)):
            lx, ly = self.cost.lifetimes(x), self.cost.lifetimes(y)
            if lx is None or ly is None or lx.ruled or ly.ruled:
                return None
            if (lx.start, lx.end, lx.rows, lx.rounded) != (ly.start, ly.end, ly.rows, ly.rounded):
                return None
            roots = _linear(lx.nbytes, ly.nbytes, a, b, affine=lx.workspaces)
            self.approximate = self.approximate or bool(lx.workspaces)
            inputs = _linear([v.aval.nbytes for v in x.invars], [v.aval.nbytes for v in y.invars], a, b)
            if roots is None or inputs is None:
                return None
            graphs.append((lx, roots, inputs))
        if held is None:
            return None

        def own(n: int, lifetimes: Lifetimes, roots: tuple, inputs: tuple) -> int:
            return max(lifetimes.peak(roots[0] + roots[1] * n) - int((inputs[0] + inputs[1] * n).sum()), 0)

        def parts(n: int) -> tuple[int, int, int, int]:
            cat, acc = (int(v) for v in held[0] + held[1] * n)
            return own(n, *graphs[0]), own(n, *graphs[1]), cat, acc

        return parts

    def chunk_peaks(self, n: int) -> tuple[int, int]:
        """(first, later) chunk peaks for chunks of ``n``: the body's, or a pre-pass's where that is larger."""
        split = self.split
        held = _batch_wide(split)
        first, rest = (p + held for p in _peaks(split, self.parts("body", n)))
        for kind, wanted in (("normaliser", split.globals), ("reduction", split.reduced_for_globals)):
            if wanted:
                before = _batch_wide(split, "reduction") if kind == "reduction" else 0
                f, r = (p + before for p in _peaks(split, self.parts(kind, n)))
                first, rest = max(first, f), max(rest, r)
        return first, rest

    def phase_peak(self, n: int) -> int:
        """Peak of the phases that run once: the shared phase before the chunks, the post phase after them
        (with the accumulators and full results held)."""
        split, cost = self.split, self.cost
        base = base_bytes(split)
        cat, acc = self.parts("body", n)[2:]
        post = cost(split.post) - bytes_of(split.post.invars) if split.post.eqns else 0
        return max(cost(split.shared) - split.input_overlap, base + _batch_wide(split) + cat + acc + max(post, 0))

    def chunked_peak(self, n: int) -> int:
        """The predicted peak of a chunked run in chunks of ``n``: its chunks' and its once-only phases'."""
        return max(*self.chunk_peaks(n), self.phase_peak(n))


@collector.paused()  # chunk graphs and their schedules, many small objects that all stay alive while it plans
def plan_chunks(
    graph: Graph,
    split: Callable[[], Split],
    batch: int,
    budget: int,
    cost: Callable[[Graph], int],
    full: int | None = None,
    cap: int | None = None,
) -> Plan:
    """Choose chunk sizes for ``graph`` over ``batch`` examples within ``budget`` bytes.

    ``split`` builds the chunked form on demand (only when the whole batch does not fit). ``cost`` is the
    memory interpreter: a Graph's peak bytes; ``full`` is ``cost(graph)`` when the caller already has it.
    ``cap``: the largest chunk to plan (a larger one ran out of memory before); the whole batch is then
    split even when the estimate says it fits.
    """
    usable = margin.usable(budget)
    cost = _Memo(cost)
    full = cost(graph) if full is None else full
    if (full <= usable and (cap is None or cap >= batch)) or batch == 1:
        why = "The whole batch fits." if full <= usable else "A single example cannot be split further."
        if full > usable:
            try:
                s = split()
            except (BatchCouplingError, UnsupportedOpError):  # one example: nothing would be split anyway
                raise _whole_too_big(full, budget) from None
            raise _too_big(graph, s, budget, cost)
        return Plan(batch, (batch,), (full,), budget, full, why)
    s = split()
    small, large = (1, 2) if batch < 4 else (2, 4)
    sizes_of = _Sizes(s, cost, (small, large))
    peak = sizes_of.chunked_peak
    p_small, p_large = peak(small), peak(large)
    per_example = max((p_large - p_small) / (large - small), 1)
    fixed = p_small - per_example * small
    # The line through two samples is only a first guess: below the smaller sample a workspace that does not
    # shrink with the chunk (a per-thread reduction) bends the peak, so a chunk smaller than the line allows may
    # still fit. Every size is checked against its own peak before one example is refused.
    largest = max(min(int((usable - fixed) // per_example), batch - 1, cap or batch), 1)
    while largest >= 1 and peak(largest) > usable:
        largest -= max(1, largest // 16)
    if sizes_of.approximate:
        sizes_of = _Sizes(s, sizes_of.cost)  # every size built and costed
        while largest >= 1 and sizes_of.chunked_peak(largest) > usable:
            largest -= max(1, largest // 16)
    if largest < 1:
        raise _too_big(graph, s, budget, cost)
    sizes = even_chunks(batch, largest)
    peaks = tuple(sizes_of.chunk_peaks(n)[k > 0] for k, n in enumerate(sizes))
    phases = sizes_of.phase_peak(sizes[0])
    why = (
        f"The program it runs needs {format_bytes(full)} on the whole batch (without what the call holds beside it); "
        f"fixed {format_bytes(fixed)} + {format_bytes(per_example)} per example allows chunks of up to {largest}."
    )
    if cap is not None and cap < batch:
        why += f" Chunks are at most {cap} examples: a larger one ran out of memory in an earlier call."
    if any(draws_random(e) for e in graph.eqns):  # (not an attention kernel whose dropout_p is 0)
        why += (
            " Random ops (dropout) draw per chunk: each example's draws have the whole batch's distribution, "
            "not its numbers (docs/chunking.md, Random ops)."
        )
    return Plan(batch, tuple(sizes), peaks, budget, full, why, phases)


def _not_even_one(needs: int, budget: int, subject: str, detail: str) -> OutOfMemoryError:
    """The error for one example that does not fit: ``subject`` (what runs it) ``needs`` bytes against
    ``budget``; ``detail`` follows (what the bytes are, or why nothing smaller runs)."""
    error = OutOfMemoryError(
        f"not even one example fits: {subject} needs {format_bytes(needs)} against a budget of {format_bytes(budget)} "
        f"(less a {margin.margin_words()} margin){detail}. What to do: raise memory_budget, use a smaller model or lower "
        "precision, or move the batch off the device."
    )
    error.smallest_budget = margin.smallest_budget(needs)
    return error


def _whole_too_big(full: int, budget: int) -> OutOfMemoryError:
    """The error for one example that does not fit, where the graph's chunked form (which would break its
    bytes down) cannot be built: an op in it couples the batch or has no batch rule."""
    return _not_even_one(full, budget, "the step on a batch of one", ", and a batch of one cannot be split")


def _too_big(graph: Graph, split: Split, budget: int, cost: Callable[[Graph], int]) -> OutOfMemoryError:
    body = split.body(1)
    first, rest = _chunk_peaks(split, 1, cost)
    phases = _phase_peak(split, 1, cost)
    roles = dict(zip(graph.invars, graph.roles or ["arg"] * len(graph.invars)))
    params = bytes_of([v for v in graph.invars if roles[v] in ("param", "buffer")])
    inputs = base_bytes(split) - params
    cat, acc = body.held_bytes
    t = timeline(body.rest)
    partial_roots = {x.root for x in body.partials}
    live = [r for r in t.peak_live if t.owners[r][2] >= 0]
    partials = sum(t.owners[r][1] for r in live if r in partial_roots)
    activations = sum(t.owners[r][1] for r in live if r not in partial_roots) + t.peak_workspace
    parts = [
        ("parameters and buffers", params), ("inputs (the whole batch) and shared values", inputs),
        ("gradient and other accumulators", acc), ("per-example outputs", cat),
        ("partial gradients of the chunk", partials), ("activations and temporaries of one example", activations),
    ]
    listed = ", ".join(f"{name} {format_bytes(n)}" for name, n in parts if n)
    return _not_even_one(max(first, rest, phases), budget, "a chunk of 1", f". At a later chunk's peak: {listed}")

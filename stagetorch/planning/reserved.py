"""What the CUDA caching allocator reserves for a planned step: the step's allocations and frees in the order the
chunked executor makes them, replayed through the allocator's model (:mod:`stagetorch.devices.cuda_allocator`),
and the planner's check that the predicted reserved bytes fit the budget (:func:`fit_reserved`).

The order is the memory interpreter's (:func:`stagetorch.interpreters.memory.allocation_events`) per program.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from ..devices.budget import format_bytes
from ..devices.catalog import Device, cublas_workspace
from ..devices.cuda_allocator import AllocatorStats, CachingAllocatorModel, allocator_settings, replay
from ..interpreters.memory import allocation_events
from ..ir import Graph, Var, op_name

if TYPE_CHECKING:
    from ..interpreters.chunked import Split
    from .chunks import Plan

__all__ = ["step_events", "resident_events", "predict_reserved", "on_cuda", "fit_reserved", "reserved_of", "uses_cublas", "device_workspace"]


def _program(graph: Graph, tag: Any, final: bool, keep: bool) -> tuple[list[tuple], list[tuple]]:
    """One program's events, keyed apart from other programs' by ``tag``, and the frees of what it keeps to
    its end (``keep``: nothing, it stays for the rest of the step)."""
    events = [(action, (tag, key), size) for action, key, size in allocation_events(graph, final=final)]
    freed = {key for action, key, _ in events if action == "free"}
    if keep:
        return events, []
    return events, [("free", key, 0) for action, key, _ in events if action == "alloc" and key not in freed]


def step_events(graph: Graph, chunk_sizes: Sequence[int], split: Split | None = None) -> list[tuple[str, Any, int]]:
    """The allocations and frees of a step run as planned, in the order the executor makes them
    (:func:`stagetorch.interpreters.chunked.run_chunked`): the whole graph when it is one chunk; else the shared program
    (its outputs held to the end), each pre-pass (then the batch-wide values' program) and the body once per
    chunk (the first chunk's results become the accumulators and stay, the full per-example results are made
    before the first chunk; what a later chunk makes goes when it ends), then the post program. The graph's
    inputs are not in it."""
    if len(chunk_sizes) == 1:
        return _program(graph, "step", True, True)[0]
    assert split is not None, "a chunked plan's events need the graph's split"
    costed: dict[int, tuple[list[tuple], list[tuple]]] = {}  # a chunk graph's events, for each chunk that runs it
    events, _ = _program(split.shared, "shared", False, True)
    passes = [("body", split.body)]
    if split.reduced_for_globals:
        passes.insert(0, ("reduction", split.reduction_pass))
    if split.globals:
        passes.insert(0, ("normaliser", split.normaliser_pass))
    batch = sum(chunk_sizes)
    for name, make in passes:
        for k, n in enumerate(chunk_sizes):
            body = make(n)
            if k == 0:
                for feed in body.first_feeds:
                    if feed[0] == "into":
                        v, label = feed[1], feed[2]
                        shape = list(v.aval.shape)
                        shape[label.dim] = label.extent(batch)
                        events.append(("alloc", (name, "into", v), _nbytes(shape, v)))
            graph_k = body.first if k == 0 else body.rest
            if id(graph_k) not in costed:
                costed[id(graph_k)] = _program(graph_k, name, False, k == 0)
            made, ended = costed[id(graph_k)]
            events += [(action, (k, key), size) for action, key, size in (*made, *ended)]
        if name == "reduction" and split.global_post.eqns:  # what the batch-wide values make, before the body
            events += _program(split.global_post, "global_post", False, True)[0]
    if split.post.eqns:
        events += _program(split.post, "post", True, True)[0]
    return events


def _nbytes(shape: Sequence[int], v: Var) -> int:
    count = 1
    for d in shape:
        count *= d
    return count * v.aval.dtype.itemsize


def resident_events(graph: Graph, held: int = 0, workspace: int = 0) -> list[tuple[str, Any, int]]:
    """The allocations that hold ``graph``'s inputs before it runs: each input storage once, in the order the
    graph takes them (parameters as ``model.to("cuda")`` moves them), then ``held`` bytes the call holds
    beside the program and a library's ``workspace`` (each as one block)."""
    inputs: dict[Var, None] = dict.fromkeys(v.root for v in graph.invars)
    events = [("alloc", ("input", r), r.owned_nbytes) for r in inputs if r.owned_nbytes]
    return events + [("alloc", name, n) for name, n in (("held", held), ("workspace", workspace)) if n]


def predict_reserved(
    graph: Graph, chunk_sizes: Sequence[int], split: Split | None = None, *, held: int = 0, workspace: int = 0,
    **allocator: Any,
) -> AllocatorStats:
    """What the caching allocator reserves for a step of ``graph`` run in ``chunk_sizes`` (with its ``split``
    when chunked): its inputs, ``held`` bytes and a library's ``workspace`` first (:func:`resident_events`;
    cuBLAS keeps one per handle and stream from the first matmul on, 32 MiB on an H200), then the step
    (:func:`step_events`). ``allocator``: :class:`CachingAllocatorModel`'s options. Raises
    :class:`AllocatorOutOfMemory` when the step cannot get its segments within a ``memory_limit``."""
    events = [*resident_events(graph, held, workspace), *step_events(graph, chunk_sizes, split)]
    return replay(events, CachingAllocatorModel(**allocator))


def on_cuda(graph: Graph) -> bool:
    """Whether ``graph`` runs on a CUDA device (any input there): its memory is the caching allocator's."""
    return any(v.aval.device.type == "cuda" for v in graph.invars)


# The ops that run through cuBLAS (or cuBLASLt): a program with one creates a handle and its workspace.
_CUBLAS_OPS = frozenset({
    "aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.addbmm", "aten.addmv", "aten.mv", "aten.dot",
    "aten._scaled_mm", "aten._addmm_activation", "aten.linear", "aten.matmul",
})


def uses_cublas(graph: Graph) -> bool:
    """Whether ``graph`` runs a matmul through cuBLAS, which keeps a workspace from its first call on."""
    return any(op_name(e.prim).split(".out")[0] in _CUBLAS_OPS for e in graph.eqns)


def device_workspace(graph: Graph, device: Device | None) -> int:
    """The cuBLAS workspace a run of ``graph`` keeps on ``device`` (None: this process's GPU, by its compute
    capability and ``CUBLAS_WORKSPACE_CONFIG``): none where the graph runs no matmul."""
    if not uses_cublas(graph):
        return 0
    if device is not None:
        return device.workspace_bytes
    import torch

    if not torch.cuda.is_available():
        return cublas_workspace((9, 0))
    index = graph.device.index if graph.device.index is not None else torch.cuda.current_device()
    return cublas_workspace(torch.cuda.get_device_capability(index))


def reserved_of(plan: Plan, graph: Graph, split: Callable[[], Split], device: Device | None = None) -> AllocatorStats:
    """What the caching allocator is predicted to hold for ``plan`` of ``graph`` on ``device`` (None: this
    process's own, with its :func:`allocator_settings`): its allocations and frees, after the graph's
    inputs and the cuBLAS workspace (:func:`device_workspace`)."""
    settings = dict(device.allocator) if device is not None else allocator_settings()
    sizes = plan.chunk_sizes
    return predict_reserved(graph, sizes, split() if len(sizes) > 1 else None,
                            workspace=device_workspace(graph, device), **settings)


def fit_reserved(
    plan: Plan, graph: Graph, split: Callable[[], Split], budget: int, replan: Callable[[int], Plan],
    device: Device | None = None,
) -> Plan:
    """``plan`` if the caching allocator's predicted reserved bytes for it (:func:`reserved_of`: on ``device``,
    or this process's with its :func:`allocator_settings`; the cuBLAS workspace included) fit ``budget``
    (the bytes the process may hold: a memory fraction caps reserved, not allocated); else the plan
    ``replan(cap)`` makes with chunks of at most ``cap``, for the largest ``cap`` that fits. A plan of chunks
    of one that still does not fit is returned as it is (its allocated peak was planned; nothing smaller
    runs). The plan's reason says the prediction, and ``Plan.reserved_bytes`` holds it."""
    while True:
        sizes = plan.chunk_sizes
        reserved = reserved_of(plan, graph, split, device).max_reserved
        if reserved <= budget or max(sizes) == 1:
            return attrs.evolve(plan, reserved_bytes=reserved, reason=(
                f"{plan.reason} The caching allocator will reserve about {format_bytes(reserved)} for it"
                f"{' (the cuBLAS workspace included)' if uses_cublas(graph) else ''}."))
        plan = replan(max(sizes) - 1)

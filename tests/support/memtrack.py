"""Measure the memory peak of real PyTorch code: the ground truth the memory estimates are tested against, and
the one harness that runs a step along every path (tests and benchmarks) and returns both.

``AllocatorPeak`` reads the allocator itself: every byte a kernel, a workspace or a kept copy takes (on CPU the
profiler's allocation events, on CUDA ``max_memory_allocated``). ``LivePeak`` is the older diagnostic that sees
only the tensors ops return. A dispatch mode sees every tensor an ATen op returns, forward and backward. Each storage is counted once
from its first appearance until the last tensor on it dies (weak references fire when the C++ tensor goes,
since PyTorch keeps a tensor's Python object alive while C++ still holds it). Tensors alive before the step
(parameters, buffers, inputs, existing .grad) are counted as resident.
"""

from __future__ import annotations

import copy
import math
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import models
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import stagetorch
from stagetorch.interpreters.memory import peak_bytes
from stagetorch.planning.budget import SAFETY_MARGIN
from stagetorch.planning.chunks import _chunk_peaks, _phase_peak
from stagetorch.runtime.executable import Executable

MODELS = {**models.CLASSIFIERS, "gpt2": models.gpt2}


def _step_of(name):
    return models.gpt2_step if name == "gpt2" else models.train_step

_DENSE = (torch.Tensor, torch.nn.Parameter)


def _storages(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    """The distinct storages under ``tensors`` (views of one storage count once): address -> bytes."""
    seen: dict[int, int] = {}
    for t in tensors:
        if type(t) in _DENSE and t.device.type != "meta":
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return seen


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages under ``tensors`` (views of one storage count once)."""
    return sum(_storages(tensors).values())


def _events(nodes):
    for e in nodes:
        yield e
        yield from _events(e.children)


class AllocatorPeak:
    """The peak of bytes the allocator handed out while the block ran, plus ``resident`` (state alive before).

    CPU: the profiler records every allocation and free of torch's allocator (kernel workspaces, column buffers
    and copies a call keeps included), to which the buffers kernels take from plain ``malloc`` are added
    (_unseen_at_malloc); their running sum's maximum is the block's own peak. CUDA: ``max_memory_allocated`` after
    resetting the peak statistics (and ``reserved``, the caching allocator's segments). Only the allocations of
    ``device`` count.

    ``frees_resident``: on CPU, a free of a ``resident`` tensor's storage counts too (as CUDA's statistics count
    every free): a block that frees state before its peak (eager's ``zero_grad()`` of the previous step's
    ``.grad``, ``jit(donate_grads=True)``) peaks that much lower. Off, such a free is ignored as any free of a
    block allocated before the block ran. The profiler reports the free of a block only if the block was
    allocated while a profiler recorded memory: make those resident tensors under one (an earlier
    ``AllocatorPeak``, as :func:`known_to_the_profiler` does)."""

    def __init__(self, resident: Iterable[torch.Tensor] = (), device: str = "cpu", frees_resident: bool = False,
                 at_malloc: bool = True):
        resident = list(resident)
        self.resident = _storage_bytes(resident)
        self._freeable = _storages(resident) if frees_resident else {}
        self.device = torch.device(device)
        self.at_malloc = at_malloc  # False: the profiler's events alone
        self.peak = self.excess = self.reserved = 0

    def __enter__(self) -> AllocatorPeak:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                                record_shapes=True)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.excess = torch.cuda.max_memory_allocated(self.device) - self._base
            self.reserved = torch.cuda.max_memory_reserved(self.device)
        else:
            self._prof.__exit__(*exc)
            allocation = torch._C._profiler._EventType.Allocation
            tree = self._prof.profiler.kineto_results.experimental_event_tree()
            events = sorted(
                [(e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.ptr) for e in _events(tree)
                 if e.tag == allocation and e.extra_fields.device.type == "cpu"]
                + (_unseen_at_malloc(tree) if self.at_malloc else []),
                key=lambda e: e[0],
            )
            # A free of a block allocated before the block ran (a cache, an earlier step's tensor) is not this
            # block's: counting it would hide as many bytes of the block's own.
            # The profiler records the allocations and frees of the threads it watches only: a block freed on
            # another (gloo's worker thread drops the last reference to a collective's output or input copy
            # when it finishes after the caller: measured with storage weak references, freed by then) has no
            # free event. A block allocated at an address still live here was freed so: it is dropped then.
            mine: dict[int, int] = {}
            live = 0
            for _, size, ptr in events:
                if ptr is None:  # a buffer from malloc (below)
                    pass
                elif size > 0:
                    live -= mine.pop(ptr, 0)  # (an unseen free of the block that had this address)
                    mine[ptr] = size
                elif ptr in mine:
                    del mine[ptr]
                elif self._freeable.pop(ptr, None) == -size:
                    pass  # a resident storage freed inside the block
                else:
                    continue
                live += size
                self.excess = max(self.excess, live)
        self.peak = self.resident + self.excess


def known_to_the_profiler(fn: Callable, *args: Any) -> Any:
    """``fn(*args)`` with the CPU profiler recording memory, so that a later ``AllocatorPeak(...,
    frees_resident=True)`` sees the frees of what it allocates (a previous step's ``.grad``)."""
    with AllocatorPeak():
        return fn(*args)


def _unseen_at_malloc(tree) -> list[tuple[int, int, None]]:
    """What the CPU kernels take from plain ``malloc`` while the profiler watched, which its allocation events
    miss, as (time, +bytes or -bytes, None) events: the native 2-d convolution's input gradient
    (``_slow_conv2d_backward``, a grouped one's per group) unfolds each example into a buffer of its thread's
    own, one example's columns, from after the input gradient is made (``resize_as_``, ``zero_``) until the
    kernel's next step (tests/ops/test_workspace.py measures these buffers at ``malloc`` with tests/support/mallocpeak.c).
    Every thread with examples holds one, at most: counted so."""
    torch_op = torch._C._profiler._EventType.TorchOp
    found: list[tuple[int, int, None]] = []
    for e in _events(tree):
        if e.tag != torch_op or e.name != "aten::_slow_conv2d_backward":
            continue
        grad, x, w = (getattr(t, "sizes", None) for t in e.extra_fields.inputs[:3])
        if not (grad and x and w) or len(x) != 4:
            continue
        children = sorted(e.children, key=lambda c: c.start_time_ns)
        start = next((i for i, c in enumerate(children) if c.name == "aten::resize_as_"
                      and list(getattr(c.extra_fields.inputs[1], "sizes", ())) == list(x)), None)
        if start is None:  # no input gradient asked
            continue
        begin = next((c.end_time_ns for c in children[start + 1:] if c.name == "aten::zero_"), children[start].end_time_ns)
        end = next((c.start_time_ns for c in children if c.start_time_ns > begin), e.end_time_ns)
        itemsize = torch.empty((), dtype=e.extra_fields.inputs[1].dtype).element_size()
        size = min(torch.get_num_threads(), x[0]) * x[1] * math.prod(w[2:]) * math.prod(grad[2:]) * itemsize
        found += [(begin, size, None), (end, -size, None)]
    return found


class LivePeak(TorchDispatchMode):
    def __init__(self, resident: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.count: dict[int, int] = {}
        self.size: dict[int, int] = {}
        self.live = 0
        self.peak = 0
        self._refs: list = []
        for t in resident:
            self._see(t, keep=True)
        self.peak = self.live

    def _see(self, t: torch.Tensor, keep: bool = False) -> None:
        if type(t) not in _DENSE or t.device.type == "meta":  # fake and lazy tensors hold no memory
            return
        st = t.untyped_storage()
        key, nbytes = st.data_ptr(), st.nbytes()
        if not nbytes:
            return
        if key not in self.size:
            self.size[key] = nbytes
            self.count[key] = 0
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        if keep:
            self.count[key] += 1
            return
        self.count[key] += 1
        self._refs.append(weakref.ref(t, lambda _, key=key: self._drop(key)))

    def _drop(self, key: int) -> None:
        self.count[key] -= 1
        if self.count[key] == 0:
            self.live -= self.size.pop(key)
            del self.count[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and not isinstance(args[0], torch.Tensor):
            # Under a dispatch mode, .item() of a 0-dim tensor autograd made from a Python number arrives with
            # the number itself (torch 2.13); stagetorch.lazy reads such saved numbers.
            return args[0]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self._see(t)
        return out


# "remat" is the chunked path's budget with recomputation allowed (jit's default); "chunked" and
# "small_chunks" turn it off, so that they measure chunking alone. The same for "lazy_remat" and "lazy_chunked".
PATHS = ["jit", "chunked", "small_chunks", "remat", "no_grad", "lazy", "lazy_chunked", "lazy_remat"]


def smallest_plan_peak(staged: stagetorch.Staged, *args: torch.Tensor) -> int:
    """The predicted peak of the smallest plan (chunks of one example)."""
    entry, _, _ = staged._stage(args, {})
    split = entry.executable.split()
    return max(*_chunk_peaks(split, 1, peak_bytes), _phase_peak(split, 1, peak_bytes))


def budget_between(staged, args, fraction):
    """A budget ``fraction`` of the way from the smallest feasible plan's peak to the whole batch's."""
    smallest = smallest_plan_peak(staged, *args)
    full = staged.plan(*args).full_batch_peak_bytes
    return int((smallest + fraction * (full - smallest)) / (1 - SAFETY_MARGIN)) + 64


def measure(name, path, tracker=None, warm=True):
    """Run one step of ``name`` along ``path`` at the allocator (``tracker``: another, such as the LivePeak
    diagnostic): (predicted, measured, budget, chunks). The model's state, the inputs and nothing else are
    resident before the step. ``warm``: a lazy path's programs are made before the measured call."""
    tracker = AllocatorPeak if tracker is None else tracker
    torch.manual_seed(0)
    model, make = MODELS[name]()
    # The MLP's activations outweigh its parameters only from a few hundred examples: below, chunking saves nothing.
    x, y = make(1024 if name == "mlp" else 16)
    resident = [*model.parameters(), *model.buffers(), x, y]
    if path == "no_grad":
        with torch.no_grad():
            staged = stagetorch.jit(model if name != "gpt2" else lambda ids: model(input_ids=ids).logits)
            staged.memory_budget = budget_between(staged, (x,), 0.3)
            plan = staged.plan(x)
            with tracker(resident) as run:
                staged(x)
        return plan.peak, run.peak, staged.memory_budget, len(plan.chunk_sizes)
    staged = stagetorch.jit(_step_of(name)(copy.deepcopy(model)))
    budget = {"chunked": 0.4, "small_chunks": 0.05, "remat": 0.4, "lazy_chunked": 0.4, "lazy_remat": 0.4}.get(path)
    if budget is not None:
        budget = budget_between(staged, (x, y), budget)
    if path.startswith("lazy"):
        # The prediction is that of the flushes lazy runs (through the Executable every front end uses).
        planned = []
        run_executable = Executable.run

        def recorded(self, inputs, plan, **kwargs):
            out = run_executable(self, inputs, plan, **kwargs)
            planned.append(plan)  # the plan it ran, as its caller planned it
            return out

        if warm:
            # The process's lazy programs for this step made first (on a copy), as a test run alone has none:
            # the measured call is a later one. A first call can plan otherwise (see test_memory's
            # test_a_first_lazy_call_is_planned_as_it_runs).
            lcx, lcy = stagetorch.lazy(x, y, batch=0, memory_budget=budget, remat=False if path == "lazy_chunked" else "auto")
            float(_step_of(name)(copy.deepcopy(model))(lcx, lcy))
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Executable, "run", recorded)
            with tracker(resident) as run:
                lx, ly = stagetorch.lazy(x, y, batch=0, memory_budget=budget, remat=False if path == "lazy_chunked" else "auto")
                float(_step_of(name)(model)(lx, ly))
        assert planned
        return max(p.peak for p in planned), run.peak, budget, max(len(p.chunk_sizes) for p in planned)
    staged = stagetorch.jit(_step_of(name)(model), memory_budget=budget, remat="auto" if path in ("jit", "remat") else False)
    plan = staged.plan(x, y)
    with tracker(resident) as run:
        staged(x, y)
    return plan.peak, run.peak, budget, len(plan.chunk_sizes)


def measured_peak(step: Callable, model: torch.nn.Module, *args: torch.Tensor) -> int:
    """The allocator's peak of ``step(*args)`` run eagerly, with the model's state and the inputs resident."""
    resident = [*model.parameters(), *model.buffers(), *args]
    with AllocatorPeak(resident) as tracker:
        step(*args)
    return tracker.peak


def allocator_peak(step: Callable, resident: Iterable[torch.Tensor], *args, device: str = "cpu", **kwargs) -> tuple[int, Any]:
    """``(peak, result)`` of ``step(*args, **kwargs)`` at the allocator, with ``resident`` (parameters, buffers,
    held ``.grad``, optimizer state, inputs) counted as alive before it."""
    with AllocatorPeak(resident, device) as tracker:
        out = step(*args, **kwargs)
    return tracker.peak, out


def op_workspace(op: Callable, *args: Any, at_malloc: bool = True) -> int:
    """What ``op(*args)`` allocates beyond its outputs at its own peak, as the allocator sees it: the bytes a
    workspace rule says (run below autograd, as staged programs run; the inputs already resident).
    ``at_malloc=False``: the profiler's events alone (see AllocatorPeak)."""
    held = {t.untyped_storage().data_ptr() for t in args if isinstance(t, torch.Tensor)}
    with torch._C._AutoDispatchBelowAutograd(), AllocatorPeak(at_malloc=at_malloc) as run:
        out = op(*args)
    outs = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in (out if isinstance(out, (tuple, list)) else (out,))
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in held
    }
    return run.excess - sum(outs.values())

"""A function staged by :func:`~stagetorch.jit`: :class:`Staged`, its cache of programs (one per input
signature and state), the guards that pick one per call, and restaging when something it read changed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
import torch.utils._pytree as pytree

from ..devices.budget import format_bytes, free_memory, parse_bytes
from ..devices.catalog import Device, PlanOnlyDeviceError, device_named
from ..errors import BatchShapeError, NotATensorError, OutOfMemoryError, UnsupportedOpError
from ..interpreters.batching import Batched
from ..interpreters.eager import is_dense
from ..ir import Graph
from ..ops.kernels.cuda_dispatch import cuda_staging, no_cuda_autocast_on_cpu
from ..ops.kernels.cuda_sdpa import CudaProps
from ..parallel import data_parallel as distributed
from ..parallel import fsdp
from ..planning.chunks import Plan
from ..planning.planner import COPIES
from ..staging.guards import MAX_OUTCOMES, Outcomes, StateWalk, flatten_args
from ..staging.state import State, arg_names, discover, held_values
from ..staging.tracer import Traced, leaf_names, staging_device, trace
from ..utils import caches
from .executable import Executable
from .grads import accumulate_grad, install_grads
from .plan_log import PlanLog

__all__ = ["Staged", "grad_storages", "map_batched"]

log = logging.getLogger("stagetorch")


def _signature(leaves: list, static: set[int], leaf_argnum: list[int] | None) -> tuple:
    sig = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and (leaf_argnum is None or leaf_argnum[i] not in static):
            # The strides too: the trace records views and copies as the layout it saw makes them.
            sig.append((leaf.shape, leaf.stride(), leaf.dtype, leaf.device, leaf.requires_grad))
        else:
            try:
                hash(leaf)
                sig.append(("static", type(leaf), leaf))
            except TypeError:
                sig.append(("static-id", id(leaf)))
    return tuple(sig)


def _grad_or_zeros(t: torch.Tensor) -> torch.Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)


def grad_storages(inputs: list, positions: Sequence[int]) -> dict[int, int]:
    """The bytes of the ``.grad`` storages of ``inputs`` at ``positions``, by storage (each counted once)."""
    out = {}
    for i in positions:
        g = inputs[i].grad
        if g is not None:
            out[g.untyped_storage().data_ptr()] = g.untyped_storage().nbytes()
    return out


def _leaf_argnums(args: Sequence, kwargs: dict) -> list[int]:
    out = []
    for i, a in enumerate(args):
        out += [i] * len(pytree.tree_leaves(a))
    for a in kwargs.values():
        out += [-1] * len(pytree.tree_leaves(a))
    return out


def _fed_consts(entry: _Entry, fed: dict) -> list[torch.Tensor]:
    """The program's constants with each value fed from the host program replaced by this call's."""
    graph, consts = entry.traced.graph, entry.executable.consts
    first = len(graph.invars) - len(consts)
    position = {v: i - first for i, v in enumerate(graph.invars) if i >= first}
    out = list(consts)
    for v, t in fed.items():
        out[position[v]] = t
    return out


def _named_args(fn: Callable, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """(name, value) for every argument, positional first, in the order the tracer flattens them."""
    return list(zip(arg_names(fn, len(args)), args)) + list(kwargs.items())


@attrs.define
class _Entry:
    traced: Traced
    executable: Executable
    # Positions of the inputs whose .grad the step adds into after the program (see Staged._held).
    added: list[int] | None = None
    # Positions of the inputs whose .grad the step replaces or clears without reading it: what
    # ``donate_grads=True`` drops before the program runs (see Staged._donated).
    donatable: list[int] | None = None



# As dynamo's recompile limit: this many programs for one function means some value changes every call.
_MANY_PROGRAMS = 8


class Staged:
    """A function staged by :func:`jit`. Call it like the function; inspect it with ``graph``/``plan``."""

    def __init__(
        self,
        fn: Callable,
        *,
        batch_dim: int = 0,
        batch_argnums: Sequence[int] | None = None,
        static_argnums: Sequence[int] = (),
        memory_budget: int | str | None = None,
        progress: bool = False,
        process_group: Any = None,
        remat: str | bool = "auto",
        donate_grads: bool = False,
        device: str | Device | None = None,
    ):
        if remat not in ("auto", False):
            raise ValueError(f"remat must be \"auto\" or False, not {remat!r}")
        if not isinstance(donate_grads, bool):
            raise TypeError(f"donate_grads must be True or False, not {donate_grads!r}")
        self.donate_grads = donate_grads
        self.remat = remat == "auto"
        self.fn = fn
        self.process_group = process_group
        self.progress = progress
        self.batch_dim = batch_dim
        self.batch_argnums = None if batch_argnums is None else tuple(batch_argnums)
        self.static_argnums = tuple(static_argnums)
        self.memory_budget = memory_budget
        # The CUDA device the step is planned for (a name of the table, "cuda", or a Device); None: where its
        # inputs are. A named card this process does not run on is planned on fake CUDA tensors, never run.
        self.device = None if device is None else device_named(device)
        if self.device is not None and not self.device.local and process_group is not None:
            raise ValueError(
                f"device={self.device.name!r} plans for a card this process does not run on, which a process group "
                "cannot: plan one rank's shard as a step of its own (stagetorch.memory(step, device=...) on it)."
            )
        self._cache: dict[tuple, _Entry | Outcomes] = {}
        self._caps: dict[int, int] = {}  # batch size -> the largest chunk that ran after an out-of-memory error
        self._last_key: tuple | None = None
        self._last_entry: _Entry | Outcomes | None = None
        self._walk = StateWalk()  # discover and tensors_and_key, made again only when what they read changed
        # Its plans in the log, all its programs together: one line, then one more only when the plan changes.
        self.plan_log = PlanLog()
        # The level of its "staging again" lines (stagetorch.memory's probes at other batch sizes: DEBUG).
        self.restage_log_level = logging.INFO
        # The modules the last staging found (a process group's step looks for FSDP2 units among them before
        # it stages: their parameters are gathered first), and the last FSDP2 step's bytes by category.
        self._roots: list | None = None
        self.fsdp_memory: fsdp.FsdpMemory | None = None
        functools.update_wrapper(self, fn)
        _STAGED.add(self)

    def _log_restage(self, old: tuple, new: tuple, state: State) -> None:
        """Say why a call stages again: what changed since the previous call's program."""
        why = []
        if old[0] != new[0] or old[1] != new[1]:
            why.append("the arguments (their structure, shapes, strides, dtypes or static values)")
        why += state.changes(old[2], new[2])
        if old[4] != new[4]:
            why.append(f"the grad mode (torch.is_grad_enabled() is now {new[4]})")
        name = getattr(self.fn, "__name__", "step")
        log.log(self.restage_log_level, "stagetorch: %s: staging again (%d programs now), as these changed: %s", name,
                len(self._cache) + 1, "; ".join(why) or "nothing nameable")
        self.plan_log.why = "the step was staged again, as said above"
        if len(self._cache) + 1 == _MANY_PROGRAMS:
            log.warning(
                "stagetorch: %s has been staged %d times: a value it reads changes between calls (last: %s). "
                "Pass a value that changes every step as a tensor argument, or read it outside the function.",
                name, _MANY_PROGRAMS, "; ".join(why))

    def _stage(self, args: tuple, kwargs: dict, global_batch: int | None = None) -> tuple[_Entry, list, State]:
        """The cached staged program for these arguments, and its real inputs. With ``global_batch`` (a
        process group's), the program is staged for the batched arguments holding that many examples."""
        leaves, tree = flatten_args(args, kwargs)
        held = held_values(leaves, lambda: leaf_names(self.fn, args, kwargs))
        if held is not leaves:  # a lazy tensor: the step reads the real tensor it holds
            leaves = held
            args, kwargs = pytree.tree_unflatten(leaves, tree)
        state, state_tensors, state_key = self._walk.walk(self.fn, args, kwargs, leaves)
        static = set(self.static_argnums)
        argnums = _leaf_argnums(args, kwargs) if static or self.batch_argnums is not None else None
        # The grad mode decides what the tracer records (a forward under no_grad has no backward to stage).
        key = (tree, _signature(leaves, static, argnums), state_key, global_batch, torch.is_grad_enabled())
        last = self._last_key
        if last is not None and state_key is last[2] and tree is last[0] and key == last:
            cached = self._last_entry  # the same key objects as the call before: no hash of the whole key
        else:
            cached = self._cache.get(key)
        if argnums is None:
            inputs = [x for x in leaves if isinstance(x, torch.Tensor)]
        else:
            inputs = [x for x, a in zip(leaves, argnums) if isinstance(x, torch.Tensor) and a not in static]
        entry, fed = cached, None
        if isinstance(cached, Outcomes):  # a step that reads values on the host: the program they select
            entry, fed = cached.pick(inputs) or (None, None)
        if entry is None:
            # A new outcome of the host reads is logged once the trace has read it (_add_program).
            if self._last_key is not None and not isinstance(cached, Outcomes):
                self._log_restage(self._last_key, key, state)
            batched_leaves, batch = self._batch_leaves(args, kwargs, allow_empty=global_batch is not None)
            traced_args, traced_kwargs = args, kwargs
            if global_batch is not None:
                batch = global_batch
                traced_args, traced_kwargs = map_batched(
                    self, args, kwargs, lambda x, dim: distributed.global_aval(x, dim, global_batch)
                )
            restore = state.snapshot()
            with distributed.staging(state, self.process_group), self._card_kernels():
                traced = trace(self.fn, traced_args, traced_kwargs, static_argnums=self.static_argnums, state=state,
                               device=self._fake_device)
            self._check_unchanged(state, state_key, args, kwargs, restore)
            graph = traced.graph
            arg_vars = [v for v, r in zip(graph.invars, graph.roles) if r == "arg"]
            batched = {v: Batched(dim) for v, (is_batched, dim) in zip(arg_vars, batched_leaves) if is_batched}
            # A chunk size that ran out of memory for another signature of this step is not tried again.
            entry = _Entry(
                traced,
                Executable(graph, batched, batch, traced.consts, cap=self._caps.get(batch), remat=self.remat,
                           cut_coupled=True, device=self.device),
            )
            entry.executable.plan_log = self.plan_log
            cached = self._add_program(key, cached, entry)
        self._last_key, self._last_entry = key, cached
        inputs += state_tensors
        inputs += [_grad_or_zeros(inputs[i]) for i in entry.traced.grad_params]
        consts = entry.executable.consts
        if fed:  # the values read on the host that the program reads too (nonzero's rows): this call's
            consts = _fed_consts(entry, fed)
        inputs += consts
        return entry, inputs, state

    def _add_program(self, key: tuple, cached: Any, entry: _Entry) -> Any:
        """Cache ``entry`` under ``key``: alone, or among the programs of that key chosen by what the step
        reads on the host (logged when they grow). **Returns** what the key now holds."""
        host = entry.traced.host
        if host is None:
            self._cache[key] = entry
            return entry
        outcomes = cached if isinstance(cached, Outcomes) else Outcomes()
        outcomes.add(host, entry)
        self._cache[key] = outcomes
        if len(outcomes) > 1:
            log.info("stagetorch: %s: staging again for what it read on the host (%d programs for these arguments "
                     "now, at most %d): %s", getattr(self.fn, "__name__", "step"), len(outcomes), MAX_OUTCOMES,
                     host.describe())
        return outcomes

    def _check_unchanged(self, state: State, key: tuple, args: tuple, kwargs: dict, restore: Callable) -> None:
        """Refuse a function that changes, while it is staged, a Python value its programs are keyed on.

        The trace runs the function's Python once; a later call reuses the program and runs none of it. A
        ``scheduler.step()`` or ``self.calls += 1`` inside the function would then happen once per trace,
        not once per call, and move the key it is cached under: silently wrong hyperparameters."""
        after = discover(self.fn, args, kwargs).tensors_and_key()[1]
        if after == key:
            return
        changed = state.changes(key, after)
        restore()
        name = getattr(self.fn, "__name__", "the function")
        code = getattr(self.fn, "__code__", None)
        where = f" (defined at {code.co_filename}:{code.co_firstlineno})" if code is not None else ""
        raise UnsupportedOpError(
            f"{name}{where} changed Python-side state while stagetorch staged it: {'; '.join(changed) or 'its state'}. "
            "Python code runs only when a function is staged, not on every call, so such an update (an LR "
            "scheduler's step(), a counter on a module) would happen once per program instead of once per step. "
            "What to do: make the update outside the staged function (call scheduler.step() after the step "
            "returns), or keep the value in a tensor. The values it changed have been put back."
        )

    def _batch_leaves(
        self, args: tuple, kwargs: dict, allow_empty: bool = False
    ) -> tuple[list[tuple[bool, int]], int]:
        """For each tensor leaf of the non-static arguments: is it batched, and along which dim; and the batch
        size. Raises a clear error for a batch dim out of range, mismatched batch sizes or an empty batch
        (unless ``allow_empty``: a process group's rank may hold no examples)."""
        static = set(self.static_argnums)
        chosen = None if self.batch_argnums is None else set(self.batch_argnums)
        if chosen is not None:
            for i in chosen:
                if i >= len(args) or not any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(args[i])):
                    raise NotATensorError(
                        f"batch_argnums names argument {i}, which is not a tensor (or pytree of tensors) "
                        f"in this call of {getattr(self.fn, '__name__', 'the function')}. What to do: list in "
                        "batch_argnums only the arguments that carry the batch"
                    )
        names = _named_args(self.fn, args, kwargs)
        out, sizes = [], []
        for argnum, (name, tree) in enumerate(names):
            for path, leaf in pytree.tree_flatten_with_path(tree)[0]:
                if not isinstance(leaf, torch.Tensor) or argnum in static:
                    continue
                is_batched = chosen is None or argnum in chosen
                dim = self.batch_dim
                if is_batched:
                    where = name + pytree.keystr(path)
                    if not -leaf.ndim <= dim < leaf.ndim:
                        raise BatchShapeError(
                            f"batch_dim={dim} is out of range for argument {where} with shape {tuple(leaf.shape)}; "
                            "pass batch_dim=... or leave this argument out of batch_argnums"
                        )
                    dim %= leaf.ndim
                    sizes.append((where, leaf.shape[dim]))
                out.append((is_batched, dim))
        if len({n for _, n in sizes}) > 1:
            listed = ", ".join(f"{w}: {n}" for w, n in sizes)
            raise BatchShapeError(
                f"the batched arguments disagree on the batch size ({listed}); batch_dim={self.batch_dim}. What to do: "
                "pass the same number of examples in each, or leave the arguments that are not per-example out of "
                "batch_argnums"
            )
        batch = sizes[0][1] if sizes else 1
        if sizes and batch == 0 and not allow_empty:
            raise BatchShapeError(f"the batch is empty: {sizes[0][0]} has 0 examples along batch_dim={self.batch_dim}")
        return out, batch

    def graph(self, *args: Any, **kwargs: Any) -> Graph:
        """The staged program for these arguments (staging it if needed)."""
        return self._stage(args, kwargs)[0].traced.graph

    def plan(self, *args: Any, **kwargs: Any) -> Plan:
        """How a call with these arguments would run: chunk sizes, predicted peaks, and why.

        With a ``process_group`` this is this rank's plan for its shard, and a collective: call it on every
        rank, with every rank's shard. If no schedule fits on some rank, every rank raises the same
        ``OutOfMemoryError`` (``smallest_budget``: this rank's, None where it fitted), as the call does, so
        that a retry keeps the ranks in step.
        """
        if self.process_group is not None:
            group = distributed.ShardGroup(self.process_group)
            with fsdp.gathered(self._modules(args, kwargs), self.process_group) as units:
                entry, _, plan, _ = self._shard(group, args, kwargs, units)
            group.check(plan if isinstance(plan, OutOfMemoryError) else None, entry.executable.signature())
            return plan
        entry, inputs, _ = self._stage(args, kwargs)
        return self._step_plan(entry, inputs)

    def _card_kernels(self) -> contextlib.AbstractContextManager:
        """For a named card: CUDA's choice of attention kernel for its compute capability (and CUDA's autocast
        where the trace runs on fake CUDA tensors), whichever device the trace runs on (a CPU-only torch traces
        on CPU fakes: see :func:`~stagetorch.staging.tracer.staging_device`)."""
        if self._fake_device is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(cuda_staging(CudaProps(capability=self.device.capability), devices=("cuda", "cpu")))
        if staging_device(self._fake_device).type == "cpu":
            stack.enter_context(no_cuda_autocast_on_cpu(self.device.name))
        return stack

    @property
    def _fake_device(self) -> torch.device | None:
        """Where a step planned for a named card is staged as if it lived (None: where its inputs are)."""
        return torch.device("cuda") if self.device is not None and not self.device.local else None

    def _budget(self, executable: Executable, inputs: list = ()) -> int:
        """The step's budget: its ``memory_budget``, else what the device has free; on CUDA no more than what
        this process can get, with the bytes its ``inputs`` already hold there (see
        :func:`stagetorch.devices.budget.free_memory`). For a named card: its ``memory_budget``, no more than
        what the card's caching allocator may reserve (``Device.usable_bytes``), else all of that."""
        if self._fake_device is not None:
            usable = self.device.usable_bytes
            if self.memory_budget is None:
                return usable
            asked = parse_bytes(self.memory_budget)
            if asked > usable and (self.device, asked) not in _SAID_OVER:
                _SAID_OVER.add((self.device, asked))
                log.warning("stagetorch: memory_budget=%r is more than %s can hold (%s usable): planned for that.",
                            self.memory_budget, self.device.name, format_bytes(usable))
            return min(asked, usable)
        return free_memory(executable.graph.device, self.memory_budget, executable.resident_bytes(inputs))

    def _refuse_to_run(self) -> None:
        """A step planned for a named card this process does not run on is planned, never run."""
        if self._fake_device is not None:
            name = getattr(self.fn, "__name__", "the step")
            raise PlanOnlyDeviceError(
                f"{name} is staged for device={self.device.name!r}, a card this process does not run on: it was "
                "staged on fake CUDA tensors, and can be planned and reported, not run.\nWhat to do: ask "
                f"{name}.plan(*args) or stagetorch.memory(step, device=...)(*args) for the plan; to run the step, "
                "stage it without device= (or with device='cuda') on the machine that has the GPU."
            )

    def _donated(self, entry: _Entry) -> list[int]:
        """Positions of the inputs whose ``.grad`` the call drops before the program runs: with
        ``donate_grads=True``, each one the step replaces or clears (``zero_grad()``, then ``backward()``)
        without reading it first, as eager frees it at the ``zero_grad()``. A ``.grad`` the step reads (clips,
        adds into, returns) is an input of the program and stays until it has run."""
        if not self.donate_grads:
            return []
        if entry.donatable is None:
            traced = entry.traced
            read = set(traced.grad_params)
            entry.donatable = [i for i in dict.fromkeys((*traced.assign_grads, *traced.clear_grads)) if i not in read]
        return entry.donatable

    def _held(self, entry: _Entry, inputs: list) -> tuple[int, list[str]]:
        """What a call holds beside the program while it runs, and why: the copies of the inputs it writes
        outside its commit (kept to restore them if the step fails: BatchNorm's statistics; an optimizer's
        parameters and moments only where something that can fail runs after its update), each
        ``.grad`` the step replaces or clears (the old one lives until the program has run, unless
        ``donate_grads=True`` drops it first: :meth:`_donated`), and each ``.grad`` it adds into after the
        program (gradient accumulation). Without them an optimizer step inside ``jit`` ran up to 35% over
        its plan, and an accumulating step over its budget."""
        executable, traced = entry.executable, entry.traced
        copies = {inputs[i].untyped_storage().data_ptr(): inputs[i].untyped_storage().nbytes() for i in executable.guarded}
        replaced = (*traced.assign_grads, *traced.clear_grads)
        if self.donate_grads:
            dropped = set(self._donated(entry))
            replaced = tuple(i for i in replaced if i not in dropped)
        old = grad_storages(inputs, replaced)
        if entry.added is None:
            fed = {*traced.grad_params, *traced.assign_grads, *traced.clear_grads}
            entry.added = [i for i, _ in executable.graph.grads if i not in fed]
        added = grad_storages(inputs, entry.added)
        why = [COPIES.format(len(copies))] if copies else []
        why += [f"the old .grad of {len(old)} parameter(s), which the step replaces"] if old else []
        why += [f"the .grad of {len(added)} parameter(s), which the step adds into"] if added else []
        return sum({**copies, **old, **added}.values()), why

    def _step_plan(self, entry: _Entry, inputs: list) -> Plan:
        """The step's plan (the budget the program is planned in on it): the step's budget less what the call holds
        beside the program (:meth:`_held`), which the plan's peak counts. An error about the budget then
        says what ``memory_budget`` would fit (see :meth:`stagetorch.planning.planner.Planner.plan_call`)."""
        executable = entry.executable
        held, why = self._held(entry, inputs)
        donated = sum(grad_storages(inputs, self._donated(entry)).values()) if self.donate_grads else 0
        return executable.planner.plan_call(self._budget(executable, inputs), held, why, inputs, donated)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse_to_run()
        if self.process_group is not None:
            return self._call_sharded(args, kwargs)
        entry, inputs, _ = self._stage(args, kwargs)
        executable = entry.executable
        plan = self._step_plan(entry, inputs)
        if self.donate_grads:
            # The old .grad the step replaces without reading it, freed now, as eager frees it at zero_grad():
            # a failed step leaves it None (what it restores needs nothing from it; nor does a retry in
            # smaller chunks, which reads only the program's inputs).
            for i in self._donated(entry):
                inputs[i].grad = None
        name = getattr(self.fn, "__name__", "step")
        outs, grads = executable.run(inputs, plan, on_chunk=self._progress(plan), name=name)
        if executable.cap is not None:
            self._caps[executable.batch] = executable.cap
        traced = entry.traced
        first = len(inputs) - len(executable.consts) - len(traced.grad_params)
        install_grads(inputs, grads, inputs[first:], traced.grad_params, traced.assign_grads, traced.clear_grads)
        n = traced.graph.out_tree.num_leaves
        for (opt, p, key), value in zip(traced.state_outs, outs[n:]):
            opt.state[p][key] = value
        return pytree.tree_unflatten(outs[:n], traced.graph.out_tree)

    def _modules(self, args: tuple, kwargs: dict) -> list:
        """The modules the step reads, as the last staging found them (found now on the first call)."""
        if self._roots is None:
            self._roots = discover(self.fn, args, kwargs).modules
        return self._roots

    def _shard(self, group: distributed.ShardGroup, args: tuple, kwargs: dict, units: fsdp.Units | None = None) -> tuple:
        """Stage this rank's shard as part of the global batch and plan it for this rank's budget (two
        collectives). ``units``: the FSDP2 units, gathered, whose shards the plan holds beside the program.
        **Returns** the entry, its real inputs, the plan or the ``OutOfMemoryError`` that says none fits,
        and the shard's offset in the global batch."""
        def describe() -> tuple[int, distributed.Signature]:
            leaves, local = self._batch_leaves(args, kwargs, allow_empty=True)
            return local, self._signature(args, kwargs, leaves)

        sizes = group.global_sizes(describe, getattr(self.fn, "__name__", "the step"))
        local = sizes[group.rank]
        # The program is the global batch's, staged on stand-ins laid out as the shard (dense, in the order
        # of its strides: channels-last stays channels-last, with no copy); the shard runs on what it cuts.
        # A shard with gaps or overlaps (a strided view) runs on a contiguous copy, as the stand-in is.
        args, kwargs = map_batched(self, args, kwargs, lambda x, dim: x if is_dense(x) else x.contiguous())
        entry, inputs, state = self._stage(args, kwargs, global_batch=sum(sizes))
        self._roots = state.modules
        executable = entry.executable
        if units is None:
            plan = executable.shard_plan(local, self._budget(executable, inputs))
            return entry, inputs, plan, sum(sizes[: group.rank])
        # FSDP2: the shards are held beside the program, whose inputs are the gathered parameters and whose
        # outputs their unsharded gradients; the reduce-scatter after it peaks with all of those at once.
        memory = units.memory([inputs[i] for i, _ in executable.graph.grads])
        why = [f"FSDP2's shards and one all-gather buffer ({format_bytes(memory.beside)})"]
        budget = self._budget(executable, inputs)
        plan = executable.shard_plan(local, budget, (memory.beside, why))
        scatter = memory.scatter_peak(executable.resident_bytes(inputs))
        if isinstance(plan, OutOfMemoryError) and plan.smallest_budget is not None and plan.smallest_budget < scatter:
            # The program alone would fit from its smallest budget on, but the reduce-scatter after it peaks
            # higher whatever the chunks: that is the smallest budget.
            plan = OutOfMemoryError(
                f"with FSDP2's shards ({format_bytes(memory.beside)}) beside it, the reduce-scatter of the unsharded "
                f"gradients after the chunks peaks at {format_bytes(scatter)} whatever the chunks (the program "
                f"alone fits from {format_bytes(plan.smallest_budget)}), against a budget of "
                f"{format_bytes(budget)}.\nWhat to do: raise memory_budget to at least {scatter} bytes."
            )
            plan.smallest_budget = scatter
        if not isinstance(plan, OutOfMemoryError):
            held = plan.held_bytes + memory.beside
            plan = attrs.evolve(plan, held_bytes=held, phase_peak_bytes=max(plan.phase_peak_bytes, scatter - held),
                                reason=f"{plan.reason} Beside it: {why[0]}; the reduce-scatter of the gradients "
                                f"after it peaks at {format_bytes(scatter)}.")
            if plan.peak > budget:  # what no chunk size changes: the reduce-scatter, or a rank without examples
                peak = plan.peak
                plan = OutOfMemoryError(
                    f"with FSDP2's shards ({format_bytes(memory.beside)}) beside it and the reduce-scatter of the "
                    f"unsharded gradients after it ({format_bytes(scatter)}), this rank's step peaks at "
                    f"{format_bytes(peak)} in chunks of {list(plan.chunk_sizes)}, against a budget of "
                    f"{format_bytes(budget)}.\nWhat to do: raise memory_budget to at least {peak} bytes."
                )
                plan.smallest_budget = peak
        self.fsdp_memory = memory
        return entry, inputs, plan, sum(sizes[: group.rank])

    def _signature(self, args: tuple, kwargs: dict, leaves: list[tuple[bool, int]]) -> distributed.Signature:
        """What every rank's call must share: the step, the arguments' structure, their dtypes, and their
        shapes but the batch dimension (``leaves``: each tensor's (batched, dim), from ``_batch_leaves``)."""
        flat, tree = pytree.tree_flatten((args, kwargs))
        static = set(self.static_argnums)
        argnums = _leaf_argnums(args, kwargs)
        tensors = [x for x, a in zip(flat, argnums) if isinstance(x, torch.Tensor) and a not in static]
        shapes = [
            tuple("N" if batched and d == dim else n for d, n in enumerate(x.shape))
            for x, (batched, dim) in zip(tensors, leaves)
        ]
        code = getattr(self.fn, "__code__", None)
        where = f" ({code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno})" if code is not None else ""
        return distributed.Signature(
            the_step=f"{getattr(self.fn, '__qualname__', type(self.fn).__name__)}{where}",
            the_argument_structure=f"{tree} with leaves {[type(x).__name__ for x in flat]}",
            the_argument_dtypes=str([str(x.dtype).removeprefix("torch.") for x in tensors]),
            the_argument_shapes=str(shapes).replace("'N'", "N"),
        )

    def _call_sharded(self, args: tuple, kwargs: dict) -> Any:
        """One data-parallel step: this rank's shard of a global batch (see ``stagetorch.parallel.data_parallel``)."""
        group = distributed.ShardGroup(self.process_group)
        with fsdp.gathered(self._modules(args, kwargs), self.process_group) as units:
            return self._run_sharded(group, args, kwargs, units)

    def _run_sharded(self, group: distributed.ShardGroup, args: tuple, kwargs: dict, units: fsdp.Units | None) -> Any:
        entry, inputs, plan, offset = self._shard(group, args, kwargs, units)
        traced = entry.traced
        if traced.state_outs or traced.grad_params or traced.assign_grads or traced.clear_grads:
            # Every rank staged the same program, so every rank raises here: no collective is left waiting.
            raise UnsupportedOpError(
                f"{getattr(self.fn, '__name__', 'the step')} reads or sets .grad, or steps an optimizer, inside a "
                "step staged with process_group=: the gradients are all-reduced after the staged program has run, "
                "so they would be this rank's alone. What to do: call clip_grad_norm_, opt.step() and "
                "opt.zero_grad() after the staged step returns (its .grad is then the global batch's)."
            )
        executable = entry.executable
        group.check(plan if isinstance(plan, OutOfMemoryError) else None, executable.signature())
        if isinstance(plan, Plan):
            self.plan_log.say(f"{getattr(self.fn, '__name__', 'step')} (rank {group.rank})", plan)
        keep = [i for i, _ in executable.graph.grads if units.owns(inputs[i])] if units is not None else ()
        outs, grads, partial = executable.run_shard(inputs, plan, offset, group, on_chunk=self._progress(plan),
                                                    keep_partial=keep)
        # In the order of the inputs, the same on every rank: FSDP2's gradients are reduce-scattered here.
        scattered = []
        for i, g in sorted(grads, key=lambda ig: ig[0]):
            if units is not None and units.owns(inputs[i]):
                scattered.append((inputs[i], g, i in partial))
            else:
                accumulate_grad(inputs[i], g)
        if scattered:
            units.scatter_all(scattered)
        return pytree.tree_unflatten(outs, executable.graph.out_tree)

    def _progress(self, plan: Plan) -> Any:
        if not self.progress:
            return None
        from tqdm.auto import tqdm

        bar = tqdm(total=plan.batch, unit="example", desc=getattr(self.fn, "__name__", "step"))

        def advance(start: int, n: int) -> None:
            bar.update(n)
            if start + n >= plan.batch:
                bar.close()

        return advance


_STAGED: weakref.WeakSet[Staged] = weakref.WeakSet()
_SAID_OVER: set = set()  # (device, budget) pairs whose budget was said to be more than the named card holds
caches.on_clear(lambda: [s._cache.clear() for s in list(_STAGED)])


def map_batched(staged: Any, args: tuple, kwargs: dict, f: Callable[[torch.Tensor, int], Any]) -> tuple[tuple, dict]:
    """The arguments with every batched tensor ``x`` replaced by ``f(x, its batch dim)``."""
    leaves_info, _ = staged._batch_leaves(args, kwargs, allow_empty=True)
    it = iter(leaves_info)
    static = set(staged.static_argnums)

    def resize(x: Any, argnum: int) -> Any:
        if not isinstance(x, torch.Tensor) or argnum in static:
            return x
        is_batched, dim = next(it)
        return f(x, dim) if is_batched else x

    new_args = tuple(pytree.tree_map(lambda x, i=i: resize(x, i), a) for i, a in enumerate(args))
    new_kwargs = {k: pytree.tree_map(lambda x: resize(x, -1), v) for k, v in kwargs.items()}
    return new_args, new_kwargs


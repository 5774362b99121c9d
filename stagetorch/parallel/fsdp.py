"""FSDP2 (``torch.distributed.fsdp.fully_shard``) under a step staged with ``process_group=``.

FSDP2 keeps each parameter as a DTensor shard (dim 0, padded to a multiple of the group's size) and moves
data in module hooks and autograd functions: an all-gather before a unit's forward and backward, a
reduce-scatter of its gradients after. The tracer follows neither, so stagetorch does not trace them: it
stages the **unsharded** module and places FSDP2's collectives around the staged program itself.

1. :func:`gathered` all-gathers every unit's parameters with FSDP2's own ``FSDPModule.unshard()`` (so its
   padding, its buffers and the unsharded ``nn.Parameter`` objects are FSDP2's, the same objects every step:
   the staged program's cache key holds), before the step is staged or run; FSDP2's forward hooks are set
   aside while the step is traced (:func:`hooks_off`).
2. The step runs as any data-parallel step (staged for the global batch, this rank's shard in chunks).
   The gradients of FSDP2's parameters are **not** all-reduced with the others: each stays this rank's
   partial sum, accumulated unsharded over the rank's chunks (as ``set_requires_gradient_sync(False)``
   does), and :meth:`Units.scatter` reduce-scatters it (a sum over the ranks: each rank's partial is
   already divided by the global batch's normaliser) into the sharded ``.grad`` DTensor that FSDP2's
   optimizer step reads.
3. ``FSDPModule.reshard()`` frees the unsharded parameters after the step, whatever ``reshard_after_forward``
   says (FSDP2 too reshards every unit after the backward).

So a rank's memory during the step holds the unsharded parameters and gradients of every unit at once (as
DDP's would), beside the 1/N shards and the chunked activations: what FSDP2 saves here is the optimizer
state and the parameters between steps, not the step's own peak. Gathering unit by unit inside the chunk
loop is not done (see docs/distributed.md).

This module knows ``torch.distributed`` and FSDP2's public API (``FSDPModule``, ``unshard``, ``reshard``,
DTensor); it knows nothing of the staged program.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist

from ..errors import UnsupportedOpError

# torch 2.13 renamed reduce_scatter_tensor (and warns on the old name); torch 2.11 has only that.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

__all__ = ["Units", "unit_class", "find_units", "gathered", "hooks_off", "refuse_sharded", "refuse_lazy", "guard_calls",
           "FsdpMemory"]


def _fsdp_classes() -> tuple[type, type] | None:
    """FSDP2's ``FSDPModule`` and ``DTensor``, or None where no module can be one: FSDP2 not imported (importing
    it here would cost every step's first staging about 2 s), or a torch built without distributed."""
    if "torch.distributed.fsdp" not in sys.modules:
        return None
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return FSDPModule, DTensor


def unit_class() -> type | None:
    """FSDP2's ``FSDPModule`` (what ``fully_shard`` makes a module), None without ``torch.distributed``."""
    classes = _fsdp_classes()
    return None if classes is None else classes[0]


def find_units(roots: Sequence[tuple[str, torch.nn.Module]]) -> list[tuple[str, torch.nn.Module]]:
    """The ``fully_shard``-ed modules under ``roots``, (name, module) in module-tree order: the same order on
    every rank, which every collective here follows."""
    classes = _fsdp_classes()
    if classes is None:
        return []
    out, seen = [], set()
    for prefix, root in roots:
        for name, m in root.named_modules():
            if isinstance(m, classes[0]) and id(m) not in seen:
                seen.add(id(m))
                out.append((".".join(p for p in (prefix, name) if p) or type(m).__name__, m))
    return out


@attrs.frozen
class FsdpMemory:
    """A rank's bytes under FSDP2 beside what the staged program's plan counts, by category: the plan's
    ``held_bytes`` holds :attr:`beside`, its ``phase_peak_bytes`` at least :meth:`scatter_peak` (less the
    held bytes). The unsharded parameters are the program's inputs, counted in its plan."""

    sharded_params: int  # this rank's shards (FSDP2's padded storage), alive the whole step
    sharded_grads: int  # the sharded .grad the step adds into (0 when it is None: the step makes it)
    unsharded_params: int  # every unit's gathered parameters: inputs of the program, in its plan
    unsharded_grads: int  # every unit's unsharded gradient, this rank's partial sum: outputs of the program
    # the largest unit's padded gradients, every rank's share (one reduce-scatter's input); on gloo, with the
    # copy gloo makes of it while the collective runs
    scatter_buffer: int
    new_grad_shards: int  # the sharded .grad the scatter makes (1/N of the unsharded gradients, padded)
    # The largest unit's all-gather output (its padded parameters), alive with its copy-out: FSDP2 frees it
    # after, unit by unit (measured on gloo with storage weak references: every output freed when unshard()
    # returns; gloo's worker thread may drop the last reference a moment after the caller, a free the CPU
    # profiler does not record, which tests/support/memtrack.py accounts for).
    gather_buffer: int = 0

    @property
    def beside(self) -> int:
        """What the call holds beside the program while it runs: the shards (and the sharded .grad it adds
        into), and the all-gather outputs the backend may keep."""
        return self.sharded_params + self.sharded_grads + self.gather_buffer

    def scatter_peak(self, resident: int) -> int:
        """The peak of the reduce-scatter after the program: its ``resident`` inputs (the gathered parameters,
        the batch), every unsharded gradient, the shards and the new sharded .grad, and one padded buffer."""
        return resident + self.unsharded_grads + self.beside + self.new_grad_shards + self.scatter_buffer


class Units:
    """The FSDP2 units of one step, gathered: which unsharded parameter stands for which sharded one."""

    def __init__(self, units: list[tuple[str, torch.nn.Module]], group: Any):
        self.units = units
        self.group = group
        self.size = dist.get_world_size(group)
        # id(unsharded parameter) -> (its name, the sharded DTensor parameter)
        self.sharded: dict[int, tuple[str, Any]] = {}
        self._gathered = False
        self.gather_buffer = 0  # the all-gather outputs (padded parameters) that may stay alive: FsdpMemory
        self.unit_of: dict[int, int] = {}  # id(sharded parameter) -> the index of its unit

    def _own_parameters(self, unit: torch.nn.Module) -> list[torch.Tensor]:
        """The parameters of ``unit`` that are its own: under it, not under a unit inside it."""
        out, todo = [], [unit]
        while todo:
            m = todo.pop()
            out += [p for p in m._parameters.values() if p is not None]
            todo += [c for c in m._modules.values() if c is not None and not isinstance(c, unit_class())]
        return out

    def _slots(self) -> list[tuple[str, torch.nn.Module, str]]:
        """(where, module, attribute) of every parameter slot under the units, each module once."""
        out, seen = [], set()
        for uname, unit in self.units:
            for name, m in unit.named_modules():
                if id(m) in seen:
                    continue
                seen.add(id(m))
                for attr in m._parameters:
                    out.append((".".join(p for p in (uname, name, attr) if p), m, attr))
        return out

    def gather(self) -> None:
        """All-gather every unit's parameters (``unshard()``, unit by unit in module-tree order); checks first
        that each sharded parameter is one FSDP2 shards as this module scatters (dim 0 over the step's group)."""
        _, dtensor = _fsdp_classes()
        slots = self._slots()
        before = []
        for where, m, attr in slots:
            p = m._parameters[attr]
            if isinstance(p, dtensor):
                self._check(where, p)
            before.append(p)
        sizes = []
        for k, (_, unit) in enumerate(self.units):
            own = {id(p): p for p in self._own_parameters(unit) if isinstance(p, dtensor)}
            for key in own:
                self.unit_of.setdefault(key, k)
            sizes.append(sum(math.ceil(p.shape[0] / self.size) * self.size * (p.numel() // max(p.shape[0], 1))
                             * p.element_size() for p in own.values() if p.ndim))
        self.gather_buffer = max(sizes, default=0)
        for _, unit in self.units:
            unit.unshard()
        self._gathered = True
        for (where, m, attr), p in zip(slots, before):
            now = m._parameters[attr]
            if isinstance(p, dtensor):
                if isinstance(now, dtensor):
                    raise UnsupportedOpError(
                        f"{where} is a DTensor that FSDP2's unshard() left sharded: it is not a parameter of a "
                        "fully_shard unit (tensor parallel?), which stagetorch cannot stage.\nWhat to do: shard "
                        "the model with fully_shard alone (per block and at the root)."
                    )
                if now.dtype != p.dtype:
                    raise UnsupportedOpError(
                        f"{where} is gathered as {now.dtype} but kept as {p.dtype} (a MixedPrecisionPolicy): "
                        "stagetorch does not stage FSDP2's mixed precision yet.\nWhat to do: fully_shard without "
                        "mp_policy (or cast the model), or run the step without stagetorch."
                    )
                self.sharded.setdefault(id(now), (where, p))

    def _check(self, where: str, p: Any) -> None:
        from torch.distributed.tensor import Shard

        mesh = p.device_mesh
        if mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
            raise UnsupportedOpError(
                f"{where} is sharded as {tuple(p.placements)} over a {mesh.ndim}-D mesh: stagetorch reduce-scatters "
                "FSDP2's gradients only for parameters sharded along dim 0 over a 1-D mesh (fully_shard's "
                "default; HSDP and shard_placement_fn are not supported).\nWhat to do: fully_shard with the "
                "default placement over the step's process group."
            )
        mine = dist.get_process_group_ranks(mesh.get_group())
        if mine != dist.get_process_group_ranks(self.group):
            raise UnsupportedOpError(
                f"{where} is sharded over ranks {mine}, but the step's process_group holds ranks "
                f"{dist.get_process_group_ranks(self.group)}.\nWhat to do: pass process_group= the group "
                "fully_shard's mesh uses (mesh.get_group())."
            )

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a gathered parameter of a unit (its gradient goes to :meth:`scatter`)."""
        return id(t) in self.sharded

    def scatter_all(self, grads: list[tuple[torch.Tensor, torch.Tensor, bool]]) -> None:
        """:meth:`scatter` for every (gathered parameter, unsharded gradient, partial) of a step, in the
        order given (the same on every rank): the partial sums in one reduce-scatter per unit and dtype, as
        FSDP2 buckets them (each rank's rows of every parameter side by side), the others cut locally."""
        buckets: dict[tuple[int, torch.dtype], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for param, grad, partial in grads:
            if partial:
                unit = self.unit_of.get(id(self.sharded[id(param)][1]), -1)
                buckets.setdefault((unit, grad.dtype), []).append((param, grad))
            else:
                self.scatter(param, grad, False)
        # One input buffer for every bucket of a dtype, the largest's size, reused bucket after bucket: one
        # buffer's bytes whatever the order in which the allocator and gloo's worker thread free things.
        scratch: dict[torch.dtype, torch.Tensor] = {}
        for (_, dtype), items in buckets.items():
            size = self.size * sum(self._share(grad)[1] * self._share(grad)[2] for _, grad in items)
            if dtype not in scratch or scratch[dtype].numel() < size:
                scratch[dtype] = items[0][1].new_empty(size)
        for (_, dtype), items in sorted(buckets.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
            self._scatter_bucket(items, scratch[dtype])

    def _share(self, grad: torch.Tensor) -> tuple[int, int, int]:
        """(rows, rows per rank, row numel) of a gradient, sharded along dim 0 with FSDP2's padding."""
        rows = grad.shape[0] if grad.ndim else 1
        return rows, math.ceil(rows / self.size), grad.numel() // max(rows, 1)

    def _scatter_bucket(self, items: list[tuple[torch.Tensor, torch.Tensor]], scratch: torch.Tensor | None = None) -> None:
        n = self.size
        shapes = [self._share(grad) for _, grad in items]
        width = sum(c * r for _, c, r in shapes)
        if scratch is None:
            scratch = items[0][1].new_empty(n * width)
        buffer = scratch[: n * width].view(n, width)  # rank k's rows of every gradient, side by side
        buffer.zero_()  # the padding rows
        offset = 0
        for (_, grad), (rows, c, r) in zip(items, shapes):
            flat = grad.reshape(rows, r)
            for k in range(n):
                part = flat[k * c: min((k + 1) * c, rows)]
                buffer[k, offset: offset + part.numel()].copy_(part.reshape(-1))
            offset += c * r
        out = buffer.new_empty(width)
        _reduce_scatter(out, buffer.view(-1), op=dist.ReduceOp.SUM, group=self.group)
        del buffer
        offset = 0
        for (param, _), (_, c, r) in zip(items, shapes):
            self._add_shard(param, out[offset: offset + c * r].view(c, r))
            offset += c * r

    def _add_shard(self, param: torch.Tensor, rows: torch.Tensor) -> None:
        """Add this rank's ``rows`` (its padded share of the gradient, flattened to rows) into the sharded
        parameter's ``.grad``, made as a DTensor laid out as the parameter where there is none."""
        from torch.distributed.tensor import DTensor

        _, sharded = self.sharded[id(param)]
        local = sharded.to_local()
        mine = rows[: local.shape[0] if local.ndim else 1].reshape(local.shape)
        if sharded.grad is None:
            sharded.grad = DTensor.from_local(
                mine.contiguous(), sharded.device_mesh, sharded.placements, run_check=False,
                shape=sharded.shape, stride=sharded.stride(),
            )
        else:
            sharded.grad.to_local().add_(mine)

    def scatter(self, param: torch.Tensor, grad: torch.Tensor, partial: bool) -> None:
        """Add ``grad`` (the unsharded gradient of the gathered ``param``) into the sharded parameter's
        ``.grad``: reduce-scattered (a sum over the ranks) when it is this rank's ``partial`` sum, else (a
        value every rank computed alike from merged sums) cut at this rank's rows. Every rank calls this for
        the same parameters in the same order."""
        if partial:
            self._scatter_bucket([(param, grad)])
            return
        rows = grad.shape[0] if grad.ndim else 1
        per_rank = math.ceil(rows / self.size)
        start = dist.get_rank(self.group) * per_rank
        self._add_shard(param, grad.reshape(rows, -1)[start: start + per_rank].clone())

    def release(self) -> None:
        """Reshard every unit (free the unsharded parameters), in reverse order; local, no collective."""
        if self._gathered:
            for _, unit in reversed(self.units):
                unit.reshard()
            self._gathered = False

    def memory(self, grads_of: Sequence[torch.Tensor]) -> FsdpMemory:
        """The categories of :class:`FsdpMemory` for a step whose gathered parameters with a gradient are
        ``grads_of`` (each storage once)."""
        shards: dict[int, int] = {}
        sharded_grads: dict[int, int] = {}
        unsharded: dict[int, int] = {}
        for _, p in self.sharded.values():
            st = p.to_local().untyped_storage()
            shards[st.data_ptr()] = st.nbytes()
            if p.grad is not None:
                gst = p.grad.to_local().untyped_storage()
                sharded_grads[gst.data_ptr()] = gst.nbytes()
        new_shards = ugrads = 0
        per_unit: dict[int, int] = {}  # a unit's per-rank share of its gradients (a bucket's output)
        for t in grads_of:
            if id(t) not in self.sharded:
                continue
            st = t.untyped_storage()
            unsharded[st.data_ptr()] = st.nbytes()
            rows = t.shape[0] if t.ndim else 1
            share = math.ceil(rows / self.size) * (t.numel() // max(rows, 1)) * t.element_size()
            ugrads += t.numel() * t.element_size()
            sharded = self.sharded[id(t)][1]
            unit = self.unit_of.get(id(sharded), -1)
            per_unit[unit] = per_unit.get(unit, 0) + share
            new_shards += share
        # The largest bucket: every rank's share of one unit's gradients. The outputs become the new .grad
        # shards (where there is none: else they are added in and freed).
        scatter = self.size * max(per_unit.values(), default=0)
        if dist.get_backend(self.group) == "gloo":
            # gloo's reduce-scatter copies its input (the profiler: c10d::_reduce_scatter_base_ > aten::clone),
            # freed when the collective ends: one bucket's copy at a time.
            scatter += self.size * max(per_unit.values(), default=0)
        if all(self.sharded[id(t)][1].grad is not None for t in grads_of if id(t) in self.sharded):
            new_shards, scatter = 0, scatter + max(per_unit.values(), default=0)
        return FsdpMemory(
            sharded_params=sum(shards.values()), sharded_grads=sum(sharded_grads.values()),
            unsharded_params=sum(unsharded.values()), unsharded_grads=ugrads, scatter_buffer=scatter,
            new_grad_shards=new_shards, gather_buffer=self.gather_buffer,
        )


@contextlib.contextmanager
def gathered(roots: Sequence[tuple[str, torch.nn.Module]], group: Any) -> Iterator[Units | None]:
    """While the block runs, every FSDP2 unit under ``roots`` holds its unsharded parameters (None: there is
    no unit); resharded after, also when the block fails."""
    units = find_units(roots)
    if not units:
        yield None
        return
    gathered_units = Units(units, group)
    try:
        gathered_units.gather()
        yield gathered_units
    finally:
        gathered_units.release()


@contextlib.contextmanager
def hooks_off(modules: Sequence[torch.nn.Module]) -> Iterator[None]:
    """FSDP2's forward pre- and post-hooks on ``modules`` set aside (they all-gather, reshard and register
    autograd hooks: the step is staged on the parameters :func:`gathered` already unsharded)."""
    saved: list[tuple[Any, dict]] = []
    for m in modules:
        state = m._get_fsdp_state()  # FSDPModule's accessor: the FSDPState whose bound methods are the hooks
        for store in (m._forward_pre_hooks, m._forward_hooks):
            if any(getattr(h, "__self__", None) is state for h in store.values()):
                saved.append((store, dict(store)))
                for key, h in list(store.items()):
                    if getattr(h, "__self__", None) is state:
                        del store[key]
    try:
        yield
    finally:
        for store, items in saved:  # every hook back, in its order (FSDP2's pre-hook first)
            store.clear()
            store.update(items)


def refuse_sharded(where: str, m: torch.nn.Module, process_group: Any) -> None:
    """Raise for a ``fully_shard``-ed module met while staging without its parameters gathered: under
    ``jit`` without ``process_group=``, or in a front end that does not gather them (one-line mode)."""
    _, dtensor = _fsdp_classes()
    if process_group is None:
        raise UnsupportedOpError(
            f"{where} is sharded by FSDP2 (fully_shard), whose collectives stagetorch places only in a step with a "
            "process group.\nWhat to do: pass process_group= to stagetorch.jit (the group fully_shard's mesh "
            "uses, e.g. dist.group.WORLD)."
        )
    if any(isinstance(p, dtensor) for p in m._parameters.values()):
        raise UnsupportedOpError(
            f"{where} is sharded by FSDP2 (fully_shard) and its parameters are not gathered: only "
            "stagetorch.jit(step, process_group=...) gathers them (one-line mode, lazy(..., process_group=), does "
            "not).\nWhat to do: stage the step with stagetorch.jit(process_group=)."
        )


# What guard_calls installed: the checks every FSDP2 unit's call runs first.
_CALL_CHECKS: list[Callable[[torch.nn.Module, tuple, dict], None]] = []


def guard_calls(check: Callable[[torch.nn.Module, tuple, dict], None]) -> bool:
    """Have every ``fully_shard``-ed module's call run ``check(module, args, kwargs)`` before its forward hooks
    (FSDP2's pre-hook all-gathers the unit's parameters): a ``__call__`` on FSDP2's ``FSDPModule``, which the
    class ``fully_shard`` makes of a module's puts first in its order, then the module's own call. Installed
    once per process (idempotent), only where FSDP2 is imported: the modules that are not units, and every
    module where it is not, keep nn.Module's call untouched (no global hook: those enter ``jit``'s cache key
    and slow every module's call). Returns whether it is installed."""
    classes = _fsdp_classes()
    if classes is None:
        return False
    unit = classes[0]
    if check not in _CALL_CHECKS:
        _CALL_CHECKS.append(check)
    if "__call__" not in unit.__dict__:

        def __call__(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            for c in _CALL_CHECKS:
                c(self, args, kwargs)
            return super(unit, self).__call__(*args, **kwargs)

        unit.__call__ = __call__
    return True


def refuse_lazy(unit: torch.nn.Module) -> None:
    """Raise for a ``fully_shard``-ed module called on lazy tensors (one-line mode), before its FSDP2 hooks run:
    they would gather, free and reduce-scatter its parameters behind the recorded step."""
    classes = _fsdp_classes()
    plain = next((c for c in type(unit).__mro__ if classes is None or not issubclass(c, classes[0])), type(unit))
    raise UnsupportedOpError(
        f"stagetorch.lazy: a lazy tensor reached a {plain.__name__} sharded by FSDP2 (fully_shard). The one-line "
        "mode does not gather FSDP2's shards nor reduce-scatter its gradients, and FSDP2's own hooks would free "
        "the gathered parameters the recorded step reads. Nothing ran: the parameters, their .grad and FSDP2's "
        "state are as they were.\nWhat to do: write the step as a function and stage it with "
        "stagetorch.jit(step, process_group=...) (the group fully_shard's mesh uses, e.g. dist.group.WORLD), "
        "which gathers the units, runs the chunks and reduce-scatters the gradients into the shards."
    )

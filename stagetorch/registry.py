"""The op registry: one entry per primitive, holding its shape, memory, batch, FLOP, kernel-call and layout rules.

An entry is keyed by an ATen overload packet (``aten.mm``) or, where overloads differ, by one overload
(``aten.sum.dim_IntList``); lookup tries the overload first. The library fills the registry from the
tables in the family modules beside this one, through the same :func:`register` that users call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import attrs
import torch

from .utils import caches

__all__ = ["Rule", "register", "rules", "lookup"]

Op = torch._ops.OpOverloadPacket | torch._ops.OpOverload


@attrs.define
class Rule:
    """The rules for one op. A slot left ``None`` means "use the default"."""

    op: Op
    shape: Callable[..., Any] | None = None
    memory: Callable[..., Any] | None = None
    batch: Callable[..., Any] | None = None
    flops: Callable[..., Any] | None = None
    calls: Callable[..., Any] | None = None
    layout: Callable[..., Any] | None = None
    workspace: Callable[..., Any] | None = None


_RULES: dict[Op, Rule] = {}

NO_TENSOR = "no tensor"
"""What a layout rule gives for an output the kernel leaves undefined (``None``) where its meta kernel
makes a tensor: the trace then holds no value there, and the memory interpreter counts no bytes."""


def _check_op(op: Any) -> Op:
    if not isinstance(op, (torch._ops.OpOverloadPacket, torch._ops.OpOverload)):
        raise TypeError(
            f"stagetorch.ops.register expects an ATen op such as torch.ops.aten.mm or a torch.library custom op "
            f"(torch.ops.mylib.myop), not {op!r}"
        )
    return op


def register(
    op: Op,
    *,
    shape: Callable[..., Any] | None = None,
    memory: Callable[..., Any] | None = None,
    batch: Callable[..., Any] | None = None,
    flops: Callable[..., Any] | None = None,
    calls: Callable[..., Any] | None = None,
    layout: Callable[..., Any] | None = None,
    workspace: Callable[..., Any] | None = None,
) -> Rule:
    """Teach stagetorch an op, or override what it knows.

    Only the slots given are changed, so a memory rule can be added to an op that already has a shape rule.

    **Arguments**

    - ``op``: an overload packet (``torch.ops.aten.mm``) or one overload (``torch.ops.aten.sum.dim_IntList``).
    - ``shape``: called with the op's arguments, :class:`~stagetorch.Aval` in place of tensors; returns an
      ``Aval`` or a tuple of them, or raises :class:`~stagetorch.ShapeError`.
    - ``memory``: called with the :class:`~stagetorch.Eqn`; returns the bytes of transient workspace the
      op needs while it runs, beyond its outputs.
    - ``batch``: called as ``batch(eqn, label)``; says how the op runs on a chunk of the batch (see
      :mod:`stagetorch.interpreters.batching`).
    - ``flops``: called with the :class:`~stagetorch.Eqn`; returns the floating-point operations it does
      (a multiply-add counts 2, as ``torch.utils.flop_counter`` counts). Default: one per output element.
    - ``calls``: called with the :class:`~stagetorch.Eqn`; returns how many kernels it runs, each of which
      costs the device's fixed price again in every extra chunk. Default: one. (A recurrent layer runs
      one per time step.)
    - ``layout``: called with the op's arguments as the tracer holds them (fake tensors: shapes, strides,
      dtype and device, no data); returns, for each tensor output in order, the strides the real kernel
      gives it, ``None`` where the meta kernel's strides are right, or ``stagetorch.registry.NO_TENSOR``
      where the kernel returns no tensor at all (a backward's masked-out gradient). Needed only where an op's meta
      kernel lays its output out otherwise than its kernel does: the tracer would record a ``view`` of it
      that fails at run time, or a copy eager PyTorch does not make.
    - ``workspace``: called with the :class:`~stagetorch.Eqn`; returns the bytes the kernel allocates inside
      itself beyond its outputs (column buffers, reordered copies, scratchpads), as the allocator sees them
      at the kernel's own peak. The memory interpreter holds them while the equation runs and frees them
      after it. Unlike a ``memory`` rule, a workspace rule keeps the planner's fast costing of chunk sizes
      (it is asked again at each size). Measure it with ``tests/support/memtrack.op_workspace``.

    Each slot is also a decorator: ``@stagetorch.ops.register.memory(torch.ops.mylib.op)``.

    **Returns** the op's :class:`Rule` after the change.
    """
    op = _check_op(op)
    _SLOTS.clear()
    rule = _RULES.setdefault(op, Rule(op))
    slots = (
        ("shape", shape), ("memory", memory), ("batch", batch), ("flops", flops), ("calls", calls), ("layout", layout),
        ("workspace", workspace),
    )
    for slot, fn in slots:
        if fn is not None:
            setattr(rule, slot, fn)
    return rule


def _slot_decorator(slot: str) -> Callable[[Op], Callable[[Callable], Callable]]:
    def decorator_for(op: Op) -> Callable[[Callable], Callable]:
        def decorate(fn: Callable) -> Callable:
            register(op, **{slot: fn})
            return fn

        return decorate

    decorator_for.__name__ = slot
    decorator_for.__doc__ = f"Decorator form of ``register(op, {slot}=fn)``."
    return decorator_for


register.shape = _slot_decorator("shape")  # type: ignore[attr-defined]
register.memory = _slot_decorator("memory")  # type: ignore[attr-defined]
register.batch = _slot_decorator("batch")  # type: ignore[attr-defined]
register.flops = _slot_decorator("flops")  # type: ignore[attr-defined]
register.calls = _slot_decorator("calls")  # type: ignore[attr-defined]
register.layout = _slot_decorator("layout")  # type: ignore[attr-defined]
register.workspace = _slot_decorator("workspace")  # type: ignore[attr-defined]


def rules() -> dict[Op, Rule]:
    """The explicit entries, by op: what the library and the user have registered."""
    return dict(_RULES)


def lookup(prim: Any) -> Rule | None:
    """The rule for an overload: its own entry, else its packet's, else ``None``."""
    rule = _RULES.get(prim)
    if rule is None and isinstance(prim, torch._ops.OpOverload):
        rule = _RULES.get(prim.overloadpacket)
    return rule


# slot()'s answers, by (prim, slot name): the interpreters ask for every equation's rules, many times over a
# plan. register() empties it.
_SLOTS: dict[tuple[Any, str], Callable[..., Any] | None] = {}
caches.on_clear(_SLOTS.clear)


def slot(prim: Any, name: str) -> Callable[..., Any] | None:
    """One slot of ``prim``'s rule, looking through overload then packet."""
    key = (prim, name)
    if key not in _SLOTS:
        _SLOTS[key] = _slot(prim, name)
    return _SLOTS[key]


def _slot(prim: Any, name: str) -> Callable[..., Any] | None:
    # A prim a pass makes from an op (stagetorch.transforms.rng's replay of a random op) answers for its own rules.
    own_rule = getattr(type(prim), "stagetorch_rule", None)
    if own_rule is not None and not isinstance(prim, torch._ops.OpOverload):
        return own_rule(prim, name)
    own = _RULES.get(prim)
    if own is not None and getattr(own, name) is not None:
        return getattr(own, name)
    # A packet's rule speaks for its functional overloads; out= variants write into a given tensor.
    if isinstance(prim, torch._ops.OpOverload) and not _is_out_variant(prim):
        packet = _RULES.get(prim.overloadpacket)
        if packet is not None:
            return getattr(packet, name)
    return None


@functools.cache  # by overload: the interpreters ask for every equation's slots, and a schema does not change
def _is_out_variant(prim: torch._ops.OpOverload) -> bool:
    return any(a.kwarg_only and a.alias_info is not None and a.alias_info.is_write for a in prim._schema.arguments)


caches.on_clear(_is_out_variant.cache_clear)

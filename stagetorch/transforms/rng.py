"""Random ops run again with the same draws: the two prims the remat pass inserts to recompute one.

A random op (dropout, ``bernoulli``, ``rand_like``) draws from its device's default generator. To recompute
it in the backward with the numbers it drew in the forward, the pass saves the generator's state just
before the op runs (:class:`SaveRngState`: on CPU ``torch.get_rng_state()``, 5 KiB; on CUDA the Philox
seed and offset, 16 bytes) and recomputes it under that state (:class:`ReplayRandom`: set the state, run
the op, put back the state it found), as ``torch.utils.checkpoint(preserve_rng_state=True)`` and torch's
``run_with_rng_state`` do. The replay leaves the generator where it was, so after the step the generator
is where the run without recomputation leaves it; the recomputed values are bit for bit the forward's.

Both are prims of ordinary equations: they answer for their own rules (:meth:`~ReplayRandom.stagetorch_rule`, which the registry
asks), the replay's being its op's, so the shape, memory, FLOP and batch interpreters treat a replay as
the op it runs. Neither has an effect (:func:`stagetorch.transforms.schedule.has_effect`): one reads the generator, the
other leaves it as it found it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import attrs
import torch

from ..ir import Aval, Eqn, Var, iter_vars, op_name
from ..registry import slot

__all__ = [
    "SaveRngState", "ReplayRandom", "LayoutOf", "replayable", "device_of", "save_generator", "generator_state",
    "set_generator_state", "METADATA_ONLY",
]

# Ops that read only the sizes, strides, dtype and device of their first argument (by packet): recomputed
# from a layout token of it (:class:`LayoutOf`), they need not have that argument recomputed too (CPU
# dropout's noise is ``empty_like`` of the activation it drops).
METADATA_ONLY = frozenset({
    torch.ops.aten.empty_like, torch.ops.aten.zeros_like, torch.ops.aten.ones_like, torch.ops.aten.full_like,
    torch.ops.aten.rand_like, torch.ops.aten.randn_like, torch.ops.aten.new_empty, torch.ops.aten.new_zeros,
    torch.ops.aten.new_ones, torch.ops.aten.new_full,
})

# The generators a state can be saved and set for, by device type.
_DEVICES = ("cpu", "cuda")


# CUDA's default generator's state as torch.cuda.get_rng_state() returns it: its seed and Philox offset, 8 bytes
# each: what a plan for a named GPU counts where this process has none to ask.
_CUDA_STATE_NBYTES = 16


@functools.cache
def _state_nbytes(kind: str) -> int:
    if kind == "cuda" and not torch.cuda.is_available():
        return _CUDA_STATE_NBYTES
    return (torch.cuda.get_rng_state() if kind == "cuda" else torch.get_rng_state()).numel()


def _get(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def device_of(e: Eqn) -> torch.device | None:
    """The device whose default generator ``e`` draws from: its first tensor argument's, else its
    ``device`` keyword's (a factory: ``rand``, ``randn``)."""
    for v in iter_vars((e.args, e.kwargs)):
        return v.aval.device
    device = e.kwargs.get("device")
    return torch.device(device) if device is not None else None


def replayable(e: Eqn) -> bool:
    """Whether ``e``, a random op, can be recomputed by :class:`ReplayRandom`: an ATen op that draws from
    the default generator of a CPU or CUDA device (no ``generator=`` of its own, whose state the step cannot
    save). One that draws into its argument (``bernoulli_``) writes again: the remat pass replays it only
    into a fresh copy of that argument."""
    if not isinstance(e.prim, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in e.prim.tags:
        return False
    schema = e.prim._schema
    named = dict(zip((a.name for a in schema.arguments), e.args)) | e.kwargs
    if named.get("generator") is not None:
        return False
    device = device_of(e)
    return device is not None and device.type in _DEVICES


class SaveRngState:
    """The prim of ``state = save(*reads)``: the state of ``device``'s default generator as the next
    equation finds it. It reads the random op's own arguments (and ignores them) so that it runs where the
    op runs: in the same chunk of a chunked step, right before it."""

    pure = True  # no effect: it reads the generator (see stagetorch.transforms.schedule.has_effect)

    def __init__(self, device: torch.device):
        self.device = device
        self.__name__ = "save_rng_state"

    @staticmethod
    @functools.cache
    def of(device: torch.device) -> SaveRngState:
        return SaveRngState(device)

    def aval(self) -> Aval:
        return Aval((_state_nbytes(self.device.type),), torch.uint8, torch.device("cpu"))

    def __call__(self, *reads: Any) -> torch.Tensor:
        # Handed out through a dispatched op (an alias of the same storage), so that a TorchDispatchMode (a
        # user's, or tests/support/memtrack.py's live-tensor tracker) sees the tensor the step holds.
        return torch.ops.aten.alias.default(_get(self.device))

    def __repr__(self) -> str:
        return f"save_rng_state({self.device})"

    def stagetorch_rule(self, name: str) -> Callable[..., Any] | None:
        if name == "shape":
            return lambda *args, **kwargs: self.aval()
        if name == "batch":
            return _same_in_every_chunk
        if name == "flops":
            return _no_flops
        return None


def _same_in_every_chunk(e: Eqn, label: Any) -> Any:
    # Its value is not the same in every chunk (each chunk draws on from where the last left the
    # generator), but it is read only by replays in the same chunk: it never leaves the chunk's body.
    from ..interpreters.batching import Chunked

    return Chunked(out=(None,))


def _no_flops(e: Eqn) -> int:
    return 0


class SetRngState:
    """The prim of ``set_rng_state(state, *reads)``: set ``device``'s default generator to ``state`` (what
    it was when the next equation, a random op, was called). It reads that op's arguments (and ignores
    them) so that it runs where the op runs, right before it. It has an effect (the generator): never
    removed, reordered or recomputed; a recomputation of the op replays the state it finds after it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.__name__ = "set_rng_state"

    @staticmethod
    @functools.cache
    def of(device: torch.device) -> SetRngState:
        return SetRngState(device)

    def __call__(self, state: torch.Tensor, *reads: Any) -> None:
        _set(self.device, state)

    def __repr__(self) -> str:
        return f"set_rng_state({self.device})"

    def stagetorch_rule(self, name: str) -> Callable[..., Any] | None:
        if name == "shape":
            return lambda *args, **kwargs: ()
        if name == "batch":
            return _in_its_chunk
        if name == "flops":
            return _no_flops
        return None


def _in_its_chunk(e: Eqn, label: Any) -> Any:
    from ..interpreters.batching import Chunked

    return Chunked(out=())


class ReplayRandom:
    """The prim of ``outs = replay(state, *args, **kwargs)``: ``op(*args, **kwargs)`` run with the
    generator of ``device`` set to ``state``, the generator's own state put back after."""

    pure = True  # no effect: the generator is left as it was found

    def __init__(self, op: torch._ops.OpOverload, device: torch.device):
        self.op, self.device = op, device
        self.__name__ = f"replay({op_name(op)})"

    @staticmethod
    @functools.cache
    def of(op: torch._ops.OpOverload, device: torch.device) -> ReplayRandom:
        return ReplayRandom(op, device)

    def __call__(self, state: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        found = _get(self.device)
        _set(self.device, state)
        try:
            return self.op(*args, **kwargs)
        finally:
            _set(self.device, found)

    def __repr__(self) -> str:
        return self.__name__

    def stagetorch_rule(self, name: str) -> Callable[..., Any] | None:
        """The op's own rule, for the equation without the state argument."""
        if name == "layout":
            return None
        if name == "shape":
            from ..interpreters.shapes import abstract_eval

            return lambda state, *args, **kwargs: tuple(abstract_eval(self.op, args, kwargs))
        inner = slot(self.op, name)
        if inner is None:
            return None
        if name == "batch":
            return functools.partial(_replayed_batch, self, inner)
        return lambda e: inner(_without_state(e))


def _without_state(e: Eqn) -> Eqn:
    assert isinstance(e.prim, ReplayRandom)
    return Eqn(e.prim.op, e.args[1:], e.kwargs, e.outvars, e.source)


def _replayed_batch(replay: ReplayRandom, inner: Callable, e: Eqn, label: Any) -> Any:
    """The op's batch rule, the call it gives for a chunk run under the saved state."""
    state: Var = e.args[0]
    decision = inner(_without_state(e), label)
    if decision.call is None:
        return decision

    def call(n: int) -> tuple[Any, tuple, dict]:
        prim, args, kwargs = decision.call(n)
        return ReplayRandom.of(prim, replay.device), (state, *args), kwargs

    return attrs.evolve(decision, call=call)


class LayoutOf:
    """The prim of ``token = layout_of(x)``: a tensor on the meta device with ``x``'s sizes, strides and
    dtype, and no data (no bytes: its var says ``storage_nbytes=0``). A metadata-only op (``empty_like``)
    recomputed from it, with ``device=`` ``x``'s device, makes what it made from ``x``."""

    pure = True
    __name__ = "layout_of"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")

    def __repr__(self) -> str:
        return "layout_of"

    @staticmethod
    def var(x: Var) -> Var:
        """The var of a token of ``x``."""
        return Var(Aval(x.aval.shape, x.aval.dtype, torch.device("meta")), storage_nbytes=0)

    def stagetorch_rule(self, name: str) -> Callable[..., Any] | None:
        if name == "shape":
            return lambda x: Aval(x.shape, x.dtype, torch.device("meta"))
        if name == "batch":
            from ..interpreters.batching import elementwise

            return elementwise
        if name == "flops":
            return _no_flops
        return None


LAYOUT_OF = LayoutOf()


def save_generator(device: torch.device) -> Callable[[], None]:
    """Save the state of ``device``'s default generator; return what sets it back. A step's host reads
    (:mod:`stagetorch.staging.host_reads`) draw before its staged program, which then draws the same numbers again."""
    state = _get(device)
    return functools.partial(_set, device, state)


def generator_state(device: torch.device) -> torch.Tensor:
    """The state of ``device``'s default generator now (a copy: drawing on does not change it)."""
    return _get(device)


def set_generator_state(device: torch.device, state: torch.Tensor) -> None:
    """Set ``device``'s default generator to ``state`` (one :func:`generator_state` gave)."""
    _set(device, state)

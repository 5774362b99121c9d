"""Host reads: the values a step reads on the host (``.item()``, ``if mask.any():``, ``nonzero``, ``x[mask]``,
``torch.unique``) that depend only on its arguments and constants that need no gradient (of any dtype) and on
the default generators.

Such a value is the same whatever the parameters are, so it can be computed for real when the step is
called, before its staged program runs: the tracer notes, as it stages, which values are *host-known*
(:class:`HostTrace`), computes one for real only where the function reads it, and the trace ends with the
:class:`HostProgram` that computes every read again for a later call's arguments. A call runs that small
program first and reuses a staged program only where every read comes out as it did when that program was
staged (:class:`stagetorch.staging.guards.Outcomes` keeps a few programs per outcome).

Draws keep eager's order: a read of a random number (LayerDrop's ``torch.rand([]) < p``) is preceded, in
the host program, by every draw the step made before it (dropout's masks, drawn on stand-ins of their
shape: how many numbers a draw takes depends on its shape, not on its values), and the generators are set
back after it, so that the staged program draws the same numbers again, in the same order, as eager would.

A value that a data-dependent shape makes (the indices ``nonzero`` finds, the classes ``unique`` finds) is
not computed again by the staged program: the host program's value is fed to it as an input, the whole
batch's, as eager has it (see :attr:`HostProgram.fed`).

What it must not know: how a program is cached or run (``staged`` and ``guards`` do that).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..ir import Eqn, SourceInfo, Var
from ..transforms import rng
from ..transforms.schedule import draws_random
from ..utils.tree import flatten, map_leaves

__all__ = ["HostRead", "HostTrace", "HostProgram", "is_seed", "mask_positions"]


def is_seed(t: torch.Tensor) -> bool:
    """Whether an argument is host-known: a tensor that needs no gradient, whatever its dtype (token ids,
    labels, lengths, attention masks of ints, bools or floats, the inputs themselves): the call has its value
    before the program runs, and the parameters do not change it."""
    return not t.requires_grad


@attrs.define(eq=False)
class HostRead:
    """A value the step read on the host, and what it was when the program was staged.

    ``kind`` ``"value"``: the Python value ``eqn`` returns run on real values (``.item()``, ``bool(t)``);
    ``"shape"``: the shapes of ``vars`` (what a data-dependent shape made: ``nonzero``'s rows)."""

    kind: str
    outcome: Any
    source: SourceInfo
    eqn: Eqn | None = None
    vars: tuple[Var, ...] = ()

    @property
    def reads(self) -> list[Var]:
        return self.eqn.invars if self.eqn is not None else list(self.vars)

    def evaluate(self, values: dict[Var, torch.Tensor]) -> Any:
        if self.kind == "shape":
            return tuple(tuple(values[v].shape) for v in self.vars)
        return _call(self.eqn, values)


Step = Eqn | HostRead


def _written(e: Eqn) -> list[Var]:
    """The vars ``e`` writes in place (its schema's mutable arguments)."""
    out = []
    for i, name in _writes(e.prim):
        x = e.args[i] if i < len(e.args) else e.kwargs.get(name)
        out += [v for v in flatten(x) if isinstance(v, Var)]
    return out


def _writes(prim: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument ``prim`` writes, by its schema; remembered per op (asked per equation)."""
    found = _WRITES.get(prim)
    if found is None:
        schema = getattr(prim, "_schema", None)
        arguments = schema.arguments if schema is not None else ()
        found = _WRITES[prim] = tuple(
            (i, a.name) for i, a in enumerate(arguments) if a.alias_info is not None and a.alias_info.is_write
        )
    return found


_WRITES: dict[Any, tuple[tuple[int, str], ...]] = {}
_DRAWS: dict[Any, bool] = {}


def mask_positions(*masks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The integer positions that boolean masks select (``x[mask]`` is ``x[mask_positions(mask)]``), one
    tensor per dim each mask spans."""
    return tuple(c.clone() for m in masks for c in m.nonzero().unbind(1))


def _is_draw(e: Eqn) -> bool:
    draw = _DRAWS.get(e.prim)
    if draw is None:
        draw = _DRAWS[e.prim] = isinstance(e.prim, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in e.prim.tags
    return draw and draws_random(e)  # (not an attention kernel whose dropout_p is 0: its arguments say)


def _stand_in(v: Var) -> torch.Tensor:
    """A tensor laid out as ``v`` (values unset): what a draw reads of an argument that is not host-known."""
    a = v.aval
    if v.strides is not None:
        return torch.empty_strided(a.shape, v.strides, dtype=a.dtype, device=a.device)
    return torch.empty(a.shape, dtype=a.dtype, device=a.device)


def _call(e: Eqn, values: dict[Var, torch.Tensor]) -> Any:
    def real(v: Var) -> torch.Tensor:
        found = values.get(v)
        return found if found is not None else _stand_in(v)

    # Real tensors, run as eager runs them: not staged, not faked, no autograd (none of them needs a gradient).
    with _disable_current_modes(), torch.no_grad():
        return e.prim(*map_leaves(e.args, Var, real), **map_leaves(e.kwargs, Var, real))


def _run(e: Eqn, values: dict[Var, torch.Tensor], known: bool) -> None:
    out = _call(e, values)
    if known:
        for v, t in zip(e.outvars, flatten(out)):
            if v is not None:
                values[v] = t


def _slice(steps: Sequence[Step], needed: Iterable[Var], end: int, known: set[int]) -> list[int]:
    """The positions, in order, of the steps before ``end`` that the values of ``needed`` follow from (their
    makers, and the in-place writes into their storage), and of every draw before ``end`` (the generators
    must reach each draw as eager reaches it)."""
    roots = {v.root for v in needed}
    out = []
    for i in range(end - 1, -1, -1):
        s = steps[i]
        if isinstance(s, HostRead):
            continue
        makes = any(v is not None and v.root in roots for v in s.outvars) or any(v.root in roots for v in _written(s))
        if makes and i in known:
            roots.update(v.root for v in s.invars)
            out.append(i)
        elif _is_draw(s):
            out.append(i)
    return out[::-1]


class HostTrace:
    """What one trace knows about host-known values: which vars are (``known``), the steps that make them and
    the draws among them, in trace order, the reads, and the real values computed so far (only where a read
    needed them)."""

    def __init__(self) -> None:
        self.known: set[Var] = set()
        self.tainted: set[Var] = set()  # roots written from values that are not host-known
        self.steps: list[Step] = []
        self.known_steps: set[int] = set()  # positions of the steps whose outputs are host-known
        self.values: dict[Var, torch.Tensor] = {}
        self.ran: set[int] = set()
        self.args: dict[Var, int] = {}  # an argument -> its position among the call's tensor arguments
        self.consts: dict[Var, torch.Tensor] = {}
        self.fed: list[Var] = []  # host values the staged program reads as inputs (see HostProgram.fed)
        self._restore: list[Callable[[], None]] = []
        self._saved: set[torch.device] = set()

    def seed_arg(self, v: Var, position: int, real: torch.Tensor) -> None:
        if is_seed(real):
            self.known.add(v)
            self.args[v] = position
            self.values[v] = real

    def seed_const(self, v: Var, real: torch.Tensor) -> None:
        if not real.requires_grad:
            self.known.add(v)
            self.consts[v] = real
            self.values[v] = real

    def is_known(self, vs: Iterable[Var]) -> bool:
        return all(v in self.known and v.root not in self.tainted for v in vs)

    def note(self, e: Eqn) -> None:
        """A recorded equation: its outputs are host-known when all its inputs are (a factory's always), and a
        draw from a default generator is a step either way (for the order of the draws)."""
        draw = _is_draw(e)
        # A draw from its own generator= is not host-known: the step cannot save or set that one's state.
        known = self.is_known(e.invars) and not (draw and not rng.replayable(e))
        if known:
            self.known.update(v for v in e.outvars if v is not None)
            self.known_steps.add(len(self.steps))
            self.steps.append(e)
            return
        if _writes(e.prim):
            self.tainted.update(v.root for v in _written(e))
        if draw and rng.replayable(e):
            self.steps.append(e)

    def read(self, e: Eqn, value: Any, src: SourceInfo) -> None:
        """``e`` (``_local_scalar_dense`` of a host-known value) gave the Python ``value`` (see :meth:`call`): a
        read the program is chosen by."""
        self.steps.append(HostRead("value", value, src, eqn=e))

    def call(self, e: Eqn) -> Any:
        """``e`` run on the real values of its host-known inputs (computed first, with the draws before)."""
        self.evaluate(e.invars)
        return _call(e, self.values)

    def shaped(self, e: Eqn, real: Any, src: SourceInfo) -> None:
        """``e`` (a data-dependent shape over host-known inputs: ``nonzero``, ``unique``), which gave ``real``
        (see :meth:`call`): a step whose outputs' shapes are a read and whose outputs the staged program reads
        as inputs (``e.outvars`` are the constants the recorder lifted them to)."""
        position = len(self.steps)
        self.known_steps.add(position)
        self.ran.add(position)
        self.steps.append(e)
        outs = tuple(v for v in e.outvars if v is not None)
        for v, t in zip(e.outvars, flatten(real)):
            if v is not None:
                self.values[v] = t
                self.known.add(v)
                self.consts.pop(v, None)  # lifted as a constant, but the call's own value is the host program's
        self.fed += outs
        self.steps.append(HostRead("shape", tuple(tuple(self.values[v].shape) for v in outs), src, vars=outs))

    def evaluate(self, needed: list[Var]) -> None:
        """Compute the real values of host-known ``needed`` (and every draw before this point, in order)."""
        self._run_steps([i for i in _slice(self.steps, needed, len(self.steps), self.known_steps) if i not in self.ran])

    def _run_steps(self, positions: list[int]) -> None:
        for i in positions:
            e = self.steps[i]
            if _is_draw(e):
                device = rng.device_of(e)
                if device not in self._saved:
                    self._saved.add(device)
                    self._restore.append(rng.save_generator(device))
            _run(e, self.values, i in self.known_steps)
            self.ran.add(i)

    def finish(self) -> None:
        """Set the generators back to where the trace found them (the call draws again, host program first)."""
        for restore in self._restore:
            restore()
        self._restore.clear()

    def program(self) -> HostProgram | None:
        """What a later call runs to compute every read again; None when the trace read nothing."""
        reads = [i for i, s in enumerate(self.steps) if isinstance(s, HostRead)]
        if not reads:
            return None
        keep: set[int] = set(reads)
        for r in reads:
            keep.update(_slice(self.steps, self.steps[r].reads, r, self.known_steps))
        steps = [(self.steps[i], i in self.known_steps) for i in sorted(keep)]
        return HostProgram(steps, dict(self.args), dict(self.consts), list(self.fed))


@attrs.define(eq=False)
class HostProgram:
    """The host reads of one staged program, and what computes them for a call: ``steps`` (each with
    whether its outputs are kept), the arguments it reads (by position among the call's tensor arguments)
    and the constants. ``fed``: the values the staged program reads as inputs (each a constant of its
    trace, which a call replaces with its own)."""

    steps: list[tuple[Step, bool]]
    args: dict[Var, int]
    consts: dict[Var, torch.Tensor]
    fed: list[Var]

    @property
    def reads(self) -> list[HostRead]:
        return [s for s, _ in self.steps if isinstance(s, HostRead)]

    def agrees(self, seen: Sequence[Any]) -> bool:
        """Whether this program's reads came out as ``seen``, the outcomes another program's run found for a
        call, as far as that run went: else this program is not the call's, and need not run."""
        reads = self.reads
        return len(reads) >= len(seen) and all(r.outcome == o for r, o in zip(reads, seen))

    def run(self, args: Sequence[torch.Tensor]) -> tuple[dict[Var, torch.Tensor] | None, list[Any]]:
        """Compute the reads for a call with tensor arguments ``args``. **Returns** the fed values where every
        read comes out as when the program was staged, else None (at the first that does not); and the
        outcomes found, that one included. The default generators are left as they were found."""
        values: dict[Var, torch.Tensor] = dict(self.consts)
        for v, i in self.args.items():
            values[v] = args[i]
        restore: dict[torch.device, Callable[[], None]] = {}
        seen: list[Any] = []
        try:
            for step, known in self.steps:
                if isinstance(step, HostRead):
                    seen.append(step.evaluate(values))
                    if seen[-1] != step.outcome:
                        return None, seen
                    continue
                if _is_draw(step):
                    device = rng.device_of(step)
                    if device not in restore:
                        restore[device] = rng.save_generator(device)
                _run(step, values, known)
        finally:
            for put_back in restore.values():
                put_back()
        return {v: values[v] for v in self.fed}, seen

    def describe(self) -> str:
        """The reads and their outcomes, for a log line."""
        shown = [f"{r.source}: {r.outcome!r}" for r in self.reads[:4]]
        more = len(self.reads) - len(shown)
        return "; ".join(shown) + (f" (and {more} more)" if more > 0 else "")

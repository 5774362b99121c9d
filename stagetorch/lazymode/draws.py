"""Draws in eager's order: a random op a lazy step records (dropout's ``bernoulli_``) takes its numbers from the
generator when it is called, as eager's does, not when the flush runs it.

Eager draws in program order. A step that also draws outside the lazy tensors (LayerDrop's
``torch.rand([]) < p``, a real tensor's dropout) between two recorded draws would otherwise take the numbers
eager gives to the recorded one, skip other layers than eager skips, and leave the generator elsewhere. So
each recorded draw saves the generator's state and draws once on stand-ins of its arguments' layout (how many
numbers a draw takes depends on its shape, not its values: the same rule as ``jit``'s host reads,
:mod:`stagetorch.staging.host_reads`), leaving the generator where eager leaves it; the flush draws again from each saved
state (:class:`stagetorch.transforms.rng.SetRngState` before each draw), then sets the generator back.

That second draw costs a draw per random op, so a recording pays it only where it is needed: a session that
records always does, and notes whether a draw outside the lazy tensors came between one of its draws and the
flush that ran it (``_Recording.interleaved``); a session replaying a recording without one draws at the
flush only, as before, and checks the generator did not move meanwhile.

What it must not know: how a session records, replays or flushes (``recording`` and ``session`` call it).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..ir import Eqn, Var
from ..transforms.rng import replayable
from ..transforms.schedule import draws_random
from ..utils.tree import map_leaves

__all__ = ["draws_from_default", "draw_on_stand_ins", "COUNTED_BY_VALUES"]

_aten = torch.ops.aten

# Draws whose count of numbers depends on their arguments' values (rejection sampling): one-line mode runs
# them for real on evaluated inputs, as it runs a data-dependent shape, since a stand-in would draw another count.
COUNTED_BY_VALUES = frozenset({_aten.poisson, _aten.binomial, _aten._standard_gamma, _aten._sample_dirichlet})


def draws_from_default(e: Eqn) -> bool:
    """Whether ``e`` draws from a CPU or CUDA device's default generator (not from a ``generator=`` of its
    own, whose state a step cannot save). An attention kernel whose ``dropout_p`` is 0 takes no number: drawing
    it again on stand-ins would only cost its whole batch's memory at the call (:func:`draws_random`)."""
    return replayable(e) and draws_random(e)


def _stand_in(v: Var, known: Mapping[Var, torch.Tensor]) -> torch.Tensor:
    """The value of ``v`` where it is known, else a tensor laid out as ``v`` holding 0.5 (1 for an integer
    dtype): a probability, rate or scale every random op accepts."""
    found = known.get(v)
    if found is not None:
        return found
    a = v.aval
    fill = 0.5 if a.dtype.is_floating_point or a.dtype.is_complex else 1
    if v.strides is not None:
        return torch.empty_strided(a.shape, v.strides, dtype=a.dtype, device=a.device).fill_(fill)
    return torch.full(a.shape, fill, dtype=a.dtype, device=a.device)


def draw_on_stand_ins(e: Eqn, values: Mapping[Var, torch.Tensor], consts: Mapping[Var, torch.Tensor]) -> None:
    """Run the random op ``e`` once on real tensors (its arguments' values where the session has them,
    stand-ins elsewhere), for the numbers it takes from the generator; its result is dropped."""

    written = set(_written(e))  # (drawn into a stand-in: a value the session holds is not written)

    def real(v: Var) -> torch.Tensor:
        found = None if v in written else values.get(v)
        return found if found is not None else _stand_in(v, {} if v in written else consts)

    with _disable_current_modes(), torch.no_grad():
        e.prim(*map_leaves(e.args, Var, real), **map_leaves(e.kwargs, Var, real))


def _written(e: Eqn) -> list[Var]:
    """The vars ``e`` writes in place (``bernoulli_``'s ``self``), by its schema."""
    out = []
    for i, a in enumerate(e.prim._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            x = e.args[i] if i < len(e.args) else e.kwargs.get(a.name)
            if isinstance(x, Var):
                out.append(x)
    return out

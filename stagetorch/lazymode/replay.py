"""The slow replay: below autograd, each ATen call is checked against the recorded step at the cursor and
reuses it (no fake kernel runs); the first call that differs records the replayed steps again on fakes
(:meth:`SlowReplay._diverge`) and the session goes on recording. :meth:`SlowReplay.call` is where every
ATen call on lazy tensors arrives.
"""

from __future__ import annotations

import weakref
from typing import Any

import attrs
import torch

from ..ir import Var
from ..staging.host_reads import mask_positions
from ..utils.tree import flat_call, flatten, map_leaves
from .autograd_graph import Unreadable
from .mode import Mode
from .recording import BACKWARD, Out, RecordingSteps, Step, replay_key
from .tensor import LazyTensor, lazy_tensor, real_value

_aten = torch.ops.aten

# Selections whose result's shape follows from a boolean index's values (``x[mask]``).
_MASK_SELECT = frozenset({_aten.index.Tensor, _aten._unsafe_index.Tensor})


def _is_mask(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


class SlowReplay(RecordingSteps):
    """The slow replay: each ATen call matched against the recorded step at the cursor."""

    def call(self, func: Any, args: tuple, kwargs: dict, leaves: list) -> Any:
        """An op on lazy tensors: replay it, record it, or (for a value read) run it for real."""
        if self.reading_saved:
            # Autograd unpacking a saved lazy output detaches it: an alias of the same value, not a step.
            if func is not _aten.detach.default:
                raise Unreadable
            t = args[0]
            return lazy_tensor(t.shape, t.stride(), t.dtype, t.device, t._var, self, t._fake)
        if func.namespace == "prim":
            return func(*map_leaves(args, torch.Tensor, real_value), **map_leaves(kwargs, torch.Tensor, real_value))
        if func in _MASK_SELECT and self.shard is None and len(args) > 1 and any(_is_mask(t) for t in args[1]):
            args = self._positions_of_masks(args)
            leaves = flat_call(args, kwargs)
            if not any(type(t) is LazyTensor for t in leaves):  # a real tensor selected by a lazy mask
                return func(*args, **kwargs)
        if self.mode is not Mode.RECORD:
            step = self._match(func, leaves)
            if step is not None:
                return self._replay(step, args, kwargs)
            self._diverge()
        return self._record_or_run(func, args, kwargs, leaves)

    def _positions_of_masks(self, args: tuple) -> tuple:
        """``x[mask]`` as ``x[positions]`` (issue 43), as ``jit``'s tracer stages a mask it knows: only the masks'
        values size the result, so only they are computed (a peek where they follow from a small part of
        the pending work: ``m > 0.5``, ``y != pad``), and the selection is recorded, not run. Run for real, it
        would need ``x`` too: the whole forward, flushed mid-step with every value autograd saved held for
        the whole batch, left the backward's flush (a program of its own, cut where the examples meet at the
        selection's backward) too little room for one example at ``jit``'s budget."""
        indices = []
        for t in args[1]:
            if _is_mask(t):
                indices.extend(mask_positions(real_value(t)))
            else:
                indices.append(t)
        return (args[0], indices, *args[2:])

    def _match(self, func: Any, leaves: list) -> Step | None:
        steps = self.recording.steps
        if self.cursor >= len(steps):
            return None
        step = steps[self.cursor]
        if step.func is not func:
            return None
        key = replay_key(leaves)
        if key != step.key or tuple(map(type, key)) != step.types:
            return None
        for i, var in step.consts:
            if var is None:  # an argument of a call that ran for real: its metadata is all that matters
                continue
            bound = self.consts.get(var)
            if bound is None:
                self.consts[var] = leaves[i]
                self.versions[var] = leaves[i]._version
            elif bound is not leaves[i]:
                return None
            elif var not in self.versions:  # bound before the last flush: bound again, as it is now
                self.versions[var] = leaves[i]._version
        return step

    def _replay(self, step: Step, args: tuple, kwargs: dict) -> Any:
        self.cursor += 1
        if not step.recorded:
            return self._run_real(step.func, args, kwargs, [])
        self.end += 1
        self.draws_due()
        if step.inplace and type(args[0]) is not LazyTensor and isinstance(args[0], torch.Tensor):
            self.consts[step.out.var] = args[0]
            for _, v in step.consts:  # autograd bumps the written tensor's version now, for this write
                if v is not None and self.consts.get(v) is args[0]:
                    self.versions.pop(v, None)
        if step.inplace and type(args[0]) is LazyTensor:
            target = args[0]
            target._var = step.out.var
            self.alive[target._var] = weakref.ref(target)
            return target
        if step.single:
            return self._wrap_out(step.out)
        return map_leaves(step.out, Out, self._wrap_out)

    def _wrap_out(self, o: Out) -> LazyTensor:
        out = lazy_tensor(o.shape, o.stride, o.dtype, o.device, o.var, self)
        self.alive[o.var] = weakref.ref(out)
        return out

    def _diverge(self) -> None:
        """The call differs from the recording being replayed: record the replayed steps again on fake
        tensors, remap every live value to the new variables, and go on recording."""
        old = self.recording
        replayed = old.steps[: self.cursor]
        self.mode = Mode.RECORD
        self.recording = self._start_recording()
        # The same step recorded again: how many sessions in a row left its express replay carries over. A
        # session that left it ran the calls made so far again through autograd, after the autograd nodes
        # that real tensors' ops made meanwhile (an expert weight's transpose), so the engine may order the
        # backward otherwise than in a session that never was express: each such recording diverges at the
        # next session's backward, and that one's at the next express session's. Counted, the express
        # replay is turned off after MAX_LEAVES, and the steps replay (unpadded one-line Mixtral with its
        # router loss recorded every step: ~20x its jit step).
        self.recording.left, self.recording.express = old.left, old.express
        self.recording.interleaved = old.interleaved
        self.tape = None  # its steps are not this session's calls one for one: the next session tapes it
        rec = self.recorder
        new_of: dict[Var, Var] = {}
        fake_of: dict[Var, torch.Tensor] = {}
        for i, var in enumerate(old.inputs):
            new_of[var], fake_of[var] = self._add_input(i, self.values[var])
        consts, versions = self.consts, self.versions
        self.consts, self.versions = {}, {}
        eqns = iter(old.eqns)
        for step in replayed:
            if step.func is BACKWARD:  # a skipped backward's marker; its steps follow it
                continue
            if step.recorded:
                eqn = next(eqns)
                args = map_leaves(eqn.args, Var, lambda v: fake_of[v] if v in fake_of else consts[v])
                kwargs = map_leaves(eqn.kwargs, Var, lambda v: fake_of[v] if v in fake_of else consts[v])
                out = self._record_call(step.func, args, kwargs, src=eqn.source)
                for v, f in zip(eqn.outvars, flatten(out)):
                    if v is not None:
                        new_of[v], fake_of[v] = rec.var(f), f
                if step.inplace and eqn.args and type(eqn.args[0]) is Var and eqn.args[0] in consts:
                    self.consts[new_of[eqn.outvars[0]]] = consts[eqn.args[0]]
            # (a constant no re-recorded call lifted, read only by a call that ran for real: None, as
            # _consts_in marks it; issue 43: CTC's lengths after an out-of-memory error raised KeyError here)
            step_consts = [(i, v if v is None else rec.const_vars.get(id(consts[v]))) for i, v in step.consts]
            key = tuple(new_of[x] if type(x) is Var else x for x in step.key)
            out_spec = map_leaves(step.out, Out, lambda o: attrs.evolve(o, var=new_of[o.var]))
            self.recording.steps.append(Step(step.func, key, step_consts, out_spec, step.recorded, step.inplace))
        for var, ref in self.alive.items():
            t = ref()
            if t is not None:
                t._var, t._fake = new_of[var], fake_of[var]
        self.alive = {new_of[v]: ref for v, ref in self.alive.items() if ref() is not None}
        self.values = {new_of[v]: x for v, x in self.values.items()}
        self.batched = {new_of[v]: b for v, b in self.batched.items()}
        # The batch labels of what this session's flushes made, which later flushes read as batched.
        self.made = {new_of[v]: b for v, b in self.made.items() if v in new_of}
        # The version each constant had when a call that has not run bound it (not now: a change in place
        # since then must still raise ModifiedInputError), and the losses whose backward ran.
        self.versions = {rec.const_vars[id(consts[v])]: seen for v, seen in versions.items() if id(consts[v]) in rec.const_vars}
        self.freed = frozenset(new_of[v] for v in self.freed if v in new_of)
        if self.shard is not None:
            self.shard.labels = {new_of[v]: b for v, b in self.shard.labels.items() if v in new_of}
        self.eqns = rec.eqns

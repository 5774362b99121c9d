"""One-line mode: ``stagetorch.lazy(input, label, batch=0)`` and the rest of the script unchanged.

A :class:`LazyTensor` is a real ``torch.Tensor`` subclass. Operations on it are recorded into the same IR
the tracer builds (by the tracer's own recorder, on fake tensors), including the backward ops autograd
emits for ``loss.backward()``. Reading a value (``print``, ``item``, ``if``...) and ``backward()`` flush
the recorded equations that have not run yet through the same :class:`~stagetorch.api.Executable` that
``jit`` uses: planned against the memory budget, chunked when the batch does not fit, exact.

Every value that is still referenced when a flush runs (by you, or by autograd for the backward) is kept,
so nothing runs twice: BatchNorm statistics are updated once and dropout masks are drawn once.

A training loop makes the same calls every step, and replays at two levels. Above autograd, each session
tapes its torch-level calls (:class:`_Call`); a session whose inputs match an earlier one's replays that tape
*express*: each call is matched by generated code and not run at all (no autograd graph, no dispatch), and
``loss.backward()`` runs the recorded backward. The first call off the tape gives the tensors made so far
their autograd graph (shadows) and continues with the *slow* replay below autograd: each ATen call checked
against the recorded step, reusing its executables, the backward skipping the autograd engine where it can.
The first ATen call that differs makes the session record (see :class:`_Session`).
"""

from __future__ import annotations

import itertools
import linecache
import sys
import weakref
from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ._tree import flat_call, flatten, map_leaves, unflat_call
from .api import Executable
from .batching import Batched
from .devices import free_memory
from .errors import ConcretizationError
from .execute import accumulate_grad
from .ir import Eqn, Graph, Var
from .tracing import _Recorder, user_frame

__all__ = ["lazy", "LazyTensor"]

_aten = torch.ops.aten


@attrs.define(eq=False)
class _Out:
    """A lazy result of a recorded call: its variable and the metadata its LazyTensor is made with."""

    var: Var
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device


@attrs.define(eq=False)
class _Step:
    """One call that reached lazy tensors: the op, its flattened arguments and its result. ``recorded`` steps
    became an equation; the others (``item``, data-dependent shapes) ran for real on evaluated inputs.
    ``key`` is :func:`_key` of the call when it was recorded."""

    func: Any
    key: tuple
    consts: list  # (position in the key, the graph input the real tensor there became; None if not recorded)
    out: Any
    recorded: bool
    inplace: bool
    types: tuple = attrs.field(init=False)
    single: bool = attrs.field(init=False)  # the result is one lazy tensor

    def __attrs_post_init__(self) -> None:
        self.types = tuple(map(type, self.key))
        self.single = type(self.out) is _Out


@attrs.define(eq=False)
class _Recording:
    """What a session recorded, for the next session with the same inputs to replay instead of re-tracing:
    the steps, the equations, and the executables its flushes built."""

    inputs: list[Var]
    eqns: list[Eqn]
    steps: list[_Step] = attrs.field(factory=list)
    # (first, end) -> (the values those equations produce, their inputs from outside);
    # (first, end, outputs) -> the Executable of that flush.
    flushes: dict[tuple, Any] = attrs.field(factory=dict)
    # The torch-level calls that made ``steps``, for the express replay (see _Call); None until a session
    # taped them.
    tape: list[_Call] | None = None
    # False once a call ran inside a Python autograd.Function's forward: apply() builds its graph from the
    # lazy tensors it takes, below any torch function, so they must have theirs (no express replay).
    express: bool = True
    # Sessions in a row that left the express replay (their calls were replayed twice, express then slow);
    # at _MAX_LEAVES the express replay is turned off for this recording. A backward replayed express resets it.
    left: int = 0


_MAX_LEAVES = 2


@attrs.define(eq=False, frozen=True)
class _Real:
    """A real tensor argument in a taped call: the ``slot``-th real tensor the session's calls took. A new
    one is compared by metadata (and bound to the slot), a ``same`` one by identity with the slot."""

    meta: tuple | None
    slot: int
    same: bool
    graph: _Graph | None = None  # a non-leaf that requires grad (``pos[:, :n]``): its autograd graph


@attrs.define(eq=False, frozen=True)
class _Graph:
    """The autograd graph behind a real tensor argument computed from parameters outside the lazy tensors
    (a slice or lookup of a positional embedding): the node types in walk order, what they saved (as
    :func:`_saved_state` summarises it), and for each leaf its slot and whether an earlier argument took it.
    The backward runs through it; a replay walks it again and compares."""

    kinds: tuple
    saved: tuple
    leaves: tuple  # (slot, same, metadata of a new one) per leaf, in walk order


@attrs.define(eq=False, frozen=True)
class _New:
    """A lazy tensor a taped call returned: the variable it stands for and the metadata it is made with."""

    var: Var
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool


@attrs.define(eq=False, frozen=True)
class _Arg:
    """A taped call returned one of its own arguments (an in-place op returns ``self``): leaf ``index``."""

    index: int


@attrs.define(eq=False)
class _Call:
    """One call of a torch function (``F.linear``, ``Tensor.__add__``, ``loss.backward``) on lazy tensors,
    as seen above autograd: what the express replay compares and what it reproduces without running the
    call. ``key`` is :func:`flat_call` of the arguments with each lazy tensor replaced by its variable and
    each real tensor by a :class:`_Real`; ``grad`` the grad mode. The call made the recording's steps
    ``[first, first + nsteps)`` and ``neqns`` equations, bound ``consts`` (variable, leaf index, and the
    view of that leaf's storage or None for the leaf itself), moved the lazy arguments at ``mutated``
    (leaf index, new variable) to new values in place, and returned ``out`` (a _New, an _Arg, None, or a
    _Seq of them). A call ``express`` cannot reproduce (it ran a kernel for real, read a value, ran Python
    autograd code...) stops the express replay there. A backward is ``func`` Tensor.backward with ``key``
    (the loss variable,), ``mark`` the index of its _Backward step and ``leaves`` the slots of its leaves."""

    func: Any
    key: tuple
    grad: bool
    first: int
    nsteps: int
    neqns: int
    consts: list = attrs.field(factory=list)
    mutated: list = attrs.field(factory=list)
    out: Any = None
    express: bool = True
    mark: int = -1
    leaves: list = attrs.field(factory=list)
    views: _Views = attrs.field(factory=lambda: _Views())
    slots_before: int = 0  # how many real tensors the session's earlier calls took
    guard: Any = None  # the generated match (_compile_guard), made at its first replay

    def compile_guard(self) -> Callable:
        self.guard = _compile_guard(self)
        return self.guard


# The latest recording per input signature: the step loop of a training script records once. The oldest
# signatures are forgotten first.
_RECORDINGS: dict[tuple, _Recording] = {}
_MAX_RECORDINGS = 32


_BATCHED_AT: dict[int, Batched] = {}  # Batched(dim) of an input, made once per dim


def _meta(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.device, t.requires_grad


def _key(leaves: list) -> tuple:
    """What a replay compares: the variable of each lazy tensor, the metadata of each real one, values."""
    return tuple([
        x._var if type(x) is LazyTensor else _meta(x) if isinstance(x, torch.Tensor) else x for x in leaves
    ])


def _is_inplace(func: Any) -> bool:
    returns = func._schema.returns
    return bool(returns) and returns[0].alias_info is not None and returns[0].alias_info.is_write


class _Session:
    """What one ``lazy(...)`` call records: the equations, which of them have run, and the values kept.

    A session either *records* (each op runs on fake tensors through the tracer's recorder) or *replays*
    the recording of an earlier session with the same inputs: while each call is the same op on the same
    variables, the same constants' metadata and the same Python values as the recorded step at that
    position, the session reuses the step (no fake kernel runs) and, at a flush, the executable built for
    it. The first call that differs switches the session to recording: the steps replayed so far are
    recorded again on fakes, and it goes on from there.

    Above that, a session replaying a taped recording starts *express* (in ``LazyTensor.__torch_function__``):
    calls are matched against the tape and not run until one is not the tape's next (:meth:`leave_express`).
    """

    done = 0  # equations before this index have run
    hooked = False  # a hook or grad_fn was reached: backward always runs the autograd engine
    freed: frozenset[Var] = frozenset()  # losses whose backward ran (the engine would have freed their graph)
    reading_saved = False  # reading what autograd saved: calls are not steps
    recorder: _Recorder | None = None
    # Express replay (see _Call): the torch-level calls this session tapes, or replays without running them.
    tape: list[_Call] | None = None  # the tape this session appends to
    express = False  # replaying the recording's tape call by call
    tape_pos = 0  # the next call of the tape to replay
    shadowed = False  # the lazy tensors the express replay made have shadows: calls take those instead

    def __init__(self, tensors: tuple[torch.Tensor, ...], batch: int, memory_budget: int | str | None, size: int):
        self.batch = size
        self.memory_budget = memory_budget
        # The key: grad mode tells a training step from an evaluation step on batches of the same shape (a
        # loop that alternates them would otherwise re-record each time).
        metas = [_meta(t) for t in tensors]
        self.key = (batch, torch.is_grad_enabled(), tuple(metas))
        self.values: dict[Var, torch.Tensor] = {}  # real values of vars, inputs included
        self.consts: dict[Var, torch.Tensor] = {}  # the real tensors recorded calls read
        self.alive: dict[Var, weakref.ref] = {}
        self.batched: dict[Var, Batched] = {}
        self.lazies: list[LazyTensor] = []
        self.slots: list[torch.Tensor] = []  # the real tensors the session's calls took, in order
        self.slot_ids: dict[int, int] = {}
        self.graph_nodes: dict[int, list] = {}  # slot of a real argument with a graph -> its nodes, walked
        self.replaying = _RECORDINGS.get(self.key)
        grad_inputs = any(m[4] for m in metas)
        if self.replaying is not None:
            self.recording = self.replaying
            self.eqns = self.replaying.eqns
            self.cursor = 0  # the next step to replay
            self.end = 0  # equations replayed so far
            inputs = self.replaying.inputs
            tape = self.replaying.tape
            if tape is None and not grad_inputs:
                self.tape = self.replaying.tape = []
            self.express = bool(tape) and tape[0].express and self.replaying.express and not grad_inputs
        else:
            self.recording = self._start_recording()
            inputs = [None] * len(tensors)
            if not grad_inputs:
                self.tape = self.recording.tape = []
        self.input_refs: list[weakref.ref] = []
        for i, (t, var, (shape, stride, dtype, device, requires_grad)) in enumerate(zip(tensors, inputs, metas)):
            real = t.detach() if requires_grad else t  # the value, without its autograd graph
            fake = None
            if var is None:
                var, fake = self._add_input(i, real)
            self.values[var] = real
            # _lazy_tensor and Batched(dim), inline and cached: a replayed step's hot path, where each call
            # saved is measurable (with these and flush's inline .grad, batch 256 ran 1.044x eager, not 1.051x).
            dim = batch % len(shape)
            self.batched[var] = _BATCHED_AT.get(dim) or _BATCHED_AT.setdefault(dim, Batched(dim))
            lazy_t = _make_subclass(LazyTensor, shape, strides=stride, dtype=dtype, device=device, requires_grad=requires_grad)
            lazy_t._fake, lazy_t._var, lazy_t._session = fake, var, self
            self.alive[var] = ref = weakref.ref(lazy_t)
            self.input_refs.append(ref)
            self.lazies.append(lazy_t)

    def _add_input(self, i: int, real: torch.Tensor) -> tuple[Var, torch.Tensor]:
        rec = self.recorder
        with rec.fake_mode:
            fake = rec.fake_mode.from_tensor(real, static_shapes=True)
        var = rec.add_input(fake, "arg", f"lazy{i}")
        self.recording.inputs.append(var)
        return var, fake

    def _start_recording(self) -> _Recording:
        self.recorder = _Recorder(FakeTensorMode(allow_non_fake_inputs=True))
        self.eqns = self.recorder.eqns
        recording = _Recording([], self.eqns)
        _RECORDINGS.pop(self.key, None)
        _RECORDINGS[self.key] = recording
        while len(_RECORDINGS) > _MAX_RECORDINGS:
            del _RECORDINGS[next(iter(_RECORDINGS))]
        return recording

    # -- recording ---------------------------------------------------------------------------------------

    def call(self, func: Any, args: tuple, kwargs: dict, leaves: list) -> Any:
        """An op on lazy tensors: replay it, record it, or (for a value read) run it for real."""
        if self.reading_saved:
            # Autograd unpacking a saved lazy output detaches it: an alias of the same value, not a step.
            if func is not _aten.detach.default:
                raise _Unreadable
            t = args[0]
            return _lazy_tensor(t.shape, t.stride(), t.dtype, t.device, t._var, self, t._fake)
        if func.namespace == "prim":
            return func(*map_leaves(args, torch.Tensor, _real), **map_leaves(kwargs, torch.Tensor, _real))
        if self.replaying is not None:
            step = self._match(func, leaves)
            if step is not None:
                return self._replay(step, args, kwargs)
            self._diverge()
        if func in _CONCRETE:
            return self._run_real(func, args, kwargs, leaves)
        try:
            return self._record(func, args, kwargs, leaves)
        except ConcretizationError:
            # A data-dependent shape (x[x > 0], nonzero): evaluate the inputs and run this op for real.
            return self._run_real(func, args, kwargs, leaves)

    def _record_call(self, func: Any, args: tuple, kwargs: dict, src: Any = None) -> Any:
        """Record one call on fakes; the real tensors it lifted become this session's constants."""
        rec = self.recorder
        n_consts = len(rec.consts)
        out = rec.record(func, args, kwargs, src=src)
        for t in rec.consts[n_consts:]:
            self.consts[rec.const_vars[id(t)]] = t
        return out

    def _record(self, func: Any, args: tuple, kwargs: dict, leaves: list) -> Any:
        rec = self.recorder
        out = self._record_call(func, map_leaves(args, torch.Tensor, self._unwrap), map_leaves(kwargs, torch.Tensor, self._unwrap))
        out_spec = map_leaves(out, torch.Tensor, lambda f: _Out(rec.var(f), f.shape, f.stride(), f.dtype, f.fake_device))
        inplace = _is_inplace(func)
        self.recording.steps.append(_Step(func, _key(leaves), self._consts_in(leaves), out_spec, True, inplace))
        if inplace and type(args[0]) is not LazyTensor and isinstance(args[0], torch.Tensor):
            # In place on a real tensor (autograd accumulating into a real .grad): its new value is that
            # tensor too, once the flush has run the op.
            self.consts[rec.var(out)] = args[0]
        if inplace and isinstance(args[0], LazyTensor):
            # In place: the same Python object now stands for the op's result.
            target = args[0]
            target._var, target._fake = rec.var(out), out
            self.alive[target._var] = weakref.ref(target)
            return target
        return map_leaves(out, torch.Tensor, self._wrap_fake)

    def _consts_in(self, leaves: list) -> list[tuple[int, Var | None]]:
        rec, out = self.recorder, []
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor) and type(x) is not LazyTensor:
                out.append((i, rec.const_vars.get(id(x))))
        return out

    def _run_real(self, func: Any, args: tuple, kwargs: dict, leaves: list) -> Any:
        if self.replaying is None:
            self.recording.steps.append(_Step(func, _key(leaves), self._consts_in(leaves), None, False, False))
        return func(*map_leaves(args, torch.Tensor, _real), **map_leaves(kwargs, torch.Tensor, _real))

    def _wrap_fake(self, fake: torch.Tensor) -> LazyTensor:
        var = self.recorder.var(fake)
        out = _lazy_tensor(fake.shape, fake.stride(), fake.dtype, fake.fake_device, var, self, fake)
        self.alive[var] = weakref.ref(out)
        return out

    @staticmethod
    def _unwrap(t: torch.Tensor) -> torch.Tensor:
        return t._fake if type(t) is LazyTensor else t

    # -- replaying ---------------------------------------------------------------------------------------

    def _match(self, func: Any, leaves: list) -> _Step | None:
        steps = self.replaying.steps
        if self.cursor >= len(steps):
            return None
        step = steps[self.cursor]
        if step.func is not func:
            return None
        key = _key(leaves)
        if key != step.key or tuple(map(type, key)) != step.types:
            return None
        for i, var in step.consts:
            if var is None:  # an argument of a call that ran for real: its metadata is all that matters
                continue
            bound = self.consts.get(var)
            if bound is None:
                self.consts[var] = leaves[i]
            elif bound is not leaves[i]:
                return None
        return step

    def _replay(self, step: _Step, args: tuple, kwargs: dict) -> Any:
        self.cursor += 1
        if not step.recorded:
            return self._run_real(step.func, args, kwargs, [])
        self.end += 1
        if step.inplace and type(args[0]) is not LazyTensor and isinstance(args[0], torch.Tensor):
            self.consts[step.out.var] = args[0]
        if step.inplace and type(args[0]) is LazyTensor:
            target = args[0]
            target._var = step.out.var
            self.alive[target._var] = weakref.ref(target)
            return target
        if step.single:
            return self._wrap_out(step.out)
        return map_leaves(step.out, _Out, self._wrap_out)

    def _wrap_out(self, o: _Out) -> LazyTensor:
        out = _lazy_tensor(o.shape, o.stride, o.dtype, o.device, o.var, self)
        self.alive[o.var] = weakref.ref(out)
        return out

    def _diverge(self) -> None:
        """The call differs from the recording being replayed: record the replayed steps again on fake
        tensors, remap every live value to the new variables, and go on recording."""
        old = self.replaying
        replayed = old.steps[: self.cursor]
        self.replaying = None
        self.recording = self._start_recording()
        self.tape = None  # its steps are not this session's calls one for one: the next session tapes it
        rec = self.recorder
        new_of: dict[Var, Var] = {}
        fake_of: dict[Var, torch.Tensor] = {}
        for i, var in enumerate(old.inputs):
            new_of[var], fake_of[var] = self._add_input(i, self.values[var])
        consts = self.consts
        self.consts = {}
        eqns = iter(old.eqns)
        for step in replayed:
            if step.func is _BACKWARD:  # a skipped backward's marker; its steps follow it
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
            step_consts = [(i, v if v is None else rec.const_vars[id(consts[v])]) for i, v in step.consts]
            key = tuple(new_of[x] if type(x) is Var else x for x in step.key)
            out_spec = map_leaves(step.out, _Out, lambda o: attrs.evolve(o, var=new_of[o.var]))
            self.recording.steps.append(_Step(step.func, key, step_consts, out_spec, step.recorded, step.inplace))
        for var, ref in self.alive.items():
            t = ref()
            if t is not None:
                t._var, t._fake = new_of[var], fake_of[var]
        self.alive = {new_of[v]: ref for v, ref in self.alive.items() if ref() is not None}
        self.values = {new_of[v]: x for v, x in self.values.items()}
        self.batched = {new_of[v]: b for v, b in self.batched.items()}
        self.eqns = rec.eqns

    # -- express replay ----------------------------------------------------------------------------------

    @property
    def step_count(self) -> int:
        return self.cursor if self.replaying is not None else len(self.recording.steps)

    def torch_call(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A torch function on lazy tensors, above autograd, that the express replay did not match: run it
        (through autograd and ``__torch_dispatch__``), taping it if this session tapes."""
        if self.shadowed:
            owners = {id(t._shadow): t for t in flat_call(args, kwargs) if type(t) is LazyTensor and t._shadow is not None}
            args, kwargs = _unshadow(args), _unshadow(kwargs)
            if func is torch.autograd.grad:
                _refuse_stranded(args, kwargs)
            if owners:
                # A call that hands back its argument (in place, ``contiguous``) hands back the user's tensor.
                with torch._C.DisableTorchFunctionSubclass():
                    out = func(*args, **kwargs)
                return map_leaves(out, LazyTensor, lambda t: owners.get(id(t), t))
        tape = self.tape
        if tape is None:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        leaves = flat_call(args, kwargs)
        first, n_eqns, n_consts = self.step_count, self.eqn_count, len(self.consts)
        call = self._tape_key(func, leaves, first, tape)
        try:
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
        except BaseException:
            self.tape = None
            raise
        if self.tape is tape:  # not diverged meanwhile
            self._tape_result(call, leaves, n_eqns, n_consts, out)
            tape.append(call)
            if not call.express:
                self.tape = None  # the express replay stops at this call: the rest need not be taped
        return out

    def _tape_key(self, func: Any, leaves: list, first: int, tape: list) -> _Call:
        if _in_custom_function():
            self.recording.express = False
        # A call is not replayed express under autocast or inference mode, nor after steps made outside any
        # taped call (``first`` not where the tape ends: an engine run by a hook, say).
        express = (
            not torch._C._is_any_autocast_enabled() and not torch.is_inference_mode_enabled()
            and first == (tape[-1].first + tape[-1].nsteps if tape else 0) and self.recording.express
        )
        key = []
        slots_before = len(self.slots)
        for x in leaves:
            if type(x) is LazyTensor:
                key.append(x._var)
            elif isinstance(x, torch.Tensor):
                slot = self.slot_ids.get(id(x))
                if slot is not None:
                    key.append(_Real(None, slot, True))
                    continue
                slot = self._slot(x)
                graph = None
                if x.requires_grad and x.grad_fn is not None:
                    graph = self._tape_graph(x)
                    express = express and graph is not None
                key.append(_Real(_meta(x), slot, False, graph))
            else:
                key.append(x)
        return _Call(func, tuple(key), torch.is_grad_enabled(), first, 0, 0, express=express, slots_before=slots_before)

    def _slot(self, x: torch.Tensor) -> int:
        slot = self.slot_ids[id(x)] = len(self.slots)
        self.slots.append(x)
        return slot

    def _tape_graph(self, x: torch.Tensor) -> _Graph | None:
        """The graph behind a real argument with one, its leaves given slots; None where it runs Python
        (an autograd.Function), which only the engine can run."""
        leaves, kinds, nodes = _autograd_graph([x])
        if any(issubclass(kind, _PYTHON_FUNCTION_NODE) for kind in kinds):
            return None
        self.graph_nodes[self.slot_ids[id(x)]] = nodes
        spec = []
        for leaf in leaves:
            slot = self.slot_ids.get(id(leaf))
            spec.append((self._slot(leaf), False, _meta(leaf)) if slot is None else (slot, True, None))
        return _Graph(kinds, self._saved_state(nodes)[0], tuple(spec))

    def _tape_result(self, call: _Call, leaves: list, n_eqns: int, n_consts: int, out: Any) -> None:
        call.nsteps = self.step_count - call.first
        call.neqns = self.eqn_count - n_eqns
        steps = self.recording.steps[call.first : call.first + call.nsteps]
        if not all(st.recorded and st.func is not _BACKWARD for st in steps):
            call.express = False  # an op that ran for real (read a value)
        for i, (x, k) in enumerate(zip(leaves, call.key)):
            if type(x) is LazyTensor and x._var is not k:
                call.mutated.append((i, x._var))
        for var, t in list(self.consts.items())[n_consts:]:
            source = _source(t, leaves)
            if source is None:
                call.express = False  # a real tensor the call made itself: its value is not the arguments'
                break
            call.consts.append((var, *source))
        try:
            call.out = _out_spec(out, leaves, self)
        except _Unreadable:
            call.express = False
        if not steps and (call.func is torch.Tensor.requires_grad_ or not _only_args(call.out)):
            # No op: only a call that hands back its own arguments (``x.to(x.dtype)``, ``x.contiguous()``) is
            # reproduced; anything else changed what the tape cannot see (autograd state, a new alias).
            call.express = False

    def _express_out(self, o: _New) -> LazyTensor:
        t = _make_subclass(LazyTensor, o.shape, strides=o.stride, dtype=o.dtype, device=o.device, requires_grad=o.requires_grad)
        t._var, t._session, t._express = o.var, self, True
        self.alive[o.var] = weakref.ref(t)
        return t

    def leave_express(self) -> None:
        """Go back to the slow replay: run the calls replayed so far again through autograd, from the start
        of the recording (nothing runs for real: the steps replay as recorded), and give each live lazy
        tensor the express replay made a shadow, the same value with its autograd graph. Calls on it use
        its shadow from now on."""
        self.express = False
        recording = self.recording
        recording.left += 1
        if recording.left >= _MAX_LEAVES:  # every step leaves it (at a call the tape cannot replay, say)
            recording.express = False
        calls = recording.tape[: self.tape_pos]
        self.cursor = self.end = 0
        self.consts = {}
        # Their shadows take their place (the same variables) as the calls run again.
        made = [t for r in self.alive.values() if (t := r()) is not None and t._express]
        self.alive = {v: r for v, r in self.alive.items() if (t := r()) is not None and not t._express}
        shadow_of: dict[Var, LazyTensor] = {}
        for var, ref in zip(self.recording.inputs, self.input_refs):
            t = ref()
            if t is None:
                x = self.values[var]
                t = _lazy_tensor(x.shape, x.stride(), x.dtype, x.device, var, self)
            t._var = var  # an in-place call replayed on it moved it on: it is replayed again
            shadow_of[var] = t
            self.alive[var] = weakref.ref(t)
        for call in calls:
            if self.replaying is not recording:
                raise RuntimeError("stagetorch.lazy: the express replay's calls differ from its recording; this is a bug")
            if call.mark >= 0:  # a backward, already run without the engine
                mark = recording.steps[call.mark].out
                self.cursor, self.end = call.mark + 1 + mark.nsteps, self.end + mark.neqns
                continue
            flat = [shadow_of[k] if type(k) is Var else self.slots[k.slot] if type(k) is _Real else k for k in call.key]
            args, kwargs = unflat_call(flat)
            # Express calls were taped with autocast off; the leave may come inside a user's autocast region.
            with torch.set_grad_enabled(call.grad), torch._C.DisableTorchFunctionSubclass(), torch._C._DisableAutocast():
                out = call.func(*args, **kwargs)
            for x in flatten(out):
                if type(x) is LazyTensor:
                    shadow_of[x._var] = x
            for i, var in call.mutated:
                shadow_of[var] = flat[i]
        for t in made:
            t._shadow = shadow_of[t._var]
        self.shadowed = True

    def _express_backward(self, args: tuple, kwargs: dict, roots: list) -> bool:
        """``loss.backward()`` in an express replay, as the tape's backward: no autograd graph exists, so
        it runs the recorded backward steps (the _Backward marker's) and accumulates into the leaves."""
        tape = self.recording.tape
        call = tape[self.tape_pos] if self.tape_pos < len(tape) else None
        loss = roots[0]
        if (
            call is None or call.mark < 0 or len(args) != 1 or len(roots) != 1 or type(loss) is not LazyTensor
            or loss._session is not self or loss._var is not call.key[0] or loss._shadow is not None
            or any(v is not None and v is not False for v in kwargs.values())
        ):
            return False
        mark: _Backward = self.recording.steps[call.mark].out
        leaves = [self.slots[i] for i in call.leaves]
        for leaf in leaves:
            # A real .grad (gradient accumulation) is added into, as AccumulateGrad would.
            grad = leaf.grad
            if (
                (grad is not None and (type(grad) is not torch.Tensor or grad.layout != torch.strided))
                or leaf._backward_hooks or getattr(leaf, "_post_accumulate_grad_hooks", None)
            ):
                return False
        consts = self.consts
        for j, ((v, _, shape, stride, offset), source) in enumerate(zip(mark.derived, call.consts)):
            if type(source) is Var:
                consts[v] = call.views.get(j, consts[source], (shape, stride, offset))
            else:  # what a node of a real argument's graph saved (the indices of an embedding lookup)
                slot, i, name = source
                with torch._C.DisableTorchFunctionSubclass():
                    base = getattr(self.graph_nodes[slot][i], name)
                same = base.shape == shape and base.stride() == stride and base.storage_offset() == offset
                consts[v] = base if same else _view(base, (shape, stride, offset))
        self.cursor = call.mark + 1 + mark.nsteps
        self.end += mark.neqns
        self.tape_pos += 1
        self.freed = self.freed | {loss._var}
        self.recording.left = 0
        self.flush([], grads=[(leaves[i], v) for i, v in mark.grads])
        return True

    # -- backward --------------------------------------------------------------------------------------

    def backward(self, func: Any, args: tuple, kwargs: dict, roots: list) -> None:
        """``loss.backward()``: autograd runs the backward ops through ``__torch_dispatch__`` (recorded or
        replayed), then a flush turns the lazy gradients into real ones. When the session replays a
        recording whose backward ran over the same autograd graph into the same leaves, with no hooks and
        every ``.grad`` empty, the engine is skipped: its steps are the recorded ones."""
        if self.express:
            if self._express_backward(args, kwargs, roots):
                return
            self.leave_express()
        if self.shadowed:
            args, kwargs = _unshadow(args), _unshadow(kwargs)
            roots = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
        tape, tape_from = self.tape, self.step_count
        self.tape = None  # taped below, once the backward's steps are known
        loss = roots[0]
        if any(type(t) is LazyTensor and t._var in self.freed for t in roots):
            raise RuntimeError(
                "Trying to backward through the graph a second time: the first backward() freed it. Specify "
                "retain_graph=True in the first backward() if you need to backward through it again."
            )
        with torch._C.DisableTorchFunctionSubclass():
            leaves, kinds, nodes = _autograd_graph(roots)
        # The engine may be skipped only for a plain backward over built-in formulas: no arguments, no
        # hooks, empty .grad, and no Python autograd.Function (its backward is Python code reading any state).
        plain = (
            len(args) == 1 and len(roots) == 1 and type(loss) is LazyTensor and not self.hooked
            and not any(v is not None and v is not False for v in kwargs.values())
            and all(
                type(leaf) is not LazyTensor and leaf.grad is None and not leaf._backward_hooks
                and not getattr(leaf, "_post_accumulate_grad_hooks", None)
                for leaf in leaves
            )
            and not any(issubclass(kind, _PYTHON_FUNCTION_NODE) for kind in kinds)
        )
        key = (loss._var, kinds)
        remark = None  # the replayed marker to bring up to date if the engine replays its steps as recorded
        if self.replaying is not None:
            steps = self.replaying.steps
            step = steps[self.cursor] if self.cursor < len(steps) else None
            if step is not None and step.func is _BACKWARD:
                mark: _Backward = step.out
                if (
                    plain and mark.key == key and len(mark.leaves) == len(leaves)
                    and all(r() is leaf for r, leaf in zip(mark.leaves, leaves))
                    and all(v in self.consts for v in mark.needs)
                    and (state := self._saved_state(nodes, mark.checks))[0] == mark.saved
                ):
                    self.consts.update(self._derive(mark.derived, state[1]))
                    self.cursor += 1 + mark.nsteps
                    self.end += mark.neqns
                    self.freed = self.freed | {loss._var}  # as the engine would have freed the graph
                    self._tape_backward(tape, tape_from, self.cursor - 1 - mark.nsteps, loss, leaves, nodes)
                    self.flush([], grads=[(leaves[i], v) for i, v in mark.grads])
                    return
                remark = self.cursor
                self.cursor += 1  # the engine runs below; its calls replay one by one
        was_recording = self.replaying is None
        start = (self.cursor if not was_recording else len(self.recording.steps), self.eqn_count, dict(self.consts))
        marking = plain and (was_recording or remark is not None)
        caller = user_frame(2) if marking else None
        call_site = (caller.f_code.co_filename, caller.f_lineno) if caller is not None else None
        with torch._C.DisableTorchFunctionSubclass():
            saved = self._saved_state(nodes) if marking else None
            stranded = [t for t in leaves if type(t) is LazyTensor and t._express]
            if stranded:
                leaves = self._run_stranded(func, args, kwargs, leaves, stranded)
            else:
                func(*args, **kwargs)
        marked = -1
        if plain and was_recording:
            # Recorded (from the start, not after a divergence mid-backward): mark it for the next steps.
            span = self.recording.steps[start[0] :]
            mark = self._backward_mark(key, leaves, span, start[1], start[2], saved, call_site)
            if mark is not None:
                self.recording.steps.insert(start[0], _Step(_BACKWARD, (), [], mark, False, False))
                marked = start[0]
        elif plain and remark is not None and self.replaying is not None:
            # Replayed through the engine, step by step as recorded (another model of the same shapes, a
            # hook since removed): the marker now describes this graph, so the next step skips the engine.
            span = self.replaying.steps[remark + 1 : self.cursor]
            mark = self._backward_mark(key, leaves, span, start[1], start[2], saved, call_site)
            if mark is not None:
                self.replaying.steps[remark] = _Step(_BACKWARD, (), [], mark, False, False)
                marked = remark
        if marked >= 0:
            self._tape_backward(tape, tape_from, marked, loss, leaves, nodes)
        elif tape is not None:
            tape.append(_Call(_BACKWARD, (), False, tape_from, 0, 0, express=False))
        self.flush([], leaves)

    def _run_stranded(self, func: Any, args: tuple, kwargs: dict, leaves: list, stranded: list) -> list:
        """Run a backward whose graph ends at lazy tensors the express replay made: a Python
        ``autograd.Function`` took them, below any torch function, before the session left the express
        replay. Their gradients go on from their shadows in a second pass. Returns the leaves of both."""
        grads: dict[int, torch.Tensor] = {}
        handles = [t.register_hook(lambda g, i=i: grads.__setitem__(i, g)) for i, t in enumerate(stranded)]
        try:
            func(*args, **{**kwargs, "retain_graph": True})  # the second pass goes through the shadows' graph
        finally:
            for h in handles:
                h.remove()
        for t in stranded:
            t.grad = None
        roots = [stranded[i]._shadow for i in grads]
        more = [t for t in _autograd_graph(roots)[0] if not any(t is u for u in leaves)]
        if roots:
            retain = bool(kwargs.get("retain_graph") or kwargs.get("create_graph"))
            torch.autograd.backward(roots, list(grads.values()), retain_graph=retain)
        return [t for t in leaves if not any(t is u for u in stranded)] + more

    def _tape_backward(
        self, tape: list | None, first: int, marked: int, loss: LazyTensor, leaves: list, nodes: list
    ) -> None:
        """Tape a backward that has a _Backward marker at step ``marked``; the express replay can run it
        when the marker's constants all derive from the forward's and its leaves are real arguments the
        calls took."""
        if tape is None:
            return
        mark: _Backward = self.recording.steps[marked].out
        slots = [self.slot_ids.get(id(leaf)) for leaf in leaves]
        # A constant the backward derives from what a node saved must come from the graph of a real
        # argument, which the express replay walks: (slot of the argument, node index in its walk, attribute).
        where = {id(n): (slot, i) for slot, walked in self.graph_nodes.items() for i, n in enumerate(walked)}
        sources = [d[1] if type(d[1]) is Var else (*where.get(id(nodes[d[1][0]]), (None, None)), d[1][1]) for d in mark.derived]
        express = (
            first == marked == (tape[-1].first + tape[-1].nsteps if tape else 0)
            and all(type(src) is Var or src[0] is not None for src in sources)
            and all(i is not None and self.slots[i] is leaf for i, leaf in zip(slots, leaves))
        )
        tape.append(_Call(
            _BACKWARD, (loss._var,), False, first, 1 + mark.nsteps, mark.neqns, mark=marked, leaves=slots,
            express=express, consts=sources,
        ))
        if express:
            self.tape = tape

    @property
    def eqn_count(self) -> int:
        return self.end if self.replaying is not None else len(self.eqns)

    def _saved_state(self, nodes: list, only: list | None = None) -> tuple[tuple, dict]:
        self.reading_saved = True
        try:
            return _saved_state(nodes, only)
        finally:
            self.reading_saved = False

    def _backward_mark(
        self, key: tuple, leaves: list, span: list, n_eqns: int, bound: dict, saved: tuple, call_site: tuple | None
    ) -> _Backward | None:
        if not span or not all(s.recorded and s.func is not _BACKWARD for s in span):
            return None
        # Backward formulas run in C++: the user's frame of each of their calls is the backward() call. A
        # call from anywhere else is Python code the engine ran (a hook on a real tensor or node, which
        # PyTorch does not let us see): that code must run every step, so the engine is never skipped.
        if call_site is None or any(
            (e.source.file, e.source.line) != call_site for e in self.eqns[n_eqns : self.eqn_count]
        ):
            return None
        grads = [
            (i, leaf.grad._var) for i, leaf in enumerate(leaves)
            if type(leaf.grad) is LazyTensor and leaf.grad._session is self
        ]
        summary, real = saved
        by_storage: dict[int, list[tuple[tuple[int, str], torch.Tensor]]] = {}
        for where, x in real.items():
            by_storage.setdefault(x.untyped_storage()._cdata, []).append((where, x))
        needs = {v for s in span for _, v in s.consts if v is not None}
        derived = []
        for v in needs - bound.keys():
            t = self.consts[v]
            # The same StorageImpl (not the same address: empty storages share addresses) and dtype.
            # A constant bound before the backward first: the express replay, which has no graph, can make it.
            storage = t.untyped_storage()._cdata
            source = next(
                (u for u, b in bound.items() if b.dtype == t.dtype and b.untyped_storage()._cdata == storage), None
            )
            if source is None:
                source = next((where for where, x in by_storage.get(storage, ()) if x.dtype == t.dtype), None)
            if source is None:
                return None
            derived.append((v, source, t.shape, t.stride(), t.storage_offset()))
        # A saved lazy tensor is an input or output of a recorded step, fixed by the forward's match; the rest
        # (numbers, real tensors) is what a replay reads again and compares.
        checked = tuple(entry for entry in summary if not _is_lazy_summary(entry[2]))
        weak = [weakref.ref(leaf) for leaf in leaves]
        needs = (needs & bound.keys()) | {d[1] for d in derived if type(d[1]) is Var}
        return _Backward(key, weak, grads, len(span), self.eqn_count - n_eqns, needs, derived, checked)

    def _derive(self, derived: list[tuple], real: dict[tuple[int, str], torch.Tensor]) -> dict[Var, torch.Tensor]:
        """The constants a skipped backward reads that the forward did not bind, made as the engine would:
        the same view of the same saved tensor."""
        out = {}
        for v, source, shape, stride, offset in derived:
            base = real[source] if type(source) is tuple else self.consts[source]
            if base.shape == shape and base.stride() == stride and base.storage_offset() == offset:
                out[v] = base
            else:
                out[v] = base.detach().as_strided(shape, stride, offset)
        return out

    # -- running -----------------------------------------------------------------------------------------

    def flush(self, targets: list[Var], leaves: list[torch.Tensor] = (), grads: list | None = None) -> None:
        """Run every recorded equation not yet run; keep ``targets``, every value still referenced, and the
        lazy gradients autograd stored in the ``.grad`` of ``leaves`` (or the (leaf, Var) pairs ``grads``),
        which become real gradients."""
        end = self.eqn_count
        if end == self.done:
            return
        if grads is None:
            grads = [
                (leaf, leaf.grad._var)
                for leaf in leaves
                if isinstance(leaf.grad, LazyTensor) and leaf.grad._session is self
            ]
        flushes = self.recording.flushes
        span = flushes.get((self.done, end))
        if span is None:
            pending = self.eqns[self.done : end]
            produced = [v for e in pending for v in e.outvars if v is not None]
            made = set(produced)
            invars: list[Var] = []  # every input of the pending equations that the user or a flush supplied
            for e in pending:
                for v in e.invars:
                    if v not in made and v not in invars:
                        invars.append(v)
            span = flushes[(self.done, end)] = (produced, invars)
        produced, invars = span
        values = self.values
        # Only what can still be read is kept: the inputs, and values whose lazy tensor is alive.
        alive = self.alive = {v: ref for v, ref in self.alive.items() if ref() is not None}
        wanted = {v for v in targets if v not in values}
        wanted.update(v for v in alive if v not in values)
        wanted.update(v for _, v in grads)
        later = None
        if self.express:
            # No autograd graph holds what the recording's later steps (the backward) read: keep it here.
            # (The recording is complete: an express replay only replays a recorded session's calls.)
            later_key = ("later", self.done, end)
            if later_key not in flushes:
                later = frozenset(v for e in self.eqns[end:] for v in e.invars)
                flushes[later_key] = (later, [v for v in produced if v in later])
            later, read_later = flushes[later_key]
            wanted.update(read_later)
        outs = tuple(v for v in produced if v in wanted)
        built = flushes.get((self.done, end, outs))
        if built is None:
            roles = ["arg" if v in self.batched else "const" for v in invars]
            graph = Graph(invars, self.eqns[self.done : end], list(outs), roles, [""] * len(invars))
            batched = {v: b for v, b in self.batched.items() if v in invars}
            executable = Executable(graph, batched, self.batch)
            device = next((v.aval.device for v in executable.batched), torch.device("cpu"))
            # Outputs in storage the flush made (no view of an input): a gradient there is no parameter's.
            made = set(produced)
            fresh = frozenset(v for v in outs if v.root in made)
            built = flushes[(self.done, end, outs)] = (executable, device, fresh, {v: i for i, v in enumerate(outs)})
        executable, device, fresh, position = built
        consts = self.consts
        try:
            inputs = [values[v] if v in values else consts[v] for v in invars]
        except KeyError:
            raise ConcretizationError("a lazy value was dropped before it ran; this is a bug in stagetorch.lazy") from None
        batched = self.batched
        kept = {v: x for v, x in values.items() if v in alive or v in batched or (later is not None and v in later)}
        results, _ = executable.run(inputs, free_memory(device, self.memory_budget), name="lazy")
        self.done = end
        dropped = False
        for leaf, v in grads:
            grad = leaf.grad
            if type(grad) is LazyTensor:
                leaf.grad = grad = None  # autograd stored the lazy gradient; accumulate the real one as it would have
                dropped = True
            i = position.get(v)
            x = values[v] if i is None else results[i]
            if grad is None and v in fresh and x.stride() == leaf.stride():
                leaf.grad = x  # accumulate_grad's first case, inline: the hot path (see __init__)
            else:
                accumulate_grad(leaf, x, fresh=v in fresh)
        if dropped:
            alive = self.alive = {v: ref for v, ref in alive.items() if ref() is not None}
            kept = {v: x for v, x in kept.items() if v in alive or v in batched or (later is not None and v in later)}
        for v, x in zip(outs, results):
            if v in alive or (later is not None and v in later):
                kept[v] = x
        self.values = kept


def _autograd_graph(roots: list[torch.Tensor]) -> tuple[list[torch.Tensor], tuple, list]:
    """The leaf tensors a backward from ``roots`` accumulates into (its graph's AccumulateGrad nodes), the
    graph's node types in a fixed walk order, and the nodes in that order."""
    leaves, kinds, nodes, seen, stack = [], [], [], set(), [t.grad_fn for t in reversed(roots)]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nodes.append(node)
        kinds.append(type(node))
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves.append(variable)
        stack.extend(n for n, _ in node.next_functions)
    return leaves, tuple(kinds), nodes


_SAVED_ATTRS: dict[type, list[str]] = {}


class _Unreadable(Exception):
    """A saved value autograd cannot hand out without running an op on a lazy tensor."""


def _saved_state(nodes: list, only: list[tuple[int, str]] | None = None) -> tuple[tuple, dict]:
    """What the graph's nodes saved for their backward formulas: a summary to compare, ((node index in walk
    order, attribute, value) with each Python value, the variable of each lazy tensor and the metadata of
    each real tensor), and the real tensors by (node index, attribute). Read before the engine runs: it
    frees them. ``only``: just these attributes."""
    summary, real = [], {}
    if only is None:
        only = []
        for i, node in enumerate(nodes):
            kind = type(node)
            names = _SAVED_ATTRS.get(kind)
            if names is None:
                names = _SAVED_ATTRS[kind] = [a for a in dir(node) if a.startswith("_saved_")]
            only.extend((i, name) for name in names)
    for i, name in only:
        try:
            x = getattr(nodes[i], name)
        except Exception:  # not readable (released, or a saved value that needs an op): compare its absence
            summary.append((i, name, _Unreadable))
            continue
        if isinstance(x, torch.Tensor):
            if type(x) is not LazyTensor:
                real[(i, name)] = x
            summary.append((i, name, _summary(x)))
        elif isinstance(x, (list, tuple)):
            summary.append((i, name, tuple(_summary(y) if isinstance(y, torch.Tensor) else y for y in x)))
        else:
            summary.append((i, name, x))
    return tuple(summary), real


def _is_lazy_summary(value: Any) -> bool:
    """A saved attribute that is one lazy tensor (a list of tensors is always compared whole)."""
    return type(value) is tuple and len(value) == 2 and isinstance(value[0], str) and value[0] == "lazy"


def _summary(t: torch.Tensor) -> tuple:
    if type(t) is LazyTensor:
        return ("lazy", t._var)
    meta = (t.shape, t.stride(), t.storage_offset(), t.dtype, t.device, t.layout)
    if t.ndim == 0 and t.device.type == "cpu":
        # A Python number autograd saved as a tensor (`weight * scale`): the backward call gets it back as
        # a number, recorded in the step, so its value is part of what must match.
        return (*meta, t.item())
    return meta


@attrs.define(eq=False)
class _Backward:
    """A ``loss.backward()`` in a recording, with what a replay needs to skip the autograd engine: the
    autograd graph it ran over (node types, leaf tensors), the recorded steps it produced, the gradients
    it left in each leaf's ``.grad``, and the constants those steps read. What the graph's nodes saved is
    compared too: a real tensor of another shape, or another Python number, in an op on real tensors (whose
    backward formula reads it) is otherwise invisible to the replay. A constant the forward did not
    bind is a real tensor the engine makes from the graph's saved tensors: a saved tensor itself (the
    indices of a real embedding lookup) or a view of one (``mat2.t()`` in addmm's backward). It is recorded
    as the view it is of a node's saved tensor (or, failing that, of a constant bound before the backward),
    so a replay makes it the same way without the engine."""

    key: tuple
    leaves: list[weakref.ref]
    grads: list[tuple[int, Var]]
    nsteps: int
    neqns: int
    needs: set[Var]  # constants bound before the backward
    derived: list[tuple]  # (var, source, shape, stride, offset); source (node index, saved attribute) or a var
    saved: tuple  # _saved_state's summary of what the graph saved (all but lazy tensors), as recorded

    @property
    def checks(self) -> list[tuple[int, str]]:
        """The (node index, attribute) pairs ``saved`` covers: what a replay reads again."""
        return [(i, name) for i, name, _ in self.saved]


_BACKWARD = torch.Tensor.backward
_PYTHON_FUNCTION_NODE = torch.autograd.function.BackwardCFunction
_make_subclass = torch.Tensor._make_wrapper_subclass
_MISS = object()  # the call is not the tape's next one
_NO_KWARGS: dict = {}  # never written
_grad_enabled = torch.is_grad_enabled
_any_autocast = torch._C._is_any_autocast_enabled
_APPLY = torch.autograd.Function.apply.__func__.__code__


def _in_custom_function() -> bool:
    """Whether the call runs inside a Python ``autograd.Function``'s forward: its backward is the
    Function's, which only the autograd engine runs, so the calls inside it cannot be replayed alone."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _APPLY:
            return True
        frame = frame.f_back
    return False


def _source(t: torch.Tensor, leaves: list) -> tuple[int, tuple | None] | None:
    """How a constant a call bound derives from its real arguments: (leaf index, None) for an argument
    itself, (leaf index, (shape, stride, offset)) for a view of one's storage; None otherwise."""
    for i, x in enumerate(leaves):
        if x is t:
            return i, None
    try:
        storage = t.untyped_storage()._cdata
        for i, x in enumerate(leaves):
            if (
                isinstance(x, torch.Tensor) and type(x) is not LazyTensor and x.dtype == t.dtype
                and x.untyped_storage()._cdata == storage
            ):
                return i, (tuple(t.shape), t.stride(), t.storage_offset())
    except (RuntimeError, NotImplementedError):  # no storage (sparse, nested)
        pass
    return None


def _view(x: torch.Tensor, view: tuple) -> torch.Tensor:
    shape, stride, offset = view
    return x.detach().as_strided(shape, stride, offset)


class _Views:
    """The views of parameters a taped call's constants are (``weight.t()`` in ``linear``), kept from one
    step to the next while the parameter and its data pointer are the same. Each is dropped with its
    parameter, so a deleted model's memory is not held."""

    def __init__(self) -> None:
        self.entries: dict[int, tuple] = {}

    def get(self, j: int, base: torch.Tensor, view: tuple) -> torch.Tensor:
        hit = self.entries.get(j)
        if hit is not None and hit[0]() is base and hit[1] == base.data_ptr():
            return hit[2]
        t = _view(base, view)
        self.entries[j] = (weakref.ref(base, lambda _, j=j: self.entries.pop(j, None)), base.data_ptr(), t)
        return t


@attrs.define(eq=False, frozen=True)
class _Seq:
    """A tuple, list or named tuple (``torch.return_types.max``) a taped call returned."""

    kind: type
    items: tuple


def _out_spec(out: Any, leaves: list, session: _Session) -> Any:
    if type(out) is LazyTensor:
        for i, x in enumerate(leaves):
            if x is out:
                return _Arg(i)
        if out._session is not session:
            raise _Unreadable
        with torch._C.DisableTorchFunctionSubclass():
            return _New(out._var, out.shape, out.stride(), out.dtype, out.device, out.requires_grad)
    if out is None:
        return None
    if isinstance(out, (tuple, list)):
        return _Seq(type(out), tuple(_out_spec(x, leaves, session) for x in out))
    raise _Unreadable  # a real tensor or a Python value


_GUARDS = itertools.count()


def _compile_guard(call: _Call) -> Callable:
    """The taped call's match as straight-line Python, as dynamo compiles its guards: each argument
    unpacked (nested lists and tuples too) and compared with the taped one in place; then the constants
    bound, the lazy results made, and the session moved on. Returns the result, or _MISS."""
    key = call.key
    env: dict[str, Any] = {
        "_MISS": _MISS, "LazyTensor": LazyTensor, "Tensor": torch.Tensor, "_weakref": weakref.ref,
        "_make": _make_subclass, "_map_out": _map_out, "call": call, "views": call.views, "_graph_ok": _graph_ok,
    }

    def const(x: Any) -> str:
        name = f"_k{len(env)}"
        env[name] = x
        return name

    base = call.slots_before
    lines = ["def guard(session, args, kwargs):", f"    slots = session.slots\n    if len(slots) != {base}: return _MISS\n    new = []"]
    pos = 1  # the next element of the key

    def take(source: str) -> None:
        # The key element at ``pos`` against the argument ``source`` evaluates to; as local x<pos>.
        nonlocal pos
        k, x = key[pos], f"x{pos}"
        pos += 1
        lines.append(f"    {x} = {source}")
        kind = type(k)
        if kind is tuple:  # a nested list or tuple: (type, length), then its items
            lines.append(f"    if type({x}) is not {const(k[0])} or len({x}) != {k[1]}: return _MISS")
            for j in range(k[1]):
                take(f"{x}[{j}]")
        elif kind is Var:
            lines.append(
                f"    if type({x}) is not LazyTensor or {x}._var is not {const(k)} or {x}._session is not session"
                f" or {x}._shadow is not None: return _MISS"
            )
        elif kind is _Real:
            lines.append(f"    if type({x}) is LazyTensor or not isinstance({x}, Tensor): return _MISS")
            if k.same:
                other = f"slots[{k.slot}]" if k.slot < base else f"new[{k.slot - base}]"
                lines.append(f"    if {x} is not {other}: return _MISS")
            else:
                shape, stride, dtype, device, requires_grad = k.meta
                lines.append(
                    f"    if {x}.shape != {const(shape)} or {x}.dtype is not {const(dtype)} or {x}.stride() != {stride!r}"
                    f" or {x}.device != {const(device)} or {x}.requires_grad is not {requires_grad!r}: return _MISS"
                )
                lines.append(f"    new.append({x})")
                if k.graph is not None:
                    lines.append(f"    if not _graph_ok(session, {x}, {const(k.graph)}, new, {base}, {k.slot}): return _MISS")
                elif requires_grad:  # a leaf (a parameter)
                    lines.append(f"    if {x}.grad_fn is not None: return _MISS")
        elif k is None or kind is bool:
            lines.append(f"    if {x} is not {k!r}: return _MISS")
        else:
            lines.append(f"    if type({x}) is not {const(kind)} or {x} != {const(k)}: return _MISS")

    nargs = key[0]
    lines.append(f"    if len(args) != {nargs}: return _MISS")
    for i in range(nargs):
        take(f"args[{i}]")
    names = key[pos] if pos < len(key) else ()
    pos += 1
    lines.append(f"    if len(kwargs) != {len(names)}: return _MISS")
    for name in names:
        take(f"kwargs.get({name!r}, _MISS)")
    lines.append("    if new: slots.extend(new)")
    if call.consts:
        lines.append("    consts = session.consts")
    for j, (var, i, view) in enumerate(call.consts):
        lines.append(f"    consts[{const(var)}] = {f'x{i}' if view is None else f'views.get({j}, x{i}, {const(view)})'}")
    for i, var in call.mutated:
        lines.append(f"    x{i}._var = {const(var)}\n    session.alive[{const(var)}] = _weakref(x{i})")
    lines.append(f"    session.cursor += {call.nsteps}\n    session.end += {call.neqns}\n    session.tape_pos += 1")
    out = call.out
    if type(out) is _New:
        lines.append(
            f"    t = _make(LazyTensor, {const(out.shape)}, strides={out.stride!r}, dtype={const(out.dtype)},"
            f" device={const(out.device)}, requires_grad={out.requires_grad!r})\n"
            f"    t._var = {const(out.var)}\n    t._session = session\n    t._express = True\n"
            f"    session.alive[{const(out.var)}] = _weakref(t)\n    return t"
        )
    elif type(out) is _Arg:
        lines.append(f"    return x{out.index}")
    else:
        leaves = ", ".join(f"x{i}" if type(k) is not tuple and i else "None" for i, k in enumerate(key))
        lines.append(f"    return _map_out(call.out, [{leaves}], session._express_out)")
    source = "\n".join(lines) + "\n"
    filename = f"<stagetorch guard {next(_GUARDS)}: {getattr(call.func, '__name__', call.func)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), env)  # noqa: S102 - code generated from the tape
    return env["guard"]


def _graph_ok(session: _Session, x: torch.Tensor, graph: _Graph, new: list, base: int, slot: int) -> bool:
    """Whether the autograd graph behind real argument ``x`` is the taped one (node types, saved values,
    leaves: the same tensor where the tape had one, the same metadata where it took a new one). Its new
    leaves are appended to ``new``, the slots the guard is about to take."""
    leaves, kinds, nodes = _autograd_graph([x])
    if kinds != graph.kinds or len(leaves) != len(graph.leaves) or session._saved_state(nodes)[0] != graph.saved:
        return False
    slots = session.slots
    for leaf, (s, same, meta) in zip(leaves, graph.leaves):
        if same:
            if (slots[s] if s < base else new[s - base]) is not leaf:
                return False
        elif s != base + len(new) or _meta(leaf) != meta or leaf.grad_fn is not None:
            return False
        else:
            new.append(leaf)
    session.graph_nodes[slot] = nodes
    return True


def _only_args(spec: Any) -> bool:
    if type(spec) is _Seq:
        return bool(spec.items) and all(_only_args(x) for x in spec.items)
    return type(spec) is _Arg


def _map_out(spec: Any, leaves: list, make: Any) -> Any:
    kind = type(spec)
    if kind is _New:
        return make(spec)
    if kind is _Arg:
        return leaves[spec.index]
    if kind is _Seq:
        return spec.kind([_map_out(x, leaves, make) for x in spec.items])
    return spec


def _unshadow(tree: Any) -> Any:
    """``tree`` with each lazy tensor the express replay made replaced by its shadow."""
    return map_leaves(tree, LazyTensor, lambda t: t if t._shadow is None else t._shadow)


def _refuse_stranded(args: tuple, kwargs: dict) -> None:
    outputs = kwargs.get("outputs", args[0] if args else ())
    roots = [t for t in flatten(outputs) if isinstance(t, torch.Tensor)]
    with torch._C.DisableTorchFunctionSubclass():
        if any(type(t) is LazyTensor and t._express for t in _autograd_graph(roots)[0]):
            raise NotImplementedError(
                "stagetorch.lazy: torch.autograd.grad over a torch.autograd.Function that this step called "
                "and the step stagetorch recorded did not: call loss.backward() instead, or apply the Function "
                "in every step"
            )


def _session_of(args: tuple, kwargs: dict) -> _Session | None:
    for x in args:
        if type(x) is LazyTensor:
            return x._session
    for x in flat_call(args, kwargs):
        if type(x) is LazyTensor:
            return x._session
    return None


# Ops that need a value: evaluate the inputs, then run the op on real tensors.
_CONCRETE = {_aten._local_scalar_dense.default, _aten.item.default}

# Torch functions lazy tensors handle themselves; every other one is a call on lazy tensors (taped, or
# replayed from a tape).
_SPECIAL = {
    # Metadata: the lazy tensor has it; nothing is recorded.
    **dict.fromkeys([
        torch.Tensor.shape.__get__, torch.Tensor.size, torch.Tensor.dim, torch.Tensor.ndim.__get__,
        torch.Tensor.dtype.__get__, torch.Tensor.device.__get__, torch.Tensor.layout.__get__, torch.Tensor.__len__,
        torch.Tensor.requires_grad.__get__, torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.stride,
        torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.is_contiguous,
        torch.Tensor.element_size, torch.Tensor.is_cuda.__get__, torch.Tensor.is_cpu.__get__,
        torch.Tensor.is_sparse.__get__, torch.Tensor.is_quantized.__get__, torch.Tensor.is_meta.__get__,
        torch.Tensor.get_device, torch.Tensor.__hash__, torch.Tensor.ndimension, torch.Tensor.dim_order,
        torch.Tensor.is_signed, torch.Tensor.is_inference,
    ], "meta"),
    **dict.fromkeys([
        getattr(torch.Tensor, name).__get__ for name in (
            "is_nested", "is_mkldnn", "is_sparse_csr", "is_xpu", "is_mps", "is_ipu", "is_xla", "is_vulkan",
            "is_maia", "is_mtia", "itemsize", "nbytes", "_has_symbolic_sizes_strides",
        ) if hasattr(torch.Tensor, name)  # the list differs between torch versions
    ], "meta"),
    # Python-level reads: the tensor is evaluated and the read runs on its real value.
    **dict.fromkeys([
        torch.Tensor.__repr__, torch.Tensor.__str__, torch.Tensor.__format__, torch.Tensor.tolist,
        torch.Tensor.numpy, torch.Tensor.__array__, torch.Tensor.__float__, torch.Tensor.__int__,
        torch.Tensor.__bool__, torch.Tensor.__index__, torch.Tensor.item, torch.Tensor.__reduce_ex__,
    ], "read"),
    torch.Tensor.backward: "backward",
    torch.autograd.backward: "backward",
    **dict.fromkeys([
        torch.Tensor.register_hook, torch.Tensor.retain_grad, torch.Tensor.grad_fn.__get__,
        torch.Tensor.register_post_accumulate_grad_hook,
    ], "autograd"),
}


class LazyTensor(torch.Tensor):
    """A ``torch.Tensor`` whose operations are recorded, not run, until a value is needed."""

    _fake: torch.Tensor | None = None
    _var: Var
    _session: _Session
    _express = False  # made by the express replay: no autograd graph behind it
    _shadow: LazyTensor | None = None  # once the session left the express replay: the same value with one

    def value(self) -> torch.Tensor:
        """The real tensor, evaluated (chunked where it is per-example) and memoised."""
        t = self if self._shadow is None else self._shadow
        s = t._session
        if t._var not in s.values:
            s.flush([t._var])
        return s.values[t._var]

    def __repr__(self, **kwargs: Any) -> str:
        return repr(self.value())

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kind = _SPECIAL.get(func)
        kwargs = kwargs or _NO_KWARGS
        if kind is None:
            first = args[0] if args else None
            session = first._session if type(first) is LazyTensor else _session_of(args, kwargs)
            if session is not None:
                if session.express:
                    # The hot path of a replayed step: the tape's next call, if it is this one, matched by its
                    # guard (which makes the lazy results). Anything else leaves the express replay.
                    tape, pos = session.recording.tape, session.tape_pos
                    if pos < len(tape):
                        call = tape[pos]
                        if (
                            (call.func is func or call.func == func) and call.express
                            and call.grad is _grad_enabled() and not _any_autocast()
                        ):
                            out = (call.guard or call.compile_guard())(session, args, kwargs)
                            if out is not _MISS:
                                return out
                    session.leave_express()
                return session.torch_call(func, args, kwargs)
        elif kind == "meta":
            if args and type(args[0]) is LazyTensor and args[0]._shadow is not None:
                args = _unshadow(args)  # autograd state (requires_grad) is the shadow's
        elif kind == "backward":
            roots = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            lazies = [t for t in roots if type(t) is LazyTensor]
            if lazies:
                lazies[0]._session.backward(func, args, kwargs, roots)
                return None
        elif kind == "read":
            return func(*map_leaves(args, torch.Tensor, _real), **kwargs)
        else:  # the user reaches into autograd (a hook, a grad_fn): backward must run through the engine
            for t in flat_call(args, kwargs):
                if type(t) is LazyTensor:
                    if t._session.express:
                        t._session.leave_express()  # the autograd graph is needed
                    t._session.hooked = True
            args, kwargs = _unshadow(args), _unshadow(kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        leaves = flat_call(args, kwargs)
        session = None
        for t in leaves:
            if type(t) is LazyTensor:
                if t._express:
                    raise RuntimeError(
                        f"stagetorch.lazy: {func} reached a lazy tensor without its torch function (under "
                        "torch._C.DisableTorchFunctionSubclass?); call it on the tensor directly"
                    )
                if session is None:
                    session = t._session
                elif t._session is not session:
                    raise ValueError(
                        f"{func} got lazy tensors from two stagetorch.lazy(...) calls; make the tensors one step "
                        "uses in one call: stagetorch.lazy(x, y, batch=0)"
                    )
        return session.call(func, args, kwargs, leaves)


def _lazy_tensor(
    shape: Any, stride: Any, dtype: torch.dtype, device: torch.device, var: Var, session: _Session,
    fake: torch.Tensor | None = None, requires_grad: bool = False,
) -> LazyTensor:
    """A LazyTensor standing for ``var`` of ``session`` (``fake``: its fake tensor while recording)."""
    out = _make_subclass(LazyTensor, shape, strides=stride, dtype=dtype, device=device, requires_grad=requires_grad)
    out._fake, out._var, out._session = fake, var, session
    return out


def _real(t: Any) -> Any:
    return t.value() if isinstance(t, LazyTensor) else t


def lazy(*tensors: torch.Tensor, batch: int = 0, memory_budget: int | str | None = None) -> Any:
    """Make ``tensors`` lazy: the rest of the script runs unchanged, staged and chunked to fit.

    **Arguments**

    - ``tensors``: the batch (inputs, labels), each with its batch along dim ``batch``.
    - ``batch``: the batch dimension.
    - ``memory_budget``: bytes or a string (``"512MiB"``); default: the device's free memory.

    **Returns** one :class:`LazyTensor`, or a tuple of them.
    """
    if not tensors:
        raise ValueError("stagetorch.lazy needs at least one tensor")
    size = None
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"stagetorch.lazy: argument {i} is a {type(t).__name__}, not a tensor")
        ndim = t.ndim
        if not -ndim <= batch < ndim:
            raise ValueError(f"stagetorch.lazy: batch={batch} is out of range for argument {i} with shape {tuple(t.shape)}")
        n = t.shape[batch % ndim]
        if size is None:
            size = n
        elif n != size:
            sizes = sorted({t.shape[batch % t.ndim] for t in tensors})
            raise ValueError(f"stagetorch.lazy: the tensors disagree on the batch size along dim {batch}: {sizes}")
    if size == 0:
        raise ValueError("stagetorch.lazy: the batch is empty")
    session = _Session(tensors, batch, memory_budget, size)
    out, session.lazies = session.lazies, []  # the session keeps no strong reference to a lazy tensor
    return out[0] if len(out) == 1 else tuple(out)

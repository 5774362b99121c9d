"""Recording: each ATen call on lazy tensors is staged on fake tensors by the tracer's :class:`Recorder`,
into the same IR ``jit`` builds; a call that needs a value runs for real on evaluated inputs.

What a session recorded (:class:`_Recording`: its steps, equations, flushes and tape) is kept per input
signature for the next session with the same inputs to replay.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from types import MappingProxyType
from typing import Any

import attrs
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ..errors import ConcretizationError, UnsupportedOpError
from ..ir import Eqn, Var
from ..staging.recorder import Recorder
from ..staging.source import user_frame
from ..transforms import rng
from ..utils import caches
from ..utils.tree import map_leaves
from .autograd_graph import saved_state
from .draws import COUNTED_BY_VALUES, draw_on_stand_ins, draws_from_default
from .mode import Mode
from .tensor import LazyTensor, SessionBase, lazy_tensor, real_value

_aten = torch.ops.aten

@attrs.define(eq=False)
class Out:
    """A lazy result of a recorded call: its variable and the metadata its LazyTensor is made with."""

    var: Var
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device

@attrs.define(eq=False)
class Step:
    """One call that reached lazy tensors: the op, its flattened arguments and its result. ``recorded`` steps
    became an equation; the others (``item``, data-dependent shapes) ran for real on evaluated inputs.
    ``key`` is :func:`replay_key` of the call when it was recorded."""

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
        self.single = type(self.out) is Out

@attrs.define(eq=False)
class Backward:
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

BACKWARD = torch.Tensor.backward  # the func of a Step that marks a backward (its out: a Backward)

@attrs.define(eq=False)
class _Recording:
    """What a session recorded, for the next session with the same inputs to replay instead of re-tracing:
    the steps, the equations, and the executables its flushes built."""

    inputs: list[Var]
    eqns: list[Eqn]
    steps: list[Step] = attrs.field(factory=list)
    # (first, end) -> (the values those equations produce, their inputs from outside);
    # (first, end, outputs) -> the Executable of that flush.
    flushes: dict[tuple, Any] = attrs.field(factory=dict)
    # The torch-level calls that made ``steps`` (tape.Call), for the express replay; None until a session
    # taped them.
    tape: list | None = None
    # False once a call ran inside a Python autograd.Function's forward: apply() builds its graph from the
    # lazy tensors it takes, below any torch function, so they must have theirs (no express replay).
    express: bool = True
    # Sessions in a row that left the express replay (their calls were replayed twice, express then slow);
    # at MAX_LEAVES the express replay is turned off for this recording. A backward replayed express resets it.
    left: int = 0
    # (the tape, a guard per call of it) for the express replay's first check in LazyTensor.__torch_function__
    # (tape.express_guards); made again for another tape.
    guards: tuple | None = None
    # The positions in ``eqns`` of the equations that draw from a default generator (draws.py), and whether
    # a draw outside the lazy tensors came between one of them and the flush that ran it (LayerDrop's
    # ``torch.rand([])``): then every session replaying it takes each draw's numbers when it is called.
    draws: list[int] = attrs.field(factory=list)
    interleaved: bool = False
    # A graph input per draw position: the generator's state the flush sets before that draw.
    draw_states: dict[int, Var] = attrs.field(factory=dict)

# The latest recording per input signature: the step loop of a training script records once. The oldest
# signatures are forgotten first.
RECORDINGS: dict[tuple, _Recording] = {}
caches.on_clear(RECORDINGS.clear)

_MAX_RECORDINGS = 32

def tensor_meta(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.device, t.requires_grad

def replay_key(leaves: list) -> tuple:
    """What a replay compares: the variable of each lazy tensor, the metadata of each real one, values."""
    return tuple([
        x._var if type(x) is LazyTensor else tensor_meta(x) if isinstance(x, torch.Tensor) else x for x in leaves
    ])

def _is_inplace(func: Any) -> bool:
    returns = func._schema.returns
    return bool(returns) and returns[0].alias_info is not None and returns[0].alias_info.is_write

# Ops that need a value: evaluate the inputs, then run the op on real tensors.
CONCRETE = {_aten._local_scalar_dense.default, _aten.item.default}

_FAKE_LOG = logging.getLogger("torch._subclasses.fake_tensor")

_WRITTEN: dict[Any, tuple[tuple[int, str], ...]] = {}  # op -> (position, name) of each argument it writes


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The real tensors the op writes."""
    _writes_real(func, args, kwargs)  # fills _WRITTEN
    out = []
    for i, name in _WRITTEN[func]:
        x = args[i] if i < len(args) else kwargs.get(name)
        for t in x if isinstance(x, (list, tuple)) else (x,):
            if isinstance(t, torch.Tensor) and type(t) is not LazyTensor:
                out.append(t)
    return out


def storage_key(t: torch.Tensor) -> int:
    """What identifies the memory a real tensor writes or reads: its storage (an alias of a parameter the
    recorder bound, and the parameter ``F.embedding(max_norm=...)``'s renorm writes, are two objects over one
    storage), or the object where it has none."""
    storage = t.untyped_storage()
    return storage.data_ptr() if storage.nbytes() else id(t)


def _writes_real(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the op writes a real tensor (``ema.add_(lazy)``, ``bank[:] = lazy``, ``out=``): what the user
    can read of it without a lazy tensor, so it must hold its new value at once."""
    written = _WRITTEN.get(func)
    if written is None:
        arguments = func._schema.arguments
        written = _WRITTEN[func] = tuple(
            (i, a.name) for i, a in enumerate(arguments) if a.alias_info is not None and a.alias_info.is_write
        )
    for i, name in written:
        x = args[i] if i < len(args) else kwargs.get(name)
        for t in x if isinstance(x, (list, tuple)) else (x,):
            if isinstance(t, torch.Tensor) and type(t) is not LazyTensor:
                return True
    return False


class RecordingSteps(SessionBase):
    """Recording: each op on lazy tensors staged on fake tensors by the tracer's recorder, into the session's
    recording; and how far the session is in it."""

    # Draws (draws.py), each a class-level default a session replaces where it draws: ``drawn`` indexes the
    # recording's draws taken at their call or run by a flush; ``draw_states`` maps the position of a draw
    # taken and not run yet to (device, the generator's state at its call); ``expect``: ({device: the state
    # its generator should still be in}, whether the draws were taken) while draws are pending, and from the
    # start of a session that records (a draw outside before its first draw: LayerDrop's first layer).
    drawn = 0
    draw_states: dict[int, tuple[torch.device, torch.Tensor]] = MappingProxyType({})
    expect: tuple | None = None

    @property
    def eqn_count(self) -> int:
        """The equations the session's calls made so far."""
        return self.end if self.mode is not Mode.RECORD else len(self.eqns)

    def draws_due(self) -> None:
        """A call made equations that draw from a default generator: take their numbers now, as eager does
        (a session that records, or one replaying a recording whose draws interleave with draws outside the
        lazy tensors), or note where the generator is, to see at the flush whether it moved meanwhile."""
        recording = self.recording
        positions = recording.draws
        i, end = self.drawn, self.eqn_count
        if i >= len(positions) or positions[i] >= end or self.shard is not None:
            return
        device = rng.device_of(self.eqns[positions[i]])
        if self.mode is not Mode.RECORD and not recording.interleaved:
            if self.expect is None:
                self.expect = ({device: rng.generator_state(device)}, False)
            return
        self.check_generator()
        states = self.draw_states
        if type(states) is not dict:
            states = self.draw_states = {}
        while i < len(positions) and positions[i] < end:
            p = positions[i]
            if p >= self.done:
                e = self.eqns[p]
                device = rng.device_of(e)
                states[p] = (device, rng.generator_state(device))
                draw_on_stand_ins(e, self.values, self.consts)
            i += 1
        self.drawn = i
        if not recording.interleaved:  # (recording: learn whether a draw outside comes before the flush)
            self.expect = ({device: rng.generator_state(device)}, True)

    def check_generator(self) -> None:
        """Whether the generator moved since the draws pending were called (a draw outside the lazy tensors):
        the recording then takes each draw's numbers at its call from now on; where these draws did not, this
        step's numbers are not eager's, and a warning says so."""
        expect, self.expect = self.expect, None
        if expect is None:
            return
        states, taken = expect
        if all(torch.equal(rng.generator_state(device), state) for device, state in states.items()):
            return
        self.recording.interleaved = True
        if not taken and self.drawn < len(self.recording.draws):
            e = self.eqns[self.recording.draws[self.drawn]]
            warnings.warn(
                f"stagetorch.lazy: a random number was drawn outside the lazy tensors (torch.rand, an op on real "
                f"tensors) after {e.prim} at {e.source} was called and before it ran; eager would have drawn that "
                "op's numbers first, so this step's random numbers differ from eager's. The steps after this "
                "one take each op's numbers when it is called, as eager does.",
                RuntimeWarning, stacklevel=2,
            )

    @property
    def step_count(self) -> int:
        """The steps the session's calls made (or replayed) so far."""
        return self.cursor if self.mode is not Mode.RECORD else len(self.recording.steps)

    def _start_recording(self) -> _Recording:
        """A new recording for this session's input signature, in place of the one kept for it."""
        self.recorder = Recorder(FakeTensorMode(allow_non_fake_inputs=True))
        # Where the generators are as the step starts: a draw outside the lazy tensors before the step's first
        # draw (LayerDrop's first layer) marks the recording interleaved (draws_due).
        if self.expect is None:
            devices = {torch.device("cpu"), *(m[3] for m in self.metas if m[3].type == "cuda")}
            self.expect = ({device: rng.generator_state(device) for device in devices}, True)
        self.eqns = self.recorder.eqns
        recording = _Recording([], self.eqns)
        RECORDINGS.pop(self.key, None)
        RECORDINGS[self.key] = recording
        while len(RECORDINGS) > _MAX_RECORDINGS:
            del RECORDINGS[next(iter(RECORDINGS))]
        return recording

    def _add_input(self, i: int, real: torch.Tensor) -> tuple[Var, torch.Tensor]:
        """The recording's input ``i``, with the fake tensor the recorder stages it as."""
        rec = self.recorder
        with rec.fake_mode:
            if self.shard is None:
                fake = rec.fake_mode.from_tensor(real, static_shapes=True)
            else:  # the global batch's input
                shape, stride, dtype, device, _ = self.metas[i]
                fake = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        var = rec.add_input(fake, "arg", f"lazy{i}")
        self.recording.inputs.append(var)
        return var, fake

    def _record_or_run(self, func: Any, args: tuple, kwargs: dict, leaves: list) -> Any:
        """An op on lazy tensors that no replay reuses: record it, or (a value read, a write into a real
        tensor, a data-dependent shape) run it for real."""
        # A write into a real tensor runs now, but not the engine's accumulation into a real .grad: nobody can
        # read that before backward() returns, and its flush runs it.
        if (
            func in CONCRETE or func.overloadpacket in COUNTED_BY_VALUES
            or (_writes_real(func, args, kwargs) and torch._C._current_autograd_node() is None)
        ):
            return self._run_real(func, args, kwargs, leaves)
        try:
            return self._record(func, args, kwargs, leaves)
        except ConcretizationError:
            if self.shard is not None:
                caller = user_frame()
                where = f" at {caller.f_code.co_filename}:{caller.f_lineno}" if caller is not None else ""
                raise UnsupportedOpError(
                    f"stagetorch.lazy(process_group=): {func}{where} needs the values of its input to know its result's "
                    "shape (x[x > 0], nonzero); each rank holds only its own examples, so it would run on this "
                    "rank's rows, not the global batch's.\nWhat to do: keep the shape with torch.where or a mask "
                    "(loss * mask), or run this part outside the lazy step."
                ) from None
            # A data-dependent shape (x[x > 0], nonzero): evaluate the inputs and run this op for real.
            return self._run_real(func, args, kwargs, leaves)

    def _record_call(self, func: Any, args: tuple, kwargs: dict, src: Any = None) -> Any:
        """Record one call on fakes; the real tensors it lifted become this session's constants."""
        rec = self.recorder
        n_consts, n_eqns = len(rec.consts), len(rec.eqns)
        # A fake kernel that fails (a wrong shape) logs its traceback before the tracer's ShapeError says it
        # better, with the user's line; jit's trace silences it the same way.
        disabled, _FAKE_LOG.disabled = _FAKE_LOG.disabled, True
        try:
            out = rec.record(func, args, kwargs, src=src)
        finally:
            _FAKE_LOG.disabled = disabled
        for k in range(n_eqns, len(rec.eqns)):
            if draws_from_default(rec.eqns[k]):
                self.recording.draws.append(k)
        for t in rec.consts[n_consts:]:
            var = rec.const_vars[id(t)]
            self.consts[var] = t
            self.versions[var] = t._version
        return out

    def _record(self, func: Any, args: tuple, kwargs: dict, leaves: list) -> Any:
        rec = self.recorder
        out = self._record_call(func, map_leaves(args, torch.Tensor, self._unwrap), map_leaves(kwargs, torch.Tensor, self._unwrap))
        self.draws_due()
        out_spec = map_leaves(out, torch.Tensor, lambda f: Out(rec.var(f), f.shape, f.stride(), f.dtype, f.fake_device))
        inplace = _is_inplace(func)
        consts = self._consts_in(leaves)
        self.recording.steps.append(Step(func, replay_key(leaves), consts, out_spec, True, inplace))
        versions = self.versions
        for i, var in consts:  # a constant bound before the last flush is bound again, as it is now
            if var is not None and var not in versions:
                versions[var] = leaves[i]._version
        if inplace and type(args[0]) is not LazyTensor and isinstance(args[0], torch.Tensor):
            # In place on a real tensor (autograd accumulating into a real .grad): its new value is that
            # tensor too, once the flush has run the op. Autograd bumps its version for the write now.
            self.consts[rec.var(out)] = args[0]
            self.versions.pop(rec.const_vars.get(id(args[0])), None)
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
        if self.mode is Mode.RECORD:
            self.recording.steps.append(Step(func, replay_key(leaves), self._consts_in(leaves), None, False, False))
        if func not in CONCRETE:
            self._flush_before_write({storage_key(t) for t in _written(func, args, kwargs)}, args, kwargs)
        return func(*map_leaves(args, torch.Tensor, real_value), **map_leaves(kwargs, torch.Tensor, real_value))

    def _flush_before_write(self, written: set[int], args: tuple, kwargs: dict) -> None:
        """Before a write into real tensors (their :func:`storage_key`\\ s ``written``; or a data-dependent
        shape): everything recorded
        before it runs first, so what it read is the old value, as in eager. Where no pending equation reads a
        tensor it writes (``torch.zeros(E).scatter_add_(0, experts, mask)``), the flush may compute only the
        values the op reads (see flush's ``needed``)."""
        needed = None
        consts = self.consts  # (session.reads_any, here: this module sits below the session's)
        if not any(
            v in consts and storage_key(consts[v]) in written for e in self.eqns[self.done : self.eqn_count] for v in e.invars
        ):
            needed = []

            def need(t: torch.Tensor) -> torch.Tensor:
                if type(t) is LazyTensor:
                    t = t if t._shadow is None else t._shadow
                    if t._session is self and t._var not in needed:
                        needed.append(t._var)
                return t

            map_leaves((args, kwargs), torch.Tensor, need)
        self.flush([], needed=needed)

    def _wrap_fake(self, fake: torch.Tensor) -> LazyTensor:
        var = self.recorder.var(fake)
        out = lazy_tensor(fake.shape, fake.stride(), fake.dtype, fake.fake_device, var, self, fake)
        self.alive[var] = weakref.ref(out)
        return out

    @staticmethod
    def _unwrap(t: torch.Tensor) -> torch.Tensor:
        return t._fake if type(t) is LazyTensor else t

    def _saved_state(self, nodes: list, only: list | None = None) -> tuple[tuple, dict]:
        """:func:`~.autograd_graph.saved_state` of ``nodes``: autograd unpacking a saved lazy tensor calls
        ``detach`` on it, which :meth:`call` answers with an alias while ``reading_saved``, not a step."""
        self.reading_saved = True
        try:
            return saved_state(nodes, only)
        finally:
            self.reading_saved = False

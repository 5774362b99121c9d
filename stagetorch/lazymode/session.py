"""The session: what one ``lazy(...)`` call made (its lazy inputs, the recording it records or replays, the
real values kept) and its flush, which runs the pending equations through the same
:class:`~stagetorch.runtime.executable.Executable` that ``jit`` uses. :func:`lazy` starts one.

Why one module of ~950 lines: it is the top of the session's class chain (``SessionBase`` < ... <
``BackwardSkip`` < ``_Session``), and its methods (the flush, the peeks a host read makes, the draws a flush
replays) share the session's state and call each other; split across modules they would be mixins calling
each other's private methods, which the chain's order (tests/core/test_imports.py) exists to prevent.
"""

from __future__ import annotations

import functools
import itertools
import operator
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, overload

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..devices.budget import free_memory
from ..errors import (
    BatchCouplingError,
    BatchShapeError,
    ConcretizationError,
    ModifiedInputError,
    NotATensorError,
    StagingError,
    front_end,
)
from ..interpreters.batching import Batched
from ..interpreters.flops import graph_flops
from ..ir import Eqn, Graph, Var, op_name
from ..parallel import fsdp
from ..planning import budget as margin
from ..runtime.executable import Executable
from ..runtime.grads import accumulate_grad
from ..staging.recorder import Recorder
from ..staging.source import user_frame
from ..transforms import rng
from ..transforms.schedule import draws_random, writes
from ..utils.tree import flat_call
from . import mode as _mode
from . import shard
from .backward import BackwardSkip
from .mode import Mode
from .recording import RECORDINGS
from .shard import LazyShard
from .tape import Call, express_guards, has_contiguous_strides
from .tensor import LazyTensor, lazy_tensor, make_subclass

__all__ = ["lazy"]


_BATCH_NORM_FORWARD = torch.nn.modules.batchnorm._BatchNorm.forward.__code__

# Global switches that select kernels (and so results, or whether an op may run at all): a step under other
# settings is another program, recorded for them, as eager would run other kernels.
_KERNEL_SWITCHES = [
    getattr(torch._C, name) for name in (
        "_get_deterministic_algorithms", "_get_deterministic_algorithms_warn_only", "_get_cudnn_enabled",
        "_get_cudnn_benchmark", "_get_cudnn_deterministic", "_get_cudnn_allow_tf32", "_get_cublas_allow_tf32",
        "_get_float32_matmul_precision", "_get_mkldnn_enabled", "_get_flash_sdp_enabled",
        "_get_mem_efficient_sdp_enabled", "_get_math_sdp_enabled", "_get_cudnn_sdp_enabled",
        "_get_math_sdp_allow_fp16_bf16_reduction", "_get_overrideable_sdp_enabled",
    ) if hasattr(torch._C, name)  # the list differs between torch versions
]
# Their values as one tuple, read by a generated function of one expression (a comprehension over the list
# cost twice as much: ~1 us more, on every lazy() call).
_kernel_switches = eval(  # noqa: S307 - made from the names above
    compile(
        "lambda: (" + "".join(f"_k{i}(), " for i in range(len(_KERNEL_SWITCHES))) + ")",
        "<stagetorch kernel switches>", "eval",  # (named as the package's generated code: see _skip_under_dynamo)
    ),
    {f"_k{i}": get for i, get in enumerate(_KERNEL_SWITCHES)},
)

_SERIALS = itertools.count()
# A weak reference to each session still reachable (from its lazy tensors).
_LIVE: set[weakref.ref] = set()
# A weak reference to each session that may have calls not yet run: added when a session starts and when a call
# reaches an idle one (tensor.py), dropped by the flush that runs its last call, or with the session. The
# optimizer's hook walks only these: a step loop whose backward() ran everything walks none.
_PENDING: set[weakref.ref] = set()

_EXPRESS, _REPLAY, _RECORD = Mode.EXPRESS, Mode.REPLAY, Mode.RECORD  # module globals: read on every step
_INPUT_LABELS = ("input labels",)


def _gone(ref: weakref.ref) -> None:  # (a reference is hashed while its session lives: found once it died)
    _LIVE.discard(ref)
    _PENDING.discard(ref)


class _Sessions:
    """The sessions still reachable, newest or oldest first as the caller sorts them (tests look at them)."""

    def __iter__(self) -> Iterator[_Session]:
        return iter([s for ref in list(_LIVE) if (s := ref()) is not None])

    def __len__(self) -> int:
        return sum(1 for ref in list(_LIVE) if ref() is not None)


_SESSIONS = _Sessions()

# Whether FSDP2's units refuse lazy tensors (fsdp.guard_calls): set by the first session once FSDP2 is imported.
_fsdp_guarded = False


def _refuse_lazy_inputs(unit: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """A ``fully_shard``-ed module called on lazy tensors: refused before FSDP2's hooks gather anything."""
    if _LIVE and any(type(t) is LazyTensor for t in flat_call(args, kwargs)):
        fsdp.refuse_lazy(unit)


def _guard_fsdp_units() -> None:
    global _fsdp_guarded
    _fsdp_guarded = fsdp.guard_calls(_refuse_lazy_inputs)


def _flush_before_optimizer_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    """An optimizer step changes parameters in place: lazy work recorded before it that reads them ran, in
    eager, on their old values, so it runs first (a metric computed with the model, read after the step)."""
    if not _PENDING:
        return
    params = None
    for ref in list(_PENDING):
        session = ref()
        # A session whose flush failed was abandoned with its error (a retry with a larger budget is another
        # session, which may hold the same work): it is not run behind the user's back. Its pending calls
        # bound the parameters' versions, so reading one of its values after this step raises
        # ModifiedInputError rather than compute with the new parameters.
        if session is None or session.failed:
            continue
        if session.eqn_count == session.done:
            session.idle()
            continue
        if params is None:
            params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if session.reads_any(params):
            session.flush([])


register_optimizer_step_pre_hook(_flush_before_optimizer_step)


def _as_lazy(flush: Callable) -> Callable:
    """``flush``, whose errors name ``lazy``'s keywords (``batch=``, not ``jit``'s ``batch_dim=``); a flush for a
    value the script reads mid-step (``needed``) that no budget runs names the smallest budget of the part of
    the step up to that read only, and says so: the rest (the backward) is not recorded yet."""

    @functools.wraps(flush)
    def flushing(session: Any, targets: list, leaves: Any = (), grads: Any = None, needed: Any = None) -> None:
        with front_end("lazy"):
            if not needed:
                return flush(session, targets, leaves, grads, needed)
            try:
                return flush(session, targets, leaves, grads, needed)
            except StagingError as e:
                if e.smallest_budget is None:
                    raise
                frame = user_frame()
                where = f" at {frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else ""
                raise type(e)(
                    f"{e}\nThe smallest budget named runs only the part of the step up to a value it reads while it runs{where} "
                    "(a mask check, an .item(), a Python if on a tensor): the rest of the step, its backward "
                    "included, is not recorded yet and is planned when the script reaches it; it usually needs "
                    "more. What to do: raise memory_budget past what the whole step needs (stagetorch.memory "
                    "says it for a function of the step), or read no value mid-step."
                ).copy_from(e) from e

    return flushing


class _Session(BackwardSkip):
    """What one ``lazy(...)`` call records: the equations, which of them have run, and the values kept.

    Its :class:`~.mode.Mode` says what it does with each call. A session either *records* (each op runs on
    fake tensors through the tracer's recorder) or *replays* the recording of an earlier session with the same inputs: while each call is the same op on the same
    variables, the same constants' metadata and the same Python values as the recorded step at that
    position, the session reuses the step (no fake kernel runs) and, at a flush, the executable built for
    it. The first call that differs switches the session to recording: the steps replayed so far are
    recorded again on fakes, and it goes on from there.

    Above that, a session replaying a taped recording starts *express* (in ``LazyTensor.__torch_function__``):
    calls are matched against the tape and not run until one is not the tape's next (:meth:`leave_express`).

    Its layers, each a subclass of the one below: ``tensor.SessionBase`` (what a lazy tensor asks of it),
    ``recording.RecordingSteps``, ``replay.SlowReplay``, ``express.ExpressReplay``, ``backward.BackwardSkip``,
    and this class (its state, the flush). A layer calls down, or up only through a method declared below.
    """

    mode: Mode  # what the session does with each call; it only moves down, EXPRESS to REPLAY to RECORD
    done = 0  # equations before this index have run
    # (Class-level defaults, replaced by the session's own where it has any: a step's hot path makes none.)
    counted: list[torch.Tensor] | tuple = ()  # BatchNorm counters the step's Python code added one to
    failed = False  # its last flush raised: nothing runs it implicitly (see _flush_before_optimizer_step)
    made: Mapping[Var, Batched] = MappingProxyType({})  # batch labels of per-example values earlier flushes made
    hooked = False  # a hook or grad_fn was reached: backward always runs the autograd engine
    freed: frozenset[Var] = frozenset()  # losses whose backward ran (the engine would have freed their graph)
    reading_saved = False  # reading what autograd saved: calls are not steps
    recorder: Recorder | None = None
    # Express replay (see Call): the torch-level calls this session tapes, or replays without running them.
    tape: list[Call] | None = None  # the tape this session appends to
    tape_pos = 0  # the next call of the tape to replay
    shadowed = False  # the lazy tensors the express replay made have shadows: calls take those instead

    def __init__(
        self, tensors: tuple[torch.Tensor, ...], batch: int, memory_budget: int | str | None, size: int,
        shard: LazyShard | None = None, remat: bool = True,
    ):
        self.batch = size
        self.memory_budget = memory_budget
        self.remat = remat
        # With a process group the lazy tensors stand for the global batch; the real values are the shard's.
        self.shard = shard
        metas = self.metas = (
            [(t.shape, t.stride(), t.dtype, t.device, t.requires_grad) for t in tensors]  # tensor_meta, inline
            if shard is None else shard.metas(tensors, batch)
        )
        # The key: grad mode tells a training step from an evaluation step on batches of the same shape (a
        # loop that alternates them would otherwise re-record each time).
        self.key = (
            batch, torch.is_grad_enabled(), tuple(metas), _kernel_switches(), shard is None
        )
        values: dict[Var, torch.Tensor] = {}
        self.values = values  # real values of vars, inputs included
        self.consts: dict[Var, torch.Tensor] = {}  # the real tensors recorded calls read
        # The version counter of each constant when a call that has not run yet bound it: an in-place change
        # before the flush would make that call read a value it never saw (see _check_versions).
        self.versions: dict[Var, int] = {}
        alive: dict[Var, weakref.ref] = {}
        self.alive = alive
        lazies: list[LazyTensor] = []
        self.lazies = lazies
        self.slots: list[torch.Tensor] = []  # the real tensors the session's calls took, in order
        self.slot_ids: dict[int, int] = {}
        self.graph_nodes: dict[int, list] = {}  # slot of a real argument with a graph -> its nodes, walked
        limit = _mode._cap  # cap(), inline
        replaying = RECORDINGS.get(self.key) if limit >= _REPLAY else None
        # Inputs that require grad have an autograd graph the tape cannot reproduce: never express.
        # The express replay makes lazy tensors from the real inputs' metadata, a shard's not the global batch's.
        taping = limit >= _EXPRESS and shard is None
        for m in metas:
            if m[4]:
                taping = False
        if replaying is not None:
            self.mode = _REPLAY
            self.recording = replaying
            self.eqns = replaying.eqns
            self.cursor = 0  # the next step to replay
            self.end = 0  # equations replayed so far
            inputs = replaying.inputs
            tape = replaying.tape
            if tape is None and taping:
                self.tape = replaying.tape = []
            if taping and tape and tape[0].express and replaying.express:
                self.mode = _EXPRESS
                self.guards = express_guards(replaying, tape)
        else:
            self.mode = _RECORD
            self.recording = self._start_recording()
            if taping:
                self.tape = self.recording.tape = []
        self.ref = ref = weakref.ref(self, _gone)
        _LIVE.add(ref)
        _PENDING.add(ref)
        if not _fsdp_guarded:
            _guard_fsdp_units()
        self.serial = next(_SERIALS)  # newer sessions have larger ones
        refs: list[weakref.ref] = []
        self.input_refs = refs
        if replaying is not None:
            # A replayed step's hot path, where each call saved is measurable: the inputs' variables and batch
            # labels are the recording's, the same each step; lazy_tensor inline.
            labels = replaying.flushes.get(_INPUT_LABELS)
            if labels is None:
                labels = _input_labels(replaying, batch, metas)
            self.batched, contiguous = labels
            for t, var, (shape, stride, dtype, device, requires_grad), plain in zip(tensors, inputs, metas, contiguous):
                if plain is _PLAIN:  # contiguous, on the host, no grad: the constructor's defaults (parsed faster)
                    values[var] = t
                    lazy_t = make_subclass(LazyTensor, shape, dtype=dtype)
                    lazy_t._var, lazy_t._session, lazy_t._express, lazy_t._fake, lazy_t._shadow = var, self, False, None, None
                    alive[var] = ref = weakref.ref(lazy_t)
                    refs.append(ref)
                    lazies.append(lazy_t)
                    continue
                values[var] = t.detach() if requires_grad else t  # the value, without its autograd graph
                if plain:  # (contiguous strides: what the constructor makes without them, parsed faster)
                    lazy_t = make_subclass(LazyTensor, shape, dtype=dtype, device=device, requires_grad=requires_grad)
                else:
                    lazy_t = make_subclass(LazyTensor, shape, strides=stride, dtype=dtype, device=device, requires_grad=requires_grad)
                lazy_t._fake, lazy_t._var, lazy_t._session, lazy_t._express, lazy_t._shadow = None, var, self, False, None
                alive[var] = ref = weakref.ref(lazy_t)
                refs.append(ref)
                lazies.append(lazy_t)
            return
        batched = self.batched = {}
        for i, (t, (shape, stride, dtype, device, requires_grad)) in enumerate(zip(tensors, metas)):
            real = t.detach() if requires_grad else t
            var, fake = self._add_input(i, real)
            values[var] = real
            batched[var] = Batched(batch % len(shape))
            lazy_t = lazy_tensor(shape, stride, dtype, device, var, self, fake, requires_grad)
            alive[var] = ref = weakref.ref(lazy_t)
            refs.append(ref)
            lazies.append(lazy_t)

    def pending(self) -> None:
        self.ran_all = False
        _PENDING.add(self.ref)

    def idle(self) -> None:
        """Every call so far has run: the optimizer's hook need not look at the session until the next."""
        self.ran_all = True
        _PENDING.discard(self.ref)

    def count_batch(self, depth: int = 3) -> None:
        """BatchNorm's forward (training) added one to ``num_batches_tracked`` before calling batch_norm on
        lazy tensors: a flush that fails takes it back, so a failed step leaves the buffers as they were.
        ``depth``: frames from here to ``F.batch_norm`` (3 from ``LazyTensor.__torch_function__``)."""
        frame = sys._getframe(depth)
        for _ in range(4):  # batch_norm, called from _BatchNorm.forward (a subclass's forward in between)
            if frame is None:
                return
            if frame.f_code is _BATCH_NORM_FORWARD:
                module = frame.f_locals.get("self")
                counter = getattr(module, "num_batches_tracked", None)
                if module.training and isinstance(counter, torch.Tensor):
                    self.counted = [*self.counted, counter]
                return
            frame = frame.f_back

    def _take_back(self) -> None:
        """A flush failed: what the step's Python code counted before it is taken back."""
        counted, self.counted = self.counted, ()
        with torch.no_grad():
            for counter in counted:
                counter.sub_(1)

    def reads_any(self, ids: set[int]) -> bool:
        """Whether an equation that has not run reads a constant whose id is in ``ids``."""
        consts = self.consts
        return any(
            v in consts and id(consts[v]) in ids for e in self.eqns[self.done : self.eqn_count] for v in e.invars
        )

    def _reads_little(self, needed: list[Var], end: int) -> bool:
        """Whether a mid-step read (``needed``) depends on a small part of the pending work: at most
        1/``_LITTLE`` of its FLOPs, drawing no random numbers. Then only that part runs (:meth:`_peek`) and the
        rest stays pending, to run with the backward as one program, chunked as ``jit`` chunks the step. The
        whole flush would hold every value autograd saved so far, the whole batch's, through the flush after
        it (T5's decoder checks the encoder's attention mask after the encoder ran: its activations, held
        whole, left no room for one example of the backward at ``jit``'s budget). A random op is never peeked:
        it would draw again at the flush. Kept per recording and span."""
        key = ("little", self.done, end, tuple(needed))
        flushes = self.recording.flushes
        answer = flushes.get(key)
        if answer is None:
            pending = self.eqns[self.done : end]
            own = _ancestors(pending, needed)
            answer = flushes[key] = (
                len(own) < len(pending) and not any(_draws(e) for e in own)
                and _LITTLE * graph_flops(own) <= graph_flops(pending)
            )
        return answer

    def _peeks(self, executable: Executable, device: torch.device) -> bool:
        """Whether a flush that ``needed`` values asked for computes only those (:meth:`_peek`): where the
        whole flush, at this budget, would keep rows each chunk orders its own way. The answer is kept per
        executable and budget (to the planner's 0.4%): a failed plan is not, and planning it again at each
        mid-step write of every step cost more than the peek (two writes of a 2-layer Mixtral's router loss,
        ~12 ms each, where its peeks take ~1 ms). Either answer gives the same values: peeking is exact too."""
        budget = max(free_memory(device, self.memory_budget) - executable.restore_bytes, 0)
        key = ("peeks", id(executable), margin.bucket(budget))  # (flushes holds the executable too)
        flushes = self.recording.flushes
        answer = flushes.get(key)
        if answer is None:
            try:
                executable.plan(budget)
                answer = False
            except StagingError as e:
                # anything else is raised, and handled, by the flush's run
                answer = bool(getattr(e, "chunk_local_result", False))
            flushes[key] = answer
        return answer

    # The previous peek of this step: its key and the values it computed for the next one (_PeekSpan.extra),
    # with their batch labels. Valid while no flush ran since (its key holds the flush it started from).
    peek_kept: tuple | None = None

    def _peek(self, needed: list[Var]) -> None:
        """Compute ``needed`` from the equations not yet run that it depends on, chunked within the budget,
        without running the flush: every equation stays pending and runs again at the next flush. The values
        an op run for real mid-step reads are per-example or reduced, so this program chunks where the whole
        flush, keeping an MoE layer's sorted rows for the backward, could not.

        Peeks in a row (one per MoE layer: each layer's router counts) would each compute the step from the
        last flush, the layers before theirs again. Once a peek has been seen after another, the earlier one
        also keeps the values the later one reads from its equations (the hidden states between them), and
        the later one computes only the equations the earlier did not."""
        end = self.eqn_count
        flushes = self.recording.flushes
        key = ("peek", self.done, end, tuple(needed), self.remat)
        span = flushes.get(key)
        if span is None:
            span = flushes[key] = _PeekSpan(_ancestors(self.eqns[self.done : end], needed), list(needed))
        kept, self.peek_kept = self.peek_kept, None
        # (A peek of the recording this session replayed before it diverged is not this recording's.)
        before = kept[0] if kept is not None and kept[0][1] == self.done and kept[0] in flushes else None
        if before is not None and span.follows is None and not span.alone:
            _learn_chain(flushes[before], before, span, key)
        after = before is not None and before == span.follows and kept[1] is not None
        kept_values, kept_labels = (kept[1], kept[2]) if after else ({}, {})
        built = span.built.get((after, span.extra))
        if built is None:
            eqns = span.tail if after else span.eqns
            made = {v for e in eqns for v in e.outvars if v is not None}
            invars: list[Var] = []
            for e in eqns:
                for v in e.invars:
                    if v not in made and v not in invars:
                        invars.append(v)
            labels = {**self.batched, **self.made, **kept_labels}  # (no process group: flush peeks only without one)
            roles = ["arg" if v in labels else "const" for v in invars]
            graph = Graph(invars, eqns, [*needed, *span.extra], roles, [""] * len(invars))
            batched = {v: b for v, b in labels.items() if v in invars}
            executable = Executable(graph, batched, self.batch, remat=self.remat)
            device = next((v.aval.device for v in executable.batched), torch.device("cpu"))
            built = span.built[(after, span.extra)] = [executable, device, invars, None]
        executable, device, invars, labels_out = built
        values, consts = self.values, self.consts
        inputs = [kept_values[v] if v in kept_values else values[v] if v in values else consts[v] for v in invars]
        if self.versions:
            self._check_versions(invars)
        budget = free_memory(device, self.memory_budget, executable.resident_bytes(inputs))
        try:
            plan = executable.planner.plan_call(budget, *executable.restoring, inputs)
        except StagingError:
            if not span.extra:
                raise
            # The values kept for the next peek do not chunk (rows each chunk orders its own way): not kept.
            span.extra, span.alone = (), True
            flushes[span.next].follows = None
            flushes[span.next].alone = True
            self.peek_kept = kept
            self._peek(needed)
            return
        if self.draw_states:
            # Draws taken at their call are drawn again at the flush, from their states: the generator is
            # where eager leaves it, and the peek's draws do not move it.
            found = {d: rng.generator_state(d) for d, _ in self.draw_states.values()}
            try:
                results, _ = executable.run(inputs, plan, name="lazy")
            finally:
                for d, state in found.items():
                    rng.set_generator_state(d, state)
        else:
            results, _ = executable.run(inputs, plan, name="lazy")
        for v, x in zip(needed, results):
            values[v] = x
        if span.extra:
            if labels_out is None:  # after its first run: an executable learns about its inputs there
                labels_out = built[3] = _per_example_outputs(executable)
            extra = dict(zip(span.extra, results[len(needed) :]))
            self.peek_kept = (key, extra, {v: b for v, b in labels_out.items() if v in extra})
        else:
            self.peek_kept = (key, None, None)

    def _ran_draws(self, end: int) -> None:
        """A flush ran the equations before ``end``: their draws are done with."""
        positions, i = self.recording.draws, self.drawn
        while i < len(positions) and positions[i] < end:
            i += 1
        self.drawn = i
        states = self.draw_states
        if states:
            for p in [p for p in states if p < end]:
                del states[p]
        self.expect = None

    def _run_drawn(self, built: tuple, span: _FlushSpan, end: int, drawn: list[int], inputs: list, budget: int) -> tuple:
        """Run the flush of ``built`` whose draws at positions ``drawn`` took their numbers at their call (see
        draws.py): whole, each draws again from its state (eager's numbers); in chunks, each chunk draws on
        from where the last left the generator, starting at the first draw's state, as a chunked ``jit`` step
        draws. The generator is set back after: where the calls left it, where eager leaves it. Returns the
        results, the executable that ran and the key of its per-example outputs."""
        flushes = self.recording.flushes
        key = ("drawn", id(built[0]), tuple(drawn))
        drawing = flushes.get(key)
        if drawing is None:
            drawing = flushes[key] = self._drawing(span, end, drawn, built[4])
        states = [self.draw_states[p] for p in drawn]
        found = {d: rng.generator_state(d) for d, _ in states}
        # Held beside the program through the flush (the plan counts them): the generator's state to set back
        # after it, and, where the chunked flush does not take them as inputs, the draws' saved states.
        set_back = sum(_nbytes(s) for s in found.values())
        saved = sum(_nbytes(state) for _, state in states)
        try:
            with_states = [*inputs, *(state for _, state in states)]
            held, why = drawing.restoring
            plan = drawing.planner.plan_call(budget, held + set_back, [*why, _SET_BACK], with_states)
            if len(plan.chunk_sizes) == 1:
                return drawing.run(with_states, plan, name="lazy")[0], drawing, ("made", id(drawing))
            executable = built[0]
            for d in found:
                rng.set_generator_state(d, next(state for device, state in states if device == d))
            held, why = built[6]
            plan = executable.planner.plan_call(budget, held + set_back + saved, [*why, _SET_BACK, _SAVED], inputs)
            return executable.run(inputs, plan, name="lazy")[0], executable, built[8]
        finally:
            for d, state in found.items():
                rng.set_generator_state(d, state)

    def _drawing(self, span: _FlushSpan, end: int, drawn: list[int], outs: tuple) -> Executable:
        """The flush's executable with :class:`~stagetorch.transforms.rng.SetRngState` before each draw at ``drawn``, its
        state an input after the flush's own."""
        recording = self.recording
        eqns, states = [], []
        maker: dict[Var, Eqn] = {}
        for p in range(self.done, end):
            e = self.eqns[p]
            if p in drawn:
                device = rng.device_of(e)
                state = recording.draw_states.get(p)
                if state is None:
                    state = recording.draw_states[p] = Var(rng.SaveRngState.of(device).aval())
                states.append(state)
                eqns.append(Eqn(rng.SetRngState.of(device), (state, *_beside(e, maker)), {}, (), e.source))
            eqns.append(e)
            for v in e.outvars:
                if v is not None:
                    maker.setdefault(v.root, e)
        labels = {**self.batched, **self.made}
        invars = [*span.invars, *states]
        roles = ["arg" if v in labels else "const" for v in invars]
        graph = Graph(invars, eqns, list(outs), roles, [""] * len(invars))
        return Executable(graph, {v: b for v, b in labels.items() if v in invars}, self.batch, remat=self.remat)

    def _check_versions(self, invars: list[Var]) -> None:
        """Raise ModifiedInputError if a real tensor a pending call read was changed in place since."""
        versions, consts = self.versions, self.consts
        for v in invars:
            seen = versions.get(v)
            if seen is None or consts[v]._version == seen:
                continue
            eqn = next(e for e in self.eqns[self.done : self.eqn_count] if v in e.invars)
            raise ModifiedInputError(
                f"stagetorch.lazy: {op_name(eqn.prim)} at {eqn.source} read a real tensor ({v.aval}) that was "
                "changed in place before the op ran (lazy ops run at the next read or backward()), so it would "
                "compute with the new value where eager PyTorch used the old one. Nothing was run or changed.\n"
                "What to do: read the result first (loss.item(), or backward()) and change the tensor after, or "
                "change it before the op."
            )

    def _built(self, flushes: dict, invars: list[Var], end: int, produced: list[Var], outs: tuple) -> tuple:
        """The executable of the flush of equations ``[done, end)`` that outputs ``outs`` (made once per
        recording), its device, its outputs in storage it made, their positions, and ``outs``."""
        key = (self.done, end, outs, self.remat)
        built = flushes.get(key)
        if built is None:
            # Under a process group, per-example values earlier flushes made are batched too (this rank's rows).
            labels = {**self.batched, **(self.made if self.shard is None else self.shard.labels)}
            roles = ["arg" if v in labels else "const" for v in invars]
            graph = Graph(invars, self.eqns[self.done : end], list(outs), roles, [""] * len(invars))
            batched = {v: b for v, b in labels.items() if v in invars}
            # A flush whose examples meet (a contrastive loss over in-batch negatives) is cut there, as jit's
            # step is (planning/cut.py), where nothing else fits; not under a process group, which does not cut.
            # BatchNorm in training is not run in passes here (planning/multipass.py): not tested in this mode.
            executable = Executable(
                graph, batched, self.batch, remat=self.remat, cut_coupled=self.shard is None, passes_coupled=False,
            )
            device = next((v.aval.device for v in executable.batched), torch.device("cpu"))
            # Outputs in storage the flush made (no view of an input): a gradient there is no parameter's.
            made = set(produced)
            fresh = frozenset(v for v in outs if v.root in made)
            # The inputs read from one dict in one call (operator.itemgetter: a tuple, for two or more).
            take = operator.itemgetter(*invars) if len(invars) > 1 else None
            # (Then the positions of the outputs in fresh storage, and the key of the flush's per-example
            # outputs in ``flushes``: each step's flush reads them.)
            built = flushes[key] = (
                executable, device, fresh, {v: i for i, v in enumerate(outs)}, outs, take, executable.restoring,
                {v: i for i, v in enumerate(outs) if v in fresh}, ("made", id(executable)),
            )
        return built

    @_as_lazy
    def flush(
        self, targets: list[Var], leaves: list[torch.Tensor] = (), grads: list | None = None,
        needed: list[Var] | None = None,
    ) -> None:
        """Run every recorded equation not yet run; keep ``targets``, every value still referenced, and the
        lazy gradients autograd stored in the ``.grad`` of ``leaves`` (or the (leaf, Var) pairs ``grads``),
        which become real gradients.

        ``needed``: the values an op run for real mid-step reads. Where the whole flush cannot be chunked
        because a value it would keep has rows each chunk orders its own way (an MoE layer's tokens sorted by
        expert, saved for the backward), only ``needed`` is computed (:meth:`_peek`) and every equation is
        left to the next flush, where those rows are consumed inside the program."""
        mode = self.mode
        done = self.done
        end = len(self.eqns) if mode is _RECORD else self.end  # eqn_count, inline
        if end == done:
            return
        if needed:
            # A value computed already (an input, a value an earlier flush kept, one a peek computed: read
            # twice with work pending between, as Longformer's mask is by `.any().item()` then `.nonzero()`)
            # is not computed again: a peek's program cannot output a value it neither makes nor reads.
            values = self.values
            missing = [v for v in needed if v not in values]
            if not missing:
                return  # the op reads only values computed already, and no pending call reads what it writes
            needed = missing
        if self.expect is not None:
            self.check_generator()
        if grads is None:
            grads = [
                (leaf, leaf.grad._var)
                for leaf in leaves
                if isinstance(leaf.grad, LazyTensor) and leaf.grad._session is self
            ]
        flushes = self.recording.flushes
        span = flushes.get((done, end))
        if span is None:
            span = flushes[(done, end)] = _FlushSpan(self.eqns[done:end])
        values = self.values
        later = None
        if mode is _EXPRESS:
            # No autograd graph holds what the recording's later steps (the backward) read: keep it here.
            # (The recording is complete: an express replay only replays a recorded session's calls.)
            later = span.later
            if later is None:
                later = span.later = frozenset(v for e in self.eqns[end:] for v in e.invars)
                span.read_later = [v for v in span.produced if v in later]
            wanted = set(span.read_later)
        else:
            wanted = set()
        for v in targets:
            if v not in values:
                wanted.add(v)
        # Only what can still be read is kept: the inputs, and values whose lazy tensor is alive.
        alive = {}
        for v, ref in self.alive.items():
            if ref() is not None:
                alive[v] = ref
                if v not in values:
                    wanted.add(v)
        self.alive = alive
        for _, v in grads:
            wanted.add(v)
        # The flush that keeps these values: found by what is wanted (a step loop wants the same each step),
        # else by the outputs that makes (produced, in order, that are wanted). A flush's executable plans
        # with or without recomputation, as the session that built it asked.
        builds = span.remat if self.remat else span.no_remat
        wanted_key = frozenset(wanted)
        built = builds.get(wanted_key)
        if built is None:
            outs = tuple(v for v in span.produced if v in wanted)
            built = builds[wanted_key] = self._built(flushes, span.invars, end, span.produced, outs)
        executable, device, fresh, position, outs, take, held, fresh_position, made_key = built

        consts = self.consts
        try:
            # The inputs: each one's value, else the constant a call bound (a user's value wins).
            inputs = take({**consts, **values}) if take is not None else [
                values[v] if v in values else consts[v] for v in span.invars
            ]
        except KeyError:
            raise ConcretizationError("a lazy value was dropped before it ran; this is a bug in stagetorch.lazy") from None
        batched = self.batched
        if needed and self.shard is None and (self._reads_little(needed, end) or self._peeks(executable, device)):
            self._peek(needed)
            return
        self.peek_kept = None  # (what a peek kept for the next one is not held through the flush)
        kept = {}
        for v, x in values.items():
            if v in alive or v in batched or (later is not None and v in later):
                kept[v] = x
        try:
            versions = self.versions
            if versions:
                # Nothing bound since the last flush changed (the common case: one pass over what was bound);
                # else the exact check, which names the op that read a changed tensor.
                for v, seen in versions.items():
                    t = consts.get(v)
                    if t is not None and t._version != seen:
                        self._check_versions(span.invars)
                        break
            budget = free_memory(device, self.memory_budget, executable.resident_bytes(inputs))
            if self.shard is None:
                # A run copies what the flush updates in place (BatchNorm's statistics), beside the program:
                # the planner plans the program in the budget less those copies (an error names the budget
                # the whole flush fits in).
                drawn = [p for p in self.draw_states if p < end]
                try:
                    if drawn:
                        results, executable, made_key = self._run_drawn(built, span, end, sorted(drawn), inputs, budget)
                    else:
                        plan = executable.planner.plan_call(budget, held[0], held[1], inputs)
                        results, _ = executable.run(inputs, plan, name="lazy")
                except StagingError as e:
                    if getattr(e, "chunk_local_result", False):
                        raise _kept_chunk_local(e) from e
                    raise
                made = flushes.get(made_key)
                if made is None:  # after its first run: an executable learns about its inputs there
                    made = flushes[made_key] = _per_example_outputs(executable)
                if made:
                    self.made = {**self.made, **made}
            else:
                results = shard.run(self.shard, executable, inputs, budget)
        except BaseException:
            self.failed = True
            if self.counted:
                self._take_back()
            raise
        self.failed = False
        if self.recording.draws:
            self._ran_draws(end)
        if end == (len(self.eqns) if self.mode is _RECORD else self.end):
            self.ran_all = True  # idle(), inline
            _PENDING.discard(self.ref)
        self.versions = {}  # nothing pending reads them now; the flush's own in-place writes are the program's
        if self.counted:
            self.counted = ()
        self.done = end
        dropped = False
        for leaf, v in grads:
            grad = leaf.grad
            if grad is None:
                i = fresh_position.get(v)
                if i is not None:
                    x = results[i]
                    if x.stride() == leaf.stride():
                        leaf.grad = x  # accumulate_grad's first case, inline: the hot path (see __init__)
                        continue
            elif type(grad) is LazyTensor:
                # autograd stored the lazy gradient; accumulate the real one as it would have (no reference
                # to the lazy one is left here: the values kept are those whose lazy tensor is alive)
                leaf.grad = grad = None
                dropped = True
            i = position.get(v)
            accumulate_grad(leaf, values[v] if i is None else results[i], fresh=v in fresh)
        if dropped:
            alive = self.alive = {v: ref for v, ref in alive.items() if ref() is not None}
            kept = {v: x for v, x in kept.items() if v in alive or v in batched or (later is not None and v in later)}
        for v, x in zip(outs, results):
            if v in alive or (later is not None and v in later):
                kept[v] = x
        self.values = kept


class _FlushSpan:
    """What the flushes of equations ``[done, end)`` of a recording share: the values they make (in order),
    their inputs (what the user or an earlier flush supplied), and the executables built for it, per set of
    values kept (with recomputation and without). ``later`` (what the recording's later equations read) and
    ``read_later`` (those of its values) are filled in by an express replay's flush."""

    __slots__ = ("produced", "invars", "later", "read_later", "remat", "no_remat")

    def __init__(self, pending: list):
        self.produced = [v for e in pending for v in e.outvars if v is not None]
        made = set(self.produced)
        invars: list[Var] = []
        for e in pending:
            for v in e.invars:
                if v not in made and v not in invars:
                    invars.append(v)
        self.invars = invars
        self.later: frozenset[Var] | None = None
        self.read_later: list[Var] = []
        self.remat: dict[frozenset, tuple] = {}
        self.no_remat: dict[frozenset, tuple] = {}


# An input whose lazy tensor is made with the constructor's defaults but its dtype: contiguous strides, the host
# (its default device, whatever torch.set_default_device says), no grad.
_PLAIN = object()


def _input_labels(recording: Any, batch: int, metas: list) -> tuple[MappingProxyType, list[bool | int]]:
    """The batch labels of a recording's inputs (their batch along dim ``batch``), made once: every session
    that replays it shares them (read only); and whether each input's strides are contiguous ones, or
    ``_PLAIN`` (also on the host, no grad): the sessions that replay it have the same (its key holds them)."""
    labels = recording.flushes.get(_INPUT_LABELS)
    if labels is None:
        labels = recording.flushes[_INPUT_LABELS] = (
            MappingProxyType({var: Batched(batch % len(m[0])) for var, m in zip(recording.inputs, metas)}),
            [_PLAIN if has_contiguous_strides(m[0], m[1]) and m[3].type == "cpu" and not m[4] else has_contiguous_strides(m[0], m[1]) for m in metas],
        )
    return labels


def _kept_chunk_local(error: StagingError) -> BatchCouplingError:
    """``error`` (rows a chunk orders its own way kept as a flush's result) as one-line mode causes it."""
    caller = user_frame()
    where = f" at {caller.f_code.co_filename}:{caller.f_lineno}" if caller is not None else ""
    what = str(error).split("\nWhat to do:")[0]
    return BatchCouplingError(
        f"{what}\nIn one-line mode a flush keeps every value still referenced when it runs (a lazy tensor alive, "
        f"or one saved for backward()): this flush ran{where}, mid-step, and would keep those rows.\n"
        "What to do: read values (.item(), print, a write into a tensor that an op already recorded reads) after "
        "backward() rather than between that layer and it; or give a memory_budget at which this flush runs "
        "whole; or stage the step with stagetorch.jit, where those rows stay inside the program."
    )


def _ancestors(eqns: list, needed: list[Var]) -> list:
    """The equations of ``eqns`` that ``needed`` depends on, in order. An equation that makes a view of (or
    writes into) the storage of a value kept is kept too."""
    want = set(needed)
    roots = {v.root for v in needed}
    keep = []
    for e in reversed(eqns):
        outs = [v for v in e.outvars if v is not None]
        if any(v in want or v.root in roots for v in outs):
            keep.append(e)
            ins = [v for v in e.invars if isinstance(v, Var)]
            want.update(ins)
            roots.update(v.root for v in ins)
    keep.reverse()
    return keep


class _PeekSpan:
    """A peek (:meth:`_Session._peek`) of a recording: the pending equations its values depend on, and, once
    it has been seen right after another peek (``follows``, that one's key), the equations of its own
    (``tail``) it computes from what that one kept. ``extra`` are the values it keeps for the peek that
    follows it (``next``); ``alone``: chaining was tried and refused (a value kept would not chunk, or an
    equation writes into one). ``built``: its executables, per (starting from ``follows``, ``extra``)."""

    def __init__(self, eqns: list, needed: list[Var]):
        self.eqns, self.needed = eqns, needed
        self.follows: tuple | None = None
        self.tail: list = []
        self.extra: tuple = ()
        self.next: tuple | None = None
        self.alone = False
        self.built: dict[tuple, list] = {}


def _learn_chain(before: _PeekSpan, before_key: tuple, span: _PeekSpan, key: tuple) -> None:
    """``span`` ran right after ``before`` (same flush): from the next step on, ``before`` keeps the values
    ``span``'s other equations read from its equations, and ``span`` computes only those others."""
    if before.next is not None or before.alone:
        return  # it keeps values for another peek already
    ours = {id(e) for e in before.eqns}
    tail = [e for e in span.eqns if id(e) not in ours]
    produced = {v for e in before.eqns for v in e.outvars if v is not None}
    extra: list[Var] = []
    for e in tail:
        for v in e.invars:
            if v in produced and v not in extra and v not in before.needed:
                extra.append(v)
    roots = {v.root for v in extra}
    if not extra or len(tail) == len(span.eqns) or any(
        _is_write(e) and any(v is not None and v.root in roots for v in e.outvars) for e in (*before.eqns, *tail)
    ):
        span.alone = True  # nothing to share, or a write into the storage of a value kept (which version?)
        return
    before.extra, before.next = tuple(extra), key
    span.follows, span.tail = before_key, tail


# A mid-step read whose own work is at most this fraction of the pending work's FLOPs computes only that
# (see _Session._reads_little): what it runs again at the flush is at most 1/16 more.
_LITTLE = 16
_SET_BACK = "the generator's state, set back after the flush"
_SAVED = "the states the flush's draws took their numbers from"


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _beside(draw: Eqn, maker: dict[Var, Eqn]) -> list[Var]:
    """What the :class:`~stagetorch.transforms.rng.SetRngState` before ``draw`` reads, to run where it runs: its arguments, but
    for one it draws into (CPU dropout's ``bernoulli_`` into ``empty_like(x)``) the arguments of what made
    that one (``x``, read later anyway): a read of the storage before the draw writes it would keep a
    recomputation from making it again whole (``remat._written_whole``)."""
    written = {v.root for v in writes(draw)}
    out = []
    for v in draw.invars:
        if v.root not in written:
            out.append(v)
        elif v.root in maker:
            out += [u for u in maker[v.root].invars if u.root not in written]
    return out


def _draws(e: Any) -> bool:
    """Whether equation ``e`` draws random numbers (dropout's ``bernoulli_``, ``rand_like``)."""
    return isinstance(e.prim, torch._ops.OpOverload) and draws_random(e)


def _is_write(e: Any) -> bool:
    returns = getattr(getattr(e.prim, "_schema", None), "returns", None)
    if returns is None:
        return True  # not an ATen op: assume it may write
    return any(r.alias_info is not None and r.alias_info.is_write for r in returns)


def _per_example_outputs(executable: Executable) -> dict[Var, Batched]:
    """The batch labels of a flush's per-example outputs: the flushes that read them (the hidden states before
    a data-dependent mask check) cut them to each chunk rather than hold them whole as shared values. A flush
    that mixes the examples (it can only run whole) labels nothing: later flushes read its values whole."""
    try:
        labels = executable.split().analysis.labels
    except StagingError:
        return {}
    return {v: labels[v] for v in executable.graph.outvars if isinstance(labels.get(v), Batched)}


@overload
def lazy(
    tensor: torch.Tensor, /, *, batch: int = 0, memory_budget: int | str | None = None, process_group: Any = None,
    remat: str | bool = "auto",
) -> LazyTensor: ...


@overload
def lazy(
    first: torch.Tensor, second: torch.Tensor, /, *tensors: torch.Tensor, batch: int = 0,
    memory_budget: int | str | None = None, process_group: Any = None, remat: str | bool = "auto",
) -> tuple[LazyTensor, ...]: ...


def lazy(
    *tensors: torch.Tensor, batch: int = 0, memory_budget: int | str | None = None, process_group: Any = None,
    remat: str | bool = "auto",
) -> LazyTensor | tuple[LazyTensor, ...]:
    """Make ``tensors`` lazy: the rest of the script runs unchanged, staged and chunked to fit.

    **Arguments**

    - ``tensors``: the batch (inputs, labels), each with its batch along dim ``batch``.
    - ``batch``: the batch dimension.
    - ``memory_budget``: bytes or a string (``"512MiB"``); default: the device's free memory.
    - ``process_group``: a ``torch.distributed`` group. Each rank passes its own shard of a global batch
      (shards may differ in size, or be empty); the lazy tensors have the global batch's shape, and after
      ``loss.backward()`` every rank's ``.grad`` and the loss are those of the global batch, as with
      ``jit(process_group=)``. A per-example value read holds this rank's examples. The step runs once, at
      ``backward()`` (or the first value read): see the distributed docs page.
    - ``remat``: ``"auto"`` (default) lets a flush that does not fit whole recompute forward values in the
      backward, chosen with the chunk size as ``jit`` chooses them (bit for bit the same result); ``False``
      only chunks.

    **Returns** one :class:`LazyTensor`, or a tuple of them (one per tensor).

    **Raises** :class:`BatchShapeError` (a ``ValueError``) for no tensors, an empty batch, ``batch`` out of range
    or tensors whose batch sizes differ, :class:`NotATensorError` (a ``TypeError``) for a value not a tensor; then, as
    the script runs, the errors ``jit`` raises (:class:`OutOfMemoryError` naming the smallest budget, ...).

    **Example**

    ```python
    x, y = stagetorch.lazy(x, y, batch=0, memory_budget="2GiB")
    loss = torch.nn.functional.cross_entropy(model(x), y)   # the rest of the script unchanged
    loss.backward()
    optimizer.step()
    ```
    """
    if remat not in ("auto", False):
        raise ValueError(f"stagetorch.lazy: remat must be \"auto\" or False, not {remat!r}")
    if not _dynamo_skips and "torch._dynamo" in sys.modules:
        _skip_under_dynamo()
    if not tensors:
        raise BatchShapeError("stagetorch.lazy needs at least one tensor: the batch, as stagetorch.lazy(x, y, batch=0)")
    if process_group is not None:
        sharded = shard.start(tensors, batch, process_group, lambda: _batch_size(tensors, batch))
        return _lazies(_Session(tensors, batch, memory_budget, sharded.batch, sharded, remat == "auto"))
    size = _batch_size(tensors, batch)
    if size == 0:
        raise BatchShapeError(f"stagetorch.lazy: the batch is empty: argument 0 has 0 examples along batch={batch}")
    session = _Session(tensors, batch, memory_budget, size, remat=remat == "auto")
    out, session.lazies = session.lazies, []  # _lazies, inline
    return out[0] if len(out) == 1 else tuple(out)


# Whether dynamo was told to leave stagetorch's code alone (see _skip_under_dynamo).
_dynamo_skips = False


def _skip_under_dynamo() -> None:
    """Tell dynamo (once it is imported: a ``torch.compile`` made it so) to run stagetorch's code and never
    compile it. A compiled model called on lazy tensors reaches ``LazyTensor.__torch_function__``, which
    dynamo would otherwise inline and compile with the session's code behind it (and fail inside it): a file
    in its skip list makes it break the graph at each call on a lazy tensor and run the call, as eager does,
    and skip the frames of the package that run then. (``torch._dynamo.disable`` on the lazy tensor's hooks
    does the same for ~5 us a call, on every op of every step: this costs nothing per call.)"""
    global _dynamo_skips
    from torch._dynamo import trace_rules

    trace_rules.add(__name__.split(".")[0])
    # The code the package generates (programs, express guards and backwards) is named "<stagetorch ...>".
    trace_rules.SKIP_DIRS.append("<stagetorch")
    trace_rules._recompile_re()
    _dynamo_skips = True


def _batch_size(tensors: tuple[torch.Tensor, ...], batch: int) -> int:
    """The batch size the tensors agree on along dim ``batch``; a clear error where they do not."""
    size = -1
    try:
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                break
            n = t.size(batch)
            if n != size:
                if size >= 0:
                    break
                size = n
        else:
            return size
    except (IndexError, RuntimeError, TypeError):
        pass
    return _checked_batch_size(tensors, batch)


def _checked_batch_size(tensors: tuple[torch.Tensor, ...], batch: int) -> int:
    size = None
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise NotATensorError(
                f"stagetorch.lazy: argument {i} is a {type(t).__name__}, not a tensor. What to do: pass only the "
                "batch's tensors to stagetorch.lazy; other values go to the model as they are"
            )
        ndim = t.ndim
        if not -ndim <= batch < ndim:
            raise BatchShapeError(
                f"stagetorch.lazy: batch={batch} is out of range for argument {i} with shape {tuple(t.shape)}; "
                "pass batch=... (the dim of the examples in every tensor)"
            )
        n = t.shape[batch % ndim]
        if size is None:
            size = n
        elif n != size:
            listed = ", ".join(f"argument {j}: {u.shape[batch % u.ndim]}" for j, u in enumerate(tensors[: i + 1]))
            raise BatchShapeError(
                f"stagetorch.lazy: the tensors disagree on the batch size ({listed}); batch={batch}. What to do: pass "
                "the same number of examples in each, and only per-example tensors"
            )
    return size


def _lazies(session: _Session) -> Any:
    out, session.lazies = session.lazies, []  # the session keeps no strong reference to a lazy tensor
    return out[0] if len(out) == 1 else tuple(out)

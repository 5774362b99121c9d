"""The lazy tensor: a real ``torch.Tensor`` subclass whose operations go to its session.

``LazyTensor.__torch_function__`` sees each torch-level call (``F.linear``, ``loss.backward()``) above
autograd: metadata is answered from the tensor itself, a value read evaluates it, and every other call goes
to the session (matched against the express tape first, when the session replays one).
``__torch_dispatch__`` sees the ATen calls below autograd and hands them to the session to record or replay.
This module knows nothing of how a session records, replays or runs: :class:`SessionBase` declares what a
lazy tensor asks of its session, and the layers above implement it (``session._Session`` is all of them).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import UnsupportedOpError
from ..ir import Var
from ..staging.source import user_frame
from ..staging.state import HELD
from ..utils.tree import flat_call, map_leaves
from .mode import Mode

__all__ = ["LazyTensor"]


make_subclass = torch.Tensor._make_wrapper_subclass
_EXPRESS = Mode.EXPRESS  # a module global: read on every call of an express step

MISS = object()  # the call is not the tape's next one

NO_KWARGS: dict = {}  # never written

_grad_enabled = torch.is_grad_enabled

_any_autocast = torch._C._is_any_autocast_enabled


class SessionBase:
    """What a lazy tensor asks of its session: the bottom of the session's layers. Each layer above is a
    subclass of the one below (recording, the slow replay, the express replay, backward, the session) and
    overrides the methods declared here; a lower layer reaches a higher one only through them."""

    mode: Mode  # what the session does with each call; it only moves down, EXPRESS to REPLAY to RECORD
    values: dict[Var, torch.Tensor]  # real values of vars, inputs included
    recording: Any  # the recording it records or replays (recording._Recording)
    tape_pos: int  # the next call of the recording's tape to replay express
    serial: int  # newer sessions have larger ones
    hooked: bool  # a hook or grad_fn was reached: backward always runs the autograd engine
    ran_all = False  # its last flush ran every call, and no call came since (see session._PENDING)
    # In the express replay: a guard per call of the tape (tape.express_guards), tried first on each call.
    guards: list | tuple = ()

    def pending(self) -> None:
        """A call reached a session that had run every call (``ran_all``): it may have calls to run again."""
        raise NotImplementedError

    def call(self, func: Any, args: tuple, kwargs: dict, leaves: list) -> Any:
        """An ATen call on lazy tensors (``__torch_dispatch__``): replayed, recorded or run for real."""
        raise NotImplementedError

    def torch_call(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A torch function on lazy tensors (``__torch_function__``) that the express replay did not match."""
        raise NotImplementedError

    def backward(self, func: Any, args: tuple, kwargs: dict, roots: list) -> None:
        """``loss.backward()`` from lazy ``roots``."""
        raise NotImplementedError

    def leave_express(self) -> None:
        """Go from the express replay to the slow replay (the autograd graph is needed)."""
        raise NotImplementedError

    def count_batch(self, depth: int = 3) -> None:
        """BatchNorm's forward counted a batch before calling batch_norm on lazy tensors."""
        raise NotImplementedError

    def flush(self, targets: list[Var], leaves: list[torch.Tensor] = (), grads: list | None = None) -> None:
        """Run every pending equation; keep ``targets`` and every value still referenced."""
        raise NotImplementedError


def _session_of(args: tuple, kwargs: dict) -> SessionBase | None:
    for x in args:
        if type(x) is LazyTensor:
            return x._session
    for x in flat_call(args, kwargs):
        if type(x) is LazyTensor:
            return x._session
    return None

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
    # A call like any other, but BatchNorm's forward counted the batch just before it (see count_batch).
    torch.nn.functional.batch_norm: "batch_norm",
    **dict.fromkeys([
        torch.Tensor.register_hook, torch.Tensor.retain_grad, torch.Tensor.grad_fn.__get__,
        torch.Tensor.register_post_accumulate_grad_hook,
    ], "autograd"),
}

class LazyTensor(torch.Tensor):
    """A ``torch.Tensor`` whose operations are recorded, not run, until a value is needed."""

    # Slots, each set where a lazy tensor is made (lazy_tensor; inline in session.py and the express guards):
    # a step makes a handful, and attributes in a __dict__ cost its allocation each time (~0.4 us a tensor).
    __slots__ = ("_fake", "_var", "_session", "_express", "_shadow")
    _fake: torch.Tensor | None  # its fake tensor while recording
    _var: Var
    _session: SessionBase
    _express: bool  # made by the express replay: no autograd graph behind it
    _shadow: LazyTensor | None  # once the session left the express replay: the same value with one

    def value(self) -> torch.Tensor:
        """The real tensor, evaluated (chunked where it is per-example) and memoised."""
        t = self if self._shadow is None else self._shadow
        s = t._session
        if t._var not in s.values:
            s.flush([t._var], needed=[t._var])
        return s.values[t._var]

    def settled(self) -> torch.Tensor:
        """The real tensor of a lazy tensor of an older ``lazy(...)`` call, read by a call of a newer one (a
        value from a finished step). Its session first runs every call it has pending, whole, never as a
        peek: a peek leaves its equations pending, to run again later from the values they read, while the
        call may write into this value in place (SGD's ``buf.mul_(momentum).add_(grad)`` on a momentum
        buffer made in an earlier step, whose ``mul_`` that session recorded): computed again, the value
        would lose that write, and the optimizer would step with a stale buffer."""
        t = self if self._shadow is None else self._shadow
        s = t._session
        s.flush([t._var])
        return s.values[t._var]

    def __repr__(self, **kwargs: Any) -> str:
        return repr(self.value())

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if args:
            # The hot path of an express step: the guard at the session's position on the tape (which checks
            # the function, grad mode and every argument, and makes the lazy results). Anything it refuses
            # (another call, a metadata read, a session with calls run) takes the full path below.
            first = args[0]
            if type(first) is LazyTensor:
                session = first._session
                guards = session.guards
                pos = session.tape_pos
                if pos < len(guards) and not session.ran_all:
                    out = guards[pos](session, func, args, kwargs)
                    if out is not MISS:
                        return out
        kind = _SPECIAL.get(func)
        kwargs = kwargs or NO_KWARGS
        if kind is None or kind == "batch_norm":
            first = args[0] if args else None
            session = first._session if type(first) is LazyTensor else _session_of(args, kwargs)
            if session is not None:
                if session.ran_all:
                    session.pending()
                if session.mode is _EXPRESS:
                    # The hot path of a replayed step: the tape's next call, if it is this one, matched by its
                    # guard (which makes the lazy results). Anything else leaves the express replay.
                    tape, pos = session.recording.tape, session.tape_pos
                    if pos < len(tape):
                        call = tape[pos]
                        if (
                            (call.func is func or call.func == func) and call.express
                            and call.grad is _grad_enabled() and not _any_autocast()
                        ):
                            out = (call.guard or call.compile_guard())(session, func, args, kwargs)
                            if out is not MISS:
                                return out  # (a batch_norm's guard counted the batch)
                mixed = _one_session(args, kwargs)
                if mixed is not None:
                    return func(*mixed[0], **mixed[1])
                if kind is not None:
                    session.count_batch()
                if session.mode is _EXPRESS:
                    session.leave_express()
                return session.torch_call(func, args, kwargs)
        elif kind == "meta":
            if args and type(args[0]) is LazyTensor and args[0]._shadow is not None:
                args = unshadow(args)  # autograd state (requires_grad) is the shadow's
        elif kind == "backward":
            roots = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            lazies = [t for t in roots if type(t) is LazyTensor]
            if lazies:
                session = lazies[0]._session
                if session.ran_all:
                    session.pending()
                session.backward(func, args, kwargs, roots)
                return None
        elif kind == "read":
            return func(*map_leaves(args, torch.Tensor, real_value), **kwargs)
        else:  # the user reaches into autograd (a hook, a grad_fn): backward must run through the engine
            for t in flat_call(args, kwargs):
                if type(t) is LazyTensor:
                    if t._session.ran_all:
                        t._session.pending()
                    if t._session.mode is _EXPRESS:
                        t._session.leave_express()  # the autograd graph is needed
                    t._session.hooked = True
            args, kwargs = unshadow(args), unshadow(kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        leaves = flat_call(args, kwargs)
        mixed = _one_session(args, kwargs, leaves)
        if mixed is not None:
            args, kwargs = mixed
            leaves = flat_call(args, kwargs)
        session = None
        for t in leaves:
            if type(t) is LazyTensor:
                if t._express:
                    raise RuntimeError(
                        f"stagetorch.lazy: {func} reached a lazy tensor without its torch function (under "
                        "torch._C.DisableTorchFunctionSubclass?); call it on the tensor directly"
                    )
                session = t._session
        if session.ran_all:
            session.pending()
        return session.call(func, args, kwargs, leaves)

def _one_session(args: tuple, kwargs: dict, leaves: list | None = None) -> tuple[tuple, dict] | None:
    """A call on lazy tensors of several ``lazy(...)`` calls (``total + loss`` across steps): the ones of
    every session but the newest become their real values, as in eager they already are. None if there is
    one session."""
    sessions = {t._session for t in (flat_call(args, kwargs) if leaves is None else leaves) if type(t) is LazyTensor}
    if len(sessions) < 2:
        return None
    newest = max(sessions, key=lambda s: s.serial)

    def real(t: LazyTensor) -> torch.Tensor:
        return t if t._session is newest else t.settled()

    return map_leaves(args, LazyTensor, real), map_leaves(kwargs, LazyTensor, real)


def lazy_tensor(
    shape: Any, stride: Any, dtype: torch.dtype, device: torch.device, var: Var, session: SessionBase,
    fake: torch.Tensor | None = None, requires_grad: bool = False,
) -> LazyTensor:
    """A LazyTensor standing for ``var`` of ``session`` (``fake``: its fake tensor while recording)."""
    out = make_subclass(LazyTensor, shape, strides=stride, dtype=dtype, device=device, requires_grad=requires_grad)
    out._fake, out._var, out._session, out._express, out._shadow = fake, var, session, False, None
    return out

def real_value(t: Any) -> Any:
    return t.value() if isinstance(t, LazyTensor) else t


def _held(t: LazyTensor, name: str) -> torch.Tensor:
    """The real tensor ``t`` holds, for a function staged by ``jit`` that reads it (an argument, a global).
    Its autograd graph lives in its session, where the staged backward cannot follow it."""
    if t.requires_grad and torch.is_grad_enabled():
        frame = user_frame()
        where = f" at {frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else ""
        raise UnsupportedOpError(
            f"{name} is a lazy tensor of stagetorch.lazy that requires grad, read by a staged function{where}: "
            "its autograd graph is in its one-line session, which the staged backward cannot reach, so the "
            f"gradient would stop at it. What to do: pass {name}.detach() where only its value is needed, or "
            "compute it inside the staged function."
        )
    return t.value()


HELD[LazyTensor] = _held

def unshadow(tree: Any) -> Any:
    """``tree`` with each lazy tensor the express replay made replaced by its shadow."""
    return map_leaves(tree, LazyTensor, lambda t: t if t._shadow is None else t._shadow)

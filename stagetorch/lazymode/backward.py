"""``loss.backward()`` on lazy tensors: autograd runs the backward ops through ``__torch_dispatch__``
(recorded or replayed), then a flush turns the lazy gradients into real ones. A replayed step whose
backward runs over the same graph into the same leaves, with no hooks, skips the autograd engine: its
steps are the recorded ones (:class:`~.recording.Backward`).
"""

from __future__ import annotations

import sys
import sysconfig
import weakref
from typing import Any

import torch

from ..ir import Var
from ..staging.source import is_user_code, user_frame
from .autograd_graph import PYTHON_FUNCTION_NODE, autograd_graph, is_lazy_summary
from .express import ExpressReplay
from .mode import Mode
from .recording import BACKWARD, Backward, Step
from .tape import Call
from .tensor import LazyTensor, unshadow

_ENGINE_RUN = torch.autograd.graph._engine_run_backward.__code__
_STDLIB = sysconfig.get_paths()["stdlib"]


def _runs_user_code(func: Any, args: tuple, kwargs: dict) -> bool:
    """Call ``func``; whether it called user code on this thread (the engine runs CPU backward here; a
    device's backward runs on the engine's thread for that device, which this does not watch)."""
    seen = False

    def watch(frame: Any, event: str, arg: Any) -> None:
        nonlocal seen
        # A hook is called by the engine itself (from C++: its caller is the engine's Python entry point);
        # what torch's and our own Python code call (typing, dataclasses) is not a hook, nor is the standard
        # library (torch's C++ asks logging for its level).
        if event == "call" and not seen and is_user_code(frame.f_code):
            caller = frame.f_back
            seen = (caller is None or caller.f_code is _ENGINE_RUN) and not frame.f_code.co_filename.startswith(_STDLIB)

    previous = sys.getprofile()
    sys.setprofile(watch)
    try:
        func(*args, **kwargs)
    finally:
        sys.setprofile(previous)
    return seen


class BackwardSkip(ExpressReplay):
    """``loss.backward()``: through the autograd engine, or its recorded steps without it (below it, the
    express replay's backward: the tape's, without an autograd graph)."""

    def backward(self, func: Any, args: tuple, kwargs: dict, roots: list) -> None:
        """``loss.backward()``: autograd runs the backward ops through ``__torch_dispatch__`` (recorded or
        replayed), then a flush turns the lazy gradients into real ones. When the session replays a
        recording whose backward ran over the same autograd graph into the same leaves, with no hooks and
        every ``.grad`` empty, the engine is skipped: its steps are the recorded ones."""
        if self.mode is Mode.EXPRESS:
            if self._express_backward(args, kwargs, roots):
                return
            self.leave_express()
        if self.shadowed:
            args, kwargs = unshadow(args), unshadow(kwargs)
            roots = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
        tape, tape_from = self.tape, self.step_count
        self.tape = None  # taped below, once the backward's steps are known
        if any(type(t) is LazyTensor and t._var in self.freed for t in roots):
            raise RuntimeError(
                "Trying to backward through the graph a second time: the first backward() freed it. Specify "
                "retain_graph=True in the first backward() if you need to backward through it again."
            )
        with torch._C.DisableTorchFunctionSubclass():
            leaves, kinds, nodes = autograd_graph(roots)
        # A failed backward leaves each .grad as it was (autograd may have stored a lazy gradient there).
        before = [(leaf, leaf.grad) for leaf in leaves if type(leaf) is not LazyTensor]
        try:
            self._backward(func, args, kwargs, roots, tape, tape_from, leaves, kinds, nodes)
        except BaseException:
            for leaf, grad in before:
                if leaf.grad is not grad:
                    leaf.grad = grad
            raise

    def _backward(
        self, func: Any, args: tuple, kwargs: dict, roots: list, tape: list | None, tape_from: int,
        leaves: list, kinds: tuple, nodes: list,
    ) -> None:
        loss = roots[0]
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
            and not any(issubclass(kind, PYTHON_FUNCTION_NODE) for kind in kinds)
        )
        key = (loss._var, kinds)
        remark = None  # the replayed marker to bring up to date if the engine replays its steps as recorded
        # Skipping the engine leaves the forward's autograd graph in place, holding what it saved (the engine
        # frees it): the flush must then keep all of it, which a budget may not allow. The engine runs instead.
        # Under a process group the same holds, and every rank must flush the same outputs whatever its budget.
        skippable = plain and self.memory_budget is None and self.shard is None
        if self.mode is not Mode.RECORD:
            steps = self.recording.steps
            step = steps[self.cursor] if self.cursor < len(steps) else None
            if step is not None and step.func is BACKWARD:
                mark: Backward = step.out
                if (
                    skippable and mark.key == key and len(mark.leaves) == len(leaves)
                    and all(r() is leaf for r, leaf in zip(mark.leaves, leaves))
                    and all(v in self.consts for v in mark.needs)
                    and (state := self._saved_state(nodes, mark.checks))[0] == mark.saved
                ):
                    self.consts.update(self._derive(mark.derived, state[1]))
                    self.cursor += 1 + mark.nsteps
                    self.end += mark.neqns
                    self.freed = self.freed | {loss._var}  # as the engine would have freed the graph
                    self._tape_backward(tape, tape_from, self.cursor - 1 - mark.nsteps, loss, leaves, nodes)
                    state = None  # (the real tensors autograd saved, read to compare: not held through the flush)
                    self.flush([], grads=[(leaves[i], v) for i, v in mark.grads])
                    return
                remark = self.cursor
                self.cursor += 1  # the engine runs below; its calls replay one by one
        was_recording = self.mode is Mode.RECORD
        start = (self.cursor if not was_recording else len(self.recording.steps), self.eqn_count, dict(self.consts))
        marking = plain and (was_recording or remark is not None)
        caller = user_frame(2) if marking else None
        call_site = (caller.f_code.co_filename, caller.f_lineno) if caller is not None else None
        with torch._C.DisableTorchFunctionSubclass():
            saved = self._saved_state(nodes) if marking else None
            stranded = [t for t in leaves if type(t) is LazyTensor and t._express]
            if stranded:
                leaves = self._run_stranded(func, args, kwargs, leaves, stranded)
            elif marking:
                if _runs_user_code(func, args, kwargs):
                    # Python code of the user's ran inside the engine (a hook, even one that runs no op): it
                    # must run every step, so this backward is never skipped.
                    call_site = None
            else:
                func(*args, **kwargs)
        marked = -1
        if plain and was_recording:
            # Recorded (from the start, not after a divergence mid-backward): mark it for the next steps.
            span = self.recording.steps[start[0] :]
            mark = self._backward_mark(key, leaves, span, start[1], start[2], saved, call_site)
            if mark is not None:
                self.recording.steps.insert(start[0], Step(BACKWARD, (), [], mark, False, False))
                marked = start[0]
        elif plain and remark is not None and self.mode is not Mode.RECORD:
            # Replayed through the engine, step by step as recorded (another model of the same shapes, a
            # hook since removed): the marker now describes this graph, so the next step skips the engine.
            span = self.recording.steps[remark + 1 : self.cursor]
            mark = self._backward_mark(key, leaves, span, start[1], start[2], saved, call_site)
            if mark is not None:
                self.recording.steps[remark] = Step(BACKWARD, (), [], mark, False, False)
                marked = remark
        if marked >= 0:
            self._tape_backward(tape, tape_from, marked, loss, leaves, nodes)
        elif tape is not None:
            tape.append(Call(BACKWARD, (), False, tape_from, 0, 0, express=False))
        # The real tensors autograd saved, read to mark the backward (the Python numbers an op wrapped as 0-dim
        # tensors: `0.5 * x`), are dropped before the flush: the engine freed them, and no plan counts them.
        saved = None
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
        more = [t for t in autograd_graph(roots)[0] if not any(t is u for u in leaves)]
        if roots:
            retain = bool(kwargs.get("retain_graph") or kwargs.get("create_graph"))
            torch.autograd.backward(roots, list(grads.values()), retain_graph=retain)
        return [t for t in leaves if not any(t is u for u in stranded)] + more

    def _backward_mark(
        self, key: tuple, leaves: list, span: list, n_eqns: int, bound: dict, saved: tuple, call_site: tuple | None
    ) -> Backward | None:
        if not span or not all(s.recorded and s.func is not BACKWARD for s in span):
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
        checked = tuple(entry for entry in summary if not is_lazy_summary(entry[2]))
        weak = [weakref.ref(leaf) for leaf in leaves]
        needs = (needs & bound.keys()) | {d[1] for d in derived if type(d[1]) is Var}
        return Backward(key, weak, grads, len(span), self.eqn_count - n_eqns, needs, derived, checked)

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

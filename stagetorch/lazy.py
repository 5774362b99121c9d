"""One-line mode: ``stagetorch.lazy(input, label, batch=0)`` and the rest of the script unchanged.

A :class:`LazyTensor` is a real ``torch.Tensor`` subclass. Operations on it are recorded into the same IR
the tracer builds (by the tracer's own recorder, on fake tensors), including the backward ops autograd
emits for ``loss.backward()``. Reading a value (``print``, ``item``, ``if``...) and ``backward()`` flush
the recorded equations that have not run yet through the same :class:`~stagetorch.api.Executable` that
``jit`` uses: planned against the memory budget, chunked when the batch does not fit, exact.

Every value that is still referenced when a flush runs (by you, or by autograd for the backward) is kept,
so nothing runs twice: BatchNorm statistics are updated once and dropout masks are drawn once.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ._tree import map_leaves
from .api import Executable
from .batching import Batched
from .devices import free_memory
from .errors import ConcretizationError
from .execute import accumulate_grad
from .ir import Graph, Var
from .tracing import _Recorder

__all__ = ["lazy", "LazyTensor"]

_aten = torch.ops.aten


class _Session:
    """What one ``lazy(...)`` call records: the equations, which of them have run, and the values kept."""

    def __init__(self, batch: int, memory_budget: int | str | None):
        self.recorder = _Recorder(FakeTensorMode(allow_non_fake_inputs=True))
        self.batch = batch
        self.memory_budget = memory_budget
        self.done = 0  # equations before this index have run
        self.values: dict[Var, torch.Tensor] = {}  # real values of vars, inputs included
        self.alive: dict[Var, weakref.ref] = {}
        self.batched: dict[Var, Batched] = {}

    # -- recording ---------------------------------------------------------------------------------------

    def wrap(self, fake: torch.Tensor) -> LazyTensor:
        var = self.recorder.var(fake)
        out = LazyTensor(fake, var, self)
        self.alive[var] = weakref.ref(out)
        return out

    def record(self, func: Any, args: tuple, kwargs: dict) -> Any:
        unwrap = self._unwrap
        fake_args = map_leaves(args, torch.Tensor, unwrap)
        fake_kwargs = map_leaves(kwargs, torch.Tensor, unwrap)
        out = self.recorder.record(func, fake_args, fake_kwargs)
        schema = func._schema
        if schema.returns and schema.returns[0].alias_info is not None and schema.returns[0].alias_info.is_write:
            # In place: the same Python object now stands for the op's result.
            target = args[0]
            if isinstance(target, LazyTensor):
                target._var = self.recorder.var(out)
                target._fake = out
                self.alive[target._var] = weakref.ref(target)
                return target
        return map_leaves(out, torch.Tensor, lambda t: self.wrap(t) if isinstance(t, torch.Tensor) else t)

    def _unwrap(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, LazyTensor):
            if t._session is not self:
                raise ValueError("lazy tensors from two stagetorch.lazy(...) calls cannot be combined; make them in one call")
            return t._fake
        return t

    # -- running -----------------------------------------------------------------------------------------

    def flush(self, targets: list[Var], leaves: list[torch.Tensor] = ()) -> None:
        """Run every recorded equation not yet run; keep ``targets``, every value still referenced, and the
        lazy gradients autograd stored in the ``.grad`` of ``leaves``, which become real gradients."""
        rec = self.recorder
        pending = rec.eqns[self.done :]
        if not pending:
            return
        grads = [
            (leaf, leaf.grad._var)
            for leaf in leaves
            if isinstance(leaf.grad, LazyTensor) and leaf.grad._session is self
        ]
        wanted = {v for v in targets if v not in self.values}
        wanted |= {v for v, ref in self.alive.items() if ref() is not None and v not in self.values}
        wanted |= {v for _, v in grads}
        produced = {v for e in pending for v in e.outvars if v is not None}
        outs = [v for v in wanted if v in produced]
        # Every input of the pending equations that an earlier flush (or the user) supplied.
        invars: list[Var] = []
        for e in pending:
            for v in e.invars:
                if v not in produced and v not in invars:
                    invars.append(v)
        inputs = [self._value_of(v) for v in invars]
        roles = ["arg" if v in self.batched else "const" for v in invars]
        graph = Graph(invars, list(pending), outs, roles, [""] * len(invars))
        batched = {v: b for v, b in self.batched.items() if v in invars}
        executable = Executable(graph, batched, self.batch)
        device = next((v.aval.device for v in batched), torch.device("cpu"))
        values, _ = executable.run(inputs, free_memory(device, self.memory_budget), name="lazy")
        self.done = len(rec.eqns)
        self.values.update(zip(outs, values))
        for leaf, v in grads:
            leaf.grad = None  # autograd stored the lazy gradient; accumulate the real one as it would have
            accumulate_grad(leaf, self.values[v])
        # Keep only what can still be read: the inputs, and values whose lazy tensor is alive.
        self.alive = {v: ref for v, ref in self.alive.items() if ref() is not None}
        live = set(self.alive) | set(self.batched)
        self.values = {v: x for v, x in self.values.items() if v in live}

    def _value_of(self, v: Var) -> torch.Tensor:
        if v in self.values:
            return self.values[v]
        i = self.recorder.invars.index(v)
        role = self.recorder.roles[i]
        if role == "const":
            return self.recorder.consts[int(self.recorder.names[i].removeprefix("const"))]
        raise ConcretizationError("a lazy value was dropped before it ran; this is a bug in stagetorch.lazy")



def _autograd_leaves(t: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors a backward from ``t`` accumulates into (its graph's AccumulateGrad nodes)."""
    leaves, seen, stack = [], set(), [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves.append(variable)
        stack.extend(n for n, _ in node.next_functions)
    return leaves


# Ops that need a value: evaluate the inputs, then run the op on real tensors.
_CONCRETE = {_aten._local_scalar_dense.default, _aten.item.default}

# Python-level reads: the tensor is evaluated and the read runs on its real value.
_READS = {
    torch.Tensor.__repr__, torch.Tensor.__str__, torch.Tensor.__format__, torch.Tensor.tolist,
    torch.Tensor.numpy, torch.Tensor.__array__, torch.Tensor.__float__, torch.Tensor.__int__,
    torch.Tensor.__bool__, torch.Tensor.__index__, torch.Tensor.item, torch.Tensor.__reduce_ex__,
}


class LazyTensor(torch.Tensor):
    """A ``torch.Tensor`` whose operations are recorded, not run, until a value is needed."""

    _fake: torch.Tensor
    _var: Var
    _session: _Session

    @staticmethod
    def __new__(cls, fake: torch.Tensor, var: Var, session: _Session, requires_grad: bool = False) -> LazyTensor:
        out = torch.Tensor._make_wrapper_subclass(
            cls, fake.shape, strides=fake.stride(), dtype=fake.dtype, device=fake.fake_device,
            requires_grad=requires_grad,
        )
        out._fake, out._var, out._session = fake, var, session
        return out

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__()

    def value(self) -> torch.Tensor:
        """The real tensor, evaluated (chunked where it is per-example) and memoised."""
        s = self._session
        if self._var not in s.values:
            s.flush([self._var])
        return s.values[self._var]

    def __repr__(self, **kwargs: Any) -> str:
        return repr(self.value())

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.backward:
            loss = args[0]
            leaves = _autograd_leaves(loss)
            with torch._C.DisableTorchFunctionSubclass():
                func(*args, **kwargs)  # autograd runs the backward ops through __torch_dispatch__: recorded
            loss._session.flush([], leaves)
            return None
        if func in _READS:
            real = map_leaves(args, torch.Tensor, lambda t: t.value() if isinstance(t, LazyTensor) else t)
            return func(*real, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        session = next(t._session for t in _leaves((args, kwargs)) if isinstance(t, LazyTensor))
        if func in _CONCRETE or func.namespace == "prim":
            return func(*map_leaves(args, torch.Tensor, _real), **map_leaves(kwargs, torch.Tensor, _real))
        try:
            return session.record(func, args, kwargs)
        except ConcretizationError:
            # A data-dependent shape (x[x > 0], nonzero): evaluate the inputs and run this op for real.
            return func(*map_leaves(args, torch.Tensor, _real), **map_leaves(kwargs, torch.Tensor, _real))


def _real(t: Any) -> Any:
    return t.value() if isinstance(t, LazyTensor) else t


def _leaves(tree: Any) -> list:
    if isinstance(tree, (list, tuple)):
        return [y for x in tree for y in _leaves(x)]
    if isinstance(tree, dict):
        return [y for x in tree.values() for y in _leaves(x)]
    return [tree]


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
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"stagetorch.lazy: argument {i} is a {type(t).__name__}, not a tensor")
        if not -t.ndim <= batch < t.ndim:
            raise ValueError(f"stagetorch.lazy: batch={batch} is out of range for argument {i} with shape {tuple(t.shape)}")
    sizes = {t.shape[batch % t.ndim] for t in tensors}
    if len(sizes) > 1:
        raise ValueError(f"stagetorch.lazy: the tensors disagree on the batch size along dim {batch}: {sorted(sizes)}")
    n = sizes.pop()
    if n == 0:
        raise ValueError("stagetorch.lazy: the batch is empty")
    session = _Session(n, memory_budget)
    out = []
    for i, t in enumerate(tensors):
        with session.recorder.fake_mode:
            fake = session.recorder.fake_mode.from_tensor(t.detach(), static_shapes=True)
        var = session.recorder.add_input(fake, "arg", f"lazy{i}")
        session.values[var] = t.detach()
        session.batched[var] = Batched(batch % t.ndim)
        lazy_t = LazyTensor(fake, var, session, requires_grad=t.requires_grad)
        session.alive[var] = weakref.ref(lazy_t)
        out.append(lazy_t)
    return out[0] if len(out) == 1 else tuple(out)

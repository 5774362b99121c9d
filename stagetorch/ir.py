"""The typed IR: abstract values, variables, equations and graphs.

Plain data that every interpreter reads. It knows nothing about tracing, memory or chunking; printing a
graph and checking that it is well formed (:func:`check`) are the only behaviours it has.
"""

from __future__ import annotations

import itertools
import math
import string
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import torch

from .errors import StagingError, UnsupportedOpError

__all__ = ["Aval", "Var", "Literal", "SourceInfo", "Eqn", "Graph", "GraphError", "check", "op_name", "iter_vars", "restrided", "contiguous_strides"]

_DTYPE_NAMES = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.bool: "bool", torch.complex64: "c64", torch.complex128: "c128",
}


@attrs.frozen
class Aval:
    """An abstract tensor: what a value is, without its data."""

    shape: tuple[int, ...] = attrs.field(converter=tuple)
    dtype: torch.dtype
    device: torch.device = attrs.field(default=torch.device("cpu"), converter=torch.device)

    @classmethod
    def of(cls, t: torch.Tensor) -> Aval:
        key = (tuple(t.shape), t.dtype, t.device)
        aval = _AVALS.get(key)
        if aval is None:
            aval = _AVALS[key] = cls(*key)
        return aval

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def __str__(self) -> str:
        name = _DTYPE_NAMES.get(self.dtype, str(self.dtype).removeprefix("torch."))
        return f"{name}[{','.join(map(str, self.shape))}]"


# Avals are immutable and few distinct ones occur: share them (tracing makes one per recorded tensor).
_AVALS: dict[tuple, Aval] = {}


@attrs.define(eq=False, repr=False)
class Var:
    """A value in a graph. Compared by identity.

    ``base`` is the variable that owns the storage this one lives in (a view or an in-place result shares
    its base's storage); ``storage_nbytes`` is the size of the storage a base owns. ``strides``: the
    strides the value has when the graph runs, where known (the tracer records what it saw; a pass that
    makes a value may say, see :func:`restrided`); None where unknown. Memory rules read them through
    :class:`stagetorch.interpreters.memory.Layouts`; nothing else depends on them.
    """

    aval: Aval
    base: Var | None = None
    storage_nbytes: int | None = None
    strides: tuple[int, ...] | None = None

    @property
    def root(self) -> Var:
        v = self
        while v.base is not None:
            v = v.base
        return v

    @property
    def owned_nbytes(self) -> int:
        return self.aval.nbytes if self.storage_nbytes is None else self.storage_nbytes

    def __repr__(self) -> str:
        return f"Var({self.aval})"


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous (row-major) tensor of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def restrided(strides: tuple[int, ...] | None, shape: tuple[int, ...], new_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The strides of a value shaped ``new_shape`` laid out as one of ``shape`` with ``strides`` is (the same
    dims outermost to innermost, dense), for a pass that makes the first from the second (a chunk of fewer
    examples); None where ``strides`` is unknown or not dense (a view into a larger storage)."""
    if strides is None:
        return None
    if tuple(shape) == tuple(new_shape):
        return strides
    order = sorted(range(len(shape)), key=lambda d: (strides[d], shape[d]), reverse=True)
    expected = 1
    for d in reversed(order):  # innermost first: each dim's stride is the size of the dims inside it
        if shape[d] != 1 and strides[d] != expected:
            return None
        expected *= shape[d]
    out = [0] * len(shape)
    acc = 1
    for d in reversed(order):
        out[d] = acc
        acc *= max(new_shape[d], 1)
    return tuple(out)


@attrs.frozen
class Literal:
    """A non-tensor value in an output position (a Python number, None, a string)."""

    value: Any

    def __str__(self) -> str:
        return repr(self.value)


@attrs.frozen
class SourceInfo:
    """Where an equation came from in the user's code."""

    file: str = "?"
    line: int = 0
    function: str = ""
    module: str = ""
    backward: str = ""

    def __str__(self) -> str:
        where = f"{_short(self.file)}:{self.line}"
        if self.backward:
            where += f" backward of {self.backward}"
        if self.module:
            where += f" ({self.module})"
        return where


def _short(path: str) -> str:
    parts = path.replace("\\", "/").split("/")
    return "/".join(parts[-2:]) if len(parts) > 1 else path


def op_name(prim: Callable) -> str:
    """``aten.addmm`` for a default overload, ``aten.sum.dim_IntList`` otherwise; a callable's own name."""
    if isinstance(prim, torch._ops.OpOverload):
        packet = f"{prim.namespace}.{prim._schema.name.split('::')[-1]}"
        return packet if prim._overloadname == "default" else f"{packet}.{prim._overloadname}"
    if isinstance(prim, torch._ops.OpOverloadPacket):
        return f"{prim._qualified_op_name.split('::')[0]}.{prim.__name__}"
    return getattr(prim, "__name__", repr(prim))


def iter_vars(tree: Any) -> Iterator[Var]:
    """The Vars in an argument tree (nested lists, tuples and dicts), in order."""
    if isinstance(tree, Var):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for x in tree:
            yield from iter_vars(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from iter_vars(x)


@attrs.define(eq=False)
class Eqn:
    """One call: ``outvars = prim(*args, **kwargs)``, with :class:`Var` where a tensor was passed.

    ``outvars`` follows the flattened result of the call: a Var for each tensor, ``None`` for anything
    else (an undefined gradient, an integer).
    """

    prim: Callable
    args: tuple
    kwargs: dict
    outvars: tuple[Var | None, ...]
    source: SourceInfo = attrs.field(factory=SourceInfo)
    # The Vars in args and kwargs, found on first use: an equation is not changed once made (passes make new
    # ones with attrs.evolve, which finds them again), and interpreters ask for them many times.
    _invars: tuple[Var, ...] | None = attrs.field(default=None, init=False, repr=False)

    @property
    def invars(self) -> list[Var]:
        if self._invars is None:
            self._invars = tuple(iter_vars((self.args, self.kwargs)))
        return list(self._invars)

    @property
    def params(self) -> dict[str, Any]:
        """The non-tensor arguments, by schema name where the primitive has a schema."""
        schema = getattr(self.prim, "_schema", None)
        names = [a.name for a in schema.arguments] if schema is not None else [f"arg{i}" for i in range(len(self.args))]
        out = {}
        for name, value in itertools.chain(zip(names, self.args), self.kwargs.items()):
            if not any(True for _ in iter_vars(value)):
                out[name] = value
        return out


@attrs.define(eq=False)
class Graph:
    """A staged program: inputs, equations in execution order, outputs.

    ``roles`` and ``names`` run parallel to ``invars``: ``roles`` is one of ``"arg"`` (a leaf of the user's
    arguments), ``"param"``, ``"buffer"`` or ``"const"`` (a tensor the function closed over), ``names`` is
    what the user calls it. ``grads`` lists the gradients the program accumulates into ``.grad`` of an
    input (by position in ``invars``). ``out_tree`` rebuilds the user's output structure from ``outvars``.
    """

    invars: list[Var]
    eqns: list[Eqn]
    outvars: list[Var | Literal]
    roles: list[str] = attrs.field(factory=list)
    names: list[str] = attrs.field(factory=list)
    grads: list[tuple[int, Var]] = attrs.field(factory=list)
    out_tree: Any = None

    def __str__(self) -> str:
        return format_graph(self)

    def vars(self) -> Iterator[Var]:
        yield from self.invars
        for e in self.eqns:
            yield from (v for v in e.outvars if v is not None)

    @property
    def device(self) -> torch.device:
        """The device the batch lives on: that of the first argument, else of the first input."""
        for v, role in zip(self.invars, self.roles or ["arg"] * len(self.invars)):
            if role == "arg":
                return v.aval.device
        return self.invars[0].aval.device if self.invars else torch.device("cpu")


def _letters() -> Iterator[str]:
    for size in itertools.count(1):
        for chars in itertools.product(string.ascii_lowercase, repeat=size):
            yield "".join(chars)


def format_graph(g: Graph, *, source: bool = True) -> str:
    """Print ``g`` like a jaxpr: one typed equation a line, the user's file:line on the right."""
    names: dict[Var, str] = {}
    taken = set(g.names)
    fresh = (n for n in _letters() if n not in taken)
    for i, v in enumerate(g.invars):
        names[v] = g.names[i] if i < len(g.names) and g.names[i] else next(fresh)

    def name(v: Var) -> str:
        if v not in names:
            names[v] = next(fresh)
        return names[v]

    def arg(x: Any) -> str:
        if isinstance(x, Var):
            return name(x)
        if isinstance(x, (list, tuple)):
            inner = ", ".join(arg(y) for y in x)
            return f"[{inner}]" if isinstance(x, list) else f"({inner}{',' if len(x) == 1 else ''})"
        if isinstance(x, torch.dtype):
            return _DTYPE_NAMES.get(x, str(x))
        return repr(x)

    def binders(vs: Sequence[Var]) -> str:
        return " ".join(f"{name(v)}:{v.aval}" for v in vs)

    roles = g.roles or ["arg"] * len(g.invars)
    args = [v for v, r in zip(g.invars, roles) if r == "arg"]
    state = [v for v, r in zip(g.invars, roles) if r != "arg"]
    lines = [f"{{ lambda {binders(args)} ; {binders(state)} . let"]
    body = []
    for e in g.eqns:
        outs = [v for v in e.outvars if v is not None]
        lhs = binders(outs) if outs else "_"
        call = ", ".join([arg(a) for a in e.args] + [f"{k}={arg(v)}" for k, v in e.kwargs.items()])
        body.append((f"    {lhs} = {op_name(e.prim)}({call})", str(e.source) if source else ""))
    width = min(max((len(t) for t, _ in body), default=0), 100)
    lines += [f"{t:<{width}}  # {s}" if s else t for t, s in body]
    outs = ", ".join(str(v) if isinstance(v, Literal) else name(v) for v in g.outvars)
    lines.append(f"  in ({outs}) }}")
    for i, v in g.grads:
        lines.append(f"  {g.names[i] if i < len(g.names) else name(g.invars[i])}.grad += {name(v)}")
    return "\n".join(lines)


class GraphError(ValueError):
    """A graph that breaks the IR's invariants: a bug in whatever built or rewrote it, not in user code."""


AbstractEval = Callable[[Callable, tuple, dict], Sequence["Aval | None"]]


def check(graph: Graph, *, abstract_eval: AbstractEval | None = None) -> Graph:
    """Check that ``graph`` is well formed, and return it; raise :class:`GraphError` naming the first fault.

    - Single assignment: every variable is defined once, as an input or by one equation.
    - Defined before use: an equation reads only inputs and the outputs of earlier equations, and a view's
      ``base``, when the graph defines it, is defined before the view.
    - Outputs and gradients name defined variables; ``roles`` and ``names`` run parallel to ``invars``;
      each gradient's input position is in range and its aval is that input's.
    - With ``abstract_eval`` (``stagetorch.interpreters.shapes.abstract_eval``: the registry's shape rules, else meta
      kernels), each ATen equation's output avals are what the rules say for its input avals. Equations
      whose op has neither (a Python function a pass inserted) are checked structurally only.
    """
    defined: set[Var] = set()
    # A view's base may live outside the graph (a subgraph's input viewing the caller's storage); if the
    # graph defines it, it must do so first.
    everywhere = set(graph.vars())

    def define(v: Var, where: str) -> None:
        if v in defined:
            raise GraphError(f"{v} is defined twice ({where})")
        if v.base is not None and v.base in everywhere and v.base not in defined:
            raise GraphError(f"{v} is a view of {v.base}, which is defined after it ({where})")
        defined.add(v)

    for k, v in enumerate(graph.invars):
        define(v, f"input {k}")
    for field in ("roles", "names"):
        values = getattr(graph, field)
        if values and len(values) != len(graph.invars):
            raise GraphError(f"graph.{field} has {len(values)} entries for {len(graph.invars)} inputs")
    for i, e in enumerate(graph.eqns):
        where = f"equation {i}: {op_name(e.prim)} at {e.source}"
        for v in e.invars:
            if v not in defined:
                raise GraphError(f"{where} reads {v} before it is defined")
        if abstract_eval is not None and isinstance(e.prim, torch._ops.OpOverload):
            _check_avals(e, where, abstract_eval)
        for v in e.outvars:
            if v is not None:
                define(v, where)
    for v in graph.outvars:
        if isinstance(v, Var) and v not in defined:
            raise GraphError(f"output {v} is not defined by the graph")
    for pos, v in graph.grads:
        if not 0 <= pos < len(graph.invars):
            raise GraphError(f"a gradient names input {pos}, but the graph has {len(graph.invars)} inputs")
        if v not in defined:
            raise GraphError(f"the gradient of input {pos} is not defined by the graph")
        want = graph.invars[pos].aval
        if (v.aval.shape, v.aval.dtype) != (want.shape, want.dtype):
            raise GraphError(f"the gradient of input {pos} is {v.aval}, but that input is {want}")
    return graph


def _check_avals(e: Eqn, where: str, abstract_eval: AbstractEval) -> None:
    def aval(x: Any) -> Any:
        if isinstance(x, Var):
            return x.aval
        if isinstance(x, (list, tuple)):
            return type(x)(aval(y) for y in x)
        return x

    try:
        expected = abstract_eval(e.prim, aval(e.args), {k: aval(v) for k, v in e.kwargs.items()})
    except UnsupportedOpError:  # no rule and no meta kernel: nothing to compare against
        return
    except StagingError as err:  # the rules refuse the very operands the graph gives the op
        raise GraphError(f"{where}: the shape rule refuses its operands: {err}") from err
    for j, (v, want) in enumerate(zip(e.outvars, expected)):
        if v is None or want is None:
            continue
        if (v.aval.shape, v.aval.dtype) != (want.shape, want.dtype):
            raise GraphError(f"{where}: output {j} is {v.aval}, but the shape rule says {want}")

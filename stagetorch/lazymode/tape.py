"""The express tape: the torch-level calls a session made (:class:`Call`), and the guards that match a
later step's calls against them (:func:`_compile_guard`: generated straight-line Python).
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

from ..ir import Var
from ..utils.tree import flatten
from .autograd_graph import Unreadable, autograd_graph
from .recording import BACKWARD, RecordingSteps, tensor_meta
from .tensor import MISS, NO_KWARGS, LazyTensor, make_subclass

MAX_LEAVES = 2
_CPU = torch.device("cpu")

@attrs.define(eq=False, frozen=True)
class Real:
    """A real tensor argument in a taped call: the ``slot``-th real tensor the session's calls took. A new
    one is compared by metadata (and bound to the slot), a ``same`` one by identity with the slot. A 0-d
    tensor the call read as a Python number (``out[:, t]``: no op reads it later) is compared by ``value``."""

    meta: tuple | None
    slot: int
    same: bool
    graph: Graph | None = None  # a non-leaf that requires grad (``pos[:, :n]``): its autograd graph
    value: Any = None  # the number a 0-d tensor stood for, or None

@attrs.define(eq=False, frozen=True)
class Graph:
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

@attrs.define(eq=False, frozen=True)
class _Seq:
    """A tuple, list or named tuple (``torch.return_types.max``) a taped call returned."""

    kind: type
    items: tuple

@attrs.define(eq=False)
class Call:
    """One call of a torch function (``F.linear``, ``Tensor.__add__``, ``loss.backward``) on lazy tensors,
    as seen above autograd: what the express replay compares and what it reproduces without running the
    call. ``key`` is :func:`flat_call` of the arguments with each lazy tensor replaced by its variable and
    each real tensor by a :class:`Real`; ``grad`` the grad mode. The call made the recording's steps
    ``[first, first + nsteps)`` and ``neqns`` equations, bound ``consts`` (variable, leaf index, and the
    view of that leaf's storage or None for the leaf itself), moved the lazy arguments at ``mutated``
    (leaf index, new variable) to new values in place, and returned ``out`` (a _New, an _Arg, None, or a
    _Seq of them). A ``write`` into real tensors runs for real again. ``made`` are the constants the call made itself from its Python arguments (variable,
    tensor, version): the 0-d tensors a C++ function creates (CPU ``scaled_dot_product_attention`` turns a
    boolean mask into ``where(mask, 0, -inf)``), bound again as they are. A call ``express`` cannot reproduce (it ran a kernel for real, read a value, ran Python
    autograd code...) stops the express replay there. A backward is ``func`` Tensor.backward with ``key``
    (the loss variable,), ``mark`` the index of its Backward step and ``leaves`` the slots of its leaves."""

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
    rereads: list = attrs.field(factory=list)  # constants earlier calls bound that this one's steps read too
    made: list = attrs.field(factory=list)  # (variable, 0-d tensor, its version): constants the call made itself
    # The call wrote real tensors (``torch.zeros(E).scatter_add_(0, experts, mask)``), nothing requiring grad:
    # its one step ran for real. The express replay runs it again for real (see ExpressReplay._express_write).
    write: bool = False
    draws: bool = False  # its equations draw from a default generator (see draws.py)
    guard: Any = None  # the generated match (_compile_guard), made at its first replay
    backward: Any = None  # a backward's: the generated match and run (express._compile_backward)

    def compile_guard(self) -> Callable:
        self.guard = _compile_guard(self)
        return self.guard

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
        t = as_view(base, view)
        self.entries[j] = (weakref.ref(base, lambda _, j=j: self.entries.pop(j, None)), base.data_ptr(), t)
        return t

_APPLY = torch.autograd.Function.apply.__func__.__code__

def in_custom_function() -> bool:
    """Whether the call runs inside a Python ``autograd.Function``'s forward: its backward is the
    Function's, which only the autograd engine runs, so the calls inside it cannot be replayed alone."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _APPLY:
            return True
        frame = frame.f_back
    return False

def constant_source(t: torch.Tensor, leaves: list) -> tuple[int, tuple | None] | None:
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

def as_view(x: torch.Tensor, view: tuple) -> torch.Tensor:
    shape, stride, offset = view
    return x.detach().as_strided(shape, stride, offset)

def out_spec(out: Any, leaves: list, session: RecordingSteps) -> Any:
    if type(out) is LazyTensor:
        for i, x in enumerate(leaves):
            if x is out:
                return _Arg(i)
        if out._session is not session:
            raise Unreadable
        with torch._C.DisableTorchFunctionSubclass():
            return _New(out._var, out.shape, out.stride(), out.dtype, out.device, out.requires_grad)
    if out is None:
        return None
    if isinstance(out, (tuple, list)):
        return _Seq(type(out), tuple(out_spec(x, leaves, session) for x in out))
    raise Unreadable  # a real tensor or a Python value

def only_args(spec: Any) -> bool:
    if type(spec) is _Seq:
        return bool(spec.items) and all(only_args(x) for x in spec.items)
    return type(spec) is _Arg

def _map_out(spec: Any, leaves: list, session: RecordingSteps) -> Any:
    """What a taped call returned, made again: its own arguments from ``leaves``, new lazy tensors of
    ``session`` for the rest."""
    kind = type(spec)
    if kind is _New:
        return _express_out(session, spec)
    if kind is _Arg:
        return leaves[spec.index]
    if kind is _Seq:
        return spec.kind([_map_out(x, leaves, session) for x in spec.items])
    return spec

def _express_out(session: RecordingSteps, o: _New) -> LazyTensor:
    """A lazy tensor the express replay made for a taped result: no autograd graph behind it."""
    t = make_subclass(LazyTensor, o.shape, strides=o.stride, dtype=o.dtype, device=o.device, requires_grad=o.requires_grad)
    t._fake, t._var, t._session, t._express, t._shadow = None, o.var, session, True, None  # (its slots)
    session.alive[o.var] = weakref.ref(t)
    return t

_GUARDS = itertools.count()

def _never(session: Any, func: Any, args: tuple, kwargs: dict | None) -> Any:
    """The guard of a call the express replay does not replay (a backward, a call not express)."""
    return MISS


_TENSOR_BACKWARD = torch.Tensor.backward


def _backward_guard(call: Call) -> Callable:
    """The guard of a taped backward: ``loss.backward()`` runs its generated backward
    (``express._compile_backward``, made at the first replay through the full path) without torch's call
    going through ``__torch_function__``'s dispatch first. Anything else, or a backward not generated yet
    or made for another marker, takes the full path (which tries the same backward first)."""

    def guard(session: Any, func: Any, args: tuple, kwargs: dict | None) -> Any:
        if func is not _TENSOR_BACKWARD or not args:
            return MISS
        run = call.backward
        if run is None or run.mark is not session.recording.steps[call.mark].out:
            return MISS
        return None if run(session, args, kwargs or NO_KWARGS, [args[0]]) else MISS

    return guard


def express_guards(recording: Any, tape: list) -> list:
    """A guard per call of ``tape`` (the recording's), made once per tape: the express replay's first check
    of each torch function on a lazy tensor calls the one at the session's position. The tape's later calls
    (taped after these were made) and anything a guard refuses go through the full path."""
    guards = recording.guards
    if guards is None or guards[0] is not tape:
        made = [
            (call.guard or call.compile_guard()) if call.express and call.mark < 0 and call.func is not BACKWARD
            else _backward_guard(call) if call.express and call.mark >= 0
            else _never
            for call in tape
        ]
        guards = recording.guards = (tape, made)
    return guards[1]


def _compile_guard(call: Call) -> Callable:
    """The taped call's match as straight-line Python, as dynamo compiles its guards: the function, grad
    mode and autocast (off) as taped, each argument unpacked (nested lists and tuples too) and compared with
    the taped one in place; then the constants bound, the lazy results made, and the session moved on.
    ``guard(session, func, args, kwargs)`` returns the result, or MISS."""
    key = call.key
    env: dict[str, Any] = {
        "MISS": MISS, "LazyTensor": LazyTensor, "Tensor": torch.Tensor, "_weakref": weakref.ref,
        "_make": make_subclass, "_map_out": _map_out, "call": call, "views": call.views, "view_entries": call.views.entries,
        "_graph_ok": _graph_ok, "_grad_enabled": torch.is_grad_enabled, "_any_autocast": torch._C._is_any_autocast_enabled,
    }

    def const(x: Any) -> str:
        name = f"_k{len(env)}"
        env[name] = x
        return name

    base = call.slots_before
    func = const(call.func)
    # The real tensors the call takes anew, bound to slots once every check passed: locals, or a list where
    # an argument's autograd graph adds its leaves (_graph_ok).
    graphs = any(type(k) is Real and k.graph is not None for k in key)
    new: list[str] = []
    lines = [
        "def guard(session, func, args, kwargs):",
        f"    if func is not {func} and func != {func}: return MISS",
        f"    if _grad_enabled() is not {call.grad!r} or _any_autocast(): return MISS",
        f"    slots = session.slots\n    if len(slots) != {base}: return MISS" + ("\n    new = []" if graphs else ""),
    ]
    pos = 1  # the next element of the key

    def take(source: str) -> None:
        # The key element at ``pos`` against the argument ``source`` evaluates to; as local x<pos>.
        nonlocal pos
        k, x = key[pos], f"x{pos}"
        pos += 1
        lines.append(f"    {x} = {source}")
        kind = type(k)
        if kind is tuple:  # a nested list or tuple: (type, length), then its items
            lines.append(f"    if type({x}) is not {const(k[0])} or len({x}) != {k[1]}: return MISS")
            for j in range(k[1]):
                take(f"{x}[{j}]")
        elif kind is Var:
            lines.append(
                f"    if type({x}) is not LazyTensor or {x}._var is not {const(k)} or {x}._session is not session"
                f" or {x}._shadow is not None: return MISS"
            )
        elif kind is Real:
            lines.append(f"    if type({x}) is LazyTensor or not isinstance({x}, Tensor): return MISS")
            if k.same:
                other = f"slots[{k.slot}]" if k.slot < base else f"new[{k.slot - base}]" if graphs else new[k.slot - base]
                lines.append(f"    if {x} is not {other}: return MISS")
            else:
                shape, stride, dtype, device, requires_grad = k.meta
                # (On the host, is_cpu says it without making a torch.device to compare.)
                other_device = f"not {x}.is_cpu" if device == _CPU else f"{x}.device != {const(device)}"
                lines.append(
                    f"    if {x}.shape != {const(shape)} or {x}.dtype is not {const(dtype)} or {x}.stride() != {stride!r}"
                    f" or {other_device} or {x}.requires_grad is not {requires_grad!r}: return MISS"
                )
                if graphs:
                    lines.append(f"    new.append({x})")
                else:
                    new.append(x)
                if k.graph is not None:
                    lines.append(f"    if not _graph_ok(session, {x}, {const(k.graph)}, new, {base}, {k.slot}): return MISS")
                elif requires_grad:  # a leaf (a parameter)
                    lines.append(f"    if {x}.grad_fn is not None: return MISS")
            if k.value is not None:
                lines.append(f"    if {x}.item() != {const(k.value)}: return MISS")
        elif k is None or kind is bool:
            lines.append(f"    if {x} is not {k!r}: return MISS")
        else:
            lines.append(f"    if type({x}) is not {const(kind)} or {x} != {const(k)}: return MISS")

    nargs = key[0]
    lines.append(f"    if len(args) != {nargs}: return MISS")
    for i in range(nargs):
        take(f"args[{i}]")
    names = key[pos] if pos < len(key) else ()
    pos += 1
    if names:
        lines.append(f"    if kwargs is None or len(kwargs) != {len(names)}: return MISS")
    else:
        lines.append("    if kwargs: return MISS")
    for name in names:
        take(f"kwargs.get({name!r}, MISS)")
    if graphs:
        lines.append("    if new: slots.extend(new)")
    elif new:
        lines.append(f"    slots.extend(({', '.join(new)},))")
    for _, t, version in call.made:  # never handed out; a change in place would be a bug, not a new value
        lines.append(f"    if {const(t)}._version != {version}: return MISS")
    if call.consts or call.rereads or call.made:
        lines.append("    consts = session.consts\n    versions = session.versions")
    for var in map(const, call.rereads):  # bound before the last flush: bound again, as it is now
        lines.append(f"    if {var} not in versions: versions[{var}] = consts[{var}]._version")
    for j, (var, i, view) in enumerate(call.consts):
        if view is None:
            lines.append(f"    consts[{const(var)}] = x{i}")
        else:  # the view kept from the step before while its base and data pointer are the same (_Views.get)
            lines.append(
                f"    h = view_entries.get({j})\n"
                f"    consts[{const(var)}] = h[2] if h is not None and h[0]() is x{i} and h[1] == x{i}.data_ptr()"
                f" else views.get({j}, x{i}, {const(view)})"
            )
        lines.append(f"    versions[{const(var)}] = x{i}._version")
    for var, t, version in call.made:
        lines.append(f"    consts[{const(var)}] = {const(t)}\n    versions[{const(var)}] = {version}")
    for i, var in call.mutated:
        lines.append(f"    x{i}._var = {const(var)}\n    session.alive[{const(var)}] = _weakref(x{i})")
    lines.append(f"    session.cursor += {call.nsteps}\n    session.end += {call.neqns}\n    session.tape_pos += 1")
    if call.draws:
        lines.append("    session.draws_due()")
    if call.func is torch.nn.functional.batch_norm:  # BatchNorm's forward counted the batch just before it
        lines.append("    session.count_batch(4)")  # (one frame deeper than from __torch_function__)
    out = call.out
    if call.write:
        lines.append("    return session._express_write(call, args, kwargs)")
    elif type(out) is _New:
        # Contiguous strides are what the constructor makes without them (parsing them cost ~15% of it).
        strides = "" if has_contiguous_strides(out.shape, out.stride) else f" strides={out.stride!r},"
        # The host and no grad are the constructor's defaults (whatever torch.set_default_device says): not passed.
        device = "" if out.device == _CPU else f", device={const(out.device)}"
        grad = ", requires_grad=True" if out.requires_grad else ""
        lines.append(
            f"    t = _make(LazyTensor, {const(out.shape)},{strides} dtype={const(out.dtype)}{device}{grad})\n"
            f"    t._fake = None\n    t._var = {const(out.var)}\n    t._session = session\n    t._express = True\n    t._shadow = None\n"
            f"    session.alive[{const(out.var)}] = _weakref(t)\n    return t"
        )
    elif type(out) is _Arg:
        lines.append(f"    return x{out.index}")
    else:
        leaves = ", ".join(f"x{i}" if type(k) is not tuple and i else "None" for i, k in enumerate(key))
        lines.append(f"    return _map_out(call.out, [{leaves}], session)")
    source = "\n".join(lines) + "\n"
    filename = f"<stagetorch guard {next(_GUARDS)}: {getattr(call.func, '__name__', call.func)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), env)  # noqa: S102 - code generated from the tape
    return env["guard"]

def has_contiguous_strides(shape: Any, stride: Any) -> bool:
    """Whether ``stride`` is what ``_make_wrapper_subclass`` makes for ``shape`` when given no strides."""
    return tuple(torch.empty(shape, device="meta").stride()) == tuple(stride)

def _graph_ok(session: RecordingSteps, x: torch.Tensor, graph: Graph, new: list, base: int, slot: int) -> bool:
    """Whether the autograd graph behind real argument ``x`` is the taped one (node types, saved values,
    leaves: the same tensor where the tape had one, the same metadata where it took a new one). Its new
    leaves are appended to ``new``, the slots the guard is about to take."""
    leaves, kinds, nodes = autograd_graph([x])
    if kinds != graph.kinds or len(leaves) != len(graph.leaves) or session._saved_state(nodes)[0] != graph.saved:
        return False
    slots = session.slots
    for leaf, (s, same, meta) in zip(leaves, graph.leaves):
        if same:
            if (slots[s] if s < base else new[s - base]) is not leaf:
                return False
        elif s != base + len(new) or tensor_meta(leaf) != meta or leaf.grad_fn is not None:
            return False
        else:
            new.append(leaf)
    session.graph_nodes[slot] = nodes
    return True

def refuse_stranded(args: tuple, kwargs: dict) -> None:
    outputs = kwargs.get("outputs", args[0] if args else ())
    roots = [t for t in flatten(outputs) if isinstance(t, torch.Tensor)]
    with torch._C.DisableTorchFunctionSubclass():
        if any(type(t) is LazyTensor and t._express for t in autograd_graph(roots)[0]):
            raise NotImplementedError(
                "stagetorch.lazy: torch.autograd.grad over a torch.autograd.Function that this step called "
                "and the step stagetorch recorded did not: call loss.backward() instead, or apply the Function "
                "in every step"
            )

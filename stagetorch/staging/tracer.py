"""The tracer: runs a function on fake tensors under a dispatch mode and records the ATen calls as a Graph.

It stages forward *and* backward: autograd emits its backward ATen calls through the same mode. It knows
the IR and the errors; it knows nothing about memory, batching or execution.

Real state is never touched. The parameters and buffers of every module the function refers to (a global,
a closure variable, ``self``, an argument) are swapped for fake copies for the duration of the trace, so
autograd accumulates into fake ``.grad`` and in-place buffer updates land on fakes. Real tensors that reach
an op anyway are lifted into the graph as constants.
"""

from __future__ import annotations

import collections
import contextlib
import dis
import enum
import functools
import inspect
import linecache
import logging
import os
import sys
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import torch
import torch.nn.modules.module as _module_globals
import torch.utils._pytree as pytree
from torch._prims_common import suggest_memory_format
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import ConcretizationError, ShapeError, StagingError, UnsupportedOpError
from ..ir import Aval, Eqn, Graph, Literal, SourceInfo, Var, iter_vars, op_name
from ..registry import NO_TENSOR, slot
from ..utils import caches, collector
from ..utils.tree import flat_call, flatten, map_leaves
from .host_reads import HostProgram, HostTrace, mask_positions

__all__ = ["trace", "discover", "State", "Recorder", "user_frame", "is_user_code", "mark_internal", "source_info"]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_DIR = os.path.dirname(__file__) + os.sep
_USER_FILES_IN_PACKAGE = ("demo.py",)


def _is_internal(path: str) -> bool:
    if path.startswith(_TORCH_DIR) or path.startswith("<frozen"):
        return True
    return path.startswith(_OWN_DIR) and os.path.basename(path) not in _USER_FILES_IN_PACKAGE


_INTERNAL_CODE: dict[types.CodeType, bool] = {}


def user_frame(depth: int = 1) -> types.FrameType | None:
    """The innermost frame outside torch and stagetorch: the line of user (or model library) code."""
    f = sys._getframe(depth)
    while f is not None:
        code = f.f_code
        internal = _INTERNAL_CODE.get(code)
        if internal is None:
            internal = _INTERNAL_CODE[code] = _is_internal(code.co_filename)
        if not internal:
            return f
        f = f.f_back
    return None


def is_user_code(code: types.CodeType) -> bool:
    """Whether ``code`` is user (or model library) code: outside torch and stagetorch."""
    internal = _INTERNAL_CODE.get(code)
    if internal is None:
        internal = _INTERNAL_CODE[code] = _is_internal(code.co_filename)
    return not internal


def mark_internal(code: types.CodeType) -> None:
    """Count ``code`` as stagetorch's own: :func:`user_frame` looks past its frames (a wrapper that stands in
    for a stagetorch method, such as a test's counting wrapper, is not the user's line)."""
    _INTERNAL_CODE[code] = True


def source_info(module: str = "", backward: str = "") -> SourceInfo:
    f = user_frame(2)
    if f is None:
        return SourceInfo(module=module, backward=backward)
    return SourceInfo(f.f_code.co_filename, f.f_lineno, f.f_code.co_name, module, backward)


def _code_line(src: SourceInfo) -> str:
    text = linecache.getline(src.file, src.line).strip()
    return f"\n    {text}" if text else ""


@contextlib.contextmanager
def _no_grad_read_warning() -> Iterator[None]:
    """Describing a non-leaf (an argument computed before the call, a detached view of one), torch's meta
    converter reads its .grad, and warns about that read: the read is torch's, not the user's."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The .grad attribute of a Tensor that is not a leaf", UserWarning)
        yield


def _grad_of_another_shape(t: torch.Tensor) -> bool:
    """Whether leaf ``t`` holds a ``.grad`` whose shape is not its own (its ``.data`` was replaced since)."""
    grad = t.grad
    return grad is not None and grad.shape != t.shape


def _is_leaf(t: torch.Tensor) -> bool:
    """``t.is_leaf``; False for a view made under no_grad whose base was changed in place since, whose
    autograd metadata torch refuses to read (a weight a replayed lazy step transposed, recorded again after
    ``optimizer.step()``): its value is still a value, and is lifted as one."""
    try:
        return t.is_leaf
    except RuntimeError:
        return False


# ---------------------------------------------------------------------------------------------------------
# Discovery: what real state a function refers to.


@attrs.define
class State:
    """The real tensors a function closes over, in a fixed order, and the Python values it may read.

    ``modules`` are (name, module) roots; ``tensors`` are (name, tensor) for tensors referred to directly,
    with ``setters`` that rebind each reference (a closure cell, a global, an attribute) for the swap.
    ``values`` are (name, value) for the Python scalars found on the way (a global float, a closure cell, a
    default argument, an attribute of a user object): a trace bakes them in, so they are part of its key,
    as the scalar attributes of every module are (see :meth:`tensors_and_key`).
    """

    modules: list[tuple[str, torch.nn.Module]] = attrs.field(factory=list)
    tensors: list[tuple[str, torch.Tensor]] = attrs.field(factory=list)
    setters: list[list[Callable[[Any], None]]] = attrs.field(factory=list)
    values: list[tuple[str, Any]] = attrs.field(factory=list)
    optimizers: list[tuple[str, torch.optim.Optimizer]] = attrs.field(factory=list)
    # LR schedulers the function names: not state a trace reads, but Python state a ``step()`` inside it moves.
    schedulers: list[Any] = attrs.field(factory=list)

    def named_state(self) -> Iterator[tuple[str, str, torch.Tensor]]:
        """(role, name, tensor) for every parameter, buffer and tensor, each tensor once."""
        seen: set[int] = set()
        for prefix, m in self.modules:
            for name, p in m.named_parameters(remove_duplicate=True):
                if id(p) not in seen:
                    seen.add(id(p))
                    yield "param", _join(prefix, name), p
        for prefix, m in self.modules:
            for name, b in m.named_buffers(remove_duplicate=True):
                if id(b) not in seen:
                    seen.add(id(b))
                    yield "buffer", _join(prefix, name), b
        for name, t in self.tensors:
            if id(t) not in seen:
                seen.add(id(t))
                yield ("param" if t.requires_grad else "const"), name, t

    def tensors_and_key(self, reads: Any = None) -> tuple[list[torch.Tensor], tuple]:
        """The tensors of :meth:`named_state` (same order) and the key of everything a trace of the
        function assumed about its state, in one walk: what a call of a staged function needs (while
        nothing changes, :class:`stagetorch.staging.guards.StateWalk` reuses it).

        The key holds each tensor's identity and metadata (strides included), every module's scalar attributes (``training``,
        ``Dropout.p``, ``eps``, a user's ``self.scale``: whatever a forward may read and bake into the
        trace) and the scalars of :attr:`values`. ``reads`` (a :class:`stagetorch.staging.guards.Reads`) is told
        what the walk read: a read added here is added to ``Reads.modules``."""
        subs = [sub for _, m in self.modules for sub in m.modules()]
        seen: set[int] = set()
        tensors = []
        for store in ("_parameters", "_buffers"):
            for sub in subs:
                for t in getattr(sub, store).values():
                    if t is not None and id(t) not in seen:
                        seen.add(id(t))
                        tensors.append(t)
        for _, t in self.tensors:
            if id(t) not in seen:
                seen.add(id(t))
                tensors.append(t)
        # Strides too: ``model.to(memory_format=torch.channels_last)`` keeps each parameter and swaps its
        # data, and a program staged for the old layout views the new one wrongly (or fails).
        avals = tuple((id(t), t.shape, t.dtype, t.device, t.requires_grad, t.stride()) for t in tensors)
        scalars = tuple([_scalar_items(sub.__dict__) for sub in subs])
        # A hook's tensor math is staged with the step, so adding or removing one stages again.
        # (The checks are spelled out: this runs for every module and tensor on every call.)
        hooks = tuple(
            [(i, _hook_ids(sub, _MODULE_HOOKS)) for i, sub in enumerate(subs)
             if (d := sub.__dict__)["_forward_hooks"] or d["_forward_pre_hooks"] or d["_backward_hooks"] or d["_backward_pre_hooks"]]
            + [(-1 - i, _hook_ids(t, _TENSOR_HOOKS)) for i, t in enumerate(tensors)
               if t._backward_hooks or t._post_accumulate_grad_hooks]
        )
        if _module_globals._global_forward_hooks or _module_globals._global_forward_pre_hooks or \
                _module_globals._global_backward_hooks or _module_globals._global_backward_pre_hooks:
            hooks += ((None, _hook_ids(_module_globals, tuple(f"_global{store}" for store in _MODULE_HOOKS))),)
        values = list(self.values)
        for cls in dict.fromkeys(type(sub) for sub in subs):
            read = _CLASS_GLOBALS.get(cls)
            if read is None:
                read = _CLASS_GLOBALS[cls] = _class_globals(cls)
            values += [(name, _as_key(g.get(key))) for name, g, key in read]
        if reads is not None:
            reads.modules(subs, tensors)
        return tensors, (avals, scalars, tuple(values), hooks)

    def snapshot(self) -> Callable[[], None]:
        """Record the Python values a trace could change (the scalar attributes of every module, every
        optimizer's hyperparameters, every LR scheduler's attributes); return what puts them back."""
        modules = [(sub, {k: x for k, x in sub.__dict__.items() if type(x) in _KEYABLE})
                   for _, m in self.modules for sub in m.modules()]
        groups = [(group, {k: x for k, x in group.items() if k != "params"})
                  for _, opt in self.optimizers for group in opt.param_groups]
        schedulers = [(sch, dict(vars(sch))) for sch in self.schedulers]

        def restore() -> None:
            for sub, items in modules:
                sub.__dict__.update(items)
            for group, items in groups:
                group.update(items)
            for sch, items in schedulers:
                vars(sch).update(items)

        return restore

    def changes(self, old: tuple, new: tuple) -> list[str]:
        """What differs between two keys of :meth:`tensors_and_key` for the same function, in words."""
        (old_avals, old_scalars, old_values, old_hooks), (avals, scalars, values, hooks) = old, new
        out = []
        if old_avals != avals:
            out.append("its parameters, buffers or optimizer state (a new tensor, shape, strides, dtype, device or requires_grad)")
        if old_hooks != hooks:
            out.append("the hooks on its modules or parameters (one added or removed)")
        names = [_join(prefix, name) if name else prefix for prefix, m in self.modules for name, _ in m.named_modules()]
        if len(old_scalars) != len(scalars):
            out.append("its modules")
        else:
            for name, was, now in zip(names, old_scalars, scalars):
                if was != now:
                    as_dict = lambda items: {k: (kind, x) for k, kind, x in items}  # noqa: E731
                    out += _diff(as_dict(was), as_dict(now), f"{name}." if name else "")
        out += _diff(dict(old_values), dict(values), "")
        return out


_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_TENSOR_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")


def _hook_ids(x: Any, stores: tuple[str, ...]) -> tuple:
    return tuple(tuple(getattr(x, store) or ()) for store in stores)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


# Values a trace may bake in and a key can hold: Python scalars and short tuples or lists of them.
_SCALARS = frozenset({int, float, bool, str, complex, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format})
_MAX_SCALARS = 16


def _as_key(x: Any) -> Any:
    """``x`` as a key entry if it is a scalar (its type kept, so 1 and 1.0 stay apart), else None."""
    kind = type(x)
    if kind in _SCALARS:
        return (kind, x)
    if (kind is tuple or kind is list) and len(x) <= _MAX_SCALARS and all(type(y) in _SCALARS for y in x):
        return (kind, tuple((type(y), y) for y in x))
    if isinstance(x, enum.Enum):
        return (kind, x)
    return None


_KEYABLE = _SCALARS | {tuple, list}


def _scalar_items(d: dict) -> tuple:
    """(name, type, value) for the scalar entries of a module's ``__dict__``. This runs for every module on
    every call, so the common case is one comprehension; the rare tuple or list is checked after."""
    items = [(k, type(x), x) for k, x in d.items() if type(x) in _KEYABLE]
    for i, (k, kind, x) in enumerate(items):
        if kind is tuple or kind is list:
            items[i] = (k, kind, _as_key(x))
    return tuple(items)


_CLASS_GLOBALS: dict[type, list[tuple[str, dict, str]]] = {}


def _class_globals(cls: type) -> list[tuple[str, dict, str]]:
    """(name, globals dict, key) for each scalar global that a user's module class reads from ``forward``
    (``TEMPERATURE``), from the methods of the class that ``forward`` names, and from the functions they
    name, to a small depth."""
    out: list[tuple[str, dict, str]] = []
    seen: set[Any] = set()
    methods: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if not klass.__module__.startswith("torch"):
            for name, attr in vars(klass).items():
                methods[name] = getattr(attr, "__func__", getattr(attr, "fget", attr))  # static/class methods, properties

    def scan(f: Any, depth: int) -> None:
        if not isinstance(f, types.FunctionType) or id(f) in seen or _is_internal(f.__code__.co_filename):
            return
        seen.add(id(f))
        if depth < _MAX_DEPTH:
            for name in _used_names(f.__code__):  # self.helper() loads "helper" as an attribute
                if name in methods:
                    scan(methods[name], depth + 1)
        g = f.__globals__
        for name in _global_names(f.__code__):
            if name not in g or name.startswith("__") or (id(g), name) in seen:
                continue
            seen.add((id(g), name))
            if _as_key(g[name]) is not None:
                out.append((name, g, name))
            elif depth < _MAX_DEPTH:
                scan(g[name], depth + 1)

    scan(methods.get("forward"), 1)
    return out


def _diff(was: dict, now: dict, prefix: str) -> list[str]:
    def shown(d: dict, k: str) -> str:
        if k not in d:
            return "(unset)"
        return "(not a scalar)" if d[k] is None else repr(d[k][1])

    return sorted(f"{prefix}{k} {shown(was, k)} -> {shown(now, k)}" for k in was.keys() | now.keys() if was.get(k) != now.get(k))


_MAX_DEPTH = 3


# Tensor types that stand for a value held elsewhere (one-line mode's LazyTensor registers itself): a
# staged function that reads one, as an argument or through a global, reads the real tensor it holds.
# Each maps (tensor, the user's name for it) to that tensor, or raises a StagingError saying what to do.
HELD: dict[type, Callable[[torch.Tensor, str], torch.Tensor]] = {}


def held_values(leaves: list, names: Callable[[], Sequence[str]]) -> list:
    """``leaves`` with each tensor of a ``HELD`` type replaced by the real tensor it holds (``names``: the
    leaves' names, asked for only when there is one)."""
    if not any(type(x) in HELD for x in leaves):
        return leaves
    return [HELD[type(x)](x, name) if type(x) in HELD else x for x, name in zip(leaves, names())]


def discover(fn: Callable, args: Sequence = (), kwargs: dict | None = None, reads: Any = None) -> State:
    """Find the modules and tensors ``fn`` refers to: closure, globals it names, ``self``, defaults, args.

    ``reads`` (a :class:`stagetorch.staging.guards.Reads`) is told every mutable place the walk reads and what it
    found there, so that a later call can tell that a new walk would find the same (the modules of the
    arguments aside: the caller checks those)."""
    state = State()
    seen: set[int] = set()

    def add_tensor(name: str, t: torch.Tensor, setter: Callable[[Any], None] | None) -> None:
        hold = HELD.get(type(t))
        if hold is not None:
            if reads is not None:
                reads.unguardable()  # the tensor it holds can change while it stays the same object
            held, t = hold(t, name), t
            if setter is not None:  # the swap's undo puts back the user's tensor, not the one it holds
                setter = _putting_back(setter, held, t)
            t = held
        for i, (_, known) in enumerate(state.tensors):
            if known is t:
                if setter is not None:
                    state.setters[i].append(setter)
                return
        state.tensors.append((name, t))
        state.setters.append([setter] if setter is not None else [])

    def visit(name: str, obj: Any, depth: int, setter: Callable[[Any], None] | None = None) -> None:
        if isinstance(obj, torch.Tensor):
            add_tensor(name, obj, setter)
            return
        value = _as_key(obj)
        if value is not None:
            if reads is not None and type(obj) is list:
                reads.contents(obj)  # the value is its items'
            state.values.append((name, value))
            return
        if id(obj) in seen or depth > _MAX_DEPTH:
            return
        if reads is not None:
            reads.type(obj)  # what the walk does with it
        if isinstance(obj, torch.nn.Module):
            seen.add(id(obj))
            state.modules.append((name, obj))
            return
        if isinstance(obj, torch.optim.Optimizer):
            seen.add(id(obj))
            visit_optimizer(name, obj)
            return
        if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
            seen.add(id(obj))
            state.schedulers.append(obj)
            return
        if isinstance(obj, (types.FunctionType, types.MethodType, functools.partial)):
            seen.add(id(obj))
            visit_callable(name, obj, depth)
            return
        if reads is not None and isinstance(obj, (list, dict)):
            reads.contents(obj)
        if isinstance(obj, (list, tuple)) and len(obj) <= 256:
            seen.add(id(obj))
            for i, x in enumerate(obj):
                visit(f"{name}[{i}]", x, depth + 1, _item_setter(obj, i) if isinstance(obj, list) else None)
            return
        if isinstance(obj, dict) and len(obj) <= 256:
            seen.add(id(obj))
            for k, x in obj.items():
                visit(f"{name}[{k!r}]", x, depth + 1, _item_setter(obj, k))
            return
        if depth <= 1 and _is_user_object(obj):
            seen.add(id(obj))
            if reads is not None:
                reads.attr(obj, "__dict__")
                reads.contents(vars(obj))
            for k, x in vars(obj).items():
                visit(_join(name, k), x, depth + 1, _attr_setter(obj, k))

    def visit_optimizer(name: str, opt: torch.optim.Optimizer) -> None:
        """An optimizer's parameters, its state tensors and its hyperparameters (``lr`` set by a scheduler
        included) are the step's state like a module's."""
        state.optimizers.append((name, opt))
        if reads is not None:
            reads.attr(opt, "param_groups")
            reads.attr(opt, "state")
            reads.contents(opt.param_groups)
        k = 0
        for g, group in enumerate(opt.param_groups):
            if reads is not None:
                reads.contents(group)
                reads.contents(group["params"])
            for key, x in group.items():
                if key != "params":
                    visit(f"{name}.param_groups[{g}][{key!r}]", x, _MAX_DEPTH)
            params = group["params"]
            for j, p in enumerate(params):
                add_tensor(f"{name}.param_groups[{g}]['params'][{j}]", p, _item_setter(params, j))
                if reads is not None:
                    reads.item(opt.state, p)
                    if p in opt.state:
                        reads.contents(opt.state[p])
                for key, x in opt.state.get(p, {}).items():
                    visit(f"{name}.state[{k}][{key!r}]", x, _MAX_DEPTH)
                k += 1

    def visit_callable(name: str, f: Any, depth: int) -> None:
        if isinstance(f, functools.partial):
            if reads is not None:
                reads.contents(f.keywords)
            visit_callable(name, f.func, depth)
            for i, a in enumerate(f.args):
                visit(f"{name}.args[{i}]", a, depth + 1)
            for k, a in f.keywords.items():
                visit(k, a, depth + 1)
            return
        if isinstance(f, types.MethodType):
            visit("self" if depth == 0 else _join(name, "self"), f.__self__, depth)
            f = f.__func__
        if not isinstance(f, types.FunctionType):
            return
        if reads is not None:
            reads.attr(f, "__code__")
        if _is_internal(f.__code__.co_filename):
            return
        if reads is not None:
            reads.attr(f, "__defaults__")
            reads.attr(f, "__kwdefaults__")
            if f.__kwdefaults__:
                reads.contents(f.__kwdefaults__)
        if f.__closure__:
            for var, cell in zip(f.__code__.co_freevars, f.__closure__):
                try:
                    value = cell.cell_contents
                except ValueError:
                    if reads is not None:
                        reads.unguardable()  # an empty cell: cheaper to walk again than to check apart
                    continue
                if reads is not None:
                    reads.cell(cell, value)
                visit(var, value, depth + 1, _cell_setter(cell))
        g = f.__globals__
        for gname in _global_names(f.__code__):
            if reads is not None:
                reads.item(g, gname)
            if gname in g:
                visit(gname, g[gname], depth + 1, _item_setter(g, gname))
        for i, d in enumerate(f.__defaults__ or ()):
            visit(f"default{i}", d, depth + 1)
        for k, d in (f.__kwdefaults__ or {}).items():
            visit(k, d, depth + 1)

    if isinstance(fn, torch.nn.Module):
        seen.add(id(fn))
        state.modules.append(("", fn))
    else:
        visit_callable(getattr(fn, "__name__", "fn"), fn, 0)
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            continue
        for leaf in pytree.tree_leaves(a):
            if isinstance(leaf, torch.nn.Module) and id(leaf) not in seen:
                seen.add(id(leaf))
                state.modules.append((arg_names(fn, len(args))[i], leaf))
    for k, a in (kwargs or {}).items():
        for leaf in pytree.tree_leaves(a):
            if isinstance(leaf, torch.nn.Module) and id(leaf) not in seen:
                seen.add(id(leaf))
                state.modules.append((k, leaf))
    return state


# The opcodes that load a name from the module's globals (LOAD_NAME in a class body or module code;
# LOAD_FROM_DICT_OR_GLOBALS from Python 3.12). Their argval is the name in every version.
_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_FROM_DICT_OR_GLOBALS"})


# id(code) -> (code, its global names). Keyed by id, the code kept alive beside: hashing a code object
# hashes its bytecode and constants, and discovery asks on every call of a staged function.
_GLOBAL_NAMES: dict[int, tuple[types.CodeType, tuple[str, ...]]] = {}
caches.on_clear(_GLOBAL_NAMES.clear)


def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """The names ``code`` loads as globals, its nested code objects' (comprehensions, lambdas, inner
    functions) included. Not ``co_names``, which holds attribute names too: ``outputs.loss`` would make a
    module-level ``loss`` an input of the program."""
    known = _GLOBAL_NAMES.get(id(code))
    if known is not None and known[0] is code:
        return known[1]
    names = dict.fromkeys(i.argval for i in dis.get_instructions(code) if i.opname in _GLOBAL_LOADS)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names.update(dict.fromkeys(_global_names(c)))
    _GLOBAL_NAMES[id(code)] = (code, tuple(names))
    return _GLOBAL_NAMES[id(code)][1]


def _used_names(code: types.CodeType) -> Iterator[str]:
    """Every name ``code`` and its nested code objects load, attributes and methods included."""
    yield from code.co_names
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _used_names(c)


def _is_user_object(obj: Any) -> bool:
    if isinstance(obj, (type, types.ModuleType, str, bytes, int, float, complex, bool)) or obj is None:
        return False
    mod = type(obj).__module__ or ""
    return hasattr(obj, "__dict__") and not mod.startswith(("torch", "builtins", "numpy"))


def _cell_setter(cell: types.CellType) -> Callable[[Any], None]:
    def set_cell(v: Any) -> None:
        cell.cell_contents = v

    return set_cell


def _putting_back(set_ref: Callable[[Any], None], held: torch.Tensor, original: Any) -> Callable[[Any], None]:
    def set_or_put_back(v: Any) -> None:
        set_ref(original if v is held else v)

    return set_or_put_back


def _item_setter(container: Any, key: Any) -> Callable[[Any], None]:
    def set_item(v: Any) -> None:
        container[key] = v

    return set_item


def _attr_setter(obj: Any, name: str) -> Callable[[Any], None]:
    def set_attr(v: Any) -> None:
        object.__setattr__(obj, name, v)

    return set_attr


def arg_names(fn: Callable, n: int) -> list[str]:
    try:
        params = [
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        params = []
    return [params[i] if i < len(params) else f"arg{i}" for i in range(n)]


# ---------------------------------------------------------------------------------------------------------
# The trace itself.


class Recorder:
    """The mutable state of one trace. Every fake tensor it sees is kept alive, so ids stay unique.

    ``jit``'s trace and each ``lazy`` session that records use one: :meth:`record` stages one ATen call on
    fake tensors into ``eqns``, lifting the real tensors it meets to constant inputs (``consts``, with the
    input each became in ``const_vars``); :meth:`var` is the variable of a fake tensor it made."""

    def __init__(self, fake_mode: FakeTensorMode):
        self.fake_mode = fake_mode
        self.var_of: dict[int, Var] = {}
        self.storage_owner: dict[int, Var] = {}
        self.keep: list[torch.Tensor] = []
        self.eqns: list[Eqn] = []
        self.invars: list[Var] = []
        self.roles: list[str] = []
        self.names: list[str] = []
        self.fakes: list[torch.Tensor] = []
        self.consts: list[torch.Tensor] = []
        self.lifted: dict[int, torch.Tensor] = {}
        self.const_vars: dict[int, Var] = {}  # id of a lifted real tensor -> the input it became
        self.grad_leaks: list[tuple[torch.Tensor, Any, SourceInfo]] = []
        self.module_names: dict[int, str] = {}
        self.module_stack: list[str] = []
        # Host-known values and the reads of them (jit's traces; a lazy session reads values for real instead).
        self.host: HostTrace | None = None

    def new_var(self, t: torch.Tensor) -> Var:
        untyped = t.untyped_storage()
        storage = untyped._cdata
        owner = self.storage_owner.get(storage)
        if owner is None:
            v = Var(Aval.of(t), storage_nbytes=untyped.nbytes(), strides=t.stride())
            self.storage_owner[storage] = v
        else:
            v = Var(Aval.of(t), base=owner, strides=t.stride())
        self.var_of[id(t)] = v
        self.keep.append(t)
        return v

    def add_input(self, fake: torch.Tensor, role: str, name: str) -> Var:
        # from_tensor copies a real .grad onto the fake; the staged program starts from none and the
        # executor accumulates into the real .grad as autograd would.
        fake.grad = None
        v = self.new_var(fake)
        self.invars.append(v)
        self.roles.append(role)
        self.names.append(name)
        self.fakes.append(fake)
        return v

    def lift(self, t: torch.Tensor) -> torch.Tensor:
        """A real tensor reached an op: make it a constant input of the graph."""
        if isinstance(t, FakeTensor):
            return t
        fake = self.lifted.get(id(t))
        if fake is None:
            # A non-leaf (a weight transposed eagerly, in lazy mode) is lifted as the value it is.
            leaf = _is_leaf(t)
            source = t if leaf else t.detach()
            with self.fake_mode, _no_grad_read_warning():
                try:
                    fake = self.fake_mode.from_tensor(source, static_shapes=True)
                except (AssertionError, RuntimeError) as e:
                    # torch's meta converter rejects some views whose base has a .grad (a transposed
                    # weight after a first backward), and a leaf whose .grad has another shape than it now
                    # has (``p.data = torch.randn(new_shape)`` with the old .grad held, which eager allows:
                    # autograd adds the new gradient into it, broadcasting, or raises there); a fresh fake
                    # with the same layout stands in for it.
                    if isinstance(e, RuntimeError) and not (leaf and _grad_of_another_shape(t)):
                        raise
                    fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
            self.lifted[id(t)] = fake
            self.consts.append(t)
            self.const_vars[id(t)] = self.add_input(fake, "const", f"const{len(self.consts) - 1}")
            if self.host is not None:
                self.host.seed_const(self.const_vars[id(t)], t)
            if t.requires_grad and leaf:
                self.grad_leaks.append((t, t.grad, source_info()))
        return fake

    def constant(self, fake: torch.Tensor) -> torch.Tensor | None:
        """The real tensor behind ``fake`` when the function built it from Python data (``torch.tensor([1,
        3])``, lifted as a constant) and has not changed it in place since; else None."""
        v = self.var_of.get(id(fake))
        if v is None or fake._version != 0:
            return None
        made = next((e for e in reversed(self.eqns) if v in e.outvars), None)
        if made is None or made.prim is not torch.ops.aten.lift_fresh.default:
            return None
        source = made.args[0]
        return next((t for t in self.consts if self.const_vars[id(t)] is source), None)

    def var(self, t: torch.Tensor) -> Var:
        v = self.var_of.get(id(t))
        if v is None:
            raise StagingError(
                f"stagetorch met a fake tensor {Aval.of(t)} that no recorded op produced; "
                "this is a bug in stagetorch, please report it with the code that triggered it"
            )
        return v

    def current_module(self) -> str:
        return self.module_stack[-1] if self.module_stack else ""

    def _bind(self, tree: Any) -> tuple[Any, Any]:
        """(the tree with real tensors lifted to fakes, the tree with Vars for tensors), in one pass."""
        if isinstance(tree, torch.Tensor):
            fake = self.lift(tree)
            return fake, self.var(fake)
        if isinstance(tree, (list, tuple)):
            if not tree:
                return tree, tree
            pairs = [self._bind(x) for x in tree]
            kind = type(tree)
            return kind(p[0] for p in pairs), kind(p[1] for p in pairs)
        return tree, tree

    def record(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict, src: SourceInfo | None = None) -> Any:
        args, in_args = self._bind(args)
        if kwargs:
            bound = {k: self._bind(v) for k, v in kwargs.items()}
            kwargs, in_kwargs = {k: b[0] for k, b in bound.items()}, {k: b[1] for k, b in bound.items()}
        else:
            in_kwargs = {}
        if src is None:
            node = torch._C._current_autograd_node()
            src = source_info(self.current_module(), node.name() if node is not None else "")
        key = _meta_key(func, args, kwargs)
        entry = _META_CACHE.get(key) if key is not None else None
        if entry is not None:
            out = _from_entry(entry, args, self.fake_mode)
        else:
            try:
                out = self._dispatch(func, args, kwargs, src, self.fake_mode)
            except ConcretizationError:
                if self.host is None:
                    raise
                return self._read_on_host(func, args, kwargs, in_args, in_kwargs, src)
            _check_rule(func, args, kwargs, src)
            out = _relayout(func, args, kwargs, out, self.fake_mode)
            out = _unshared(func, out, self.fake_mode)
            if key is not None:
                _remember(key, func, args, out)
        flat = flatten(out)
        if any(isinstance(t, torch.Tensor) and t.layout != torch.strided for t in flat):
            raise UnsupportedOpError(
                f"{op_name(func)} at {src} returns a {next(t.layout for t in flat if isinstance(t, torch.Tensor) and t.layout != torch.strided)} "
                f"tensor; stagetorch stages dense (strided) tensors only.{_code_line(src)}\nWhat to do: keep "
                "sparse work outside the staged function, or convert with .to_dense() before it."
            )
        outvars = tuple(self.new_var(t) if isinstance(t, torch.Tensor) else None for t in flat)
        eqn = Eqn(func, in_args, in_kwargs, outvars, src)
        self.eqns.append(eqn)
        if self.host is not None:
            self.host.note(eqn)
        return out

    def _read_on_host(self, func: Any, args: tuple, kwargs: dict, in_args: tuple, in_kwargs: dict, src: SourceInfo) -> Any:
        """An op that needs a value (``.item()``, ``nonzero``, ``x[mask]``) in a trace that tracks host-known
        values (see :mod:`stagetorch.staging.host_reads`): run for real where its inputs are host-known, its outcome a read
        the program is chosen by; else a ConcretizationError naming the line."""
        host = self.host
        assert host is not None
        ins = list(iter_vars((in_args, in_kwargs)))
        masks = _host_masks(func, in_args, host)
        if masks is not None:
            # x[mask] over a host-known mask: x[positions], the positions found on the host and fed as inputs.
            mask_vars = tuple(in_args[1][d] for d in masks)
            positions = host.call(Eqn(mask_positions, mask_vars, {}, (), src))
            fakes = [self.lift(t) for t in positions]
            host.shaped(Eqn(mask_positions, mask_vars, {}, tuple(self.var(f) for f in fakes), src), positions, src)
            indices, it = [], iter(fakes)
            for d, index in enumerate(args[1]):
                if d in masks:
                    indices += [next(it) for _ in range(index.ndim)]
                else:
                    indices.append(index)
            return self.record(func, (args[0], indices, *args[2:]), kwargs, src)
        if host.is_known(ins):
            real = host.call(Eqn(func, in_args, in_kwargs, (), src))
            if not any(isinstance(t, torch.Tensor) for t in flatten(real)):
                host.read(Eqn(func, in_args, in_kwargs, (None,), src), real, src)
                return real
            # A shape made from data (nonzero, unique): the whole batch's value, fed to the program as an input.
            out = map_leaves(real, torch.Tensor, self.lift)
            outvars = tuple(self.var(t) if isinstance(t, torch.Tensor) else None for t in flatten(out))
            host.shaped(Eqn(func, in_args, in_kwargs, outvars, src), real, src)
            return out
        raise ConcretizationError(_host_read_message(func, src))

    @staticmethod
    def _dispatch(func: Any, args: tuple, kwargs: dict, src: SourceInfo, mode: FakeTensorMode) -> Any:
        """Run the fake kernel; its failures become stagetorch's named errors, except where an explicit
        shape rule accepts what the meta kernel refuses (``_grouped_mm``'s meta kernel wants bfloat16, its CPU
        kernel runs float32): the rule speaks for the kernel, as it does in the shape interpreter."""
        try:
            return func(*args, **kwargs)
        except StagingError:
            raise
        except (DataDependentOutputException, DynamicOutputShapeException) as e:
            raise ConcretizationError(_concretization_message(func, src)) from e
        except UnsupportedOperatorException as e:
            out = _from_rule(func, args, kwargs, mode)
            if out is not None:
                return out
            raise UnsupportedOpError(_unsupported_message(func, src)) from e
        except (RuntimeError, ValueError, IndexError, TypeError) as e:
            out = _from_rule(func, args, kwargs, mode)
            if out is not None:
                return out
            if "fake" in str(e).lower() and ("impl" in str(e).lower() or "kernel" in str(e).lower()):
                raise UnsupportedOpError(_unsupported_message(func, src, str(e))) from e
            raise ShapeError(_shape_message(func, args, kwargs, src, _rule_says(func, args, kwargs) or e)) from e


# ---------------------------------------------------------------------------------------------------------
# Output metadata by input metadata. FakeTensorMode spends most of a trace hashing arguments for its own
# cache and rebuilding outputs; a transformer repeats the same few calls layer after layer. For ops that
# make fresh outputs or one view of their first argument, the outputs' metadata is a function of the
# op, the inputs' metadata and the other arguments: the first call runs the fake kernel and every later
# one builds its outputs from the cached metadata. Shared by every trace (static shapes only).

_META_CACHE: dict[tuple, tuple] = {}
_MAX_META_CACHE = 1 << 16
_CACHE_KIND: dict[Any, str | None] = {}  # op -> "fresh", "view" or None (never cached)
caches.on_clear(_META_CACHE.clear)
caches.on_clear(_CACHE_KIND.clear)


def _cache_kind(func: Any) -> str | None:
    kind = _CACHE_KIND.get(func, "?")
    if kind != "?":
        return kind
    kind = None
    schema = getattr(func, "_schema", None)
    if (
        schema is not None
        and func.namespace == "aten"
        and schema.returns
        and all(isinstance(r.type, torch.TensorType) for r in schema.returns)
        and not {torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output, torch.Tag.inplace_view} & set(func.tags)
    ):
        writes = [a.alias_info is not None and a.alias_info.is_write for a in schema.arguments]
        aliased = [r.alias_info is not None for r in schema.returns]
        if not any(writes):
            if not any(aliased):
                kind = "fresh"  # or, as _unsafe_view, a view its schema does not declare: told apart per call
            elif func.is_view and aliased == [True]:
                kind = "view"
        elif writes[0] and not any(writes[1:]) and len(aliased) == 1 and schema.returns[0].alias_info.is_write:
            kind = "inplace"  # returns its first argument, whose metadata does not change
    _CACHE_KIND[func] = kind
    return kind


def _meta_key(func: Any, args: tuple, kwargs: dict) -> tuple | None:
    """The op, each fake input's metadata, and every other argument with its type (1 and 1.0 apart); None
    when the call cannot be cached (a real tensor, a fake with a constant, complex or not strided)."""
    if _cache_kind(func) is None:
        return None
    key: list[Any] = [func]
    for x in flat_call(args, kwargs):
        kind = type(x)
        if kind is FakeTensor:
            if x.constant is not None or x.dtype.is_complex or x.layout != torch.strided:
                return None
            key.append((x.shape, x.stride(), x.storage_offset(), x.dtype, x.fake_device))
        elif isinstance(x, torch.Tensor):
            return None
        else:
            key.append(kind)
            key.append(x)
    key = tuple(key)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _remember(key: tuple, func: Any, args: tuple, out: Any) -> None:
    """Cache ``out``'s metadata when the outputs are one of three things: the first argument itself (in
    place), one view of the first argument, or fresh dense storages exactly as large as their shapes need."""
    kind = _cache_kind(func)
    base = args[0] if args and type(args[0]) is FakeTensor else None
    if kind == "inplace":
        if out is base:
            _store(key, ("inplace", True, None, ()))
        return
    single = type(out) is FakeTensor
    outs = [out] if single else out
    if not isinstance(outs, (tuple, list)) or not outs or any(type(t) is not FakeTensor for t in outs):
        return
    if any(t.constant is not None or t.layout != torch.strided or t.dtype.is_complex for t in outs):
        return
    metas = tuple((t.shape, t.stride(), t.storage_offset(), t.dtype, t.fake_device) for t in outs)
    storages = [t.untyped_storage()._cdata for t in outs]
    if single and base is not None and storages[0] == base.untyped_storage()._cdata:
        _store(key, ("view", True, None, metas))
        return
    if kind == "view":
        return
    inputs = {t.untyped_storage()._cdata for t in flatten(args) if type(t) is FakeTensor}
    if len(set(storages)) != len(storages) or inputs & set(storages):
        return
    for t, (shape, stride, offset, dtype, _) in zip(outs, metas):
        with torch._C._DisableTorchDispatch():
            fresh = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        if offset != 0 or fresh.untyped_storage().nbytes() != t.untyped_storage().nbytes():
            return
    _store(key, ("fresh", single, type(out), metas))


def _store(key: tuple, entry: tuple) -> None:
    if len(_META_CACHE) >= _MAX_META_CACHE:
        _META_CACHE.clear()
    _META_CACHE[key] = entry


def _from_entry(entry: tuple, args: tuple, mode: FakeTensorMode) -> Any:
    kind, single, container, metas = entry
    if kind == "inplace":
        return args[0]
    outs = []
    for shape, stride, offset, dtype, device in metas:
        with torch._C._DisableTorchDispatch():
            if kind == "view":
                empty = torch.empty(0, dtype=dtype, device="meta")
                empty.set_(args[0].untyped_storage(), offset, shape, stride)
            else:
                empty = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        outs.append(FakeTensor(mode, empty, device))
    return outs[0] if single else container(outs)


def _relayout(func: Any, args: tuple, kwargs: dict, out: Any, mode: FakeTensorMode) -> Any:
    """``out`` as the real kernel returns it, where the op's layout rule says its meta kernel's strides
    differ, or that the kernel returns no tensor (see :mod:`stagetorch.ops.layout_rules`). Done before the
    metadata cache remembers the call."""
    rule = slot(func, "layout")
    if rule is None:
        return out
    strides = rule(*args, **kwargs)
    if not strides:
        return out
    single = isinstance(out, torch.Tensor)
    outs = [out] if single else list(out)
    for k, (t, stride) in enumerate(zip(outs, strides)):
        if stride is NO_TENSOR:
            outs[k] = None
        elif stride is not None and type(t) is FakeTensor and tuple(stride) != t.stride():
            with torch._C._DisableTorchDispatch():
                empty = torch.empty_strided(t.shape, stride, dtype=t.dtype, device="meta")
            outs[k] = FakeTensor(mode, empty, t.fake_device)
    return outs[0] if single else type(out)(outs)


def _unshared(func: Any, out: Any, mode: FakeTensorMode) -> Any:
    """``out`` with each output that its schema declares fresh made a tensor of its own where the fake kernel
    returned one tensor twice. The meta kernel of ``mkldnn_rnn_layer_backward`` returns its bias gradient as
    both biases' gradients; the CPU kernel returns two tensors, and so does FakeTensorMode once its dispatch
    cache is warm: the trace would otherwise depend on that cache. Done before the metadata cache remembers
    the call."""
    schema = getattr(func, "_schema", None)
    if not isinstance(out, tuple) or schema is None or any(r.alias_info is not None for r in schema.returns):
        return out
    seen: set[int] = set()
    outs = list(out)
    for k, t in enumerate(outs):
        if type(t) is not FakeTensor:
            continue
        storage = t.untyped_storage()._cdata
        if storage in seen:
            with torch._C._DisableTorchDispatch():
                empty = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            outs[k] = FakeTensor(mode, empty, t.fake_device)
        else:
            seen.add(storage)
    return type(out)(outs)


def _from_rule(func: Any, args: tuple, kwargs: dict, mode: FakeTensorMode) -> Any:
    """Fresh contiguous fakes of the avals the op's explicit shape rule gives for these operands; None where
    it has no rule, the rule refuses them, or the op returns other than tensors."""
    rule = slot(func, "shape")
    schema = getattr(func, "_schema", None)
    if rule is None or schema is None or not all(isinstance(r.type, torch.TensorType) for r in schema.returns):
        return None
    abstract = map_leaves((args, kwargs), torch.Tensor, Aval.of)
    try:
        avals = rule(*abstract[0], **abstract[1])
    except Exception:  # noqa: BLE001 - the kernel's own error is the one to report
        return None
    single = isinstance(avals, Aval)
    outs = [avals] if single else list(avals)
    if len(outs) != len(schema.returns) or not all(isinstance(a, Aval) for a in outs):
        return None
    fakes = []
    for a in outs:
        with torch._C._DisableTorchDispatch():
            empty = torch.empty(a.shape, dtype=a.dtype, device="meta")
        fakes.append(FakeTensor(mode, empty, a.device))
    return fakes[0] if single else tuple(fakes)


def _check_rule(func: Any, args: tuple, kwargs: dict, src: SourceInfo) -> None:
    """Some meta kernels accept what the real kernel refuses (relu of a bool tensor). An explicit shape
    rule that refuses the call is believed, so the error comes at trace time with the user's line rather
    than from the kernel mid-run. Checked when the fake kernel runs: once per signature, as the metadata
    cache answers repeats."""
    reason = _rule_says(func, args, kwargs)
    if reason is not None:
        raise ShapeError(_shape_message(func, args, kwargs, src, reason))


def _rule_says(func: Any, args: tuple, kwargs: dict) -> str | None:
    """The explicit shape rule's account of why these operands fail, when the op has one: it names the op
    and the shapes more plainly than most kernels do."""
    rule = slot(func, "shape")
    if rule is None:
        return None
    abstract = map_leaves((args, kwargs), torch.Tensor, Aval.of)
    try:
        rule(*abstract[0], **abstract[1])
    except ShapeError as e:
        return str(e)
    except Exception:  # the rule has nothing clearer to say than the kernel
        return None
    return None


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return str(Aval.of(x))
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(_describe(y) for y in x) + "]"
    return repr(x)


def _shape_message(func: Any, args: tuple, kwargs: dict, src: SourceInfo, e: Exception | str) -> str:
    operands = ", ".join([_describe(a) for a in args] + [f"{k}={_describe(v)}" for k, v in kwargs.items()])
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"{op_name(func)}({operands}) failed at {src}:{_code_line(src)}\n{first}"


def _concretization_message(func: Any, src: SourceInfo) -> str:
    return (
        f"{op_name(func)} at {src} needs a tensor's value, but stagetorch.jit stages with shapes only:"
        f"{_code_line(src)}\n"
        "This is data-dependent Python control flow or output shape (.item(), float(t), `if t:`, "
        "boolean-mask indexing, nonzero). What to do: pass Python values that steer control flow as static "
        "arguments (stagetorch.jit(fn, static_argnums=...)); select with torch.where(cond, a, b) instead of "
        "`if`; or use stagetorch.lazy(...), which evaluates such reads eagerly."
    )


def _host_read_message(func: Any, src: SourceInfo) -> str:
    return (
        f"{op_name(func)} at {src} reads a tensor's value on the host, and that value depends on the parameters "
        f"or on activations:{_code_line(src)}\nstagetorch.jit computes on the host only values that follow from "
        "the step's integer arguments (labels, masks, lengths), constants and random draws; a value computed from "
        "the model's outputs is known only when the staged program runs. What to do: make the decision outside "
        "the staged step (return the loss and test it after the call, e.g. for early stopping), or pass the "
        "Python value that steers it as a static argument (stagetorch.jit(fn, static_argnums=...)); select with "
        "torch.where(cond, a, b) instead of `if`; keep shapes fixed with a mask (loss * mask) instead of x[mask]; "
        "or use stagetorch.lazy(...), which evaluates such reads eagerly."
    )


_MASKABLE = frozenset({
    torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default,
    torch.ops.aten._unsafe_index.Tensor,
})


def _host_masks(func: Any, in_args: tuple, host: HostTrace) -> list[int] | None:
    """The positions of the boolean indices of an advanced index (``x[mask]``, ``x[mask] = v``) when they are
    all host-known, else None."""
    if func not in _MASKABLE or len(in_args) < 2:
        return None
    indices = in_args[1]
    masks = [d for d, t in enumerate(indices) if isinstance(t, Var) and t.aval.dtype in (torch.bool, torch.uint8)]
    if masks and host.is_known([indices[d] for d in masks]):
        return masks
    return None


def _unsupported_message(func: Any, src: SourceInfo, detail: str = "") -> str:
    name = op_name(func)
    return (
        f"{name} at {src} has no fake (meta) kernel, so stagetorch cannot infer its output shape."
        f"{_code_line(src)}\nTeach it with one line: stagetorch.ops.register(torch.ops.{name}, "
        "shape=lambda *args, **kwargs: stagetorch.Aval(shape, dtype, device)), or give the op a fake impl "
        "with torch.library.register_fake." + (f"\n({detail.splitlines()[0]})" if detail else "")
    )


class _StagingMode(TorchDispatchMode):
    def __init__(self, recorder: Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func is _PRIM_DEVICE:  # x.device, thousands of times a trace
            fake_device = getattr(args[0], "fake_device", None)
            return fake_device if fake_device is not None else func(*args)
        if func.namespace == "prim":
            return func(*args, **(kwargs or {}))
        return self.recorder.record(func, args, kwargs or {})


_PRIM_DEVICE = torch.ops.prim.device.default

# What torch says when a kernel reads the data of a fake tensor, which has none.
_NO_DATA = "its data is not allocated yet"


class _ReadsData(Exception):
    """A composite kernel read a tensor's data in C++, where no dispatch mode sees it: ``trace`` runs the
    function again under :class:`_ReadConstants`."""


_SPLITS = frozenset({torch.tensor_split, torch.Tensor.tensor_split})


class _ReadConstants(TorchFunctionMode):
    """The torch-level calls of a trace, watched for a composite kernel that reads a tensor argument's
    data in C++ (below the staging mode, which never sees the read). The split points of
    ``torch.tensor_split`` given as a tensor the function built from Python data (``torch.tensor([1,
    3])``) are read from the constant the recorder lifted, as eager reads them; any other such read is a
    ConcretizationError at the user's line. Only a trace that met such a read runs under it: it costs
    every torch call of the trace a Python call."""

    def __init__(self, recorder: Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func in _SPLITS:
            args, kwargs = self._split_points(func, args, kwargs)
        try:
            return func(*args, **kwargs)
        except RuntimeError as e:
            if _NO_DATA not in str(e):
                raise
            raise ConcretizationError(_reads_data_message(func, source_info())) from e

    def _split_points(self, func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``args``, ``kwargs`` with split points given as a constant tensor replaced by its Python value."""
        key = next((k for k in ("tensor_indices_or_sections", "indices", "sections") if k in kwargs), None)
        points = args[1] if len(args) > 1 else kwargs.get(key)
        if not isinstance(points, torch.Tensor):
            return args, kwargs
        real = self.recorder.constant(points)
        if real is None:
            raise ConcretizationError(_reads_data_message(func, source_info()))
        value = real.tolist()
        if len(args) > 1:
            return (args[0], value, *args[2:]), kwargs
        kwargs = {k: x for k, x in kwargs.items() if k != key}
        kwargs["indices" if isinstance(value, list) else "sections"] = value
        return args, kwargs


# What a fake tensor's autograd graph says when a backward reaches it: the fake of a real non-leaf (a
# tensor computed from parameters before the call) has a placeholder graph that raises this.
_THROUGH_INPUT = "Tried to backward() through example input"


def _through_input_message(e: RuntimeError, leaves: list, names: list[str], state: State) -> str:
    tensors = [*zip(names, leaves), *((name, t) for name, t in state.tensors)]
    outside = [name for name, t in tensors if isinstance(t, torch.Tensor) and t.requires_grad and not _is_leaf(t)]
    tb, frame = e.__traceback__, None
    while tb is not None:
        if is_user_code(tb.tb_frame.f_code):
            frame = tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next
    where = code = ""
    if frame is not None:
        where = f" at {frame[0].f_code.co_filename}:{frame[1]}"
        code = _code_line(SourceInfo(frame[0].f_code.co_filename, frame[1]))
    return (
        f"the backward{where} reaches {', '.join(outside) or 'a tensor'}, which requires grad and was computed "
        "outside the staged function: its autograd graph is eager's, which the staged backward cannot follow."
        f"{code}\nWhat to do: compute it inside the staged function (from its parameters), or pass it "
        "detached (x.detach()) if its gradient is not wanted."
    )


def _reads_data_message(func: Any, src: SourceInfo) -> str:
    name = getattr(func, "__qualname__", "")
    name = name if name.startswith("Tensor.") else f"torch.{getattr(func, '__name__', func)}"
    return (
        f"{name} at {src} reads the values of a tensor argument, but stagetorch.jit stages with shapes "
        f"only:{_code_line(src)}\nWhat to do: pass those values as Python numbers (torch.tensor_split(x, [1, "
        "3]) rather than a tensor of split points; .tolist() outside the staged function), or build the tensor "
        "in the function from Python data (torch.tensor([1, 3])), which stagetorch reads; or use "
        "stagetorch.lazy(...), which evaluates such reads eagerly."
    )


@attrs.define
class Traced:
    """A graph and what the caller needs to run it again.

    ``consts`` are the real tensors it captured (its last inputs). ``grad_params`` are the inputs whose
    ``.grad`` is an input, in order, after the state (zeros where it is None, which then become its
    ``.grad``); ``assign_grads`` the inputs whose ``.grad`` the step replaces (rather than adds to),
    ``clear_grads`` those it sets to None. ``state_outs`` are (optimizer, parameter, key) for the outputs
    after the function's own: optimizer state the step created.
    """

    graph: Graph
    consts: list[torch.Tensor]
    grad_params: list[int] = attrs.field(factory=list)
    assign_grads: list[int] = attrs.field(factory=list)
    clear_grads: list[int] = attrs.field(factory=list)
    state_outs: list[tuple] = attrs.field(factory=list)
    # The values it read on the host, and what computes them again for a call (see stagetorch.staging.host_reads).
    host: HostProgram | None = None


# A trace allocates many small objects that all stay alive until it ends: the cyclic collector's passes
# over them found nothing and cost a quarter of a deep model's trace.
@collector.paused()
def trace(
    fn: Callable,
    args: Sequence,
    kwargs: dict,
    *,
    static_argnums: Sequence[int] = (),
    state: State | None = None,
) -> Traced:
    """Stage ``fn(*args, **kwargs)`` into a Graph. Real tensors are left exactly as they were.

    An argument given as an :class:`~stagetorch.Aval` stands for a contiguous tensor of that aval.
    """
    state = discover(fn, args, kwargs) if state is None else state
    try:
        return _trace(fn, args, kwargs, static_argnums, state, watch=False)
    except _ReadsData:
        return _trace(fn, args, kwargs, static_argnums, state, watch=True)


def _trace(fn: Callable, args: Sequence, kwargs: dict, static_argnums: Sequence[int], state: State, watch: bool) -> Traced:
    """One trace; with ``watch``, under :class:`_ReadConstants`."""
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    rec = Recorder(fake_mode)
    rec.host = HostTrace()
    static = set(static_argnums)

    leaves, tree = pytree.tree_flatten((tuple(args), kwargs))
    names = leaf_names(fn, args, kwargs)
    leaves = held_values(leaves, lambda: names)
    arg_is_static = _static_mask(args, kwargs, static)
    fake_leaves = []
    n_tensors = 0  # the position of each tensor argument among the call's (what a host read of it reads)
    for leaf, name, is_static in zip(leaves, names, arg_is_static):
        if isinstance(leaf, torch.Tensor) and not is_static and leaf.layout != torch.strided:
            raise UnsupportedOpError(
                f"argument {name} is a {leaf.layout} tensor; stagetorch stages dense (strided) tensors only. "
                "Pass x.to_dense(), or keep sparse work outside the staged function."
            )
        if isinstance(leaf, torch.Tensor) and not is_static:
            with fake_mode, _no_grad_read_warning():
                fake = fake_mode.from_tensor(leaf, static_shapes=True)
            rec.host.seed_arg(rec.add_input(fake, "arg", name), n_tensors, leaf)
            n_tensors += 1
            fake_leaves.append(fake)
        elif isinstance(leaf, Aval):
            # An argument known by its aval only (a process group's global batch): laid out as its strides
            # say (the rank's shard's layout), else contiguous.
            strides = getattr(leaf, "strides", ())
            with fake_mode:
                if strides:
                    fake = torch.empty_strided(leaf.shape, strides, dtype=leaf.dtype, device=leaf.device)
                else:
                    fake = torch.empty(leaf.shape, dtype=leaf.dtype, device=leaf.device)
            rec.add_input(fake, "arg", name)
            n_tensors += 1
            fake_leaves.append(fake)
        else:
            fake_leaves.append(leaf)

    swapped: dict[int, torch.Tensor] = {}
    with_grad: list[tuple[int, str, torch.Tensor]] = []
    for role, name, t in state.named_state():
        with fake_mode:
            fake = fake_mode.from_tensor(t, static_shapes=True)
        swapped[id(t)] = fake
        if t.requires_grad and t.is_leaf:
            # A hook on a parameter (``p.register_hook(lambda g: g * 3)``) changes the gradient autograd
            # accumulates: the fake the trace differentiates carries it too, so its math is staged.
            for hook in (t._backward_hooks or {}).values():
                fake.register_hook(hook)
            for hook in (t._post_accumulate_grad_hooks or {}).values():
                fake.register_post_accumulate_grad_hook(hook)
        rec.add_input(fake, role, name)
        if t.requires_grad and t.is_leaf:
            with_grad.append((len(rec.invars) - 1, name, t))
    # Every .grad is an input, so a step that reads .grad (clip_grad_norm_) sees the gradient accumulated
    # so far plus this call's, as in eager (the caller feeds zeros where .grad is None: 0 + g is g, to the
    # bit). _settle_grads drops each one the step only adds to, so a plain step's program is unchanged.
    grad_inputs: dict[int, Var] = {}
    for i, name, t in with_grad:
        with fake_mode:
            fake_grad = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        grad_inputs[i] = rec.add_input(fake_grad, "grad", f"{name}.grad")
        rec.fakes[i].grad = fake_grad
    for prefix, m in state.modules:
        for sub_name, sub in m.named_modules(remove_duplicate=False):
            rec.module_names.setdefault(id(sub), _join(prefix, sub_name) or type(sub).__name__)

    optimizers = [_TracedOptimizer(opt, swapped) for _, opt in state.optimizers]
    restore = _swap(state, swapped)
    # A torch.compile'd module warns when global module hooks exist (they fire again for its wrapper):
    # where they are only the tracer's own (module paths for source info), the warning is not the user's.
    own_hooks_only = not _module_globals._has_any_global_hook()
    hooks = _module_hooks(rec)
    # FakeTensorMode logs every kernel failure at ERROR level; stagetorch raises its own named error instead.
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    log_level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    try:
        fake_args, fake_kwargs = pytree.tree_unflatten(fake_leaves, tree)
        with (
            fake_mode, _StagingMode(rec), _ReadConstants(rec) if watch else contextlib.nullcontext(),
            warnings.catch_warnings() if own_hooks_only else contextlib.nullcontext(),
        ):
            if own_hooks_only:
                warnings.filterwarnings("ignore", _COMPILED_MODULE_HOOKS, UserWarning)
            try:
                out = fn(*fake_args, **fake_kwargs)
            except RuntimeError as e:
                if _THROUGH_INPUT in str(e):
                    raise UnsupportedOpError(_through_input_message(e, leaves, names, state)) from e
                if watch or _NO_DATA not in str(e):
                    raise
                raise _ReadsData from e
        out_leaves, out_tree = pytree.tree_flatten(out)
        with fake_mode:
            out_leaves = [rec.lift(x) if isinstance(x, torch.Tensor) else x for x in out_leaves]
        outvars = [rec.var(x) if isinstance(x, torch.Tensor) else Literal(x) for x in out_leaves]
        state_outs = []
        for opt in optimizers:
            for target, x in opt.created():
                state_outs.append(target)
                outvars.append(rec.var(rec.lift(x)) if isinstance(x, torch.Tensor) else Literal(x))
        # An input computed before the call (a non-leaf) has no .grad to accumulate into, as in eager.
        final = {
            i: None if fake.grad is None else rec.var(fake.grad)
            for i, fake in enumerate(rec.fakes) if fake.requires_grad and fake.is_leaf
        }
    finally:
        rec.host.finish()
        fake_log.setLevel(log_level)
        for h in hooks:
            h.remove()
        for opt in optimizers:
            opt.restore()
        restore()
        leaks = rec.grad_leaks
        for t, old_grad, _ in leaks:
            t.grad = old_grad
    if leaks:
        t, _, src = leaks[0]
        raise UnsupportedOpError(
            f"a tensor that requires grad ({Aval.of(t)}, first used at {src}) is not reachable from the "
            f"function's globals, closure, self or arguments, so stagetorch cannot stage its gradient."
            f"{_code_line(src)}\nRefer to its module directly in the function (a global or closure "
            "variable, an attribute of self, or an argument)."
        )
    eqns, grads, assign, clear, unused = _settle_grads(rec.eqns, final, grad_inputs, outvars)
    strides = {rec.var_of[id(t)]: t.stride() for t in rec.keep if id(t) in rec.var_of}
    eqns, grads = _steal_accumulated_grads(eqns, grads, outvars, strides)
    eqns, grads = _lay_out_as_parameters(eqns, grads, strides, rec.fakes)
    eqns, grads = _one_grad_each(eqns, grads)
    keep = [i for i, v in enumerate(rec.invars) if v not in unused]
    index = {old: new for new, old in enumerate(keep)}
    graph = Graph(
        [rec.invars[i] for i in keep], eqns, outvars, [rec.roles[i] for i in keep], [rec.names[i] for i in keep],
        [(index[i], g) for i, g in grads], out_tree,
    )
    return Traced(
        graph, rec.consts,
        grad_params=[index[i] for i, v in grad_inputs.items() if v not in unused],
        assign_grads=[index[i] for i in assign], clear_grads=[index[i] for i in clear], state_outs=state_outs,
        host=rec.host.program(),
    )


class _TracedOptimizer:
    """An optimizer pointed at the fakes for a trace: its parameters (through the swap) and its state,
    re-keyed by the fake parameters, each state tensor the fake the trace made for it. A first step's
    state, created during the trace, becomes outputs the caller installs after each run."""

    def __init__(self, opt: torch.optim.Optimizer, fakes: dict[int, torch.Tensor]):
        self.opt, self.real_state = opt, opt.state
        self.pairs = [(p, fakes[id(p)]) for group in opt.param_groups for p in group["params"]]
        self.state: collections.defaultdict = collections.defaultdict(dict)
        self.inputs: set[int] = set()
        for p, fake in self.pairs:
            if p in self.real_state:
                entries = {k: fakes.get(id(x), x) if isinstance(x, torch.Tensor) else x for k, x in self.real_state[p].items()}
                self.state[fake] = entries
                self.inputs.update(id(x) for x in entries.values())
        opt.state = self.state
        self.undo_step = _stage_optimizer_step(opt)

    def created(self) -> Iterator[tuple[tuple, Any]]:
        """((optimizer, real parameter, key), value) for each state entry the trace created or rebound."""
        for p, fake in self.pairs:
            for k, x in self.state.get(fake, {}).items():
                if id(x) not in self.inputs:
                    yield (self.opt, p, k), x

    def restore(self) -> None:
        self.opt.state = self.real_state
        self.undo_step()


def _stage_optimizer_step(opt: torch.optim.Optimizer) -> Callable[[], None]:
    """Make ``opt.step`` stageable for the trace; return the undo.

    Adam-like optimizers read their step count with ``.item()`` unless ``capturable``; their capturable
    formulation keeps it a tensor, so the trace runs that (its device check, which only guards CUDA graph
    capture, is skipped as torch.compile skips it). An optimizer without such a mode cannot be staged."""
    # An LR scheduler wraps ``opt.step`` as an instance attribute; it is put back as it was.
    own = vars(opt).get("step")

    def undo() -> None:
        if own is None:
            vars(opt).pop("step", None)
        else:
            opt.step = own

    if "capturable" not in opt.defaults and not isinstance(opt, _STAGEABLE_OPTIMIZERS):
        def refuse(*args: Any, **kwargs: Any) -> Any:
            src = source_info()
            raise UnsupportedOpError(
                f"{type(opt).__name__}.step at {src} cannot be staged: it reads its state as Python numbers."
                f"{_code_line(src)}\nCall the optimizer outside the staged function: loss = step(x, y); "
                "opt.step(); opt.zero_grad()."
            )

        opt.step = refuse
        return undo
    if "capturable" not in opt.defaults:
        return lambda: None
    original = opt.step

    def capturable_step(*args: Any, **kwargs: Any) -> Any:
        flags = [g.get("capturable") for g in opt.param_groups]
        is_compiling = torch.compiler.is_compiling
        for g in opt.param_groups:
            g["capturable"] = True
        torch.compiler.is_compiling = lambda: True
        try:
            return original(*args, **kwargs)
        finally:
            torch.compiler.is_compiling = is_compiling
            for g, flag in zip(opt.param_groups, flags):
                g["capturable"] = flag

    opt.step = capturable_step
    return undo


_STAGEABLE_OPTIMIZERS = (torch.optim.SGD,)


def _settle_grads(
    eqns: list[Eqn], final: dict[int, Var | None], grad_inputs: dict[int, Var], outvars: list
) -> tuple[list[Eqn], list[tuple[int, Var]], list[int], list[int], set[Var]]:
    """What the step does to each ``.grad``, given ``final``, the value each parameter's fake ``.grad``
    ended with, and ``grad_inputs``, the inputs that held the real ``.grad`` where it existed.

    **Returns** the equations, the (parameter, gradient) pairs to accumulate, the parameters whose ``.grad``
    is replaced by theirs (zero_grad, then backward), those whose ``.grad`` is set to None, and the grad
    inputs no equation reads (dropped). A grad input only added into by AccumulateGrad is dropped with
    that add: the executor accumulates as for a parameter with no ``.grad``, so the program is the same.
    One the program writes in place (accumulated, then clipped) needs nothing after the run."""
    readers: dict[Var, list[Eqn]] = {v: [] for v in grad_inputs.values()}
    # The accumulated .grad returned (``return loss, p.grad``) must stay in the program (one read again
    # is a second reader of its storage, below).
    returned = {v.root for v in outvars if isinstance(v, Var)}
    for e in eqns:
        for v in {v.root for v in e.invars}:
            if v in readers:
                readers[v].append(e)
    dropped: set[int] = set()
    grads, assign, clear, unused = [], [], [], set()
    for i, fv in final.items():
        g = grad_inputs.get(i)
        if g is None:
            if fv is not None:
                grads.append((i, fv))
            continue
        users = readers[g]
        if len(users) == 1 and _only_accumulates(users[0], g, fv) and g not in returned:
            dropped.add(id(users[0]))
            grads.append((i, users[0].args[1]))
            unused.add(g)
            continue
        if not users:
            unused.add(g)
        if fv is None:
            clear.append(i)
        elif fv.root is not g:
            grads.append((i, fv))
            assign.append(i)
    return [e for e in eqns if id(e) not in dropped], grads, assign, clear, unused


def _only_accumulates(e: Eqn, g: Var, final: Var | None) -> bool:
    return (
        e.prim is torch.ops.aten.add_.Tensor
        and e.source.backward == _ACCUMULATE_GRAD
        and len(e.args) == 2 and not e.kwargs
        and e.args[0] is g
        and e.outvars[0] is final
    )


_ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"


def _steal_accumulated_grads(
    eqns: list[Eqn], grads: list[tuple[int, Var]], outvars: list, strides: dict[Var, tuple[int, ...]]
) -> tuple[list, list]:
    """Undo the copy AccumulateGrad makes under tracing.

    Eager autograd hands the incoming gradient buffer to ``.grad`` when nothing else holds it; under the
    tracer something always does, so it records ``new_empty_strided`` + ``copy_``. The copy is dropped here
    where eager would steal the buffer: when the gradient is laid out as the parameter (the layout
    contract). Where it is not (a convolution's weight gradient over channels-last input, for a contiguous
    weight), eager copies too, and the copy stays in the program, where the memory interpreter counts it
    and its source dies right after it; ``strides``: each var's strides as traced.
    """
    producer = {v: e for e in eqns for v in e.outvars if v is not None}
    readers: dict[Var, int] = {}
    for e in eqns:
        for v in e.invars:
            readers[v] = readers.get(v, 0) + 1
    returned = {v for v in outvars if isinstance(v, Var)}
    dropped: set[int] = set()
    new_grads = []
    for i, g in grads:
        copy = producer.get(g)
        ok = (
            copy is not None
            and copy.source.backward == _ACCUMULATE_GRAD
            and copy.prim is torch.ops.aten.copy_.default
            and g not in returned
            # A step that reads the new .grad (an optimizer's step() right after backward()) keeps the copy.
            and not readers.get(g)
        )
        if ok:
            dst, src = copy.args[0], copy.args[1]
            alloc = producer.get(dst)
            ok = (
                alloc is not None
                and alloc.prim is torch.ops.aten.new_empty_strided.default
                and readers.get(dst) == 1
                and readers.get(src) == 2
                and src not in returned
                and _same_layout(strides.get(src), tuple(alloc.args[2]), src.aval.shape)
            )
        if ok:
            dropped.update((id(copy), id(alloc)))
            new_grads.append((i, src))
        else:
            new_grads.append((i, g))
    return [e for e in eqns if id(e) not in dropped], new_grads


def _lay_out_as_parameters(
    eqns: list[Eqn], grads: list[tuple[int, Var]], strides: dict[Var, tuple[int, ...]], params: list[torch.Tensor]
) -> tuple[list[Eqn], list[tuple[int, Var]]]:
    """A gradient laid out otherwise than its parameter (a convolution's weight gradient over channels-last
    activations, for a contiguous weight) is copied into the parameter's layout when it becomes ``.grad``
    (autograd's layout contract; :func:`stagetorch.runtime.grads.accumulate_grad`). The copy is made the program's
    last equation, so that the memory interpreter counts it and the gradient it copies dies right after;
    made after the program, the copies of every such gradient were held at once, beside the program's
    outputs, and above its plan. (When ``.grad`` already exists the copy is one eager does not make.)"""
    out = []
    for i, v in grads:
        p = params[i]
        fmt = suggest_memory_format(p)
        if _same_layout(strides.get(v), p.stride(), p.shape) or not p.is_contiguous(memory_format=fmt):
            out.append((i, v))
            continue
        copy = Var(v.aval, storage_nbytes=v.aval.nbytes, strides=p.stride())
        made_by = next((e for e in reversed(eqns) if v in e.outvars), eqns[-1])
        eqns = [*eqns, Eqn(torch.ops.aten.clone.default, (v,), {"memory_format": fmt}, (copy,), made_by.source)]
        out.append((i, copy))
    return eqns, out


def _one_grad_each(eqns: list[Eqn], grads: list[tuple[int, Var]]) -> tuple[list[Eqn], list[tuple[int, Var]]]:
    """One gradient for two parameters (a custom ``autograd.Function`` returning one tensor for two inputs)
    is copied for the second, as autograd's AccumulateGrad copies a gradient another edge still holds: each
    ``.grad`` is a tensor of its own, which an in-place clip or accumulation touches once. The copy is the
    program's last equation, so that the memory interpreter counts it (made when installing the gradients,
    it was above the plan)."""
    seen: set[Var] = set()
    out = []
    for i, v in grads:
        if v in seen:
            copy = Var(v.aval, storage_nbytes=v.aval.nbytes, strides=v.strides)
            made_by = next((e for e in reversed(eqns) if v in e.outvars), eqns[-1])
            eqns = [*eqns, Eqn(torch.ops.aten.clone.default, (v,), {}, (copy,), made_by.source)]
            v = copy
        seen.add(v)
        out.append((i, v))
    return eqns, out


def _same_layout(a: tuple[int, ...] | None, b: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Strides ``a`` and ``b`` agree on every dim of more than one element (unknown ``a``: assumed so)."""
    return a is None or all(x == y or n <= 1 for x, y, n in zip(a, b, shape))


def _swap(state: State, fakes: dict[int, torch.Tensor]) -> Callable[[], None]:
    """Point every module slot and every discovered reference at the fakes; return the undo."""
    undo: list[Callable[[], None]] = []
    for _, root in state.modules:
        for m in root.modules():
            for table in (m._parameters, m._buffers):
                for name, t in list(table.items()):
                    if t is not None and id(t) in fakes:
                        table[name] = fakes[id(t)]
                        undo.append(functools.partial(table.__setitem__, name, t))
    for (_, t), setters in zip(state.tensors, state.setters):
        for set_ref in setters:
            set_ref(fakes[id(t)])
            undo.append(functools.partial(set_ref, t))

    def restore() -> None:
        for u in reversed(undo):
            u()

    return restore


# The start of the warning torch.compile's OptimizedModule gives when any global module hook exists.
_COMPILED_MODULE_HOOKS = r"Using `torch\.compile\(module\)` when there are global hooks on modules"


def _module_hooks(rec: Recorder) -> list[Any]:
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    def push(module: torch.nn.Module, args: Any) -> None:
        rec.module_stack.append(rec.module_names.get(id(module), type(module).__name__))

    def pop(module: torch.nn.Module, args: Any, out: Any) -> None:
        if rec.module_stack:
            rec.module_stack.pop()

    return [register_module_forward_pre_hook(push), register_module_forward_hook(pop, always_call=True)]


def leaf_names(fn: Callable, args: Sequence, kwargs: dict) -> list[str]:
    names = arg_names(fn, len(args))
    out = []
    for i, a in enumerate(args):
        out += _named_leaves(names[i], a)
    for k, a in kwargs.items():
        out += _named_leaves(k, a)
    return out


def _named_leaves(name: str, tree: Any) -> list[str]:
    paths, _ = pytree.tree_flatten_with_path(tree)
    return [name + pytree.keystr(path) for path, _ in paths]


def _static_mask(args: Sequence, kwargs: dict, static: set[int]) -> list[bool]:
    mask = []
    for i, a in enumerate(args):
        mask += [i in static] * len(pytree.tree_leaves(a))
    for a in kwargs.values():
        mask += [False] * len(pytree.tree_leaves(a))
    return mask

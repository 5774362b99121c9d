"""State discovery: the real state a staged function refers to, and the key of what a trace of it assumes.

:func:`discover` walks what the function refers to (its closure, the globals it names, ``self``, its
defaults, its arguments) and finds the modules, optimizers, LR schedulers and tensors it reads, and the
Python scalars a trace would bake in. :class:`State` holds them in a fixed order, with the setters that
rebind each reference for the trace's swap, and makes the key a staged program is cached under
(:meth:`State.tensors_and_key`: every module's scalar attributes, the globals a module class reads, the
hooks, each tensor's metadata). A tensor of a ``HELD`` type (one-line mode's LazyTensor) stands for the real
tensor it holds.

What it must not know: fake tensors, the trace that swaps the state for fakes, or how a walk is reused
(:mod:`stagetorch.staging.guards` is told what the walk read, through ``reads``).
"""

from __future__ import annotations

import dis
import enum
import functools
import inspect
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import torch
import torch.nn.modules.module as _module_globals
import torch.utils._pytree as pytree

from ..utils import caches
from .source import is_internal_file

__all__ = ["State", "discover", "HELD", "held_values", "arg_names", "join_name", "CLASS_GLOBALS", "MODULE_HOOKS"]


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
                    yield "param", join_name(prefix, name), p
        for prefix, m in self.modules:
            for name, b in m.named_buffers(remove_duplicate=True):
                if id(b) not in seen:
                    seen.add(id(b))
                    yield "buffer", join_name(prefix, name), b
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
            [(i, _hook_ids(sub, MODULE_HOOKS)) for i, sub in enumerate(subs)
             if (d := sub.__dict__)["_forward_hooks"] or d["_forward_pre_hooks"] or d["_backward_hooks"] or d["_backward_pre_hooks"]]
            + [(-1 - i, _hook_ids(t, _TENSOR_HOOKS)) for i, t in enumerate(tensors)
               if t._backward_hooks or t._post_accumulate_grad_hooks]
        )
        if _module_globals._global_forward_hooks or _module_globals._global_forward_pre_hooks or \
                _module_globals._global_backward_hooks or _module_globals._global_backward_pre_hooks:
            hooks += ((None, _hook_ids(_module_globals, tuple(f"_global{store}" for store in MODULE_HOOKS))),)
        values = list(self.values)
        for cls in dict.fromkeys(type(sub) for sub in subs):
            read = CLASS_GLOBALS.get(cls)
            if read is None:
                read = CLASS_GLOBALS[cls] = _class_globals(cls)
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
        names = [join_name(prefix, name) if name else prefix for prefix, m in self.modules for name, _ in m.named_modules()]
        if len(old_scalars) != len(scalars):
            out.append("its modules")
        else:
            for name, was, now in zip(names, old_scalars, scalars):
                if was != now:
                    as_dict = lambda items: {k: (kind, x) for k, kind, x in items}  # noqa: E731
                    out += _diff(as_dict(was), as_dict(now), f"{name}." if name else "")
        out += _diff(dict(old_values), dict(values), "")
        return out


MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_TENSOR_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")


def _hook_ids(x: Any, stores: tuple[str, ...]) -> tuple:
    return tuple(tuple(getattr(x, store) or ()) for store in stores)


def join_name(prefix: str, name: str) -> str:
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


CLASS_GLOBALS: dict[type, list[tuple[str, dict, str]]] = {}


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
        if not isinstance(f, types.FunctionType) or id(f) in seen or is_internal_file(f.__code__.co_filename):
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
                visit(join_name(name, k), x, depth + 1, _attr_setter(obj, k))

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
            visit("self" if depth == 0 else join_name(name, "self"), f.__self__, depth)
            f = f.__func__
        if not isinstance(f, types.FunctionType):
            return
        if reads is not None:
            reads.attr(f, "__code__")
        if is_internal_file(f.__code__.co_filename):
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

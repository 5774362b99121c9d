"""What a staged call checks before it reuses the state walk of the call before: guards that cost what
changed, not what exists.

Every call of a staged function must know that the program it runs was staged for the state the function
sees now: the same parameters and buffers (their shapes, strides, dtypes, devices, ``requires_grad``), the same
Python values a trace may have baked in (module attributes, globals, closure cells, defaults, optimizer
hyperparameters), the same hooks. :func:`stagetorch.staging.state.discover` and :meth:`State.tensors_and_key`
walk all of that and make the key; this module remembers, beside the key, every mutable place that walk
read and the object it found there (:class:`Reads`), and checks on the next call that each place still
holds that same object (:class:`Guard`), with C-level passes (``map(operator.is_, ...)``) instead of a
Python loop per attribute. Where something differs the call walks again, so a guard can only be stricter
than the key it stands for: an attribute set again to an equal value walks again and finds the same key.

A step that reads values on the host (``if mask.any():``, LayerDrop's ``torch.rand([]) < p``) has a program
per outcome of those reads: :class:`Outcomes` keeps them, and picks one per call by running the host
program of each (:mod:`stagetorch.staging.host_reads`) on the call's arguments.

What it must not know: how a trace uses the state (``tracer`` says), or what a key means (``state`` says).
"""

from __future__ import annotations

import operator
import types
import weakref
from collections.abc import Sequence
from itertools import chain, repeat
from typing import Any

import torch
import torch.nn.modules.module as _module_globals
import torch.utils._pytree as pytree

from ..utils import caches
from .host_reads import HostProgram
from .state import CLASS_GLOBALS, MODULE_HOOKS, State, discover

__all__ = ["Reads", "Guard", "StateWalk", "flatten_args", "Outcomes", "MAX_OUTCOMES"]

# Set by a test run that checks every reuse against a fresh walk (see tests/staging/test_guards.py).
VERIFY = False

_MISSING = object()
_is = operator.is_
_CELL = operator.attrgetter("cell_contents")
# What State.tensors_and_key keys a tensor on, and its hooks (held as copies: a hook added changes them).
_META = operator.attrgetter("shape", "dtype", "device", "requires_grad", "_backward_hooks", "_post_accumulate_grad_hooks")
_STRIDE = torch.Tensor.stride  # and its strides (a parameter whose data ``Module.to`` swapped keeps the rest)
# A list or dict longer than this is not looked into by discover (see ``state.discover``).
_LONG = 256


class Reads:
    """The mutable places a state walk read, each with the object it found there (held, so that no other
    object can take its id while the guard stands)."""

    def __init__(self) -> None:
        self.cells: list = []
        self.cell_values: list = []
        self.attr_objects: list = []
        self.attr_names: list[str] = []
        self.attr_values: list = []
        self.item_dicts: list[dict] = []
        self.item_keys: list = []
        self.item_values: list = []
        self.dicts: list[dict] = []  # their keys and values, in order
        self.value_dicts: list[dict] = []  # their values, in order (the keys are names the key leaves out)
        self.lists: list[list] = []
        self.long: list = []  # lists and dicts the walk does not look into: they must stay long
        self.typed: list = []
        self.types: list[type] = []
        self.tensors: list[torch.Tensor] = []
        self.guardable = True

    def unguardable(self) -> None:
        """The walk read something no identity check covers (a lazy tensor's value): walk on every call."""
        self.guardable = False

    def cell(self, cell: Any, value: Any) -> None:
        self.cells.append(cell)
        self.cell_values.append(value)

    def attr(self, obj: Any, name: str) -> None:
        self.attr_objects.append(obj)
        self.attr_names.append(name)
        self.attr_values.append(getattr(obj, name))

    def item(self, d: dict, key: Any) -> None:
        self.item_dicts.append(d)
        self.item_keys.append(key)
        self.item_values.append(dict.get(d, key, _MISSING))

    def contents(self, container: list | dict) -> None:
        if len(container) > _LONG:
            self.long.append(container)
        elif isinstance(container, dict):
            self.dicts.append(container)
        else:
            self.lists.append(container)

    def type(self, obj: Any) -> None:
        self.typed.append(obj)
        self.types.append(type(obj))

    def modules(self, subs: list[torch.nn.Module], tensors: list[torch.Tensor]) -> None:
        """What :meth:`State.tensors_and_key` reads of the modules ``subs`` and of ``tensors`` (what it
        returns): each module's class, ``__dict__`` (its scalar attributes and hook stores among it),
        parameters, buffers and children, the global module hooks, the globals its class reads; each
        tensor's metadata and hooks. ``tensors_and_key`` calls it: a read added there is added here."""
        subs = list(dict.fromkeys(subs))
        for sub in subs:
            self.type(sub)
            self.attr(sub, "__dict__")
            d = sub.__dict__
            self.dicts.append(d)
            for x in d.values():
                if type(x) is list:  # a list attribute is keyed on its items
                    self.contents(x)
            self.value_dicts += [d["_parameters"], d["_buffers"], d["_modules"]]
            self.dicts += [d[store] for store in MODULE_HOOKS]
        for store in MODULE_HOOKS:
            self.attr(_module_globals, f"_global{store}")
            self.dicts.append(getattr(_module_globals, f"_global{store}"))
        for cls in dict.fromkeys(type(sub) for sub in subs):
            for _, g, key in CLASS_GLOBALS[cls]:  # tensors_and_key has filled it
                self.item(g, key)
                if type(g.get(key)) is list:
                    self.contents(g[key])
        self.tensors = list(tensors)


def _copy_hooks(meta: tuple) -> tuple:
    """``meta`` with its hook stores copied: the guard compares what they hold, not the store itself."""
    hooks, post = meta[4], meta[5]
    return (*meta[:4], None if hooks is None else type(hooks)(hooks), None if post is None else type(post)(post))


class Guard:
    """Whether a state walk would read the same objects as the one that filled ``reads``, and find the same
    modules among the arguments (``modules``). :meth:`holds` is generated for what the walk read: a few
    C-level passes over flat tuples, none for what it did not read."""

    def __init__(self, reads: Reads, modules: tuple) -> None:
        # Most stores are empty (a leaf module's children, its hooks, its buffers): one truth test each.
        empty = tuple(c for c in chain(reads.dicts, reads.value_dicts, reads.lists) if not c)
        dicts = tuple(d for d in chain(reads.dicts, reads.value_dicts) if d)
        keyed = tuple(d for d in reads.dicts if d)
        lists = tuple(c for c in reads.lists if c)
        tensors = tuple(reads.tensors)
        names: dict[str, Any] = {
            "_is": _is, "_CELL": _CELL, "_META": _META, "_STRIDE": _STRIDE, "_MISSING": _MISSING, "_LONG": _LONG, "_Module": torch.nn.Module,
            "chain": chain, "repeat": repeat, "getattr": getattr, "len": len, "map": map, "all": all, "any": any,
            "type": type, "list": list, "isinstance": isinstance, "dict_get": dict.get, "dict_values": dict.values,
        }
        checks = []

        def check(condition: str, **values: Any) -> None:
            names.update(values)
            checks.append(condition)

        if not reads.guardable:
            check("False")
        if reads.cells:
            check("all(map(_is, map(_CELL, cells), cell_values))", cells=tuple(reads.cells), cell_values=tuple(reads.cell_values))
        if reads.attr_objects:
            check("all(map(_is, map(getattr, attr_objects, attr_names), attr_values))", attr_objects=tuple(reads.attr_objects),
                  attr_names=tuple(reads.attr_names), attr_values=tuple(reads.attr_values))
        if reads.item_dicts:
            check("all(map(_is, map(dict_get, item_dicts, item_keys, repeat(_MISSING)), item_values))",
                  item_dicts=tuple(reads.item_dicts), item_keys=tuple(reads.item_keys), item_values=tuple(reads.item_values))
        if empty:
            check("not any(empty)", empty=empty)
        if dicts:
            # The lengths first: the passes below then pair each value with the one read.
            check("list(map(len, dicts)) == dict_lens", dicts=dicts, dict_lens=list(map(len, dicts)))
            check("all(map(_is, chain.from_iterable(map(dict_values, dicts)), dict_items))",
                  dict_items=tuple(chain.from_iterable(map(dict.values, dicts))))
        if keyed:
            check("all(map(_is, chain.from_iterable(keyed), dict_keys))", keyed=keyed, dict_keys=tuple(chain.from_iterable(keyed)))
        if lists:
            check("list(map(len, lists)) == list_lens", lists=lists, list_lens=list(map(len, lists)))
            check("all(map(_is, chain.from_iterable(lists), list_items))", list_items=tuple(chain.from_iterable(lists)))
        if reads.typed:
            check("all(map(_is, map(type, typed), types))", typed=tuple(reads.typed), types=tuple(reads.types))
        if reads.long:
            check("all(len(c) > _LONG for c in long)", long=tuple(reads.long))
        if tensors:
            check("list(map(_META, tensors)) == metas", tensors=tensors, metas=[_copy_hooks(m) for m in map(_META, tensors)])
            check("list(map(_STRIDE, tensors)) == strides", strides=list(map(_STRIDE, tensors)))
        if modules:
            check("_same(tuple(x for x in leaves if isinstance(x, _Module)), modules)", _same=_same, modules=modules)
        else:
            check("not any(map(isinstance, leaves, repeat(_Module)))")
        source = "def holds(leaves):\n    try:\n        return bool(\n            " + "\n            and ".join(checks)
        source += "\n        )\n    except Exception:\n        return False\n"
        code = _CODE.get(source)
        if code is None:  # compiled once per set of checks: a guard made on every call must be cheap to make
            exec(compile(source, "<stagetorch state guard>", "exec"), names)  # noqa: S102 - made from the checks above
            code = _CODE[source] = names["holds"].__code__
        self.holds = types.FunctionType(code, names)
        self.source = source


# The code of Guard.holds per source: each guard binds its own values to it.
_CODE: dict[str, types.CodeType] = {}


def _same(a: Sequence, b: Sequence) -> bool:
    return len(a) == len(b) and all(map(_is, a, b))


def _arg_modules(leaves: Sequence) -> tuple:
    """The modules among the arguments' leaves, in order: the modules ``discover`` adds from the arguments
    (the leaves of a tensor argument are the tensor)."""
    return tuple(x for x in leaves if isinstance(x, torch.nn.Module))


# A guard that fails on every call costs more than it saves: something it checks changes every call (an
# object set anew on a module each step, which the key leaves out; a key that alternates between two
# programs; a lazy tensor, which no guard covers). After this many misses in a row, the next _REST calls
# walk without making one, as every call did before guards.
_MISSES = 2
_REST = 64


class StateWalk:
    """The state walk of one staged function (``discover`` and ``tensors_and_key``), made again only when
    something it read changed. ``walk`` returns the same ``State``, tensor list and key objects while its
    guard holds."""

    def __init__(self) -> None:
        self._last: tuple[Any, Guard, State, list, tuple] | None = None  # (fn, guard, state, tensors, key)
        self._misses = 0  # guards that failed in a row
        self._rest = 0  # calls left to walk without a guard
        self.walks = 0  # full walks made (a test's way to see the guard at work)
        _WALKS.add(self)

    def walk(self, fn: Any, args: tuple, kwargs: dict, leaves: Sequence) -> tuple[State, list[torch.Tensor], tuple]:
        """``fn``'s ``State``, its tensors and its key for a call with ``args``/``kwargs`` (``leaves``: their
        flat leaves, lazy tensors already replaced by what they hold)."""
        last = self._last
        self.walks += 1
        if self._rest:
            self._rest -= 1
            state = discover(fn, args, kwargs)
            return (state, *state.tensors_and_key())
        if last is not None and last[0] is fn and last[1].holds(leaves):
            self.walks -= 1
            self._misses = 0
            if VERIFY:
                _verify(fn, args, kwargs, last)
            return last[2], last[3], last[4]
        reads = Reads()
        state = discover(fn, args, kwargs, reads=reads)
        tensors, key = state.tensors_and_key(reads)
        if last is not None and last[0] is fn:
            if _same(tensors, last[3]) and key == last[4]:
                tensors, key = last[3], last[4]  # the same objects: the caller's cache lookup is then cheap
            self._misses += 1
            if self._misses >= _MISSES:
                self._misses, self._rest, self._last = 0, _REST, None
                return state, tensors, key
        self._last = (fn, Guard(reads, _arg_modules(leaves)), state, tensors, key)
        return state, tensors, key

    def forget(self) -> None:
        self._last = None
        self._misses = self._rest = 0


def _verify(fn: Any, args: tuple, kwargs: dict, last: tuple) -> None:
    tensors, key = discover(fn, args, kwargs).tensors_and_key()
    if key != last[4] or not _same(tensors, last[3]):
        raise AssertionError(f"a state guard held where the state walk changed: {last[2].changes(last[4], key)}")


# Every StateWalk, so that clear_caches drops what their guards hold.
_WALKS: weakref.WeakSet[StateWalk] = weakref.WeakSet()


def _forget_all() -> None:
    for w in list(_WALKS):
        w.forget()


caches.on_clear(_forget_all)


# The tree spec of n plain tensors passed positionally, without keywords: the common call.
_PLAIN: dict[int, pytree.TreeSpec] = {}


def flatten_args(args: tuple, kwargs: dict) -> tuple[list, pytree.TreeSpec]:
    """``pytree.tree_flatten((args, kwargs))``, with a shortcut for the call every training loop makes:
    plain tensors passed positionally (the spec is then the same object every call)."""
    if not kwargs and all(type(a) is torch.Tensor or type(a) is torch.nn.Parameter for a in args):
        spec = _PLAIN.get(len(args))
        if spec is None:
            spec = _PLAIN[len(args)] = pytree.tree_flatten((args, kwargs))[1]
        return list(args), spec
    return pytree.tree_flatten((args, kwargs))




# The programs kept for one signature of a step that reads values on the host: beyond this, the least
# recently used is dropped (each new outcome stages, and logs why).
MAX_OUTCOMES = 16


class Outcomes:
    """The staged programs of one signature whose step reads values on the host (see
    :mod:`stagetorch.staging.host_reads`), each with the host program that computes those reads: a call takes the first
    program whose reads come out, on its arguments, as they did when it was staged. Most recently used
    first, at most :data:`MAX_OUTCOMES`."""

    def __init__(self) -> None:
        self.programs: list[tuple[HostProgram, Any]] = []

    def pick(self, args: Sequence[torch.Tensor]) -> tuple[Any, dict] | None:
        """The program (the value :meth:`add` was given) for a call with tensor arguments ``args``, and the
        values its host program feeds it; None when no program read what this call reads."""
        seen: list = []  # the call's outcomes, as far as the programs run so far read them
        for i, (host, program) in enumerate(self.programs):
            if not host.agrees(seen):  # its reads came out otherwise on this call: no need to run it
                continue
            fed, found = host.run(args)
            if fed is not None:
                if i:
                    self.programs.insert(0, self.programs.pop(i))
                return program, fed
            seen = max(seen, found, key=len)
        return None

    def add(self, host: HostProgram, program: Any) -> None:
        self.programs.insert(0, (host, program))
        del self.programs[MAX_OUTCOMES:]

    def __len__(self) -> int:
        return len(self.programs)

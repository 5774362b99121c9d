"""The commit plan: which of the caller's state a program writes, which writes need a copy to undo, and the
program's *commit*, its last stretch, where nothing can fail for memory.

A step that fails must leave the caller's state (parameters, buffers, ``.grad``, optimizer state) as it
was. A program writes that state in two ways (see :func:`commit_plan` and ``docs/chunking.md``): a write
after which something can still fail saves a copy of what it writes first
(:class:`~stagetorch.interpreters.undo.Undo`); the writes of the commit save nothing. The commit's
temporaries are placed in one workspace allocated before its first write (with the state a first optimizer
step makes there), so an optimizer step inside the program, foreach or not, costs no copy of the model.

A pure analysis of a scheduled graph (:func:`stagetorch.transforms.schedule.scheduled`): it knows the IR,
the schedule and the ATen ops whose out= or in-place forms allocate nothing; it runs nothing and holds no
tensor. The eager interpreter compiles its plan into a program; the memory interpreter costs it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import torch

from ..ir import Aval, Eqn, Graph, Var, iter_vars
from .schedule import Liveness, add_into, is_random, writes

__all__ = ["COMMIT_OPS", "Commit", "commit_plan", "may_commit"]

aten = torch.ops.aten


# Ops whose out= overload runs the functional op's own kernel into the given tensor, allocating nothing of
# the output's size (each checked under the allocator by tests/interpreters/test_commit.py): what optimizers compute.
# The out= overloads of rsub.Tensor and of the arithmetic ops' .Scalar forms compute into a temporary and
# copy it (a traced step records a Python number's product as mul.Tensor, whose out= does not).
COMMIT_OPS = frozenset(
    getattr(packet, name)
    for packet in (
        aten.add, aten.sub, aten.rsub, aten.mul, aten.div, aten.pow, aten.sqrt, aten.rsqrt, aten.reciprocal,
        aten.neg, aten.abs, aten.sign, aten.maximum, aten.minimum, aten.clamp, aten.clamp_min, aten.clamp_max,
        aten.lerp, aten.addcmul, aten.addcdiv, aten.exp, aten.log, aten.sigmoid, aten.tanh, aten.square,
    )
    for name in packet.overloads()
    if not name.endswith("out") and not (name.startswith("Scalar") and packet in (aten.add, aten.sub, aten.mul, aten.div, aten.rsub))
) - {aten.rsub.Tensor}

# The ops of COMMIT_OPS by name: a functional ``_foreach_`` op of one of them runs in a commit as its in-place
# form on a copy of its first list (see _foreach_in_place).
_COMMIT_NAMES = frozenset(p.overloadpacket.__name__ for p in COMMIT_OPS)

# Writes that allocate nothing of their argument's size (besides pointwise in-place ops).
_SAFE_WRITES = frozenset({aten.copy_, aten.zero_, aten.fill_})

# Calls with no memory and no failure of their own: the profiler's record_function around optimizer.step.
_INERT = frozenset({"profiler::_record_function_enter_new", "profiler::_record_function_exit"})

_ALIGN = 64  # bytes: each temporary of the commit's workspace starts on a boundary any dtype accepts


@attrs.frozen
class Commit:
    """How a program protects the caller's state (see :func:`commit_plan`).

    ``saves[k]``: the vars (inputs or views of them) whose storage step ``k`` writes outside the commit,
    saved to the :class:`~stagetorch.interpreters.undo.Undo` before it runs. ``start``: the step of the commit's first write (None: no
    commit). ``places``: per step of the commit that allocates, its out= overload, the names of its output
    arguments and, per output, the index of its place in ``layout``: (device, offset, bytes, dtype, shape);
    for a functional ``_foreach_`` op, its in-place form and no names (the first list is copied into the
    places, then updated there by the same kernel). ``workspace``: bytes per device of the one allocation
    the commit makes, before its first write. ``fresh``: per step of the commit that makes a tensor the
    program keeps (a first step's momentum buffer, ``clone(grad)``), what that tensor is laid out as (a var,
    or an Aval: contiguous): it is allocated beside the workspace, before the first write, and filled at its
    step. ``numbers``: bytes the commit still allocates after that, at their most at once: the 0-dim results
    of the ops on numbers it runs as they are (a step count's power) and the Python numbers an op wraps as
    0-dim tensors (at most 16 bytes each, with their cast, freed inside the op).
    """

    saves: dict[int, list[Var]] = attrs.field(factory=dict)
    start: int | None = None
    places: dict[int, tuple[Any, tuple[str, ...], tuple[int, ...]]] = attrs.field(factory=dict)
    layout: tuple[tuple[torch.device, int, int, torch.dtype, tuple[int, ...]], ...] = ()
    workspace: dict[torch.device, int] = attrs.field(factory=dict)
    fresh: dict[int, Var | Aval] = attrs.field(factory=dict)
    numbers: int = 0

    @property
    def saved_inputs(self) -> list[Var]:
        """The vars saved, in order, each once."""
        return list(dict.fromkeys(v for vs in self.saves.values() for v in vs))


def commit_plan(run: Graph, keep: Sequence[Var] = (), final: bool = True) -> Commit:
    """Where the scheduled graph ``run`` writes storage it did not make (its inputs: the caller's state), and
    which of those writes need a copy to undo.

    The *commit* is the longest tail of the program in which every step is one that cannot fail for memory
    once its outputs have a place: an in-place pointwise write, a view, the profiler's marks, a pointwise
    op on 0-dim tensors only (a few bytes, as each Python scalar an op wraps as a tensor), or an op of
    :data:`COMMIT_OPS` on operands of one dtype (a 0-dim one aside) whose result the program does not keep,
    run into its out= overload; a functional ``_foreach_`` op of one of them (an optimizer's
    ``_foreach_sqrt``), run as its in-place form on a copy of its first list; or a copy the program keeps (a
    first step's momentum buffer). It starts at the first write to an input in that tail. Its temporaries are
    placed, first fit by lifetime, in one workspace per device, allocated just before that write with the
    tensors it keeps; a failure to allocate them comes before anything is written. A write outside the
    commit (a forward's BatchNorm statistics, an optimizer followed by a forward or a custom op, any write of
    a program that is not ``final``) saves what it writes first. An optimizer stepped last in a step, foreach
    or not, is a commit: its parameters and moments are written in place with nothing copied."""
    eqns = run.eqns
    n = len(eqns)
    made = {v for e in eqns for v in e.outvars if v is not None and v.base is None}  # storage the program makes
    kept = {_root(v) for v in run.outvars if isinstance(v, Var)} | {_root(v) for _, v in run.grads}
    kept |= {_root(v) for v in keep}
    state_writes = [[x for x in writes(e) if _root(x) not in made] for e in eqns]
    safe = [final and _cannot_fail(e, kept) for e in eqns]
    first_safe = n
    while first_safe > 0 and safe[first_safe - 1]:
        first_safe -= 1
    start = next((k for k in range(first_safe, n) if state_writes[k]), None)
    end = n if start is None else start
    saves = {k: state_writes[k] for k in range(end) if state_writes[k]}
    if start is None:
        return Commit(saves)
    last: dict[Var, int] = {}
    for k, e in enumerate(eqns):
        for v in e.invars:
            last[_root(v)] = k
    places: dict[int, tuple[Any, tuple[str, ...], tuple[int, ...]]] = {}
    layout: list[tuple[torch.device, int, int, torch.dtype, tuple[int, ...]]] = []
    active: dict[torch.device, list[tuple[int, int, int]]] = {}  # (offset, bytes, last step) per device
    workspace: dict[torch.device, int] = {}
    fresh: dict[int, Var | Aval] = {}
    made_at = {v: k for k, e in enumerate(eqns) for v in e.outvars if v is not None}
    for k in range(start, n):
        e = eqns[k]
        outs = [v for v in e.outvars if v is not None]
        if _is_fresh(e, kept):
            fresh[k] = _layout_donor(e.args[0], eqns, made_at, start)
            continue
        if not outs or _returns_alias(e):
            continue  # a write, or a view
        if e.prim in COMMIT_OPS and _out_overload(e.prim)[0] is not None:
            overload, names = _out_overload(e.prim)
        elif _foreach_in_place(e) is not None:
            overload, names = _foreach_in_place(e), ()
        else:
            continue  # an op on numbers that makes its few bytes itself
        ids = []
        for v in outs:
            device, size = v.aval.device, -(-v.aval.nbytes // _ALIGN) * _ALIGN
            blocks = active.setdefault(device, [])
            blocks[:] = [b for b in blocks if b[2] >= k]
            offset = 0
            for o, b, _ in sorted(blocks):
                if offset + size <= o:
                    break
                offset = max(offset, o + b)
            blocks.append((offset, size, last.get(v, k)))
            workspace[device] = max(workspace.get(device, 0), offset + size)
            ids.append(len(layout))
            layout.append((device, offset, v.aval.nbytes, v.aval.dtype, v.aval.shape))
        places[k] = (overload, names, tuple(ids))
    return Commit(saves, start, places, tuple(layout), workspace, fresh, _numbers(eqns, start, places, fresh, last))


def may_commit(graph: Graph, live: Liveness) -> bool:
    """Whether ``graph``, run as a step's last program on the schedule ``live``, may have a commit: a cheap
    test before :func:`commit_plan` (which the memory interpreter would otherwise make for every graph it
    costs). It walks back the tail of equations that cannot fail, as the commit does but on the graph
    before scheduling, where every test is as lenient (an accumulation into a dying gradient is still an
    ``add``), and looks for a write to an input's storage there. False: there is none."""
    eqns, runs = graph.eqns, live.runs
    kept = {live.storage(v) for v in graph.outvars if isinstance(v, Var)} | {live.storage(v) for _, v in graph.grads}
    for k in range(len(eqns) - 1, -1, -1):
        if not runs[k]:
            continue
        e = eqns[k]
        if not _cannot_fail(e, kept):
            return False
        if any(live.defined.get(live.storage(x)) == -1 for x in writes(e)):
            return True
    return False


_WRAPPED = 16  # bytes: a Python number an op wraps as a 0-dim tensor (complex double), or its cast


def _numbers(eqns: list[Eqn], start: int, places: dict, fresh: dict, last: dict[Var, int]) -> int:
    """The bytes a commit allocates besides its workspace, at their most at once (``Commit.numbers``)."""
    live: dict[Var, int] = {}
    most = 0
    for k in range(start, len(eqns)):
        e = eqns[k]
        numbers = [x for x in _leaves((e.args, e.kwargs)) if isinstance(x, (int, float, complex))]
        wrapped = _WRAPPED * sum(not isinstance(x, bool) for x in numbers)
        if k not in places and k not in fresh and not _returns_alias(e):
            live.update((v, v.aval.nbytes) for v in e.outvars if v is not None)
        most = max(most, sum(live.values()) + wrapped)
        for v in [v for v in live if last.get(v, k) <= k]:
            del live[v]
    return most


def _leaves(tree: Any) -> Iterator[Any]:
    if isinstance(tree, (list, tuple)):
        for x in tree:
            yield from _leaves(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from _leaves(x)
    else:
        yield tree


def _layout_donor(v: Var, eqns: list[Eqn], made_at: dict[Var, int], start: int) -> Var | Aval:
    """What a tensor the commit keeps, a copy of ``v``, is laid out as when the commit allocates it: ``v``
    if it exists by then; else an operand of the same shape of the op that makes ``v`` that does (eager's
    result of a pointwise op is laid out as its operands: a channels-last weight and its gradient); else
    ``v``'s Aval (contiguous, as the commit's temporaries are)."""
    if made_at.get(v, -1) < start:  # an input, or made before (a view of an input is made where it is taken)
        return v
    maker = eqns[made_at[v]]
    for x in iter_vars((maker.args, maker.kwargs)):
        if x.aval == v.aval and made_at.get(x, -1) < start:
            return x
    return v.aval


def _root(v: Var) -> Var:
    return v.root


def _is_inert(prim: Any) -> bool:
    name = getattr(prim, "name", None)
    return isinstance(prim, torch._ops.OperatorBase) and callable(name) and name().split(".")[0] in _INERT


def _returns_alias(e: Eqn) -> bool:
    schema = getattr(e.prim, "_schema", None)
    return schema is not None and bool(schema.returns) and all(r.alias_info is not None for r in schema.returns)


def _cannot_fail(e: Eqn, kept: set[Var]) -> bool:
    """Whether step ``e`` of a commit allocates nothing of a tensor's size once its outputs have a place
    in the workspace (see :func:`commit_plan`)."""
    prim = e.prim
    if prim is add_into:
        return False  # it may fall back to a new tensor
    if _is_inert(prim):
        return True
    if not isinstance(prim, torch._ops.OpOverload) or prim.namespace != "aten" or is_random(e):
        return False
    schema = prim._schema
    packet = prim.overloadpacket
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        pointwise = torch.Tag.pointwise in prim.tags or packet in _SAFE_WRITES or (
            packet.__name__.startswith("_foreach_") and packet.__name__.endswith("_")
        )
        return pointwise and (not schema.returns or _returns_alias(e)) and _one_dtype(e)
    if _returns_alias(e):
        return "as_strided" not in packet.__name__  # a view: strides of its own would read other bytes
    if _is_fresh(e, kept):
        return True  # allocated with the workspace, then a copy
    outs = [v for v in e.outvars if v is not None]
    if any(v.root in kept or v.base is not None for v in outs):
        return False
    numbers = all(v.aval.ndim == 0 for v in [*outs, *iter_vars((e.args, e.kwargs))])
    if packet.__name__.startswith("_foreach_"):
        if packet.__name__.removeprefix("_foreach_") not in _COMMIT_NAMES or not _one_dtype(e):
            return False
        return numbers or _foreach_in_place(e) is not None
    if torch.Tag.pointwise in prim.tags and numbers:
        return True  # on numbers (a step count, a bias correction): a few bytes, as a wrapped Python scalar
    return prim in COMMIT_OPS and _out_overload(prim)[0] is not None and _one_dtype(e)


def _is_fresh(e: Eqn, kept: set[Var]) -> bool:
    """``e`` copies a tensor into a new one the program keeps (SGD's first momentum buffer, ``clone(grad)``):
    the commit allocates it, laid out as what it copies, before its first write."""
    if e.prim is not aten.clone.default or e.kwargs.get("memory_format") not in (None, torch.preserve_format):
        return False
    (out,) = e.outvars
    return out is not None and out.base is None and out in kept and isinstance(e.args[0], Var)


def _foreach_in_place(e: Eqn) -> Any:
    """The in-place form of the functional ``_foreach_`` op of ``e`` (``_foreach_sqrt_`` for
    ``_foreach_sqrt``), if its outputs are laid out as its first list: the commit copies that list into the
    outputs' places and runs it there. Its out= overload would compute into new tensors and copy; the
    in-place form runs the functional op's own kernel and allocates nothing. None if there is none."""
    prim = e.prim
    found = _FOREACH_IN_PLACE.get(prim, False)
    if found is False:
        found = None
        packet = getattr(aten, prim.overloadpacket.__name__ + "_", None)
        name = prim._overloadname
        if packet is not None and name in packet.overloads():
            o = getattr(packet, name)
            args = [(a.name, str(a.type)) for a in prim._schema.arguments]
            if [(a.name, str(a.type)) for a in o._schema.arguments] == args and args and args[0][1] == "List[Tensor]":
                found = o
        _FOREACH_IN_PLACE[prim] = found
    if found is None or not e.args or not isinstance(e.args[0], (list, tuple)):
        return None
    first = list(e.args[0])
    outs = list(e.outvars)
    same = all(isinstance(x, Var) and y is not None and x.aval == y.aval for x, y in zip(first, outs))
    if len(first) != len(outs) or not same:
        return None
    return found


_FOREACH_IN_PLACE: dict[Any, Any] = {}


def _one_dtype(e: Eqn) -> bool:
    """Every tensor operand and output of ``e`` has one dtype and device (a 0-dim operand may have another
    dtype of the same kind, and live on the CPU): where they differ, an in-place or out= kernel computes into
    a temporary of the common dtype, or copies across devices."""
    vs = list(iter_vars((e.args, e.kwargs))) + [v for v in e.outvars if v is not None]
    if len({v.aval.dtype for v in vs if v.aval.ndim}) > 1 or len({v.aval.device for v in vs if v.aval.ndim}) > 1:
        return False
    kinds = {(d.is_floating_point, d.is_complex, d == torch.bool) for d in {v.aval.dtype for v in vs}}
    return len(kinds) <= 1


_OUT_OVERLOADS: dict[Any, tuple[Any, tuple[str, ...]]] = {}


def _out_overload(prim: Any) -> tuple[Any, tuple[str, ...]]:
    """The out= overload of ``prim`` (the same arguments, and outputs to write) and the names of its output
    arguments; (None, ()) if it has none."""
    found = _OUT_OVERLOADS.get(prim)
    if found is None:
        found = (None, ())
        packet = prim.overloadpacket
        args = [(a.name, str(a.type)) for a in prim._schema.arguments]
        for name in packet.overloads():
            o = getattr(packet, name)
            outs = [a for a in o._schema.arguments if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write]
            rest = [(a.name, str(a.type)) for a in o._schema.arguments if a not in outs]
            if outs and rest == args and len(outs) == len(prim._schema.returns):
                found = (o, tuple(a.name for a in outs))
                break
        _OUT_OVERLOADS[prim] = found
    return found

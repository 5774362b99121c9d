"""The eager interpreter: compiles a Graph into a program that runs it on real tensors.

It only compiles: which equations run, which var is which tensor and where each tensor dies is the schedule
of :func:`stagetorch.transforms.schedule.liveness`, the one the memory interpreter costs. It knows the IR and that
schedule; chunking builds graphs for it to run, and the staged callable gives it the real inputs.

A step that fails must leave the caller's state (parameters, buffers, ``.grad``, optimizer state) as it
was. A program writes that state in two ways (see :func:`commit_plan` and ``docs/chunking.md``): a write
after which something can still fail saves a copy of what it writes first (:class:`Undo`); the writes of
the program's *commit*, its last stretch, where nothing can fail for memory, save nothing. The commit's
temporaries are made in one workspace allocated before its first write (with the state a first optimizer
step makes there), so an optimizer step inside the program, foreach or not, costs no copy of the model.
"""

from __future__ import annotations

import itertools
import keyword
import linecache
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import attrs
import torch
import torch.utils._python_dispatch

from ..ir import Aval, Eqn, Graph, Literal, Var, iter_vars, op_name
from ..transforms.schedule import Liveness, add_into, is_random, liveness, scheduled, writes
from ..utils import collector
from ..utils.tree import flatten

__all__ = ["Program", "Undo", "Commit", "commit_plan", "accumulate_grad", "grad_to_install", "install_grads"]

aten = torch.ops.aten
_below_autograd = torch._C._AutoDispatchBelowAutograd


class Program:
    """A Graph compiled for repeated execution: straight-line Python, one call per equation that runs, each
    value dropped after its last use. What runs and what is dropped where is :func:`stagetorch.transforms.schedule.liveness`'s
    schedule, the one the memory interpreter costs; this class only turns it into code."""

    @collector.paused()  # building a big program allocates many objects that all stay alive, as tracing does
    def __init__(self, graph: Graph, keep: Sequence[Var] = (), final: bool = False):
        """``final``: nothing of the step runs after this program, so its last stretch may be a commit
        (:func:`commit_plan`); a program something runs after saves whatever it writes of its inputs."""
        self.graph = graph
        live = liveness(graph, keep)
        run = scheduled(graph, live)  # aliases replaced by their tensors: one slot (a local) per var
        slot_of = {v: k for k, v in enumerate(run.vars())}
        frees = [free for free, runs in zip(live.frees, live.runs) if runs]
        steps = [(e, [slot_of[v] for v in free]) for e, free in zip(run.eqns, frees)]
        nslots = len(slot_of)
        self.out_slots = [slot_of[v] if isinstance(v, Var) else v for v in run.outvars]
        self.grad_slots = [(i, slot_of[v]) for i, v in run.grads]
        in_slots = [slot_of[v] for v in run.invars]
        self.commit = commit_plan(run, keep, final)
        self._run = _compile(steps, slot_of, in_slots, nslots, self.out_slots, self.grad_slots, self.commit)
        # What run() hands back, read from the environment by one generated expression each (a step's hot path:
        # a comprehension over the slots cost ~10 bytecodes a value).
        literals = {f"_l{k}": x.value for k, x in enumerate(self.out_slots) if isinstance(x, Literal)}
        self._outputs = eval(  # noqa: S307 - made from slot numbers
            "lambda env: [" + "".join(f"_l{k}, " if f"_l{k}" in literals else f"env[{x}], " for k, x in enumerate(self.out_slots)) + "]",
            literals,
        )
        self._grads = eval("lambda env: [" + "".join(f"({i}, env[{s}]), " for i, s in self.grad_slots) + "]")  # noqa: S307

    def run_env(self, inputs: Sequence[torch.Tensor], undo: Undo | None = None) -> list:
        """Run on real inputs (parallel to the graph's invars); returns the environment of the slots the
        outputs and gradients live in. ``undo`` receives a copy of each protected input before the program
        first writes it outside its commit."""
        # Below autograd, not under no_grad: some kernels (mkldnn RNN) skip saving what their backward
        # needs when grad mode is off, and the staged backward needs it.
        with torch._C._AutoDispatchBelowAutograd():
            return self._run(inputs, _NOTHING if undo is None else undo)

    def outputs(self, env: list) -> list:
        return self._outputs(env)

    def run(self, inputs: Sequence[torch.Tensor], undo: Undo | None = None) -> tuple[list, list[tuple[int, torch.Tensor]]]:
        """Run; return the flat outputs and the (input position, gradient) pairs to accumulate."""
        with _below_autograd():  # as run_env (a step's hot path: one call less)
            env = self._run(inputs, _NOTHING if undo is None else undo)
        return self._outputs(env), self._grads(env)


class Undo:
    """What a failed step puts back: a copy of each protected tensor (the caller's state the step writes),
    taken just before a program first writes it outside its commit, when the step is past its largest
    allocations (a forward's BatchNorm statistics are copied in the forward, an optimizer's state only
    where its update cannot be a commit). ``protected``: the tensors whose storage is the caller's."""

    def __init__(self, protected: Iterable[torch.Tensor] = ()):
        self.protected = {t.untyped_storage().data_ptr() for t in protected}
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def save(self, t: torch.Tensor) -> None:
        base = t if t._base is None else t._base
        key = base.untyped_storage().data_ptr()
        if key in self.protected and key not in self.saved:
            self.saved[key] = (base, base.clone())

    def restore(self) -> None:
        with torch.no_grad():
            for t, copy in self.saved.values():
                t.copy_(copy)
        self.saved.clear()


_NOTHING = Undo()  # protects nothing: a program run outside a step's guarantee


# ---------------------------------------------------------------------------------------------------------
# The commit: the last stretch of a program, where nothing can fail for memory.

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
    saved to the :class:`Undo` before it runs. ``start``: the step of the commit's first write (None: no
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


def _carve(
    layout: tuple, workspace: dict[torch.device, int], like: Sequence[torch.Tensor | Aval] = ()
) -> list[torch.Tensor]:
    """The commit's allocations, all made before its first write: its temporaries, views into one allocation
    per device, then a tensor laid out as each of ``like`` (a tensor, or an Aval: contiguous), each a tensor
    the program keeps."""
    spaces = {d: torch.empty(size, dtype=torch.uint8, device=d) for d, size in workspace.items()}
    views = [spaces[d][o:o + size].view(dtype).view(shape) for d, o, size, dtype, shape in layout]
    return views + [
        torch.empty_like(t) if isinstance(t, torch.Tensor) else torch.empty(t.shape, dtype=t.dtype, device=t.device)
        for t in like
    ]


def _laid_out(places: list[torch.Tensor], like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The workspace ``places`` (contiguous) viewed with the strides of ``like`` where those are dense in
    another order (a transposed weight): a functional ``_foreach_`` op's results are laid out as its first
    list, and copying a transposed tensor into a contiguous one would allocate a transposition buffer."""
    return [
        w if x.is_contiguous() or not _dense(x) else w.as_strided(x.shape, x.stride()) for w, x in zip(places, like)
    ]


def _dense(x: torch.Tensor) -> bool:
    """The elements of ``x`` fill ``x.numel()`` places of its storage without a gap or overlap."""
    expected = 1
    for size, stride in sorted(zip(x.shape, x.stride()), key=lambda d: d[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def grad_to_install(param: torch.Tensor, grad: torch.Tensor, fresh: bool = False) -> torch.Tensor:
    """The tensor autograd's AccumulateGrad would make ``param.grad`` from ``grad`` where ``.grad`` is None:
    ``grad`` itself, or a copy laid out as ``param`` (the one allocation of installing a gradient).
    ``fresh``: ``grad`` is known to live in storage of its own (not a view of an input)."""
    if grad.stride() != param.stride() or (
        not fresh and grad.untyped_storage().data_ptr() == param.untyped_storage().data_ptr()
    ):
        return torch.empty_strided(param.shape, param.stride(), dtype=param.dtype, device=param.device).copy_(grad)
    return grad


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor, fresh: bool = False) -> None:
    """What autograd's AccumulateGrad does for a dense leaf: set ``.grad`` or add into it in place.
    ``fresh``: ``grad`` is known to live in storage of its own (not a view of an input)."""
    if param.grad is None:
        param.grad = grad_to_install(param, grad, fresh)
    else:
        with torch.no_grad():
            param.grad.add_(grad)


def install_grads(
    inputs: list, grads: Sequence[tuple[int, torch.Tensor]], zeros: Sequence[torch.Tensor],
    grad_params: Sequence[int] = (), assign_grads: Sequence[int] = (), clear_grads: Sequence[int] = (),
) -> None:
    """Leave each ``.grad`` as the eager step would after a staged step ran: ``grads`` are the (input
    position, gradient) pairs it returned; ``grad_params`` the positions whose ``.grad`` it read, fed as
    ``zeros`` (parallel) where it was None, which then become that ``.grad``; ``assign_grads`` those whose
    ``.grad`` it replaces, ``clear_grads`` those it sets to None.

    The only allocations, a copy of a gradient laid out otherwise than its parameter where no ``.grad`` will
    be there to add into, are made before any ``.grad`` changes: failing to make one leaves every ``.grad`` as
    it was (the rest assigns, or adds in place)."""
    fed = {i for i in grad_params if inputs[i].grad is None} if grad_params else ()
    assigned = set(assign_grads) if assign_grads else ()
    ready = []  # (parameter, gradient, laid out as the parameter)
    installed = set()  # the ids of the gradients installed as they are
    for i, g in grads:
        param = inputs[i]
        if i in assigned or (param.grad is None and i not in fed):
            g = grad_to_install(param, g)
            if id(g) in installed:
                # One gradient for two parameters (the oneDNN LSTM's backward returns one bias gradient for
                # both biases): autograd's AccumulateGrad copies a gradient another edge still holds (views of
                # one storage it installs as they are), so each ``.grad`` is a tensor of its own, which an
                # in-place clip or accumulation touches once.
                g = torch.empty_strided(param.shape, param.stride(), dtype=param.dtype, device=param.device).copy_(g)
            installed.add(id(g))
            ready.append((param, g, True))
        else:
            ready.append((param, g, False))
    for i, zero in zip(grad_params, zeros):
        if inputs[i].grad is None:
            inputs[i].grad = zero  # the zeros fed for it, which the step wrote
    for i in assign_grads:
        inputs[i].grad = None
    for param, g, laid_out in ready:
        if param.grad is None:
            param.grad = g if laid_out else grad_to_install(param, g, fresh=True)
        else:
            with torch.no_grad():
                param.grad.add_(g)
    for i in clear_grads:
        inputs[i].grad = None


_PROGRAMS = itertools.count()


class _Dispatched(torch.utils._python_dispatch.TorchDispatchMode):
    """The ops a call dispatches (on meta tensors, see :func:`_entry`), with their arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.calls.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


# Where torch's Python bindings are: functions (torch.addmm, torch._C._nn.nll_loss_forward), then methods.
_BINDINGS = [torch._C._VariableFunctions, torch._C._nn, torch._C._linalg, torch._C._special, torch._C.TensorBase]
_ENTRIES: dict[tuple, Any] = {}  # (overload, what its arguments are) -> the binding that calls it, or None
# Factories whose binding (torch.ones_like) is exact where the dispatch mode says it is (see _entry).
_LIKE_FACTORIES = frozenset({aten.ones_like.default, aten.zeros_like.default})


def _entry(e: Eqn) -> Callable:
    """What the program calls for ``e``: the Python binding of torch's that calls exactly ``e.prim`` with these
    arguments and nothing else (``torch.addmm``, ``Tensor.view``), where there is one, else the overload's
    own entry point.
    A binding parses its arguments in C++ and calls the kernel unboxed; an overload's ``_op`` boxes each
    argument through the JIT's operator registry, ~1-2 us more per op: a third of what one-line mode added
    to a small step (docs/history/results-log.md). Whether a binding is exact is found once per overload and kinds of
    arguments, by calling it on meta tensors under a dispatch mode that sees each op it dispatches: it must
    dispatch ``e.prim`` alone (``torch.ones_like`` also detaches), with the same arguments (nothing
    decomposed, defaulted or converted on the way)."""
    prim = e.prim
    fallback = getattr(prim, "_op", prim)  # the overload's C++ entry point
    packet = getattr(prim, "overloadpacket", None)
    if packet is None or prim.namespace != "aten" or (
        prim not in _LIKE_FACTORIES and any(a.name == "pin_memory" for a in prim._schema.arguments)
    ):
        # (A factory's binding can do more than its op, which a dispatch mode does not always see: the
        # binding's TensorOptions take requires_grad, device initialisation... Only the ``*_like`` factories
        # below are taken, where the binding calls the op on the tensor's own options and hands back the
        # result with requires_grad off, as the op does: the ones of a loss's gradient, each step.)
        return fallback
    key = (prim, _kinds(e.args), _kinds(e.kwargs))
    if key not in _ENTRIES:
        binding = _exact_binding(prim, packet.__name__, e.args, e.kwargs)
        if binding is not None and prim in _LIKE_FACTORIES:
            binding = _like_binding(binding, fallback)
        _ENTRIES[key] = binding
    return _ENTRIES[key] or fallback


_dispatch_modes = torch._C._len_torch_dispatch_stack
_Tensor = torch.Tensor


def _like_binding(binding: Callable, op: Callable) -> Callable:
    """``torch.ones_like`` for ``aten.ones_like``: the binding hands the op's result back through
    ``make_variable``, which detaches it (a dispatched ``aten.detach``) where something else holds it, as a
    user's dispatch mode does, or where the tensor is a subclass's. There the op's own entry runs, so that
    a mode sees the same ops either way; a plain tensor with no mode (each step's loss) takes the binding,
    ~2 us less than the boxed entry."""

    def like(x: Any, *args: Any, **kwargs: Any) -> Any:
        if type(x) is _Tensor and not _dispatch_modes():
            return binding(x, *args, **kwargs)
        return op(x, *args, **kwargs)

    return like


def _kinds(tree: Any) -> Any:
    if isinstance(tree, Var):
        return Var
    if isinstance(tree, (list, tuple)):
        return (type(tree), tuple(_kinds(x) for x in tree))
    if isinstance(tree, dict):
        return tuple((k, _kinds(v)) for k, v in tree.items())
    return type(tree)


def _exact_binding(prim: Any, name: str, args: tuple, kwargs: dict) -> Callable | None:
    metas: dict[int, torch.Tensor] = {}

    def meta(x: Any) -> Any:
        if isinstance(x, Var):
            t = metas[len(metas)] = torch.empty(x.aval.shape, dtype=x.aval.dtype, device="meta")
            return t
        if isinstance(x, (list, tuple)):
            return type(x)(meta(y) for y in x)
        return x.value if isinstance(x, Literal) else x

    # The user's dispatch modes (a FlopCounterMode around the first call) see none of it.
    with torch.utils._python_dispatch._disable_current_modes():
        return _exact_binding_of(prim, name, meta, args, kwargs)


def _exact_binding_of(prim: Any, name: str, meta: Callable, args: tuple, kwargs: dict) -> Callable | None:
    try:
        margs, mkwargs = meta(list(args)), {k: meta(v) for k, v in kwargs.items()}
    except Exception:  # noqa: BLE001 - no meta tensor for it (a layout the aval does not say): the overload's entry
        return None
    for owner in _BINDINGS:
        binding = getattr(owner, name, None)
        if binding is None or not callable(binding):
            continue
        seen = _Dispatched()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a deprecated signature matched: not this one
                with seen:
                    binding(*margs, **mkwargs)
        except Exception:  # noqa: BLE001, S112 - it does not take these arguments (or has no meta kernel)
            continue
        if len(seen.calls) == 1:
            func, a, k = seen.calls[0]
            if func is prim and _same(list(a), margs) and _same(k, mkwargs):
                return binding
    return None


def _same(a: Any, b: Any) -> bool:
    """The same arguments: the same meta tensors (by identity), equal everything else, in the same structure."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _has_var(tree: Any) -> bool:
    if isinstance(tree, Var):
        return True
    if isinstance(tree, (list, tuple)):
        return any(_has_var(x) for x in tree)
    return False


def _compile(
    steps: list[tuple[Eqn, list[int]]], slot_of: dict[Var, int], in_slots: list[int], nslots: int,
    out_slots: list, grad_slots: list[tuple[int, int]], commit: Commit,
) -> Callable[[Sequence[torch.Tensor], Undo], list]:
    """Generate the program as one Python function, as torch.fx does: a local per slot, each equation a
    call on locals, ``sN = None`` where a value dies. Against a loop over equations with argument binders,
    this removes most of the interpreter's per-equation cost. Constants and ops are the function's globals;
    each line is commented with the equation's source, which a traceback through the program shows."""
    names: dict[str, Any] = {"_flatten": flatten}
    consts: dict[int, str] = {}

    def const(x: Any) -> str:
        name = consts.get(id(x))
        if name is None:
            name = consts[id(x)] = f"_c{len(consts)}"
            names[name] = x
        return name

    def expr(x: Any) -> str:
        if isinstance(x, Var):
            return f"s{slot_of[x]}"
        if isinstance(x, (list, tuple)) and _has_var(x):
            items = ", ".join(expr(y) for y in x)
            return f"[{items}]" if isinstance(x, list) else f"({items},)"
        return const(x)

    lines = ["def program(inputs, _undo):"]
    for k, slot in enumerate(in_slots):
        lines.append(f"    s{slot} = inputs[{k}]")
    if commit.start is not None:
        names["_carve"], names["_layout"], names["_workspace"] = _carve, commit.layout, commit.workspace
        names["_copy"], names["_copy_list"] = aten.copy_.default._op, aten._foreach_copy_.default._op
        names["_laid_out"] = _laid_out
    for n, (e, free) in enumerate(steps):
        op = f"_p{n}"
        names[op] = getattr(e.prim, "_op", e.prim)  # the overload's C++ entry point
        args = [expr(a) for a in e.args]
        if e.kwargs:
            if all(k.isidentifier() and not keyword.iskeyword(k) for k in e.kwargs):
                args += [f"{k}={expr(v)}" for k, v in e.kwargs.items()]
            else:
                args.append("**{" + ", ".join(f"{k!r}: {expr(v)}" for k, v in e.kwargs.items()) + "}")
        outs = [(j, slot_of[v]) for j, v in enumerate(e.outvars) if v is not None]
        comment = f"  # {op_name(e.prim)} at {e.source}".replace("\n", " ")
        lines.extend(f"    _undo.save({expr(v)})" for v in commit.saves.get(n, ()))
        if n == commit.start:
            like = "".join(f"{expr(v) if isinstance(v, Var) else const(v)}, " for v in commit.fresh.values())
            lines.append(f"    _w = _carve(_layout, _workspace, ({like}))  # the commit's allocations")
        if n in commit.fresh:
            place = f"_w[{len(commit.layout) + list(commit.fresh).index(n)}]"
            lines.append(f"    _copy({place}, {args[0]}){comment}")
            lines.append(f"    s{outs[0][1]} = {place}")
            if free:
                lines.append("    " + " = ".join(f"s{slot}" for slot in free) + " = None")
            continue
        if n in commit.places:
            overload, out_names, ids = commit.places[n]
            names[op] = overload
            if out_names:
                args += [f"{k}=_w[{i}]" for k, i in zip(out_names, ids)]
            else:  # a functional _foreach_ op: its in-place form on a copy of its first list
                places = "[" + ", ".join(f"_w[{i}]" for i in ids) + "]"
                lines.append(f"    _o = _laid_out({places}, {args[0]})")
                lines.append(f"    _copy_list(_o, {args[0]})")
                args[0] = "_o"
                ids = [f"_o[{j}]" for j in range(len(ids))]
            lines.append(f"    {op}({', '.join(args)}){comment}")
            lines.extend(f"    s{slot} = {i if isinstance(i, str) else f'_w[{i}]'}" for (_, slot), i in zip(outs, ids))
            if not out_names:
                lines.append("    _o = None")
            if free:
                lines.append("    " + " = ".join(f"s{slot}" for slot in free) + " = None")
            continue
        names[op] = _entry(e)
        call = f"{op}({', '.join(args)})"
        schema = getattr(e.prim, "_schema", None)
        single = (
            schema is not None and len(schema.returns) == 1 and isinstance(schema.returns[0].type, torch.TensorType)
        )
        if single and len(e.outvars) == 1:
            target = f"s{outs[0][1]}" if outs else "_"
            lines.append(f"    {target} = {call}{comment}")
        elif (
            schema is not None and len(schema.returns) == len(e.outvars) > 1
            and all(isinstance(r.type, torch.TensorType) for r in schema.returns)
        ):  # a tuple of tensors (nll_loss_forward's output and total weight): unpacked as it is
            slots = dict(outs)
            targets = ", ".join(f"s{slots[j]}" if j in slots else "_" for j in range(len(e.outvars)))
            lines.append(f"    {targets} = {call}{comment}")
            if "_" in targets.split(", "):
                lines.append("    _ = None")
        else:
            lines.append(f"    _f = _flatten({call}){comment}")
            lines.extend(f"    s{slot} = _f[{j}]" for j, slot in outs)
            lines.append("    _f = None")
        if free:
            lines.append("    " + " = ".join(f"s{slot}" for slot in free) + " = None")
    kept = sorted({s for s in out_slots if isinstance(s, int)} | {s for _, s in grad_slots})
    lines.append(f"    env = [None] * {nslots}")
    lines.extend(f"    env[{slot}] = s{slot}" for slot in kept)
    lines.append("    return env")
    source = "\n".join(lines) + "\n"
    filename = f"<stagetorch program {next(_PROGRAMS)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), names)  # noqa: S102 - code generated from the staged graph
    return names["program"]

"""The eager interpreter: compiles a Graph into a program that runs it on real tensors.

It only compiles: which equations run, which var is which tensor and where each tensor dies is the schedule
of :func:`stagetorch.transforms.schedule.liveness`, the one the memory interpreter costs. It knows the IR and that
schedule; chunking builds graphs for it to run, and the staged callable gives it the real inputs.

A step that fails must leave the caller's state (parameters, buffers, ``.grad``, optimizer state) as it
was. Which writes of that state save a copy first (into an :class:`~stagetorch.interpreters.undo.Undo`) and
where the program's *commit* begins is :func:`stagetorch.transforms.commit.commit_plan`'s plan; this module
compiles it: the saves, and the commit's one workspace allocated before its first write.
"""

from __future__ import annotations

import itertools
import keyword
import linecache
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._python_dispatch

from ..ir import Aval, Eqn, Graph, Literal, Var, op_name
from ..transforms.commit import Commit, commit_plan
from ..transforms.schedule import liveness, scheduled
from ..utils import collector
from ..utils.tree import flatten
from .undo import Undo

__all__ = ["Program", "is_dense"]

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

_NOTHING = Undo()  # protects nothing: a program run outside a step's guarantee


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
        w if x.is_contiguous() or not is_dense(x) else w.as_strided(x.shape, x.stride()) for w, x in zip(places, like)
    ]


def is_dense(x: torch.Tensor) -> bool:
    """The elements of ``x`` fill ``x.numel()`` places of its storage without a gap or overlap."""
    expected = 1
    for size, stride in sorted(zip(x.shape, x.stride()), key=lambda d: d[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


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

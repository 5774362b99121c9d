"""The eager interpreter: compiles a Graph into a program that runs it on real tensors.

It only compiles: which equations run, which var is which tensor and where each tensor dies is the schedule
of :func:`stagetorch.passes.liveness`, the one the memory interpreter costs. It knows the IR and that
schedule; chunking builds graphs for it to run, and the staged callable gives it the real inputs.
"""

from __future__ import annotations

import itertools
import keyword
import linecache
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import _gc
from ._tree import flatten
from .ir import Eqn, Graph, Literal, Var, op_name
from .passes import liveness, scheduled

__all__ = ["Program", "accumulate_grad"]


class Program:
    """A Graph compiled for repeated execution: straight-line Python, one call per equation that runs, each
    value dropped after its last use. What runs and what is dropped where is :func:`stagetorch.passes.liveness`'s
    schedule, the one the memory interpreter costs; this class only turns it into code."""

    @_gc.paused()  # building a big program allocates many objects that all stay alive, as tracing does
    def __init__(self, graph: Graph, keep: Sequence[Var] = ()):
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
        self._run = _compile(steps, slot_of, in_slots, nslots, self.out_slots, self.grad_slots)

    def run_env(self, inputs: Sequence[torch.Tensor]) -> list:
        """Run on real inputs (parallel to the graph's invars); returns the environment of the slots the
        outputs and gradients live in."""
        # Below autograd, not under no_grad: some kernels (mkldnn RNN) skip saving what their backward
        # needs when grad mode is off, and the staged backward needs it.
        with torch._C._AutoDispatchBelowAutograd():
            return self._run(inputs)

    def outputs(self, env: list) -> list:
        return [x.value if isinstance(x, Literal) else env[x] for x in self.out_slots]

    def run(self, inputs: Sequence[torch.Tensor]) -> tuple[list, list[tuple[int, torch.Tensor]]]:
        """Run; return the flat outputs and the (input position, gradient) pairs to accumulate."""
        with torch._C._AutoDispatchBelowAutograd():  # as run_env (a step's hot path: one call less)
            env = self._run(inputs)
        return self.outputs(env), [(i, env[s]) for i, s in self.grad_slots]


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor, fresh: bool = False) -> None:
    """What autograd's AccumulateGrad does for a dense leaf: set ``.grad`` or add into it in place.
    ``fresh``: ``grad`` is known to live in storage of its own (not a view of an input)."""
    if param.grad is None:
        if grad.stride() != param.stride() or (
            not fresh and grad.untyped_storage().data_ptr() == param.untyped_storage().data_ptr()
        ):
            grad = torch.empty_strided(param.shape, param.stride(), dtype=param.dtype, device=param.device).copy_(grad)
        param.grad = grad
    else:
        with torch.no_grad():
            param.grad.add_(grad)


_PROGRAMS = itertools.count()


def _has_var(tree: Any) -> bool:
    if isinstance(tree, Var):
        return True
    if isinstance(tree, (list, tuple)):
        return any(_has_var(x) for x in tree)
    return False


def _compile(
    steps: list[tuple[Eqn, list[int]]], slot_of: dict[Var, int], in_slots: list[int], nslots: int,
    out_slots: list, grad_slots: list[tuple[int, int]],
) -> Callable[[Sequence[torch.Tensor]], list]:
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

    lines = ["def program(inputs):"]
    for k, slot in enumerate(in_slots):
        lines.append(f"    s{slot} = inputs[{k}]")
    for n, (e, free) in enumerate(steps):
        op = f"_p{n}"
        names[op] = getattr(e.prim, "_op", e.prim)  # the overload's C++ entry point
        args = [expr(a) for a in e.args]
        if e.kwargs:
            if all(k.isidentifier() and not keyword.iskeyword(k) for k in e.kwargs):
                args += [f"{k}={expr(v)}" for k, v in e.kwargs.items()]
            else:
                args.append("**{" + ", ".join(f"{k!r}: {expr(v)}" for k, v in e.kwargs.items()) + "}")
        call = f"{op}({', '.join(args)})"
        outs = [(j, slot_of[v]) for j, v in enumerate(e.outvars) if v is not None]
        schema = getattr(e.prim, "_schema", None)
        single = (
            schema is not None and len(schema.returns) == 1 and isinstance(schema.returns[0].type, torch.TensorType)
        )
        comment = f"  # {op_name(e.prim)} at {e.source}".replace("\n", " ")
        if single and len(e.outvars) == 1:
            target = f"s{outs[0][1]}" if outs else "_"
            lines.append(f"    {target} = {call}{comment}")
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

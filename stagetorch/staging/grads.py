"""Grad settling: what a staged step does to each ``.grad``, read from the equations after the trace.

Every ``.grad`` is an input of the trace, and the fake ``.grad`` each parameter ended with says what the
step did: added into it, replaced it, set it to None. :func:`settle_grads` turns that into the gradients to
accumulate, the ``.grad`` to replace or clear, and the inputs no equation reads;
:func:`steal_accumulated_grads` drops the copy AccumulateGrad makes under tracing where eager would take the
buffer; :func:`lay_out_as_parameters` and :func:`one_grad_each` add the copies eager makes (into the
parameter's layout; one for a gradient two parameters share) as the program's last equations.

What it must not know: how the equations were recorded (the recorder, the fake mode), or how the caller
installs the gradients.
"""

from __future__ import annotations

import torch
from torch._prims_common import suggest_memory_format

from ..ir import Eqn, Var

__all__ = ["settle_grads", "steal_accumulated_grads", "lay_out_as_parameters", "one_grad_each"]


def settle_grads(
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


def steal_accumulated_grads(
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


def lay_out_as_parameters(
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


def one_grad_each(eqns: list[Eqn], grads: list[tuple[int, Var]]) -> tuple[list[Eqn], list[tuple[int, Var]]]:
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

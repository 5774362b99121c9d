"""The FLOP interpreter: how many floating-point operations each equation of a Graph does, and how many
kernels it runs.

An op's ``flops`` rule in the registry answers for it (matrix products, convolutions and attention have
rules in their family files, counted as ``torch.utils.flop_counter`` counts: a multiply-add is 2). Any
other op costs one operation per element it writes; ops that only make a view or a new var on an input's
storage cost nothing. An op runs one kernel unless its ``calls`` rule says more (a recurrent layer: one
per time step). It knows the IR and the registry; it runs nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from ..ir import Eqn, Graph, Var
from ..registry import slot

__all__ = ["eqn_flops", "graph_flops", "eqn_calls", "graph_calls", "conv_flops", "attention_flops"]


def eqn_flops(e: Eqn) -> int:
    """The floating-point operations of one equation."""
    rule = slot(e.prim, "flops")
    if rule is not None:
        return int(rule(e))
    # Pointwise by size: a view (or an in-place result) writes no new storage of its own.
    return sum(v.aval.numel for v in e.outvars if v is not None and v.base is None)


def graph_flops(graph: Graph | Iterable[Eqn]) -> int:
    """The floating-point operations of a graph (or of some of its equations)."""
    eqns = graph.eqns if isinstance(graph, Graph) else graph
    return sum(eqn_flops(e) for e in eqns)


def eqn_calls(e: Eqn) -> int:
    """The kernels one equation runs."""
    rule = slot(e.prim, "calls")
    return 1 if rule is None else int(rule(e))


def graph_calls(graph: Graph | Iterable[Eqn]) -> int:
    """The kernels a graph (or some of its equations) runs."""
    eqns = graph.eqns if isinstance(graph, Graph) else graph
    return sum(eqn_calls(e) for e in eqns)


def _shape(x: object) -> tuple[int, ...]:
    assert isinstance(x, Var), x
    return x.aval.shape


def conv_flops(x: tuple[int, ...], w: tuple[int, ...], out: tuple[int, ...], transposed: bool) -> int:
    """A convolution: each output point (each input point, when transposed) is a dot product over the
    filter and its input channels."""
    points = (x if transposed else out)[2:]
    return 2 * x[0] * math.prod(w) * math.prod(points)


def attention_flops(q: tuple[int, ...], k: tuple[int, ...], v: tuple[int, ...]) -> int:
    """Scaled dot-product attention: scores ``q @ k^T`` then ``scores @ v`` (key/value heads broadcast)."""
    b, h, sq, d = q
    sk, dv = k[-2], v[-1]
    return 2 * b * h * sq * sk * d + 2 * b * h * sq * sk * dv


def matmul_rule(e: Eqn) -> int:
    """``mm``/``bmm`` and the ``add*`` forms: the product's multiply-adds (the added term is not counted)."""
    a, b = (e.args[0], e.args[1]) if len(e.args) == 2 or not isinstance(e.args[2], Var) else (e.args[1], e.args[2])
    sa, sb = _shape(a), _shape(b)
    return 2 * math.prod(sa) * sb[-1]


def conv_rule(e: Eqn) -> int:
    x, w = _shape(e.args[0]), _shape(e.args[1])
    out = next(v for v in e.outvars if v is not None).aval.shape
    return conv_flops(x, w, out, bool(e.args[6]))


def conv_backward_rule(e: Eqn) -> int:
    """The input gradient and the weight gradient each cost one forward convolution (the bias gradient, a
    sum, is not counted)."""
    grad_out, x, w = (_shape(a) for a in e.args[:3])
    transposed, mask = bool(e.args[7]), e.args[10]
    one = conv_flops(x, w, grad_out, transposed)
    return one * (int(bool(mask[0])) + int(bool(mask[1])))


def attention_rule(e: Eqn) -> int:
    return attention_flops(*(_shape(a) for a in e.args[:3]))


def attention_backward_rule(e: Eqn) -> int:
    """The backward recomputes the scores and does four more products: 2.5 forwards' worth."""
    _, q, k, v = (_shape(a) for a in e.args[:4])
    b, h, sq, d = q
    sk, dv = k[-2], v[-1]
    return 2 * b * h * (sq * d * sk + sq * dv * sk + sk * sq * dv + sq * sk * d + d * sq * sk)

"""The IR as data: avals, vars, equations, and how a graph prints."""

from __future__ import annotations

import torch

import stagetorch
from stagetorch.ir import Aval, op_name


def test_aval():
    a = Aval([2, 3], torch.float16)
    assert a.shape == (2, 3) and a.nbytes == 12 and a.ndim == 2 and str(a) == "f16[2,3]"
    assert Aval.of(torch.zeros(2, 3, dtype=torch.float16)) == a


def test_graph_prints_one_typed_equation_a_line_with_source():
    w = torch.randn(3, 2, requires_grad=True)

    def f(x):
        y = torch.relu(x @ w)  # the relu line
        loss = y.sum()
        loss.backward()
        return loss

    g = stagetorch.make_ir(f)(torch.randn(4, 3))
    text = str(g)
    first, *body, last = text.splitlines()
    assert first.startswith("{ lambda x:f32[4,3] ; w:f32[3,2] . let")
    assert any("= aten.mm(x, w)" in line and "test_ir.py:" in line for line in body)
    assert any("aten.relu" in line for line in body)
    assert text.rstrip().endswith(f"w.grad += {text.rstrip().split('w.grad += ')[1]}")
    assert len(g.eqns) == sum(" = " in line for line in body) and g.roles == ["arg", "param"]
    assert op_name(torch.ops.aten.sum.dim_IntList) == "aten.sum.dim_IntList" and op_name(torch.ops.aten.mm.default) == "aten.mm"
    assert all(isinstance(v, stagetorch.Var) for e in g.eqns for v in e.invars)
    mm = next(e for e in g.eqns if e.prim is torch.ops.aten.mm.default)
    assert mm.params == {} and mm.source.function == "f"

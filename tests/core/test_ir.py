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


# -- the checker ------------------------------------------------------------------------------------------

import models  # noqa: E402
import pytest  # noqa: E402

from stagetorch.interpreters.batching import Batched, analyze  # noqa: E402
from stagetorch.interpreters.chunked import Split  # noqa: E402
from stagetorch.interpreters.shapes import check as check_with_rules  # noqa: E402
from stagetorch.ir import Eqn, Graph, GraphError, Var, check  # noqa: E402

ZOO = {
    "seed_mlp": (models.seed_mlp, models.train_step, 8),
    "cnn": (models.cnn, models.train_step, 8),
    "transformer": (models.transformer, models.train_step, 4),
    "mha": (models.mha, models.train_step, 4),
    "lstm": (models.lstm, models.train_step, 4),
    "gpt2": (models.gpt2, models.gpt2_step, 4),
}


@pytest.mark.parametrize("name", sorted(ZOO))
def test_every_staged_graph_of_the_test_models_checks(name):
    """The traced step and every graph the chunked executor builds from it (shared, body, post, pre-passes)."""
    factory, step, b = ZOO[name]
    model, make = factory()
    x, y = make(b)
    graph = stagetorch.make_ir(step(model))(x, y)
    check_with_rules(graph)
    args = [v for v, r in zip(graph.invars, graph.roles) if r == "arg"]
    split = Split(analyze(graph, {v: Batched(0) for v in args}, b))
    bodies = [g for n in (1, 2) for g in (split.body(n).first, split.body(n).rest)]
    for g in (split.shared, split.post, split.global_post, *bodies):
        check_with_rules(g)


def _tiny() -> Graph:
    x = Var(stagetorch.Aval((2, 3), torch.float32))
    y = Var(stagetorch.Aval((2, 3), torch.float32))
    return Graph([x], [Eqn(torch.ops.aten.relu.default, (x,), {}, (y,))], [y], roles=["arg"], names=["x"])


def test_check_accepts_a_well_formed_graph_and_names_each_fault():
    assert check_with_rules(_tiny()) is not None
    g = _tiny()
    g.eqns[0].outvars = (g.invars[0],)  # x defined twice
    with pytest.raises(GraphError, match="defined twice"):
        check(g)
    g = _tiny()
    g.eqns[0].args = (Var(stagetorch.Aval((2, 3), torch.float32)),)  # read before defined
    with pytest.raises(GraphError, match="before it is defined"):
        check(g)
    g = _tiny()
    g.outvars = [Var(stagetorch.Aval((1,), torch.float32))]
    with pytest.raises(GraphError, match="not defined"):
        check(g)
    g = _tiny()
    g.eqns[0].outvars = (Var(stagetorch.Aval((3, 2), torch.float32)),)
    g.outvars = list(g.eqns[0].outvars)
    check(g)  # structurally fine...
    with pytest.raises(GraphError, match="shape rule says f32\\[2,3\\]"):
        check_with_rules(g)  # ...but relu of f32[2,3] is not f32[3,2]
    g = _tiny()
    g.grads = [(0, Var(stagetorch.Aval((2,), torch.float32)))]
    with pytest.raises(GraphError):
        check(g)
    g = _tiny()
    g.roles = ["arg", "param"]
    with pytest.raises(GraphError, match="roles"):
        check(g)

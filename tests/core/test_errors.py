"""The named errors: what happened, the user's file:line, what to do; and the model untouched after."""

from __future__ import annotations

import copy

import models
import pytest
import torch
import torch.nn.functional as F

import stagetorch


def _snapshot(model):
    return copy.deepcopy(model.state_dict()), [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _unchanged(model, snap):
    state, grads = snap
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    for p, g in zip(model.parameters(), grads):
        assert (p.grad is None and g is None) or torch.equal(p.grad, g)


@pytest.fixture
def bn_model():
    model, make = models.cnn(norm="batch")
    models.train_step(model)(*make(4))  # existing .grad and statistics that must survive a failed trace
    return model, make


def test_shape_error_names_op_shapes_and_line(bn_model):
    model, make = bn_model
    snap = _snapshot(model)

    def step(x, y):
        h = model(x)
        loss = F.cross_entropy(h @ torch.ones(3, 3), y)  # the bad line
        loss.backward()
        return loss

    with pytest.raises(stagetorch.ShapeError) as err:
        stagetorch.jit(step)(*make(4))
    msg = str(err.value)
    assert "aten.mm" in msg and "f32[4,10]" in msg and "f32[3,3]" in msg
    assert "test_errors.py:" in msg and "the bad line" in msg
    _unchanged(model, snap)


@pytest.mark.parametrize(
    "body",
    [
        lambda x: x * 2 if x.sum().item() > 0 else x,
        lambda x: x * 2 if x.sum() > 0 else x,
        lambda x: x[x > 0],
    ],
    ids=["item", "bool", "mask"],
)
def test_data_dependent_control_flow_raises_concretization_error(body, bn_model):
    model, make = bn_model
    snap = _snapshot(model)

    def step(x, y):
        out = body(model(x))
        loss = out.sum()
        loss.backward()
        return loss

    with pytest.raises(stagetorch.ConcretizationError) as err:
        stagetorch.jit(step)(*make(4))
    msg = str(err.value)
    assert "test_errors.py:" in msg
    assert "static_argnums" in msg and "torch.where" in msg and "stagetorch.lazy" in msg
    _unchanged(model, snap)


def test_op_without_fake_kernel_raises_unsupported_with_register_hint():
    torch.library.define("stagetorch_test::opaque", "(Tensor x) -> Tensor")
    torch.library.impl("stagetorch_test::opaque", "cpu", lambda x: x.clone())
    with pytest.raises(stagetorch.UnsupportedOpError) as err:
        stagetorch.make_ir(lambda x: torch.ops.stagetorch_test.opaque(x))(torch.randn(3))
    assert "stagetorch.ops.register(torch.ops.stagetorch_test.opaque" in str(err.value)
    assert "register_fake" in str(err.value)


def test_non_tensor_arguments_are_static_and_wrong_types_fail_clearly():
    staged = stagetorch.jit(lambda x, n: x * n)
    assert torch.equal(staged(torch.ones(2), 3), torch.full((2,), 3.0))
    with pytest.raises(TypeError, match="batch_argnums names argument 1"):
        stagetorch.jit(lambda x, n: x * n, batch_argnums=(1,))(torch.ones(2), 3)


def test_sparse_input_is_refused_by_name():
    with pytest.raises(stagetorch.UnsupportedOpError, match="dense"):
        stagetorch.make_ir(lambda x: x * 2)(torch.eye(3).to_sparse())


def test_register_rejects_what_is_not_an_op():
    with pytest.raises(TypeError, match="expects an ATen op"):
        stagetorch.ops.register(torch.mm, shape=lambda *a: None)


@pytest.mark.parametrize("fn", [torch.relu, torch.neg, torch.abs, torch.nn.functional.gelu, torch.nn.functional.silu])
def test_ops_whose_meta_kernel_accepts_bool_but_whose_kernel_does_not(fn):
    x = torch.tensor([True, False])
    with pytest.raises(RuntimeError):
        fn(x)  # the real kernel refuses bool; the meta kernel does not, the explicit rule does
    with pytest.raises(stagetorch.ShapeError, match=r"test_errors.py:\d+[\s\S]*bool tensors are not supported"):
        stagetorch.eval_shape(lambda t: fn(t))(x)
    assert stagetorch.eval_shape(lambda t: fn(t))(torch.tensor([1.0, -1.0])).dtype == torch.float32


def test_op_without_meta_kernel_names_the_op_the_line_and_the_register_call():
    def qr_parts(x):
        return torch.geqrf(x)

    with pytest.raises(stagetorch.UnsupportedOpError) as info:
        stagetorch.eval_shape(qr_parts)(torch.randn(5, 3))
    msg = str(info.value)
    assert "aten.geqrf" in msg and "test_errors.py:" in msg
    assert "stagetorch.ops.register(torch.ops.aten.geqrf, shape=" in msg
    # ...and the call it shows is the fix.
    geqrf = torch.ops.aten.geqrf
    before = stagetorch.ops.lookup(geqrf)
    stagetorch.ops.register(geqrf, shape=lambda x: (x, stagetorch.Aval(x.shape[:-2] + (min(x.shape[-2:]),), x.dtype, x.device)))
    try:
        a, tau = stagetorch.eval_shape(qr_parts)(torch.randn(5, 3))
        real = torch.geqrf(torch.randn(5, 3))
        assert (a.shape, tau.shape) == (tuple(real[0].shape), tuple(real[1].shape))
    finally:
        if before is None:
            stagetorch.registry._RULES.pop(geqrf)
        else:
            stagetorch.registry._RULES[geqrf] = before
        stagetorch.clear_caches()  # the registry's slot answers, too


def test_an_error_rebuilt_with_a_longer_message_says_what_the_first_said():
    """``StagingError.copy_from``: the planner's errors rebuilt from another keep its attributes (the smallest
    budget, BatchNorm's source, a chunk-local result), then the changes given."""
    first = stagetorch.BatchStatisticsError("coupled")
    first.smallest_budget, first.source, first.chunk_local_result = 100, "model.py:3", "kept"
    again = stagetorch.BatchStatisticsError("coupled, and more").copy_from(first, smallest_budget=150)
    assert (str(again), again.source, again.chunk_local_result, again.smallest_budget) == (
        "coupled, and more", "model.py:3", "kept", 150)
    assert first.smallest_budget == 100

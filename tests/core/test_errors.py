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


# Errors that agree (issue 46 item 4): jit and lazy raise one class for each mistake with the arguments' batch,
# each message naming its own front end's keyword (jit's batch_dim=, lazy's batch=).


def _jit(x, y, **options):
    return stagetorch.jit(lambda a, b: (a * b).sum(), **options)(x, y)


def _lazy(x, y, batch=0, **options):
    a, b = stagetorch.lazy(x, y, batch=batch, **options)
    return float((a * b).sum())


_MISTAKES = {
    # mistake: (x, y, jit's options, lazy's options, error class, what jit's message says, what lazy's says)
    "batch dim out of range": (torch.ones(4, 3), torch.ones(4, 3), dict(batch_dim=2), dict(batch=2),
                               stagetorch.BatchShapeError, "batch_dim=2 is out of range", "batch=2 is out of range"),
    "batch sizes disagree": (torch.ones(4, 3), torch.ones(5, 3), {}, {}, stagetorch.BatchShapeError,
                             r"disagree on the batch size \(a: 4, b: 5\)", r"disagree on the batch size \(argument 0: 4, "
                             r"argument 1: 5\)"),
    "empty batch": (torch.ones(0, 3), torch.ones(0, 3), {}, {}, stagetorch.BatchShapeError, "the batch is empty",
                    "the batch is empty"),
    "not a tensor": (torch.ones(4, 3), 3, dict(batch_argnums=(0, 1)), {}, stagetorch.NotATensorError,
                     "batch_argnums names argument 1, which is not a tensor", "argument 1 is a int, not a tensor"),
}


@pytest.mark.parametrize("front", ["jit", "lazy"])
@pytest.mark.parametrize("mistake", list(_MISTAKES))
def test_the_same_mistake_raises_the_same_class_under_jit_and_lazy(mistake, front):
    x, y, jit_options, lazy_options, error, jit_says, lazy_says = _MISTAKES[mistake]
    builtin = ValueError if issubclass(error, ValueError) else TypeError
    with pytest.raises(error, match=jit_says if front == "jit" else lazy_says) as info:
        _jit(x, y, **jit_options) if front == "jit" else _lazy(x, y, **lazy_options)
    assert isinstance(info.value, builtin) and isinstance(info.value, stagetorch.StagingError)
    if front == "lazy":
        assert "batch_dim" not in str(info.value) and "batch_argnums" not in str(info.value)


def test_lazy_without_tensors_raises_batch_shape_error():
    with pytest.raises(stagetorch.BatchShapeError, match="needs at least one tensor"):
        stagetorch.lazy()


@pytest.mark.parametrize("front", ["jit", "lazy"])
def test_a_batch_on_the_wrong_dim_names_the_front_ends_own_keyword(front):
    """A padded BERT batch given with its examples along dim 1 (issue 46's first script): under a budget that
    needs chunks, jit and lazy name modeling_bert.py's layer norm, each telling to move the batch with its own
    keyword. jit raises the BatchCouplingError; lazy's flush (the step up to the attention mask's check) can be
    cut where the examples meet, and its OutOfMemoryError names the smallest budget of that cut, why the
    examples meet there and the same advice."""
    pytest.importorskip("transformers")
    from trainer_models import VOCAB, bert_classifier

    model = bert_classifier()
    ids = torch.randint(0, VOCAB, (8, 12))
    mask = torch.ones(8, 12, dtype=torch.long)
    mask[:, 9:] = 0
    labels = torch.randint(0, 3, (8,))

    def step(i, m):
        loss = model(input_ids=i, attention_mask=m, labels=labels).loss
        loss.backward()
        return loss

    expected = stagetorch.BatchCouplingError if front == "jit" else stagetorch.OutOfMemoryError
    with pytest.raises(expected, match=r"modeling_bert\.py") as info:
        if front == "jit":
            stagetorch.jit(step, batch_dim=1, memory_budget="300KiB")(ids, mask)
        else:
            step(*stagetorch.lazy(ids, mask, batch=1, memory_budget="300KiB"))
    message = str(info.value)
    if front == "jit":
        assert "(batch_dim=...)" in message, message
    else:
        assert "(stagetorch.lazy(..., batch=...))" in message and "batch_dim" not in message, message
        assert "Why they meet there: aten.native_layer_norm" in message and info.value.smallest_budget, message
    assert all(p.grad is None for p in model.parameters())


def test_lazy_says_its_smallest_budget_at_a_mid_step_read_covers_only_the_part_up_to_the_read():
    """A value read mid-forward (transformers' attention-mask check, here a Python if): the error of a budget too
    small for it names the smallest budget of the part up to the read, and says so; at that budget the read
    runs and backward() needs more, which its own error names; at that one the step runs, as eager's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))
    reference = copy.deepcopy(model)
    x, y = torch.randn(32, 16), torch.randint(0, 3, (32,))

    def step(x, y, net):
        h = net[0](x)
        if h.abs().sum() > 0:  # a value read while the step runs
            h = h * 2
        loss = F.cross_entropy(net[2](net[1](h)), y)
        loss.backward()
        return loss

    def lazy_step(budget):
        return step(*stagetorch.lazy(x, y, batch=0, memory_budget=budget), model)

    with pytest.raises(stagetorch.OutOfMemoryError, match="runs only the part of the step up to a value it reads "
                       r"while it runs at \S*test_errors.py:\d+") as at_read:
        lazy_step(64)
    read_budget = at_read.value.smallest_budget
    assert read_budget is not None
    with pytest.raises(stagetorch.OutOfMemoryError) as at_backward:
        lazy_step(read_budget)  # the read runs now; the backward does not fit
    assert "up to a value it reads" not in str(at_backward.value)
    assert at_backward.value.smallest_budget > read_budget
    model.zero_grad()
    loss = lazy_step(at_backward.value.smallest_budget)
    torch.testing.assert_close(loss.detach(), step(x, y, reference).detach(), rtol=1e-6, atol=0)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)

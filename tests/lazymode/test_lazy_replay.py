"""Replay in one-line mode: a step that repeats the previous one reuses its recording, and every way a step
can differ from it (an op, a constant, a model, a hook, a value read, a data-dependent shape) is caught and
re-recorded. Each case runs several steps against the same loop in plain PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from budgets import budget_for
from lazy_loops import assert_same_grads, assert_same_loop, batches, mlp, run_loop

import stagetorch
from stagetorch.lazymode import recording
from stagetorch.lazymode.mode import Mode
from stagetorch.runtime.executable import Executable

pytestmark = pytest.mark.usefixtures("lazy_mode")


def plain_step(i, model, x, y):
    return F.cross_entropy(model(x), y)


def test_repeated_steps_replay_without_recording_and_equal_eager(recorded, dispatched, lazy_mode):
    assert_same_loop(plain_step, n=5)
    recording.RECORDINGS.clear()
    recorded.clear()
    dispatched.clear()
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    counts = []
    for x, y in batches(3):
        x, y = stagetorch.lazy(x, y, batch=0)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        counts.append((len(recorded), len(dispatched)))
        recorded.clear()
        dispatched.clear()
    # The first step records every op that reached a lazy tensor (reading what autograd saved adds two
    # detaches that are not steps).
    assert counts[0][0] > 20 and counts[0][0] <= counts[0][1] <= counts[0][0] + 4, counts
    if lazy_mode >= Mode.REPLAY:
        assert [c[0] for c in counts[1:]] == [0, 0] and all(c[1] < counts[0][1] / 2 for c in counts[1:]), counts


def test_replay_of_a_chunked_step_equals_eager():
    assert_same_loop(plain_step, memory_budget=20_000)


def test_a_step_that_differs_in_an_op_is_recorded_again():
    def step(i, model, x, y):
        h = model[0](x)
        if i % 2:  # Python control flow outside the tensors: an extra op on odd steps
            h = h * 0.5
        return F.cross_entropy(model[2](model[1](h)), y)

    assert_same_loop(step, n=5)


def test_a_step_that_differs_after_a_read_is_recorded_again():
    def step(i, model, x, y):
        out = model(x)
        scale = 2.0 if out.mean().item() > 0 else 3.0  # a value read mid-step steers the rest
        return F.cross_entropy(out * scale + i, y)

    assert_same_loop(step, n=4)


def test_new_constant_values_with_the_same_shape_are_used():
    offsets = [torch.randn(3) for _ in range(4)]

    def step(i, model, x, y):
        return F.cross_entropy(model(x) + offsets[i], y)

    assert_same_loop(step)


def test_data_dependent_shapes_that_change_between_steps():
    def step(i, model, x, y):
        out = model(x)
        picked = out[out[:, 0] > 0]  # a different number of rows each step
        return F.cross_entropy(out, y) + picked.square().sum() * 0.01

    assert_same_loop(step, n=5)


def test_two_models_with_the_same_shapes_get_their_own_gradients():
    other = mlp(seed=5)
    other_reference = copy.deepcopy(other)

    def step(i, model, x, y):
        m = model if i % 2 == 0 else (other if isinstance(x, stagetorch.LazyTensor) else other_reference)
        return F.cross_entropy(m(x), y)

    assert_same_loop(step, n=4)
    for p, q in zip(other.parameters(), other_reference.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_a_hook_added_later_runs_and_changes_the_gradient():
    def step(i, model, x, y):
        if i == 2:
            hook = model[0].weight.register_hook(lambda g: g * 3)
            step.hooks.append(hook)
        return F.cross_entropy(model(x), y)

    step.hooks = []
    assert_same_loop(step, n=4)
    for h in step.hooks:
        h.remove()


def test_hooks_on_lazy_values_run_every_step():
    seen = []

    def step(i, model, x, y):
        h = model[0](x)
        if isinstance(x, stagetorch.LazyTensor):
            h.register_hook(lambda g: seen.append(g.shape) or g * 2)
        else:
            h.register_hook(lambda g: g * 2)
        return F.cross_entropy(model[2](model[1](h)), y)

    assert_same_loop(step, n=3)
    assert len(seen) == 3


def test_freezing_a_layer_between_steps():
    def step(i, model, x, y):
        model[0].weight.requires_grad_(i < 2)
        return F.cross_entropy(model(x), y)

    assert_same_loop(step, n=4)


def test_gradients_accumulated_across_steps_without_zero_grad():
    recording.RECORDINGS.clear()
    model = mlp()
    reference = copy.deepcopy(model)
    for x, y in batches(3):
        F.cross_entropy(model(stagetorch.lazy(x, batch=0)), y).backward()
        F.cross_entropy(reference(x), y).backward()
    assert_same_grads(model, reference)


@pytest.mark.parametrize("how", ["method", "function"])
def test_autograd_backward_function_is_intercepted(how):
    recording.RECORDINGS.clear()
    model = mlp()
    reference = copy.deepcopy(model)
    for x, y in batches(3):
        loss = F.cross_entropy(model(stagetorch.lazy(x, batch=0)), y)
        if how == "method":
            loss.backward()
        else:
            torch.autograd.backward(loss)
        assert all(type(p.grad) is torch.Tensor for p in model.parameters())
        F.cross_entropy(reference(x), y).backward()
        assert_same_grads(model, reference, clear=True)


def test_batchnorm_statistics_update_once_per_replayed_step():
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))

    def step(i, model, x, y):
        return F.cross_entropy(model(x), y)

    recording.RECORDINGS.clear()
    model = make()
    reference = copy.deepcopy(model)
    data = batches(4)
    run_loop(model, data, step, True)
    run_loop(reference, data, step, False)
    assert torch.allclose(model[1].running_mean, reference[1].running_mean, atol=1e-6)
    assert torch.allclose(model[1].running_var, reference[1].running_var, atol=1e-6)
    assert model[1].num_batches_tracked.item() == 4


def test_tensors_of_two_sessions_never_mix_even_when_both_replay():
    """A call on lazy tensors of two sessions records in the newer one; the older one's tensors are read as
    the real values they are in eager."""
    recording.RECORDINGS.clear()
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    x = stagetorch.lazy(a)
    assert torch.equal((x + x).value(), a + a)
    x1, x2 = stagetorch.lazy(a), stagetorch.lazy(b)  # both replay the recording of `x + x`
    for _ in range(3):
        out = x1 * 2 + x2
        assert out._session is x2._session and torch.equal(out.value(), a * 2 + b)


def test_recordings_are_bounded():
    recording.RECORDINGS.clear()
    for n in range(1, recording._MAX_RECORDINGS + 10):
        (stagetorch.lazy(torch.randn(n, 2)) * 2).value()
    assert len(recording.RECORDINGS) == recording._MAX_RECORDINGS


def test_a_second_backward_through_a_replayed_graph_raises_as_in_eager():
    recording.RECORDINGS.clear()
    model = mlp()
    for x, y in batches(2):
        loss = F.cross_entropy(model(stagetorch.lazy(x, batch=0)), y)
        loss.backward()
        model.zero_grad()
        with pytest.raises(RuntimeError, match="a second time"):
            loss.backward()


def test_a_new_model_of_the_same_shapes_replays_from_its_first_step(dispatched, lazy_mode):
    """The express replay binds real tensors (parameters) by position, as the slow replay does, and takes
    the backward's leaves from them: another model's first step replays without reaching any op."""
    recording.RECORDINGS.clear()
    counts = []
    for model in (mlp(), mlp(seed=3)):
        reference = copy.deepcopy(model)
        for x, y in batches(3):
            F.cross_entropy(model(stagetorch.lazy(x, batch=0)), y).backward()
            F.cross_entropy(reference(x), y).backward()
            assert_same_grads(model, reference, clear=True)
            counts.append(len(dispatched))
            dispatched.clear()
    if lazy_mode is Mode.EXPRESS:
        assert counts[0] > 0 and counts[1:] == [0] * 5, counts


class ReadThenAct(nn.Module):
    """A value read after the first layer (it runs the steps that made the hidden states), then ``act``: two
    of these with other activations have the same shapes and differ after the read."""

    def __init__(self, act, read=True):
        super().__init__()
        self.l1, self.l2, self.act, self.read = nn.Linear(64, 256), nn.Linear(256, 10), act, read

    def forward(self, x):
        h = self.l1(x)
        if self.read and bool(h.isnan().any()):
            raise ValueError("nan in the hidden states")
        return self.l2(self.act(h))


def test_a_model_that_diverges_after_a_flush_still_chunks(monkeypatch, lazy_mode):
    """Two models of the same shapes, chunked, one after the other: the second replays the first's recording
    through the value read, whose flush makes the hidden states (per example), and diverges after it. The
    flush after the divergence still reads the hidden states per example, cut to each chunk: it chunks and
    equals eager. (It used to take them as one shared value, whole, and raise OutOfMemoryError.)"""
    recording.RECORDINGS.clear()
    chunks = []
    run = Executable.run

    def counted(self, inputs, plan, **kwargs):
        chunks.append(len(plan.chunk_sizes))
        return run(self, inputs, plan, **kwargs)

    def step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    monkeypatch.setattr(Executable, "run", counted)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(512, 64, generator=g), torch.randint(0, 10, (512,), generator=g)
    budget = budget_for(stagetorch.jit(lambda x, y: step(ReadThenAct(F.relu, read=False), x, y)), x, y)
    for act in (F.relu, F.gelu):
        model = ReadThenAct(act)
        reference = copy.deepcopy(model)
        expected = step(reference, x, y)
        chunks.clear()
        loss = step(model, *stagetorch.lazy(x, y, batch=0, memory_budget=budget))
        assert len(chunks) == 2 and chunks[1] >= 2, (act.__name__, chunks)  # the read, then the backward
        assert abs(loss.item() - expected.item()) <= 1e-5 * abs(expected.item())
        assert_same_grads(model, reference)


def test_a_tensor_changed_in_place_before_a_divergence_still_raises(lazy_mode):
    """A step that replays a recording and then differs from it records the replayed calls again (leaving
    the express replay first, in that mode): a real tensor a pending call read, changed in place since, still
    raises ModifiedInputError rather than be read with its new value."""
    recording.RECORDINGS.clear()
    w = torch.randn(4, 3)
    for act, write in ((torch.relu, False), (torch.sigmoid, True)):
        h = stagetorch.lazy(torch.randn(4, 3)) * w
        if write:
            with torch.no_grad():
                w.add_(1.0)  # before the multiplication ran; the sigmoid then differs from the recording
            with pytest.raises(stagetorch.ModifiedInputError, match="changed in place"):
                act(h).sum().item()
        else:
            act(h).sum().item()


def test_a_loss_whose_backward_ran_refuses_a_second_one_after_a_divergence(lazy_mode):
    """A replayed backward that skipped the engine left the graph in place; after the step differs from its
    recording, a second backward of the same loss still raises as eager's does (it ran the engine again,
    adding the gradients twice)."""
    recording.RECORDINGS.clear()
    model = nn.Linear(3, 2)
    for diverge in (False, True):
        x = stagetorch.lazy(torch.randn(4, 3))
        loss = model(x).sum()
        loss.backward()
        if diverge:
            (x * 2).sum().item()  # a call the recording does not have, after the backward
        with pytest.raises(RuntimeError, match="a second time"):
            loss.backward()
        model.zero_grad()


def test_retain_graph_and_autograd_grad_run_through_the_engine():
    recording.RECORDINGS.clear()
    model = mlp()
    reference = copy.deepcopy(model)
    for x, y in batches(3):
        loss = F.cross_entropy(model(stagetorch.lazy(x, batch=0)), y)
        loss.backward(retain_graph=True)
        loss.backward()
        grads = torch.autograd.grad(F.cross_entropy(model(stagetorch.lazy(x, batch=0)), y), list(model.parameters()))
        expected_loss = F.cross_entropy(reference(x), y)
        expected_loss.backward(retain_graph=True)
        expected_loss.backward()
        expected = torch.autograd.grad(F.cross_entropy(reference(x), y), list(reference.parameters()))
        for p, q, g, e in zip(model.parameters(), reference.parameters(), grads, expected):
            assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6)
            assert torch.allclose(g.value(), e, rtol=1e-5, atol=1e-6)
            p.grad = q.grad = None


def test_backward_twice_into_real_grads_that_already_hold_values():
    recording.RECORDINGS.clear()
    model = nn.Linear(5, 3)
    reference = copy.deepcopy(model)
    x = torch.randn(4, 5)
    for m in (model, reference):  # .grad already holds a real gradient before the first lazy step
        F.mse_loss(m(x), torch.zeros(4, 3)).backward()
    for _ in range(3):
        xs = torch.randn(9, 5)
        loss = F.mse_loss(model(stagetorch.lazy(xs)), torch.zeros(9, 3))
        loss.backward(retain_graph=True)
        loss.backward()
        expected = F.mse_loss(reference(xs), torch.zeros(9, 3))
        expected.backward(retain_graph=True)
        expected.backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            assert type(p.grad) is torch.Tensor and torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_training_and_evaluation_steps_on_the_same_shapes_each_replay(recorded, lazy_mode):
    recording.RECORDINGS.clear()
    model = mlp()
    reference = copy.deepcopy(model)
    counts = []
    for x, y in batches(4):
        F.cross_entropy(model(stagetorch.lazy(x, batch=0)), y).backward()
        F.cross_entropy(reference(x), y).backward()
        with torch.no_grad():
            got = model(stagetorch.lazy(x, batch=0)).value()
            assert torch.allclose(got, reference(x), atol=1e-6)
        assert_same_grads(model, reference, clear=True)
        counts.append(len(recorded))
        recorded.clear()
    if lazy_mode >= Mode.REPLAY:
        assert counts[0] > 0 and counts[1:] == [0, 0, 0], counts


def test_a_finished_step_frees_its_values_without_waiting_for_the_garbage_collector(lazy_mode):
    """A replayed session is reachable only from its lazy tensors: when the step's tensors go, its real
    values go at once (on a GPU, a previous step's activations must not outlive it until a collection).
    (A recording session waits for one: FakeTensorMode's constructor leaves a reference cycle through an
    import's traceback.)"""
    import gc
    import weakref

    recording.RECORDINGS.clear()
    model = mlp()
    gc.disable()
    try:
        for i, (x, y) in enumerate(batches(4)):
            x, y = stagetorch.lazy(x, y, batch=0)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            session = weakref.ref(x._session)
            replayed = x._session.mode is not Mode.RECORD
            model.zero_grad()
            del x, y, loss
            assert replayed == (i > 0 and lazy_mode >= Mode.REPLAY)
            if replayed:
                assert session() is None
    finally:
        gc.enable()


def test_a_python_number_in_an_op_on_real_tensors_changes_between_steps():
    """``weight * scale`` runs on real tensors (no lazy input): no step records it, but its backward
    formula reads ``scale``. What autograd saved is part of the replay's guard."""
    scales = [1.0, 2.0, 3.0, 0.5]

    def step(i, model, x, y):
        w = model[0].weight * scales[i]
        h = F.linear(x, w, model[0].bias)
        return F.cross_entropy(model[2](model[1](h)), y)

    assert_same_loop(step, n=4)


def test_a_real_tensor_of_another_shape_in_the_backward():
    def step(i, model, x, y):
        out = model(x)
        picked = out[out[:, 0] > 0]  # runs for real: a real tensor whose row count changes, saved by square
        return F.cross_entropy(out, y) + picked.square().sum() * 0.01

    assert_same_loop(step, n=6)


class _Scale(torch.autograd.Function):
    """A Python autograd.Function whose backward reads state the graph does not save as tensors."""

    @staticmethod
    def forward(ctx, x, s):
        ctx.s = s  # only the backward uses it
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.s, None


def test_a_python_autograd_function_always_runs_its_backward():
    scales = [1.0, 2.0, 3.0, 0.5]

    def step(i, model, x, y):
        return F.cross_entropy(_Scale.apply(model(x), scales[i]), y)

    assert_same_loop(step, n=4)


def test_a_hook_on_a_real_intermediate_tensor_runs_every_step():
    """PyTorch cannot show a hook on an autograd node; the replay sees the hook's calls come from a line
    other than backward()'s, and never skips the engine for that backward."""
    factors = [1.0, 3.0, 0.5, 2.0]

    def step(i, model, x, y):
        w = model[0].weight * 1.0  # real: computed from a parameter, no lazy input
        w.register_hook(lambda g: g * factors[i])
        h = F.linear(x, w, model[0].bias)
        return F.cross_entropy(model[2](model[1](h)), y)

    assert_same_loop(step, n=4)

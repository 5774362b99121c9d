"""What training scripts do that once died inside stagetorch with a raw error: each loop written as users
write it (several steps, an optimizer, values kept across steps), compared with the same loop in eager."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import models
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from budgets import budget_for

import stagetorch

STEPS = 4

# A script's module-level name, which the staged step below also reads as an attribute (``out.loss``):
# set by the tests to a plain tensor, or to a lazy tensor a one-line loop left behind.
loss = None
SCALE, SHIFT = 1.0, 0.0  # scalar globals read only by nested code of a step


@dataclass
class Output:
    loss: torch.Tensor
    logits: torch.Tensor


class Classifier(nn.Module):
    """Returns its loss and logits in an output object, as Hugging Face models do."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> Output:
        logits = self.net(x)
        return Output(F.cross_entropy(logits, labels), logits)


def batches(n: int = STEPS, batch: int = 10, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 12, generator=g), torch.randint(0, 3, (batch,), generator=g)) for _ in range(n)]


def train_step(model: nn.Module):
    def step(x, labels):
        out = model(x, labels)
        out.loss.backward()
        return out.loss

    return step


def train(model: nn.Module, step, data) -> list[float]:
    """The loop: zero_grad, the step, an SGD step; the loss of each step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        losses.append(step(x, y).item())
        optimizer.step()
    return losses


def one_line_loop(model: nn.Module, data) -> torch.Tensor:
    """A finished one-line loop; returns its last loss, a lazy tensor whose session is over."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in data:
        x, y = stagetorch.lazy(x, y, batch=0)
        out = F.cross_entropy(model.net(x), y)
        optimizer.zero_grad()
        out.backward()
        optimizer.step()
    return out


@pytest.mark.parametrize("script_global", ["tensor", "lazy"])
def test_an_attribute_name_is_not_a_global(script_global):
    """``out.loss`` loads the attribute ``loss``, not the global ``loss``: the program must not take the
    global as an input (a lazy one left by a one-line loop died in the run with an invalid-storage error)."""
    global loss
    torch.manual_seed(0)
    model = Classifier()
    reference = copy.deepcopy(model)
    loss = torch.randn(1000) if script_global == "tensor" else one_line_loop(Classifier(), batches(2, seed=5))
    left = loss
    data = batches()
    try:
        step = stagetorch.jit(train_step(model))
        assert "loss" not in step.graph(*data[0]).names
        got = train(model, step, data)
    finally:
        loss = None
    assert got == pytest.approx(train(reference, train_step(reference), data), rel=1e-6)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert left is not None


def test_globals_read_by_nested_code_still_key_the_program():
    """A global loaded only inside a generator expression or a lambda of the step is still read on every
    call: a new value stages again (what reading globals from bytecode must keep)."""
    global SCALE, SHIFT
    model = nn.Linear(12, 3)
    x = batches(1)[0][0]

    def step(x):
        shift = lambda: SHIFT
        return sum(model(x * SCALE).sum() for _ in range(1)) + shift()

    staged = stagetorch.jit(step)
    try:
        for scale, shift in [(1.0, 0.0), (2.0, 0.0), (2.0, 5.0)]:
            SCALE, SHIFT = scale, shift
            torch.testing.assert_close(staged(x), step(x).detach())
    finally:
        SCALE, SHIFT = 1.0, 0.0


def test_a_finished_one_line_sessions_tensors_are_data_to_jit():
    """The lazy input and a detached lazy result of a finished one-line loop, handed to a staged step as
    its data, are the real tensors they hold; a lazy global read by a staged evaluation step too (and the
    global is still the user's lazy tensor after)."""
    global loss
    torch.manual_seed(0)
    features = nn.Linear(12, 12)
    model = Classifier()
    reference = copy.deepcopy(model)
    data = batches()
    optimizer = torch.optim.SGD(features.parameters(), lr=0.1)
    for x, y in data:
        lx, ly = stagetorch.lazy(x, y, batch=0)
        h = features(lx)
        pretrain = F.cross_entropy(h[:, :3], ly)
        optimizer.zero_grad()
        pretrain.backward()
        optimizer.step()
    assert isinstance(lx, stagetorch.LazyTensor) and isinstance(h, stagetorch.LazyTensor)
    step = stagetorch.jit(train_step(model))
    lazy_data = [(lx, ly), (h.detach(), ly)] * 2
    eager_data = [(x, y), (h.detach().value(), y)] * 2
    assert train(model, step, lazy_data) == pytest.approx(train(reference, train_step(reference), eager_data), rel=1e-6)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)

    loss = pretrain
    try:

        @stagetorch.jit
        def evaluate(x):
            return model.net(x).sum() * loss

        with torch.no_grad():
            got = evaluate(x)
            want = model.net(x).sum() * pretrain.value()
        assert loss is pretrain
    finally:
        loss = None
    torch.testing.assert_close(got, want)


def test_a_lazy_tensor_that_requires_grad_is_refused_with_what_to_do():
    """A lazy result with an autograd graph, as a staged step's data: the staged backward could not follow
    its graph into the one-line session, so it is refused by name (what to do: .detach())."""
    torch.manual_seed(0)
    features = nn.Linear(12, 12)
    model = Classifier()
    x, y = batches(1)[0]
    lx, ly = stagetorch.lazy(x, y, batch=0)
    h = features(lx)
    with pytest.raises(stagetorch.UnsupportedOpError) as err:
        stagetorch.jit(train_step(model))(h, ly)
    msg = str(err.value)
    assert "x is a lazy tensor" in msg and "x.detach()" in msg and "test_user_scripts.py:" in msg
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("chunked", [False, True])
def test_one_line_accuracy_kept_across_steps_and_read_after_the_loop(lazy_mode, chunked):
    """``correct.append((logits.argmax(1) == labels).sum())`` each step and ``sum(correct)`` after the loop,
    epoch after epoch: once a recording replays, the sum re-records a finished step whose transposed weights
    the optimizer has since changed (a raw 'view was created in no_grad mode' error)."""
    torch.manual_seed(0)
    model = Classifier().net
    reference = copy.deepcopy(model)
    data = batches(batch=24)
    budget = None
    if chunked:
        budget = budget_for(stagetorch.jit(train_step(Classifier())), *data[0])

    def epochs(model, one_line):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        seen = []
        for _ in range(3):
            correct, losses = [], []
            for inputs, labels in data:
                if one_line:
                    inputs, labels = stagetorch.lazy(inputs, labels, batch=0, memory_budget=budget)
                logits = model(inputs)
                step_loss = F.cross_entropy(logits, labels)
                optimizer.zero_grad()
                step_loss.backward()
                optimizer.step()
                correct.append((logits.argmax(1) == labels).sum())
                losses.append(step_loss.detach())
            seen.append((int(sum(correct)), float(sum(losses))))
        return seen

    got, want = epochs(model, True), epochs(reference, False)
    assert [c for c, _ in got] == [c for c, _ in want]
    assert [s for _, s in got] == pytest.approx([s for _, s in want], rel=1e-5)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


class GroupedHead(nn.Module):
    """Splits its features into groups at fixed points given as a tensor, as code ported from numpy does."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(12, 16)
        self.heads = nn.ModuleList(nn.Linear(n, 3) for n in (4, 8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        groups = torch.tensor_split(self.body(x).relu(), torch.tensor([4, 12]), dim=1)
        return sum(head(g) for head, g in zip(self.heads, groups))


def test_eval_shape_reads_split_points_the_function_builds():
    x = torch.randn(5, 2)
    split = stagetorch.eval_shape(lambda x: torch.tensor_split(x, torch.tensor([1, 3])))(x)
    assert [a.shape for a in split] == [t.shape for t in torch.tensor_split(x, torch.tensor([1, 3]))]
    by_name = stagetorch.eval_shape(lambda x: x.tensor_split(tensor_indices_or_sections=torch.tensor([2]), dim=1))(x)
    assert [a.shape for a in by_name] == [(5, 2), (5, 0)]


@pytest.mark.parametrize("chunked", [False, True])
def test_a_step_that_splits_at_constant_points_trains_as_eager(chunked):
    torch.manual_seed(0)
    model = GroupedHead()
    reference = copy.deepcopy(model)
    data = batches(batch=24)

    step = models.train_step(model)
    staged = stagetorch.jit(step)
    if chunked:
        staged.memory_budget = budget_for(stagetorch.jit(step), *data[0])
        assert len(staged.plan(*data[0]).chunk_sizes) >= 3
    optimizer, eager_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    for x, y in data:
        optimizer.zero_grad()
        eager_optimizer.zero_grad()
        got = staged(x, y)
        want = F.cross_entropy(reference(x), y)
        want.backward()
        torch.testing.assert_close(got, want.detach())
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
        optimizer.step()
        eager_optimizer.step()


def test_split_points_from_an_argument_are_a_concretization_error_at_the_line():
    def step(x, points):
        return torch.tensor_split(x, points)  # the split

    with pytest.raises(stagetorch.ConcretizationError) as err:
        stagetorch.jit(step, batch_argnums=(0,))(torch.randn(5, 2), torch.tensor([1, 3]))
    msg = str(err.value)
    assert "torch.tensor_split" in msg and "test_user_scripts.py:" in msg and "# the split" in msg
    assert "tolist()" in msg


def bn_classifier() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(12, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3)
    )


def test_memory_of_a_batchnorm_step_under_a_budget_that_needs_chunks_names_the_coupling():
    """``stagetorch.memory`` stages the step at one example too, where BatchNorm in training mode (as in
    eager) refuses a single value per channel: that probe is left out, not a raw ValueError; under a budget
    that needs chunks it raises the BatchCouplingError ``jit`` raises, whose smallest budget then trains
    as eager does (in chunked passes over one example each: the BatchNorm's statistics summed per pass)."""
    model = bn_classifier()
    reference = copy.deepcopy(model)
    data = batches(batch=32)

    step = models.train_step(model)
    report = stagetorch.memory(step)(*data[0])
    assert 1 not in report.probes and report.peak_bytes == stagetorch.jit(step).plan(*data[0]).peak
    with pytest.raises(stagetorch.BatchCouplingError) as err:
        stagetorch.memory(step, memory_budget=report.peak_bytes // 2)(*data[0])
    assert "BatchNorm" in str(err.value) and err.value.smallest_budget is not None
    assert stagetorch.memory(step, memory_budget=err.value.smallest_budget)(*data[0]).schedule.chunk_sizes == (1,) * 32
    staged = stagetorch.jit(step, memory_budget=report.peak_bytes // 2)
    with pytest.raises(stagetorch.BatchCouplingError) as err:
        staged(*data[0])
    assert all(p.grad is None for p in model.parameters())
    staged.memory_budget = err.value.smallest_budget  # the call's, with the copies it holds beside the program
    optimizer, eager_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    for x, y in data:
        optimizer.zero_grad()
        eager_optimizer.zero_grad()
        got = staged(x, y)
        want = F.cross_entropy(reference(x), y)
        want.backward()
        torch.testing.assert_close(got, want.detach())
        optimizer.step()
        eager_optimizer.step()
    for p, q in zip(model.state_dict().values(), reference.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_an_argument_with_an_eager_autograd_graph_is_named_where_the_backward_reaches_it():
    """Features computed eagerly from an encoder, handed to a staged step that trains the head: the staged
    backward cannot follow them into the encoder (a raw 'backward() through example input' error before);
    detached, the step trains the head as eager does."""
    torch.manual_seed(0)
    encoder, head = nn.Linear(12, 16), nn.Linear(16, 3)
    reference = copy.deepcopy(head)
    data = batches()

    def step(features, y):
        loss = F.cross_entropy(head(features.relu()), y)
        loss.backward()  # the backward
        return loss

    x = data[0][0]
    score = stagetorch.jit(lambda features: head(features).sum())  # no backward: its graph is not followed
    torch.testing.assert_close(score(encoder(x)), head(encoder(x)).sum().detach())
    staged = stagetorch.jit(step)
    with pytest.raises(stagetorch.UnsupportedOpError) as err:
        staged(encoder(x), data[0][1])
    msg = str(err.value)
    assert "reaches features" in msg and "test_user_scripts.py:" in msg and "# the backward" in msg
    assert ".detach()" in msg
    assert all(p.grad is None for p in [*encoder.parameters(), *head.parameters()])
    optimizer, eager_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (head, reference))
    for x, y in data:
        features = encoder(x).detach()
        optimizer.zero_grad()
        eager_optimizer.zero_grad()
        got = staged(features, y)
        want = F.cross_entropy(reference(features.relu()), y)
        want.backward()
        torch.testing.assert_close(got, want.detach())
        optimizer.step()
        eager_optimizer.step()
    for p, q in zip(head.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)

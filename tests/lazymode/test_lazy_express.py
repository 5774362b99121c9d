"""The express replay: a step whose torch-level calls repeat the taped ones runs none of them (no autograd
graph, no op reaches ``__torch_dispatch__``), and every way a step can leave the tape (another call, a value
read, a hook, an autograd.Function, autocast, a parameter swapped) still gives plain PyTorch's losses and
gradients. Each loop runs against the same loop in plain PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from lazy_loops import assert_same_grads, assert_same_loop, batches, mlp

import stagetorch
from stagetorch.errors import ShapeError
from stagetorch.lazymode import recording
from stagetorch.lazymode.mode import Mode
from stagetorch.lazymode.session import _Session

pytestmark = pytest.mark.usefixtures("lazy_mode")


def plain_step(i, model, x, y):
    return F.cross_entropy(model(x), y)


def test_a_repeated_step_runs_no_op_and_builds_no_graph(dispatched, lazy_mode):
    recording.RECORDINGS.clear()
    model = mlp()
    reference = copy.deepcopy(model)
    counts = []
    for x, y in batches(4):
        h = model[1](model[0](stagetorch.lazy(x, batch=0)))
        loss = F.cross_entropy(model[2](h), y)
        loss.backward()
        F.cross_entropy(reference(x), y).backward()
        assert_same_grads(model, reference, clear=True)
        counts.append(len(dispatched))
        dispatched.clear()
        # What user code sees of a lazy tensor is the same in both modes.
        assert h.shape == (10, 16) and h.dtype == torch.float32 and h.requires_grad and isinstance(h, torch.Tensor)
    session = h._session
    assert session.mode is lazy_mode
    if lazy_mode is Mode.EXPRESS:
        assert counts[0] > 0 and counts[1:] == [0, 0, 0], counts
        assert session.tape_pos == len(session.recording.tape)


def test_a_call_the_tape_lacks_leaves_the_express_replay_mid_forward():
    """Every other step adds a call in the middle of the forward: the replayed calls before it get their
    autograd graph back (shadows), and a lazy tensor made before the divergence is used after it."""

    def step(i, model, x, y):
        h = model[0](x)
        r = model[1](h)
        if i % 2:
            r = r * 0.5 + h.tanh()  # h: made by the express replay, used after it left
        return F.cross_entropy(model[2](r), y)

    assert_same_loop(step, n=6)


def test_in_place_calls_replay_and_survive_a_divergence():
    def step(i, model, x, y):
        x = x.clone()
        x.mul_(2.0)
        h = model[0](x)
        h.relu_()
        if i == 3:
            h = h + h.sum(1, keepdim=True) * 0.01  # leaves the tape after the in-place calls
        return F.cross_entropy(model[2](h), y)

    assert_same_loop(step, n=5)


def test_a_value_read_mid_forward_does_not_leave_the_express_replay(dispatched, lazy_mode):
    reads, counts = [], []

    def step(i, model, x, y):
        h = model[1](model[0](x))
        reads.append(h.sum().item())  # evaluated once, kept for the backward
        counts.append(len(dispatched))
        return F.cross_entropy(model[2](h), y)

    assert_same_loop(step, n=4)
    lazy_part, eager_part = reads[:4], reads[4:]
    assert lazy_part == pytest.approx(eager_part, rel=1e-5)
    if lazy_mode is Mode.EXPRESS:
        assert counts[0] > 0 and len(set(counts[1:4])) == 1, counts  # steps 2-4 dispatch nothing


def test_batchnorm_and_dropout_replay_once_per_step():
    """Running statistics are updated once per step and dropout masks are drawn by the staged program, in
    the same order as eager (the same seed gives the same losses and gradients)."""

    def model_fn():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))

    assert_same_loop(plain_step, n=4, model_fn=model_fn)
    recording.RECORDINGS.clear()
    model = model_fn()
    reference = copy.deepcopy(model)
    for x, _ in batches(4):
        model(stagetorch.lazy(x, batch=0)).sum().backward()
        reference(x).sum().backward()
    assert torch.allclose(model[1].running_mean, reference[1].running_mean, atol=1e-6)
    assert model[1].num_batches_tracked == reference[1].num_batches_tracked == 4


@pytest.mark.parametrize("reach", ["grad_fn", "is_leaf", "register_hook", "retain_grad"])
def test_reaching_into_autograd_leaves_the_express_replay(reach):
    seen = []

    def step(i, model, x, y):
        h = model[0](x)
        if reach == "grad_fn":
            assert h.grad_fn is not None
        elif reach == "is_leaf":
            assert not h.is_leaf
        elif reach == "register_hook":
            h.register_hook(lambda g: seen.append(g.shape) or g * 2)
        else:
            h.retain_grad()
        return F.cross_entropy(model[2](model[1](h)), y)

    assert_same_loop(step, n=3)
    if reach == "register_hook":
        assert seen == [(10, 16)] * 6


class _Reverse(torch.autograd.Function):
    """Gradient reversal: forward is the identity, backward negates."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -grad


def test_an_autograd_function_the_recorded_step_did_not_call():
    """apply() builds its graph below any torch function, from the lazy tensors it takes: here ones the
    express replay made, with no graph. The backward carries their gradients on from their shadows."""

    def step(i, model, x, y):
        h = model[1](model[0](x))
        if i >= 2:
            h = h + _Reverse.apply(h) * 0.5
        return F.cross_entropy(model[2](h), y)

    assert_same_loop(step, n=4)


def test_an_autograd_function_in_every_step_turns_the_express_replay_off(lazy_mode):
    def step(i, model, x, y):
        return F.cross_entropy(model[2](_Reverse.apply(model[1](model[0](x)))), y)

    assert_same_loop(step, n=3)
    (recorded_once,) = recording.RECORDINGS.values()
    assert not recorded_once.express or lazy_mode is not Mode.EXPRESS  # only an express step turns it off


@pytest.mark.lazy_modes("express")
def test_autograd_grad_over_an_unrecorded_function_is_refused():
    recording.RECORDINGS.clear()
    model = mlp()
    for i, (x, y) in enumerate(batches(2)):
        h = model[1](model[0](stagetorch.lazy(x, batch=0)))
        if i == 1:
            h = _Reverse.apply(h)
        loss = F.cross_entropy(model[2](h), y)
        if i == 0:
            loss.backward()
        else:
            with pytest.raises(NotImplementedError, match="autograd.Function"):
                torch.autograd.grad(loss, list(model.parameters()))


def test_real_tensors_made_each_step_are_read_each_step():
    """A mask drawn in user code each step is a new real tensor in the same position: bound, not compared
    by identity, and its new values are the ones the staged program reads."""
    masks = [torch.rand(10, 16) > 0.5 for _ in range(4)]

    def step(i, model, x, y):
        return F.cross_entropy(model[2](model[1](model[0](x)) * masks[i]), y)

    assert_same_loop(step, n=4)


def test_a_parameter_given_new_storage_is_read_from_its_new_storage():
    def step(i, model, x, y):
        if i == 2:
            with torch.no_grad():
                model[0].weight.data = torch.randn(16, 12, generator=torch.Generator().manual_seed(i))  # new storage
        if i == 3:
            with torch.no_grad():
                model[2].weight.data = torch.randn(16, 3, generator=torch.Generator().manual_seed(i)).t()  # another stride
        return F.cross_entropy(model(x), y)

    recording.RECORDINGS.clear()
    torch.manual_seed(5)
    assert_same_loop(step, n=5)


@pytest.mark.parametrize(("old", "new"), [(3, 1), (1, 3), (3, 4)])
def test_a_parameter_given_another_shape_with_its_grad_held(old, new):
    """``w.data = torch.randn(new)`` between steps, the ``.grad`` of the old shape kept (accumulation): eager
    PyTorch adds the new gradient into it, broadcasting (3 into 1), or raises where it cannot (1 into 3 in
    the backward, 3 against 4 in the forward). One-line mode does the same, in every mode: it failed in the
    recording, which copied the stale ``.grad`` onto the parameter's fake tensor (autograd's "attempting to
    assign a gradient of size")."""
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))

    def run(lazy):
        torch.manual_seed(0)
        w = nn.Parameter(torch.randn(old))
        outcome = []
        for i in range(4):
            if i == 2:
                w.data = torch.randn(new)
            xi = stagetorch.lazy(x) if lazy else x
            try:
                (xi * w).sum().backward()
            except (RuntimeError, ShapeError) as e:  # (stagetorch's error for a shape failure: ShapeError)
                return outcome, e
            outcome.append(w.grad.clone())
        return outcome, None

    (eager, eager_error), (lazy, lazy_error) = run(False), run(True)
    assert (lazy_error is None) == (eager_error is None), (lazy_error, eager_error)
    assert "attempting to assign a gradient" not in str(lazy_error)
    assert len(lazy) == len(eager)
    for a, b in zip(lazy, eager):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b)
    if (old, new) == (3, 1):
        assert eager_error is None and eager[-1].shape == (3,)  # the case eager runs through


@pytest.mark.parametrize(
    ("scales", "express"), [([1.0, 2.0, 0.5, 3.0], [False] * 4), ([2.0, 2.0, 2.0, 0.5, 0.5], [False, True, True, False, False])]
)
def test_a_real_argument_with_an_autograd_graph(scales, express, dispatched, lazy_mode):
    """``weight * scale`` computed outside the lazy tensors: its graph (node types, the saved scale, the
    parameter) is walked and compared each step; the same graph replays express, another scale does not."""
    counts = []

    def step(i, model, x, y):
        counts.append(len(dispatched))
        w = model[0].weight * scales[i]  # real, with an autograd graph into the parameter
        return F.cross_entropy(model[2](model[1](F.linear(x, w, model[0].bias))), y)

    assert_same_loop(step, n=len(scales))
    per_step = [counts[i + 1] - counts[i] for i in range(len(scales))]  # then the eager loop: nothing
    if lazy_mode is Mode.EXPRESS:
        assert [n == 0 for n in per_step] == express, per_step


def test_results_keep_their_kind_and_aliases():
    recording.RECORDINGS.clear()
    for x, _ in batches(3):
        a = stagetorch.lazy(x, batch=0)
        assert a.contiguous() is a
        best = torch.max(a, 1)
        assert type(best) is torch.return_types.max
        halves = a.chunk(2, dim=1)
        assert type(halves) is tuple and len(halves) == 2
        assert torch.equal(best.values.value(), torch.max(x, 1).values)
        assert torch.equal(halves[1].value(), x.chunk(2, dim=1)[1])


@pytest.mark.lazy_modes("express")
def test_an_op_below_the_torch_function_is_refused():
    recording.RECORDINGS.clear()
    model = mlp()
    for i, (x, _) in enumerate(batches(2)):
        h = model[0](stagetorch.lazy(x, batch=0))
        if i == 1:
            assert h._express
            with torch._C.DisableTorchFunctionSubclass(), pytest.raises(RuntimeError, match="without its torch function"):
                h + 1


def test_autocast_and_grad_mode_are_part_of_what_repeats():
    """A step under autocast does not replay a tape recorded without it, nor a no_grad call one recorded
    with grad."""

    def step(i, model, x, y):
        if i == 2:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = model[0](x)
            assert h.dtype == torch.bfloat16
            h = h.float()
        else:
            h = model[0](x)
        if i == 3:
            with torch.no_grad():
                h = h * 1.0
            assert not h.requires_grad
            return F.cross_entropy(model[2](model[1](h)), y)
        return F.cross_entropy(model[2](model[1](h)), y)

    assert_same_loop(step, n=5)


def test_gradient_accumulation_replays_and_adds_into_grad(dispatched, lazy_mode):
    """Several micro-batches, one optimizer step: the express backward adds into the real .grad."""
    recording.RECORDINGS.clear()
    model = mlp()
    reference = copy.deepcopy(model)
    counts = []
    for step in range(3):
        for x, y in batches(3, seed=step):
            (F.cross_entropy(model(stagetorch.lazy(x, batch=0)), y) / 3).backward()
            (F.cross_entropy(reference(x), y) / 3).backward()
            counts.append(len(dispatched))
            dispatched.clear()
        assert_same_grads(model, reference, clear=True)
    if lazy_mode is Mode.EXPRESS:
        assert counts[0] > 0 and counts[1:] == [0] * 8, counts


def test_a_second_backward_after_an_express_backward_raises(lazy_mode):
    recording.RECORDINGS.clear()
    model = mlp()
    for x, y in batches(2):
        loss = F.cross_entropy(model(stagetorch.lazy(x, batch=0)), y)
        loss.backward()
    assert loss._express == (lazy_mode is Mode.EXPRESS)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


def test_a_call_that_returns_its_argument_stays_on_the_tape(dispatched, lazy_mode):
    """``x.to(x.dtype)`` runs no op and hands back its argument: replayed (as is ``loss.detach()``, an op).
    A call that changes autograd state without an op (``requires_grad_``) is not."""
    recording.RECORDINGS.clear()
    model = mlp()
    counts = []
    for x, y in batches(3):
        a = stagetorch.lazy(x, batch=0)
        assert a.to(torch.float32) is a
        loss = F.cross_entropy(model(a), y)
        loss.backward()
        logged = loss.detach()
        assert not logged.requires_grad
        model.zero_grad()
        counts.append(len(dispatched))
        dispatched.clear()
    if lazy_mode is Mode.EXPRESS:
        assert counts[0] > 0 and counts[1:] == [0, 0], counts
    assert loss._session.mode is lazy_mode
    recording.RECORDINGS.clear()
    for x, _ in batches(2):
        a = stagetorch.lazy(x, batch=0).clone()
        assert a.requires_grad_() is a and a.requires_grad
        assert a._session.mode is not Mode.EXPRESS or a._session.tape_pos < len(a._session.recording.tape)


def test_an_express_step_still_chunks_to_its_budget(dispatched, lazy_mode):
    """The seed program, three steps with a budget that forces chunks: steps 2 and 3 replay from the tape
    (no op reaches a lazy tensor), run in chunks (what the real kernels saw), and equal eager."""
    import models
    from budgets import budget_for
    from lazy_loops import RealKernelBatchSizes, rel, seed_program

    recording.RECORDINGS.clear()
    model, make = models.seed_mlp()
    x, y = make(1000)
    budget = budget_for(stagetorch.jit(models.train_step(copy.deepcopy(model))), x, y)
    reference = copy.deepcopy(model)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        dispatched.clear()
        if step == 0:  # recorded without the mode: its frames would stand between backward() and its ops
            loss, grads = seed_program(model, x, y, memory_budget=budget)
        else:
            with RealKernelBatchSizes((torch.ops.aten.addmm,)) as seen:
                loss, grads = seed_program(model, x, y, memory_budget=budget)
            assert max(seen.sizes) < 1000 and len(seen.sizes) > 3, seen.sizes
        assert (len(dispatched) == 0) == (step > 0 and lazy_mode is Mode.EXPRESS), len(dispatched)
        reference_optimizer.zero_grad()
        expected = F.cross_entropy(reference(x), y)
        expected.backward()
        assert abs(loss - expected.item()) <= 1e-5 * expected.item()
        for g, p in zip(grads, reference.parameters()):
            assert rel(g, p.grad) < 1e-5
        reference_optimizer.step()


def test_nested_and_keyword_arguments_replay(dispatched, lazy_mode):
    """Lists of tensors (``torch.cat``), keyword arguments and Python values are part of the taped call;
    another value (here a dim, a scale) is another call."""
    recording.RECORDINGS.clear()
    model = mlp()
    reference = copy.deepcopy(model)
    counts = []
    for i, (x, y) in enumerate(batches(5)):
        for net, inputs in ((model, stagetorch.lazy(x, batch=0)), (reference, x)):
            h = net[0](inputs)
            both = torch.cat([h, net[1](h)], dim=1)
            scale = 0.5 if i != 3 else 2.0
            logits = net[2](both[:, 16:] * scale + both[:, :16].mul(other=0.1))
            F.cross_entropy(logits, y, reduction="sum" if i == 4 else "mean").backward()
        assert_same_grads(model, reference, clear=True)
        counts.append(len(dispatched))
        dispatched.clear()
    if lazy_mode is Mode.EXPRESS:
        assert counts[0] > 0 and counts[1:3] == [0, 0] and counts[3] > 0 and counts[4] > 0, counts



@pytest.mark.parametrize("name", ["cnn_batchnorm", "transformer", "mha", "lstm", "gpt2"])
def test_models_replay_express_and_equal_eager(name, dispatched, lazy_mode):
    """Each model of the zoo, four training steps (SGD) with the one line added, against the same loop in
    plain PyTorch: losses, gradients and parameters equal, and from the second step on nothing reaches an op
    on a lazy tensor. (The transformers add a slice or a lookup of a positional-embedding parameter: a real
    tensor with an autograd graph, which the replay walks and compares each step.)"""
    import models

    if name == "gpt2":
        pytest.importorskip("transformers")
        model, make = models.gpt2()
        step = lambda m, x, y: m(input_ids=x, labels=y).loss  # noqa: E731
    else:
        model, make = models.cnn("batch") if name == "cnn_batchnorm" else getattr(models, name)()
        step = lambda m, x, y: (lambda out: F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)))(m(x))  # noqa: E731
    recording.RECORDINGS.clear()
    reference = copy.deepcopy(model)
    batches_ = [make(6) for _ in range(4)]
    counts, results = [], []
    for net, one_line in ((model, True), (reference, False)):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
        torch.manual_seed(0)
        for x, y in batches_:
            if one_line:
                x, y = stagetorch.lazy(x, y, batch=0)
                dispatched.clear()
            optimizer.zero_grad()
            loss = step(net, x, y)
            loss.backward()
            results.append((loss.item(), [p.grad.clone() for p in net.parameters() if p.grad is not None]))
            optimizer.step()
            if one_line:
                counts.append(len(dispatched))
    for (a, ga), (b, gb) in zip(results[:4], results[4:]):
        assert abs(a - b) <= 1e-5 * abs(b) + 1e-6
        assert len(ga) == len(gb)
        for g, e in zip(ga, gb):
            assert torch.allclose(g, e, rtol=1e-4, atol=1e-6)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=1e-4, atol=1e-6)
    if lazy_mode is Mode.EXPRESS:
        assert counts[0] > 0 and counts[1:] == [0, 0, 0], counts


def test_a_positional_lookup_replays_with_its_saved_indices(dispatched, lazy_mode):
    """``h + pos(positions)``: a real embedding lookup of a parameter. Its backward reads the indices the
    lookup saved; the express backward takes them from this step's graph (new positions each step)."""
    recording.RECORDINGS.clear()
    model = mlp()
    pos = nn.Embedding(40, 16)
    reference, reference_pos = copy.deepcopy(model), copy.deepcopy(pos)
    counts = []
    for i, (x, y) in enumerate(batches(4)):
        positions = torch.arange(10) + 7 * i
        for net, table, inputs in ((model, pos, stagetorch.lazy(x, batch=0)), (reference, reference_pos, x)):
            h = net[0](inputs) + table(positions)
            F.cross_entropy(net[2](net[1](h)), y).backward()
        assert_same_grads(model, reference, clear=True)
        assert torch.allclose(pos.weight.grad, reference_pos.weight.grad, atol=1e-7)
        pos.weight.grad = reference_pos.weight.grad = None
        counts.append(len(dispatched))
        dispatched.clear()
    if lazy_mode is Mode.EXPRESS:
        assert counts[0] > 0 and counts[1:] == [0, 0, 0], counts


def _record_leaves(monkeypatch):
    """The tape positions at which sessions leave the express replay, appended as they do."""
    left = []
    leave = _Session.leave_express
    monkeypatch.setattr(_Session, "leave_express", lambda self: left.append(self.tape_pos) or leave(self))
    return left


def test_a_step_that_always_leaves_the_replay_stops_replaying_express(monkeypatch, lazy_mode):
    """A call the tape does not replay (here one under autocast) in every step: the first two replays leave
    the express replay there; after that the recording is replayed slowly from the start, not express then
    slow."""
    left = _record_leaves(monkeypatch)

    def step(i, model, x, y):
        h = model[1](model[0](x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = model[2](h)
        return F.cross_entropy(h.float(), y)

    assert_same_loop(step, n=6)
    assert left == ([2, 2] if lazy_mode is Mode.EXPRESS else []), left



@pytest.mark.lazy_modes("express")
@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_padded_transformers_stay_on_the_express_replay(name, dispatched, monkeypatch, lazy_mode):
    """A padded batch (attention mask): CPU ``scaled_dot_product_attention`` turns the boolean mask into
    ``where(mask, 0, -inf)``, two 0-d tensors it makes itself, which the express replay binds again as they
    are. Four AdamW steps equal eager's (losses, every gradient, the parameters), and from the second step on
    no op reaches a lazy tensor and no step leaves the express replay (before: every step left it at the
    first attention, and after two steps the recording was replayed slowly)."""
    pytest.importorskip("transformers")
    import transformer_zoo as zoo

    left = _record_leaves(monkeypatch)
    model = zoo.make_model(name)
    reference = copy.deepcopy(model)
    batch = zoo.make_batch(name, padded=True)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
    counts = []
    for _ in range(4):
        for optimizer in optimizers:
            optimizer.zero_grad()
        inputs = dict(zip(batch, stagetorch.lazy(*batch.values(), batch=0)))
        dispatched.clear()
        loss = model(**inputs).loss
        loss.backward()
        counts.append(len(dispatched))
        expected = reference(**batch).loss
        expected.backward()
        zoo.assert_same(model, reference, loss, expected)
        for optimizer in optimizers:
            optimizer.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert (p - q).norm() <= 1e-9 * q.norm(), (p - q).norm()
    assert counts[0] > 0 and counts[1:] == [0, 0, 0], counts
    assert left == [], left


class _Masked(nn.Module):
    """Attention under a boolean mask (SDPA makes 0-d tensors of its own), a ``torch.where`` of a real
    tensor and a number, and a cosine similarity with a parameter (a 0-d norm of the parameter made inside
    the call: its value changes every step, so that call must never be replayed from the tape)."""

    def __init__(self, cosine: bool):
        super().__init__()
        self.proj = nn.Linear(8, 24)
        self.direction = nn.Parameter(torch.randn(8))
        self.bias = torch.randn(5, 5)
        self.cosine = cosine

    def forward(self, x, mask):
        q, k, v = self.proj(x).unflatten(-1, (3, 8)).unbind(-2)
        keep = mask[:, None, :] & mask[:, :, None]
        scores = torch.where(keep, self.bias, -1e4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep) + scores.softmax(-1) @ v
        if self.cosine:
            out = out * F.cosine_similarity(out, self.direction, dim=-1)[..., None]
        return out.square().mean()


@pytest.mark.parametrize("cosine", [False, True], ids=["literals", "computed"])
def test_constants_a_call_makes_itself(cosine, dispatched, lazy_mode):
    """Constants a taped call makes itself replay express only where their value is the call's Python
    arguments': SDPA's own 0-d tensors and ``torch.where``'s number do; a 0-d norm of a parameter (cosine
    similarity) does not, and the steps still equal eager's as the parameter trains."""
    recording.RECORDINGS.clear()
    torch.manual_seed(0)
    model = _Masked(cosine)
    reference = copy.deepcopy(model)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.1) for m in (model, reference)]
    x = torch.randn(4, 5, 8)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    counts = []
    for _ in range(4):
        for optimizer in optimizers:
            optimizer.zero_grad()
        dispatched.clear()
        loss = model(*stagetorch.lazy(x, mask, batch=0))
        loss.backward()
        counts.append(len(dispatched))
        expected = reference(x, mask)
        expected.backward()
        assert torch.allclose(loss, expected, rtol=1e-6, atol=0), (loss.item(), expected.item())
        for p, q in zip(model.parameters(), reference.parameters()):
            assert (p.grad is None) == (q.grad is None) == (p is model.direction and not cosine)
            assert p.grad is None or torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)
        for optimizer in optimizers:
            optimizer.step()
    if lazy_mode is Mode.EXPRESS:
        assert counts[0] > 0 and (all(counts[1:]) if cosine else counts[1:] == [0, 0, 0]), counts


@pytest.mark.parametrize("case", ["fresh", "read-before", "diverge-after"])
def test_writes_into_real_tensors_replay_express(case, dispatched, monkeypatch, lazy_mode):
    """A router's token counts, ``torch.zeros(E).scatter_add_(0, experts, ones)``, and a running mean a
    buffer keeps, ``ema.add_(logits.detach().mean(0))``: writes into real tensors, which run for real at once
    (the user may read them). The express replay runs them for real too, after what they read: the counts
    read each step equal eager's, and so do the buffer, the losses and the gradients. ``read-before``: the
    loss reads the buffer before the write, so the write waits for what was recorded before it;
    ``diverge-after``: every other step leaves the express replay after the writes, which the slow replay
    does not run again (the counts and the buffer would be added twice)."""
    left = _record_leaves(monkeypatch)
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    reference = copy.deepcopy(model)
    buffers = [torch.zeros(4), torch.zeros(4)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.1) for m in (model, reference)]
    counts = []
    for i in range(5):
        x = torch.randn(10, 8)
        seen = []
        for net, ema, one_line in ((model, buffers[0], True), (reference, buffers[1], False)):
            logits = net(stagetorch.lazy(x, batch=0) if one_line else x)
            if one_line:
                dispatched.clear()
            if case == "read-before":
                logits = logits + ema
            experts = logits.argmax(-1)
            tokens = torch.zeros(4).scatter_add_(0, experts, torch.ones_like(logits[:, 0]))
            ema.add_(logits.detach().mean(0))
            if case == "diverge-after" and i % 2:
                logits = logits * 2
            loss = (logits.softmax(-1) * tokens).sum() / 10
            loss.backward()
            seen.append((tokens.tolist(), loss.item(), ema.clone()))
            if one_line:
                counts.append(len(dispatched))
        (tokens, loss, ema), (tokens0, loss0, ema0) = seen
        assert tokens == tokens0 and abs(loss - loss0) <= 1e-6 * abs(loss0) and torch.allclose(ema, ema0, atol=1e-6)
        assert_same_grads(model, reference)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    if lazy_mode is Mode.EXPRESS and case != "diverge-after":
        assert counts[0] > 0 and counts[1:] == [0] * 4 and left == [], (counts, left)
    elif lazy_mode is Mode.EXPRESS:
        assert left and all(pos > 3 for pos in left), left  # past both writes


def test_a_write_of_a_value_that_requires_grad_is_not_replayed_express(monkeypatch, lazy_mode):
    """``bank.add_(h)`` with ``h`` requiring grad: the real tensor joins the autograd graph (eager: it gets a
    grad_fn), which the express replay does not make, so the call stops it; the steps still equal eager's."""
    left = _record_leaves(monkeypatch)
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    reference = copy.deepcopy(model)
    for _ in range(4):
        x = torch.randn(10, 8)
        losses = []
        for net, one_line in ((model, True), (reference, False)):
            h = net(stagetorch.lazy(x, batch=0) if one_line else x)
            bank = torch.zeros(10, 4)
            bank.add_(h)
            loss = bank.square().mean()
            loss.backward()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= 1e-6 * abs(losses[1])
        assert_same_grads(model, reference, clear=True)
    assert (left != []) == (lazy_mode is Mode.EXPRESS), left

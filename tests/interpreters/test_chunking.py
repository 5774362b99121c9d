"""Chunked execution against one full-batch eager step: loss, outputs and every .grad, exactly.

Every case forces at least three uneven chunks with memory_budget, and proves it by the batch sizes the
real kernels saw.
"""

from __future__ import annotations

import copy
import re

import models
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from budgets import KernelBatchSizes, budget_for, rel
from hungry_op import _DEVICE
from injected import identity_op

import stagetorch

BATCH = 100



def check(model: nn.Module, step_of, batch: tuple, ops: tuple = (torch.ops.aten.addmm,), out_index=None):
    """Full-batch eager vs staged in >= 3 uneven chunks; compares loss, outputs and grads."""
    reference = copy.deepcopy(model)
    with KernelBatchSizes(ops) as full:
        expected = step_of(reference)(*batch)
    staged = stagetorch.jit(step_of(model), remat=False)  # chunks alone: recomputation could take fewer
    budget_for(staged, *batch)
    plan = staged.plan(*batch)
    assert len(plan.chunk_sizes) >= 3 and len(set(plan.chunk_sizes)) > 1, plan
    with KernelBatchSizes(ops) as seen:
        got = staged(*batch)
    # The kernels saw chunks, never the whole batch, and chunks of more than one size.
    assert seen.sizes and max(seen.sizes) < max(full.sizes), (seen.sizes, full.sizes, plan)
    assert len(set(seen.sizes)) > 1
    exp_loss, got_loss = (expected, got) if out_index is None else (expected[out_index], got[out_index])
    assert rel(got_loss.detach(), exp_loss.detach()) < 1e-5
    if out_index is not None:
        for i, (e, g) in enumerate(zip(expected, got)):
            assert g.shape == e.shape
            assert rel(g.detach(), e.detach()) < 1e-5, i
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is None:
            assert p.grad is None, name
        else:
            assert rel(p.grad, q.grad) < 1e-5, name
    return plan


def _step(model, loss_fn):
    def step(x, y):
        out = model(x)
        loss = loss_fn(out.reshape(-1, out.shape[-1]), y.reshape(-1), model)
        loss.backward()
        return loss

    return step


LOSSES = {
    "mean_ce": lambda out, y, m: F.cross_entropy(out, y),
    "sum_ce": lambda out, y, m: F.cross_entropy(out, y, reduction="sum"),
    "ce_plus_l2": lambda out, y, m: F.cross_entropy(out, y) + 1e-3 * sum((p**2).sum() for p in m.parameters()),
    "mse": lambda out, y, m: F.mse_loss(out, F.one_hot(y, out.shape[-1]).float()),
    "two_losses": lambda out, y, m: F.cross_entropy(out, y) + 0.5 * F.mse_loss(out.softmax(-1), F.one_hot(y, out.shape[-1]).float()),
}


@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("arch", ["mlp", "cnn", "transformer", "lstm"])
def test_chunked_step_equals_full_batch(arch, loss):
    model, make = models.CLASSIFIERS[arch]() if arch != "mlp" else _mlp()
    # An op whose first argument leads with the batch: what the kernels saw.
    ops = {
        "mlp": (torch.ops.aten.addmm,),
        "cnn": (torch.ops.aten.convolution,),
        "transformer": (torch.ops.aten.native_layer_norm,),
        "lstm": (torch.ops.aten.addmm,),
    }[arch]
    x, y = make(BATCH)
    check(model, lambda m: _step(m, LOSSES[loss]), (x, y), ops)


class _Upsampler(nn.Module):
    """A conv, an upsampling of ``mode`` and a conv over a ``dims``-d image, then a classifier."""

    def __init__(self, mode: str, dims: int, antialias: bool = False):
        super().__init__()
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
        self.mode, self.antialias = mode, antialias
        self.inp, self.out, self.head = conv(3, 4, 3, padding=1), conv(4, 4, 3, padding=1), nn.Linear(4, 5)

    def forward(self, x):
        h = F.interpolate(self.inp(x), scale_factor=2, mode=self.mode, antialias=self.antialias)
        return self.head(self.out(h).flatten(2).mean(-1))


@pytest.mark.parametrize("mode, dims, antialias", [
    ("nearest", 1, False), ("nearest", 2, False), ("nearest", 3, False), ("nearest-exact", 2, False),
    ("linear", 1, False), ("bilinear", 2, False), ("bicubic", 2, False), ("trilinear", 3, False),
    ("bilinear", 2, True), ("bicubic", 2, True),
])
def test_upsampling_chunks_exactly(mode, dims, antialias):
    """The upsampling backward takes the input's full size, batch included: each chunk's call gets its own
    (a chunked step crashed with "Expected grad_output to have the same shape as output")."""
    torch.manual_seed(0)
    model = _Upsampler(mode, dims, antialias).double()  # float64: a 3-d bias gradient sums 1e4 terms
    x = torch.randn(BATCH, 3, *[6] * dims, dtype=torch.float64)
    y = torch.randint(0, 5, (BATCH,))
    check(model, models.train_step, (x, y), (torch.ops.aten.convolution,))


_UNTAGGED_BACKWARDS = {
    "hardswish": nn.Hardswish, "hardsigmoid": nn.Hardsigmoid, "mish": nn.Mish, "softplus": nn.Softplus,
    "softshrink": nn.Softshrink, "hardshrink": nn.Hardshrink, "logsigmoid": nn.LogSigmoid,
}


@pytest.mark.parametrize("act", sorted(_UNTAGGED_BACKWARDS))
def test_activations_whose_backward_torch_does_not_tag_pointwise_chunk_exactly(act):
    """Their backward ops (hardswish_backward...) have no ``pointwise`` tag: each needs a batch rule (a
    chunked step with Hardswish raised UnsupportedOpError)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), _UNTAGGED_BACKWARDS[act](), nn.Linear(16, 5)).double()
    x, y = torch.randn(BATCH, 8, dtype=torch.float64), torch.randint(0, 5, (BATCH,))
    check(model, lambda m: _step(m, LOSSES["mean_ce"]), (x, y))


def _mlp():
    """The seed MLP. Chunking holds a partial gradient besides the accumulator, so at small batches its
    parameters outweigh what chunking saves; its batches are ten times larger than the other models'."""
    model, make = models.seed_mlp()
    return model, lambda b: make(10 * b)


def test_gpt2_with_padded_labels():
    model, make = models.gpt2()
    ids, labels = make(BATCH)
    assert (labels == -100).any()
    check(model, models.gpt2_step, (ids, labels), (torch.ops.aten.native_layer_norm,))


def test_returns_per_example_logits_besides_the_loss():
    model, make = _mlp()
    x, y = make(BATCH)

    def step_of(m):
        def step(x, y):
            logits = m(x)
            loss = F.cross_entropy(logits, y)
            loss.backward()
            return loss, logits

        return step

    check(model, step_of, (x, y), out_index=0)


def test_mha_sequence_first_attention():
    model, make = models.mha()
    x, y = make(BATCH)
    check(model, lambda m: _step(m, LOSSES["mean_ce"]), (x, y), (torch.ops.aten.addmm,))


def test_batchnorm_training_raises_coupling_error_naming_the_line():
    model, make = models.cnn(norm="batch")
    x, y = make(BATCH)
    staged = stagetorch.jit(_step(model, LOSSES["mean_ce"]))
    # (Below every schedule: from a third of the peak, the step runs in passes over chunks: test_batchnorm_cut.)
    staged.memory_budget = staged.plan(x, y).full_batch_peak_bytes // 100
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(stagetorch.BatchCouplingError, match=r"native_batch_norm at support/models.py:\d+ \(model.norm\).*BatchNorm in training mode"):
        staged(x, y)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in model.parameters())


def test_batchnorm_eval_mode_chunks_exactly():
    model, make = models.cnn(norm="batch")
    model.eval()
    x, y = make(BATCH)
    check(model, lambda m: _step(m, LOSSES["mean_ce"]), (x, y), (torch.ops.aten.convolution,))


def test_a_gradient_that_reads_the_loss_value_uses_a_prepass():
    # d(loss**2) = 2 * loss * d(loss): every chunk's backward needs the whole batch's loss.
    model, make = _mlp()
    x, y = make(BATCH)
    check(model, lambda m: _step(m, lambda out, y, m: F.cross_entropy(out, y) ** 2), (x, y))


def test_examples_weighted_by_a_batch_sum_use_a_prepass():
    model, make = _mlp()
    x, y = make(BATCH)

    def loss(out, y, m):
        w = out.detach().abs().sum(1)
        return (F.cross_entropy(out, y, reduction="none") * (w / w.sum())).sum()

    check(model, lambda m: _step(m, loss), (x, y))


def test_a_batch_sum_read_twice_by_its_own_gradient_is_summed_once():
    # d(s * s) = s * ds + s * ds, s a sum over the batch: the pre-pass reads s in two equations, and summed
    # its chunks' partials once for each (the gradient was 2x too large wherever s met itself).
    model, make = _mlp()
    x, y = make(BATCH)

    def loss(out, y, m):
        s = out.sum(0)
        return (s * s).sum() / BATCH**2 + F.cross_entropy(out, y)

    check(model, lambda m: _step(m, loss), (x, y))


def test_a_spatial_loss_with_reduction_none_summed():
    # nll_loss2d with reduction="none": its backward's incoming gradient is a shared expand of the full
    # batch, cut to each chunk.
    model, make = _mlp()
    x, y = make(BATCH)

    def step_of(m):
        def step(x, y):
            loss = F.cross_entropy(m(x).unsqueeze(-1), y.unsqueeze(-1), reduction="none").sum() / x.shape[0]
            loss.backward()
            return loss

        return step

    check(model, step_of, (x, y))


def test_normalising_by_batch_statistics_raises():
    model, make = _mlp()
    x, y = make(BATCH)

    def step(x, y):
        h = model[0](x)
        h = h - h.mean(0)
        h = h / (h * h).mean(0).add(1e-5).sqrt()
        loss = F.cross_entropy(model[2](model[1](h)), y)
        loss.backward()
        return loss

    staged = stagetorch.jit(step)
    staged.memory_budget = staged.plan(x, y).full_batch_peak_bytes // 2
    with pytest.raises(stagetorch.BatchCouplingError, match="depends on another batch-wide value"):
        staged(x, y)


def test_fits_whole_batch_without_chunking():
    model, make = models.seed_mlp()
    x, y = make(64)
    staged = stagetorch.jit(_step(model, LOSSES["mean_ce"]), memory_budget="1GiB")
    plan = staged.plan(x, y)
    assert plan.chunk_sizes == (64,) and "fits" in str(plan)


def test_not_even_one_example_fits():
    model, make = models.seed_mlp()
    x, y = make(64)
    staged = stagetorch.jit(_step(model, LOSSES["mean_ce"]), memory_budget=1000)
    with pytest.raises(stagetorch.OutOfMemoryError, match="not even one example fits") as error:
        staged(x, y)
    assert all(p.grad is None for p in model.parameters())
    # The bytes are attributed to what holds them; the parameters' share is exact.
    params = sum(p.nbytes for p in model.parameters())
    text = str(error.value)
    for holder in ("parameters and buffers", "inputs", "gradient and other accumulators", "partial gradients",
                   "activations"):
        assert holder in text, holder
    assert f"parameters and buffers {stagetorch.devices.budget.format_bytes(params)}" in text, text


def test_plan_prefers_multiples_of_eight_and_no_tiny_last_chunk():
    from stagetorch.interpreters.chunked import even_chunks as _sizes

    assert _sizes(100, 45) == [40, 40, 20]
    assert _sizes(100, 30) == [25, 25, 25, 25]
    assert _sizes(1000, 300) == [256, 256, 256, 232]


# -- out of memory at run time, and failures ---------------------------------------------------------------

_LIMIT = {"examples": 10**9, "error": None}


def _guard(x: torch.Tensor) -> None:
    """Fail like the device would, for chunks above a limit."""
    if x.shape[0] > _LIMIT["examples"]:
        raise (_LIMIT["error"] or torch.OutOfMemoryError)(f"simulated: {x.shape[0]} examples")


identity_op("guard", _guard)


def _guarded_step(model):
    def step(x, y):
        loss = F.cross_entropy(model[2:](torch.ops.stagetorch_test.guard(model[:2](x))), y)
        loss.backward()
        return loss

    return step


def test_runtime_oom_halves_the_chunk_and_stays_exact():
    model, make = _mlp()
    x, y = make(BATCH)
    reference = copy.deepcopy(model)
    expected = _guarded_step(reference)(x, y)
    staged = stagetorch.jit(_guarded_step(model))
    budget_for(staged, x, y)
    planned = staged.plan(x, y).chunk_sizes
    limit = max(planned) // 2 + 1
    _LIMIT.update(examples=limit, error=None)
    try:
        with KernelBatchSizes((torch.ops.stagetorch_test.guard,)) as seen:
            loss = staged(x, y)
    finally:
        _LIMIT.update(examples=10**9)
    assert any(n > limit for n in seen.sizes), "the injected OOM never fired"
    assert sum(n for n in seen.sizes if n <= limit) == len(x), (seen.sizes, planned)
    assert rel(loss, expected.detach()) < 1e-5
    for p, q in zip(model.parameters(), reference.parameters()):
        assert rel(p.grad, q.grad) < 1e-5


def test_a_failed_step_leaves_grads_and_buffers_untouched():
    model, make = _mlp()
    x, y = make(BATCH)
    staged = stagetorch.jit(_guarded_step(model))
    staged(x, y)  # .grad now holds one step's gradients
    grads = [p.grad.clone() for p in model.parameters()]
    budget_for(staged, x, y)
    _LIMIT.update(examples=max(staged.plan(x, y).chunk_sizes) - 1, error=RuntimeError)
    try:
        with pytest.raises(RuntimeError, match="simulated"):
            staged(x, y)
    finally:
        _LIMIT.update(examples=10**9, error=None)
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g)


# -- an out-of-memory error the plan did not foresee, on every path ---------------------------------------------


class HungryMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(20, 32), nn.ReLU())
        self.head = nn.Linear(32, 5)

    def forward(self, x):
        return self.head(torch.ops.stagetorch_test.scratch_hungry(self.inner(x)))


@pytest.fixture
def device_limit():
    def limit(rows):
        _DEVICE.update(limit=rows, raised=0)
        return _DEVICE

    yield limit
    _DEVICE.update(limit=10**9, raised=0)


def _oom_warnings(caplog):
    return [r for r in caplog.records if r.levelname == "WARNING" and "out of memory" in r.getMessage()]


@pytest.mark.parametrize("budget", [None, "chunked"])
def test_an_unforeseen_oom_is_survived_exactly_and_remembered(budget, device_limit, caplog):
    """Three SGD steps with Python values that change between steps, against the same eager loop; the
    device holds fewer rows than the plan thinks (the whole batch, or a planned chunk)."""
    torch.manual_seed(0)
    model = HungryMLP()
    reference = copy.deepcopy(model)
    batches = [(torch.randn(96, 20), torch.randint(0, 5, (96,))) for _ in range(3)]

    def step_of(m):
        def step(x, y, scale):
            loss = F.cross_entropy(m(x), y) * scale
            loss.backward()
            return loss

        return step

    staged = stagetorch.jit(step_of(model), static_argnums=(2,))
    if budget == "chunked":
        budget_for(staged, *batches[0], 1.0)
    planned = max(staged.plan(*batches[0], 1.0).chunk_sizes)
    state = device_limit(planned // 2 - 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    with caplog.at_level("WARNING", logger="stagetorch"):
        for k, (x, y) in enumerate(batches):
            optimizer.zero_grad()
            loss = staged(x, y, 1.0 + k)
            raised_by_step = state["raised"]
            state["limit"] = 10**9
            ref_optimizer.zero_grad()
            expected = step_of(reference)(x, y, 1.0 + k)
            state["limit"] = planned // 2 - 3
            assert rel(loss.detach(), expected.detach()) < 1e-5, k
            for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                assert rel(p.grad, q.grad) < 1e-5, (k, name)
            optimizer.step()
            ref_optimizer.step()
            if k == 0:
                assert raised_by_step >= 1, "the injected OOM never fired"
            state["raised"] = 0
    assert raised_by_step == 0  # later steps planned with the chunk size that ran
    assert max(staged.plan(*batches[0], 1.0).chunk_sizes) <= planned // 2 - 3
    assert len(_oom_warnings(caplog)) <= 2 and any("later calls" in r.getMessage() for r in _oom_warnings(caplog))
    for p, q in zip(model.parameters(), reference.parameters()):
        assert rel(p.detach(), q.detach()) < 1e-5


def test_an_oom_in_a_forward_only_step_under_no_grad(device_limit):
    torch.manual_seed(0)
    model = HungryMLP()
    x = torch.randn(64, 20)
    with torch.no_grad():
        expected = model(x)
        staged = stagetorch.jit(model)
        state = device_limit(20)
        got = staged(x)
    assert state["raised"] >= 1
    assert rel(got, expected) < 1e-6 and got.shape == expected.shape


def test_an_oom_in_lazy_mode(device_limit):
    torch.manual_seed(0)
    model = HungryMLP()
    reference = copy.deepcopy(model)
    x, y = torch.randn(64, 20), torch.randint(0, 5, (64,))
    expected = F.cross_entropy(reference(x), y)
    expected.backward()
    state = device_limit(20)
    lx, ly = stagetorch.lazy(x, y, batch=0)
    loss = F.cross_entropy(model(lx), ly)
    loss.backward()
    assert abs(loss.item() - expected.item()) < 1e-5 and state["raised"] >= 1
    for p, q in zip(model.parameters(), reference.parameters()):
        assert rel(p.grad, q.grad) < 1e-5


def test_an_oom_that_cannot_be_chunked_leaves_state_untouched(device_limit):
    """BatchNorm in training couples the batch: without recomputation (which chunked passes need) the
    whole-batch OOM is raised, with buffers and .grad as before."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32))

    def step(x):
        loss = torch.ops.stagetorch_test.scratch_hungry(model(x)).sum()
        loss.backward()
        return loss

    x = torch.randn(64, 20)
    staged = stagetorch.jit(step, remat=False)
    staged(x)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in model.parameters()]
    device_limit(20)
    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        staged(x)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g)


# -- bad input -----------------------------------------------------------------------------------------------


def test_bad_batch_inputs_get_clear_errors():
    model, make = models.seed_mlp()
    x, y = make(8)
    step = stagetorch.jit(_step(model, LOSSES["mean_ce"]))
    with pytest.raises(stagetorch.ShapeError, match=r"disagree on the batch size \(x: 8, y: 7\)"):
        step(x, y[:7])
    with pytest.raises(stagetorch.ShapeError, match="batch is empty"):
        step(x[:0], y[:0])
    with pytest.raises(stagetorch.ShapeError, match=r"batch_dim=2 is out of range for argument x"):
        stagetorch.jit(_step(model, LOSSES["mean_ce"]), batch_dim=2)(x, y)
    with pytest.raises(TypeError, match="batch_argnums names argument 1"):
        stagetorch.jit(lambda x, n: model(x).sum() * n, batch_argnums=(1,))(x, 3)
    with pytest.raises(ValueError, match="not a size"):
        stagetorch.jit(_step(model, LOSSES["mean_ce"]), memory_budget="lots")(x, y)
    assert all(p.grad is None for p in model.parameters())


def test_memory_budget_strings():
    from stagetorch.devices.budget import parse_bytes

    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes(4096) == 4096


def test_a_chunked_step_logs_its_plan_and_can_show_progress(caplog, capsys):
    model, make = _mlp()
    x, y = make(BATCH)
    staged = stagetorch.jit(_step(model, LOSSES["mean_ce"]), progress=True)
    budget_for(staged, x, y)
    with caplog.at_level("INFO", logger="stagetorch"):
        staged(x, y)
    assert any(re.search(r": batch 1000 in \d+ chunks \[", r.getMessage()) for r in caplog.records)
    assert f"{len(x)}/{len(x)}" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["cnn", "transformer", "lstm"])
def test_chunked_inference_equals_full_batch(arch):
    model, make = models.CLASSIFIERS[arch]()
    model.eval()
    x, _ = make(BATCH)
    with torch.no_grad():
        expected = model(x)

    def predict(x):
        with torch.no_grad():
            return model(x).softmax(-1)

    staged = stagetorch.jit(predict)
    budget_for(staged, x)
    got = staged(x)
    assert got.shape == expected.shape
    assert rel(got, expected.softmax(-1)) < 1e-5


def test_small_changes_in_free_memory_do_not_replan(monkeypatch):
    import stagetorch.planning.planner as planner

    costed = []
    real = planner.peak_bytes
    monkeypatch.setattr(planner, "peak_bytes", lambda g: costed.append(1) or real(g))
    model, make = models.seed_mlp()
    x, y = make(64)
    staged = stagetorch.jit(_step(model, LOSSES["mean_ce"]))
    for budget in (2**30, 2**30 + 4096, 2**30 - 12345, 3 * 2**30):
        staged.memory_budget = budget
        staged(x, y)
    assert len(costed) == 1  # the whole graph, once; every budget fits, so no chunked planning


def _made_in_every_chunk(kind: str, batch: int, classes: int):
    """A value no example owns, made in the body from an argument's metadata (``x.new_ones``), then read by
    equations with no per-example input (issue 43: the shared phase read it before any chunk made it, and the
    planner looped or raised ``KeyError``)."""

    def step_of(model: nn.Module):
        def step(x, y):
            logits = model(x)
            w = x.new_ones(batch, classes) * 2
            if kind == "cumsum_summed":
                w = w.cumsum(0).sum()
            elif kind == "cumsum":
                w = w.cumsum(0)
            elif kind == "cumsum_rows":
                w = w.cumsum(1)
            loss = (w * logits).pow(2).mean() + F.cross_entropy(logits, y)
            loss.backward()
            return loss

        return step

    return step_of


@pytest.mark.parametrize("kind", ["cumsum_summed", "scaled", "cumsum_rows", "cumsum"])
def test_a_value_every_chunk_makes_again_runs_in_the_body_or_is_refused_by_name(kind):
    """Read as a whole-batch scalar, or as rows paired with the examples (the factory it is computed from is
    then made per chunk at the chunk's size: issue 43's needless refusal of ``x.new_ones(B, C) * 2``), such a
    value runs in exact chunks (three SGD steps against eager). A cumsum along the batch of it (each row's
    value its position in the whole batch) runs exactly or is refused by name, leaving the model as it was."""
    batch, classes = 23, 5
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, classes)).double()
    x = torch.randn(batch, 8, dtype=torch.float64)
    y = torch.randint(0, classes, (batch,))
    eager, staged_model = copy.deepcopy(base), copy.deepcopy(base)
    step_of = _made_in_every_chunk(kind, batch, classes)
    staged = stagetorch.jit(step_of(staged_model), remat=False)
    try:
        budget_for(staged, x, y, chunks=3)
    except stagetorch.BatchCouplingError as e:
        assert kind == "cumsum", str(e)
        assert re.search(r"(?s)at interpreters/test_chunking.py:\d+ .*What to do", str(e)), str(e)
        assert all(p.grad is None for p in staged_model.parameters())
        return
    assert len(staged.plan(x, y).chunk_sizes) >= 3
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (eager, staged_model)]
    for _ in range(3):
        for opt in opts:
            opt.zero_grad()
        e_loss = step_of(eager)(x, y)
        loss = staged(x, y)
        torch.testing.assert_close(loss, e_loss, rtol=1e-12, atol=1e-12)
        for p, q in zip(staged_model.parameters(), eager.parameters()):
            assert rel(p.grad, q.grad) < 1e-9
        for opt in opts:
            opt.step()

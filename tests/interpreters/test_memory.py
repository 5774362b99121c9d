"""Memory estimates against the allocator's peak of the same step really executed (tests/support/memtrack.py)."""

from __future__ import annotations

import copy
import statistics

import models
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from memtrack import PATHS, AllocatorPeak, known_to_the_profiler, measure, measured_peak, smallest_plan_peak

import stagetorch
from stagetorch.devices.budget import bytes_ceiling, format_bytes, parse_bytes
from stagetorch.errors import OutOfMemoryError
from stagetorch.interpreters.memory import MemoryEffect, peak_bytes
from stagetorch.ops.reductions import partials_bytes

MODELS = {**models.CLASSIFIERS, "gpt2": models.gpt2}


def _step(name):
    return models.gpt2_step if name == "gpt2" else models.train_step


@pytest.fixture(scope="module")
def errors():
    """Estimate vs measured peaks for every model: (staged step executed, eager step)."""
    out = {}
    for name, factory in MODELS.items():
        torch.manual_seed(0)
        model, make = factory()
        x, y = make(64)
        estimate = stagetorch.memory(_step(name)(model))(x, y).peak_bytes
        staged = stagetorch.jit(_step(name)(model))
        staged.plan(x, y)  # stage outside the tracker
        with AllocatorPeak([*model.parameters(), *model.buffers(), x, y]) as run:
            staged(x, y)
        reference = copy.deepcopy(model)
        eager = measured_peak(_step(name)(reference), reference, x, y)
        out[name] = ((estimate - run.peak) / run.peak, (estimate - eager) / eager)
    return out


def test_estimate_matches_the_staged_step_really_executed(errors):
    rel = [abs(staged) for staged, _ in errors.values()]
    assert statistics.median(rel) <= 0.05 and max(rel) <= 0.10, errors


def test_estimate_matches_the_eager_step(errors):
    # Eager Python holds some tensors in locals past their last use; the estimate is of stagetorch's schedule,
    # which never holds more than eager's and may hold less: it adds each gradient contribution into a dying
    # one in place wherever it can, where autograd's engine does not always (MHA's packed q/k/v: -16%).
    rel = [eager for _, eager in errors.values()]
    assert statistics.median(map(abs, rel)) <= 0.05 and min(rel) >= -0.20 and max(rel) <= 0.02, errors


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer", "lstm", "gpt2"])
def test_fixed_plus_per_example_predicts_other_batches(name):
    torch.manual_seed(0)
    model, make = MODELS[name]()
    report = stagetorch.memory(_step(name)(model))(*make(64))
    # oneDNN pads the LSTM workspace at small batches: stagetorch must notice and say so.
    assert report.linear == (name != "lstm") and report.per_example_bytes > 0, report.note
    for b in (24, 96):
        x, y = make(b)
        staged = stagetorch.jit(_step(name)(model))
        staged.plan(x, y)
        with AllocatorPeak([*model.parameters(), *model.buffers(), x, y]) as run:
            staged(x, y)
        model.zero_grad(set_to_none=True)
        assert abs(report.predict(b) - run.peak) / run.peak <= _TOLERANCE.get(name, 0.02), (b, report.predict(b), run.peak)


@pytest.mark.parametrize("name", list(MODELS))
def test_a_report_at_any_batch_predicts_every_batch_up_to_four_times_it(name):
    """Batch 1-3 is where long-sequence fine-tuning lives: a report made there must know the per-example
    part (costed at larger batches) and predict the peak the step is planned with at other batches."""
    torch.manual_seed(0)
    model, make = MODELS[name]()
    step = _step(name)(model)
    estimate = {}
    for batch in (1, 3, 16):
        report = stagetorch.memory(step)(*make(batch))
        assert report.per_example_bytes > 0 and report.predict(batch) == report.peak_bytes, report
        for b in range(1, 4 * batch + 1) if batch < 16 else (1, 7, 24, 64):
            if b not in estimate:
                estimate[b] = stagetorch.jit(step).plan(*make(b)).full_batch_peak_bytes
            assert abs(report.predict(b) - estimate[b]) <= 0.02 * estimate[b], (batch, b, report.predict(b), estimate[b])


# oneDNN's LSTM scratchpad is a fit (stagetorch/ops/recurrent.py), not its formula: it is page-rounded and
# grows unevenly with the batch, and the fit over-estimates small chunks' backward by up to 5%.
# Every model on every path within 2%, but the LSTM without grad: oneDNN's inference kernels (brgemm: blocked
# weights and a scratchpad that depend on the ISA and the threads) are still a fit there, +3.6% at 4 examples
# per chunk. (Training, where oneDNN's reference kernel runs, is its arithmetic: exact.)
_TOLERANCE: dict[tuple[str, str], float] = {("lstm", "no_grad"): 0.05}


# -- measured = predicted, on every path --------------------------------------------------------------------

def test_a_first_lazy_call_is_planned_as_it_runs():
    """The first lazy call of a step (no program made yet in the process) records it, and takes each draw's
    numbers at its call on stand-ins of the whole batch. The MHA model's attention kernel, tagged random for
    a dropout_p of 0, was such a draw: q, k, v and the output of all 16 examples at once, 7% over the
    flush's plan (session 16's bug). A kernel whose dropout_p is 0 takes no number and is no draw."""
    stagetorch.clear_caches()
    predicted, measured, _, _ = measure("mha", "lazy_chunked", warm=False)
    assert abs(measured - predicted) <= 0.02 * predicted, (predicted, measured)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", list(MODELS))
def test_measured_peak_is_the_predicted_peak_under_the_budget(name, path):
    predicted, measured, budget, chunks = measure(name, path)
    if path not in ("remat", "lazy_remat"):  # recomputation may fit the budget without chunks
        assert (chunks > 1) == (path not in ("jit", "lazy")), chunks
    assert abs(measured - predicted) <= _TOLERANCE.get((name, path), 0.02) * predicted, (predicted, measured, chunks)
    if budget is not None:
        assert measured <= budget, (measured, budget)


@pytest.mark.parametrize("path", ["lazy", "lazy_chunked", "lazy_remat"])
@pytest.mark.parametrize("name", ["transformer", "gpt2"])
def test_a_lazy_flush_is_never_planned_under_the_allocator(name, path):
    """The allocator holds, while a lazy flush runs, what its program's values alone do not say: the whole
    storage of an input that is a view (the transformer's ``pos[:, :T]``), the leaves of the real autograd
    graph an input hangs from (GPT-2's ``wpe``, looked up for real before the flush), and nothing of what
    the backward read to mark itself (the Python numbers autograd saved as 0-dim tensors: gelu's ``0.5 * x``).
    Planned under, a step can run over its budget."""
    predicted, measured, budget, _ = measure(name, path)
    assert predicted >= measured, (predicted, measured)
    assert predicted - measured <= 0.02 * predicted, (predicted, measured)
    if budget is not None:
        assert measured <= budget, (measured, budget)


def test_the_smallest_plan_needs_little_more_than_gradient_accumulation():
    """Parameters + gradients + the batch's inputs + the largest parameter is the least any chunked step
    that accumulates gradients can hold; the smallest plan stays within 10% of it."""
    torch.manual_seed(0)
    layers = [m for _ in range(8) for m in (torch.nn.Linear(512, 512), torch.nn.ReLU())]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(512, 10))
    x, y = torch.randn(4096, 512), torch.randint(0, 10, (4096,))
    staged = stagetorch.jit(models.train_step(model))
    smallest = smallest_plan_peak(staged, x, y)
    params = [p.nbytes for p in model.parameters()]
    floor = 2 * sum(params) + x.nbytes + y.nbytes + max(params)
    assert floor <= smallest <= 1.10 * floor, (smallest, floor)


def test_report_says_where_the_memory_goes(tmp_path):
    model, make = models.transformer()
    report = stagetorch.memory(models.train_step(model))(*make(32))
    text = str(report)
    assert "Peak" in text and "per example" in text and "by category" in text and "by module" in text
    assert "models.py:" in str(report.peak_source)
    assert sum(report.by_category.values()) == report.peak_bytes
    assert report.by_category["parameters"] == sum(p.numel() * 4 for p in model.parameters())
    assert any(k.startswith("model.encoder.layers.0") for k in report.by_module)
    path = report.plot(str(tmp_path / "memory.png"))
    assert (tmp_path / "memory.png").stat().st_size > 10_000 and path.endswith("memory.png")


def test_a_custom_memory_rule_changes_the_estimate():
    @torch.library.custom_op("stagetorch_test::scratchy", mutates_args=())
    def scratchy(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @scratchy.register_fake
    def _(x):
        return torch.empty_like(x)

    def fn(x):
        return torch.ops.stagetorch_test.scratchy(x).sum()

    x = torch.randn(256, 256)
    graph = stagetorch.make_ir(fn)(x)
    before = peak_bytes(graph)
    stagetorch.ops.register(torch.ops.stagetorch_test.scratchy, memory=lambda eqn: 10 * eqn.invars[0].aval.nbytes)
    # the input and the op's output, then the 4-byte sum (and its partial sums, one per thread)
    assert before == 2 * x.nbytes + 4 + partials_bytes(x.numel(), 1, 4)
    assert peak_bytes(graph) == 2 * x.nbytes + 10 * x.nbytes  # held while the op runs
    stagetorch.ops.register(torch.ops.stagetorch_test.scratchy, memory=lambda eqn: MemoryEffect(outputs={0: 3 * x.nbytes}))
    assert peak_bytes(graph) == before + 2 * x.nbytes


def test_a_program_not_affine_in_the_batch_says_so():
    def gram(x):
        return (x @ x.T).sum()  # (batch x batch): quadratic in the batch

    report = stagetorch.memory(gram)(torch.randn(64, 8))
    assert not report.linear and "not affine" in report.note and "NOT linear" in str(report)


def test_memory_rejects_bad_batches():
    model, make = models.seed_mlp()
    x, y = make(8)
    with pytest.raises(stagetorch.ShapeError, match="disagree on the batch size"):
        stagetorch.memory(models.train_step(model))(x, y[:4])
    with pytest.raises(stagetorch.ShapeError, match="out of range"):
        stagetorch.memory(models.train_step(model), batch_dim=3)(x, y)


def test_parse_bytes():
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("2GB") == 2 * 10**9
    assert parse_bytes(" 1.5 KiB ") == 1536
    for bad in ("lots", "-3MiB", "12 parsecs", True):
        with pytest.raises((ValueError, TypeError)):
            parse_bytes(bad)


def test_costing_never_touches_real_state():
    model, make = models.cnn(norm="batch")
    before = copy.deepcopy(model.state_dict())
    stagetorch.memory(models.train_step(model, F.cross_entropy))(*make(16))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    assert all(p.grad is None for p in model.parameters())


def _optimizer_step_in_jit(optimizer, remat, **options):
    """A 64-256-10 MLP (float64) whose zero_grad / backward / optimizer step is staged with ``jit``, after
    one call (which creates the optimizer's state and the .grad); with a batch of 256."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).double()
    opt = optimizer(model.parameters(), lr=0.01, **options)

    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    x, y = torch.randn(256, 64, dtype=torch.float64), torch.randint(0, 10, (256,))
    staged = stagetorch.jit(step, remat=remat)
    staged(x, y)
    return model, opt, staged, x, y


@pytest.mark.parametrize("budget", [None, 2_500_000, 2_000_000], ids=["whole", "2-chunks", "3-chunks"])
def test_an_optimizer_step_inside_jit_stays_within_its_budget_under_the_tracker(budget):
    """The call holds, beside the program, the .grad that zero_grad() inside the step replaces: the budget
    must cover it. The optimizer's update is the program's commit, so nothing is copied to restore a failed
    step (a copy of every parameter and moment, before). Before either, this step measured 22-35% over its
    plan and over a 1.3 MB budget."""
    model, opt, staged, x, y = _optimizer_step_in_jit(torch.optim.AdamW, remat=False, weight_decay=0.1)
    staged.memory_budget = budget
    plan = staged.plan(x, y)
    params = [*model.parameters()]
    held = sum(p.grad.untyped_storage().nbytes() for p in params)
    with AllocatorPeak([*params, x, y, *(p.grad for p in params), *(t for st in opt.state.values() for t in st.values())]) as run:
        staged(x, y)
    assert len(plan.chunk_sizes) == {None: 1, 2_500_000: 2, 2_000_000: 3}[budget]  # 5 with the copies
    assert abs(plan.held_bytes - held) <= 64 and abs(run.peak - plan.peak) <= 0.02 * run.peak
    if budget is not None:
        assert run.peak <= budget


@pytest.mark.parametrize("remat", ["auto", False])
def test_a_budget_the_held_bytes_push_below_the_floor_names_the_memory_budget_that_fits(remat):
    """The error's smallest budget is the program's; the call also holds the old .grad beside it, so the
    error names the memory_budget that covers both, and that one runs (under the tracker, within itself)."""
    model, opt, staged, x, y = _optimizer_step_in_jit(torch.optim.SGD, remat=remat, momentum=0.9)
    params = [*model.parameters()]
    before = [t.clone() for t in [*params, *(p.grad for p in params)]]
    staged.memory_budget = 600_000
    with pytest.raises(OutOfMemoryError, match="the smallest memory_budget this call fits in is") as info:
        staged(x, y)
    assert all(map(torch.equal, before, [*params, *(p.grad for p in params)]))  # the failed call changed nothing
    message = str(info.value)
    assert "the old .grad of 4 parameter(s)" in message and "copies of" not in message, message  # a commit: none
    smallest = info.value.smallest_budget
    assert f"fits in is {format_bytes(bytes_ceiling(smallest))}." in message
    staged.memory_budget = bytes_ceiling(smallest)
    moments = [t for st in opt.state.values() for t in st.values()]
    with AllocatorPeak([*params, x, y, *(p.grad for p in params), *moments]) as run:
        staged(x, y)
    assert run.peak <= staged.memory_budget


@pytest.mark.parametrize("budget", [None, 0.9, 0.8], ids=["whole", "0.9", "0.8"])
def test_a_second_call_that_adds_into_held_grads_is_planned_with_them(budget):
    """Gradient accumulation: the .grad of the first call is held while the second runs (the step adds into
    it after the program), so the plan counts it and the budget covers it. Before, the plan left it out
    and such a step ran past its budget."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(256, 256), nn.ReLU())], nn.Linear(256, 10))
    x, y = torch.randn(512, 256), torch.randint(0, 10, (512,))
    staged = stagetorch.jit(models.train_step(model), remat=False)
    staged(x, y)
    grads = [p.grad.clone() for p in model.parameters()]
    whole = staged.plan(x, y)
    held = sum(p.grad.nbytes for p in model.parameters())
    assert whole.held_bytes == held
    if budget is not None:
        staged.memory_budget = int(budget * whole.peak)
    plan = staged.plan(x, y)
    with AllocatorPeak([*model.parameters(), *(p.grad for p in model.parameters()), x, y]) as run:
        staged(x, y)
    assert len(plan.chunk_sizes) > 1 or budget is None
    assert abs(run.peak - plan.peak) <= 0.02 * plan.peak, (run.peak, plan.peak)
    if budget is not None:
        assert run.peak <= staged.memory_budget
    reference = copy.deepcopy(model)
    for p, g in zip(reference.parameters(), grads):
        p.grad = g.clone()
    models.train_step(reference)(x, y)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_a_report_predicts_the_small_batches_where_a_workspace_bends():
    """A oneDNN convolution's backward workspace is the larger of a fixed part (weights, per-thread buffers)
    and a per-example part: the peak bends below the batches a report's lines were checked at. The report at
    16 predicts each smaller batch as the report made there says (it was 3% under at 2)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.GroupNorm(2, 8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.GroupNorm(2, 8), nn.ReLU(),
        nn.Flatten(), nn.Linear(8 * 12 * 12, 10),
    )
    step = models.train_step(model)

    def make(b):
        return torch.randn(b, 3, 16, 16), torch.randint(0, 10, (b,))

    report = stagetorch.memory(step)(*make(16))
    for b in (1, 2, 3, 5, 12, 24, 40):
        at_b = stagetorch.memory(step)(*make(b)).peak_bytes
        assert abs(report.predict(b) - at_b) <= 0.02 * at_b, (b, report.predict(b), at_b)


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.AdamW], ids=["sgd", "adamw"])
def test_the_report_of_an_optimizer_step_inside_jit_is_what_the_call_takes(optimizer):
    """stagetorch.memory counts everything the call holds: the optimizer's state in its own category, and
    beside the program the old .grad ("held"; the update is the step's commit, so no parameter or moment is
    copied to restore a failed step). Its peak is the allocator's."""
    options = {"momentum": 0.9} if optimizer is torch.optim.SGD else {}
    model, opt, staged, x, y = _optimizer_step_in_jit(optimizer, remat=False, **options)
    report = stagetorch.memory(staged.fn, remat=False)(x, y)
    state = [t for st in opt.state.values() for t in st.values()]
    assert report.by_category["optimizer"] == sum(t.nbytes for t in state)
    grads = sum(p.grad.untyped_storage().nbytes() for p in model.parameters())
    assert report.by_category["held"] == staged.plan(x, y).held_bytes == grads and "restore" not in report.note
    assert sum(report.by_category.values()) == report.peak_bytes
    params = [*model.parameters()]
    with AllocatorPeak([*params, x, y, *(p.grad for p in params), *state]) as run:
        staged(x, y)
    assert abs(run.peak - report.peak_bytes) <= 0.02 * run.peak, (run.peak, report.peak_bytes)
    assert report.predict(256) == report.peak_bytes and report.predict(64) < report.peak_bytes


@pytest.mark.parametrize("budget", [None, 2_000_000], ids=["whole", "chunked"])
@pytest.mark.parametrize("donate", [False, True], ids=["kept", "donated"])
def test_an_optimizer_step_inside_jit_with_donated_grads_peaks_where_eager_does(donate, budget):
    """The previous step's .grad resident, ``zero_grad()`` inside the step: eager frees it there; ``jit``
    holds it beside the program by default (to restore it if the step fails: 1.07x eager's peak here), and
    with ``donate_grads=True`` frees it when the call starts. At the allocator (a free of that .grad counted)
    the donated step peaks within 2% of eager's and of its plan, whole and chunked; the default is unchanged."""
    model, opt, first, x, y = _optimizer_step_in_jit(torch.optim.AdamW, remat=False, weight_decay=0.1)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01, weight_decay=0.1)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # (load_state_dict shares the step count)
    for p, q in zip(model.parameters(), reference.parameters()):
        # The CPU profiler reports the free of a block it saw allocated only: each .grad is made under it.
        p.grad = known_to_the_profiler(torch.clone, p.grad)
        q.grad = known_to_the_profiler(torch.clone, p.grad)
    grads = sum(p.grad.untyped_storage().nbytes() for p in model.parameters())

    def eager(x, y):
        ref_opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()

    def resident(m, o):
        return [*m.parameters(), x, y, *(p.grad for p in m.parameters()), *(t for st in o.state.values() for t in st.values())]

    with AllocatorPeak(resident(reference, ref_opt), frees_resident=True) as eager_run:
        eager(x, y)
    staged = stagetorch.jit(first.fn, remat=False, memory_budget=budget, donate_grads=donate)
    plan = staged.plan(x, y)
    with AllocatorPeak(resident(model, opt), frees_resident=True) as run:
        staged(x, y)
    assert abs(run.peak - plan.peak) <= 0.02 * run.peak, (run.peak, plan.peak)
    if budget is not None:
        assert len(plan.chunk_sizes) > 1 and run.peak <= budget
    if donate:
        assert plan.donated_bytes == grads and plan.held_bytes == 0  # the update is the commit: no copies
        assert run.peak <= 1.02 * eager_run.peak, (run.peak, eager_run.peak)
    else:
        assert plan.held_bytes == grads and plan.donated_bytes == 0
        if budget is None:
            assert run.peak >= eager_run.peak + 0.9 * grads, (run.peak, eager_run.peak)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-10)


def test_the_report_of_an_accumulating_step_counts_the_held_grads():
    torch.manual_seed(0)
    model, make = models.seed_mlp()
    x, y = make(64)
    step = models.train_step(model)
    before = stagetorch.memory(step)(x, y)
    step(x, y)  # eager: the .grad the next call adds into
    after = stagetorch.memory(step)(x, y)
    grads = sum(p.grad.nbytes for p in model.parameters())
    assert after.by_category["held"] == grads and after.peak_bytes == before.peak_bytes + grads
    assert after.predict(16) == before.predict(16) + grads


_INSIDE = {
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=False),
    "adam_foreach": lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False),
}


@pytest.mark.parametrize("first", [False, True], ids=["later_step", "first_step"])
@pytest.mark.parametrize("kind", list(_INSIDE))
def test_the_report_counts_the_commits_workspace_and_the_state_a_first_step_makes(kind, first):
    """An optimizer stepped last is the program's commit: its temporaries live in one workspace allocated
    before its first write and held to the end, beside the state a first step makes
    (``stagetorch.transforms.commit.commit_plan``). The report and the plan cost that, not one tensor per equation:
    Adam's first step measured 7% over both before. The report's peak is the plan's and the allocator's, to
    the byte (the bias corrections' ``beta ** step`` wraps each beta as a 0-dim tensor: 12 B, unplanned
    before, were the foreach steps' peak), the workspace in its category, the state made in the optimizer's."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(256, 256), nn.GELU())])
    opt = _INSIDE[kind](model.parameters())

    def step(x, y):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()  # mse_loss has a kernel workspace of its own: not this test's
        loss.backward()
        opt.step()
        return loss

    x, y = torch.randn(32, 256), torch.randn(32, 256)
    staged = stagetorch.jit(step, memory_budget=1 << 40)
    if not first:
        staged(x, y)
        model.zero_grad(set_to_none=True)
    report = stagetorch.memory(step)(x, y)
    plan = staged.plan(x, y)
    executable = next(reversed(staged._cache.values())).executable
    commit = executable.program.commit
    assert commit.start is not None
    state = [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    with AllocatorPeak([*model.parameters(), x, y, *state]) as run:
        staged(x, y)
    assert report.peak_bytes == plan.peak == run.peak, (report.peak_bytes, run.peak)
    made = [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    assert report.by_category["optimizer"] == sum(t.nbytes for t in made)
    if report.peak_index > commit.start:
        assert report.by_category.get("workspace", 0) >= sum(commit.workspace.values())


def _bert_step():
    import transformer_models

    model, batch = transformer_models.model_and_batch("BERT", layers=2, tokens=64)
    ids = batch["input_ids"]

    def step(input_ids, labels):
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        return loss

    return step, lambda b: (ids.repeat(b, 1), ids.repeat(b, 1))


def _classifier_step(factory):
    def build():
        torch.manual_seed(0)
        model, make = factory()
        return models.train_step(model), make

    return build


_PREDICTED = {
    "cnn_groupnorm": (_classifier_step(lambda: models.cnn("group")), range(1, 33)),
    "cnn_batchnorm": (_classifier_step(lambda: models.cnn("batch")), range(1, 33)),
    "transformer": (_classifier_step(models.transformer), range(1, 33)),
    "lstm": (_classifier_step(models.lstm), range(1, 33)),
    "bert": (_bert_step, (1, 2, 3, 5, 7, 8, 11, 16, 23, 31, 32)),
}


@pytest.mark.parametrize("name", list(_PREDICTED))
def test_a_report_made_at_any_batch_predicts_the_report_made_at_another(name):
    """``report.predict(b)`` is within 2% of the report made at ``b``, for batches 1-32, from reports made at
    2, 8 and 16. oneDNN's LSTM workspace is page-rounded: lines through batches 2, 4 and 8 agreed, and
    the report at 8 predicted odd batches up to 7.4% under (a report made where a rule answers also
    checks an odd batch, and stages the step at the batch asked when its lines miss it)."""
    make_step, batches = _PREDICTED[name]
    step, make = make_step()
    # The first trace of an LSTM backward at a shape records the two bias gradients as one tensor, later
    # ones as two (512 B apart here; open): the truth is a later trace, as the reports' are.
    truth = {}
    for b in batches:
        if name == "lstm":
            stagetorch.jit(step).graph(*make(b))
        truth[b] = peak_bytes(stagetorch.jit(step).graph(*make(b)))
    for at in (2, 8, 16):
        report = stagetorch.memory(step)(*make(at))
        held = report.by_category.get("held", 0)  # BatchNorm's statistics, copied to restore a failed step
        assert report.predict(at) == report.peak_bytes == truth[at] + held
        errors = {b: (report.predict(b) - t - held) / (t + held) for b, t in truth.items()}
        assert all(abs(e) <= 0.02 for e in errors.values()), (at, {b: f"{e:+.2%}" for b, e in errors.items() if abs(e) > 0.02})


# The losses and reductions the test models end with, after a 3 x (Linear(256) + GELU) model.
_LOSS_STEPS = {
    "mse": lambda o, y: F.mse_loss(o, y),
    "mse_sum": lambda o, y: F.mse_loss(o, y, reduction="sum"),
    "smooth_l1": lambda o, y: F.smooth_l1_loss(o, y),
    "huber": lambda o, y: F.huber_loss(o, y),
    "bce": lambda o, y: F.binary_cross_entropy(o.sigmoid(), y.sigmoid()),
    "bce_logits": lambda o, y: F.binary_cross_entropy_with_logits(o, y.sigmoid()),
    "soft_margin": lambda o, y: F.soft_margin_loss(o, y.sign()),
    "kl_div": lambda o, y: F.kl_div(o.log_softmax(-1), y.softmax(-1), reduction="batchmean"),
    "cross_entropy": lambda o, y: F.cross_entropy(o, y.argmax(-1)),
    "cross_entropy_sum": lambda o, y: F.cross_entropy(o, y.argmax(-1), reduction="sum"),
    "sum": lambda o, y: ((o - y) ** 2).sum(),
}


@pytest.mark.parametrize("budget", [None, 0.6], ids=["whole", "chunked"])
@pytest.mark.parametrize("loss", list(_LOSS_STEPS))
def test_a_step_ending_in_a_loss_is_at_its_plan(loss, budget):
    """Plan = allocator, whole and in chunks, within the Python numbers kernels wrap as 0-dim tensors (16 B).
    Before the loss rules, F.mse_loss and smooth_l1_loss measured 8.7% over their plan at 512 x 256 (the
    loss's 0-dim result keeps the storage of the unreduced loss, through the backward), soft_margin_loss 20.7%,
    binary_cross_entropy (with logits too) 8.0%; mse_loss(reduction="sum") in chunks 1.8% (the first chunk's
    loss, handed over as the accumulator, kept its storage)."""
    plan, peak = loss_step_at_the_allocator(loss, budget)
    assert (len(plan.chunk_sizes) > 1) == (budget is not None)
    assert peak - 16 <= plan.peak <= peak * 1.02, (plan.peak, peak)


@pytest.mark.parametrize("loss", ["cross_entropy", "cross_entropy_sum"])
def test_a_chunked_step_holds_the_batch_wide_total_weight_its_plan_counts(loss):
    """A count-normalised loss in chunks: a pre-pass sums the targets' total weight over the chunks (for
    ``sum`` too: the backward reads it), a 0-dim value the run holds through every chunk and the post phase.
    The plan counts it: plan = allocator to the byte (it was 4 B under)."""
    plan, peak = loss_step_at_the_allocator(loss, 0.6)
    assert len(plan.chunk_sizes) > 1
    assert plan.peak == peak, (plan.peak, peak)


def loss_step_at_the_allocator(loss: str, fraction: float | None) -> tuple:
    """A 3 x (Linear(256) + GELU) step at 512 x 256 ending in ``_LOSS_STEPS[loss]``, staged whole or at
    ``fraction`` of its peak (chunked): its plan, and the allocator's peak of its second call (from ``.grad``
    cleared). ``tools/probes/loss_plan_check.py`` prints it over losses and threads."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(256, 256), nn.GELU())])

    def step(x, y):
        out = _LOSS_STEPS[loss](model(x), y)
        out.backward()
        return out

    x, y = torch.randn(512, 256), torch.randn(512, 256)
    budget = None
    if fraction is not None:
        budget = int(fraction * stagetorch.jit(step, memory_budget=1 << 40).plan(x, y).peak)
    staged = stagetorch.jit(step, memory_budget=budget or 1 << 40, remat=False)
    plan = staged.plan(x, y)
    staged(x, y)
    model.zero_grad(set_to_none=True)
    with AllocatorPeak([*model.parameters(), x, y]) as run:
        staged(x, y)
    return plan, run.peak


class _MatmulBoth(torch.autograd.Function):
    """``x @ (a + b)``, whose backward returns one tensor as both ``a``'s and ``b``'s gradient."""

    @staticmethod
    def forward(ctx, x, a, b):
        ctx.save_for_backward(x, a, b)
        return x @ (a + b)

    @staticmethod
    def backward(ctx, g):
        x, a, b = ctx.saved_tensors
        gw = x.t() @ g
        return g @ (a + b).t(), gw, gw


@pytest.mark.parametrize("held", [False, True], ids=["fresh", "accumulating"])
def test_one_gradient_for_two_parameters_is_copied_inside_the_plan(held):
    """Each ``.grad`` is a tensor of its own, as autograd's AccumulateGrad makes them: the copy of the second is
    the program's last equation (made when installing the gradients, it was 33% above the plan here)."""
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(256, 256)), nn.Parameter(torch.randn(256, 256))

    def step(x):
        loss = _MatmulBoth.apply(x, a, b).sum()
        loss.backward()
        return loss

    x = torch.randn(2, 256)
    step(x)
    expected = a.grad.clone()
    a.grad = b.grad = None
    staged = stagetorch.jit(step, memory_budget=1 << 40)
    staged(x)
    if not held:
        a.grad = b.grad = None
    plan = staged.plan(x)
    with AllocatorPeak([a, b, x, *([a.grad, b.grad] if held else [])]) as run:
        staged(x)
    assert a.grad.data_ptr() != b.grad.data_ptr()
    assert torch.allclose(a.grad, expected * (2 if held else 1)) and torch.equal(a.grad, b.grad)
    assert run.peak <= plan.peak <= run.peak * 1.02, (plan.peak, run.peak)

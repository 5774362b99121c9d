"""An out-of-memory error the plan did not foresee converges (issue 36): the step is redone one plan smaller at
a time (the next chunking with one chunk more: 3 -> 2 -> 1, then recomputation), never in a halving that
overshoots; what ran is remembered per program, across ``jit`` calls and across one-line steps; a step ends
in the device's error only where no smaller plan is left; and the gradients after a recovery are eager's.

The device is an identity op (tests/support/injected.py) that raises ``torch.OutOfMemoryError`` for chunks above a
chosen number of examples."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from injected import identity_op

import stagetorch
from stagetorch.planning.remat_search import RematPlan
from stagetorch.runtime.executable import Executable

BATCH = 24
STEPS = 5
_DEVICE = {"above": None, "failures": 0, "sizes": [], "failed_input": None, "held": []}


def _device(x: torch.Tensor) -> None:
    """Run out of memory on more than ``_DEVICE["above"]`` examples, as a device would; keep a weak reference
    to the input of the chunk that failed (the failed attempt's activation), and say at each later call
    whether it is still alive (``held``)."""
    failed = _DEVICE["failed_input"]
    if failed is not None:
        _DEVICE["held"].append(failed() is not None)
    if _DEVICE["above"] is None:
        return
    _DEVICE["sizes"].append(x.shape[0])
    if x.shape[0] > _DEVICE["above"]:
        _DEVICE["failures"] += 1
        _DEVICE["failed_input"] = weakref.ref(x)
        raise torch.OutOfMemoryError(f"injected: CUDA out of memory at {x.shape[0]} examples")


identity_op("oom_above", _device)


@pytest.fixture(autouse=True)
def _fresh():
    stagetorch.clear_caches()  # what programs learned is kept per program: each test starts from nothing
    yield
    _DEVICE.update(above=None, failures=0, sizes=[], failed_input=None, held=[])


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model[2:](torch.ops.stagetorch_test.oom_above(model[:2](x))), y)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 12, generator=g), torch.randint(0, 4, (BATCH,), generator=g)) for _ in range(STEPS)]


def _budget_for(chunk: int, model: nn.Module) -> int:
    """The largest budget (in 2% steps) whose plan runs chunks of at most ``chunk`` examples."""
    staged = stagetorch.jit(lambda x, y: _loss(model, x, y).backward(), remat=False)
    x, y = _batches()[0]
    budget = staged.plan(x, y).full_batch_peak_bytes * 2
    while budget > 1024:
        staged.memory_budget = budget
        if max(staged.plan(x, y).chunk_sizes) <= chunk:
            return budget
        budget = int(budget * 0.98)
    raise AssertionError(f"no budget gives chunks of {chunk}")


def _train(front: str, model: nn.Module, budget: int | None, above: int | None) -> list[int]:
    """Five SGD steps of ``front`` (``"jit"`` or ``"lazy"``) on a device that runs out of memory above
    ``above`` examples, against eager's: **returns** the failed attempts of each step."""
    reference = copy.deepcopy(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    staged = stagetorch.jit(lambda x, y: _loss(model, x, y).backward(), memory_budget=budget, remat=False)
    failures = []
    for k, (x, y) in enumerate(_batches()):
        opt.zero_grad()
        _DEVICE.update(above=above, failures=0)
        if front == "jit":
            staged(x, y)
        else:
            lx, ly = stagetorch.lazy(x, y, memory_budget=budget, remat=False)
            _loss(model, lx, ly).backward()
        failures.append(_DEVICE["failures"])
        _DEVICE["above"] = None
        ref_opt.zero_grad()
        _loss(reference, x, y).backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m, k=k, n=name: f"step {k} {n}: {m}")
        opt.step()
        ref_opt.step()
    return failures


def _runs_out_once(front: str, planned: int, caplog) -> None:
    """The plan's chunk (the whole batch, or chunks of 3) runs out of memory, the next smaller one does not:
    one failed attempt in the first step, none in the four after; the steps ran one chunking smaller, not
    half (chunks of 1 where 2 would do, on the GPU)."""
    model = _model()
    budget = None if planned == BATCH else _budget_for(planned, model)
    smaller = {BATCH: 12, 3: 2}[planned]  # one chunk more: 24 -> 2 chunks of 12; 8 chunks of 3 -> 12 of 2
    with caplog.at_level("WARNING", logger="stagetorch"):
        failures = _train(front, model, budget, smaller)
    assert failures == [1, 0, 0, 0, 0]
    assert max(_DEVICE["sizes"][-BATCH // smaller:]) == smaller  # the last step ran at that chunk, not less
    warned = [r.getMessage() for r in caplog.records if "out of memory" in r.getMessage()]
    assert len(warned) == 1 and "1 time(s)" in warned[0] and "later calls will too" in warned[0], warned


@pytest.mark.parametrize("planned", [BATCH, 3], ids=["whole", "chunks_of_3"])
def test_a_jit_step_that_runs_out_once_learns_and_never_again(planned, caplog):
    _runs_out_once("jit", planned, caplog)


@pytest.mark.parametrize("planned", [BATCH, 3], ids=["whole", "chunks_of_3"])
def test_a_lazy_step_that_runs_out_once_learns_and_never_again(planned, lazy_mode, caplog):
    """As for jit, in every lazy mode: the lesson outlives the first step's recording."""
    _runs_out_once("lazy", planned, caplog)


@pytest.mark.parametrize("front", ["jit", "lazy"])
def test_a_far_smaller_device_converges_in_the_first_step(front):
    """Chunks of 2 at most where the plan says the whole batch: the first step tries one chunking smaller at
    a time (24, 12, 8, 6, 5, 4, 3: each fails) and runs at 2; the steps after never fail."""
    failures = _train(front, _model(), None, 2)
    assert failures == [7, 0, 0, 0, 0]


def test_the_failed_attempts_tensors_are_freed_before_the_next_attempt():
    """The error of a failed attempt holds its frames, and so its activations: the retry runs without them,
    with no garbage collection needed (on the GPU the recovery ran out of memory at every smaller chunk while
    they were kept, then raised the device's error)."""
    model = _model()
    staged = stagetorch.jit(lambda x, y: _loss(model, x, y).backward())
    x, y = _batches()[0]
    _DEVICE["above"] = 12
    gc.disable()
    try:
        staged(x, y)
    finally:
        gc.enable()
    assert _DEVICE["failures"] == 1
    assert _DEVICE["held"] == [False, False], "the failed attempt's activation was alive during the retry"


def test_the_ladder_ends_in_recomputation_then_the_devices_error(monkeypatch):
    """A device where nothing runs: chunks 24 -> 12 -> ... -> 2 -> 1, then recomputing plans below the failed
    peak, then the device's own error (no smaller plan is left); the planner forgets what this call tried,
    and the parameters' .grad is as before."""
    model = _model()
    staged = stagetorch.jit(lambda x, y: _loss(model, x, y).backward())
    x, y = _batches()[0]
    staged(x, y)
    grads = [p.grad.clone() for p in model.parameters()]
    tried = []
    attempt = Executable._attempt

    def spy(self, inputs, plan, on_chunk, name):
        if self.graph is staged.graph(x, y):  # (the outer call: a recomputing plan runs an inner executable)
            tried.append(plan)
        return attempt(self, inputs, plan, on_chunk, name)

    monkeypatch.setattr(Executable, "_attempt", spy)
    _DEVICE["above"] = 0
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        staged(x, y)
    largest = [max(p.chunk_sizes) for p in tried]
    chunked = [n for p, n in zip(tried, largest) if not (isinstance(p, RematPlan) and p.recompute is not None)]
    assert chunked == [24, 12, 8, 6, 5, 4, 3, 2, 1], largest
    assert len(tried) > len(chunked), "no recomputing plan was tried after chunks of one"
    assert all(isinstance(p, RematPlan) and p.recompute is not None for p in tried[len(chunked):])
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g)
    assert not staged.plan(x, y).chunked  # nothing ran: nothing was learned


def test_a_lesson_outlives_the_staged_function():
    """What a program learned is the program's: a new ``jit`` of the same step (a script run's next staging)
    plans with it from its first call, and ``stagetorch.clear_caches()`` forgets it."""
    model = _model()
    x, y = _batches()[0]
    _DEVICE["above"] = 12
    stagetorch.jit(lambda x, y: _loss(model, x, y).backward())(x, y)
    assert _DEVICE["failures"] == 1
    again = stagetorch.jit(lambda x, y: _loss(model, x, y).backward())
    assert again.plan(x, y).chunk_sizes == (12, 12)
    again(x, y)
    assert _DEVICE["failures"] == 1
    stagetorch.clear_caches()
    assert not stagetorch.jit(lambda x, y: _loss(model, x, y).backward()).plan(x, y).chunked

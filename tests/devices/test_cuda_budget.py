"""The budget on CUDA is what this process can get (issue 36): the per-process memory fraction, the driver's
free memory and the caching allocator's cached bytes; a larger ``memory_budget`` is planned as that, said
once; the first run of a program on CUDA calibrates later plans against the allocator.

No GPU is needed: the readings come through ``stagetorch.devices.budget.cuda_memory`` (and the peaks are reset
through ``reset_peaks``), which these tests replace, and a step on the host is planned as a CUDA step by
taking the host's device type for "cuda"."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stagetorch
from stagetorch.devices import budget as devices
from stagetorch.devices.budget import SEGMENT_MARGIN, CudaMemory, cuda_budget, free_memory

GiB, MiB = 1 << 30, 1 << 20
CUDA = torch.device("cuda", 0)


def _memory(**readings: float) -> CudaMemory:
    base = dict(free=100 * GiB, total=140 * GiB, fraction=1.0, reserved=0, allocated=0, peak_reserved=0, peak_allocated=0)
    return CudaMemory(**{**base, **readings})


@pytest.mark.parametrize(
    "readings, expected",
    [
        # No fraction set: the driver's free memory, plus the bytes the allocator caches free.
        (dict(free=100 * GiB, reserved=3 * GiB, allocated=2 * GiB), 101 * GiB),
        # A fraction of 4 GiB of 140: what the process may still reserve (4 - 3 GiB), plus its cached 1 GiB.
        (dict(fraction=4 / 140, reserved=3 * GiB, allocated=2 * GiB), 2 * GiB),
        # The same fraction with 0.5 GiB of other tensors resident: they are allocated, so not the step's.
        (dict(fraction=4 / 140, reserved=GiB, allocated=GiB // 2), int(3.5 * GiB)),
        # Another process holds the device: its free memory is less than the fraction leaves.
        (dict(fraction=0.5, free=GiB, reserved=GiB, allocated=GiB), GiB),
        # Nothing left: never negative.
        (dict(fraction=4 / 140, reserved=4 * GiB, allocated=4 * GiB), 0),
    ],
    ids=["driver", "fraction", "others_resident", "other_process", "full"],
)
def test_the_cuda_budget_is_what_the_process_can_get(readings, expected):
    assert cuda_budget(_memory(**readings)) == max(expected - SEGMENT_MARGIN, 0)


@pytest.fixture
def device(monkeypatch):
    """The host planned as a CUDA device whose readings the test sets (``device["memory"]``, and a function
    ``device["peak"]`` giving the peak reserved bytes a run reaches from what it was planned to)."""
    state = {"memory": _memory(), "reset": 0}

    def read(d):
        return state["memory"]

    def reset(d):
        state["reset"] += 1

    monkeypatch.setattr(devices, "cuda_memory", read)
    monkeypatch.setattr(devices, "reset_peaks", reset)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    for d in (torch.device("cpu"), "cpu", CUDA):
        monkeypatch.setitem(devices._DEVICE_TYPES, d, "cuda")
    monkeypatch.setattr(devices, "_SAID", set())
    stagetorch.clear_caches()
    yield state
    stagetorch.clear_caches()


def test_a_budget_larger_than_the_process_can_get_is_planned_as_that_and_said_once(device, caplog):
    device["memory"] = _memory(fraction=4 / 140, reserved=GiB, allocated=GiB // 2)
    can_get = cuda_budget(device["memory"])
    with caplog.at_level("WARNING", logger="stagetorch"):
        assert free_memory(CUDA, "1GiB") == GiB  # within it: the budget as given
        assert free_memory(CUDA, "8GiB") == can_get
        assert free_memory(CUDA, "8GiB", resident=MiB) == can_get + MiB  # the step's own inputs are its
        assert free_memory(CUDA) == can_get
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "memory_budget='8GiB' is more than this process can still get" in said[0], said


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))


def _batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    return torch.randn(256, 32, generator=g), torch.randint(0, 8, (256,), generator=g)


def _step(model: nn.Module):
    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    return step


def _under_a_fraction(device: dict, model: nn.Module, share: float) -> None:
    """Cap the process at ``share`` of the whole batch's plan: the step's inputs are all it has allocated
    (and reserved), the driver has room to spare."""
    staged = stagetorch.jit(_step(copy.deepcopy(model)), memory_budget=1 << 40)
    x, y = _batch(0)
    whole = staged.plan(x, y).full_batch_peak_bytes
    resident = staged._last_entry.executable.resident_bytes(staged._stage((x, y), {})[1])
    total = 64 * GiB
    fraction = (int(whole * share) + SEGMENT_MARGIN) / total
    device["memory"] = _memory(total=total, fraction=fraction, free=total, reserved=resident, allocated=resident)


@pytest.mark.parametrize("front", ["jit", "lazy"])
def test_no_budget_under_a_fraction_chunks_instead_of_running_out(front, device):
    """A process capped at 60% of the whole batch's plan, with no memory_budget: the step is planned within
    the cap and chunked, with eager's loss and gradients, over three steps (the calibration after the first
    finds nothing to add: the readings' peak is the plan's)."""
    model = _model()
    reference = copy.deepcopy(model)
    _under_a_fraction(device, model, 0.6)
    staged = stagetorch.jit(_step(model))
    chunks = []
    for k in range(3):
        x, y = _batch(k)
        model.zero_grad()
        reference.zero_grad()
        if front == "jit":
            chunks.append(staged.plan(x, y).chunk_sizes)
            loss = staged(x, y)
        else:
            lx, ly = stagetorch.lazy(x, y)
            loss = F.cross_entropy(model(lx), ly)
            loss.backward()
        expected = _step(reference)(x, y)
        torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-5, atol=1e-6)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    assert device["reset"] >= 1  # the first run was measured
    if front == "jit":
        assert all(len(c) > 1 for c in chunks), chunks


@pytest.mark.parametrize(
    "cached, reserved_beyond, allocated_beyond, expected",
    [(0, 3 * MiB, 0, 3 * MiB), (8 * GiB, None, MiB, MiB)],
    ids=["new_segments", "within_the_cache"],
)
def test_the_first_run_calibrates_later_plans(cached, reserved_beyond, allocated_beyond, expected, device, caplog):
    """The first run on CUDA needed more than its plan: 3 MiB more reserved in segments it made (its tensors as
    the plan said), or, inside 8 GiB the allocator had cached (its reserved peak is that cache, which says
    nothing), 1 MiB more allocated. Later plans of that program leave the difference out of the budget, the
    log says so once, and a new jit of the same program plans with it too."""
    model = _model()
    x, y = _batch(0)
    staged = stagetorch.jit(_step(model), memory_budget=1 << 40)
    plan = staged.plan(x, y)
    entry = staged._last_entry
    resident = entry.executable.resident_bytes(staged._stage((x, y), {})[1])
    # Before the run the step's inputs are allocated, nothing else (beside the cache).
    base = resident + cached
    device["memory"] = _memory(
        allocated=resident, reserved=base, peak_reserved=base if reserved_beyond is None else plan.peak + reserved_beyond,
        peak_allocated=plan.peak + allocated_beyond, free=1 << 42, total=1 << 42,
    )
    with caplog.at_level("INFO", logger="stagetorch"):
        staged(x, y)
        staged(x, y)
    planner = entry.executable.planner
    assert planner.calibration == expected
    assert device["reset"] == 1  # measured once
    said = [r.getMessage() for r in caplog.records if "the first run needed" in r.getMessage()]
    assert len(said) == 1 and f"later plans leave {expected // MiB}.0 MiB more room" in said[0], said
    # The budget the program is planned in is the step's less the calibration.
    budget = 100 * MiB
    assert planner.plan_call(budget, 0, []).program_budget_bytes == budget - expected
    again = stagetorch.jit(_step(model), memory_budget=1 << 40)
    again.plan(x, y)
    assert again._last_entry.executable.planner.calibration == expected

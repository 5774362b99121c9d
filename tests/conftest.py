import os
import pathlib
import sys

import pytest
import torch

from stagetorch.lazymode import recording
from stagetorch.lazymode.mode import Mode, force_mode
from stagetorch.lazymode.session import _Session
from stagetorch.planning.planner import _LESSONS
from stagetorch.staging.recorder import Recorder
from stagetorch.staging.source import mark_internal

# tests/ mirrors the package, a folder per layer; the helpers the test modules share (``import models``, ``from
# budgets import budget_for``) are in tests/support, the one folder put on sys.path here (pytest puts each test
# module's own folder there itself). A test module imports no other test module.
sys.path.insert(0, str(pathlib.Path(__file__).parent / "support"))

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    # `pytest -n N`: each worker takes its share of the cores, so N workers do not each start one OpenMP thread
    # per core and spin against each other; but never fewer than 2, the threads of CI's 2-core machines: some
    # tests check what a kernel allocates per thread (a reduction's partial sums) and the plans that follow.
    torch.set_num_threads(max(2, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _no_lessons_across_tests():
    """What a program learned from an out-of-memory error is kept per program for the process (a step staged
    again relearns nothing): a test's injected OOMs must not teach the next test's same-shaped program."""
    yield
    _LESSONS.clear()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "lazy_modes(*names): run a test that uses the lazy_mode fixture only in these modes (it checks "
        "the mechanism of one mode, not results)",
    )


def pytest_generate_tests(metafunc):
    """A test that uses ``lazy_mode`` (every lazy test module does) runs once per mode: the lazy program's
    results must be the same whether each step records, replays its recording, or replays express."""
    if "lazy_mode" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("lazy_modes")
        modes = marker.args if marker else [m.name.lower() for m in Mode]
        metafunc.parametrize("lazy_mode", modes, indirect=True)


@pytest.fixture
def lazy_mode(request):
    """Sessions capped at the test's mode, starting from no recording."""
    recording.RECORDINGS.clear()
    with force_mode(request.param) as mode:
        yield mode


def _instrument(monkeypatch, owner, name, wrapper):
    """Wrap a stagetorch method for counting. The wrapper is marked as stagetorch's own code, so the
    tracer does not take it for the user's line (which the replay's hook detection relies on)."""
    mark_internal(wrapper.__code__)
    monkeypatch.setattr(owner, name, wrapper)


@pytest.fixture
def recorded(monkeypatch):
    """The ops run on fake tensors (recorded, not replayed), in order."""
    ops = []
    original = Recorder.record
    _instrument(
        monkeypatch, Recorder, "record",
        lambda self, *a, **k: ops.append(a[0]) or original(self, *a, **k),
    )
    return ops


@pytest.fixture
def dispatched(monkeypatch):
    """The ops that reached a lazy tensor (a skipped backward's ops never do), in order."""
    ops = []
    call = _Session.call
    _instrument(monkeypatch, _Session, "call", lambda self, *a: ops.append(a[0]) or call(self, *a))
    return ops

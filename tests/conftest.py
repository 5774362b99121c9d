import pathlib
import sys

import pytest
import torch

from stagetorch import tracing
from stagetorch.lazymode.session import _Session

sys.path.insert(0, str(pathlib.Path(__file__).parent))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _instrument(monkeypatch, owner, name, wrapper):
    """Wrap a stagetorch method for counting. The wrapper is marked as stagetorch's own code, so the
    tracer does not take it for the user's line (which the replay's hook detection relies on)."""
    tracing.mark_internal(wrapper.__code__)
    monkeypatch.setattr(owner, name, wrapper)


@pytest.fixture
def recorded(monkeypatch):
    """The ops run on fake tensors (recorded, not replayed), in order."""
    ops = []
    original = tracing.Recorder.record
    _instrument(
        monkeypatch, tracing.Recorder, "record",
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

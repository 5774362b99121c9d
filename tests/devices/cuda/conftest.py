"""Tests that need a GPU: skipped where torch sees no CUDA device (run them where one is lent)."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "/cuda/" in str(item.fspath):
            item.add_marker(skip)

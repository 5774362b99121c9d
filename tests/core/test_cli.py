"""``python -m stagetorch``: its help, its version, and the demo, run as a user runs them."""

from __future__ import annotations

import subprocess
import sys
import typing
from collections.abc import Callable

import pytest
import torch

import stagetorch


def _run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stagetorch", *args], capture_output=True, text=True, cwd=cwd)


def test_version_names_stagetorch_and_torch():
    out = _run("--version")
    assert out.returncode == 0
    assert out.stdout.strip() == f"stagetorch {stagetorch.__version__} (torch {torch.__version__})"


def test_help_says_what_the_library_does_and_each_command():
    out = _run("--help")
    assert out.returncode == 0
    assert "exact chunks" in out.stdout and "demo" in out.stdout and "--version" in out.stdout
    demo = _run("demo", "--help")
    assert demo.returncode == 0 and "--plot" in demo.stdout and "--batch" in demo.stdout


def test_no_command_is_a_usage_error():
    out = _run()
    assert out.returncode == 2 and "COMMAND" in out.stderr


def test_the_demo_writes_its_plot_where_it_is_told(tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "memory.png"
    out = _run("demo", "--batch", "32", "--plot", str(plot), cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().endswith("OK: staged and chunked steps equal eager PyTorch.")
    assert f"written to: {plot}" in out.stdout
    assert plot.is_file() and not (tmp_path / "stagetorch-memory.png").exists()


def test_jit_and_lazy_are_typed_for_a_type_checker():
    """``jit`` returns a ``Staged`` (a decorator making one, without ``fn``), ``lazy`` a ``LazyTensor`` or a
    tuple of them: the public annotations say so instead of ``Any``."""
    assert typing.get_type_hints(stagetorch.jit)["return"] == (
        stagetorch.Staged | Callable[[Callable], stagetorch.Staged]
    )
    assert typing.get_type_hints(stagetorch.lazy)["return"] == (
        stagetorch.LazyTensor | tuple[stagetorch.LazyTensor, ...]
    )
    x = stagetorch.lazy(torch.randn(4, 3))
    xs = stagetorch.lazy(torch.randn(4, 3), torch.randn(4))
    assert isinstance(x, stagetorch.LazyTensor) and isinstance(xs, tuple) and len(xs) == 2

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


# -- python -m stagetorch fit ------------------------------------------------------------------------------

_FIT_FILE = '''
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 4))


def train_step(x, y):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss


def example_args(batch=None):
    n = batch or 512
    return torch.randn(n, 256), torch.randint(0, 4, (n,))
'''


def test_fit_plans_a_users_file_for_a_gpu_by_name(tmp_path):
    (tmp_path / "my_train.py").write_text(_FIT_FILE)
    out = _run("fit", "my_train.py:train_step", "--device", "t4", "--batch", "1024", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "Device: T4" in out.stdout and "At batch 1024, whole: max allocated" in out.stdout
    assert "max reserved" in out.stdout and "cuBLAS workspace 4.0 MiB" in out.stdout
    for strategy in ("whole", "recomputing", "in chunks"):
        assert f"  {strategy}" in out.stdout
    assert "Plan at batch 1024: Plan: batch 1024 as 1 chunk(s)" in out.stdout


def test_fit_under_a_budget_prints_the_chunked_plan(tmp_path):
    (tmp_path / "my_train.py").write_text(_FIT_FILE)
    out = _run("fit", "my_train.py:train_step", "--device", "H100-80GB", "--budget", "200MiB", "--batch", "8192",
               "--no-remat", cwd=tmp_path)
    assert out.returncode == 0, out.stderr + out.stdout
    assert "Budget: 200.0 MiB" in out.stdout and "At batch 8192, whole" in out.stdout and "does NOT fit" in out.stdout
    assert "Plan at batch 8192: Plan: batch 8192 as 2 chunk(s) [4096+4096]" in out.stdout
    assert "in chunks         up to" in out.stdout
    # A budget below what the cuBLAS workspace's segment and the parameters' take: nothing fits, exit status 1.
    out = _run("fit", "my_train.py:train_step", "--device", "H100-80GB", "--budget", "40MiB", "--no-remat", cwd=tmp_path)
    assert out.returncode == 1


def test_fit_refuses_an_unknown_device_and_a_file_without_its_convention(tmp_path):
    (tmp_path / "my_train.py").write_text(_FIT_FILE)
    out = _run("fit", "my_train.py:train_step", "--device", "GTX-970", cwd=tmp_path)
    assert out.returncode == 2 and "no GPU named 'GTX-970'" in out.stderr and "A100-40GB" in out.stderr
    out = _run("fit", "my_train.py", "--device", "T4", cwd=tmp_path)  # no function named step
    assert out.returncode == 2 and "defines no step" in out.stderr
    out = _run("fit", "missing.py", "--device", "T4", cwd=tmp_path)
    assert out.returncode == 2 and "no file" in out.stderr
    helped = _run("fit", "--help")
    assert helped.returncode == 0 and "example_args(batch=None)" in helped.stdout and "H100-80GB" in helped.stdout

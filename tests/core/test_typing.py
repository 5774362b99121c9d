"""The public API's types as a user's type checker sees them (issue 46 item 5): mypy, configured in pyproject.toml's
[tool.mypy], on stagetorch/__init__.py, stagetorch/api.py and tests/typing/ (a user script: jit -> Staged,
lazy -> LazyTensor or a tuple of them, memory -> MemoryReport). Skipped where mypy is not installed (the [dev]
extra installs it, so CI runs it)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[2]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    """One mypy cache for the module's runs: the first reads torch's types (~10 s of CPU), the second reuses them."""
    pytest.importorskip("mypy")
    return str(tmp_path_factory.mktemp("mypy") / "cache")


def test_the_public_api_type_checks(cache):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", cache, "--no-error-summary"],
        cwd=ROOT, capture_output=True, text=True, env=env, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_checker_sees_a_wrong_type(cache, tmp_path):
    """The check can fail: a script that takes jit's result for a LazyTensor is refused."""
    script = tmp_path / "wrong.py"
    script.write_text(
        "import torch\nimport stagetorch\n\n"
        "lazy: stagetorch.LazyTensor = stagetorch.jit(lambda x: x)\n"
        "pair: tuple[stagetorch.LazyTensor, ...] = stagetorch.lazy(torch.ones(2), batch=0)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", cache,
         str(script)],
        cwd=ROOT, capture_output=True, text=True, env=env, timeout=300,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert 'has type "Staged", variable has type "LazyTensor"' in done.stdout, done.stdout
    assert 'has type "LazyTensor", variable has type "tuple[LazyTensor, ...]"' in done.stdout, done.stdout

"""The package as pip installs it: one version, optional extras that stay optional, the files a wheel ships."""

from __future__ import annotations

import importlib.metadata
import pathlib
import sys

import pytest
import torch

import stagetorch

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
OPTIONAL = ("matplotlib", "transformers", "accelerate", "lightning")


def test_the_version_has_one_source():
    """pyproject reads the version from stagetorch.__version__, and the installed metadata agrees with it."""
    assert "version" in PYPROJECT["project"]["dynamic"] and "version" not in PYPROJECT["project"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "stagetorch.__version__"}
    assert importlib.metadata.version("stagetorch") == stagetorch.__version__


def test_the_optional_extras_are_not_requirements():
    required = " ".join(PYPROJECT["project"]["dependencies"])
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert not any(name in required for name in OPTIONAL)
    assert extras["plot"] == ["matplotlib>=3.7"]
    assert any(r.startswith("lightning") for r in extras["lightning"])
    assert any(r.startswith("transformers") for r in extras["transformers"])
    # The tests run every integration, so the dev set-up installs every extra.
    for extra in ("plot", "lightning", "transformers"):
        assert all(r in extras["dev"] for r in extras[extra]), extra


def test_a_missing_matplotlib_says_which_extra_to_install(monkeypatch, tmp_path):
    report = stagetorch.memory(torch.nn.Linear(3, 2))(torch.randn(4, 3))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an environment without it imports
    with pytest.raises(ImportError, match=r'pip install "stagetorch\[plot\]"'):
        report.plot(str(tmp_path / "memory.png"))


def test_the_package_is_typed():
    assert (pathlib.Path(stagetorch.__file__).parent / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["stagetorch"]

"""The benchmarks: tests/support on the path, and ``bench_*.py`` collected (pytest's own pattern is ``test_*.py``,
so ``python -m pytest bench`` found nothing)."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "tests" / "support"))


def pytest_collect_file(file_path: pathlib.Path, parent: pytest.Collector):
    # A file named on the command line is collected by pytest itself already.
    if file_path.suffix == ".py" and file_path.name.startswith("bench_") and not parent.session.isinitpath(file_path):
        return pytest.Module.from_parent(parent, path=file_path)
    return None

"""The benchmarks: the shared test helpers (tests/support: models, memtrack, remat_models, ...) on the path.
pyproject.toml's ``python_files`` collects ``bench_*.py``."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "tests" / "support"))

"""The one place the scripts under tools/ set ``sys.path``.

First on the path: the repository root (this tree's ``stagetorch`` before an installed one) and tests/support
(the shared test helpers: ``models``, ``memtrack``, ``random_nets``, ``remat_models``, ``transformer_models``,
...). Last on the path: bench/ and every test layer's folder (tests/ops, tests/end_to_end, ...), for the
scripts that reuse a benchmark's or a test module's steps (``bench_step``, ``test_moe``,
``test_transformers_zoo``, ...); pytest already needs those modules' names to be unique.

A script in ``tools/<kind>/`` says ``import _paths  # noqa: F401`` before its first import of any of them; the
``_paths.py`` beside it runs this file.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
while not (ROOT / "pyproject.toml").exists() and ROOT.parent != ROOT:  # also run from tools/<kind>/_paths.py
    ROOT = ROOT.parent
SUPPORT = ROOT / "tests" / "support"

for _first in (SUPPORT, ROOT):
    if str(_first) not in sys.path:
        sys.path.insert(0, str(_first))
for _last in [ROOT / "bench", *sorted(p for p in (ROOT / "tests").iterdir() if p.is_dir() and p != SUPPORT)]:
    if str(_last) not in sys.path:
        sys.path.append(str(_last))

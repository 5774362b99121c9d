"""Staged (whole, unchunked) against eager peak of the same step, at the allocator, for every test model and
the optimizer-inside steps, foreach or not, first step or later (issue 25: never more than eager). Prints a
markdown table.

    PYTHONPATH=. python bench/eager_parity.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "support"))

import torch  # noqa: E402
from eager_parity_cases import CASES, peaks  # noqa: E402


def main() -> None:
    print("| step | eager peak (B) | staged peak (B) | staged / eager |")
    print("|---|---|---|---|")
    for name in CASES:
        eager, staged = peaks(name)
        print(f"| {name} | {eager:,} | {staged:,} | {staged / eager:.3f} |", flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()

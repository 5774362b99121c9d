"""Probe: staged (whole) against eager peak at the allocator for every test model: never more. Last run: 2026-11-26.

Staged (whole, unchunked) against eager peak of the same step, at the allocator, for every test model and
the optimizer-inside steps, foreach or not, first step or later (issue 25: never more than eager). Prints a
markdown table.

    python tools/probes/eager_parity.py
"""

from __future__ import annotations

import _paths  # noqa: F401  (tools/_paths.py: the tree and tests/support on sys.path)
import torch
from eager_parity_cases import CASES, peaks


def main() -> None:
    print("| step | eager peak (B) | staged peak (B) | staged / eager |")
    print("|---|---|---|---|")
    for name in CASES:
        eager, staged = peaks(name)
        print(f"| {name} | {eager:,} | {staged:,} | {staged / eager:.3f} |", flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()

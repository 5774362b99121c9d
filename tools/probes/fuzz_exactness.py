"""Probe: the step fuzzer's long search for wrong gradients under jit and lazy. Last run: 2026-11-28.

The step fuzzer's long search (tests/support/step_fuzz.py; its CI slice is tests/end_to_end/test_exactness_fuzz.py).

Random training steps whose loss reads a batch-sized weight or mask from anywhere (an argument, a global, a
closure, a module attribute, a buffer, a factory, Python data), trained for a few SGD steps in eager and under
jit (whole, >= 3 uneven chunks, recomputing) and lazy with a budget. Prints each failure (the step's source,
what differed) as it is found and a markdown summary per variant: ran, refused by which named error, wrong,
raw errors. Exit status 1 when anything failed.

    python tools/probes/fuzz_exactness.py --examples 500 --seconds 1800 [--seed N]
"""

from __future__ import annotations

import argparse
import sys
import time

import _paths  # noqa: F401  (tools/_paths.py: the tree and tests/support on sys.path)
import step_fuzz


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=200, help="how many steps hypothesis draws at most")
    parser.add_argument("--seconds", type=float, default=None, help="stop drawing after this long")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis's seed (default: random)")
    parser.add_argument("--derandomize", action="store_true", help="the CI slice's fixed sequence")
    options = parser.parse_args()
    start = time.monotonic()

    def progress(outcome: step_fuzz.Outcome) -> None:
        if outcome.failures:
            print(f"\n### failure\n\n```\n{outcome.report()}\n```\n", flush=True)

    outcomes = step_fuzz.search(options.examples, options.seconds, options.derandomize, options.seed, progress)
    print(f"## fuzz_exactness: {time.monotonic() - start:.0f} s\n")
    print(step_fuzz.summary(outcomes))
    failed = sum(bool(o.failures) for o in outcomes)
    print(f"\n{failed} of {len(outcomes)} steps failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Probe: the step fuzzer's op families (issue 43) over many seeds, under jit in chunks and lazy with a budget.

Last run: 2026-12-07, --seeds 0:300 (after the instance_norm rule): 370 s on a shared 2-core machine; jit 258
exact, 10 refused where examples meet, 19 refused where eager is per-example, 13 unchunkable, 0 raw, 0 wrong;
lazy 288 / 2 / 10 / 0 raw / 0 wrong.

Random training steps from tests/support/step_fuzz_families.py (captured sources and indices, masks of every
dtype and origin, in-place writes, picks, repeat/expand, batch statistics, reshapes, embeddings, einsum,
scatter, losses of every reduction, count-normalised losses, issue 43's leftovers), each trained 3 optimizer
steps in eager, under ``jit`` with a budget that plans >= 2 chunks and under ``lazy`` with a budget, and
classified exact / refused-needed / refused-needless / raw / wrong. Prints each raw error, wrong run and
needless refusal (the step's source) as found, then the markdown tables. Its CI slice is
tests/end_to_end/test_exactness_fuzz.py. Exit status 1 when anything ran raw or wrong.

    python tools/probes/fuzz_families.py --seeds 0:300 [--family mask] [--seconds 1800] [--quiet]
"""

from __future__ import annotations

import argparse
import sys
import time

import _paths  # noqa: F401  (tools/_paths.py: the tree and tests/support on sys.path)
import step_fuzz_families as fuzz


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0:150", help="a range start:stop, or seeds separated by commas")
    parser.add_argument("--family", default=None, choices=fuzz.FAMILIES, help="draw only this family")
    parser.add_argument("--seconds", type=float, default=None, help="stop drawing after this long")
    parser.add_argument("--quiet", action="store_true", help="print needless refusals in the table only")
    options = parser.parse_args()
    if ":" in options.seeds:
        start, stop = map(int, options.seeds.split(":"))
        seeds = range(start, stop)
    else:
        seeds = [int(s) for s in options.seeds.split(",")]
    began = time.monotonic()

    def progress(outcome: fuzz.Outcome) -> None:
        statuses = {r.status for r in outcome.results.values()}
        shown = {"raw", "wrong"} | (set() if options.quiet else {"refused-needless"})
        if statuses & shown or any(r.memory for r in outcome.results.values()):
            print(f"\n### {'/'.join(sorted(statuses))}\n\n```\n{outcome.report()}\n```\n", flush=True)
        else:
            print(".", end="", flush=True)

    outcomes = fuzz.search(seeds, options.seconds, progress, options.family)
    print(f"\n## fuzz_families --seeds {options.seeds}: {time.monotonic() - began:.0f} s\n")
    print(fuzz.summary(outcomes))
    bad = sum(bool(o.failures) for o in outcomes)
    print(f"\n{bad} of {len(outcomes)} steps ran raw or wrong")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

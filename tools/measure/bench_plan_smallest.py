"""Measures: planning time at the smallest budget, per zoo model. Last run: 2026-11-26.

Planning time at the smallest budget: the search below the frontier's least peak.

Per zoo model (``tests/support/transformer_models.py``, 8 layers x 512 tokens by default, one example, CPU): the
step staged first (``staged.graph``), then the process's CPU time of asking its smallest budget (a 1 KiB
budget's ``OutOfMemoryError`` names it: frontier, search below it) and planning at that budget, with the
simulations it ran (``Simulator.run`` calls), the simulators it built, and the plan's peak and recomputed
FLOPs (equal before and after a change that only makes planning faster).

    python tools/measure/bench_plan_smallest.py [--models BART,BERT] [--layers 8] [--tokens 512]

Results in docs/history/results-log.md ("Planning time at the smallest budget").
"""

from __future__ import annotations

import argparse
import time

import _paths  # noqa: F401  (tools/_paths.py: the tree and tests/support on sys.path)
import torch
from transformer_models import model_and_batch, smallest_budget, step_of

import stagetorch
from stagetorch.planning.remat_simulator import Simulator

COUNTS = {"runs": 0, "built": 0}
_run, _init = Simulator.run, Simulator.__init__


def _counted_run(self, *args, **kwargs):
    COUNTS["runs"] += 1
    return _run(self, *args, **kwargs)


def _counted_init(self, *args, **kwargs):
    COUNTS["built"] += 1
    _init(self, *args, **kwargs)


def measure(name: str, layers: int, tokens: int) -> str:
    model, batch = model_and_batch(name, layers=layers, tokens=tokens)
    staged = stagetorch.jit(step_of(model))
    model.zero_grad(set_to_none=True)
    staged.graph(**batch)
    COUNTS.update(runs=0, built=0)
    start = time.process_time()
    staged.memory_budget = smallest_budget(staged, batch)
    plan = staged.plan(**batch)
    seconds = time.process_time() - start
    return (f"{name}: {seconds:.2f} s, {COUNTS['runs']} simulations, {COUNTS['built']} simulators | peak "
            f"{plan.peak} B, recomputes {plan.extra_flops} FLOPs, chunks {plan.chunk_sizes}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="BART,BERT,GPT-2,Llama")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(1)
    Simulator.run, Simulator.__init__ = _counted_run, _counted_init
    for name in args.models.split(","):
        print(measure(name, args.layers, args.tokens), flush=True)


if __name__ == "__main__":
    main()

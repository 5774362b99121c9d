"""GPU: issue 36's checks (cap table, allocator table, chunked step) as markdown. Last run: never (written 2026-11-28).

The GPU checks of issue 36 in one command, printed as markdown for bench/RESULTS.md (under 5 minutes on one
H200; run by a session that has a GPU):

1. **The cap table.** GPT-2 124M, 16x512, fp32, the process capped at 4 GiB with
   ``torch.cuda.set_per_process_memory_fraction``: five steps of each front end (``jit`` with and without a
   budget, ``lazy`` with and without one, ``jit`` recomputing) and the CNN recomputing under a cap of 0.45 of its
   whole batch, each with and without 0.5 GB of other tensors resident, in one subprocess per allocator setting
   (``expandable_segments`` off and on): the failed attempts of each step (stagetorch's recovery says them), a
   raw ``torch.OutOfMemoryError`` if one ends a step, ``max_memory_reserved`` against the cap.
2. **The plan against the allocator**: ``max_memory_allocated`` and ``max_memory_reserved`` against the plan,
   whole, chunked, recomputing and lazy, on the CNN (64x3x224x224) and GPT-2 (8x512)
   (``tools/gpu/cuda_memory_check.py``'s models and measurements).
3. **Step times**, medians of 5, GPT-2 16x512 fp32 with TF32 matmuls, no cap: eager's whole batch, ``jit`` at
   4 GiB, hand accumulation at jit's chunk size, ``lazy`` at 4 GiB after its warm-up.

``--device cpu --quick`` runs every section with small models on the host (no cap, no reserved bytes): the
smoke test of this script where no GPU is lent.

Run: python tools/gpu/cuda_check.py [--device cuda|cpu] [--quick]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import _paths  # noqa: F401  (tools/_paths.py: the tree and tests/support on sys.path)
import cuda_memory_check as cmc
import torch
import torch.nn as nn
from memtrack import budget_between

import stagetorch

GiB = 1 << 30
CAP = 4 * GiB
ALLOCATOR_SETTINGS = ("", "expandable_segments:True")
STEPS = 5


class Fallbacks(logging.Handler):
    """The failed attempts of the steps stagetorch's recovery ran ("out of memory N time(s)" in its log)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        said = re.search(r"out of memory (\d+) time", record.getMessage())
        if said:
            self.count += int(said.group(1))


def gpt2(quick: bool) -> nn.Module:
    if not quick:
        return cmc.gpt2_124m()
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64,
                                      resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))


def tokens(quick: bool, batch: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 512 if quick else 50257, (4 if quick else batch, 32 if quick else 512))
    return ids, ids


def cnn(quick: bool) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    if quick:
        return cmc.resnet(8), (torch.randn(8, 3, 32, 32), torch.randint(0, 1000, (8,)))
    return cmc.resnet(), (torch.randn(64, 3, 224, 224), torch.randint(0, 1000, (64,)))


def share_of_whole(model: nn.Module, lm: bool, inputs: tuple, share: float) -> int:
    """``share`` of the whole batch's plan, or the smallest budget any schedule fits in (5% over) if more."""
    staged = stagetorch.jit(cmc.step_of(model, lm), memory_budget=1 << 50)
    budget = int(share * staged.plan(*inputs).full_batch_peak_bytes)
    staged.memory_budget = budget
    try:
        staged.plan(*inputs)
    except stagetorch.errors.StagingError as e:
        if e.smallest_budget is None:
            raise
        budget = int(e.smallest_budget * 1.05)
    return budget


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def five_steps(front: str, model: nn.Module, lm: bool, inputs: tuple, budget: int | None, device: str,
               remat: str | bool = "auto") -> dict:
    """Five steps of ``front`` from nothing learned: the failed attempts of each, the error that ended one if any,
    the allocator's peaks and the plan's chunks (jit)."""
    stagetorch.clear_caches()
    fallbacks = Fallbacks()
    logging.getLogger("stagetorch").addHandler(fallbacks)
    step = cmc.step_of(model, lm)
    staged = stagetorch.jit(step, memory_budget=budget, remat=remat) if front == "jit" else None
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    per_step, error, plan = [], None, None
    try:
        for _ in range(STEPS):
            fallbacks.count = 0
            model.zero_grad(set_to_none=True)
            try:
                if staged is not None:
                    staged(*inputs)
                else:
                    float(step(*stagetorch.lazy(*inputs, memory_budget=budget)))
                sync(device)
            except (torch.OutOfMemoryError, stagetorch.OutOfMemoryError) as e:
                error = f"{type(e).__module__}.{type(e).__name__}"
                per_step.append(fallbacks.count)
                break
            per_step.append(fallbacks.count)
        if staged is not None and error is None:
            model.zero_grad(set_to_none=True)  # (as each step was planned: the .grad it leaves is not held)
            plan = staged.plan(*inputs)
    finally:
        logging.getLogger("stagetorch").removeHandler(fallbacks)
    row = {"fallbacks": per_step, "error": error}
    if plan is not None:
        recomputes = getattr(plan, "recompute", None) is not None
        row["chunks"] = f"{list(plan.chunk_sizes)}{' recomputing' if recomputes else ''}"
    if device == "cuda":
        row.update(reserved=torch.cuda.max_memory_reserved(), allocated=torch.cuda.max_memory_allocated())
    return row


def cap_rows(device: str, quick: bool) -> list[dict]:
    """The cap table's rows for this process's allocator setting (run as a subprocess per setting): the CNN's,
    then GPT-2's, each model alone on the device."""
    half = GiB // 2  # other tensors resident under the same cap (the budget is then more than the process can get)
    rows = []
    for model_name in ("CNN", "GPT-2"):
        torch.manual_seed(0)
        if model_name == "CNN":
            model, inputs = cnn(quick)
            lm = False
        else:
            model, inputs, lm = gpt2(quick), tokens(quick), True
        model = model.to(device)
        inputs = tuple(t.to(device) for t in inputs)
        if lm:
            cap = CAP if not quick else share_of_whole(model, lm, inputs, 0.6)
            paths = [("jit, no budget", None, "auto", 0), ("jit, no budget", None, "auto", half),
                     ("jit, budget = cap", cap, False, 0), ("jit, budget = cap", cap, False, half),
                     ("jit recomputing, budget = cap", cap, "auto", 0), ("lazy, no budget", None, "auto", 0),
                     ("lazy, budget = cap", cap, "auto", 0), ("lazy, budget = cap", cap, "auto", half)]
        else:
            # As the GPU run that ran out 5 times: a cap of 0.45 of its whole batch (the plan's, to 6%).
            cap = share_of_whole(model, lm, inputs, 0.45)
            paths = [("jit recomputing, budget = cap", cap, "auto", 0), ("jit, no budget", None, "auto", 0)]
        for path, budget, remat, others in paths:
            resident = torch.empty(others if device == "cuda" else 0, dtype=torch.uint8, device=device)
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.mem_get_info()[1])
            started = time.perf_counter()
            row = five_steps(path.split()[0].rstrip(","), model, lm, inputs, budget, device, remat)
            row.update(model=model_name, path=path, cap=cap if device == "cuda" else None, others=others,
                       seconds=round(time.perf_counter() - started, 1))
            rows.append(row)
            del resident
            model.zero_grad(set_to_none=True)
        del model, inputs
        if device == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0)
            torch.cuda.empty_cache()
    return rows


def cap_table(device: str, quick: bool) -> list[str]:
    lines = [
        "| allocator | model | path | other tensors | chunks | failed attempts per step | ended in | max reserved / cap | s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    # On the host the allocator settings are the same process: one subprocess (the smoke test of the others).
    for setting in ALLOCATOR_SETTINGS if device == "cuda" else ALLOCATOR_SETTINGS[:1]:
        env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
        if setting:
            env["PYTORCH_CUDA_ALLOC_CONF"] = setting
        args = [sys.executable, __file__, "--child", "--device", device] + (["--quick"] if quick else [])
        done = subprocess.run(args, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            lines.append(f"| {setting or 'default'} | (the subprocess failed: {done.stderr.strip().splitlines()[-1:]}) |")
            continue
        for row in json.loads(done.stdout.strip().splitlines()[-1]):
            reserved = f"{row['reserved'] / row['cap']:.3f}" if row.get("cap") else "-"
            lines.append(
                f"| {setting or 'default'} | {row['model']} | {row['path']} | {row['others'] / 1e9:.1f} GB | "
                f"{row.get('chunks', '-')} | {row['fallbacks']} | {row['error'] or 'ran'} | {reserved} | {row['seconds']} |"
            )
    return lines


def plan_table(device: str, quick: bool) -> list[str]:
    """Plan against max_memory_allocated / max_memory_reserved on every path of the CNN and GPT-2."""
    lines = [
        "| model | path | budget | plan | max allocated (plan error) | max reserved | reserved / allocated |",
        "|---|---|---|---|---|---|---|",
    ]
    cnn_model, cnn_inputs = cnn(quick)
    for name, model, inputs, lm in (("CNN", cnn_model, cnn_inputs, False), ("GPT-2", gpt2(quick), tokens(quick, 8), True)):
        stagetorch.clear_caches()
        model = model.to(device)
        inputs = tuple(t.to(device) for t in inputs)
        budget = budget_between(stagetorch.jit(cmc.step_of(model, lm), remat=False), inputs, 0.4)
        recomputing = share_of_whole(model, lm, inputs, 0.45)
        for path, run_budget, remat in (("whole", None, False), ("chunked", budget, False),
                                        ("recomputing", recomputing, "auto"), ("lazy", budget, "auto")):
            model.zero_grad(set_to_none=True)
            if path == "lazy":
                planned, run = cmc.lazy_plan(model, lm, inputs, run_budget, device, False)
            else:
                staged = stagetorch.jit(cmc.step_of(model, lm), memory_budget=run_budget, remat=remat)
                planned = staged.plan(*inputs).peak
                run = cmc.measure(device, staged, cmc.resident(model, inputs), *inputs)
            reserved = f"{run.reserved:,}" if device == "cuda" else "-"
            ratio = f"{run.reserved / run.peak:.3f}" if device == "cuda" else "-"
            spent = f"{run_budget:,}" if run_budget else "-"
            lines.append(f"| {name} | {path} | {spent} | {planned:,} | {run.peak:,} "
                         f"({100 * (planned - run.peak) / run.peak:+.1f}%) | {reserved} | {ratio} |")
        del model, inputs
        if device == "cuda":
            torch.cuda.empty_cache()
    return lines


def median_ms(fn: Callable[[], object], device: str, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(STEPS):
        started = time.perf_counter()
        fn()
        sync(device)
        times.append(1000 * (time.perf_counter() - started))
    return statistics.median(times)


def speed_table(device: str, quick: bool) -> list[str]:
    """GPT-2 step times: eager's whole batch, jit at the cap's budget, hand accumulation at jit's chunk size,
    lazy at the same budget after its warm-up (3 steps)."""
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    stagetorch.clear_caches()
    model = gpt2(quick).to(device)
    x, y = (t.to(device) for t in tokens(quick))
    step = cmc.step_of(model, True)
    budget = CAP if not quick else budget_between(stagetorch.jit(step, remat=False), (x, y), 0.4)
    staged = stagetorch.jit(step, memory_budget=budget)
    chunk = max(staged.plan(x, y).chunk_sizes)

    def eager() -> None:
        model.zero_grad(set_to_none=True)
        step(x, y)

    def accumulated() -> None:
        model.zero_grad(set_to_none=True)
        for i in range(0, len(x), chunk):
            n = len(x[i:i + chunk])
            (model(input_ids=x[i:i + chunk], labels=y[i:i + chunk]).loss * (n / len(x))).backward()

    def jit() -> None:
        model.zero_grad(set_to_none=True)
        staged(x, y)

    def lazy() -> None:
        model.zero_grad(set_to_none=True)
        float(step(*stagetorch.lazy(x, y, memory_budget=budget)))

    whole = median_ms(eager, device)
    at = stagetorch.devices.budget.format_bytes(budget)
    rows = [("eager, whole batch", whole), (f"jit at {at}, chunks {list(staged.plan(x, y).chunk_sizes)}", median_ms(jit, device)),
            (f"hand accumulation, micro-batches of {chunk}", median_ms(accumulated, device)),
            (f"lazy at {at}, after 3 warm-up steps", median_ms(lazy, device, warmup=3))]
    lines = ["| step | median of 5 (ms) | / eager |", "|---|---|---|"]
    lines += [f"| {name} | {ms:.1f} | {ms / whole:.2f}x |" for name, ms in rows]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small models: the smoke test of this script")
    parser.add_argument("--child", action="store_true", help="(internal) the cap table's rows, as JSON")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.child:
        print(json.dumps(cap_rows(args.device, args.quick)))
        return
    started = time.perf_counter()
    name = torch.cuda.get_device_name() if args.device == "cuda" else "host"
    print(f"## tools/gpu/cuda_check.py on {name}, torch {torch.__version__}{' (--quick)' if args.quick else ''}\n")
    for title, table in (("The cap table", cap_table), ("The plan against the allocator", plan_table),
                         ("Step times", speed_table)):
        section = time.perf_counter()
        print(f"### {title}\n")
        print("\n".join(table(args.device, args.quick)))
        print(f"\n({time.perf_counter() - section:.0f} s)\n")
    print(f"Total: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()

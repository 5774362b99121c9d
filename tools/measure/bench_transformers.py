"""Measures: recomputation on transformers models against their own checkpointing. Last run: 2026-11-26.

Recomputation on real model code against what its users already have: ``model.gradient_checkpointing_enable()``.

Tiny configs of `transformers` models (8 layers, or 4 + 4 for encoder-decoders; hidden 64, 4 heads, vocab
97, the configs' own dropout), one example of 512 tokens, float32, CPU, a training step
``loss = model(**batch).loss; loss.backward()``. Per model: the eager step's peak; transformers' per-layer
checkpointing, its peak and step time; stagetorch at the smallest budget it accepts (the budget the
``OutOfMemoryError`` of a tiny one names), its predicted and measured peak and step time. Peaks are measured
at the CPU allocator (``tests/support/memtrack.py``'s ``AllocatorPeak``: every byte it hands out, the model's
parameters, the batch and the gradients held before the step counted as resident); step times are medians of
interleaved runs (checkpointing, stagetorch, checkpointing, ...), in the same process: wall-clock, and the
process's CPU time (``time.process_time``), the measure that holds on a shared machine, with ``--threads 1``
(two threads of a loaded 2-core machine wait on each other: T5's step took 3.5 s at load 6 against 0.5 s of CPU).
The ratio columns are the medians of the per-repeat ratios (stagetorch / the checkpointing run beside it).

    python tools/measure/bench_transformers.py [--models gpt2,llama] [--repeats 5] [--mask] [--threads 1]

``--mask`` passes an all-ones ``attention_mask`` too (batch 1, so nothing is padded). The column
"chunked exact, 3 chunks": the same model in float64 with its dropout off, a padded batch of 3 x 128 tokens
(the last two rows padded, ``-100`` labels there), under a budget that runs it in 3 chunks, against the eager
step: the largest relative error of the loss and of any parameter's gradient (by norm).
Results in docs/history/results-log.md.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import _paths  # noqa: F401  (tools/_paths.py: the tree and tests/support on sys.path)
import torch
from transformer_models import (
    MODELS,
    allocator_peak,
    checkpointing,
    model_and_batch,
    smallest_budget,
    step_of,
)

import stagetorch

MiB = 2**20


def measure(name: str, repeats: int = 5, mask: bool = False, chunked: bool = True) -> dict:
    """One row of the table (bytes and seconds)."""
    model, batch = model_and_batch(name, mask)
    step = step_of(model)
    row: dict = {"model": name, "eager_peak": allocator_peak(step, model, batch)}
    with checkpointing(model):
        step(**batch)  # warm
        row["ckpt_peak"] = allocator_peak(step, model, batch)
    staged = stagetorch.jit(step)
    # Asked as the step is measured, with no .grad yet (the plan counts a .grad the step adds into as held).
    model.zero_grad(set_to_none=True)
    budget = row["budget"] = smallest_budget(staged, batch)
    staged.memory_budget = budget
    plan = staged.plan(**batch)
    row["predicted"], row["plan"] = plan.peak, str(plan)
    staged(**batch)  # warm
    row["stagetorch_peak"] = allocator_peak(staged, model, batch)
    # Timed on two models: checkpointing switched on and off between calls would add and remove a hook on the
    # model each time (enable_input_require_grads), which the staged step's guard sees as a new module state:
    # every stagetorch call would stage again (this bench's step times before session 8 were that, 5-11x).
    ckpt_model = copy.deepcopy(model)
    ckpt_step = step_of(ckpt_model)
    times: dict[str, list[float]] = {"ckpt": [], "stagetorch": []}
    cpu: dict[str, list[float]] = {"ckpt": [], "stagetorch": []}
    with checkpointing(ckpt_model):
        for _ in range(repeats):
            for kind, m, fn in (("ckpt", ckpt_model, ckpt_step), ("stagetorch", model, staged)):
                m.zero_grad(set_to_none=True)
                start, start_cpu = time.perf_counter(), time.process_time()
                fn(**batch)
                times[kind].append(time.perf_counter() - start)
                cpu[kind].append(time.process_time() - start_cpu)
    row["ckpt_time"] = statistics.median(times["ckpt"])
    row["stagetorch_time"] = statistics.median(times["stagetorch"])
    row["time_ratio"] = statistics.median(s / c for s, c in zip(times["stagetorch"], times["ckpt"]))
    row["cpu_ratio"] = statistics.median(s / c for s, c in zip(cpu["stagetorch"], cpu["ckpt"]))
    row["ckpt_cpu"] = statistics.median(cpu["ckpt"])
    row["chunked"] = chunked_exact(name) if chunked else "not run"
    return row


def chunked_exact(name: str, examples: int = 3, tokens: int = 128) -> str:
    """A padded batch in 3 chunks against eager: "3 chunks, 2e-15" (the worst relative error), or the error."""
    model, _ = model_and_batch(name)
    model = model.double().eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 97, (examples, tokens), generator=g)
    mask = torch.ones_like(ids)
    mask[1, tokens // 2:] = 0
    mask[2, tokens // 4:] = 0
    batch = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    step = step_of(model)
    model.zero_grad(set_to_none=True)
    expected = step(**batch)
    grads = [p.grad.clone() for p in model.parameters()]
    staged = stagetorch.jit(step, remat=False)
    low, high = 0, staged.plan(**batch).peak
    while high - low > 1024:  # the largest budget that runs the batch in 3 chunks
        staged.memory_budget = mid = (low + high) // 2
        try:
            chunks = staged.plan(**batch).chunk_sizes
        except MemoryError:
            low = mid
            continue
        if len(chunks) >= 3:
            low = mid
        else:
            high = mid
    staged.memory_budget = low
    try:
        chunks = staged.plan(**batch).chunk_sizes
        model.zero_grad(set_to_none=True)
        loss = staged(**batch)
    except Exception as e:  # a refusal is the column's answer
        return f"{type(e).__name__}"
    worst = (loss - expected).abs().item() / expected.abs().item()
    for p, e in zip(model.parameters(), grads):
        worst = max(worst, ((p.grad - e).norm() / e.norm().clamp(min=1e-300)).item())
    return f"{len(chunks)} chunks, {worst:.0e}"


def table(rows: list[dict]) -> str:
    lines = [
        "| model | eager peak | checkpointing: peak | step | stagetorch: smallest budget | predicted | measured "
        "| step | step, CPU time | chunked exact, 3 chunks |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['error']} |  |  |  |  |  |  |  |  |")
            continue
        lines.append(
            f"| {r['model']} | {r['eager_peak'] / MiB:.1f} MiB | {r['ckpt_peak'] / MiB:.2f} MiB | "
            f"{r['ckpt_time'] * 1e3:.0f} ms | {r['budget'] / MiB:.2f} MiB | {r['predicted'] / MiB:.2f} MiB | "
            f"**{r['stagetorch_peak'] / MiB:.2f} MiB** ({r['stagetorch_peak'] / r['ckpt_peak']:.2f}x) | "
            f"{r['stagetorch_time'] * 1e3:.0f} ms ({r['time_ratio']:.2f}x) | {r['cpu_ratio']:.2f}x of "
            f"{r['ckpt_cpu'] * 1e3:.0f} ms | {r['chunked']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mask", action="store_true", help="pass an all-ones attention_mask too")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (1 on a shared machine)")
    parser.add_argument("--no-chunked", action="store_true", help="skip the chunked exactness column")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for name in args.models.split(","):
        try:
            rows.append(measure(name, args.repeats, args.mask, chunked=not args.no_chunked))
        except Exception as e:  # a model that fails is a row saying how, not the end of the table
            rows.append({"model": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"})
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()

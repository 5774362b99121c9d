"""Probe: random networks against eager PyTorch over any number of seeds, reporting failures. Last run: 2026-11-24.

Random networks against eager PyTorch, over as many seeds as you like (tests/support/random_nets.py): what
tests/end_to_end/test_random_steps.py runs for 96 seeds, for thousands, reporting instead of stopping.

    python tools/probes/random_probe.py sequence 0 500      # jit, recomputation allowed, two SGD steps each
    python tools/probes/random_probe.py image 0 300
    python tools/probes/random_probe.py sequence 0 300 --lazy   # one-line mode: lazy line, loss.item(), SGD
    python tools/probes/random_probe.py sequence 0 150 --ranks 2  # data parallel on 2 gloo processes
    python tools/probes/random_probe.py sequence 0 150 --ranks 2 --lazy  # the same in one-line mode

Each case prints one line when it is not equal to eager within its budget and plan; the last line counts
the outcomes. A case the process crashes on (PyTorch's own CPU GroupNorm crashes on a channels-last input
that needs no gradient; the image generator avoids that) stops the run: start again after its seed.
"""

from __future__ import annotations

import argparse
import collections
import copy
import traceback

import _paths  # noqa: F401  (tools/_paths.py: the tree and tests/support on sys.path)
import random_nets
import torch
from memtrack import AllocatorPeak
from test_random_steps import train_against_eager

import stagetorch
from stagetorch.interpreters.memory import peak_bytes


def _lazy(case: random_nets.Case, steps: int = 3) -> str:
    """The one-line loop against eager: a retry at the error's smallest budget, SGD with momentum."""
    model, reference = case.model, copy.deepcopy(case.model)
    lr = 0.05 / case.y.numel() if case.loss == "sum" else 0.05  # a summed loss at 0.05 diverges (chaotic)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=lr, momentum=0.9)
    full = peak_bytes(stagetorch.make_ir(case.step(copy.deepcopy(model)))(case.x, case.y))
    budget = int(full * case.fraction) + 2 * sum(b.untyped_storage().nbytes() for b in model.buffers())
    for k in range(steps):
        x, y = (case.x, case.y) if k == 0 else case.batch(k)
        for attempt in range(2):
            opt.zero_grad()
            try:
                with AllocatorPeak([*model.parameters(), *model.buffers(), x, y]) as tracker:
                    lx, ly = stagetorch.lazy(x, y, memory_budget=budget)
                    value = case.step(model)(lx, ly).item()
                break
            except (stagetorch.OutOfMemoryError, stagetorch.BatchCouplingError) as e:
                if attempt or e.smallest_budget is None:
                    raise
                budget = e.smallest_budget
        opt.step()
        ref_opt.zero_grad()
        expected = case.step(reference)(x, y).item()
        ref_opt.step()
        if tracker.peak > budget:
            return f"step {k}: measured {tracker.peak} over the budget {budget}"
        if abs(value - expected) > 1e-9 * max(1.0, abs(expected)):
            return f"step {k}: loss {value} against eager's {expected}"
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            scale = max(q.abs().max().item(), 1e-3)
            if (p - q).abs().max().item() > 1e-9 * scale:
                return f"step {k}: {name} differs from eager's by {(p - q).abs().max().item():.3g}"
    return ""


def _rank(rank: int, store: str, kind: str, seeds: range, lazy: bool, results) -> None:
    """One process of ``--ranks``: each case's global batch (two examples more than the case's) cut in two
    uneven shards, staged with ``process_group=``, against eager on the global batch (rank 0 compares)."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    lines = []
    for seed in seeds:
        case = random_nets.KINDS[kind](seed)
        g = torch.Generator().manual_seed(seed)
        n = case.x.shape[0] + 2
        x = torch.randn((n, *case.x.shape[1:]), dtype=case.x.dtype, generator=g)
        y = torch.randint(0, 5, (n, *case.y.shape[1:]), generator=g)
        sizes = [n // 2 + seed % 2, n - n // 2 - seed % 2]
        xs, ys = x.split(sizes), y.split(sizes)
        reference = copy.deepcopy(case.model)
        try:
            staged = stagetorch.jit(case.step(case.model), process_group=dist.group.WORLD)
            full = peak_bytes(staged.graph(xs[rank], ys[rank]))
            staged.memory_budget = int(full * case.fraction) + 2 * sum(b.untyped_storage().nbytes() for b in case.model.buffers())
            try:
                plan = staged.plan(xs[rank], ys[rank])
            except stagetorch.OutOfMemoryError as e:  # every rank raises; a rank that fitted has no smallest
                if e.smallest_budget is not None:
                    staged.memory_budget = e.smallest_budget
                plan = staged.plan(xs[rank], ys[rank])
            if lazy:  # the step written eagerly on lazy tensors; its flush plans apart, and may need more
                budget = staged.memory_budget
                for attempt in range(2):
                    case.model.zero_grad(set_to_none=True)
                    try:
                        lx, ly = stagetorch.lazy(xs[rank], ys[rank], process_group=dist.group.WORLD, memory_budget=budget)
                        loss = case.step()(lx, ly)
                        break
                    except stagetorch.OutOfMemoryError as e:  # every rank raises
                        if attempt:
                            raise
                        budget = e.smallest_budget or budget
            else:
                loss = staged(xs[rank], ys[rank])
        except stagetorch.BatchCouplingError:
            lines.append(("named error", ""))  # BatchNorm couples the ranks' examples: refused on every rank
            continue
        except Exception as e:  # noqa: BLE001 - reported, and the ranks may be out of step: stop
            lines.append(("crash", f"{case.description}, rank {rank}: {type(e).__name__}: {e}"))
            break
        if rank == 0:
            expected = case.step(reference)(x, y)
            # Gradients to 1e-9 of the largest: one that is zero but for rounding (a bias before a centring)
            # differs in its last bits from eager's, as a sum in another order does.
            scale = max((q.grad.abs().max().item() for q in reference.parameters() if q.grad is not None), default=1.0)
            wrong = abs(loss.item() - expected.item()) > 1e-9 * max(1.0, abs(expected.item())) or any(
                (p.grad is None) != (q.grad is None)
                or (p.grad is not None and (p.grad - q.grad).abs().max().item() > 1e-9 * scale)
                for p, q in zip(case.model.parameters(), reference.parameters())
            )
            lines.append(("problem", f"{case.description} in shards {sizes}: not eager's") if wrong
                         else ("equal to eager" if lazy else _kind(plan), ""))
    results.put((rank, lines))
    dist.destroy_process_group()


def _distributed(kind: str, seeds: range, lazy: bool) -> list[tuple[str, str]]:
    import tempfile

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = tempfile.mktemp()
    procs = [ctx.Process(target=_rank, args=(r, store, kind, seeds, lazy, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
    return got[0] + [line for line in got[1] if line[0] == "crash"]


def _kind(plan) -> str:
    recompute, chunks = getattr(plan, "recompute", None) is not None, plan.chunked
    return {(False, False): "whole", (True, False): "recompute", (False, True): "chunks"}.get((recompute, chunks), "both")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=sorted(random_nets.KINDS))
    parser.add_argument("start", type=int)
    parser.add_argument("stop", type=int)
    parser.add_argument("--lazy", action="store_true", help="one-line mode instead of jit")
    parser.add_argument("--ranks", type=int, choices=(1, 2), default=1, help="2: data parallel on two processes")
    args = parser.parse_args()
    counts: collections.Counter = collections.Counter()
    if args.ranks == 2:
        for outcome, problem in _distributed(args.kind, range(args.start, args.stop), args.lazy):
            counts[outcome] += 1
            if problem:
                print(problem, flush=True)
        print(dict(counts))
        return
    for seed in range(args.start, args.stop):
        case = random_nets.KINDS[args.kind](seed)
        try:
            if args.lazy:
                problem = _lazy(case)
                outcome = "problem" if problem else "equal to eager"
            else:
                plans = train_against_eager(case)
                problem = ""
                outcome = ", ".join(_kind(p) for p in plans)
        except (stagetorch.OutOfMemoryError, stagetorch.BatchCouplingError, stagetorch.UnsupportedOpError) as e:
            problem, outcome = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}", "named error"
        except AssertionError as e:
            problem, outcome = f"AssertionError: {str(e)[:400]}", "problem"
        except Exception as e:  # a crash of stagetorch's: always a defect
            problem, outcome = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}", "crash"
        counts[outcome] += 1
        if problem:
            print(f"{case.description}: {problem}", flush=True)
    print(dict(counts))


if __name__ == "__main__":
    main()

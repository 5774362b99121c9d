"""GPU (or --device cpu): the plan against the allocator on every path. Last run: 2026-11-26, on CPU only.

The plan against the allocator on every path: whole, chunked, recomputing, lazy, an optimizer stepping inside
the staged function (with the previous step's ``.grad`` resident: by default held until the program has run,
with ``donate_grads=True`` freed when the call starts, as eager's ``zero_grad()`` frees it), and gradient
accumulation into a held ``.grad``; with the eager step's allocator peak beside it (staged / eager).

On CUDA (the default when a GPU is there) it reports ``max_memory_allocated`` and ``max_memory_reserved``
(the caching allocator's segments: what fragmentation costs) against the plan, for a ResNet-ish CNN at batch
64x3x224x224 and GPT-2 124M at 8x512. Without a GPU, or with ``--device cpu``, it runs the test models
(tests/support/models.py) on CPU at the allocator (profiler allocation events; no reserved column). ``--dry-run``
only stages and plans (nothing runs): it checks the script where no device is lent.

Every number is tests/support/memtrack.AllocatorPeak: the allocator's peak during the call plus what was resident
before it (parameters, buffers, inputs, held ``.grad``, optimizer state).

``--remat-seeds`` runs the seed models of tests/support/remat_models.py recomputing at 1.0, 0.7 and 0.5 of their peak.

Run: python tools/gpu/cuda_memory_check.py [--device cuda|cpu] [--dry-run] [--remat-seeds]
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable

import _paths  # noqa: F401  (tools/_paths.py: the tree and tests/support on sys.path)
import models
import remat_models
import torch
import torch.nn as nn
import torch.nn.functional as F
from memtrack import AllocatorPeak, budget_between, known_to_the_profiler

import stagetorch
from stagetorch.planning.budget import SAFETY_MARGIN
from stagetorch.planning.chunks import Plan
from stagetorch.runtime.executable import Executable

PATHS = ("whole", "chunked", "recomputing", "lazy", "optimizer inside", "optimizer inside, donate_grads", "accumulating")
INSIDE = ("optimizer inside", "optimizer inside, donate_grads")


def resnet(width: int = 64) -> nn.Module:
    def block(c: int) -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(c, c, 3, padding=1), nn.GroupNorm(8, c), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1), nn.GroupNorm(8, c)
        )

    return nn.Sequential(
        nn.Conv2d(3, width, 7, 2, 3), nn.ReLU(), *[block(width) for _ in range(4)],
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 1000),
    )


def gpt2_124m() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))


def cases(device: str) -> list[tuple[str, nn.Module, tuple[torch.Tensor, torch.Tensor], bool]]:
    """(name, model, (x, y), language model) per model checked on ``device``."""
    if device == "cuda":
        ids = torch.randint(0, 50257, (8, 512))
        return [
            ("resnet-ish, 64x3x224x224", resnet(), (torch.randn(64, 3, 224, 224), torch.randint(0, 1000, (64,))), False),
            ("gpt2-124M, 8x512", gpt2_124m(), (ids, ids), True),
        ]
    torch.manual_seed(0)
    out = []
    for name, factory in {**models.CLASSIFIERS, "gpt2": models.gpt2}.items():
        model, make = factory()
        out.append((name, model, make(1024 if name == "mlp" else 32), name == "gpt2"))
    return out


def step_of(model: nn.Module, lm: bool, optimizer: torch.optim.Optimizer | None = None) -> Callable:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if optimizer is not None:
            optimizer.zero_grad()
        if lm:
            loss = model(input_ids=x, labels=y).loss
        else:
            out = model(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        if optimizer is not None:
            optimizer.step()
        return loss

    return step


def resident(model: nn.Module, inputs: tuple, optimizer: torch.optim.Optimizer | None = None) -> list[torch.Tensor]:
    state = [t for st in optimizer.state.values() for t in st.values()] if optimizer is not None else []
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return [*model.parameters(), *model.buffers(), *grads, *state, *inputs]


def measure(device: str, fn: Callable, held: list[torch.Tensor], *args: torch.Tensor, frees_resident: bool = False) -> AllocatorPeak:
    run = AllocatorPeak(held, device, frees_resident=frees_resident)
    held.clear()  # a .grad the call frees must not live on in this list
    with run:
        fn(*args)
    return run


def lazy_plan(model: nn.Module, lm: bool, inputs: tuple, budget: int, device: str, dry: bool) -> tuple[int, AllocatorPeak | None]:
    """The largest plan of the flushes ``stagetorch.lazy`` runs, and the allocator's peak of the step."""
    planned = []
    run_executable = Executable.run

    def recorded(self: Executable, flat: list, plan: Plan, **kwargs: object) -> tuple:
        out = run_executable(self, flat, plan, **kwargs)
        planned.append(plan.peak)
        return out

    Executable.run = recorded
    try:
        run = None if dry else AllocatorPeak(resident(model, inputs), device)
        if run is not None:
            run.__enter__()
        lx, ly = stagetorch.lazy(*inputs, batch=0, memory_budget=budget)
        float(step_of(model, lm)(lx, ly))
        if run is not None:
            run.__exit__(None, None, None)
    finally:
        Executable.run = run_executable
    return max(planned), run


def check(name: str, model: nn.Module, inputs: tuple, lm: bool, device: str, dry: bool) -> list[str]:
    model = model.to(device)
    inputs = tuple(t.to(device) for t in inputs)
    rows = []
    # 40% of the way from the smallest plan's peak to the whole batch's (as the tests' chunked paths).
    budget = budget_between(stagetorch.jit(step_of(model, lm), remat=False), inputs, 0.4)
    eager_model = copy.deepcopy(model)
    eager = None if dry else measure(device, step_of(eager_model, lm), resident(eager_model, inputs), *inputs).peak
    for path in PATHS:
        model.zero_grad(set_to_none=True)
        path_eager = eager
        if path == "lazy":
            peak, run = lazy_plan(model, lm, inputs, budget, device, dry)
            rows.append(_row(name, path, budget, peak, run, path_eager))
            continue
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4) if path in INSIDE else None
        staged = stagetorch.jit(
            step_of(model, lm, optimizer), remat="auto" if path == "recomputing" else False,
            memory_budget=budget if path in ("chunked", "recomputing") else None,
            donate_grads=path.endswith("donate_grads"),
        )
        # A .grad freed inside the call (zero_grad() in eager, donate_grads) counts as freed: on CPU the profiler
        # sees that free only for a block allocated under it, so the previous step runs under one.
        frees = path in INSIDE
        if path in ("optimizer inside", "optimizer inside, donate_grads", "accumulating") and not dry:
            # the optimizer's state, or the .grad the next call adds into
            known_to_the_profiler(staged, *inputs) if frees and device == "cpu" else staged(*inputs)
            reference = copy.deepcopy(model)
            for p, q in zip(model.parameters(), reference.parameters()):
                q.grad = known_to_the_profiler(torch.clone, p.grad)  # the same step: the previous .grad resident
            ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-4) if optimizer is not None else None
            if ref_opt is not None:
                ref_opt.load_state_dict(optimizer.state_dict())
            ref_step = step_of(reference, lm, ref_opt)
            path_eager = measure(device, ref_step, resident(reference, inputs, ref_opt), *inputs, frees_resident=frees).peak
        plan = staged.plan(*inputs)
        run = None if dry else measure(device, staged, resident(model, inputs, optimizer), *inputs, frees_resident=frees)
        rows.append(_row(name, path, plan.budget_bytes if path in ("chunked", "recomputing") else None, plan.peak, run,
                         path_eager, len(plan.chunk_sizes)))
    return rows


def _row(name: str, path: str, budget: int | None, planned: int, run: AllocatorPeak | None, eager: int | None,
         chunks: int | None = None) -> str:
    where = path + (f", {chunks} chunks" if chunks and chunks > 1 else "")
    spent = f"{budget:,}" if budget is not None else "-"
    if run is None:
        return f"| {name} | {where} | {spent} | {planned:,} | (dry run) | | | |"
    error = f"{100 * (planned - run.peak) / run.peak:+.1f}%"
    reserved = f"{run.reserved:,}" if run.device.type == "cuda" else "-"
    ratio = f"{run.peak / eager:.2f}" if eager else "-"
    over = " **over budget**" if budget is not None and run.peak > budget else ""
    return f"| {name} | {where} | {spent} | {planned:,} | {run.peak:,} ({error}){over} | {reserved} | {eager or 0:,} | {ratio} |"


def seed_runs(model: nn.Module, x: torch.Tensor, device: str, dry: bool,
              after: Callable[[float], None] | None = None) -> list[tuple[float, int, Plan | None, AllocatorPeak | None]]:
    """``model``'s step recomputing under budgets of 1.0, 0.7 and 0.5 of its peak without recomputation (the
    budget less the planner's margin): (fraction, budget, plan or None below the floor, the allocator's
    peak of the call or None on a dry run) each; ``after(fraction)`` once each call has run."""
    step = remat_models.step_of(model)
    full = stagetorch.jit(step, remat=False).plan(x).peak
    out = []
    for fraction in (1.0, 0.7, 0.5):
        budget = int(full * fraction / (1 - SAFETY_MARGIN)) + 1
        staged = stagetorch.jit(step, memory_budget=budget)
        # Before the plan: a .grad left by the last fraction's call is held beside a program that replaces it,
        # which the plan counts (and recomputes more for), but the measured call, without it, plans again.
        model.zero_grad(set_to_none=True)
        try:
            plan = staged.plan(x)
        except stagetorch.errors.StagingError:
            out.append((fraction, budget, None, None))
            continue
        run = None if dry else measure(device, staged, resident(model, (x,)), x)
        if after is not None and not dry:
            after(fraction)
        out.append((fraction, budget, plan, run))
    return out


def check_seed(name: str, device: str, dry: bool) -> list[str]:
    """A seed model of tests/support/remat_models.py recomputing (:func:`seed_runs`), against its eager step."""
    torch.manual_seed(0)
    model, x = remat_models.SEEDS[name]()
    model, x = model.to(device), x.to(device)
    eager_model = copy.deepcopy(model)
    eager = None if dry else measure(device, remat_models.step_of(eager_model), resident(eager_model, (x,)), x).peak
    rows = []
    for fraction, budget, plan, run in seed_runs(model, x, device, dry):
        if plan is None:
            rows.append(f"| {name} | recomputing at {fraction}x | {budget:,} | below the floor | | | | |")
            continue
        rows.append(_row(name, f"recomputing at {fraction}x", budget, plan.peak, run, eager, len(plan.chunk_sizes)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dry-run", action="store_true", help="stage and plan only; run nothing")
    parser.add_argument("--remat-seeds", action="store_true", help="the seed models of tests/support/remat_models.py instead")
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}, torch {torch.__version__}")
    print("| model | path | budget | plan | allocated (plan error) | reserved | eager allocated | staged / eager |")
    print("|---|---|---|---|---|---|---|---|")
    if args.remat_seeds:
        for name in sorted(remat_models.SEEDS):
            for row in check_seed(name, args.device, args.dry_run):
                print(row, flush=True)
        return
    for name, model, inputs, lm in cases(args.device):
        for row in check(name, model, inputs, lm, args.device, args.dry_run):
            print(row, flush=True)
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""Figures: draws docs/img/remat-*.png, the Recomputation page's plots. Last run: 2026-12-07.

The plots of the Recomputation docs page (docs/remat.md), made from stagetorch's own reports and plans.

- docs/img/remat-resnet.png: the ResNet seed model (BatchNorm: it cannot be chunked) at 0.6x of its peak,
  ``stagetorch.memory(step, memory_budget=...)(x).plot(...)``: the live bytes with and without recomputation.
- docs/img/remat-mlp.png: the issue's example (24 x (Linear(128,128)+GELU), 2 x 1024 tokens) under 12 MiB:
  chunks of one example and recomputation.
- docs/img/remat-sweep.png: every seed model from 1.0x down to 0.2x of its no-recompute peak: the plan's
  predicted peak, the peak measured by tests/support/memtrack.py while the step runs, and the extra FLOPs.

Run: python tools/figures/remat_plots.py   (a few minutes on the 2-core CPU VM; the sweep measures every step)

The tests of docs/remat.md run timelines() into a temporary folder and check its reports against the page's
printed schedule; the sweep is drawn only by running this script.
"""

from __future__ import annotations

import math
import pathlib

import matplotlib

matplotlib.use("Agg")
import _paths  # noqa: F401  (tools/_paths.py: the tree and tests/support on sys.path)
import matplotlib.pyplot as plt
import remat_models
import torch
import torch.nn as nn
from memtrack import AllocatorPeak

import stagetorch
from stagetorch.errors import BatchCouplingError, OutOfMemoryError, UnsupportedOpError
from stagetorch.interpreters.memory import peak_bytes
from stagetorch.planning.budget import SAFETY_MARGIN
from stagetorch.planning.remat_search import RematPlan

OUT = pathlib.Path(__file__).resolve().parents[2] / "docs" / "img"
FRACTIONS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.45, 0.4, 0.35, 0.3, 0.25, 0.2)


def step_of(model: nn.Module):
    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        return loss

    return step


# The budgets of docs/remat.md's examples, whose printed schedules the page shows: its tests run timelines() and
# compare (so the figures drawn from these reports say what the page says). The ResNet's is 0.6x of its 6.3 MiB
# peak without recomputation, less the planner's 10% margin.
RESNET_BUDGET = "4.2MiB"
MLP_BUDGET = "12MiB"


def timelines(out: pathlib.Path = OUT) -> tuple[stagetorch.MemoryReport, stagetorch.MemoryReport]:
    """Draws remat-resnet.png and remat-mlp.png into ``out``; returns their two reports."""
    torch.manual_seed(0)
    model, x = remat_models.resnet()
    resnet = stagetorch.memory(step_of(model), memory_budget=RESNET_BUDGET)(x)
    resnet.plot(str(out / "remat-resnet.png"))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.GELU()) for _ in range(24)])
    mlp = stagetorch.memory(step_of(model), memory_budget=MLP_BUDGET)(torch.randn(2, 1024, 128))
    mlp.plot(str(out / "remat-mlp.png"))
    return resnet, mlp


def sweep() -> None:
    fig, (peaks, flops) = plt.subplots(1, 2, figsize=(10, 4))
    for name in sorted(remat_models.SEEDS):
        torch.manual_seed(0)
        model, x = remat_models.SEEDS[name]()
        staged = stagetorch.jit(step_of(model))
        full = peak_bytes(staged.graph(x))
        rows = []
        for fraction in FRACTIONS:
            staged.memory_budget = math.ceil(full * fraction / (1 - SAFETY_MARGIN)) + 1
            try:
                plan = staged.plan(x)
            except (OutOfMemoryError, BatchCouplingError, UnsupportedOpError):
                break  # below the floor: the named error (every smaller budget fails too)
            model.zero_grad(set_to_none=True)
            with AllocatorPeak([*model.parameters(), *model.buffers(), x]) as tracker:
                staged(x)
            extra = plan.extra_flops / plan.base_flops if isinstance(plan, RematPlan) else 0.0
            rows.append((fraction, plan.peak / full, tracker.peak / full, 100 * extra, len(plan.chunk_sizes)))
            print(f"{name:12} {fraction:4.2f}x: predicted {plan.peak / full:.3f}x measured {tracker.peak / full:.3f}x "
                  f"+{100 * extra:.1f}% FLOPs, {len(plan.chunk_sizes)} chunk(s)")
        xs = [r[0] for r in rows]
        (line,) = peaks.plot(xs, [r[1] for r in rows], "-", label=name)
        peaks.plot(xs, [r[2] for r in rows], "x", color=line.get_color())
        flops.plot(xs, [r[3] for r in rows], "o-", color=line.get_color(), markersize=4, label=name)
    peaks.plot(FRACTIONS, FRACTIONS, "k--", linewidth=1, label="budget less the 10% margin")
    peaks.set_xlabel("budget (x the peak without recomputation)")
    peaks.set_ylabel("peak (x the peak without recomputation)")
    peaks.set_title("predicted peak (line), measured (x)")
    flops.set_xlabel("budget (x the peak without recomputation)")
    flops.set_ylabel("extra FLOPs (%)")
    flops.set_title("recomputation's cost")
    for ax in (peaks, flops):
        ax.invert_xaxis()
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / "remat-sweep.png", dpi=80)
    plt.close(fig)


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    for report in timelines():
        print(report.schedule, "\n")
    sweep()
    for path in sorted(OUT.glob("remat-*.png")):
        print(path, path.stat().st_size, "bytes")

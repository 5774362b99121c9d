"""The demo: a small real model and batch, staged, run, and checked against eager PyTorch."""

from __future__ import annotations

import argparse
import copy
import importlib.util
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .api import jit, make_ir, memory


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))


def _setup(batch: int) -> tuple[nn.Module, nn.Module, torch.Tensor, torch.Tensor, Callable]:
    """The model, an untouched copy for eager PyTorch, a batch, and the train step to stage."""
    torch.manual_seed(0)
    model = _model()
    reference = copy.deepcopy(model)
    x, y = torch.randn(batch, 784), torch.randint(0, 10, (batch,))

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    return model, reference, x, y, train_step


def _against_eager(model: nn.Module, reference: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: torch.Tensor, what: str) -> dict[str, float]:
    ref_loss = F.cross_entropy(reference(x), y)
    ref_loss.backward()
    grad_err = max(
        ((p.grad - q.grad).norm() / q.grad.norm()).item() for p, q in zip(model.parameters(), reference.parameters())
    )
    loss_err = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    print(f"{what} loss {loss.item():.6f}  eager loss {ref_loss.item():.6f}  "
          f"relative error: loss {loss_err:.1e}, worst .grad {grad_err:.1e}")
    return {"loss_error": loss_err, "grad_error": grad_err}


def run_demo(batch: int = 256, plot: str = "stagetorch-memory.png") -> dict[str, float]:
    model, reference, x, y, train_step = _setup(batch)

    graph = make_ir(train_step)(x, y)
    print(f"Staged train_step for x:{tuple(x.shape)} y:{tuple(y.shape)}: {len(graph.eqns)} ATen ops "
          f"(forward and backward), {sum(r == 'param' for r in graph.roles)} parameters lifted.")
    print(graph)

    report = memory(train_step)(x, y)
    print(f"\nMemory, before running anything:\n{report}")
    if importlib.util.find_spec("matplotlib") is None:
        print('No plot of live memory: matplotlib is an optional extra (pip install "stagetorch[plot]").')
    else:
        print(f"Plot of live memory across the step, written to: {report.plot(plot)}")

    loss = jit(train_step)(x, y)
    print()
    return _against_eager(model, reference, x, y, loss, "staged")


def run_chunked_demo(batch: int = 4096, budget: str = "16MiB") -> dict[str, float]:
    """A batch whose step needs several times the embedded budget runs in exact chunks."""
    model, reference, x, y, train_step = _setup(batch)
    step = jit(train_step, memory_budget=budget)
    plan = step.plan(x, y)
    print(f"\nBatch {batch} under memory_budget={budget!r}:")
    print(plan)
    result = _against_eager(model, reference, x, y, step(x, y), "chunked")
    return {**result, "chunks": len(plan.chunk_sizes)}


def main(argv: list[str]) -> int:
    """``python -m stagetorch``: the command line. Returns the process's exit status."""
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="python -m stagetorch",
        description="stagetorch stages PyTorch steps, knows their memory before they run, and runs batches that "
        "do not fit in exact chunks. This command runs its demo.",
    )
    parser.add_argument("--version", action="version", version=f"stagetorch {__version__} (torch {torch.__version__})")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="stage a small MLP's train step, report its memory, run it whole and in exact chunks, check both "
        "against eager PyTorch",
        description="Stages a small MLP's train step (784-128-10, cross-entropy), prints its staged program and its "
        "memory report, runs it whole and then a batch of 4096 under memory_budget='16MiB' in exact chunks, and "
        "checks loss and every .grad against eager PyTorch. With matplotlib installed it writes the live-memory "
        "plot to --plot (default: stagetorch-memory.png in the current directory). Exit status 0 when both "
        "runs equal eager.",
    )
    demo.add_argument("--batch", type=int, default=256, help="batch size of the whole-batch run (default: 256)")
    demo.add_argument("--plot", default="stagetorch-memory.png",
                      help="where to write the live-memory plot (default: stagetorch-memory.png)")
    args = parser.parse_args(argv)
    results = [run_demo(args.batch, args.plot), run_chunked_demo()]
    ok = all(r["loss_error"] < 1e-5 and r["grad_error"] < 1e-5 for r in results) and results[1]["chunks"] > 1
    print("\nOK: staged and chunked steps equal eager PyTorch." if ok else "\nMISMATCH against eager PyTorch.")
    return 0 if ok else 1

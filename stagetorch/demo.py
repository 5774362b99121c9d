"""The demo: a small real model and batch, staged, run, and checked against eager PyTorch."""

from __future__ import annotations

import argparse
import copy
import importlib.util
import sys
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .api import jit, make_ir, memory
from .devices.catalog import known_devices


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
    fit = commands.add_parser(
        "fit",
        help="will it fit? plan a step for a GPU by name (H100-80GB, A100-40GB, T4...) from any machine",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=FIT_HELP,
    )
    fit.add_argument("target", metavar="FILE.py[:STEP]", help="the Python file and the name of its step (default: step)")
    fit.add_argument("--device", required=True, help="the GPU to plan for: " + ", ".join(known_devices()))
    fit.add_argument("--batch", type=int, default=None, help="the batch size, passed to example_args(batch)")
    fit.add_argument("--budget", default=None, help="bytes the step may use, e.g. 40GiB (default: all the device's "
                     "usable memory)")
    fit.add_argument("--expandable-segments", action="store_true",
                     help="plan for PYTORCH_ALLOC_CONF=expandable_segments:True")
    fit.add_argument("--no-remat", action="store_true", help="plan chunks only, without recomputation")
    args = parser.parse_args(argv)
    if args.command == "fit":
        return fit_main(args)
    results = [run_demo(args.batch, args.plot), run_chunked_demo()]
    ok = all(r["loss_error"] < 1e-5 and r["grad_error"] < 1e-5 for r in results) and results[1]["chunks"] > 1
    print("\nOK: staged and chunked steps equal eager PyTorch." if ok else "\nMISMATCH against eager PyTorch.")
    return 0 if ok else 1


FIT_HELP = """Plans a training step for a GPU this machine need not have, and prints what it would hold there.

FILE.py must define the step (a function, by default named `step`; FILE.py:NAME picks another) and
`example_args(batch=None)`, returning the step's positional arguments as a tuple for a batch of that size
(None: the file's own default). Build the model at module level; on the meta device it needs no memory:

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)

    def step(input_ids):
        model(input_ids=input_ids, labels=input_ids).loss.backward()

    def example_args(batch=None):
        return (torch.randint(0, 32000, (batch or 8, 1024)),)

The step is staged on fake CUDA tensors (nothing runs, no weights are read) and planned for the device's
memory, caching allocator and cuBLAS workspace. Printed: the predicted max allocated and max reserved at the
batch, the largest batch that fits whole, recomputing and in chunks, and the plan under --budget. Exit
status 0 when the step fits the device at that batch (in some plan), 1 when it does not, 2 on a usage error.
"""


def fit_main(args: argparse.Namespace) -> int:
    """``python -m stagetorch fit FILE.py[:STEP] --device NAME``: see :data:`FIT_HELP`."""
    import importlib.util
    import os

    from .api import memory
    from .devices.catalog import device_named
    from .errors import StagingError

    path, _, name = args.target.partition(":")
    name = name or "step"
    if not os.path.isfile(path):
        print(f"stagetorch fit: no file {path!r}", file=sys.stderr)
        return 2
    try:
        device = device_named(args.device, "expandable_segments:True" if args.expandable_segments else None)
    except StagingError as e:
        print(f"stagetorch fit: {e}", file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    step, make_args = getattr(module, name, None), getattr(module, "example_args", None)
    if not callable(step) or not callable(make_args):
        missing = [n for n, f in ((name, step), ("example_args", make_args)) if not callable(f)]
        print(f"stagetorch fit: {path} defines no {' and no '.join(missing)} (see python -m stagetorch fit --help)",
              file=sys.stderr)
        return 2
    step_args = make_args() if args.batch is None else make_args(args.batch)
    if not isinstance(step_args, tuple):
        step_args = (step_args,)
    try:
        report = memory(step, memory_budget=args.budget, device=device,
                        remat=False if args.no_remat else "auto")(*step_args)
    except StagingError as e:
        print(f"stagetorch fit: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(report.device)
    plan = report.device.plan
    return 0 if not isinstance(plan, StagingError) and (plan.reserved_bytes or 0) <= report.device.budget_bytes else 1

"""Measures: a Lightning user's answers to a batch that does not fit, against StagedStrategy. Last run: 2026-11-26.

What a Lightning user does when a batch does not fit, against StagedStrategy: peak memory, step time, and
whether three optimizer steps equal the full batch's.

    python tools/measure/lightning_compare.py [--batch 4096] [--budget 128MiB] [--device cpu] [--class-weights]

The model is docs/lightning.md's (784-1024-1024-10 MLP, AdamW), in float64 so that "equal" means rounding
(1e-12) and not float32's 1e-7. Each way trains 3 steps from the same weights over the same examples in the
same order; Δw is the largest weight difference from the full-batch run. Peak: on the CPU, every tensor
storage alive during a step (tests/support/memtrack.py's LivePeak: parameters, gradients, optimizer state, the
batch and all a step allocates), on the second step; on CUDA, torch.cuda.max_memory_allocated over that
step. Time: median of steps 2-5 of a separate run without the tracker.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import _paths  # noqa: F401  (tools/_paths.py: the tree and tests/support on sys.path)
import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from memtrack import LivePeak
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader

from stagetorch.integrations.lightning import StagedStrategy
from stagetorch.interpreters.memory import format_bytes

STEPS = 3


class Classifier(L.LightningModule):
    def __init__(self, checkpointed: bool = False, class_weights: bool = False) -> None:
        super().__init__()
        # Class weights make the loss a weighted mean: each batch divides by its own labels' total weight.
        self.register_buffer("class_weights", torch.linspace(0.5, 2.0, 10) if class_weights else None)
        self.blocks = nn.ModuleList([
            nn.Sequential(nn.Linear(784, 1024), nn.GELU()), nn.Sequential(nn.Linear(1024, 1024), nn.GELU()),
        ])
        self.head = nn.Linear(1024, 10)
        self.checkpointed = checkpointed

    def training_step(self, batch, batch_idx):
        x, y = batch
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return F.cross_entropy(self.head(x), y, weight=self.class_weights)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Measure(L.Callback):
    """Times every batch; with ``track``, the peak of the second optimizer step (its ``accumulate`` batches)."""

    def __init__(self, track: bool, device: torch.device, accumulate: int) -> None:
        self.track, self.device, self.times, self.peak, self._mode = track, device, [], 0, None
        self.first, self.last = accumulate, 2 * accumulate - 1

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self._sync()
        if self.track and batch_idx == self.first:
            opt = trainer.optimizers[0]
            state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
            grads = [p.grad for p in module.parameters() if p.grad is not None]
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            else:
                self._mode = LivePeak([*module.parameters(), *grads, *state, *batch]).__enter__()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self._sync()
        self.times.append(time.perf_counter() - self._start)
        if self.track and batch_idx == self.last:
            if self.device.type == "cuda":
                self.peak = torch.cuda.max_memory_allocated()
            else:
                self._mode.__exit__(None, None, None)
                self.peak = self._mode.peak

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def _train(module, data, device, steps, track, **trainer_args):
    measure = Measure(track, device, trainer_args.get("accumulate_grad_batches", 1))
    trainer = L.Trainer(max_steps=steps, accelerator=device.type, devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[measure], **trainer_args)
    trainer.fit(module, data)
    return module, measure


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--budget", default="128MiB")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--class-weights", action="store_true", help="a class-weighted cross-entropy")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    device, batch = torch.device(args.device), args.batch
    torch.manual_seed(0)
    initial = Classifier(class_weights=args.class_weights).double()
    g = torch.Generator().manual_seed(1)
    n = batch * 5
    x, y = torch.randn(n, 784, dtype=torch.float64, generator=g), torch.randint(0, 10, (n,), generator=g)

    def loader(size):
        # Batches made up front, each its own storage: a DataLoader that indexes one big tensor makes views of
        # the whole data set, which the tracker would count at the data set's size inside the step.
        batches = [(x[i:i + size].clone(), y[i:i + size].clone()) for i in range(0, n, size)]
        return DataLoader(batches, batch_size=None)

    small = batch // 4
    ways = [
        ("full batch (fits only without a budget)", batch, {}, False),
        (f"StagedStrategy(memory_budget={args.budget!r})", batch,
         {"strategy": StagedStrategy(memory_budget=args.budget, device=device)}, False),
        (f"accumulate_grad_batches=4 at batch {small}", small, {"accumulate_grad_batches": 4}, False),
        ("activation checkpointing per block", batch, {}, True),
        (f"batch {small} (a batch-size finder's answer)", small, {}, False),
    ]
    rows, reference = [], None
    for name, size, trainer_args, checkpointed in ways:
        def fresh(checkpointed=checkpointed):
            m = Classifier(checkpointed, args.class_weights)
            m.load_state_dict(initial.state_dict())
            return m.double()

        timed_args = {k: (StagedStrategy(memory_budget=args.budget, device=device) if k == "strategy" else v)
                      for k, v in trainer_args.items()}
        # max_steps counts optimizer steps: with accumulation each takes 4 batches.
        _, timing = _train(fresh(), loader(size), device, 5, False, **timed_args)
        module, tracked = _train(fresh(), loader(size), device, STEPS, True, **trainer_args)
        weights = torch.cat([p.detach().cpu().flatten() for p in module.parameters()])
        reference = weights if reference is None else reference
        per_step = statistics.median(timing.times[1:]) * trainer_args.get("accumulate_grad_batches", 1)
        rows.append((name, tracked.peak, per_step, (weights - reference).abs().max().item()))
    loss = "class-weighted cross-entropy" if args.class_weights else "cross-entropy"
    print(f"{device.type}, batch {batch}, float64, {loss}, {STEPS} AdamW steps; torch {torch.__version__}, "
          f"lightning {L.__version__}")
    print("| way | peak | time per optimizer step | max \\|Δw\\| vs full batch |\n|---|---:|---:|---:|")
    for name, peak, seconds, dw in rows:
        print(f"| {name} | {format_bytes(peak)} | {seconds:.2f} s | {dw:.1e} |")


if __name__ == "__main__":
    main()

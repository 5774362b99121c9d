"""GPU: a batch eager cannot fit, chunked under jit, against eager. Last run: never (written 2026-11-22).

CUDA check for chunked execution (needs a GPU; run by a session that has one).

1. Finds a batch at which a plain PyTorch training step raises torch.OutOfMemoryError.
2. Runs the same step at that batch under stagetorch.jit (budget: the device's free memory) and compares the
   gradients with an exact eager reference (per-chunk sum-reduced losses divided by the batch size).
3. Compares throughput with plain PyTorch at the largest batch that fits.

Run: python tools/gpu/cuda_chunking_check.py   (prints a markdown table for bench/RESULTS.md)
"""

from __future__ import annotations

import copy
import time

import _paths  # noqa: F401  (tools/_paths.py: the tree and tests/support on sys.path)
import torch
import torch.nn as nn
import torch.nn.functional as F

import stagetorch


def model_and_batch(b: int, device: str = "cuda"):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.0, batch_first=True)
    model = nn.Sequential(nn.Embedding(32000, 512), nn.TransformerEncoder(layer, 6), nn.Linear(512, 32000)).to(device)
    x = torch.randint(0, 32000, (b, 256), device=device)
    return model, x, x.roll(-1, 1)


def step_of(model):
    def step(x, y):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        return loss

    return step


def plain_fits(b: int) -> bool:
    model, x, y = model_and_batch(b)
    try:
        step_of(model)(x, y)
        torch.cuda.synchronize()
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        del model, x, y
        torch.cuda.empty_cache()


def throughput(fn, b: int, repeat: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return b * repeat / (time.perf_counter() - t)


def main() -> None:
    b = 16
    while plain_fits(b):
        b *= 2
    largest = b // 2
    print(f"plain PyTorch: batch {largest} fits, {b} raises OOM")

    model, x, y = model_and_batch(b)
    reference = copy.deepcopy(model).cpu()
    step = stagetorch.jit(step_of(model))
    print(step.plan(x, y))
    loss = step(x, y)
    grads = {n: p.grad.cpu() for n, p in model.named_parameters()}
    ref_loss = 0.0
    for i in range(0, b, 8):
        xs, ys = x[i : i + 8].cpu(), y[i : i + 8].cpu()
        part = F.cross_entropy(reference(xs).flatten(0, 1), ys.flatten(), reduction="sum") / y.numel()
        part.backward()
        ref_loss += part.item()
    worst = max(((grads[n] - p.grad).norm() / p.grad.norm()).item() for n, p in reference.named_parameters())
    print(f"| batch {b} (plain OOM) | loss {loss.item():.6f} vs {ref_loss:.6f} | worst grad rel err {worst:.2e} |")

    chunked = throughput(lambda: step(x, y), b)
    model = x = y = step = None
    torch.cuda.empty_cache()
    model, x, y = model_and_batch(largest)
    plain = throughput(lambda: step_of(model)(x, y), largest)
    print(f"| throughput | stagetorch batch {b}: {chunked:.1f} ex/s | plain batch {largest}: {plain:.1f} ex/s | "
          f"ratio {chunked / plain:.3f} |")


if __name__ == "__main__":
    main()

"""CUDA check for memory estimates (needs a GPU): estimate against torch.cuda.max_memory_allocated().

For each model the model and inputs are made resident, statistics reset, one step run; the staged estimate
is printed beside the measured peak, for the whole batch and for chunked runs at half and a quarter of its
predicted peak (the plan's predicted peak, ``plan.peak``, against the measured one and the budget).
Run: python bench/cuda_memory_check.py
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import stagetorch


def resnet(width: int = 64) -> nn.Module:
    def block(c: int) -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
        )

    return nn.Sequential(
        nn.Conv2d(3, width, 7, 2, 3), nn.ReLU(), *[block(width) for _ in range(4)],
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 1000),
    )


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))


def check(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, lm: bool) -> None:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=x, labels=y).loss if lm else F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    estimate = stagetorch.memory(step)(x, y).peak_bytes
    for fraction in (None, 0.5, 0.25):
        budget = None if fraction is None else int(estimate * fraction)
        staged = stagetorch.jit(step, memory_budget=budget)
        try:
            plan = staged.plan(x, y)
        except stagetorch.BatchCouplingError:  # BatchNorm in training: the resnet is not chunked
            print(f"| {name}, budget {budget:,} | cannot be chunked (BatchNorm in training) | | |")
            continue
        for p in model.parameters():
            p.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        staged(x, y)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        where = "whole batch" if budget is None else f"budget {budget:,}, {len(plan.chunk_sizes)} chunks"
        print(f"| {name}, {where} | {plan.peak:,} | {peak:,} | {100 * (plan.peak - peak) / peak:+.2f}% |")


def main() -> None:
    print("| model | predicted | max_memory_allocated | error |\n|---|---|---|---|")
    check("resnet-ish, batch 64x3x224x224", resnet().cuda(), torch.randn(64, 3, 224, 224).cuda(),
          torch.randint(0, 1000, (64,)).cuda(), lm=False)
    torch.cuda.empty_cache()
    ids = torch.randint(0, 50257, (8, 512)).cuda()
    check("gpt2-124M, batch 8x512", gpt2().cuda(), ids, ids, lm=True)


if __name__ == "__main__":
    main()

"""A small user script of the public API that must type-check (tests/core/test_typing.py runs the checker on it):
``jit`` returns a ``Staged`` whose ``plan`` is a ``Plan``; ``lazy`` returns a ``LazyTensor`` for one tensor and a
tuple of them for several; ``memory`` returns a function of the step's arguments that gives a ``MemoryReport``.
It is checked, not run as a test (its name does not start with ``test_``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import stagetorch
from stagetorch import LazyTensor, MemoryReport, Plan, Staged

model = torch.nn.Linear(8, 3)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def main() -> None:
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))

    step: Staged = stagetorch.jit(train_step, memory_budget="64MiB")
    plan: Plan = step.plan(x, y)
    chunks: tuple[int, ...] = plan.chunk_sizes
    peak: int = plan.peak
    decorate = stagetorch.jit(memory_budget="64MiB", remat=False)
    other: Staged = decorate(train_step)
    print(chunks, peak, other.plan(x, y).whole_batch_bytes)

    report: MemoryReport = stagetorch.memory(train_step)(x, y)
    print(report.peak_bytes)

    one: LazyTensor = stagetorch.lazy(x, batch=0)
    both: tuple[LazyTensor, ...] = stagetorch.lazy(x, y, batch=0, memory_budget="64MiB")
    lx, ly = both
    loss = F.cross_entropy(model(lx), ly)
    loss.backward()
    print(one.shape)

    try:
        stagetorch.lazy(x, y[:3], batch=0)
    except stagetorch.BatchShapeError as e:  # also a ShapeError and a ValueError
        error: ValueError = e
        print(error)


if __name__ == "__main__":
    main()

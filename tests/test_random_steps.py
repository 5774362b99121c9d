"""Random networks under random budgets, trained for two steps against eager PyTorch.

Each case draws a small DAG network (Linear, Conv1d, LayerNorm, BatchNorm1d over a transposed activation,
attention, concatenation, skip connections, in-place ReLU, a Python scale read by forward), a batch size,
a loss and a fraction of the whole step's peak as ``memory_budget``. The staged step (recomputation
allowed, the planner choosing chunks and recompute together) must run, or raise a named error whose
smallest budget then runs; within its budget, as its plan predicts (to 2% either way); and give
eager's loss, gradients, weights and BatchNorm statistics (float64, to 1e-9), over two SGD steps between
which the Python scale changes. The same generator, over hundreds of seeds, found the BatchNorm layout
defect that ``tests/test_layout.py`` now pins down.
"""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from memtrack import LivePeak

import stagetorch
from stagetorch.costing import peak_bytes
from stagetorch.errors import BatchCouplingError, OutOfMemoryError

_OPS = ("linear", "act", "norm", "add", "gate", "cat", "attn", "scale", "inplace", "center", "conv", "bn")
_TOL = {"rtol": 1e-9, "atol": 1e-12}


class RandomNet(nn.Module):
    def __init__(self, rng: random.Random, d: int, nodes: int, bn: bool):
        super().__init__()
        self.steps: list[tuple] = []
        self.mods = nn.ModuleList()
        for i in range(nodes):
            op = rng.choice([o for o in _OPS if bn or o != "bn"])
            module = {
                "linear": lambda: nn.Linear(d, d), "norm": lambda: nn.LayerNorm(d), "cat": lambda: nn.Linear(2 * d, d),
                "attn": lambda: nn.Linear(d, 3 * d), "conv": lambda: nn.Conv1d(d, d, 3, padding=1),
                "bn": lambda: nn.BatchNorm1d(d),
            }.get(op)
            if module is not None:
                self.mods.append(module())
            index = len(self.mods) - 1 if module is not None else None
            # Inputs: two earlier values (0 is the network's input), an activation, a constant.
            self.steps.append((op, rng.randrange(i + 1), rng.randrange(i + 1), index,
                               rng.choice(["gelu", "tanh", "relu", "sigmoid"]), rng.uniform(0.5, 2)))
        self.head = nn.Linear(d, 5)
        self.scale = 1.0  # a Python value forward reads: the loop changes it between steps

    def forward(self, x):
        values = [x]
        for op, a, b, index, act, const in self.steps:
            u, v = values[a], values[b]
            m = self.mods[index] if index is not None else None
            if op in ("linear", "norm"):
                y = m(u)
            elif op == "act":
                y = F.gelu(u) if act == "gelu" else getattr(torch, act)(u)
            elif op == "add":
                y = u + v
            elif op == "gate":
                y = u * torch.sigmoid(v)
            elif op == "cat":
                y = m(torch.cat([u, v], -1))
            elif op == "attn":
                q, k, w = m(u).chunk(3, -1)
                y = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ w
            elif op == "scale":
                y = u * (const * self.scale)
            elif op == "inplace":
                y = u * 1.5
                y.relu_()
            elif op == "center":
                y = u - u.mean(1, keepdim=True)
            else:  # conv, bn: over (batch, channels, time)
                y = m(u.transpose(1, 2)).transpose(1, 2)
            values.append(y)
        return self.head(values[-1] + values[len(values) // 2])


def _step_of(model: nn.Module, loss: str):
    def step(x, y):
        out = model(x)
        if loss == "ce":
            value = F.cross_entropy(out.flatten(0, 1), y.flatten())
        elif loss == "sum":
            value = out.square().sum()
        else:
            value = out.square().mean()
        value.backward()
        return value

    return step


def _plan_within(staged, x, y, budget: int):
    """The plan at ``budget``, or at the smallest budget the planner's error names (which must plan)."""
    staged.memory_budget = budget
    try:
        return staged.plan(x, y), budget
    except (OutOfMemoryError, BatchCouplingError) as e:
        assert "smallest" in str(e) and e.smallest_budget is not None, str(e)
        staged.memory_budget = e.smallest_budget
        return staged.plan(x, y), e.smallest_budget


@pytest.mark.parametrize("seed", range(64))
def test_a_random_network_trains_within_its_budget_as_eager(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    d, length, batch = rng.choice([8, 16, 32]), rng.choice([4, 16, 64]), rng.choice([1, 2, 3, 4, 7])
    model = RandomNet(rng, d, rng.randint(3, 14), bn=rng.random() < 0.3).double()
    loss, fraction = rng.choice(["ce", "sum", "mean"]), rng.choice([0.9, 0.7, 0.5, 0.4, 0.3, 0.2])
    reference = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, reference))
    staged = stagetorch.jit(_step_of(model, loss))
    case = f"seed {seed}: d={d} length={length} batch={batch} {[s[0] for s in model.steps]} {loss} at {fraction}"
    for k, scale in enumerate((1.0, 1.7)):
        x = torch.randn(batch, length, d, dtype=torch.float64)
        y = torch.randint(0, 5, (batch, length))
        model.scale = reference.scale = scale
        # The call holds a copy of each buffer the step updates (BatchNorm's statistics) beside the program.
        held = sum(b.untyped_storage().nbytes() for b in model.buffers())
        plan, budget = _plan_within(staged, x, y, int(peak_bytes(staged.graph(x, y)) * fraction) + held)
        opt.zero_grad(set_to_none=True)
        with LivePeak([*model.parameters(), *model.buffers(), x, y]) as tracker:
            got = staged(x, y)
        assert tracker.peak <= budget, (case, k, plan)
        assert tracker.peak <= (plan.peak + held) * 1.02, (case, k, tracker.peak, plan)
        assert tracker.peak >= (plan.peak + held) * 0.98, (case, k, tracker.peak, plan)
        ref_opt.zero_grad(set_to_none=True)
        expected = _step_of(reference, loss)(x, y)
        where = f"{case}, step {k}"
        torch.testing.assert_close(got, expected.detach(), **_TOL, msg=lambda m, where=where: f"{where}: {m}")
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **_TOL, msg=lambda m, where=where: f"{where}: {m}")
        for b, c in zip(model.buffers(), reference.buffers()):
            torch.testing.assert_close(b, c, **_TOL, msg=lambda m, where=where: f"{where}: {m}")
        opt.step()
        ref_opt.step()

"""Random networks for the tests and the bench's probe: small DAGs drawn from a seed.

``sequence(seed)`` draws a network over (batch, length, features) (Linear, Conv1d, LayerNorm, BatchNorm1d
over a transposed activation, attention, concatenation, skips, in-place ReLU, a Python scale read by
forward); ``image(seed)`` one over (batch, channels, height, width) (3x3, 1x1, depthwise and strided
convolutions, BatchNorm2d, GroupNorm, channels-last activations, pooling, nearest upsampling,
concatenation, several activations). Each returns a :class:`Case`: the model (float64), a batch, the
loss and a fraction of the whole step's peak to use as ``memory_budget``.
"""

from __future__ import annotations

import math
import random

import attrs
import torch
import torch.nn as nn
import torch.nn.functional as F


@attrs.define
class Case:
    model: nn.Module
    x: torch.Tensor
    y: torch.Tensor
    loss: str  # "ce", "sum" or "mean"
    fraction: float
    description: str

    def batch(self, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Another batch of the same shapes and layout."""
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(self.x.shape, dtype=self.x.dtype, generator=g)
        if self.x.is_contiguous(memory_format=torch.channels_last) and not self.x.is_contiguous():
            x = x.contiguous(memory_format=torch.channels_last)
        return x, torch.randint(0, 5, self.y.shape, generator=g)

    def step(self, model: nn.Module | None = None):
        """The training step: forward, the loss, backward; returns the loss."""
        model = self.model if model is None else model
        kind = self.loss

        def step(x, y):
            out = model(x)
            if kind == "ce":
                value = F.cross_entropy(out.flatten(0, -2), y.flatten())
            elif kind == "sum":
                value = out.square().sum()
            else:
                value = out.square().mean()
            value.backward()
            return value

        return step


_SEQUENCE_OPS = ("linear", "act", "norm", "add", "gate", "cat", "attn", "scale", "inplace", "center", "conv", "bn")


class SequenceNet(nn.Module):
    def __init__(self, rng: random.Random, d: int, nodes: int, bn: bool):
        super().__init__()
        self.steps: list[tuple] = []
        self.mods = nn.ModuleList()
        for i in range(nodes):
            op = rng.choice([o for o in _SEQUENCE_OPS if bn or o != "bn"])
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


def sequence(seed: int) -> Case:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    d, length, batch = rng.choice([8, 16, 32]), rng.choice([4, 16, 64]), rng.choice([1, 2, 3, 4, 7])
    model = SequenceNet(rng, d, rng.randint(3, 14), bn=rng.random() < 0.3).double()
    loss, fraction = rng.choice(["ce", "sum", "mean"]), rng.choice([0.9, 0.7, 0.5, 0.4, 0.3, 0.2])
    x = torch.randn(batch, length, d, dtype=torch.float64)
    y = torch.randint(0, 5, (batch, length))
    ops = [s[0] for s in model.steps]
    return Case(model, x, y, loss, fraction, f"sequence {seed}: d={d} length={length} batch={batch} {ops} {loss} at {fraction}")


_IMAGE_OPS = ("conv", "conv1x1", "bn", "gn", "act", "add", "cat", "pool", "avg", "channels_last", "up", "dw", "gate",
              "inplace", "hardswish", "silu", "elu", "leaky")


class ImageNet(nn.Module):
    """Node 1 is a convolution of the input, and every later node reads nodes from 1 on: each activation
    needs a gradient. (PyTorch 2.13's CPU GroupNorm backward crashes the process on a channels-last input
    that needs none; see docs/history/results-log.md, session 6.)"""

    def __init__(self, rng: random.Random, c: int, nodes: int, bn: bool):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.steps: list[tuple] = []
        self.mods = nn.ModuleList()
        for i in range(nodes):
            op = rng.choice([o for o in _IMAGE_OPS if bn or o != "bn"])
            module = {
                "conv": lambda: nn.Conv2d(c, c, 3, padding=1), "conv1x1": lambda: nn.Conv2d(c, c, 1, bias=False),
                "bn": lambda: nn.BatchNorm2d(c), "gn": lambda: nn.GroupNorm(2, c), "cat": lambda: nn.Conv2d(2 * c, c, 1),
                "dw": lambda: nn.Conv2d(c, c, 3, padding=1, groups=c), "up": lambda: nn.Conv2d(c, c, 3, stride=2, padding=1),
            }.get(op)
            if module is not None:
                self.mods.append(module())
            self.steps.append((op, rng.randrange(i + 1), rng.randrange(i + 1), len(self.mods) - 1 if module else None))
        self.head = nn.Linear(c, 5)

    def forward(self, x):
        values = [self.stem(x)]
        for op, a, b, index in self.steps:
            u, v = values[a], values[b]
            m = self.mods[index] if index is not None else None
            if op in ("conv", "conv1x1", "bn", "gn", "dw"):
                y = m(u)
            elif op == "act":
                y = F.relu(u)
            elif op == "add":
                y = u + v
            elif op == "gate":
                y = u * torch.sigmoid(v)
            elif op == "cat":
                y = m(torch.cat([u, v], 1))
            elif op == "pool":
                y = F.max_pool2d(u, 3, 1, 1)
            elif op == "avg":
                y = F.avg_pool2d(u, 3, 1, 1)
            elif op == "channels_last":
                y = u.contiguous(memory_format=torch.channels_last)
            elif op == "up":
                y = F.interpolate(m(u), size=u.shape[-2:], mode="nearest")
            elif op == "inplace":
                y = u * 1.0
                y.relu_()
            else:
                y = {"hardswish": F.hardswish, "silu": F.silu, "elu": F.elu, "leaky": F.leaky_relu}[op](u)
            values.append(y)
        return self.head((values[-1] + values[len(values) // 2]).mean((2, 3)))


def image(seed: int) -> Case:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    c, hw, batch = rng.choice([4, 8]), rng.choice([6, 8, 12]), rng.choice([1, 2, 3, 5])
    model = ImageNet(rng, c, rng.randint(3, 12), bn=rng.random() < 0.3).double()
    fraction = rng.choice([0.9, 0.7, 0.5, 0.3])
    x = torch.randn(batch, 3, hw, hw, dtype=torch.float64)
    if rng.random() < 0.3:
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 5, (batch,))
    ops = [s[0] for s in model.steps]
    layout = " channels-last" if not x.is_contiguous() else ""
    return Case(model, x, y, "ce", fraction, f"image {seed}: c={c} hw={hw} batch={batch}{layout} {ops} at {fraction}")


KINDS = {"sequence": sequence, "image": image}

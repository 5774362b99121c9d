"""The seed models of the recomputation issue (after pytorch_memonger's examples), small enough for CPU tests:
a ResNet of bottleneck blocks with BatchNorm, a DenseNet block (concatenation), an LSTM, a VNet-like 3D conv
net and a stack of transformer blocks. Each factory returns (model, batch of inputs). ``per_block`` gives
each one's forward with ``torch.utils.checkpoint`` around every block, the manual baseline. ``TRAINING`` has
the same models at training sizes. ``mlp_chain`` is the issue's deep stack, smaller, and ``step_of`` the training step the recomputation tests stage."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential


def mlp_chain(n: int = 12, d: int = 64) -> nn.Module:
    """The issue's deep stack, smaller: ``n`` x (Linear(d, d) + GELU)."""
    return nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.GELU()) for _ in range(n)])


def step_of(model: nn.Module, loss: Callable = lambda out: out.square().mean()) -> Callable:
    """A training step for ``model``: the loss of its output, backward, the loss returned."""

    def step(x):
        out = loss(model(x))
        out.backward()
        return out

    return step


class Bottleneck(nn.Module):
    def __init__(self, c: int, mid: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(),
            nn.Conv2d(mid, mid, 3, padding=1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(),
            nn.Conv2d(mid, c, 1, bias=False), nn.BatchNorm2d(c),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + x)


def resnet(blocks: int = 6, c: int = 32) -> tuple[nn.Module, torch.Tensor]:
    model = nn.Sequential(
        nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
        *[Bottleneck(c, c // 4) for _ in range(blocks)],
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10),
    )
    return model, torch.randn(4, 3, 24, 24)


class DenseBlock(nn.Module):
    def __init__(self, c: int, growth: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.GroupNorm(1, c + i * growth), nn.ReLU(), nn.Conv2d(c + i * growth, growth, 3, padding=1))
            for i in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.cat([x, layer(x)], 1)
        return x


def densenet(layers: int = 8, c: int = 16, growth: int = 8) -> tuple[nn.Module, torch.Tensor]:
    model = nn.Sequential(
        nn.Conv2d(3, c, 3, padding=1), DenseBlock(c, growth, layers),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c + layers * growth, 10),
    )
    return model, torch.randn(4, 3, 24, 24)


class LSTMNet(nn.Module):
    def __init__(self, d: int = 64, layers: int = 3):
        super().__init__()
        self.lstm = nn.LSTM(d, d, layers, batch_first=True)
        self.head = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0])


def lstm() -> tuple[nn.Module, torch.Tensor]:
    return LSTMNet(), torch.randn(4, 48, 64)


def vnet(c: int = 8, depth: int = 3) -> tuple[nn.Module, torch.Tensor]:
    def stage(cin: int, cout: int) -> nn.Module:
        return nn.Sequential(nn.Conv3d(cin, cout, 3, padding=1), nn.GroupNorm(2, cout), nn.PReLU(cout))

    layers: list[nn.Module] = [stage(1, c)]
    for i in range(depth):
        layers += [stage(c << i, c << i), nn.Conv3d(c << i, c << (i + 1), 2, stride=2)]
    for i in reversed(range(depth)):
        layers += [nn.ConvTranspose3d(c << (i + 1), c << i, 2, stride=2), stage(c << i, c << i)]
    layers.append(nn.Conv3d(c, 2, 1))
    return nn.Sequential(*layers), torch.randn(2, 1, 16, 16, 16)


def transformer(layers: int = 4, d: int = 64) -> tuple[nn.Module, torch.Tensor]:
    block = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(block, layers, enable_nested_tensor=False), torch.randn(4, 64, d)


SEEDS = {"resnet": resnet, "densenet": densenet, "lstm": lstm, "vnet": vnet, "transformer": transformer}

# The same models at sizes where a step does real work (10-42 GFLOP): activations, not parameters or the
# price of an op call, make the peak and the time. Planning needs no data; running them on a CPU takes 0.5-2 s
# a step.
TRAINING = {
    "resnet": lambda: (resnet(12, 64)[0], torch.randn(32, 3, 32, 32)),
    "densenet": lambda: (densenet(12, 32, 16)[0], torch.randn(32, 3, 32, 32)),
    "lstm": lambda: (LSTMNet(256, 3), torch.randn(32, 64, 256)),
    "vnet": lambda: (vnet(16)[0], torch.randn(2, 1, 48, 48, 48)),
    "transformer": lambda: (transformer(4, 256)[0], torch.randn(16, 128, 256)),
}


def _ckpt(block: Callable, x: torch.Tensor) -> torch.Tensor:
    return checkpoint(block, x, use_reentrant=False)


def per_block(name: str, model: nn.Module) -> tuple[list[str], Callable[[torch.Tensor], torch.Tensor]]:
    """(the module paths of the blocks, the model's forward with each block checkpointed) for seed ``name``:
    ResNet's bottlenecks, DenseNet's layers, the LSTM and the head, every VNet stage, every transformer
    layer."""
    if name == "resnet":
        blocks = [i for i, m in enumerate(model) if isinstance(m, Bottleneck)]

        def forward(x):
            for i, m in enumerate(model):
                x = _ckpt(m, x) if i in blocks else m(x)
            return x

        return [str(i) for i in blocks], forward
    if name == "densenet":
        dense = model[1]

        def forward(x):
            x = model[0](x)
            for layer in dense.layers:
                x = torch.cat([x, _ckpt(layer, x)], 1)
            for m in list(model)[2:]:
                x = m(x)
            return x

        return [f"1.layers.{i}" for i in range(len(dense.layers))], forward
    if name == "lstm":
        return ["lstm", "head"], lambda x: _ckpt(model.head, _ckpt(lambda t: model.lstm(t)[0], x))
    if name == "vnet":

        def forward(x):
            for m in model:
                x = _ckpt(m, x)
            return x

        return [str(i) for i in range(len(model))], forward
    assert name == "transformer"

    def forward(x):
        for layer in model.layers:
            x = _ckpt(layer, x)
        return x

    return [f"layers.{i}" for i in range(len(model.layers))], forward


def sequential(name: str, model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The model's forward by ``torch.utils.checkpoint.checkpoint_sequential`` over its top-level modules in
    sqrt(n) segments (Chen's scheme as torch offers it), where the model is such a sequence: ResNet, DenseNet,
    VNet, and the transformer's layers. None for the LSTM (one module, then a head)."""
    if name == "transformer":
        layers = nn.Sequential(*model.layers)
    elif isinstance(model, nn.Sequential):
        layers = model
    else:
        return None
    segments = max(1, round(math.sqrt(len(layers))))
    return lambda x: checkpoint_sequential(layers, segments, x, use_reentrant=False)

"""Steps that read a value on the host (a count, a mask, a size, LayerDrop's draw), their models and batches:
shared by the host-read tests of ``jit`` and of one-line mode."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

B, T, D, CLASSES = 24, 6, 8, 5


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, 32), nn.ReLU(), nn.Linear(32, CLASSES))


class LayerDropNet(nn.Module):
    """Residual layers skipped at random in training, drawn as transformers 5.17's BART draws them."""

    def __init__(self, layers: int = 4, layerdrop: float = 0.5, dropout: float = 0.1):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(layers))
        self.head = nn.Linear(D, CLASSES)
        self.layerdrop, self.dropout = layerdrop, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training:
                dropout_probability = torch.rand([])
                if dropout_probability < self.layerdrop:  # skip the layer
                    continue
            x = x + F.dropout(torch.tanh(layer(x)), self.dropout, self.training)
        return self.head(x)


def labels_of(step: int) -> torch.Tensor:
    """Labels with a different number of ignored (-100) examples at each step, some at the front."""
    g = torch.Generator().manual_seed(step)
    labels = torch.randint(0, CLASSES, (B,), generator=g)
    return labels.masked_fill(torch.rand(B, generator=g) < 0.2 + 0.1 * step, -100)


def features(step: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(100 + step))


# Each pattern: a step over a model, and the arguments of its k-th call.

def count_step(model: nn.Module) -> Callable:
    def step(x, labels):
        n = labels.ne(-100).sum().item()  # a Python number, baked into the program
        loss = F.cross_entropy(model(x), labels, ignore_index=-100, reduction="sum") / n
        loss.backward()
        return loss

    return step


def any_step(model: nn.Module) -> Callable:
    def step(x, attention_mask):
        h = model(x)
        if (attention_mask == 0).any():
            h = h * attention_mask.unsqueeze(-1)
        loss = h.pow(2).mean()
        loss.backward()
        return loss

    return step


def length_step(model: nn.Module) -> Callable:
    def step(x, lengths):
        longest = int(lengths.max())  # a size
        loss = model(x[:, :longest]).pow(2).mean()
        loss.backward()
        return loss

    return step


def unique_step(model: nn.Module) -> Callable:
    def step(x, labels):
        classes = torch.unique(labels)
        loss = model(x)[:, classes].logsumexp(-1).mean()
        loss.backward()
        return loss

    return step


def nonzero_step(model: nn.Module) -> Callable:
    def step(x, labels):
        label_index = (labels >= 0).nonzero().squeeze(1)  # the labelled examples (a classification head's)
        logits = model(x).gather(0, label_index[:, None].expand(-1, CLASSES))
        loss = F.cross_entropy(logits, labels[label_index])
        loss.backward()
        return loss

    return step


def mask_step(model: nn.Module) -> Callable:
    def step(x, labels):
        labelled = labels >= 0
        loss = F.cross_entropy(model(x)[labelled], labels[labelled])
        loss.backward()
        return loss

    return step


def layerdrop_step(model: nn.Module) -> Callable:
    def step(x, labels):
        loss = F.cross_entropy(model(x), labels.clamp(min=0))
        loss.backward()
        return loss

    return step


def lengths_of(k: int) -> torch.Tensor:
    return torch.randint(1, T + 1, (B,), generator=torch.Generator().manual_seed(k)).clamp(max=T - k % 3)


def mask_of(k: int) -> torch.Tensor:
    mask = torch.ones(B, T, dtype=torch.long)
    if k % 2:
        mask[k, T - 2:] = 0
    return mask


def float_count_step(model: nn.Module) -> Callable:
    def step(x, weights):
        n = int(weights.sum().item())  # a float mask's count: known at call time, as an int mask's is
        loss = (F.cross_entropy(model(x), weights.long() * 0, reduction="none") * weights).sum() / max(n, 1)
        loss.backward()
        return loss

    return step


def float_input_step(model: nn.Module) -> Callable:
    def step(x, labels):
        if x.sum() > 0:  # a float argument that needs no gradient: known at call time
            x = x * 2
        loss = F.cross_entropy(model(x), labels.clamp(min=0))
        loss.backward()
        return loss

    return step


def float_mask_of(k: int) -> torch.Tensor:
    return mask_of(k).float()


def float_weights_of(k: int) -> torch.Tensor:
    return (torch.rand(B, generator=torch.Generator().manual_seed(k)) > 0.2 + 0.1 * k).float()


PATTERNS = {
    "item-count": (count_step, mlp, lambda k: (features(k, B, D), labels_of(k))),
    "any-mask": (any_step, mlp, lambda k: (features(k, B, T, D), mask_of(k))),
    "int-max-size": (length_step, mlp, lambda k: (features(k, B, T, D), lengths_of(k))),
    "unique": (unique_step, mlp, lambda k: (features(k, B, D), labels_of(k).clamp(min=k % 2))),
    "nonzero-gather": (nonzero_step, mlp, lambda k: (features(k, B, D), labels_of(k))),
    "bool-mask": (mask_step, mlp, lambda k: (features(k, B, D), labels_of(k))),
    "layerdrop": (layerdrop_step, LayerDropNet, lambda k: (features(k, B, D), labels_of(k))),
    # issue 43: the same reads of float arguments (a float attention mask, float weights, the input itself)
    "float-any-mask": (any_step, mlp, lambda k: (features(k, B, T, D), float_mask_of(k))),
    "float-item-count": (float_count_step, mlp, lambda k: (features(k, B, D), float_weights_of(k))),
    "float-input": (float_input_step, mlp, lambda k: (features(k, B, D) - 0.1 * (k % 2 * 2 - 1), labels_of(k))),
}


def seq2seq_step(model: nn.Module) -> Callable:
    def step(input_ids, attention_mask, labels):
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        return loss

    return step


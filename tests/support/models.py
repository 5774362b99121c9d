"""Small real models for tests and benchmarks: one helper, many cases.

Each factory returns ``(model, make_batch)`` where ``make_batch(b)`` gives ``(x, y)`` for batch size ``b``.
Dropout is off so that staged, chunked and eager runs draw no random numbers and compare exactly.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def seed_mlp() -> tuple[nn.Module, callable]:
    """The MLP from the seed project's README: MNIST-shaped input, 10 classes."""
    model = nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
    return model, lambda b: (torch.randn(b, 784), torch.randint(0, 10, (b,)))


class ConvNet(nn.Module):
    """padding="same", grouped convolution, pooling and a reshape before the classifier."""

    def __init__(self, norm: str = "group"):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding="same")
        self.norm = nn.GroupNorm(4, 16) if norm == "group" else nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1, groups=4)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.norm(self.conv1(x))))
        x = F.avg_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.reshape(x.shape[0], -1))


def cnn(norm: str = "group") -> tuple[nn.Module, callable]:
    return ConvNet(norm), lambda b: (torch.randn(b, 3, 16, 16), torch.randint(0, 10, (b,)))


class TinyTransformer(nn.Module):
    """Embeddings, a TransformerEncoderLayer (SDPA inside), a token classifier."""

    def __init__(self, vocab: int = 50, d: int = 32, heads: int = 4, layers: int = 1):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(1, 16, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens) + self.pos[:, : tokens.shape[1]]
        return self.head(self.encoder(h))


def transformer(layers: int = 1) -> tuple[nn.Module, callable]:
    model = TinyTransformer(layers=layers)
    return model, lambda b: (torch.randint(0, 50, (b, 12)), torch.randint(0, 50, (b, 12)))


class MHAModel(nn.Module):
    """nn.MultiheadAttention with sequence-first layout, then mean over time."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.proj = nn.Linear(8, d)
        self.attn = nn.MultiheadAttention(d, 4)
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x).transpose(0, 1)
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.head(a.mean(0))


def mha() -> tuple[nn.Module, callable]:
    return MHAModel(), lambda b: (torch.randn(b, 10, 8), torch.randint(0, 10, (b,)))


class LSTMModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


def lstm() -> tuple[nn.Module, callable]:
    return LSTMModel(), lambda b: (torch.randn(b, 7, 8), torch.randint(0, 10, (b,)))


def gpt2(pad_fraction: float = 0.25) -> tuple[nn.Module, callable]:
    """A transformers GPT-2 from a small random config (no weights, offline), labels padded with -100."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)

    def make_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, 64, (b, 16))
        labels = ids.clone()
        lengths = torch.randint(int(16 * (1 - pad_fraction)), 17, (b,))
        labels[torch.arange(16)[None, :] >= lengths[:, None]] = -100
        return ids, labels

    return model, make_batch


CLASSIFIERS = {"mlp": seed_mlp, "cnn": cnn, "transformer": transformer, "mha": mha, "lstm": lstm}


def train_step(model: nn.Module, loss_fn=F.cross_entropy):
    """The step every test stages: forward, loss, backward, return the loss."""

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = model(x)
        loss = loss_fn(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        return loss

    return step


def gpt2_step(model: nn.Module):
    def step(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        return loss

    return step

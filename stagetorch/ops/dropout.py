"""Rules for the dropout op family."""

from __future__ import annotations

import torch

from ..interpreters import batch_rules, batching
from ..ir import Aval
from . import layout_rules

aten = torch.ops.aten


# Shape rules: op -> rule(*args with Avals, **kwargs) -> Aval | tuple[Aval, ...]
SHAPE: dict = {
    aten.native_dropout: lambda x, p, train: (x, Aval(x.shape, torch.bool, x.device)),
}


# Batch rules: op -> rule(eqn, label) -> Chunked (see stagetorch/interpreters/batching.py)
BATCH: dict = {
    # Each chunk draws its own random numbers: the same distribution as one full-batch draw, other values.
    aten.native_dropout: batch_rules.per_example(outputs=("b", "b")),
    aten.bernoulli_: batching.elementwise,
    aten.bernoulli: batching.elementwise,
}


# Layout rules (see stagetorch/ops/layout_rules.py): the backward multiplies in a TensorIterator, which keeps the
# gradient's layout; its meta kernel returns a contiguous tensor.
LAYOUT: dict = {
    aten.native_dropout_backward: layout_rules.elementwise,
}

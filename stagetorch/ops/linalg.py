"""Rules for the linalg op family."""

from __future__ import annotations

import torch

from . import _batch, _memory, _shape  # noqa: F401

aten = torch.ops.aten

# Shape rules: op -> rule(*args with Avals, **kwargs) -> Aval | tuple[Aval, ...]
SHAPE: dict = {
}



# Memory rules: op -> rule(eqn) -> transient workspace bytes
MEMORY: dict = {
}



# Batch rules: op -> rule(eqn, label) -> Chunked (see stagetorch/batching.py)
BATCH: dict = {
    aten.mm: _batch.contraction("ij,jk->ik"),
    aten.bmm: _batch.contraction("bij,bjk->bik"),
    aten.addmm: _batch.contraction("ij,jk->ik", bias=True),
    aten.baddbmm: _batch.contraction("bij,bjk->bik", bias=True),
    aten.mv: _batch.contraction("ij,j->i"),
    aten.dot: _batch.contraction("i,i->"),
}


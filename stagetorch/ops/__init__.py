"""The library's op rules: one module per op family, each with ``SHAPE``, ``MEMORY``, ``BATCH`` and ``FLOPS``
tables (``CALLS`` where an op runs more than one kernel, ``LAYOUT`` where its meta kernel's strides are not
the kernel's, ``WORKSPACE`` where a kernel allocates inside itself).

Importing this package fills the registry (:mod:`stagetorch.registry`) through the same :func:`register`
that users call. The generic batch rules users need to describe their own ops are re-exported here.
"""

from ..interpreters.batch_rules import contraction, per_example
from ..interpreters.batching import elementwise as pointwise
from ..registry import Rule, lookup, register, rules
from . import (
    attention,
    conv,
    dropout,
    elementwise,
    embedding,
    indexing,
    linalg,
    losses,
    moe,
    norms,
    pooling,
    recurrent,
    reductions,
    views,
)
from .losses import reduction_loss

__all__ = ["register", "rules", "lookup", "Rule", "pointwise", "per_example", "contraction", "reduction_loss"]

for _family in (
    elementwise, linalg, conv, pooling, norms, attention, recurrent, losses, reductions, views, embedding, dropout, indexing,
    moe,
):
    for _slot in ("SHAPE", "MEMORY", "BATCH", "FLOPS", "CALLS", "LAYOUT", "WORKSPACE"):
        for _op, _fn in getattr(_family, _slot, {}).items():
            register(_op, **{_slot.lower(): _fn})

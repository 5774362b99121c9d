"""The op registry: shape, memory and batch rules per ATen primitive, one module per op family.

``register`` and ``rules`` are public; the family modules hold the library's own tables.
"""

from . import (
    attention,
    conv,
    dropout,
    elementwise,
    embedding,
    linalg,
    losses,
    norms,
    pooling,
    reductions,
    views,
)
from ._batch import contraction, per_example, reduction_loss
from ._batch import elementwise as pointwise
from ._registry import Rule, lookup, register, rules

__all__ = ["register", "rules", "lookup", "Rule", "pointwise", "per_example", "contraction", "reduction_loss"]

for _family in (
    elementwise, linalg, conv, pooling, norms, attention, losses, reductions, views, embedding, dropout,
):
    for _slot in ("SHAPE", "MEMORY", "BATCH"):
        for _op, _fn in getattr(_family, _slot, {}).items():
            register(_op, **{_slot.lower(): _fn})

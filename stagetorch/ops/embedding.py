"""Rules for the embedding op family."""

from __future__ import annotations

import torch

from ..interpreters.batching import Chunked, LabelFn, Reduced, coupling
from ..ir import Aval, Eqn

aten = torch.ops.aten


# Batch rules for this family's ops (see stagetorch/interpreters/batching.py).

def embedding(eqn: Eqn, label: LabelFn) -> Chunked:
    weight, indices = eqn.args[0], eqn.args[1]
    if label(weight) is not None:
        raise coupling(eqn, "looks up a per-example table", "keep embedding tables shared")
    return Chunked((label(indices),), whole=frozenset({weight}))  # a table: no dim of it pairs with the examples


def embedding_dense_backward(eqn: Eqn, label: LabelFn) -> Chunked:
    scale_by_freq = eqn.args[4] if len(eqn.args) > 4 else eqn.kwargs.get("scale_grad_by_freq", False)
    if scale_by_freq:
        raise coupling(eqn, "scales gradients by token counts over the batch", "use scale_grad_by_freq=False")
    grad, indices = eqn.args[0], eqn.args[1]
    lab = label(grad)
    # The gradient's leading dims are the indices' dims: shared indices (token type ids expanded to the batch)
    # are cut to the chunk with it.
    cut = {indices: lab} if lab is not None and label(indices) is None and lab.dim < indices.aval.ndim else {}
    if lab is not None and label(indices) is None and not cut:
        raise coupling(eqn, "adds per-example gradients at shared positions that do not line up with them", "batch the indices")
    return Chunked((Reduced("sum"),), slice=cut)


# Shape rules: op -> rule(*args with Avals, **kwargs) -> Aval | tuple[Aval, ...]
SHAPE: dict = {
    aten.embedding: lambda weight, indices, *args: Aval(indices.shape + weight.shape[1:], weight.dtype, weight.device),
    aten.embedding_dense_backward: lambda grad, indices, num_weights, *args: Aval(
        (num_weights, grad.shape[-1]), grad.dtype, grad.device
    ),
}


# Batch rules: op -> rule(eqn, label) -> Chunked (see stagetorch/interpreters/batching.py)
BATCH: dict = {
    aten.embedding: embedding,
    aten.embedding_dense_backward: embedding_dense_backward,
}


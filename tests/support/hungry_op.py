"""An op that runs out of memory as a device would, ``stagetorch_test::scratch_hungry``: importing this module
registers it, once (every test that uses it imports it from here)."""

from __future__ import annotations

import torch

import stagetorch

_DEVICE = {"limit": 10**9, "raised": 0}


@torch.library.custom_op("stagetorch_test::scratch_hungry", mutates_args=())
def scratch_hungry(x: torch.Tensor) -> torch.Tensor:
    """x * 2 that runs out of memory, as a device would, on more than ``_DEVICE["limit"]`` rows."""
    if x.shape[0] > _DEVICE["limit"]:
        _DEVICE["raised"] += 1
        raise torch.OutOfMemoryError(f"simulated: {x.shape[0]} rows")
    return x * 2


@scratch_hungry.register_fake
def _(x):
    return torch.empty_like(x)


scratch_hungry.register_autograd(lambda ctx, grad: grad * 2, setup_context=lambda ctx, inputs, output: None)
# What a user writes for their own op: its batch rule, from the generic ones.
stagetorch.ops.register(torch.ops.stagetorch_test.scratch_hungry, batch=stagetorch.ops.pointwise)


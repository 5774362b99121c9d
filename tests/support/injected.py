"""Identity ops that fail on demand: a kernel running out of memory (or raising) in the middle of a staged step.

Each test file makes its own with :func:`identity_op` and decides when it fails (``check``): for chunks above a
number of examples, from a number of calls on. The op is registered as a per-example op, so stagetorch chunks
through it, and its gradient is the incoming one."""

from __future__ import annotations

from collections.abc import Callable

import torch

import stagetorch


def identity_op(name: str, check: Callable[[torch.Tensor], None]):
    """``torch.ops.stagetorch_test.<name>``: ``x.clone()`` after ``check(x)``, which raises to fail the kernel."""

    def run(x: torch.Tensor) -> torch.Tensor:
        check(x)
        return x.clone()

    op = torch.library.custom_op(f"stagetorch_test::{name}", mutates_args=())(run)
    op.register_fake(lambda x: torch.empty_like(x))
    op.register_autograd(lambda ctx, grad: grad, setup_context=lambda ctx, inputs, output: None)
    stagetorch.ops.register(getattr(torch.ops.stagetorch_test, name), batch=stagetorch.ops.per_example())
    return op

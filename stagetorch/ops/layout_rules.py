"""Layout rules: the strides a real kernel gives its outputs, for the ops whose meta kernel says otherwise.

The tracer stages with fake tensors, whose strides come from meta kernels. Where a meta kernel lays an
output out otherwise than the kernel that runs, the trace goes wrong downstream: ``x.view(...)`` of a
value the trace thinks contiguous fails on the real, transposed one, and a ``reshape`` the trace records
as a copy is a view in eager PyTorch. Each rule here was measured against the CPU kernels of PyTorch
(``tests/ops/test_layout.py`` runs them all against eager).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._prims_common import (
    compute_elementwise_output_strides,
    make_channels_last_strides_for,
    make_contiguous_strides_for,
    suggest_memory_format,
)

from ..ir import Var
from ..registry import NO_TENSOR

CHANNELS_LAST = (torch.channels_last, torch.channels_last_3d)


def _dense(x: torch.Tensor) -> tuple[int, ...]:
    """The strides of a new tensor shaped as ``x``, contiguous in the memory format ``x`` suggests:
    ``torch.empty_like(x, memory_format=x.suggest_memory_format())``."""
    if suggest_memory_format(x) in CHANNELS_LAST:
        return tuple(make_channels_last_strides_for(x.shape))
    return tuple(make_contiguous_strides_for(x.shape))


def in_input_format(index: int, mask: int | None = None) -> Callable[..., tuple | None]:
    """Output 0 is new, shaped as argument ``index`` and dense in the memory format it suggests (kernels
    that allocate with ``empty_like(x, x.suggest_memory_format())``; meta kernels keep ``x``'s strides).
    ``mask``: the argument holding a backward's output mask; where its first entry is false the kernel
    returns no tensor for output 0 (the input's gradient), whatever the meta kernel makes."""

    def rule(*args: object, **kwargs: object) -> tuple | None:
        x = args[index]
        if not isinstance(x, torch.Tensor):
            return None
        if mask is not None and not args[mask][0]:
            return (NO_TENSOR,)
        return (_dense(x),)

    return rule


def all_contiguous(outputs: int, devices: tuple[str, ...]) -> Callable[..., tuple | None]:
    """Each of ``outputs`` outputs shaped as the first argument and contiguous, on ``devices``."""

    def rule(x: torch.Tensor, *args: object, **kwargs: object) -> tuple | None:
        return (tuple(make_contiguous_strides_for(x.shape)),) * outputs if x.device.type in devices else None

    return rule


def elementwise(*args: object, **kwargs: object) -> tuple | None:
    """A TensorIterator kernel: output 0 laid out as its tensor operands (torch's own Python account of
    TensorIterator, ``compute_elementwise_output_strides``), where they share a shape or are 0-dim."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    shaped = [t for t in tensors if t.ndim]
    if not shaped or any(t.shape != shaped[0].shape for t in shaped):
        return None  # broadcasting operands: the meta kernel's own account stands
    return (tuple(compute_elementwise_output_strides(*tensors)),)


# -- Layouts in workspace rules -----------------------------------------------------------------------------
#
# A workspace rule marked ``reads_layouts`` gets the strides of its equation's arguments where the IR knows
# them (stagetorch.interpreters.memory.Layouts); these read them as the kernels do.


def strides_of(v: object, layouts: Callable[[Var], tuple[int, ...] | None]) -> tuple[int, ...] | None:
    return layouts(v) if isinstance(v, Var) else None


def suggested(v: object, layouts: Callable[[Var], tuple[int, ...] | None]) -> torch.memory_format | None:
    """``Tensor.suggest_memory_format()`` of ``v`` (None: its strides are unknown)."""
    strides = strides_of(v, layouts)
    if strides is None:
        return None
    return suggested_of(torch.empty_strided(v.aval.shape, strides, dtype=v.aval.dtype, device="meta"))


def suggested_of(t: torch.Tensor) -> torch.memory_format:
    """``t.suggest_memory_format()``, with a batch of one laid out outermost. The stride of a dim of size
    one is arbitrary, and meta kernels give the batch dim of a one-example tensor another than the CPU
    kernels do (8 where they give 1152, for a channels-last (1, 8, 12, 12)); PyTorch's suggestion reads it
    (it would call that tensor contiguous). The CPU kernels' outputs have it outermost."""
    if t.ndim and t.shape[0] == 1:
        outer = max((st * n for st, n in zip(t.stride(), t.shape)), default=1)
        t = torch.empty_strided(t.shape, (outer, *t.stride()[1:]), dtype=t.dtype, device="meta")
    return suggest_memory_format(t)


def dense_in(shape: tuple[int, ...], strides: tuple[int, ...] | None, fmt: torch.memory_format) -> bool | None:
    """Whether a tensor of ``shape`` laid out as ``strides`` is dense in ``fmt`` (``.contiguous(fmt)`` copies
    nothing); None where the strides are unknown."""
    if strides is None:
        return None
    return torch.empty_strided(shape, strides, device="meta").is_contiguous(memory_format=fmt)


def dense_strides(shape: tuple[int, ...], fmt: torch.memory_format) -> tuple[int, ...]:
    """The strides of a new tensor of ``shape`` allocated in ``fmt``."""
    return tuple(torch.empty(shape, device="meta", memory_format=fmt).stride())

"""Staging for a CUDA device on a machine without one: CUDA's dispatch choices on fake CUDA tensors.

PyTorch's ``FakeTensorMode`` makes ``device="cuda"`` fake tensors on a CPU-only build, and most of what a GPU
does with them is decided by device-independent code that runs on them as it would on the GPU. Two choices are
not, and :func:`cuda_staging` makes them as the GPU would:

- **Autocast.** ``torch.autocast("cuda", ...)`` turns itself off (with a warning) when
  ``torch.cuda.amp.common.amp_definitely_not_available()`` says so, which it does on a CPU-only build. The
  dispatcher's ``AutocastCUDA`` kernels are compiled into every build and are keyed on the tensors' device, so
  once the context is allowed to switch on, fake CUDA tensors are cast by CUDA's op lists (matmul and
  convolution in the low dtype, softmax, layer_norm and the losses in float32), not CPU's.
- **Attention.** ``scaled_dot_product_attention`` picks its kernel in CUDA code a CPU build lacks, so on fake CUDA
  tensors it always decomposes into the math path; :class:`~stagetorch.ops.kernels.cuda_sdpa.sdpa_dispatch`
  picks the kernel for the given device.

Nothing here touches a real tensor; outside the context everything is as it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

from ...errors import UnsupportedOpError
from .cuda_sdpa import DEFAULT_PROPS, CudaProps, sdpa_dispatch

__all__ = ["cuda_autocast_allowed", "cuda_staging", "no_cuda_autocast_on_cpu"]


@contextlib.contextmanager
def cuda_autocast_allowed() -> Iterator[None]:
    """Inside it, ``torch.autocast("cuda", dtype=...)`` switches on where no GPU is (as on one: bfloat16 is
    accepted, as PyTorch does on every GPU it runs on, emulated below sm80)."""
    common = torch.cuda.amp.common
    saved = common.amp_definitely_not_available, torch.cuda.is_bf16_supported
    common.amp_definitely_not_available = lambda: False
    torch.cuda.is_bf16_supported = lambda *args, **kwargs: True
    try:
        yield
    finally:
        common.amp_definitely_not_available, torch.cuda.is_bf16_supported = saved


@contextlib.contextmanager
def cuda_staging(props: CudaProps = DEFAULT_PROPS, devices: tuple[str, ...] = ("cuda",)) -> Iterator[sdpa_dispatch]:
    """Stage under it for a GPU of ``props`` (``CudaProps(capability=(8, 0))`` for an A100): CUDA's autocast and
    CUDA's attention kernels on fake CUDA tensors (attention also on the ``devices`` given: see
    :class:`~stagetorch.ops.kernels.cuda_sdpa.sdpa_dispatch`). Yields the attention dispatcher (its ``choices``
    list the backend of each attention call)."""
    with cuda_autocast_allowed(), sdpa_dispatch(props, devices) as mode:
        yield mode


class no_cuda_autocast_on_cpu(TorchFunctionMode):
    """Inside it, a step that turns on ``torch.autocast("cuda")`` while it is traced on CPU fake tensors (a
    named card planned on a torch without a GPU: :func:`~stagetorch.staging.tracer.staging_device`) is refused
    by name. CUDA's autocast casts only CUDA tensors: on the CPU tensors the trace runs on, it would cast
    nothing but attention (which :class:`~stagetorch.ops.kernels.cuda_sdpa.sdpa_dispatch` casts as CUDA does),
    and the step would fail on mixed dtypes, or be planned at float32's bytes. CPU's autocast casts by other
    lists (softmax and layer_norm in the low dtype, not float32), so it cannot stand in without planning
    under the GPU."""

    def __init__(self, card: str):
        super().__init__()
        self.card = card

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if torch.is_autocast_enabled("cuda"):
            raise UnsupportedOpError(
                f"the step turns on torch.autocast('cuda') and is planned for {self.card} on a torch without a GPU, "
                "where the trace runs on CPU fake tensors that CUDA's autocast does not cast: its plan would be "
                "float32's, not what the GPU runs.\nWhat to do: plan the step on a machine with a CUDA GPU (any "
                "card: the plan is for the card named), or plan the step with the model cast to the autocast "
                "dtype (model.to(torch.bfloat16) without autocast: an estimate that keeps softmax, norms and "
                "the loss in that dtype too)."
            )
        return func(*args, **(kwargs or {}))

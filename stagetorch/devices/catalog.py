"""GPUs by name: what memory each has, what a process can use of it, and how its allocator and cuBLAS behave,
so that a step can be planned for a device this machine does not have (``stagetorch.memory(step,
device="H100-80GB")``, ``stagetorch.jit(step, device="A100-40GB").plan(...)``).

A :class:`Device` is a value: its name, its memory (``capacity_bytes``), what the CUDA context takes of it,
the fraction a process may use (``torch.cuda.set_per_process_memory_fraction``), its compute capability, the
caching allocator's settings (``PYTORCH_ALLOC_CONF``) and the cuBLAS workspace one handle keeps.
:func:`device_named` finds one by name; ``"cuda"`` is this process's own device, read from torch.cuda.

Figures: ``capacity_bytes`` is the memory the driver reports for the card (``nvidia-smi``'s total, in MiB),
except the H200's, which is what torch reported on the project's H200 (139.8 GiB). ``context_bytes`` (the CUDA
context, cuBLAS/cuDNN handles' code and the driver's own reservations, outside the caching allocator) is an
**estimate**: it depends on the driver, the CUDA version and lazy module loading, and was not measured per
card. The cuBLAS workspace is 32 MiB per handle on compute capability 9.x (seen on the H200: one 32 MiB
segment allocated at the first matmul and kept) and PyTorch's 4 MiB default below it (not measured here);
``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KiB:COUNT`` pairs) overrides both.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import attrs

from ..errors import PlanOnlyDeviceError, UnknownDeviceError
from .budget import format_bytes
from .cuda_allocator import allocator_settings

__all__ = ["Device", "device_named", "known_devices", "UnknownDeviceError", "cublas_workspace", "PlanOnlyDeviceError"]

MiB = 2**20
GiB = 2**30


def cublas_workspace(capability: tuple[int, int], environ: Mapping[str, str] = os.environ) -> int:
    """The bytes one cuBLAS handle keeps as its workspace (one per handle and stream, allocated through the
    caching allocator at the first matmul and kept): ``CUBLAS_WORKSPACE_CONFIG``'s ``:SIZE_KiB:COUNT`` pairs
    summed where set, else 32 MiB on compute capability 9.x and above (measured on an H200), 4 MiB below."""
    conf = environ.get("CUBLAS_WORKSPACE_CONFIG", "")
    pairs = re.findall(r":(\d+):(\d+)", conf)
    if pairs:
        return sum(int(size) * 1024 * int(count) for size, count in pairs)
    return 32 * MiB if capability >= (9, 0) else 4 * MiB


class _Settings(dict):
    """The allocator's options: a dict that hashes (a :class:`Device` is a value, kept in sets and as keys)."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))


def _parse_allocator(conf: str | Mapping[str, Any] | None) -> _Settings:
    if conf is None:
        return _Settings()
    if isinstance(conf, Mapping):
        return _Settings(conf)
    return _Settings(allocator_settings({"PYTORCH_ALLOC_CONF": conf}))


@attrs.frozen
class Device:
    """A CUDA device a step is planned for.

    - ``name``: as the table writes it (``"H100-80GB"``), or ``"cuda"`` / ``"cuda:N"`` for this process's own.
    - ``capacity_bytes``: the card's memory.
    - ``context_bytes``: what the CUDA context and the libraries' code take outside the caching allocator
      (an estimate for a named card; the driver's reading for this process's own).
    - ``fraction``: the share of ``capacity_bytes`` the process may reserve
      (``torch.cuda.set_per_process_memory_fraction``; 1.0 for none).
    - ``capability``: the compute capability, (major, minor).
    - ``allocator``: :class:`~stagetorch.devices.cuda_allocator.CachingAllocatorModel`'s options
      (``{"expandable_segments": True}``); empty for PyTorch's defaults.
    - ``workspace_bytes``: the cuBLAS workspace of one handle (:func:`cublas_workspace`).
    - ``local``: True for this process's own device (a step staged for it runs); False for a named card, which
      is planned on fake CUDA tensors and cannot run here.
    """

    name: str
    capacity_bytes: int
    context_bytes: int
    capability: tuple[int, int]
    fraction: float = 1.0
    allocator: Mapping[str, Any] = attrs.field(factory=dict, converter=_parse_allocator)
    workspace_bytes: int | None = None
    local: bool = False

    def __attrs_post_init__(self) -> None:
        if self.workspace_bytes is None:
            object.__setattr__(self, "workspace_bytes", cublas_workspace(self.capability))
        if not 0 < self.fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], not {self.fraction}")

    @property
    def usable_bytes(self) -> int:
        """What the caching allocator may reserve: the process's fraction of the card, less the context
        (the allocator checks the fraction against its reserved bytes; the context is outside it)."""
        return max(min(int(self.fraction * self.capacity_bytes), self.capacity_bytes - self.context_bytes), 0)

    def with_allocator(self, conf: str | Mapping[str, Any]) -> Device:
        """This device with the caching allocator configured as ``conf`` says (``"expandable_segments:True"``,
        as ``PYTORCH_ALLOC_CONF`` writes it, or the options as a dict)."""
        return attrs.evolve(self, allocator=_parse_allocator(conf))

    def with_fraction(self, fraction: float) -> Device:
        """This device with a per-process memory fraction (``torch.cuda.set_per_process_memory_fraction``)."""
        return attrs.evolve(self, fraction=fraction)

    def describe(self) -> str:
        alloc = ", ".join(f"{k}={v}" for k, v in sorted(self.allocator.items())) or "default allocator"
        fraction = f", fraction {self.fraction:g}" if self.fraction != 1 else ""
        return (f"{self.name} ({format_bytes(self.capacity_bytes)}, compute capability {self.capability[0]}."
                f"{self.capability[1]}; usable {format_bytes(self.usable_bytes)} after a CUDA context of about "
                f"{format_bytes(self.context_bytes)}{fraction}; {alloc}; cuBLAS workspace "
                f"{format_bytes(self.workspace_bytes)})")


# The CUDA context's estimate: larger on Ampere and later (more kernels' modules, even loaded lazily).
_CTX_NEW, _CTX_OLD = 512 * MiB, 384 * MiB

# name -> (capacity in MiB as nvidia-smi reports it, compute capability). Aliases below.
_TABLE: dict[str, tuple[int, tuple[int, int]]] = {
    "H100-80GB": (81559, (9, 0)),  # SXM5 / PCIe, HBM3 / HBM2e
    "H100-94GB": (95830, (9, 0)),  # H100 NVL
    "H200": (int(139.8 * 1024), (9, 0)),  # 141 GB HBM3e: 139.8 GiB as torch reported it on the project's H200
    "A100-40GB": (40960, (8, 0)),
    "A100-80GB": (81920, (8, 0)),
    "L4": (23034, (8, 9)),
    "A10G": (23028, (8, 6)),
    "RTX-4090": (24564, (8, 9)),
    "RTX-3090": (24576, (8, 6)),
    "T4": (15360, (7, 5)),
    "V100-16GB": (16384, (7, 0)),
    "V100-32GB": (32768, (7, 0)),
}
_ALIASES = {
    "H100": "H100-80GB", "H100-SXM": "H100-80GB", "H100-PCIE": "H100-80GB", "H100-NVL": "H100-94GB",
    "H200-141GB": "H200", "A100": "A100-80GB", "4090": "RTX-4090", "3090": "RTX-3090", "V100": "V100-16GB",
}


def _key(name: str) -> str:
    """A name without case, spaces, dashes or underscores: ``"h100 80gb"``, ``"H100_80GB"`` -> ``"H10080GB"``."""
    return re.sub(r"[\s_\-]+", "", name).upper().removeprefix("NVIDIA").removeprefix("GEFORCE")


_BY_KEY = {_key(n): n for n in _TABLE} | {_key(a): n for a, n in _ALIASES.items()}


def known_devices() -> list[str]:
    """The names :func:`device_named` knows, as the table writes them."""
    return list(_TABLE)


def device_named(name: str | Device, allocator: str | Mapping[str, Any] | None = None) -> Device:
    """The :class:`Device` called ``name``: a GPU of the table (case, spaces and dashes do not matter:
    ``"h100 80gb"`` is ``"H100-80GB"``), or ``"cuda"`` / ``"cuda:N"`` for this process's own device (its
    memory, its per-process fraction, its allocator settings from ``PYTORCH_ALLOC_CONF``). ``allocator``:
    the caching allocator's settings for a named card (``"expandable_segments:True"``).

    Raises :class:`UnknownDeviceError` naming the known devices."""
    if isinstance(name, Device):
        return name if allocator is None else name.with_allocator(allocator)
    if not isinstance(name, str):
        raise TypeError(f"device must be a name such as 'H100-80GB' or a stagetorch Device, not {name!r}")
    if re.fullmatch(r"\s*cuda(:\d+)?\s*", name.lower()):
        device = this_process_device(name.strip().lower())
        return device if allocator is None else device.with_allocator(allocator)
    found = _BY_KEY.get(_key(name))
    if found is None:
        raise UnknownDeviceError(
            f"no GPU named {name!r} in stagetorch's table. Known: {', '.join(known_devices())} (case, spaces "
            "and dashes do not matter), or 'cuda' for this process's own device.\nWhat to do: use one of "
            "those names, or describe the card: stagetorch.devices.catalog.Device(name, capacity_bytes, "
            "context_bytes, capability)."
        )
    mib, capability = _TABLE[found]
    return Device(found, mib * MiB, _CTX_NEW if capability >= (8, 0) else _CTX_OLD, capability,
                  allocator=_parse_allocator(allocator))


def this_process_device(name: str = "cuda") -> Device:
    """This process's CUDA device as a :class:`Device`: its memory, its fraction, its compute capability,
    the allocator settings it runs with. Raises :class:`UnknownDeviceError` where there is no GPU."""
    import torch

    if not torch.cuda.is_available():
        raise UnknownDeviceError(
            f"device={name!r} means this process's own GPU, and torch sees none (torch.cuda.is_available() is "
            f"False).\nWhat to do: name the card to plan for, e.g. device='H100-80GB' ({', '.join(known_devices())})."
        )
    index = torch.device(name).index
    index = torch.cuda.current_device() if index is None else index
    props = torch.cuda.get_device_properties(index)
    free, total = torch.cuda.mem_get_info(index)
    read_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    fraction = 1.0 if read_fraction is None else float(read_fraction(index))
    # What the driver says is used that the caching allocator does not hold: the context (and other processes).
    context = max(int(total) - int(free) - torch.cuda.memory_reserved(index), 0)
    return Device(f"cuda:{index} ({props.name})", int(total), context, (props.major, props.minor), fraction,
                  _Settings(allocator_settings()), local=True)

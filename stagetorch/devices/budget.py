"""Memory available per device, and memory budgets written as strings ("512MiB").

On CUDA the budget is what this process can still get (:func:`cuda_budget`): the caching allocator's limits
are read through one function, :func:`cuda_memory`, which tests replace to plan for a device they do not have.
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from typing import NamedTuple

import torch

from ..utils import caches

__all__ = ["parse_bytes", "format_bytes", "free_memory", "cuda_memory", "cuda_budget", "CudaMemory", "device_type", "reset_peaks"]

log = logging.getLogger("stagetorch")

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(budget: int | str) -> int:
    """``"512MiB"`` -> 536870912; an int is taken as bytes."""
    if isinstance(budget, bool):
        raise TypeError("memory_budget must be a number of bytes or a string such as '512MiB', not a bool")
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"memory_budget must be positive, got {budget}")
        return budget
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(budget))
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"memory_budget {budget!r} is not a size: write bytes as an int, or e.g. '512MiB', '2GiB', '1.5GB'")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"memory_budget must be positive, got {budget!r}")
    return value


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def bytes_ceiling(n: int) -> int:
    """``n`` rounded up to what :func:`format_bytes` shows (a tenth of its unit), so that a budget copied
    from a message is enough."""
    unit = 1
    while n >= 1024 * unit and unit < 1024**4:
        unit *= 1024
    step = unit / 10 if unit > 1 else 1
    return int(math.ceil((n + 2) / step) * step)


def device_type(device: torch.device | str) -> str:
    """``device``'s type (``"cuda"``, ``"cpu"``), kept per device: ``torch.device.type`` makes a new string each
    call (0.7 us, per step)."""
    kind = _DEVICE_TYPES.get(device)
    if kind is None:
        kind = _DEVICE_TYPES[device] = (device if type(device) is torch.device else torch.device(device)).type
    return kind


class CudaMemory(NamedTuple):
    """What the caching allocator and the driver say about one CUDA device, in bytes."""

    free: int  # the driver's free memory on the device (every process's allocations left out)
    total: int  # the device's memory
    fraction: float  # this process's share of ``total`` (torch.cuda.set_per_process_memory_fraction; 1.0 unset)
    reserved: int  # the caching allocator's segments (torch.cuda.memory_reserved)
    allocated: int  # the live tensors in them (torch.cuda.memory_allocated)
    peak_reserved: int  # the most reserved since the peaks were reset (torch.cuda.max_memory_reserved)
    peak_allocated: int  # the most allocated since then (torch.cuda.max_memory_allocated)


def cuda_memory(device: torch.device) -> CudaMemory:
    """The allocator's and the driver's readings for ``device``: the one place stagetorch asks torch.cuda for
    them (tests replace it to plan for a device they do not have)."""
    free, total = torch.cuda.mem_get_info(device)
    # A torch without get_per_process_memory_fraction cannot read a fraction back: 1.0 then overstates a
    # capped process, and the recovery from an out-of-memory error finds the cap.
    read_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    fraction = 1.0 if read_fraction is None else float(read_fraction(device))
    # One call, unflattened: torch.cuda.memory_reserved & co. each make and flatten every statistic.
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    reserved, allocated = stats.get("reserved_bytes", {}).get("all", {}), stats.get("allocated_bytes", {}).get("all", {})
    return CudaMemory(
        int(free), int(total), fraction, reserved.get("current", 0), allocated.get("current", 0),
        reserved.get("peak", 0), allocated.get("peak", 0),
    )


def reset_peaks(device: torch.device) -> None:
    """Start :class:`CudaMemory`'s peaks afresh (torch.cuda.reset_peak_memory_stats)."""
    torch.cuda.reset_peak_memory_stats(device)


# What the allocator may round a new segment up to beyond the bytes asked for, once per pool: a large-pool
# allocation of 1-10 MiB takes a 20 MiB segment (kLargeBuffer), a small one a 2 MiB segment (kSmallBuffer)
# (c10/cuda/CUDACachingAllocator.cpp). Larger allocations round to 2 MiB: within the plan's 10% margin.
SEGMENT_MARGIN = (20 + 2) << 20


def cuda_budget(memory: CudaMemory) -> int:
    """The bytes this process can still allocate on a CUDA device: new segments up to the smaller of its
    per-process limit (``fraction * total``, which the allocator checks against its reserved bytes) and the
    driver's free memory, plus the bytes its segments hold free (reused without the driver), less
    :data:`SEGMENT_MARGIN`."""
    new_segments = min(int(memory.fraction * memory.total) - memory.reserved, memory.free)
    return max(new_segments + memory.reserved - memory.allocated - SEGMENT_MARGIN, 0)


def free_memory(device: torch.device, budget: int | str | None = None, resident: int = 0) -> int:
    """The bytes a step may use on ``device``: the budget if given, else what the device has free.

    On CUDA, what the process can get: :func:`cuda_budget` plus ``resident``, the bytes of the step's own
    inputs already allocated there (a plan counts them). A larger budget is planned as that, and said once."""
    kind = _DEVICE_TYPES.get(device)  # device_type, inline (a step's hot path)
    if kind is None:
        kind = device_type(device)
    if kind == "cuda":
        if type(device) is not torch.device:
            device = torch.device(device)
        can_get = cuda_budget(cuda_memory(device)) + resident
        if budget is None:
            return can_get
        asked = parse_bytes(budget)
        if asked <= can_get:
            return asked
        if (device, budget) not in _SAID:
            _SAID.add((device, budget))
            log.warning(
                "stagetorch: memory_budget=%r is more than this process can still get on %s (%s: its "
                "per-process memory fraction, the driver's free memory and the allocator's cached bytes): "
                "steps are planned for what it can get.", budget, device, format_bytes(can_get),
            )
        return can_get
    if budget is not None:
        return parse_bytes(budget)
    # Host memory: read from /proc (a system call and a parse, ~5-10 us) at most every 50 ms; a training
    # step asks once per step, and the free host memory does not move by a plan's margin in that time.
    now = time.monotonic()
    read_at, free = _HOST_FREE
    if now - read_at > _HOST_FREE_TTL:
        free = int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        _HOST_FREE[:] = [now, free]
    return free


_SAID: set = set()  # (device, budget) pairs whose budget was said to be more than the process can get
_HOST_FREE: list = [float("-inf"), 0]  # (when read, bytes free)
_DEVICE_TYPES: dict = {}  # device (or its name) -> its type
_HOST_FREE_TTL = 0.05
caches.on_clear(lambda: _HOST_FREE.__setitem__(slice(None), [float("-inf"), 0]))

"""Memory available per device, and memory budgets written as strings ("512MiB")."""

from __future__ import annotations

import math
import os
import re
import time

import torch

from . import _caches

__all__ = ["parse_bytes", "format_bytes", "free_memory"]

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


def free_memory(device: torch.device, budget: int | str | None = None) -> int:
    """The bytes a step may use on ``device``: the budget if given, else what the device has free."""
    if budget is not None:
        return parse_bytes(budget)
    kind = _DEVICE_TYPES.get(device)  # (torch.device.type makes a new string each call: 0.7 us, per step)
    if kind is None:
        kind = _DEVICE_TYPES[device] = (device if type(device) is torch.device else torch.device(device)).type
    if kind == "cuda":
        if type(device) is not torch.device:
            device = torch.device(device)
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    # Host memory: read from /proc (a system call and a parse, ~5-10 us) at most every 50 ms; a training
    # step asks once per step, and the free host memory does not move by a plan's margin in that time.
    now = time.monotonic()
    read_at, free = _HOST_FREE
    if now - read_at > _HOST_FREE_TTL:
        free = int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        _HOST_FREE[:] = [now, free]
    return free


_HOST_FREE: list = [float("-inf"), 0]  # (when read, bytes free)
_DEVICE_TYPES: dict = {}  # device (or its name) -> its type
_HOST_FREE_TTL = 0.05
_caches.on_clear(lambda: _HOST_FREE.__setitem__(slice(None), [float("-inf"), 0]))

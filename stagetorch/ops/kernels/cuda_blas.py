"""The workspaces cuBLAS and cuBLASLt hold on a CUDA device: resident, once per process and stream.

PyTorch gives each (cuBLAS handle, stream) pair one workspace, allocated through the caching allocator at the
first matmul on it and kept until the process ends (``aten/src/ATen/cuda/CublasHandlePool.cpp``): like the CUDA
context, it is resident, not an op's transient. A handle belongs to a thread, so a step whose matmuls all run on
one thread and one stream (a staged program; eager forward *and* backward run on two threads, the autograd
engine's device thread being the second) holds one.

- cuBLAS: ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE:COUNT`` pairs, SIZE in KiB, summed), else 32 MiB on sm90
  (Hopper: H100, H200) and 4096 KiB x 2 + 16 KiB x 8 (8,519,680 B) on every other capability.
- cuBLASLt (the fused bias epilogues of ``addmm``/``linear``): a pool of its own, ``CUBLASLT_WORKSPACE_SIZE`` KiB
  (1024 by default) capped at the cuBLAS size, allocated right after the cuBLAS one; only
  ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=1`` makes it share cuBLAS's.

The H200's trace of GPT-2 124M (torch 2.11, tests/support/data/cuda-traces) shows both: a 32 MiB block (a segment of
its own) and a 1 MiB block (in the small pool's 2 MiB segment) allocated one after the other at the first matmul
and never freed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

__all__ = ["cublas_workspace", "cublaslt_workspace", "resident_workspaces"]

_PAIR = re.compile(r":([0-9]+):([0-9]+)")


def cublas_workspace(capability: tuple[int, int] = (9, 0), env: Mapping[str, str] | None = None) -> int:
    """Bytes of one cuBLAS workspace on a device of ``capability`` with ``env``'s settings (default: this
    process's environment)."""
    env = os.environ if env is None else env
    default = 4096 * 8 * 1024 if tuple(capability) == (9, 0) else 4096 * 1024 * 2 + 16 * 1024 * 8
    config = env.get("CUBLAS_WORKSPACE_CONFIG")
    if not config:
        return default
    pairs = _PAIR.findall(config)
    if not pairs:
        return default  # PyTorch warns and keeps its default
    return sum(int(size) * 1024 * int(count) for size, count in pairs)


def cublaslt_workspace(capability: tuple[int, int] = (9, 0), env: Mapping[str, str] | None = None) -> int:
    """Bytes of the cuBLASLt workspace a stream gets apart from cuBLAS's (0 when the two are unified)."""
    env = os.environ if env is None else env
    if env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "").strip().lower() in ("1", "true", "on", "yes"):
        return 0
    try:
        kib = int(env.get("CUBLASLT_WORKSPACE_SIZE", "1024"))
    except ValueError:
        kib = 1024
    return min(kib * 1024, cublas_workspace(capability, env))


def resident_workspaces(capability: tuple[int, int] = (9, 0), env: Mapping[str, str] | None = None,
                        streams: int = 1, lt: bool = True) -> list[int]:
    """The resident allocations a process's matmuls make on one device: per stream (and thread) one cuBLAS
    workspace and, where the Lt path runs (``lt``), one cuBLASLt workspace; in the order they are allocated."""
    one = [cublas_workspace(capability, env)]
    if lt and cublaslt_workspace(capability, env):
        one.append(cublaslt_workspace(capability, env))
    return one * streams

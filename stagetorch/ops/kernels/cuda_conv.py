"""An upper bound on the workspace cuDNN takes for one convolution call on a CUDA device.

With ``torch.backends.cudnn.benchmark`` off, PyTorch asks cuDNN's heuristics for a ranked list of engines and
runs the first whose workspace the caching allocator can give (``Conv_v8.cpp``: each candidate's workspace is
allocated through the allocator, so it counts in ``max_memory_allocated``, and freed when the call returns);
with it on, it times the candidates once and keeps the fastest. Either way the size is the engine's and is
known only at run time, so a plan can only bound it. The bound here:

- forward: the larger of the input and the output feature map;
- backward (data and weight gradients): the input and the output gradient together;
- plus ``PER_CALL`` (4 MiB) of small scratch per call;
- at most the cap ``CUDNN_CONV_WSCAP_DBG`` sets (MiB), where it is set: PyTorch drops the engines whose workspace
  exceeds it.

It is calibrated, not derived: on an H200 (torch 2.11, cuDNN 9, fp32 with TF32 on, benchmark off) a ResNet-ish
CNN's whole step peaked inside a 3x3 convolution's backward, 2.06 feature maps (+2.3 MB) above the plan's tensors
(tests/devices/test_gpu_measurements.py); the bound takes the plan from -5.3% to +0.05% of the measured
``max_memory_allocated``. A GPU that picks larger workspaces (``benchmark=True`` with a big free pool, FFT
engines) can exceed it; ``torch.backends.cudnn`` settings are not read.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

__all__ = ["PER_CALL", "workspace_cap", "forward_workspace", "backward_workspace"]

PER_CALL = 4 * 2**20


def workspace_cap(env: Mapping[str, str] | None = None) -> int | None:
    """The workspace cap ``CUDNN_CONV_WSCAP_DBG`` (MiB) sets in ``env`` (default: this process's), in bytes."""
    value = (os.environ if env is None else env).get("CUDNN_CONV_WSCAP_DBG")
    try:
        return int(value) * 2**20 if value else None
    except ValueError:
        return None


def _capped(nbytes: int, env: Mapping[str, str] | None) -> int:
    cap = workspace_cap(env)
    return nbytes if cap is None else min(nbytes, cap)


def forward_workspace(x: Any, out: Any, env: Mapping[str, str] | None = None) -> int:
    """Bytes bounded for a forward convolution of input aval ``x`` into output aval ``out``."""
    return _capped(max(x.nbytes, out.nbytes) + PER_CALL, env)


def backward_workspace(grad: Any, x: Any, env: Mapping[str, str] | None = None) -> int:
    """Bytes bounded for ``convolution_backward`` of output gradient ``grad`` at input ``x``."""
    return _capped(grad.nbytes + x.nbytes + PER_CALL, env)

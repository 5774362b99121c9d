"""OpInfo samples (float32, CPU), collected once per test session."""

from __future__ import annotations

import functools
import itertools

import torch
from torch.testing._internal.common_methods_invocations import op_db

SAMPLES_PER_OP = 2


@functools.cache
def samples(requires_grad: bool = False) -> list:
    out = []
    for info in op_db:
        if torch.float32 not in info.supported_dtypes("cpu"):
            continue
        try:
            got = list(itertools.islice(info.sample_inputs("cpu", torch.float32, requires_grad=requires_grad), SAMPLES_PER_OP))
        except Exception:  # a sample generator that fails on this build of torch
            continue
        for i, s in enumerate(got):
            if isinstance(s.input, torch.Tensor) and s.input.layout == torch.strided:
                out.append((info, s, f"{info.name}.{info.variant_test_name}-{i}"))
    return out

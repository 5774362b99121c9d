"""OpInfo samples (CPU), collected once per test session and dtype."""

from __future__ import annotations

import functools
import itertools

import torch
from torch.testing._internal.common_methods_invocations import op_db

SAMPLES_PER_OP = 4


@functools.cache
def samples(requires_grad: bool = False, dtype: torch.dtype = torch.float32) -> list:
    out = []
    for info in op_db:
        if dtype not in info.supported_dtypes("cpu"):
            continue
        torch.manual_seed(0)  # each op's samples the same, whichever test asks first
        try:
            # The generator itself, not OpInfo.sample_inputs: that wrapper inspects the whole call stack once
            # per call to find the running test's skips, about 20 ms under pytest, and we use none of them.
            got = list(itertools.islice(info.sample_inputs_func(info, "cpu", dtype, requires_grad), SAMPLES_PER_OP))
        except Exception:  # a sample generator that fails on this build of torch
            continue
        for i, s in enumerate(got):
            if isinstance(s.input, torch.Tensor) and s.input.layout == torch.strided:
                out.append((info, s, f"{info.name}.{info.variant_test_name}-{i}"))
    return out

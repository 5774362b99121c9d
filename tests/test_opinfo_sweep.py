"""A sweep of PyTorch's OpInfo samples (float32, CPU) through stagetorch.eval_shape.

Each sample either agrees with real execution (shapes, dtypes, output structure), or is refused with a
named stagetorch error: a subclass of StagingError, never the base class, and for an op without a meta
kernel the ``stagetorch.ops.register`` call that fixes it. A wrong answer or a raw exception fails the
sweep. Run with -s for the counts.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.utils._pytree as pytree
from opinfo_util import samples

import stagetorch


def _classify(info, s) -> str:
    def fn(x):
        return info.op(x, *s.args, **s.kwargs)

    try:
        real = fn(s.input)
    except Exception:
        return "skipped"  # the op rejects its own sample on this build
    try:
        abstract = stagetorch.eval_shape(fn)(s.input)
    except stagetorch.StagingError as e:
        if type(e) is stagetorch.StagingError:
            return f"raw: the bare StagingError base class: {str(e)[:120]}"
        if "meta kernel" in str(e) and "stagetorch.ops.register(" not in str(e):
            return f"raw: a missing meta kernel without the register call that fixes it: {str(e)[:120]}"
        return "refused"
    except Exception as e:  # never acceptable: every failure must be a named stagetorch error
        return f"raw: {type(e).__name__}: {str(e)[:120]}"
    real_leaves, real_tree = pytree.tree_flatten(real)
    leaves, tree = pytree.tree_flatten(abstract)
    if real_tree != tree:
        return "wrong: structure"
    for r, a in zip(real_leaves, leaves):
        mismatch = not isinstance(a, stagetorch.Aval) or (tuple(r.shape), r.dtype) != (a.shape, a.dtype)
        if isinstance(r, torch.Tensor) and mismatch:
            return f"wrong: {a} vs {tuple(r.shape)} {r.dtype}"
    return "agree"


# Deprecated ops (torch.lu, torch.qr...) warn on every call; under this suite's warnings-as-errors they would
# count as skipped, and the sweep is about shapes.
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_opinfo_sweep_through_eval_shape():
    counts: collections.Counter = collections.Counter()
    bad = []
    for info, s, name in samples():
        outcome = _classify(info, s)
        counts[outcome.split(":")[0]] += 1
        if outcome.startswith(("wrong", "raw")):
            bad.append(f"{name}: {outcome}")
    print("\nOpInfo eval_shape sweep: " + " ".join(f"{k}={counts[k]}" for k in ("agree", "refused", "wrong", "raw", "skipped")))
    assert counts["agree"] > 500
    assert not bad, "\n".join(bad[:30])

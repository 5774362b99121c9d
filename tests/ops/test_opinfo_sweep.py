"""A sweep of PyTorch's OpInfo samples (float32, CPU) through stagetorch.eval_shape.

Each sample either agrees with real execution (shapes, dtypes, output structure), or is refused with a
named stagetorch error: a subclass of StagingError, never the base class, and for an op without a meta
kernel the ``stagetorch.ops.register`` call that fixes it. A wrong answer or a raw exception fails the
sweep. A second sweep checks the strides the tracer gives every ATen call's outputs against the CPU
kernel's, on inputs laid out column-major. Run with -s for the counts.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.utils._pytree as pytree
from opinfo_util import samples
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import stagetorch
from stagetorch.staging.recorder import _relayout


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


def _transposed(t):
    """The same values laid out column-major in the last two dims (a common non-contiguous layout)."""
    if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.ndim >= 2 and min(t.shape[-2:]) > 1:
        return t.mT.contiguous().mT
    return t


def _strides_differ(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Strides differ along a dim of more than one element (size-1 dims' strides mean nothing)."""
    return a.shape == b.shape and any(x != y and n > 1 for x, y, n in zip(a.stride(), b.stride(), a.shape))


class _Calls(TorchDispatchMode):
    """Every ATen call a sample makes, as the tracer would record it: its arguments as fake tensors with
    their metadata at the call (a FakeTensorMode of its own per call), and its real outputs."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        try:
            fake = pytree.tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, (args, kwargs))
        except Exception:
            fake = None
        out = func(*args, **kwargs)
        if fake is not None:
            self.calls.append((func, mode, fake, out))
        return out


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_traced_strides_are_the_kernels_on_transposed_inputs():
    """Every ATen call of every OpInfo sample, its tensors made column-major: the strides the tracer gives
    each output (the fake kernel's, corrected by the layout rules of stagetorch/ops/layout_rules.py) are the
    real CPU kernel's. A wrong stride makes the trace record a ``view`` that fails on the real tensor (a
    BatchNorm over a transposed activation crashed every staged step that way) or a copy eager does not
    make. In-place calls and random draws are left out (their replay on fake tensors is not the call)."""
    checked, bad = 0, {}
    for info, s, name in samples():
        args = pytree.tree_map(_transposed, (s.input, s.args, s.kwargs))
        recorder = _Calls()
        try:
            with recorder:
                info.op(args[0], *args[1], **args[2])
        except Exception:
            continue
        for func, mode, (fa, fk), out in recorder.calls:
            if func._schema.is_mutable or torch.Tag.nondeterministic_seeded in func.tags:
                continue
            try:
                with mode:
                    fake = func(*fa, **fk)
            except Exception:
                continue  # no fake kernel: the eval_shape sweep above covers those
            fake = _relayout(func, fa, fk, fake, mode)
            reals, fakes = pytree.tree_leaves(out), pytree.tree_leaves(fake)
            for r, f in zip(reals, fakes):
                if isinstance(r, torch.Tensor) and isinstance(f, torch.Tensor) and r.layout == torch.strided:
                    checked += 1
                    if _strides_differ(r, f):
                        bad.setdefault(str(func), f"{name}: {tuple(r.shape)} kernel {r.stride()} traced {f.stride()}")
    print(f"\nOpInfo calls on transposed inputs: {checked} outputs checked, {len(bad)} ops differ")
    assert checked > 2000
    assert not bad, "\n".join(f"{op}: {where}" for op, where in bad.items())

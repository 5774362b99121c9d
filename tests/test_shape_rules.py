"""Every explicit shape rule against real execution and the meta kernel.

ATen calls are captured from PyTorch's OpInfo samples, forward and backward, and from a forward+backward
step of each model in tests/models.py (which reaches the backward ops OpInfo does not).
"""

from __future__ import annotations

import collections
import contextlib

import models
import pytest
import torch
from opinfo_util import samples
from torch.utils._python_dispatch import TorchDispatchMode

import stagetorch
from stagetorch.ir import Aval
from stagetorch.ops._registry import slot
from stagetorch.shapes import meta_eval

CALLS_PER_OP = 6
# Meta kernels that disagree with the real CPU kernel; the explicit rule follows the real one.
META_DIFFERS = {torch.ops.aten.native_batch_norm.default, torch.ops.aten._native_batch_norm_legit.default}


class Capture(TorchDispatchMode):
    """Keeps (op, args, kwargs, outputs) for ops with an explicit shape rule, a few per op."""

    def __init__(self, calls):
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if slot(func, "shape") is not None and len(self.calls[func]) < CALLS_PER_OP:
            self.calls[func].append((args, kwargs, out))
        return out


def _flat(out):
    if isinstance(out, (tuple, list)):
        return [y for x in out for y in _flat(x)]
    return [out]


def _abstract(tree):
    if isinstance(tree, torch.Tensor):
        return Aval.of(tree)
    if isinstance(tree, (list, tuple)):
        return type(tree)(_abstract(x) for x in tree)
    if isinstance(tree, dict):
        return {k: _abstract(v) for k, v in tree.items()}
    return tree


@pytest.fixture(scope="module")
def calls():
    captured = collections.defaultdict(list)
    with Capture(captured):
        for info, s, _ in samples(requires_grad=True):
            with contextlib.suppress(Exception):
                out = info.op(s.input, *s.args, **s.kwargs)
                first = _flat(out)[0]
                if isinstance(first, torch.Tensor) and first.requires_grad and first.is_floating_point():
                    first.sum().backward()
        for name, factory in {**models.CLASSIFIERS, "gpt2": models.gpt2}.items():
            model, make = factory()
            step = models.gpt2_step if name == "gpt2" else models.train_step
            step(model)(*make(4))
    return captured


def test_at_least_forty_packets_have_explicit_shape_rules():
    packets = {getattr(op, "overloadpacket", op) for op, rule in stagetorch.ops.rules().items() if rule.shape}
    assert len(packets) >= 40, len(packets)


def test_every_shape_rule_is_exercised(calls):
    ruled = {op for op, rule in stagetorch.ops.rules().items() if rule.shape}
    hit = {getattr(f, "overloadpacket", f) for f in calls} | set(calls)
    missing = sorted(str(op) for op in ruled if op not in hit)
    assert len(missing) <= len(ruled) // 5, f"rules no capture exercised: {missing}"


def test_shape_rules_agree_with_real_execution_and_meta(calls):
    checked, wrong = 0, []
    for func, cases in calls.items():
        rule = slot(func, "shape")
        for args, kwargs, out in cases:
            a_args, a_kwargs = _abstract(args), _abstract(kwargs)
            try:
                predicted = [o if isinstance(o, Aval) else None for o in _flat(rule(*a_args, **a_kwargs))]
            except Exception as e:  # a rule refusing what the kernel accepted
                wrong.append(f"{func}: rule raised {e!r} on {a_args} {a_kwargs}")
                continue
            real = [Aval.of(t) if isinstance(t, torch.Tensor) else None for t in _flat(out)]
            meta = meta_eval(func, a_args, a_kwargs)
            for p, r, m in zip(predicted, real, meta):
                if r is None:
                    continue
                meta_ok = (m.shape, m.dtype) == (r.shape, r.dtype) or func in META_DIFFERS
                if p is None or (p.shape, p.dtype) != (r.shape, r.dtype) or not meta_ok:
                    wrong.append(f"{func}: rule {p} meta {m} real {r}")
            checked += 1
    assert checked > 200
    assert not wrong, "\n".join(wrong[:20])


@pytest.mark.parametrize(
    "fn, args, match",
    [
        (lambda a, b: a @ b, (torch.randn(4, 3), torch.randn(5, 2)), r"aten.mm: contraction dims differ: f32\[4,3\] @ f32\[5,2\]"),
        (lambda a: a.view(7, -1), (torch.randn(4, 3),), r"shape \[7, -1\] is invalid for 12 elements"),
        (lambda a, b: a + b, (torch.randn(4, 3), torch.randn(5, 3)), "broadcast"),
        (lambda a: a.expand(3, 5), (torch.randn(4, 1),), "cannot expand"),
    ],
)
def test_rules_refuse_what_the_kernel_refuses(fn, args, match):
    graph_error = None
    try:
        fn(*args)
    except RuntimeError as e:
        graph_error = e
    assert graph_error is not None
    with pytest.raises(stagetorch.ShapeError, match=match):
        stagetorch.eval_shape(fn)(*args)

"""Every explicit shape rule against the meta kernel and real CPU execution.

ATen calls are captured under a dispatch mode from PyTorch's OpInfo samples (float32 forward and backward,
then forward in other dtypes, so that type promotion is checked too), from a forward+backward step of each
model in tests/support/models.py (which reaches the backward ops OpInfo does not), and from direct calls to the few
ops that neither reaches on CPU. Each rule must agree with both on every call it is given, and refuse with a
``ShapeError`` naming the op what the kernels refuse.
"""

from __future__ import annotations

import collections
import contextlib
import warnings

import models
import pytest
import torch
import torch.utils._pytree as pytree
from opinfo_util import samples
from torch.utils._python_dispatch import TorchDispatchMode

import stagetorch
from stagetorch.interpreters.shapes import meta_eval
from stagetorch.ir import Aval
from stagetorch.registry import slot

aten = torch.ops.aten

CALLS_PER_SIGNATURE = 2
OTHER_DTYPES = (torch.float64, torch.bfloat16, torch.int64, torch.bool, torch.complex64)

# Outputs whose meta kernel disagrees with the real CPU kernel; the rule follows the real one.
META_DIFFERS = {
    aten.native_batch_norm.default: {1, 2},  # eval mode: the CPU kernel saves empty statistics
    aten._native_batch_norm_legit.default: {1, 2},
    aten.native_layer_norm.default: {1, 2},  # bfloat16 input: the CPU kernel keeps bfloat16 statistics
}
# Outputs the real kernel sizes while it runs (oneDNN's workspace); the rule follows the meta kernel.
SIZED_AT_RUN_TIME = {aten.mkldnn_rnn_layer.default: {3}}
# Ops whose kernels size an output from the data, with no meta kernel: the rule gives an upper bound for
# those outputs (each dim at least the real one's, the same dtype) and the real shape for the others. CTC's
# alignment table is as wide as twice the longest target length plus one; the rule takes the padded targets'
# width (stagetorch/ops/losses.py).
BOUNDED = {aten._ctc_loss: {1}, aten._ctc_loss_backward: set()}

RULED_OPS = sorted((op for op, rule in stagetorch.ops.rules().items() if rule.shape), key=str)


def _entry(func: torch._ops.OpOverload) -> torch._ops.OpOverload | torch._ops.OpOverloadPacket:
    """The registry key whose shape rule serves ``func``: its own overload's, else its packet's."""
    own = stagetorch.ops.rules().get(func)
    return func if own is not None and own.shape is not None else func.overloadpacket


class Capture(TorchDispatchMode):
    """Keeps a few (op, args, kwargs, outputs) per op and input dtypes, for ops with an explicit shape rule."""

    def __init__(self, calls: dict) -> None:
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if slot(func, "shape") is not None:
            dtypes = tuple(t.dtype for t in _flat([args, kwargs]) if isinstance(t, torch.Tensor))
            cases = self.calls[_entry(func)]
            if sum(1 for c in cases if c[0] == (func, dtypes)) < CALLS_PER_SIGNATURE:
                # Only metadata is compared; snapshot it now, since a later in-place op (matmul's squeeze_ of
                # an integer mm's result) changes the very tensor objects.
                cases.append(((func, dtypes), _snapshot(args), _snapshot(kwargs), _snapshot(out)))
        return out


def _snapshot(tree):
    def copy(t):
        if isinstance(t, torch.Tensor) and t.layout == torch.strided:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        return t

    return pytree.tree_map(copy, tree)


def _flat(tree):
    if isinstance(tree, (tuple, list)):
        return [y for x in tree for y in _flat(x)]
    if isinstance(tree, dict):
        return _flat(list(tree.values()))
    return [tree]


def _abstract(tree):
    if isinstance(tree, torch.Tensor):
        return Aval.of(tree)
    if isinstance(tree, (list, tuple)):
        return type(tree)(_abstract(x) for x in tree)
    if isinstance(tree, dict):
        return {k: _abstract(v) for k, v in tree.items()}
    return tree


def _with_grad(x):
    return x.detach().requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _run_sample(info, s, *, backward: bool) -> None:
    with contextlib.suppress(Exception):  # a sample this build's kernel rejects teaches nothing here
        x = _with_grad(s.input) if backward else s.input
        first = _flat(info.op(x, *s.args, **s.kwargs))[0]
        if backward and isinstance(first, torch.Tensor) and first.requires_grad:
            first.sum().backward()


# Ops that OpInfo and the models do not reach on CPU (the fused dropout kernel is CUDA's choice;
# lift_fresh_copy appears when a tensor constant is made under functionalization), and calls that OpInfo's
# samples do not make: operands of different dtypes, a mask that broadcasts the tensor it fills.
DIRECT_CALLS = (
    lambda: aten.native_dropout(torch.randn(4, 5), 0.5, True),
    lambda: aten.native_dropout(torch.randn(3, dtype=torch.float64), 0.0, False),
    lambda: aten.lift_fresh_copy(torch.randn(2, 3)),
    lambda: aten.mse_loss(torch.randn(3), torch.randn(3, dtype=torch.float64)),
    lambda: aten.mse_loss(torch.randn(2, 3, dtype=torch.bfloat16), torch.randn(3), 0),
    lambda: aten.masked_fill(torch.zeros(3), torch.ones(2, 3, dtype=torch.bool), 1.5),
    lambda: aten.masked_fill(torch.zeros(3, dtype=torch.int64), torch.ones(2, 1, dtype=torch.bool), 1.5),
    lambda: aten.div(torch.arange(4), torch.arange(1, 5, dtype=torch.int32), rounding_mode="floor"),
    # The grouped product in bfloat16, the one dtype its meta kernel takes (float32: tests/ops/test_moe.py).
    lambda: aten._grouped_mm(torch.randn(10, 8, dtype=torch.bfloat16), torch.randn(3, 8, 16, dtype=torch.bfloat16),
                             torch.tensor([3, 3, 8], dtype=torch.int32)),
)


@pytest.fixture(scope="module")
def calls() -> dict:
    captured: dict = collections.defaultdict(list)
    # Deprecated ops warn on every call, which this suite's warnings-as-errors would turn into lost samples.
    with warnings.catch_warnings(), Capture(captured):
        warnings.simplefilter("ignore", UserWarning)
        for info, s, _ in samples():
            _run_sample(info, s, backward=True)
        for dtype in OTHER_DTYPES:
            for info, s, _ in samples(dtype=dtype):
                _run_sample(info, s, backward=False)
        for name, factory in {**models.CLASSIFIERS, "gpt2": models.gpt2}.items():
            model, make = factory()
            step = models.gpt2_step if name == "gpt2" else models.train_step
            step(model)(*make(4))
        for call in DIRECT_CALLS:
            call()
    return captured


def check_call(func, args: tuple, kwargs: dict, out) -> list[str]:
    """What is wrong with ``func``'s shape rule on one real call: each output's (shape, dtype) from the rule,
    from the meta kernel and from the real kernel must be the same."""
    a_args, a_kwargs = _abstract(args), _abstract(kwargs)
    try:
        predicted = _flat(slot(func, "shape")(*a_args, **a_kwargs))
    except Exception as e:  # a rule refusing what the kernel accepted
        return [f"rule raised {e!r} on {a_args} {a_kwargs}"]
    real = [Aval.of(t) if isinstance(t, torch.Tensor) else None for t in _flat(out)]
    bounded = BOUNDED.get(getattr(func, "overloadpacket", func))
    if bounded is not None:
        if len(predicted) != len(real):
            return [f"rule gave {len(predicted)} outputs, the kernel {len(real)}"]
        problems = []
        for i, (p, r) in enumerate(zip(predicted, real)):
            if r is None:
                continue
            fits = isinstance(p, Aval) and p.dtype == r.dtype and len(p.shape) == len(r.shape) and (
                all(a >= b for a, b in zip(p.shape, r.shape)) if i in bounded else p.shape == r.shape)
            if not fits:
                problems.append(f"output {i}: rule {p}, real {r} on {a_args} {a_kwargs}")
        return problems
    meta = meta_eval(func, a_args, a_kwargs)
    if len(predicted) != len(real):
        return [f"rule gave {len(predicted)} outputs, the kernel {len(real)}"]
    problems = []
    for i, (p, r, m) in enumerate(zip(predicted, real, meta)):
        if r is None:
            continue
        reference = m if i in SIZED_AT_RUN_TIME.get(func, set()) else r
        meta_ok = (m.shape, m.dtype) == (r.shape, r.dtype) or i in META_DIFFERS.get(func, set()) | SIZED_AT_RUN_TIME.get(func, set())
        if not isinstance(p, Aval) or (p.shape, p.dtype) != (reference.shape, reference.dtype) or not meta_ok:
            problems.append(f"output {i}: rule {p}, meta {m}, real {r} on {a_args} {a_kwargs}")
    return problems


@pytest.mark.parametrize("op", RULED_OPS, ids=str)
def test_shape_rule_agrees_with_meta_and_real_kernels(op, calls):
    cases = calls.get(op, [])
    assert cases, f"no OpInfo sample, model or direct call reaches {op}: its rule is untested"
    problems = [f"{func} {p}" for (func, _), args, kwargs, out in cases for p in check_call(func, args, kwargs, out)]
    assert not problems, "\n".join(problems[:10])


def test_type_promotion_is_checked_beyond_float32(calls):
    signatures = {dtypes for cases in calls.values() for (_, dtypes), *_ in cases}
    assert {torch.int64, torch.bool, torch.complex64, torch.bfloat16} <= {d for s in signatures for d in s}


def test_at_least_forty_packets_have_explicit_shape_rules():
    assert len({getattr(op, "overloadpacket", op) for op in RULED_OPS}) >= 40


def _f32(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


def refusal(func, *args, match: str, meta_refuses: bool = True):
    return pytest.param(func, args, match, meta_refuses, id=str(func))


REFUSALS = [
    refusal(aten.mm.default, _f32(4, 3), _f32(5, 2), match=r"^aten\.mm: contraction dims differ: f32\[4,3\] @ f32\[5,2\]"),
    # The meta kernels of mm, addmm and convolution accept operands of different dtypes; the CPU kernels do not.
    refusal(aten.mm.default, _f32(4, 3), torch.randn(3, 2, dtype=torch.float64), match=r"^aten\.mm: operands must have the same dtype", meta_refuses=False),
    refusal(aten.addmm.default, torch.randn(2, dtype=torch.float64), _f32(3, 4), _f32(4, 2), match=r"^aten\.addmm: operands must have the same dtype", meta_refuses=False),
    refusal(aten.bmm.default, _f32(2, 4, 3), _f32(3, 3, 5), match=r"^aten\.bmm: batch or contraction dims differ"),
    refusal(aten.add.Tensor, _f32(4, 3), _f32(5, 3), match=r"^aten\.add: shapes cannot broadcast at dim 0: 4 vs 5"),
    refusal(aten.where.self, torch.ones(2, dtype=torch.bool), _f32(3), _f32(3), match=r"^aten\.where: shapes cannot broadcast"),
    refusal(aten.view.default, _f32(4, 3), [7, -1], match=r"^aten\.view: shape \[7, -1\] is invalid for 12 elements"),
    refusal(aten.expand.default, _f32(4, 1), [3, 5], match=r"^aten\.expand: size 4 at dim 0 cannot expand to 3"),
    refusal(aten.permute.default, _f32(2, 3), [0, 0], match=r"^aten\.permute: \[0, 0\] is not a permutation"),
    refusal(aten.select.int, _f32(3, 2), 0, 3, match=r"^aten\.select: index 3 out of range"),
    refusal(aten.cat.default, [_f32(2, 3), _f32(2, 4)], 0, match=r"^aten\.cat: sizes must match except in dim 0"),
    refusal(aten.stack.default, [_f32(2, 3), _f32(2, 4)], match=r"^aten\.stack: expects tensors of equal size"),
    refusal(aten.split.Tensor, _f32(4, 3), 0, match=r"^aten\.split: split_size 0 cannot split dim 0 of size 4"),
    refusal(aten.constant_pad_nd.default, _f32(2, 3), [-2, -2], match=r"^aten\.constant_pad_nd: padding \[-2, -2\] leaves dim 1 with size -1"),
    refusal(aten.sum.dim_IntList, _f32(2, 3), [2], match=r"^aten\.sum: dim 2 out of range for 2 dims"),
    refusal(aten.convolution.default, _f32(1, 3, 8, 8), _f32(4, 2, 3, 3), None, [1], [0], [1], False, [0], 1,
            match=r"^aten\.convolution: input f32\[1,3,8,8\] has 3 channels, weight f32\[4,2,3,3\] with groups=1 expects 2"),
    refusal(aten.convolution.default, _f32(1, 3, 2, 2), _f32(4, 3, 3, 3), None, [1], [0], [1], False, [0], 1,
            match=r"^aten\.convolution: input f32\[1,3,2,2\] is too small for kernel"),
    refusal(aten.convolution.default, _f32(1, 3, 8, 8), torch.randn(4, 3, 3, 3, dtype=torch.float64), None, [1], [0], [1], False, [0], 1,
            match=r"^aten\.convolution: .* must have the same dtype", meta_refuses=False),
    refusal(aten.max_pool2d_with_indices.default, _f32(1, 1, 2, 2), [3, 3], match=r"^aten\.max_pool2d_with_indices: input f32\[1,1,2,2\] is too small"),
    refusal(aten.native_layer_norm.default, _f32(2, 5), [4], None, None, 1e-5, match=r"^aten\.native_layer_norm: normalized_shape \[4\] does not end input f32\[2,5\]"),
    refusal(aten.native_group_norm.default, _f32(2, 6, 4), None, None, 2, 6, 4, 4, 1e-5, match=r"^aten\.native_group_norm: 6 channels do not split into 4 groups"),
    refusal(aten.nll_loss_forward.default, _f32(4, 3), torch.zeros(5, dtype=torch.int64), None, 1, -100,
            match=r"^aten\.nll_loss_forward: input f32\[4,3\] and target i64\[5\] do not line up"),
]


@pytest.mark.parametrize("func, args, match, meta_refuses", REFUSALS)
def test_shape_rule_refuses_what_the_kernels_refuse(func, args, match, meta_refuses):
    with pytest.raises((RuntimeError, IndexError, ValueError)):
        func(*args)
    avals = _abstract(args)
    if meta_refuses:
        with pytest.raises(stagetorch.ShapeError):
            meta_eval(func, avals, {})
    with pytest.raises(stagetorch.ShapeError, match=match):
        slot(func, "shape")(*avals)


@pytest.mark.parametrize(
    "fn, args, match",
    [
        (lambda a, b: a @ b, (_f32(4, 3), _f32(5, 2)), r"aten\.mm: contraction dims differ: f32\[4,3\] @ f32\[5,2\]"),
        (lambda a: a.view(7, -1), (_f32(4, 3),), r"shape \[7, -1\] is invalid for 12 elements"),
        (lambda a, b: a + b, (_f32(4, 3), _f32(5, 3)), r"aten\.add: shapes cannot broadcast"),
    ],
)
def test_eval_shape_reports_the_rules_account_of_a_refusal(fn, args, match):
    with pytest.raises(RuntimeError):
        fn(*args)
    with pytest.raises(stagetorch.ShapeError, match=match):
        stagetorch.eval_shape(fn)(*args)


@pytest.mark.parametrize(
    "func, args, kwargs",
    [
        (aten.div.Tensor_mode, (8, 3), {"rounding_mode": "trunc"}),
        (aten.div.Tensor, (7, 2), {}),
        (aten.mul.Tensor, (8, 2), {}),
        (aten.add.Tensor, (8, 1.5), {}),
        (aten.add.Tensor, (True, False), {}),
    ],
    ids=str,
)
def test_numbers_only_give_the_0_dim_result_torch_gives(func, args, kwargs):
    """Issue 43: torch dispatches ``torch.div(8, 3)`` with both operands numbers; the rule gives torch's 0-dim
    result, promoted as torch promotes, rather than refusing a call with no tensor."""
    real = func(*args, **kwargs)
    assert slot(func, "shape")(*args, **kwargs) == Aval.of(real)

"""``draws_random``: which equations take numbers from the generator, checked against the generator itself.

An equation said to draw when it does not costs a lazy recording a whole-batch run of it on stand-ins, and a
chunked or recomputed step a saved generator state; one said not to draw when it does would leave the
generator elsewhere than eager (or give a recomputed chunk other numbers). Each case runs the op for real
and asks whether the default CPU generator moved.
"""

from __future__ import annotations

import pytest
import torch

import stagetorch
from stagetorch.transforms.schedule import draws_random

aten = torch.ops.aten
X = torch.randn(2, 3, 4, 5)

CASES = {
    "flash_cpu_p0": (aten._scaled_dot_product_flash_attention_for_cpu.default, (X, X, X, 0.0), {}),
    "flash_cpu_default_p": (aten._scaled_dot_product_flash_attention_for_cpu.default, (X, X, X), {}),
    "math_p0": (aten._scaled_dot_product_attention_math.default, (X, X, X, None, 0.0), {}),
    "math_p_kw0": (aten._scaled_dot_product_attention_math.default, (X, X, X), {"dropout_p": 0.0}),
    "math_p.1": (aten._scaled_dot_product_attention_math.default, (X, X, X, None, 0.1), {}),
    "native_dropout_p0_train": (aten.native_dropout.default, (X, 0.0, True), {}),
    "native_dropout_eval": (aten.native_dropout.default, (X, 0.5, False), {}),
    "native_dropout_train": (aten.native_dropout.default, (X, 0.5, True), {}),
    "bernoulli_p0": (aten.bernoulli_.float, (X.clone(), 0.0), {}),
    "rand_like": (aten.rand_like.default, (X,), {}),
}


def _eqn(op, args, kwargs):
    """The equation ``op(*args, **kwargs)`` as the tracer records it (tensors as vars)."""
    from stagetorch.ir import Aval, Eqn, Var

    def var(t):
        return Var(Aval.of(t)) if isinstance(t, torch.Tensor) else t

    return Eqn(op, tuple(var(a) for a in args), {k: var(v) for k, v in kwargs.items()}, ())


@pytest.mark.parametrize("name", list(CASES))
def test_draws_random_is_whether_the_generator_moves(name):
    op, args, kwargs = CASES[name]
    torch.manual_seed(0)
    before = torch.get_rng_state()
    if op._schema.is_mutable:
        args = (args[0].clone(), *args[1:])
    op(*args, **kwargs)
    moved = not torch.equal(before, torch.get_rng_state())
    assert draws_random(_eqn(op, args, kwargs)) == moved, (name, moved)


def test_a_first_lazy_call_does_not_draw_an_attention_kernel_of_no_dropout():
    """The MHA model's step (attention through SDPA, dropout_p 0): the first lazy call runs no draw at
    its call (each would run the kernel on stand-ins of the whole batch)."""
    from stagetorch.lazymode import recording

    drawn = []
    real = recording.draw_on_stand_ins
    model = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(6, 5, 8)
    stagetorch.clear_caches()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(recording, "draw_on_stand_ins", lambda e, *a: (drawn.append(e), real(e, *a)))
        lx = stagetorch.lazy(x, batch=0)
        out, _ = model(lx, lx, lx, need_weights=False)
        out.square().mean().backward()
    assert drawn == []
    assert all(p.grad is not None for p in model.parameters())

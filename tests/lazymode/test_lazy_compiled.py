"""``torch.compile``d modules and functions in one-line mode: each call on a lazy tensor breaks dynamo's graph
and runs as eager runs it, recorded like any other (stagetorch's own code is never compiled), so the step is
the uncompiled step's: whole and chunked, several SGD steps, against the same loop in plain PyTorch. Backend
``aot_eager``: dynamo and AOT autograd as ``inductor`` runs them, without inductor's C++ compile (minutes on a
2-core CPU), which never sees a lazy tensor's op anyway."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from budgets import budget_for

import stagetorch

pytestmark = pytest.mark.usefixtures("lazy_mode")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)).double()


@pytest.mark.parametrize("compiled", ["module", "function"])
@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_a_compiled_model_in_one_line_mode_is_eagers(compiled, chunked, monkeypatch):
    torch._dynamo.reset()
    model = _mlp()
    reference = copy.deepcopy(model)
    if compiled == "module":
        forward = torch.compile(model, backend="aot_eager")
    else:
        forward = torch.compile(lambda x: model[4](model[3](model[2](model[1](model[0](x))))), backend="aot_eager")
    x, y = torch.randn(64, 8, dtype=torch.float64), torch.randint(0, 4, (64,))
    budget = None
    if chunked:
        twin = copy.deepcopy(model)  # (the compiled function's closure is not one jit's state walk reaches)
        budget = budget_for(stagetorch.jit(lambda x, y: F.cross_entropy(twin(x), y).backward()), x, y)
    chunks = []
    run = stagetorch.runtime.executable.Executable.run

    def recorded(self, inputs, plan, **kwargs):
        chunks.append(len(plan.chunk_sizes))
        return run(self, inputs, plan, **kwargs)

    monkeypatch.setattr(stagetorch.runtime.executable.Executable, "run", recorded)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    for _ in range(3):
        chunks.clear()
        lx, ly = stagetorch.lazy(x, y, batch=0, memory_budget=budget)
        loss = F.cross_entropy(forward(lx), ly)
        loss.backward()
        expected = F.cross_entropy(reference(x), y)
        expected.backward()
        assert (max(chunks) > 1) == chunked, chunks
        torch.testing.assert_close(loss.detach().value(), expected.detach(), rtol=1e-12, atol=0)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-15)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


@pytest.mark.lazy_modes("record")  # (a jit step: no lazy session)
def test_jit_over_a_compiled_module_does_not_warn_of_its_own_hooks_and_is_eagers():
    """The tracer's global module hooks (for module paths) made a compiled module warn that global hooks fire
    twice: not the user's concern, so not shown (warnings are errors here); the step equals eager."""
    torch._dynamo.reset()
    model = _mlp()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="aot_eager")
    step = stagetorch.jit(lambda x, y: F.cross_entropy(compiled(x), y).backward())
    x, y = torch.randn(64, 8, dtype=torch.float64), torch.randint(0, 4, (64,))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    for _ in range(3):
        step(x, y)
        F.cross_entropy(reference(x), y).backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-15)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


@pytest.mark.lazy_modes("record")
def test_jit_over_a_compiled_module_still_warns_of_the_users_global_hooks():
    torch._dynamo.reset()
    model = _mlp()
    compiled = torch.compile(model, backend="aot_eager")
    step = stagetorch.jit(lambda x, y: F.cross_entropy(compiled(x), y).backward())
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    try:
        with pytest.warns(UserWarning, match="global hooks on modules"):
            step(torch.randn(8, 8, dtype=torch.float64), torch.randint(0, 4, (8,)))
    finally:
        handle.remove()

"""A write into a real tensor while lazy work that read it is pending: the work runs first, as eager's order.

``nn.Embedding(max_norm=...)`` renormalises the rows it looks up in place, under ``no_grad``, on every call:
called twice in a step, its second renorm writes the weight the first lookup (still pending) read. The
recorder binds an alias of the parameter, another Python object over the same storage, so the write was
not seen as one into a value pending work reads: the flush then raised ``ModifiedInputError`` (issue 43's
fuzz). Writes are matched to reads by storage now.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import stagetorch
from stagetorch.runtime.executable import Executable


def _model() -> torch.nn.ModuleDict:
    torch.manual_seed(0)
    return torch.nn.ModuleDict({"emb": torch.nn.Embedding(50, 8, max_norm=1.0), "head": torch.nn.Linear(8, 5)}).double()


def _step(model, x, x2, y):
    a, b = model["emb"](x).mean(1), model["emb"](x2).mean(1)  # two lookups, two renorms of the same weight
    loss = F.cross_entropy(model["head"](a + b), y)
    loss.backward()
    return loss


@pytest.mark.parametrize("budget", [None, "28KiB"])
def test_two_max_norm_lookups_in_one_lazy_step_equal_eager(budget):
    lazy_model, eager_model = _model(), _model()
    opts = [torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m in (lazy_model, eager_model)]
    g = torch.Generator().manual_seed(1)
    chunks = []
    run = Executable.run

    def recorded(self, inputs, plan, **kwargs):
        chunks.append(len(plan.chunk_sizes))
        return run(self, inputs, plan, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Executable, "run", recorded)
        for _ in range(3):
            x, x2 = torch.randint(0, 50, (48, 6), generator=g), torch.randint(0, 50, (48, 3), generator=g)
            y = torch.randint(0, 5, (48,), generator=g)
            for o in opts:
                o.zero_grad()
            loss = _step(lazy_model, *stagetorch.lazy(x, x2, y, batch=0, memory_budget=budget))
            torch.testing.assert_close(loss, _step(eager_model, x, x2, y), rtol=1e-12, atol=1e-12)
            for p, q in zip(lazy_model.parameters(), eager_model.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)  # the renorms, in eager's order
            for o in opts:
                o.step()
    if budget is not None:
        assert max(chunks) >= 2, chunks  # the backward's flush ran in chunks
    for p, q in zip(lazy_model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)

"""Every model of the transformers zoo (tiny configs, padded batches) planned for a named card from this
CPU-only machine, in float32 and with the step under CUDA's autocast: the report's figures are consistent
(allocated within reserved; the card's cuBLAS workspace inside both) and the plan under a budget below the
whole step's fits its reserved bytes."""

from __future__ import annotations

import pytest
import torch
from transformer_zoo import ZOO, make_batch, make_model

import stagetorch
from stagetorch.devices.catalog import device_named


def _float_batch(name: str) -> dict[str, torch.Tensor]:
    return {k: v.float() if v.is_floating_point() else v for k, v in make_batch(name).items()}


@pytest.mark.parametrize("name", sorted(ZOO))
def test_every_zoo_model_is_planned_for_a_named_card(name: str) -> None:
    model = make_model(name).float()
    batch = _float_batch(name)

    def step(**batch: torch.Tensor) -> torch.Tensor:
        loss = model(**batch).loss
        loss.backward()
        return loss

    card = device_named("A100-40GB")
    staged = stagetorch.jit(step, device=card)
    whole = staged.plan(**batch)
    assert whole.chunk_sizes == (len(next(iter(batch.values()))),)
    assert whole.reserved_bytes is not None and whole.reserved_bytes >= whole.peak
    # Under a budget below the whole step's reserved bytes: a plan whose reserved bytes fit it.
    budget = (whole.reserved_bytes - card.workspace_bytes) // 2 + card.workspace_bytes
    tight = stagetorch.jit(step, device=card, memory_budget=budget)
    try:
        plan = tight.plan(**batch)
    except stagetorch.OutOfMemoryError as e:  # a tiny model is mostly segments: say so by name, never raw
        assert "budget" in str(e)
        return
    assert plan.reserved_bytes is not None
    # A plan over the budget in reserved bytes only where nothing smaller runs (chunks of one: a tiny model's
    # blocks round up to the allocator's 2 and 20 MiB segments), and its reason says what it will reserve.
    assert plan.reserved_bytes <= budget or (max(plan.chunk_sizes) == 1 and "will reserve" in plan.reason)
    for p in model.parameters():
        assert p.grad is None  # planning ran nothing

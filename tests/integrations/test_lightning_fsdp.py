"""Lightning's ModelParallelStrategy (FSDP2) under stagetorch: ``StagedModelParallelStrategy`` on 2 gloo processes.

Each rank runs a Lightning ``Trainer`` whose LightningModule shards a float64 MLP with ``fully_shard`` (per
``Linear`` and at the root, over ``self.device_mesh["data_parallel"]``; rows that do not divide by 2, so FSDP2
pads them) in ``configure_model``, on its own DataLoader (``use_distributed_sampler=False``): shards of uneven
sizes of three global batches. The strategy's budget on each rank lies below that rank's unchunked peak, so its
steps run in chunks. The same rank trains a plain copy on each whole global batch with the same AdamW: the losses
and the parameters (gathered from the shards) must agree to float rounding; each rank's allocator peak during
its staged steps (the profiler's allocation events) must lie under its budget. With even shards (where
Lightning's mean of each rank's mean loss is the global batch's) the staged, chunked run equals Lightning's own
``ModelParallelStrategy``. Tensor parallelism is refused by name, the parameters and their .grad untouched.
"""

from __future__ import annotations

import copy
import functools
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from gloo_workers import result, spawn
from memtrack import AllocatorPeak

import stagetorch

L = pytest.importorskip("lightning.pytorch")

from stagetorch.integrations.lightning import StagedModelParallelStrategy  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

SIZES = [3, 6]  # each global batch, split over the two ranks (uneven)
STEPS = 3
LR = 1e-2


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 33), nn.Tanh(), nn.Linear(33, 17), nn.Tanh(), nn.Linear(17, 5)).double()


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    n = sum(SIZES)
    # 48 rows an example: the activations, not the parameters, are what a budget below the peak must cut.
    return torch.randn(n, 48, 7, dtype=torch.float64, generator=g), torch.randint(0, 5, (n, 48), generator=g)


def loss_of(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(net(x).flatten(0, 1), y.flatten())


class Sharded(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()
        self.losses: list[float] = []

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for m in self.net:
            if isinstance(m, nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch):
        return loss_of(self.net, *batch)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)


class Measured(StagedModelParallelStrategy):
    """Sets each rank's budget at its first step (halfway between the smallest it fits and its unchunked
    peak), and measures the allocator's peak of every staged step."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.record: dict = {"peaks": [], "plans": []}

    def training_step(self, batch):
        module = self.lightning_module
        if self.memory_budget is None:
            self.memory_budget = 2**40
            self.record["unchunked"] = self.plan(batch).peak
            self.memory_budget = 1024
            try:
                self.plan(batch)
            except stagetorch.errors.OutOfMemoryError as e:
                smallest = e.smallest_budget
            self.memory_budget = (smallest + self.record["unchunked"]) // 2
            self.record["budget"] = self.memory_budget
        plan = self.plan(batch)
        self.record["plans"].append((plan.peak, plan.chunk_sizes))
        # Alive through the step: the shards, the batch, the previous step's .grad (Lightning clears it after
        # training_step) and AdamW's state.
        resident = [p.to_local() for p in module.parameters()] + list(batch)
        resident += [p.grad.to_local() for p in module.parameters() if p.grad is not None]
        resident += [t.to_local() for st in self.optimizers[0].state.values() for t in st.values()
                     if isinstance(t, torch.Tensor) and hasattr(t, "to_local")]
        with AllocatorPeak(resident) as tracker:
            out = super().training_step(batch)
        self.record["peaks"].append(tracker.peak)
        return out


def _torchelastic_env(rank: int, world: int) -> None:
    """What torchrun sets: Lightning then takes the processes (and their process group) as launched."""
    os.environ.update({"TORCHELASTIC_RUN_ID": "stagetorch-test", "RANK": str(rank), "LOCAL_RANK": str(rank),
                       "GROUP_RANK": "0", "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"})


def _trainer(strategy, accumulate: int = 1) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, logger=False,
                     accumulate_grad_batches=accumulate,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     use_distributed_sampler=False)  # 32-true (no 64-true under ModelParallelStrategy): the model stays float64


def trains_exactly(rank: int) -> dict:
    _torchelastic_env(rank, dist.get_world_size())
    batches = [global_batch(i) for i in range(STEPS)]
    mine = [tuple(t.split(SIZES)[rank] for t in b) for b in batches]
    module = Sharded()
    reference = copy.deepcopy(module.net)
    strategy = Measured()
    _trainer(strategy).fit(module, torch.utils.data.DataLoader(mine, batch_size=None))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    ref_losses = []
    for x, y in batches:
        ref_opt.zero_grad()
        loss = loss_of(reference, x, y)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    return {
        **strategy.record,
        "losses": module.losses, "ref_losses": ref_losses,
        "dtensor": all(type(p).__name__ == "DTensor" for p in module.parameters()),
        # numpy, not tensors: a tensor goes back through shared memory, which a leaving process may close first.
        "params": [p.full_tensor().detach().numpy() for p in module.net.parameters()],  # a collective, in order
        "ref_params": [p.detach().numpy() for p in reference.parameters()],
    }


def tensor_parallel_refused(rank: int) -> dict:
    _torchelastic_env(rank, dist.get_world_size())
    module = Sharded()
    before = [p.detach().clone() for p in module.parameters()]
    try:
        _trainer(StagedModelParallelStrategy(tensor_parallel_size=2, data_parallel_size=1)).fit(
            module, torch.utils.data.DataLoader([global_batch(0)], batch_size=None))
    except ValueError as e:
        error = str(e)
    else:
        error = None
    return {"error": error, "unchanged": all(torch.equal(a, p) for a, p in zip(before, module.parameters())),
            "no_grads": all(p.grad is None for p in module.parameters()), "plain": all(type(p) is nn.Parameter for p in module.parameters())}


def equals_plain_lightning(rank: int, accumulate: int = 1) -> dict:
    """Even shards (where Lightning's mean of each rank's mean is the global batch's mean): the staged run,
    chunked under a budget below its unchunked peak, against Lightning's own ModelParallelStrategy;
    ``accumulate`` batches a step (the staged gradients added into FSDP2's sharded .grad)."""
    _torchelastic_env(rank, dist.get_world_size())
    even = [4, 4]
    mine = [tuple(t[: sum(even)].split(even)[rank] for t in global_batch(i)) for i in range(STEPS * accumulate)]
    plain, staged = Sharded(), Sharded()
    _trainer(L.strategies.ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), accumulate).fit(
        plain, torch.utils.data.DataLoader(mine, batch_size=None))
    strategy = Measured()
    _trainer(strategy, accumulate).fit(staged, torch.utils.data.DataLoader(mine, batch_size=None))
    return {
        "chunks": [c for _, c in strategy.record["plans"]],
        "budget": strategy.record["budget"], "unchunked": strategy.record["unchunked"],
        "params": [p.full_tensor().detach().numpy() for p in staged.net.parameters()],
        "plain_params": [p.full_tensor().detach().numpy() for p in plain.net.parameters()],
    }


CASES = {"trains_exactly": trains_exactly, "tensor_parallel_refused": tensor_parallel_refused,
         "equals_plain_lightning": equals_plain_lightning,
         "equals_plain_lightning_accumulating": functools.partial(equals_plain_lightning, accumulate=2)}


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return spawn(str(tmp_path_factory.mktemp("lightning_fsdp") / "store"), 2, CASES, collective_timeout=60,
                 result_timeout=240, barrier=True)


@pytest.mark.parametrize("rank", [0, 1])
def test_staged_model_parallel_exact_within_budget(two, rank):
    got = result(two, "trains_exactly", rank)
    assert got["dtensor"]  # the parameters Lightning's optimizer steps are FSDP2's shards
    # The global batch's loss on both ranks, each step, and the same weights as one process on the whole batch.
    assert len(got["losses"]) == STEPS
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(got["ref_losses"]), rtol=1e-9, atol=1e-12)
    for p, q in zip(got["params"], got["ref_params"], strict=True):
        np.testing.assert_allclose(p, q, rtol=1e-9, atol=1e-12)
    # Below the unchunked peak: every step in chunks, its planned and measured peaks within its budget.
    assert got["budget"] < got["unchunked"], got
    for (planned, chunks), peak in zip(got["plans"], got["peaks"], strict=True):
        assert len(chunks) > 1, got["plans"]
        assert planned <= got["budget"] and peak <= got["budget"], (got["plans"], got["peaks"], got["budget"])


@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_refused_before_anything_changes(two, rank):
    got = result(two, "tensor_parallel_refused", rank)
    assert got["error"] is not None and "tensor_parallel_size=2" in got["error"] and "What to do" in got["error"]
    assert got["unchanged"] and got["plain"] and got["no_grads"], got


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("case", ["equals_plain_lightning", "equals_plain_lightning_accumulating"])
def test_even_shards_equal_plain_model_parallel_strategy(two, case, rank):
    got = result(two, case, rank)
    assert got["budget"] < got["unchunked"] and all(len(c) > 1 for c in got["chunks"]), got["chunks"]
    for p, q in zip(got["params"], got["plain_params"], strict=True):
        np.testing.assert_allclose(p, q, rtol=1e-9, atol=1e-12)

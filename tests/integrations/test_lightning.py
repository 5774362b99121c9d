"""Lightning's Trainer with StagedStrategy against a plain Lightning run whose batch fits.

Every run is float64 on the CPU, 3 optimizer steps of SGD with momentum (the momentum carries any gradient
error of an early step into every later weight), from the same initial weights over the same batches.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytest.importorskip("lightning", reason='Lightning is an optional extra: pip install "stagetorch[lightning]"')

import lightning as L  # noqa: E402
from memtrack import AllocatorPeak, LivePeak, _storage_bytes  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import stagetorch  # noqa: E402
from stagetorch.devices.budget import parse_bytes  # noqa: E402
from stagetorch.integrations.lightning import StagedStrategy  # noqa: E402
from stagetorch.ops import linalg  # noqa: E402
from stagetorch.runtime.executable import Executable  # noqa: E402

# Lightning warns about DataLoader workers and its own deprecations; neither is what these tests check.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

BATCH = 128
# Under this budget every step of 128 examples runs in 3 chunks or more (tested below on each step, so a change
# of the cost model that lets the whole batch fit again fails here rather than silently testing nothing).
CHUNKED = "300KiB"


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 256), nn.Tanh(), nn.Linear(256, 3))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.log("train_loss", loss)
        self.log("train_acc", (logits.argmax(-1) == y).double().mean())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class LastBatchReadsAValue(Classifier):
    """Stages for full batches; a short batch stages again and reads a tensor's value, which staging cannot."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        if x.shape[0] < BATCH and loss > 0:
            loss = loss * 2
        return loss


class ReadsBatchIdx(Classifier):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y) * (1 + batch_idx % 2)


class Manual(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class Plans(L.Callback):
    """The plan of every step, asked of the strategy just before the step runs (as the step will ask it)."""

    def __init__(self) -> None:
        self.chunks: list[tuple[int, ...]] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.chunks.append(tuple(trainer.strategy.plan(batch).chunk_sizes))


def _data(batches: int, last: int = BATCH) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    n = BATCH * (batches - 1) + last
    x = torch.randn(n, 4, dtype=torch.float64, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH)


def _fit(module: L.LightningModule, data: DataLoader, strategy=None, steps: int = 3, val_dataloaders=None,
         **kwargs):
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **({"strategy": strategy} if strategy else {}),
        **kwargs,
    )
    trainer.fit(module, data, val_dataloaders)
    return trainer


def _module(cls=Classifier) -> L.LightningModule:
    torch.manual_seed(0)
    return cls().double()


def _worst(a: L.LightningModule, b: L.LightningModule) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("budget", [None, CHUNKED], ids=["whole-batch", "chunked"])
def test_weights_equal_a_plain_lightning_run(budget):
    """Three steps with a validation loop after the second (the module goes to eval mode and back; the
    validation step runs as Lightning runs it)."""
    data = _data(3)
    plain = _module()
    trainer = _fit(plain, data, val_dataloaders=_data(1), val_check_interval=2)
    staged = _module()
    plans = Plans()
    staged_trainer = _fit(staged, data, StagedStrategy(memory_budget=budget), callbacks=[plans],
                          val_dataloaders=_data(1), val_check_interval=2)
    assert len(plans.chunks) == 3
    assert all((len(c) >= 3) == (budget is not None) for c in plans.chunks), plans.chunks
    assert staged_trainer.global_step == trainer.global_step == 3
    assert _worst(staged, plain) < 1e-9
    assert staged.losses == pytest.approx(plain.losses, abs=1e-12, rel=0)
    for name in ("train_loss", "train_acc", "val_loss"):  # train_*: logged inside the staged training_step
        assert staged_trainer.callback_metrics[name].item() == pytest.approx(
            trainer.callback_metrics[name].item(), abs=1e-12)
    # The optimizer ran on the same gradients: its momentum buffers agree too.
    for p, q in zip(staged.parameters(), plain.parameters(), strict=True):
        m = staged_trainer.optimizers[0].state[p]["momentum_buffer"]
        assert (m - trainer.optimizers[0].state[q]["momentum_buffer"]).abs().max() < 1e-9


class StepPeak(L.Callback):
    """Every storage alive during the second step (training_step, backward and the optimizer's step): the
    weights, the batch, the previous step's gradients, the momentum, and all the step allocates."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx == 1:
            held = [*module.parameters(), *(p.grad for p in module.parameters()), *batch,
                    *(s["momentum_buffer"] for s in trainer.optimizers[0].state.values())]
            self.tracker = LivePeak(held).__enter__()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx == 1:
            self.tracker.__exit__(None, None, None)
            self.peak = self.tracker.peak


def test_a_step_with_what_the_run_holds_stays_in_the_budget():
    """The budget is the run's: the step is planned in it less the previous gradients and the momentum it
    holds, so the measured peak of a whole step, the optimizer's included, stays under it."""
    peak = StepPeak()
    # At this budget what the run holds matters (33 KiB: the previous gradients and the momentum): a step
    # planned in the whole budget measured 165 KiB.
    _fit(_module(), _data(3), StagedStrategy(memory_budget="160KiB"), steps=2, callbacks=[peak])
    assert peak.peak <= 160 * 1024, peak.peak


def test_accumulated_batches_clipping_and_a_short_last_batch_chunked():
    """accumulate_grad_batches=2 (Lightning divides each loss by 2 and adds the gradients) over 6 batches, the
    last one shorter (a second staged program), with Lightning clipping the gradients' norm to 0.05 (they are
    larger): 3 optimizer steps, chunked, equal the plain run."""
    data = _data(6, last=100)
    plain = _module()
    _fit(plain, data, accumulate_grad_batches=2, gradient_clip_val=0.05)
    staged = _module()
    plans = Plans()
    trainer = _fit(staged, data, StagedStrategy(memory_budget=CHUNKED), accumulate_grad_batches=2,
                   gradient_clip_val=0.05, callbacks=[plans])
    assert trainer.global_step == 3
    assert len(plans.chunks) == 6 and all(len(c) >= 3 for c in plans.chunks), plans.chunks
    assert sum(plans.chunks[-1]) == 100
    assert _worst(staged, plain) < 1e-9
    assert staged.losses == pytest.approx(plain.losses, abs=1e-12, rel=0)


def test_a_step_it_cannot_stage_names_the_call_and_leaves_the_run_as_before_it():
    """The third batch is short and its step reads a tensor's value: the error names training_step and says
    what to do; weights, .grad and the optimizer's momentum are exactly those of the same run stopped after
    step 2 (and those of a plain run, to 1e-9)."""
    data = _data(3, last=20)
    two_steps = _module(LastBatchReadsAValue)
    two_trainer = _fit(two_steps, data, StagedStrategy(memory_budget=CHUNKED), steps=2)
    plain = _module(LastBatchReadsAValue)
    _fit(plain, data, steps=2)
    staged = _module(LastBatchReadsAValue)
    trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        strategy=StagedStrategy(memory_budget=CHUNKED))
    with pytest.raises(stagetorch.ConcretizationError) as e:
        trainer.fit(staged, data)
    message = str(e.value)
    assert "LastBatchReadsAValue.training_step" in message
    assert re.search(r"integrations/test_lightning\.py:\d+", message)  # the class's line and the failing line
    assert "What to do" in message and "as they were before this step" in message
    assert trainer.global_step == 2
    assert _worst(staged, two_steps) == 0 and _worst(staged, plain) < 1e-9
    for p, q in zip(staged.parameters(), two_steps.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
        assert torch.equal(trainer.optimizers[0].state[p]["momentum_buffer"],
                           two_trainer.optimizers[0].state[q]["momentum_buffer"])


def test_a_step_that_reads_batch_idx_is_refused():
    """batch_idx would be baked into the program staged on the first batch: reading it raises, before any
    weight moves."""
    staged = _module(ReadsBatchIdx)
    before = copy.deepcopy(staged)
    with pytest.raises(stagetorch.StagingError, match="batch_idx") as e:
        _fit(staged, _data(3), StagedStrategy())
    assert "ReadsBatchIdx.training_step" in str(e.value)
    assert _worst(staged, before) == 0 and all(p.grad is None for p in staged.parameters())


def test_manual_optimisation_is_refused_with_what_to_do():
    with pytest.raises(ValueError, match="automatic_optimization = False.*What to do"):
        _fit(_module(Manual), _data(3), StagedStrategy())


class Float32Data(Classifier):
    """The classifier in float32 (mixed precision autocasts float32 weights), on the data made float32."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return super().training_step((x.float(), y), batch_idx)


def _precision(name: str) -> dict:
    """Trainer arguments for ``name``. Lightning turns ``precision="16-mixed"`` into bf16 on the CPU: float16
    with its GradScaler is asked for as the plugin itself."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    return {"plugins": [MixedPrecision("16-mixed", "cpu")]} if name == "16-mixed" else {"precision": name}


# float32 weights and half-precision activations: a smaller budget than CHUNKED makes 3 chunks or more.
@pytest.mark.parametrize("budget", [None, "110KiB"], ids=["whole-batch", "chunked"])
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_equals_a_plain_lightning_run(precision, budget):
    """Lightning's autocast mixed precision on the CPU, bf16, and float16 with its GradScaler (whose scale is an
    input of the staged step): whole, the weights equal the plain run's at the same precision bit for bit;
    chunked (each chunk's half-precision gradient is rounded on its own before they are summed), within one
    unit of the half type's rounding at the weights' scale."""
    torch.manual_seed(0)
    start = Float32Data()
    plain, staged, full = (copy.deepcopy(start) for _ in range(3))
    data = _data(3)
    plain_trainer = _fit(plain, data, **_precision(precision))
    plans = Plans()
    trainer = _fit(staged, data, StagedStrategy(memory_budget=budget), callbacks=[plans], **_precision(precision))
    _fit(full, data)
    assert len(plans.chunks) == 3
    assert all((len(c) >= 3) == (budget is not None) for c in plans.chunks), plans.chunks
    scaler = trainer.precision_plugin.scaler
    if precision == "16-mixed":  # the scaler ran, and moved as the plain run's did
        assert scaler.get_scale() == plain_trainer.precision_plugin.scaler.get_scale() > 1
    else:
        assert scaler is None
    assert _worst(plain, full) > 1e-5  # autocast changed the result: the comparison below means something
    if budget is None:  # the same kernels on the same values: bit for bit
        assert _worst(staged, plain) == 0 and staged.losses == plain.losses
    else:
        eps = torch.finfo(torch.bfloat16 if precision == "bf16-mixed" else torch.float16).eps
        for p, q in zip(staged.parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=eps * q.abs().max().item())
        assert staged.losses == pytest.approx(plain.losses, rel=1e-2)


# -- transformers' own models on padded batches (the same models and data as the transformers Trainer test) ----

class HFModule(L.LightningModule):
    """A LightningModule around a transformers model: a batch of padded rows (a dict of input_ids,
    attention_mask, labels, as a tokenizer's collator makes it), the model's own loss."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _hf(name: str) -> HFModule:
    transformers_tests = pytest.importorskip("trainer_models")
    torch.manual_seed(0)
    return HFModule(transformers_tests.MODELS[name][0]().double())


def _padded(kind: str) -> DataLoader:
    transformers_tests = pytest.importorskip("trainer_models")
    rows = transformers_tests.padded_dataset(kind)
    return DataLoader(rows + rows[::-1], batch_size=8)  # 5 batches of 8


@pytest.mark.parametrize("mode", ["whole", "chunked"])
@pytest.mark.parametrize("name", ["llama", "bert"])
def test_transformers_models_on_padded_batches_equal_a_plain_lightning_run(name, mode):
    """A tiny Llama causal LM and a tiny BERT sequence classifier, padded batches of 8 (masks with padding on
    most rows), 3 steps of SGD with momentum, float64: the weights equal the plain Lightning run's to 1e-9,
    whole and chunked (each step's plan is checked, so a budget that stops chunking fails here)."""
    pytest.importorskip("transformers")
    kind = "lm" if name == "llama" else "cls"
    data = _padded(kind)
    plain = _hf(name)
    start = copy.deepcopy(plain)
    _fit(plain, data, steps=3)
    staged = _hf(name)
    strategy = StagedStrategy()
    plans = Plans()
    if mode == "chunked":
        # The run's budget under which the second step, which holds the first step's .grad and momentum beside
        # it, runs in 3 chunks: planned on a probe run stopped after one step.
        probe = _fit(_hf(name), data, StagedStrategy(), steps=1).strategy
        batch = next(iter(data))
        transformers_tests = pytest.importorskip("trainer_models")
        strategy = StagedStrategy(memory_budget=transformers_tests.budget_for_chunks(probe, lambda: probe.plan(batch), 3))
    trainer = _fit(staged, data, strategy, steps=3, callbacks=[plans])
    assert trainer.global_step == 3 and len(plans.chunks) == 3
    if mode == "chunked":  # the first step holds no .grad nor momentum yet: it may have room for the whole batch
        assert all(len(c) >= 3 for c in plans.chunks[1:]), plans.chunks
    else:
        assert all(len(c) == 1 for c in plans.chunks), plans.chunks
    moved = max((p - q).abs().max().item() for p, q in zip(staged.parameters(), start.parameters()))
    assert moved > 1e-4, "the steps did not move the weights: the comparison would prove nothing"
    assert _worst(staged, plain) < 1e-9
    # transformers' causal-LM loss upcasts the logits to float32 (loss_utils.ForCausalLMLoss), even in a float64
    # model: chunked, its float32 sum is added in another order (4.8e-7 of 4.6 was seen).
    float32_loss = name == "llama" and mode == "chunked"
    assert staged.losses == pytest.approx(plain.losses, abs=0 if float32_loss else 1e-12, rel=1e-6 if float32_loss else 0)


class Ran(L.Callback):
    """The plan of every program the step ran (asked of the executable after it ran, as it ran it)."""

    def __init__(self) -> None:
        self.chunks: list[tuple[int, ...]] = []
        self.peaks: list[int] = []

    def on_train_start(self, trainer, module):
        run = Executable.run

        def recorded(executable, inputs, plan, **kwargs):
            out = run(executable, inputs, plan, **kwargs)
            self.chunks.append(tuple(plan.chunk_sizes))
            self.peaks.append(plan.peak)
            return out

        self._patch = pytest.MonkeyPatch()
        self._patch.setattr(Executable, "run", recorded)

    def on_train_end(self, trainer, module):
        self._patch.undo()

    def on_exception(self, trainer, module, exception):  # a failed fit must not leave Executable.run patched
        self._patch.undo()


@pytest.mark.parametrize("precision", ["64-true", "32-true"])
def test_the_plan_the_strategy_gives_is_the_plan_the_step_runs(precision):
    """From the second step on the parameters hold the previous gradients when ``plan(batch)`` is asked:
    they are out of the budget (the run holds them beside the step) and, as ``training_step`` runs, off the
    parameters. The plan counted them twice (and said 8 chunks of 16 where 6 of 19 and one of 14 ran)."""
    torch.manual_seed(0)
    module = _module() if precision == "64-true" else Float32Data()
    asked, ran = Plans(), Ran()
    budget = CHUNKED if precision == "64-true" else "110KiB"
    _fit(module, _data(3), StagedStrategy(memory_budget=budget), callbacks=[asked, ran])
    assert len(ran.chunks) == 3 and all(len(c) >= 3 for c in ran.chunks), ran.chunks
    assert asked.chunks == ran.chunks


class StepAtAllocator(L.Callback):
    """The second step's ``training_step`` (the staged step) measured by ``tracker``, with what the run holds
    resident: weights, batch, the previous gradients, the optimizer's state and the scaler's; and the plan of
    the program it ran."""

    def __init__(self, tracker) -> None:
        self.tracker = tracker

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx != 1:
            return
        strategy, run, execute = trainer.strategy, trainer.strategy.training_step, Executable.run

        def recorded(executable, inputs, plan, **kwargs):
            out = execute(executable, inputs, plan, **kwargs)
            self.plan = plan
            return out

        def measured(*args, **kwargs):
            states = [t for st in trainer.optimizers[0].state.values() for t in st.values() if isinstance(t, torch.Tensor)]
            grads = [p.grad for p in module.parameters() if p.grad is not None]
            scaler = trainer.precision_plugin.scaler if hasattr(trainer.precision_plugin, "scaler") else None
            scales = [] if scaler is None else [t for t in (scaler._scale, scaler._growth_tracker) if t is not None]
            self.beside = _storage_bytes([*grads, *states])  # what the strategy takes out of the budget
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(Executable, "run", recorded)
                with self.tracker([*module.parameters(), *batch, *grads, *states, *scales]) as peak:
                    out = run(*args, **kwargs)
            self.peak = peak.peak
            return out

        strategy.training_step = measured

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx == 1:
            del trainer.strategy.training_step


def _mixed_step_peak(precision: str, tracker) -> tuple[int, int]:
    torch.manual_seed(0)
    at = StepAtAllocator(tracker)
    _fit(Float32Data(), _data(3), StagedStrategy(memory_budget="110KiB"), steps=2, callbacks=[at], **_precision(precision))
    assert len(at.plan.chunk_sizes) >= 3
    return at.peak, at.plan.peak + at.beside


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_step_holds_what_it_planned(precision, monkeypatch):
    """Every tensor an op returns, in the chunked mixed-precision step with the run's gradients and momentum
    beside it: the plan plus what the strategy took out of the budget, to the byte (16 B: 0-d values). The
    plan counts tensors only here, as this tracker sees them: oneDNN's matmul scratchpads, which the plan
    counts at their size (a bfloat16 chunk's 19,324 B), are checked at the allocator below."""
    monkeypatch.setattr(linalg, "_onednn_half", lambda dtype: None)
    measured, predicted = _mixed_step_peak(precision, LivePeak)
    assert abs(measured - predicted) <= 16, (measured, predicted)
    assert measured <= parse_bytes("110KiB")


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_step_at_the_allocator_holds_what_it_planned(precision):
    """At the allocator, oneDNN's half-precision matmul scratchpads included (their workspace rule,
    stagetorch/ops/linalg.py): the float16 256 -> 3 layer's addmm alone takes 145-166 KB from 6 examples
    up, more than the budget. The plan (chunks of 4 examples on torch 2.13) keeps every product at or under
    16 * 16 * 16 multiply-adds, where ATen's own gemm runs and allocates nothing."""
    measured, predicted = _mixed_step_peak(precision, AllocatorPeak)
    assert measured <= 1.02 * predicted and measured <= parse_bytes("110KiB"), (measured, predicted)

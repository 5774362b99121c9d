"""StagedTrainer against transformers.Trainer itself: the same weights after three optimizer steps on padded
batches, whether the step runs whole, in chunks or recomputing; and a step it cannot stage changes nothing."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from trainer_models import BATCH, MODELS, TokenLM, budget_for_chunks, padded_dataset  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import stagetorch  # noqa: E402
from stagetorch import ConcretizationError, UnsupportedOpError  # noqa: E402
from stagetorch.integrations.transformers import StagedTrainer  # noqa: E402
from stagetorch.planning.remat_search import RematPlan  # noqa: E402


# transformers' text models build their attention mask with an index op stagetorch has no batch rule for yet
# (masking_utils.py): their chunked steps are refused until it has one. Strict: the day they chunk, this fails.
def args(tmp_path, **kw) -> TrainingArguments:
    # Two accumulation steps over 5 batches: the third optimizer step accumulates one, as the plain Trainer's
    # last step of an epoch does. SGD, whose update is linear in the gradient, so that a gradient scaled wrong
    # shows (Adam's is nearly scale-free). max_grad_norm 2 clips the pooled classifier's last two steps, not its
    # first (clipping hides a gradient scaled wrong: checked by dropping the accumulation divisor).
    return TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=BATCH, gradient_accumulation_steps=2, max_steps=3,
        optim="sgd", learning_rate=1e-2, max_grad_norm=2.0, report_to=[], save_strategy="no", logging_strategy="no",
        use_cpu=True, disable_tqdm=True, **kw,
    )


def train(cls: type, model: torch.nn.Module, data: list, tmp_path, **kw) -> Trainer:
    trainer = cls(model=model, args=args(tmp_path), train_dataset=data, **kw)
    trainer.train()
    return trainer


def fresh(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return MODELS[name][0]().double()


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module, start: torch.nn.Module) -> None:
    moved = max((p - q).abs().max().item() for p, q in zip(a.parameters(), start.parameters()))
    assert moved > 1e-4, "the optimizer steps did not move the weights: the comparison would prove nothing"
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-9, msg=lambda m, name=name: f"{name}: {m}")


def _cases():
    for name in MODELS:
        for mode in ("whole", "chunked"):
            yield pytest.param(name, mode, id=f"{name}-{mode}")


@pytest.mark.parametrize("name, mode", list(_cases()))
def test_weights_equal_plain_trainer(name, mode, tmp_path, monkeypatch):
    data = padded_dataset(MODELS[name][1])
    start = fresh(name)
    plain = copy.deepcopy(start)
    train(Trainer, plain, data, tmp_path / "plain")
    staged = copy.deepcopy(start)
    trainer = StagedTrainer(model=staged, args=args(tmp_path / "staged"), train_dataset=data, remat=False)
    if mode == "chunked":
        batch = next(iter(trainer.get_train_dataloader()))
        # The budget that makes 3 chunks of a micro-step that holds the .grad it adds into (accumulation).
        for p in staged.parameters():
            p.grad = torch.zeros_like(p)
        trainer.memory_budget = budget_for_chunks(trainer, lambda: trainer.step_plan(batch), 3)
        staged.zero_grad(set_to_none=True)
    ran = []
    step_plan = stagetorch.Staged._step_plan
    monkeypatch.setattr(stagetorch.Staged, "_step_plan", lambda self, *a: ran.append(step_plan(self, *a)) or step_plan(self, *a))
    trainer.train()
    assert trainer.stagetorch_plans and ran, "no step went through stagetorch"
    if mode == "chunked":
        # The budget bounds the .grad a micro-step adds into too: those run in >= 3 chunks (the first micro-step
        # of an optimizer step, with no .grad yet, may have room for fewer).
        holding = [p for p in ran if p.held_bytes]
        assert holding and all(len(p.chunk_sizes) >= 3 for p in holding), ran
    else:
        assert all(len(p.chunk_sizes) == 1 for p in ran), ran
    assert_same_weights(plain, staged, start)


def test_recomputing_plan_equals_plain_trainer(tmp_path):
    """With remat on, a budget below what one example per chunk needs: the step fits by recomputing forward
    values in the backward, in chunks, and the weights are the plain Trainer's."""
    data = padded_dataset("cls")
    start = fresh("pooled")
    plain = copy.deepcopy(start)
    train(Trainer, plain, data, tmp_path / "plain")
    staged = copy.deepcopy(start)
    trainer = StagedTrainer(model=staged, args=args(tmp_path / "staged"), train_dataset=data)
    batch = next(iter(trainer.get_train_dataloader()))
    # (The accumulating micro-steps also hold the .grad they add into, beside the program.)
    held = sum(p.numel() * p.element_size() for p in staged.parameters())
    trainer.memory_budget = int(trainer.step_plan(batch).full_batch_peak_bytes * 0.8) + held
    trainer.train()
    plans = list(trainer.stagetorch_plans.values())
    assert plans and all(isinstance(p, RematPlan) and p.recompute is not None for p in plans), plans
    assert_same_weights(plain, staged, start)


def test_bf16_autocast_on_cpu_is_staged(tmp_path):
    """bf16=True on CPU: accelerate runs the forward under CPU autocast, and the staged step does the same
    casts: the float32 weights equal the plain Trainer's bf16 run, bit for bit, and differ from a float32 run."""
    data = padded_dataset("lm")
    torch.manual_seed(0)
    start = TokenLM()
    plain, staged, full = copy.deepcopy(start), copy.deepcopy(start), copy.deepcopy(start)
    Trainer(model=plain, args=args(tmp_path / "plain", bf16=True), train_dataset=data).train()
    StagedTrainer(model=staged, args=args(tmp_path / "staged", bf16=True), train_dataset=data).train()
    Trainer(model=full, args=args(tmp_path / "full"), train_dataset=data).train()
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), staged.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(plain.parameters(), full.parameters()))


def test_gradient_checkpointing_is_staged_too(tmp_path):
    """gradient_checkpointing=True (torch.utils.checkpoint in the model) stages as it runs: the same weights."""
    data = padded_dataset("lm")
    start = fresh("llama")
    plain, staged = copy.deepcopy(start), copy.deepcopy(start)
    Trainer(model=plain, args=args(tmp_path / "plain", gradient_checkpointing=True), train_dataset=data).train()
    trainer = StagedTrainer(model=staged, args=args(tmp_path / "staged", gradient_checkpointing=True), train_dataset=data)
    trainer.train()
    assert trainer.stagetorch_plans
    assert_same_weights(plain, staged, start)


class WeightedLoss(TrainerCallback):
    """compute_loss reads class weights the trainer holds; a new tensor replaces them after every step."""

    @staticmethod
    def compute_loss(trainer, model, inputs, return_outputs=False, num_items_in_batch=None):
        logits = model(**inputs).logits
        return F.cross_entropy(logits, inputs["labels"], weight=trainer.class_weights)

    def __init__(self, trainer_ref: list) -> None:
        self.trainer_ref = trainer_ref

    def on_step_end(self, args, state, control, **kw):
        trainer = self.trainer_ref[0]
        trainer.class_weights = trainer.class_weights.roll(1).clone()


def test_a_tensor_the_trainer_holds_is_read_each_step(tmp_path):
    """A compute_loss override that reads a tensor attribute of the trainer sees the one set for this step,
    not the one the step was staged with."""
    data = padded_dataset("cls")
    start = fresh("pooled")
    models = []
    for base in (Trainer, StagedTrainer):
        cls = type(f"Weighted{base.__name__}", (base,), {"compute_loss": WeightedLoss.compute_loss})
        models.append(copy.deepcopy(start))
        ref: list = []
        trainer = cls(model=models[-1], args=args(tmp_path / base.__name__), train_dataset=data, callbacks=[WeightedLoss(ref)])
        trainer.class_weights = torch.tensor([1.0, 2.0, 5.0], dtype=torch.float64)
        ref.append(trainer)
        trainer.train()
    assert_same_weights(models[0], models[1], start)


class Unstageable(TokenLM):
    """Reads a parameter's value into Python control flow once ``read_value`` is set (a read of the batch's
    integer inputs alone would stage: stagetorch computes those on the host when the step is called)."""

    read_value = False

    def forward(self, input_ids, attention_mask, labels, num_items_in_batch=None, **kwargs):
        if self.read_value and next(self.parameters()).sum() > 0:
            attention_mask = attention_mask * 1
        return super().forward(input_ids, attention_mask, labels, num_items_in_batch)


class Snapshot(TrainerCallback):
    """After the first micro-step of the second optimizer step (weights moved, .grad half accumulated, Adam's
    moments set): copy the state, and make the model unstageable for the next micro-step."""

    def __init__(self, trainer_ref: list) -> None:
        self.trainer_ref = trainer_ref
        self.state = None

    def on_substep_end(self, args, state, control, model=None, **kw):
        if state.global_step == 1 and self.state is None:
            trainer = self.trainer_ref[0]
            self.state = (
                [p.detach().clone() for p in model.parameters()],
                [p.grad.clone() for p in model.parameters()],
                copy.deepcopy(trainer.optimizer.state_dict()),
            )
            model.read_value = True


def test_a_step_it_cannot_stage_changes_nothing(tmp_path):
    data = padded_dataset("lm")
    model = Unstageable().double()
    ref: list = []
    snapshot = Snapshot(ref)
    trainer = StagedTrainer(model=model, args=args(tmp_path), train_dataset=data, callbacks=[snapshot])
    ref.append(trainer)
    with pytest.raises(ConcretizationError) as info:
        trainer.train()
    message = str(info.value)
    assert "StagedTrainer.training_step (global step 1)" in message and "Unstageable" in message
    assert "integrations/test_transformers.py" in message  # the user's line
    assert "transformers.Trainer" in message  # the way out
    weights, grads, optimizer = snapshot.state
    for p, w, g in zip(model.parameters(), weights, grads):
        assert torch.equal(p.detach(), w) and torch.equal(p.grad, g)
    after = trainer.optimizer.state_dict()
    for k, moments in optimizer["state"].items():
        for name, value in moments.items():
            assert torch.equal(after["state"][k][name], value), (k, name)


def test_a_first_step_it_cannot_stage_names_training_step(tmp_path):
    model = Unstageable().double()
    model.read_value = True
    before = [p.detach().clone() for p in model.parameters()]
    trainer = StagedTrainer(model=model, args=args(tmp_path), train_dataset=padded_dataset("lm"))
    with pytest.raises(ConcretizationError, match=r"StagedTrainer.training_step \(global step 0\)"):
        trainer.train()
    assert all(torch.equal(p.detach(), b) and p.grad is None for p, b in zip(model.parameters(), before))


def test_refuses_a_compiled_model_before_running(tmp_path):
    model = fresh("token-lm")
    before = [p.detach().clone() for p in model.parameters()]
    trainer = StagedTrainer(model=model, args=args(tmp_path, torch_compile=True), train_dataset=padded_dataset("lm"))
    with pytest.raises(UnsupportedOpError, match="torch_compile=False"):
        trainer.train()
    assert all(torch.equal(p.detach(), b) and p.grad is None for p, b in zip(model.parameters(), before))


def test_import_stagetorch_does_not_import_transformers():
    code = "import sys, stagetorch; assert 'transformers' not in sys.modules and 'accelerate' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("kind, advice", [("DEEPSPEED", "fully_shard"), ("FSDP", "Sharded models: FSDP2")])
def test_a_sharded_run_is_refused_with_what_to_do(tmp_path, monkeypatch, kind, advice):
    from accelerate.utils import DistributedType

    trainer = StagedTrainer(model=fresh("token-lm"), args=args(tmp_path), train_dataset=padded_dataset("lm"))
    monkeypatch.setattr(trainer.accelerator.state, "distributed_type", getattr(DistributedType, kind))
    with pytest.raises(UnsupportedOpError, match=advice) as raised:
        trainer._check_supported()
    assert "What to do:" in str(raised.value)

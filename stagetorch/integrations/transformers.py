"""``transformers.Trainer`` with the batch you asked for, exactly, in the memory you have.

:class:`StagedTrainer` is ``transformers.Trainer`` with one method replaced, ``training_step`` (the method the
Trainer's docs say to override for a custom step): it stages the step (``compute_loss`` and its backward) with
:func:`stagetorch.jit` once per input shape, and runs it whole, in exact chunks and/or recomputing forward
values, as the plan for ``memory_budget`` says. ``per_device_train_batch_size`` stays what you set, and the
``.grad`` the step leaves is the one the plain Trainer's step leaves: gradient accumulation, clipping
(``max_grad_norm``), the optimizer and the scheduler run after it unchanged.

:class:`StagedTrainingMixin` does the same for another ``Trainer`` subclass (``class MyTrainer(StagedTrainingMixin,
SFTTrainer)``). Importing this module imports transformers and accelerate; ``import stagetorch`` imports neither.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from accelerate.utils import DistributedType
from accelerate.utils.memory import clear_device_cache
from transformers import Trainer
from transformers.training_args import OptimizerNames
from transformers.utils import is_sagemaker_mp_enabled

from ..api import jit
from ..errors import StagingError, UnsupportedOpError
from ..planning.chunks import Plan
from ..runtime.staged import Staged

__all__ = ["StagedTrainer", "StagedTrainingMixin"]

log = logging.getLogger(__name__)

# The staged step repeats how Trainer.training_step normalises the loss; the rule it repeats is the one that
# came with this attribute. An older Trainer decides otherwise, and its steps would silently differ.
if not hasattr(Trainer, "loss_is_scaled_for_ga"):
    import transformers

    raise ImportError(
        f"stagetorch.integrations.transformers needs a transformers whose Trainer has loss_is_scaled_for_ga "
        f"(5.x; tested with 5.24), and this is transformers {transformers.__version__}: pip install -U transformers"
    )


def _train_step(
    trainer: Trainer, model: torch.nn.Module, inputs: dict, num_items_in_batch: Any, divisor: Any, scale: Any,
    held: dict[str, Any],
) -> torch.Tensor:
    """What ``Trainer.training_step`` computes between ``_prepare_inputs`` and the end of the backward, with
    the Python values that change between steps (the accumulation divisor, the fp16 loss scale) as tensors,
    so that one staged program serves every step of a shape. ``held``: the trainer's own tensor and module
    attributes (see ``_held``), staged as the step's inputs and state."""
    tensors = {k: v for k, v in held.items() if isinstance(v, torch.Tensor)}
    own = {k: trainer.__dict__[k] for k in tensors}
    # While staging, the trainer's tensors are the staged inputs that stand for them; its modules are
    # staged as the model is, as state (they are arguments).
    trainer.__dict__.update(tensors)
    try:
        with trainer.compute_loss_context_manager():
            # A copy: compute_loss may pop the labels, and the same dict is staged again for the plan.
            loss = trainer.compute_loss(model, dict(inputs), num_items_in_batch=num_items_in_batch)
    finally:
        trainer.__dict__.update(own)
    if divisor is not None:
        loss = loss / divisor
    # accelerator.backward for one process: scaler.scale(loss).backward() with fp16, else loss.backward().
    (loss if scale is None else loss * scale).backward()
    return loss.detach()


# Trainer attributes compute_loss does not read: the model (an argument of its own) and the running loss the
# training loop adds each step's loss to.
_NOT_HELD = frozenset({"model", "model_wrapped", "_tr_loss"})


# What runs a sharded model's step under stagetorch today, for the refusals of FSDP through the Trainer.
_FSDP2_WAY = (
    "What to do: shard the model yourself with torch.distributed.fsdp.fully_shard (FSDP2) and train it in a "
    "plain torchrun loop whose step is stagetorch.jit(step, process_group=dist.group.WORLD, memory_budget=...): "
    "the global batch's loss and gradients exactly, each rank in chunks sized to its own budget (docs/distributed.md, "
    "section 'Sharded models: FSDP2 (fully_shard)'); or, with Lightning, train under "
    "stagetorch.integrations.lightning.StagedModelParallelStrategy (docs/lightning.md)"
)


class StagedTrainingMixin:
    """Put before a ``transformers.Trainer`` class to run its training steps through stagetorch.

    **Arguments** (keyword, beside the Trainer's own)

    - ``memory_budget``: bytes (or ``"2GiB"``) one training step may use; default: the device's free memory
      (on CPU, the memory the system has available).
    - ``remat``: ``"auto"`` (default) lets a step that does not fit whole recompute forward values in the
      backward, chosen with the chunk size; ``False`` only chunks.

    ``stagetorch_plans`` maps each input shape met so far (``((name, shape), ...)``) to the plan its step
    runs with; each is logged once, at INFO, on the ``stagetorch`` logger.
    """

    def __init__(self, *args: Any, memory_budget: int | str | None = None, remat: str | bool = "auto", **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.stagetorch_plans: dict[tuple, Plan] = {}
        self._staged_step: Staged = jit(_train_step, batch_argnums=(2,), memory_budget=memory_budget, remat=remat)

    @property
    def memory_budget(self) -> int | str | None:
        """The budget of one training step (None: the device's free memory); settable between steps."""
        return self._staged_step.memory_budget

    @memory_budget.setter
    def memory_budget(self, budget: int | str | None) -> None:
        self._staged_step.memory_budget = budget
        self.stagetorch_plans.clear()  # each shape's plan is logged again, for the new budget

    def step_plan(
        self, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None, model: torch.nn.Module | None = None
    ) -> Plan:
        """How a training step on this batch would run now: chunk sizes, recomputation, predicted peak. It
        stages the step (once per input shape) and runs nothing."""
        model = self.model_wrapped if model is None else model
        model.train()
        try:
            return self._staged_step.plan(*self._step_args(model, inputs, num_items_in_batch))
        except StagingError as e:
            raise self._named(e, model, "step_plan") from e

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """``Trainer.training_step``, staged: the loss, normalised and scaled as the Trainer does it, and the
        ``.grad`` of the full batch. If stagetorch cannot stage or fit the step, it raises the error it names,
        and the model's weights and ``.grad`` and the optimizer's state are as before the call."""
        self._check_supported()
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        step_args = self._step_args(model, inputs, num_items_in_batch)
        shape = tuple((k, tuple(v.shape)) for k, v in step_args[2].items() if isinstance(v, torch.Tensor))
        try:
            if shape not in self.stagetorch_plans:
                self.stagetorch_plans[shape] = plan = self._staged_step.plan(*step_args)
                # (The staged step logs its plan at INFO, once and on each change: this is the detail.)
                log.debug("stagetorch: training step for inputs %s: %s", dict(shape), plan)
            loss = self._staged_step(*step_args)
        except StagingError as e:
            raise self._named(e, model, "training_step") from e
        if self.args.torch_empty_cache_steps is not None and self.state.global_step % self.args.torch_empty_cache_steps == 0:
            clear_device_cache()
        return loss

    def _step_args(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any) -> tuple:
        """The staged step's arguments: ``_train_step``'s, in its order."""
        inputs = dict(self._prepare_inputs(inputs))
        return (self, model, inputs, *self._loss_scaling(num_items_in_batch), self._held(model))

    def _loss_scaling(self, num_items_in_batch: torch.Tensor | int | None) -> tuple[Any, Any, Any]:
        """``num_items_in_batch``, the gradient-accumulation divisor (None where the Trainer divides by none)
        and the fp16 loss scale (None without one), as the staged step takes them: tensors, not Python
        numbers, which would be staged into the program as constants."""
        device = self.args.device
        if isinstance(num_items_in_batch, int):
            num_items_in_batch = torch.tensor(num_items_in_batch, device=device)
        # As Trainer.training_step decides whether the loss is already normalised over the accumulated batch.
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or self.compute_loss_func is not None
        divisor = None
        if not scaled:
            steps = getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)
            divisor = torch.tensor(steps, device=device)
        scaler = self.accelerator.scaler
        # GradScaler.scale multiplies by its scale tensor: applied to a one it is that scale, exactly.
        scale = None if scaler is None else scaler.scale(torch.ones((), device=device))
        return num_items_in_batch, divisor, scale

    def _held(self, model: torch.nn.Module) -> dict[str, Any]:
        """The tensors and modules a ``compute_loss`` override may keep on the trainer (class weights, a
        teacher model), read afresh each step: the staged program takes them as inputs, so a tensor replaced
        between steps is the new one, not the one the step was staged with. The model and the Trainer's own
        running loss are not among them."""
        return {
            k: v for k, v in vars(self).items()
            if isinstance(v, (torch.Tensor, torch.nn.Module)) and v is not model and k not in _NOT_HELD
        }

    def _check_supported(self) -> None:
        """Refuse, before anything runs, a set-up whose backward is not one process's ``loss.backward()``."""
        why = None
        kind = self.accelerator.distributed_type
        if kind == DistributedType.DEEPSPEED:
            why = ("DeepSpeed's engine runs its own backward and optimizer step, which stagetorch cannot stage. "
                   f"{_FSDP2_WAY}; or train under DeepSpeed without stagetorch")
        elif kind == DistributedType.FSDP:
            why = ("this run shards the model with FSDP through the Trainer (accelerate's FSDP plugin, which runs "
                   "FSDP's all-gathers and reduce-scatters in the model accelerate wraps), and this integration "
                   f"does not drive that model's step. {_FSDP2_WAY}")
        elif self.args.fsdp:
            why = (f"the TrainingArguments ask for FSDP (fsdp={self.args.fsdp!r}), but accelerate enables FSDP "
                   f"on accelerator devices only: this {kind.value} run would train the whole model replicated "
                   f"(DistributedDataParallel), not sharded. {_FSDP2_WAY}")
        elif kind != DistributedType.NO or self.args.n_gpu > 1:
            why = (f"it runs in one process on one device, and this run is {kind.value} "
                   f"on {self.args.n_gpu} device(s). For data-parallel training stage your own step with "
                   "stagetorch.jit(step, process_group=...) (see the distributed page of the docs)")
        elif self.args.optim in (OptimizerNames.LOMO, OptimizerNames.ADALOMO):
            why = "LOMO optimizers update the weights inside the backward; use another optimizer"
        elif is_sagemaker_mp_enabled():
            why = "SageMaker model parallelism runs its own forward and backward"
        elif self.args.torch_compile:
            why = "a torch.compile'd model is compiled by dynamo, not staged; set torch_compile=False"
        elif self.accelerator.gradient_accumulation_steps != 1:
            why = ("the Accelerator divides the loss by its own gradient_accumulation_steps, which the Trainer "
                   "sets to 1; leave accelerator_config's gradient_accumulation_kwargs['num_steps'] unset")
        if why is not None:
            raise UnsupportedOpError(
                f"{type(self).__name__}.training_step cannot run this training set-up through stagetorch: {why}. "
                "Nothing has been changed."
            )

    def _named(self, error: StagingError, model: torch.nn.Module, call: str) -> StagingError:
        """``error`` with the call that raised it, what it left as it was, and the way out."""
        named = type(error)(
            f"{type(self).__name__}.{call} (global step {self.state.global_step}) could not stage or fit "
            f"the training step of {type(self.accelerator.unwrap_model(model)).__name__}; the weights, their .grad "
            f"and the optimizer state are as before this step.\n{error}\nWhat to do: follow the advice above, or "
            "train this model with transformers.Trainer."
        )
        named.smallest_budget = error.smallest_budget
        return named


class StagedTrainer(StagedTrainingMixin, Trainer):
    """``transformers.Trainer`` whose training steps stagetorch stages and runs in ``memory_budget``: see
    :class:`StagedTrainingMixin` for the two arguments it adds."""

"""Lightning on stagetorch: ``Trainer(strategy=StagedStrategy(memory_budget="2GiB"))``.

The strategy is Lightning's own extension point for how a training step runs on a device. This one stages the
LightningModule's ``training_step`` together with its backward, once per input signature, with
:func:`stagetorch.jit`, and runs it in exact chunks (and recomputation) when the batch does not fit the
budget. The batch size stays the one the DataLoader gives; the gradients equal those of one full-batch step.

Automatic optimisation runs ``training_step``, then ``zero_grad``, then ``backward`` (Lightning's closure),
while a staged step computes its gradients with the forward. So the strategy's ``training_step`` runs the staged
step with every ``.grad`` set aside, keeps the new gradients, and puts the old ones back; Lightning's
``zero_grad`` then clears the old ones as usual, and the strategy's ``backward`` adds the new ones where
``loss.backward()`` would have, between the ``on_before_backward`` and ``on_after_backward`` hooks. The
optimizer step, gradient clipping, accumulation over batches and every callback stay Lightning's.

``StagedModelParallelStrategy`` does the same on Lightning's ``ModelParallelStrategy`` (FSDP2, data parallel):
the step is staged with ``process_group=`` the data-parallel group, so its gradients are the global batch's,
reduce-scattered into FSDP2's sharded ``.grad`` (stagetorch/parallel/fsdp.py).

Requires ``pip install "stagetorch[lightning]"``.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from lightning.pytorch.plugins.precision import DoublePrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import ModelParallelStrategy, SingleDeviceStrategy

from ..api import jit
from ..devices.budget import format_bytes, parse_bytes
from ..errors import OutOfMemoryError, StagingError
from ..planning.chunks import Plan
from ..runtime.staged import Staged

__all__ = ["StagedStrategy", "StagedModelParallelStrategy"]

# The precision plugins a staged step runs under: full precision, and autocast mixed precision (the step is
# staged under the plugin's autocast, as Lightning runs training_step; a 16-mixed GradScaler's scale is an input
# of the program, multiplied into the loss before its backward as the plugin's pre_backward would).
_SUPPORTED_PRECISION = (Precision, DoublePrecision, MixedPrecision)


class _BatchIndex(int):
    """The ``batch_idx`` a staged ``training_step`` receives. The step's Python runs once, when it is staged,
    so a value read from ``batch_idx`` would be baked into the program and be wrong on every later batch:
    any use of it raises instead."""

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1)
        raise StagingError(
            f"training_step uses its batch_idx argument at {caller.f_code.co_filename}:{caller.f_lineno}, but under StagedStrategy training_step's Python runs only "
            "when the step is staged (once per input shape), not on every batch, so a value computed from "
            "batch_idx would be that of the batch it was staged on. What to do: keep batch_idx out of the "
            "computation (read self.global_step in a hook outside training_step instead), or train without "
            "StagedStrategy."
        )


for _name in (
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__mod__", "__rmod__", "__floordiv__",
    "__rfloordiv__", "__truediv__", "__rtruediv__", "__pow__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__",
    "__ge__", "__bool__", "__int__", "__index__", "__float__", "__str__", "__repr__", "__format__", "__neg__",
):
    setattr(_BatchIndex, _name, _BatchIndex._refuse)
del _name


class _StagedSteps:
    """The staging a strategy of this module adds to a Lightning strategy: ``training_step`` runs the staged
    step (with its backward) and keeps its gradients, ``backward`` puts them where ``loss.backward()`` would.
    ``_process_group()`` is the group a data-parallel step is staged over (None on one device)."""

    memory_budget: int | str | None
    remat: str | bool
    progress: bool
    _staged: dict
    _pending: list | None

    def _process_group(self) -> Any:
        return None

    def _check_module(self) -> None:
        """Refuse, before anything is set up, a module or precision the staged step cannot run."""
        name = type(self).__name__
        module = self.lightning_module
        if module is not None and not module.automatic_optimization:
            raise ValueError(
                f"{name}: {type(module).__name__} sets automatic_optimization = False. The strategy stages "
                "training_step with Lightning's backward, which manual optimisation calls itself. What to do: "
                "keep automatic optimisation, or wrap your own forward-and-backward in stagetorch.jit inside "
                f"training_step and train without {name}."
            )
        if type(self.precision_plugin) not in _SUPPORTED_PRECISION:
            raise ValueError(
                f"{name}: precision plugin {type(self.precision_plugin).__name__} is not supported; it "
                'runs full precision (precision="32-true" or "64-true") and autocast mixed precision '
                f'("bf16-mixed", "16-mixed"). What to do: pick one of those precisions, or train without {name}.'
            )

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        assert module is not None
        if kwargs or len(args) > 2:
            raise TypeError(f"{type(self).__name__} stages training_step(batch) and training_step(batch, batch_idx) only")
        batch, with_index = args[0], len(args) == 2
        step = self._step(module, module.trainer.accumulate_grad_batches, with_index)
        params = [p for p in module.parameters() if p.requires_grad]
        old = [p.grad for p in params]
        held = self._budget_for(step, module, old)
        for p in params:
            p.grad = None
        try:
            with self.precision_plugin.train_step_context():
                out, logged = step(batch, module, self._loss_scale())
            new = [p.grad for p in params]
        except StagingError as e:
            raise _named(e, module, held, type(self).__name__) from e
        finally:
            for p, g in zip(params, old):
                p.grad = g
        self._pending = list(zip(params, new))
        for name, value, log_args, log_kwargs in logged:
            module.log(name, value, *log_args, **log_kwargs)
        return out

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        pending, self._pending = self._pending, None
        if pending is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        # What loss.backward() would do: a gradient accumulates into an existing .grad (accumulate_grad_batches).
        for p, g in pending:
            if g is None:
                continue
            if p.grad is None:
                p.grad = g
            else:
                p.grad += g
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def plan(self, batch: Any) -> Plan:
        """How a training step on ``batch`` runs under this strategy: the whole batch at once or in chunks, the
        predicted peak, and why (see :class:`stagetorch.Plan`). Needs the module attached (from
        ``trainer.fit`` on, a callback included)."""
        module = self.lightning_module
        if module is None:
            raise RuntimeError(f"{type(self).__name__}.plan needs a LightningModule: call it once trainer.fit has started")
        with_index = len(inspect.signature(module.training_step).parameters) >= 2
        step = self._step(module, module.trainer.accumulate_grad_batches, with_index)
        params = [p for p in module.parameters() if p.requires_grad]
        old = [p.grad for p in params]
        self._budget_for(step, module, old)
        # As training_step runs it: the previous gradients are out of the budget and off the parameters (with
        # them on, the step's plan counted them a second time, as gradients it would accumulate into).
        for p in params:
            p.grad = None
        try:
            with self.precision_plugin.train_step_context():
                return step.plan(batch, module, self._loss_scale())
        finally:
            for p, g in zip(params, old):
                p.grad = g

    def _loss_scale(self) -> torch.Tensor | None:
        """A 16-mixed run's GradScaler scale as a tensor (None without a scaler): an argument of the staged
        step, not a Python number, which would be staged into the program and go stale when the scaler moves."""
        scaler = getattr(self.precision_plugin, "scaler", None)
        # GradScaler.scale multiplies by its scale tensor: applied to a one it is that scale, exactly.
        return None if scaler is None else scaler.scale(torch.ones((), device=self.root_device))

    def _budget_for(self, step: Staged, module: Any, grads: list[torch.Tensor | None]) -> int:
        """Plan ``step`` in ``memory_budget`` less what the run holds beside it while it runs: the previous
        step's gradients (Lightning clears them after ``training_step``) and the optimizers' state. **Returns**
        those bytes. Without a budget the device's free memory, read at the call, has them out already."""
        held = {}
        states = [t for opt in module.trainer.optimizers for st in opt.state.values() for t in st.values()]
        for t in [*grads, *states]:
            if isinstance(t, torch.Tensor) and callable(getattr(t, "to_local", None)):
                t = t.to_local()  # a DTensor (FSDP2's shards, their .grad and AdamW state): this rank's part
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        total = sum(held.values())
        if self.memory_budget is not None:
            step.memory_budget = max(parse_bytes(self.memory_budget) - total, 0)
        return total

    def _step(self, module: Any, accumulate: int, with_index: bool) -> Staged:
        """The staged training step of ``module``, one per number of batches Lightning accumulates over (the
        loss is divided by it before the backward, as Lightning's closure does)."""
        key = (id(module), accumulate, with_index)
        if key not in self._staged:
            self._staged[key] = jit(
                _training_step(accumulate, with_index),
                batch_argnums=(0,),
                memory_budget=self.memory_budget,
                remat=self.remat,
                progress=self.progress,
                process_group=self._process_group(),
            )
        return self._staged[key]



class StagedStrategy(_StagedSteps, SingleDeviceStrategy):
    """A single-device strategy whose training steps run staged, chunked to fit ``memory_budget``.

    **Arguments**

    - ``memory_budget``: bytes (or ``"512MiB"``) the run may use; default: the device's free memory. Each step
      is planned in it less what the run holds beside the step (the optimizer's state, and the previous
      step's gradients, which Lightning clears after ``training_step``). A batch whose step does not fit runs
      in exact chunks (see :func:`stagetorch.jit`).
    - ``remat``: ``"auto"`` (default) may also recompute forward values in the backward; ``False`` only chunks.
    - ``progress``: a progress bar over the chunks of a chunked step.
    - ``device``: the device to train on; default: the Trainer's accelerator's first device.

    The LightningModule needs ``automatic_optimization = True`` (Lightning's default) and a ``training_step``
    that returns its loss (a tensor, or a dict with ``"loss"``) without reading tensor values (``.item()``) or
    ``batch_idx``. ``self.log(...)`` inside it works: the logged tensors are outputs of the staged program and
    are logged with their values on every step. Validation, testing and prediction run as Lightning runs them.
    """

    strategy_name = "stagetorch"

    def __init__(
        self,
        memory_budget: int | str | None = None,
        *,
        remat: str | bool = "auto",
        progress: bool = False,
        device: torch.device | str | None = None,
        **kwargs: Any,
    ):
        super().__init__(device="cpu" if device is None else device, **kwargs)
        self._device_given = device is not None
        self.memory_budget = memory_budget
        self.remat = remat
        self.progress = progress
        self._staged: dict[tuple[int, int, bool], Staged] = {}
        self._pending: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None

    @property
    def root_device(self) -> torch.device:
        if self._device_given or self.accelerator is None:
            return self._root_device
        return self.accelerator.get_parallel_devices(self.accelerator.parse_devices(1))[0]

    def setup(self, trainer: Any) -> None:
        self._check_module()
        super().setup(trainer)


class StagedModelParallelStrategy(_StagedSteps, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2: the LightningModule's ``configure_model`` applies
    ``fully_shard`` over ``self.device_mesh["data_parallel"]``) whose training steps run staged with
    ``stagetorch.jit(step, process_group=...)``: each rank runs its part of the batch in chunks sized to its own
    ``memory_budget``, and the gradients are those of the **global** batch (every rank's batches together, a
    mean over all their examples, shards of uneven sizes included), reduce-scattered into FSDP2's sharded
    ``.grad`` (see the FSDP2 section of docs/distributed.md). ``memory_budget``, ``remat`` and ``progress`` as
    for :class:`StagedStrategy`; the other arguments are ``ModelParallelStrategy``'s.

    Data parallelism only: ``tensor_parallel_size`` must be 1 (default), and ``data_parallel_size`` defaults
    to every process. Each rank's batch is its own (Lightning's distributed sampler, or
    ``use_distributed_sampler=False`` and a DataLoader per rank): the global batch is all of them, whatever
    their sizes, where Lightning alone averages each rank's own mean loss."""

    strategy_name = "stagetorch_model_parallel"

    def __init__(
        self,
        memory_budget: int | str | None = None,
        *,
        remat: str | bool = "auto",
        progress: bool = False,
        data_parallel_size: Any = "auto",
        tensor_parallel_size: Any = 1,
        **kwargs: Any,
    ):
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size, **kwargs)
        self.memory_budget = memory_budget
        self.remat = remat
        self.progress = progress
        self._staged: dict[tuple[int, int, bool], Staged] = {}
        self._pending: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None

    def setup_environment(self) -> None:
        if self._tensor_parallel_size != 1:
            raise ValueError(
                f"StagedModelParallelStrategy: tensor_parallel_size={self._tensor_parallel_size}; a staged step "
                "runs FSDP2 data parallelism only (parameters sharded with fully_shard, every rank its own "
                "examples), not tensor parallelism. What to do: tensor_parallel_size=1, or train with "
                "Lightning's ModelParallelStrategy without stagetorch."
            )
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    def setup(self, trainer: Any) -> None:
        self._check_module()
        super().setup(trainer)

    def _process_group(self) -> Any:
        return self.device_mesh["data_parallel"].get_group()


def _training_step(accumulate: int, with_index: bool) -> Any:
    # batch_idx is left out of the staged function's arguments: each value would stage a program of its own.
    # The module is an argument (static, not batched) rather than a closure variable: stagetorch finds the
    # modules of a function defined in its own package through its arguments only.
    rest = (_BatchIndex(0),) if with_index else ()

    def lightning_training_step(batch: Any, module: Any, scale: torch.Tensor | None) -> tuple[Any, list]:
        with _logs_recorded(module) as logged:
            out = module.training_step(batch, *rest)
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, torch.Tensor):
            raise StagingError(
                f"training_step returned {type(out).__name__}, not a loss: a staged step must return its loss (a "
                "tensor, or a dict with 'loss'). Skipping a batch by returning None depends on the batch's values, "
                "which a program staged once per shape cannot see."
            )
        loss = loss / accumulate
        # The backward's seed, as Lightning's closure makes it: a 16-mixed plugin's pre_backward scales the loss.
        (loss if scale is None else loss * scale).backward()
        return out, logged

    return lightning_training_step


@contextlib.contextmanager
def _logs_recorded(module: Any) -> Iterator[list]:
    """Record ``module.log(...)`` calls made while the step is staged, to log them after each run with the
    values the program computes (``log_dict`` calls ``log``)."""
    logged: list = []

    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if not isinstance(value, (torch.Tensor, int, float)):
            raise StagingError(
                f"training_step logs {name!r} as a {type(value).__name__}: under StagedStrategy training_step's "
                "Python runs once per input shape, so an object updated there (a torchmetrics Metric) would be "
                "updated once, not per batch. What to do: log a tensor, and update metrics in "
                "on_train_batch_end from the outputs training_step returns."
            )
        logged.append((name, value, args, kwargs))

    module.__dict__["log"] = log
    try:
        yield logged
    finally:
        del module.__dict__["log"]


def _named(error: StagingError, module: Any, held: int, strategy: str) -> StagingError:
    """``error`` again, saying which call failed, what to do, and that the run is as before the step; for an
    error about the budget, what it was planned in."""
    fn = type(module).training_step
    try:
        where = f" ({inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]})"
    except (OSError, TypeError):
        where = ""
    budget, smallest = "", error.smallest_budget
    if isinstance(error, OutOfMemoryError) and held:
        budget = (f" (The step was planned in memory_budget less {format_bytes(held)} that the run holds beside it: "
                  "the previous step's .grad, which Lightning clears after training_step, and the optimizer's state")
        if smallest is not None:
            smallest += held
            budget += f"; the smallest memory_budget that fits is {format_bytes(smallest)}"
        budget += ".)"
    wrapped = type(error)(
        f"{strategy} could not run {type(module).__name__}.training_step{where} as a staged step: {error}"
        f"{budget}\n"
        "Parameters, .grad and the optimizer are as they were before this step. What to do: change "
        f"training_step as the error says, or train this module without {strategy}."
    )
    wrapped.smallest_budget = smallest
    return wrapped

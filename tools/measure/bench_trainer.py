"""Measures: transformers.Trainer under a memory limit against StagedTrainer. Last run: 2026-11-26.

transformers.Trainer when the batch does not fit: auto_find_batch_size, gradient_checkpointing, StagedTrainer.

One model and one padded batch (a Llama of 2 layers, width 128, vocabulary 2,000; 32 rows of 16 to 64 tokens,
right-padded to 64, labels -100 on the padding), AdamW, 6 optimizer steps, float32, CPU. A memory limit of half
the plain Trainer's step peak. For each way of training within it:

- ``plain``: transformers.Trainer with no limit (the reference: the full batch).
- ``auto_find_batch_size``: the Trainer halving its batch after each out-of-memory error. CPU allocations do
  not fail, so the limit is emulated: a dispatch mode counts the live tensors and raises the CPU allocator's
  out-of-memory error past it (accelerate's find_executable_batch_size catches exactly that message). Its peak
  and time are those of the batch size it settled on (a plain Trainer at that size, without the emulation);
  its weights are those of the emulated run itself.
- ``gradient_checkpointing=True``: the plain Trainer recomputing each decoder layer (not adaptive: its peak is
  what it is, inside the limit or not).
- ``StagedTrainer``: memory_budget = the limit less AdamW's moments (the budget is the staged step's: the
  forward and backward; the moments live beside it, and the default budget, free memory, leaves them out too).

Peak: the CPU allocator's, through the profiler (the running sum of allocation events, maximum) over the
second optimizer step (forward, backward, clipping, optimizer step), plus the bytes alive before it (weights,
AdamW's moments). Step time: wall and the process's CPU time, one thread (torch.set_num_threads(1): on a
shared machine two threads spin-wait on each other and the times vary fivefold), median of steps 3 to 6
(step 1 stages, step 2 is profiled). Weights: max |w - w_plain|
after the 6 steps.

The rows carry no attention_mask: with right padding and a causal model it changes nothing (the padding sits
after every real token, and its labels are -100), and transformers' mask construction is not chunkable yet
(aten.index in masking_utils.py). For the same reason every run keeps use_cache=True (the Trainer's default
is False): without a cache and without a mask, masking_utils builds a packed-sequence mask whose chunked run
fails today (a view of the whole batch's mask at a chunk's shape). Pass --mask once both are fixed.

Run: python tools/measure/bench_trainer.py [--mask]
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import sys
import tempfile
import time
import weakref

import _paths  # noqa: F401  (tools/_paths.py: the tree and tests/support on sys.path)
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

import stagetorch
from stagetorch.integrations.transformers import StagedTrainer

MiB = 2**20
MASK = "--mask" in sys.argv
ROWS, LENGTH, VOCAB, STEPS = 32, 64, 2000, 6


def dataset(mask: bool) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(ROWS):
        ids = torch.randint(1, VOCAB, (LENGTH,), generator=g)
        n = int(torch.randint(16, LENGTH + 1, (), generator=g))
        keep = torch.arange(LENGTH) < n
        row = dict(input_ids=ids.masked_fill(~keep, 0), labels=ids.masked_fill(~keep, -100))
        if mask:
            row["attention_mask"] = keep.long()
        out.append(row)
    return out


def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=LENGTH,
    )
    return LlamaForCausalLM(config)


def _events(nodes):
    for e in nodes:
        yield e
        yield from _events(e.children)


def allocator_excess(prof: torch.profiler.profile) -> int:
    """The maximum of the running sum of the CPU allocator's allocation events (frees are negative)."""
    allocation = torch._C._profiler._EventType.Allocation
    tree = prof.profiler.kineto_results.experimental_event_tree()
    events = sorted(
        (e for e in _events(tree) if e.tag == allocation and e.extra_fields.device.type == "cpu"),
        key=lambda e: e.start_time_ns,
    )
    live = peak = 0
    for e in events:
        live += e.extra_fields.alloc_size
        peak = max(peak, live)
    return peak


class Measure(TrainerCallback):
    """Profile the second optimizer step's allocations; time every step."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.peak = 0
        self._prof = None

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kw):
        if state.global_step == 1:
            resident = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
            for moments in optimizer.state.values():
                for v in moments.values():
                    if isinstance(v, torch.Tensor):
                        resident[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
            self.resident = sum(resident.values())
            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        self._start = time.perf_counter(), time.process_time()

    def on_step_end(self, args, state, control, **kw):
        self.times.append(time.perf_counter() - self._start[0])
        self.cpu.append(time.process_time() - self._start[1])
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self.peak = self.resident + allocator_excess(self._prof)
            self._prof = None


class EmulatedLimit(TorchDispatchMode):
    """Raise the CPU allocator's out-of-memory error when the live tensors ATen ops made pass ``limit`` bytes
    (plus what was alive before: the weights)."""

    def __init__(self, limit: int, resident: int) -> None:
        super().__init__()
        self.limit, self.live, self.failures = limit - resident, 0, 0
        self.sizes: dict[int, int] = {}
        self.refs: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and type(t) in (torch.Tensor, torch.nn.Parameter):
                self._see(t)
        if self.live > self.limit:
            self.failures += 1
            raise RuntimeError(f"DefaultCPUAllocator: can't allocate memory (emulated: {self.live} live bytes)")
        return out

    def _see(self, t: torch.Tensor) -> None:
        key, nbytes = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
        if not nbytes:
            return
        if key not in self.sizes:
            self.sizes[key], self.refs[key] = nbytes, 0
            self.live += nbytes
        self.refs[key] += 1

        def gone(key=key) -> None:
            self.refs[key] -= 1
            if not self.refs[key]:
                self.live -= self.sizes.pop(key)
                del self.refs[key]

        weakref.finalize(t, gone)


def arguments(out: str, **kw) -> TrainingArguments:
    return TrainingArguments(**{
        "output_dir": out, "per_device_train_batch_size": ROWS, "max_steps": STEPS, "learning_rate": 1e-3,
        "report_to": [], "save_strategy": "no", "logging_strategy": "no", "use_cpu": True, "disable_tqdm": True,
        "use_cache": not MASK, **kw,
    })


def run(cls: type, data: list, start: torch.nn.Module, **kw) -> tuple[torch.nn.Module, Measure, Trainer]:
    trainer_kw = {k: kw.pop(k) for k in ("memory_budget",) if k in kw}
    m = copy.deepcopy(start)
    measure = Measure()
    trainer = cls(model=m, args=arguments(tempfile.mkdtemp(), **kw), train_dataset=data, callbacks=[measure], **trainer_kw)
    trainer.train()
    return m, measure, trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mask", action="store_true", help="pass the attention mask (once its batch rules exist)")
    parser.parse_args()
    torch.set_num_threads(1)
    data, start = dataset(MASK), model()
    weights = sum(p.numel() * p.element_size() for p in start.parameters())

    reference, plain, _ = run(Trainer, data, start)
    limit = plain.peak // 2
    rows = [("plain Trainer (no limit)", ROWS, plain, reference)]

    with EmulatedLimit(limit, weights) as emulated:
        found, _, finder = run(Trainer, data, start, auto_find_batch_size=True)
    settled = finder._train_batch_size
    _, at_settled, _ = run(Trainer, data, start, per_device_train_batch_size=settled)
    rows.append((f"auto_find_batch_size ({emulated.failures} OOM, settled at {settled})", settled, at_settled, found))

    checkpointed, ckpt, _ = run(Trainer, data, start, gradient_checkpointing=True)
    rows.append(("gradient_checkpointing=True", ROWS, ckpt, checkpointed))

    moments = 2 * weights
    staged, st, trainer = run(StagedTrainer, data, start, memory_budget=limit - moments)
    (plan,) = trainer.stagetorch_plans.values()
    rows.append((f"StagedTrainer: {_describe(plan)}", ROWS, st, staged))

    print(f"torch {torch.__version__}, transformers {__import__('transformers').__version__}, stagetorch "
          f"{stagetorch.__version__}; weights {weights / MiB:.1f} MiB; limit {limit / MiB:.1f} MiB; "
          f"mask {'on' if MASK else 'off (use_cache=True)'}; first staged step {st.times[0]:.2f} s\n")
    print("| run | rows per step | step peak (MiB) | within limit | step time (s) | step CPU time (s) | max abs(w - w_plain) |")
    print("|---|---|---|---|---|---|---|")
    for name, rows_per_step, m, w in rows:
        diff = max((p - q).abs().max().item() for p, q in zip(w.parameters(), reference.parameters()))
        print(f"| {name} | {rows_per_step} | {m.peak / MiB:.1f} | {'yes' if m.peak <= limit else 'no'} | "
              f"{statistics.median(m.times[2:]):.3f} | {statistics.median(m.cpu[2:]):.3f} | {diff:.1e} |")


def _describe(plan: stagetorch.Plan) -> str:
    text = f"{len(plan.chunk_sizes)} chunk(s) {list(plan.chunk_sizes)}, predicted {plan.peak / MiB:.1f} MiB"
    recompute = getattr(plan, "recompute", None)
    if recompute is not None:
        text += f", recomputing {recompute.dropped} op(s)"
    return text


if __name__ == "__main__":
    logging.getLogger("transformers").setLevel(logging.ERROR)
    main()

"""A/B: one-line mode on padded transformers models against eager. Last run: 2026-11-26.

One-line mode on padded transformers models (an attention mask): a step's time against eager, run
alternately in one process, with "lazy, before" the same one-line step as it was before the express replay
bound the 0-d tensors CPU ``scaled_dot_product_attention`` makes itself from a boolean mask (every step left
the express replay at the first attention; after two steps the recording was replayed slowly).

Setup: tests/end_to_end/test_transformers_zoo.py's tiny configs (hidden 32, 2 layers, 4 heads), float64, its padded batch
of 7 x 16, an AdamW step; one thread.

Run: python tools/ab/bench_lazy_padded.py [steps] [bert,gpt2,llama]
"""

from __future__ import annotations

import copy
import statistics
import sys
import time

import _paths  # noqa: F401  (tools/_paths.py: the tree and tests/support on sys.path)
import torch
import transformer_zoo as zoo

import stagetorch
from stagetorch.lazymode import express
from stagetorch.lazymode.recording import RECORDINGS

_made = express._made_from_python_values


def _step(label: str, model, optimizer, batch: dict, kept: dict) -> None:
    optimizer.zero_grad()
    if label == "eager":
        model(**batch).loss.backward()
    else:
        recordings = kept.setdefault(label, {})  # each lazy variant's recordings, apart (kept per input signature)
        RECORDINGS.clear()
        RECORDINGS.update(recordings)
        express._made_from_python_values = _made if label == "lazy" else (lambda *a: False)
        try:
            model(**dict(zip(batch, stagetorch.lazy(*batch.values(), batch=0)))).loss.backward()
        finally:
            express._made_from_python_values = _made
            recordings.clear()
            recordings.update(RECORDINGS)
    optimizer.step()


def main(steps: int = 30, names: str = "bert,gpt2,llama") -> None:
    torch.set_num_threads(1)
    for name in names.split(","):
        model, batch = zoo.make_model(name), zoo.make_batch(name, padded=True)
        models = {label: copy.deepcopy(model) for label in ("eager", "lazy", "lazy, before")}
        optimizers = {label: torch.optim.AdamW(m.parameters(), lr=1e-3) for label, m in models.items()}
        kept: dict[str, dict] = {}
        times: dict[str, list[float]] = {label: [] for label in models}
        for i in range(steps + 5):
            for label in models:
                t = time.perf_counter()
                _step(label, models[label], optimizers[label], batch, kept)
                if i >= 5:  # warm-up: recording, planning, the first replays
                    times[label].append(time.perf_counter() - t)
        for label in ("lazy", "lazy, before"):  # the same training as eager's
            for p, q in zip(models[label].parameters(), models["eager"].parameters()):
                assert torch.allclose(p, q, rtol=1e-9, atol=1e-12), (name, label)
        eager = statistics.median(times["eager"])
        print(f"{name}, padded batch {tuple(batch['input_ids'].shape)}, {steps} steps, medians:")
        for label, ts in times.items():
            print(f"  {label:13s} {statistics.median(ts) * 1e3:8.2f} ms  ({statistics.median(ts) / eager:.2f}x eager)")


if __name__ == "__main__":
    main(*(int(a) if a.isdigit() else a for a in sys.argv[1:]))

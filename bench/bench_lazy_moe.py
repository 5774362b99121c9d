"""One-line mode on an MoE model with its load-balancing loss (issue 24): a step's time against the same step
staged with ``jit`` and in eager, run alternately in one process; and where one-line mode's time goes (each
``Executable.run``: the peeks a mid-step write makes, the step's flush). "lazy, before" is one-line mode as it
was before two fixes: the answer to "does the whole flush keep rows a chunk orders its own way" was not kept
(the whole flush planned again, and refused, at each mid-step write), and a recording made again after a
divergence forgot that sessions had left its express replay (unpadded, every other step recorded). "lazy, write
leaves" is one-line mode before the express replay ran the router loss's write into a real tensor
(``zeros(E).scatter_add_``) itself: every step left the express replay there, and after two steps the
recording was replayed slowly.

Setup: tests/test_moe.py's tiny Mixtral (hidden 32, 2 layers, 4 experts, top 2), float32, its router loss
weighted 1, the padded batch of 7 x 16, the budget at which ``jit`` splits it in >= 3 chunks.

Run: python bench/bench_lazy_moe.py [steps] [mixtral|qwen2_moe|olmoe] [padded|unpadded]
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_chunking import budget_for  # noqa: E402
from test_moe import aux_step_of, batch, with_router_loss  # noqa: E402

import stagetorch  # noqa: E402
import stagetorch.devices  # noqa: E402
from stagetorch.errors import StagingError  # noqa: E402
from stagetorch.executable import Executable  # noqa: E402
from stagetorch.lazymode import express  # noqa: E402
from stagetorch.lazymode.recording import _RECORDINGS  # noqa: E402
from stagetorch.lazymode.session import _Session  # noqa: E402

runs: list[tuple[str, float]] = []
_run = Executable.run


def timed_run(self, inputs, plan, **kwargs):
    t = time.perf_counter()
    out = _run(self, inputs, plan, **kwargs)
    runs.append((f"{len(self.graph.eqns)} eqns, {len(plan.chunk_sizes)} chunks", time.perf_counter() - t))
    return out


_peeks = _Session._peeks


def replanning_peeks(self, executable, device):
    """The answer as before it was kept: the whole flush planned again at each mid-step write."""
    try:
        executable.plan(max(stagetorch.devices.free_memory(device, self.memory_budget) - executable.restore_bytes, 0))
        return False
    except StagingError as e:
        return bool(getattr(e, "chunk_local_result", False))


_diverge = _Session._diverge
_a_real_write = express._a_real_write


def forgetting_diverge(self):
    """A recording made again after a divergence starts with the express replay on, whatever its
    predecessor saw."""
    _diverge(self)
    self.recording.left, self.recording.express = 0, True


def main(steps: int = 30, name: str = "mixtral", padded: str = "padded") -> None:
    torch.set_num_threads(1)
    model, b = with_router_loss(name), batch(padded == "padded")
    m_eager, m_jit, m_lazy = (copy.deepcopy(model) for _ in range(3))
    staged = stagetorch.jit(aux_step_of(m_jit), remat=False)
    budget = budget_for(staged, *b)
    Executable.run = timed_run

    def eager():
        aux_step_of(m_eager)(*b)

    def jit():
        staged(*b)

    def lazy():
        ids, mask, labels = stagetorch.lazy(*b, batch=0, memory_budget=budget, remat=False)
        out = m_lazy(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        out.loss.item()

    kept = {}  # each lazy variant's recordings, apart (they are kept per input signature)

    def apart(label, fn):
        def run():
            recordings = kept.setdefault(label, {})
            _RECORDINGS.clear()
            _RECORDINGS.update(recordings)
            try:
                fn()
            finally:
                recordings.clear()
                recordings.update(_RECORDINGS)

        return run

    def lazy_before():
        _Session._peeks, _Session._diverge = replanning_peeks, forgetting_diverge
        try:
            lazy()
        finally:
            _Session._peeks, _Session._diverge = _peeks, _diverge

    def lazy_write_leaves():
        express._a_real_write = lambda *a: False
        try:
            lazy()
        finally:
            express._a_real_write = _a_real_write

    variants = (
        ("eager", eager), ("jit", jit), ("lazy", apart("lazy", lazy)),
        ("lazy, write leaves", apart("write leaves", lazy_write_leaves)), ("lazy, before", apart("before", lazy_before)),
    )
    times: dict[str, list[float]] = {label: [] for label, _ in variants}
    per_run: dict[str, list[float]] = {}
    for i in range(steps + 3):
        for label, fn in variants:
            for m in (m_eager, m_jit, m_lazy):
                m.zero_grad()
            runs.clear()
            t = time.perf_counter()
            fn()
            dt = time.perf_counter() - t
            if i >= 3:  # warm-up: recording, planning
                times[label].append(dt)
                if label == "lazy":
                    for j, (what, rt) in enumerate(runs):
                        per_run.setdefault(f"lazy run {j}: {what}", []).append(rt)
    Executable.run = _run
    print(f"{name}, {padded} batch {tuple(b[0].shape)}, budget {budget} B, {steps} steps, medians:")
    for label, ts in times.items():
        print(f"  {label:17s} {statistics.median(ts) * 1e3:8.2f} ms")
    for what, ts in per_run.items():
        print(f"  {what}: {statistics.median(ts) * 1e3:.2f} ms")


if __name__ == "__main__":
    main(*(int(a) if a.isdigit() else a for a in sys.argv[1:]))

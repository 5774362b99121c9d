"""A/B: one-line mode on an MoE with its router loss against jit and eager. Last run: 2026-11-26.

One-line mode on an MoE model with its load-balancing loss (issue 24): a step's time against the same step
staged with ``jit`` and in eager, run alternately in one process; and where one-line mode's time goes (each
``Executable.run``: the peeks a mid-step write makes, the step's flush). Each "lazy, ..." variant takes one more
fix away than the one above it: "unchained", each peek starting from the values the one before it kept (a
write per layer: each peek computed the layers before its own again, quadratic in the depth); "write leaves",
the express replay running the router loss's write into a real tensor (``zeros(E).scatter_add_``) itself
(every step left the express replay there, and after two steps the recording was replayed slowly);
"before", two older fixes: the answer to "does the whole flush keep rows a chunk orders its own way" was not
kept (the whole flush planned again, and refused, at each mid-step write), and a recording made again after a
divergence forgot that sessions had left its express replay (unpadded, every other step recorded).

Setup: tests/ops/test_moe.py's tiny Mixtral (hidden 32, 2 layers, 4 experts, top 2), float32, its router loss
weighted 1, the padded batch of 7 x 16, the budget at which ``jit`` splits it in >= 3 chunks.

Run: python tools/ab/bench_lazy_moe.py [steps] [mixtral|qwen2_moe|olmoe] [padded|unpadded] [layers]
"""

from __future__ import annotations

import copy
import statistics
import sys
import time

import _paths  # noqa: F401  (tools/_paths.py: the tree and tests/support on sys.path)
import test_moe
import torch
from budgets import budget_for
from test_moe import aux_step_of, batch, with_router_loss

import stagetorch
import stagetorch.devices.budget
from stagetorch.errors import StagingError
from stagetorch.lazymode import express, session
from stagetorch.lazymode.recording import RECORDINGS
from stagetorch.lazymode.session import _Session
from stagetorch.runtime.executable import Executable

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
        executable.plan(max(stagetorch.devices.budget.free_memory(device, self.memory_budget) - executable.restore_bytes, 0))
        return False
    except StagingError as e:
        return bool(getattr(e, "chunk_local_result", False))


_diverge = _Session._diverge
_a_real_write = express._a_real_write
_learn_chain = session._learn_chain


def forgetting_diverge(self):
    """A recording made again after a divergence starts with the express replay on, whatever its
    predecessor saw."""
    _diverge(self)
    self.recording.left, self.recording.express = 0, True


def main(steps: int = 30, name: str = "mixtral", padded: str = "padded", layers: int = 2) -> None:
    torch.set_num_threads(1)
    test_moe.H["num_hidden_layers"] = layers
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
            RECORDINGS.clear()
            RECORDINGS.update(recordings)
            try:
                fn()
            finally:
                recordings.clear()
                recordings.update(RECORDINGS)

        return run

    # Each variant below takes one more fix away than the one above it.
    def unchained():
        session._learn_chain = lambda before, before_key, span, key: setattr(span, "alone", True)

    def write_leaves():
        unchained()
        express._a_real_write = lambda *a: False

    def before():
        write_leaves()
        _Session._peeks, _Session._diverge = replanning_peeks, forgetting_diverge

    def patched(patch):
        def run():
            patch()
            try:
                lazy()
            finally:
                session._learn_chain, express._a_real_write = _learn_chain, _a_real_write
                _Session._peeks, _Session._diverge = _peeks, _diverge

        return run

    variants = (
        ("eager", eager), ("jit", jit), ("lazy", apart("lazy", lazy)),
        ("lazy, unchained", apart("unchained", patched(unchained))),
        ("lazy, write leaves", apart("write leaves", patched(write_leaves))),
        ("lazy, before", apart("before", patched(before))),
    )
    times: dict[str, list[float]] = {label: [] for label, _ in variants}
    per_run: dict[str, list[float]] = {}
    for i in range(steps + 8):
        for label, fn in variants:
            for m in (m_eager, m_jit, m_lazy):
                m.zero_grad()
            runs.clear()
            t = time.perf_counter()
            fn()
            dt = time.perf_counter() - t
            if i >= 8:  # warm-up: recording, planning, the re-recordings before a recording settles
                times[label].append(dt)
                if label in ("lazy", "lazy, unchained"):
                    for j, (what, rt) in enumerate(runs):
                        per_run.setdefault(f"{label} run {j}: {what}", []).append(rt)
                    # every run but the step's flush at backward() (the last that chunks, then the optimizer's)
                    last = max(j for j, (what, _) in enumerate(runs) if not what.endswith(" 1 chunks")) if any(
                        not what.endswith(" 1 chunks") for what, _ in runs) else len(runs) - 1
                    per_run.setdefault(f"{label}: runs before the step's flush, summed", []).append(
                        sum(rt for _, rt in runs[:last]))
    Executable.run = _run
    print(f"{name}, {layers} layers, {padded} batch {tuple(b[0].shape)}, budget {budget} B, {steps} steps, medians:")
    for label, ts in times.items():
        print(f"  {label:17s} {statistics.median(ts) * 1e3:8.2f} ms")
    for what, ts in per_run.items():
        print(f"  {what}: {statistics.median(ts) * 1e3:.2f} ms")


if __name__ == "__main__":
    main(*(int(a) if a.isdigit() else a for a in sys.argv[1:]))

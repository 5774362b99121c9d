"""One-line mode against eager PyTorch on CPU: the seed MLP train step at batch 8 and 256 (issue 5).

Run: python -m pytest bench/bench_lazy.py --benchmark-enable -s

``test_seed_step`` times each mode on its own (pytest-benchmark's table). ``test_interleaved_ratio`` runs
an eager step and a lazy step alternately, 400 times, and prints the ratio of their medians: on a shared
machine whose speed drifts by 20-30% within a minute, that ratio is the number to quote.
``test_model_zoo_ratio`` does the same for the models of ``tests/support/models.py`` (CNN, transformer, MHA, GPT-2).
"""

from __future__ import annotations

import copy
import statistics
import time

import models
import pytest
import torch
import torch.nn as nn

import stagetorch


def seed_step(model, x, y, mode):
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        inputs, labels = stagetorch.lazy(x, y, batch=0) if mode == "lazy" else (x, y)
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), labels)
        loss.backward()
        optimizer.step()

    return step


@pytest.mark.parametrize("batch", [8, 256])
@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_seed_step(benchmark, batch, mode):
    torch.set_num_threads(2)
    model, make = models.seed_mlp()
    x, y = make(batch)
    step = seed_step(model, x, y, mode)
    for _ in range(3):
        step()
    benchmark.pedantic(step, rounds=30, iterations=1, warmup_rounds=3)


def interleaved(eager, lazy, n=400):
    """Medians of ``n`` eager and ``n`` lazy steps, run alternately after 20 of each."""
    for _ in range(20):
        eager()
        lazy()
    times: dict[str, list[float]] = {"eager": [], "lazy": []}
    for _ in range(n):
        for name, step in (("eager", eager), ("lazy", lazy)):
            t = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t)
    return statistics.median(times["eager"]), statistics.median(times["lazy"])


@pytest.mark.parametrize("batch", [8, 256])
def test_interleaved_ratio(benchmark, batch):
    torch.set_num_threads(2)
    model, make = models.seed_mlp()
    x, y = make(batch)
    eager, lazy = seed_step(model, x, y, "eager"), seed_step(copy.deepcopy(model), x, y, "lazy")
    e, z = benchmark.pedantic(interleaved, (eager, lazy), rounds=1, iterations=1)
    benchmark.extra_info.update(eager_median_us=e * 1e6, lazy_median_us=z * 1e6, ratio=z / e)
    print(f"\nbatch {batch}: eager median {e * 1e6:.0f} us, lazy median {z * 1e6:.0f} us, lazy / eager {z / e:.2f}")


def zoo_step(name, model, x, y, mode):
    """A train step of a model of tests/support/models.py: forward, loss, backward, SGD step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    forward_backward = models.gpt2_step(model) if name == "gpt2" else models.train_step(model)

    def step():
        inputs, labels = stagetorch.lazy(x, y, batch=0) if mode == "lazy" else (x, y)
        optimizer.zero_grad()
        forward_backward(inputs, labels)
        optimizer.step()

    return step


@pytest.mark.parametrize(("name", "batch"), [("cnn", 32), ("transformer", 8), ("mha", 8), ("gpt2", 8)])
def test_model_zoo_ratio(benchmark, name, batch):
    """The express replay on the model zoo: lazy against eager, interleaved (200 of each)."""
    if name == "gpt2":
        pytest.importorskip("transformers")
    torch.set_num_threads(2)
    model, make = models.gpt2() if name == "gpt2" else models.CLASSIFIERS[name]()
    x, y = make(batch)
    eager = zoo_step(name, model, x, y, "eager")
    lazy = zoo_step(name, copy.deepcopy(model), x, y, "lazy")
    e, z = benchmark.pedantic(interleaved, (eager, lazy, 200), rounds=1, iterations=1)
    benchmark.extra_info.update(eager_median_us=e * 1e6, lazy_median_us=z * 1e6, ratio=z / e)
    print(f"\n{name}, batch {batch}: eager median {e * 1e6:.0f} us, lazy median {z * 1e6:.0f} us, lazy / eager {z / e:.2f}")


@pytest.mark.parametrize("batch", [8, 256])
def test_inference_ratio(benchmark, batch):
    """An evaluation step under ``torch.no_grad()``: forward, accuracy, ``.item()`` (interleaved, 400 of each).
    No autograd bookkeeping to save here: the guards and the flush are the whole difference."""
    torch.set_num_threads(2)
    model, make = models.seed_mlp()
    x, y = make(batch)

    def step(mode):
        def run():
            with torch.no_grad():
                inputs, labels = stagetorch.lazy(x, y, batch=0) if mode == "lazy" else (x, y)
                return (model(inputs).argmax(1) == labels).float().mean().item()

        return run

    eager, lazy = step("eager"), step("lazy")
    assert eager() == lazy()
    e, z = benchmark.pedantic(interleaved, (eager, lazy), rounds=1, iterations=1)
    benchmark.extra_info.update(eager_median_us=e * 1e6, lazy_median_us=z * 1e6, ratio=z / e)
    print(f"\nno_grad, batch {batch}: eager median {e * 1e6:.0f} us, lazy median {z * 1e6:.0f} us, lazy / eager {z / e:.2f}")

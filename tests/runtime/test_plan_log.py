"""The plan in the ``stagetorch`` log (issue 46 item 3): one short INFO line per step, and one more only when the
plan changes, saying why (another batch size, another budget); the whole plan at DEBUG; no note about random
draws where nothing draws; never inside a progress bar's line; ``stagetorch.memory`` probes at DEBUG, and its
whole-batch peak the plan's."""

from __future__ import annotations

import copy
import logging
import re
import sys

import pytest
import torch
import torch.nn.functional as F

import stagetorch
from stagetorch.runtime.plan_log import emit

STEPS = 5


class Attention(torch.nn.Module):
    """Self-attention through scaled_dot_product_attention (dropout_p 0: a kernel tagged random that draws
    nothing), a Dropout(0.0) and a pooled head: per example, so that it chunks."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)
        self.drop = torch.nn.Dropout(dropout)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        h = F.scaled_dot_product_attention(q, k, v)
        return self.head(self.drop(torch.tanh(h)).mean(1))


@pytest.fixture(autouse=True)
def _logger_as_a_fresh_process_has_it():
    """The stagetorch logger at its default level (a test or page before may have turned it up): what each test
    counts is what it turned on itself."""
    logger = logging.getLogger("stagetorch")
    level = logger.level
    logger.setLevel(logging.NOTSET)
    yield
    logger.setLevel(level)


def _data(batch: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch, 6, 16), torch.randint(0, 3, (batch,))


def _step_of(model: torch.nn.Module, opt: torch.optim.Optimizer):
    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def _chunking_budget(step, x, y) -> int:
    """A budget that runs the step in chunks (nothing recomputed): 70% of its whole-batch peak."""
    return int(stagetorch.jit(step, remat=False).plan(x, y).whole_batch_bytes * 0.7)


def _plan_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "stagetorch" and r.levelno == logging.INFO and " budget" in r.getMessage()]


def test_a_training_loop_logs_one_plan_line_and_one_more_for_another_batch_size(caplog):
    torch.manual_seed(0)
    model = Attention()
    eager_model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=0.1)
    x, y = _data()
    step = stagetorch.jit(_step_of(model, opt), memory_budget=_chunking_budget(_step_of(model, opt), x, y))
    eager = _step_of(eager_model, eager_opt)
    with caplog.at_level(logging.INFO, logger="stagetorch"):
        for _ in range(STEPS):
            torch.testing.assert_close(step(x, y), eager(x, y), rtol=1e-5, atol=1e-6)
        lines = _plan_lines(caplog)
        assert len(lines) == 1, lines
        assert re.fullmatch(
            r"stagetorch: step: batch 8 in \d+ chunks \[[\d+]+\](, recomputing \d+ op\(s\))?: predicted peak [\d.]+ "
            r"\w?i?B of a [\d.]+ \w?i?B budget \(whole batch at once: [\d.]+ \w?i?B, as stagetorch.memory says\)",
            lines[0]), lines[0]
        # Short: no op names, no reasons; those are at DEBUG.
        assert "aten" not in lines[0] and "Random" not in lines[0] and len(lines[0]) < 200, lines[0]
        caplog.clear()
        for _ in range(2):
            torch.testing.assert_close(step(x[:4], y[:4]), eager(x[:4], y[:4]), rtol=1e-5, atol=1e-6)
        lines = _plan_lines(caplog)
        assert len(lines) == 1 and "the plan changed (another batch size, 8 -> 4): batch 4 " in lines[0], lines
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_another_budget_that_changes_the_plan_is_said_and_one_that_does_not_is_not(caplog):
    model = Attention()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()
    step = stagetorch.jit(_step_of(model, opt), remat=False)
    whole = step.plan(x, y).whole_batch_bytes
    with caplog.at_level(logging.INFO, logger="stagetorch"):
        step.memory_budget = whole * 4
        step(x, y)
        step.memory_budget = whole * 3  # the same plan: the whole batch at once
        step(x, y)
        assert len(_plan_lines(caplog)) == 1, _plan_lines(caplog)
        step.memory_budget = int(whole * 0.7)
        step(x, y)
    lines = _plan_lines(caplog)
    assert len(lines) == 2 and "the plan changed (another budget, " in lines[1] and "chunks" in lines[1], lines


def test_the_whole_plan_is_at_debug_once_per_change(caplog):
    model = Attention(dropout=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()
    step = stagetorch.jit(_step_of(model, opt), memory_budget=_chunking_budget(_step_of(model, opt), x, y))
    with caplog.at_level(logging.DEBUG, logger="stagetorch"):
        for _ in range(3):
            step(x, y)
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG and "Plan: batch 8" in r.getMessage()]
    assert len(debug) == 1 and "Random ops (dropout) draw per chunk" in debug[0], debug


def test_no_note_about_random_draws_where_nothing_draws():
    """Dropout(0.0) and an attention kernel with dropout_p 0 (tagged random by PyTorch) draw nothing."""
    model = Attention(dropout=0.0)
    x, y = _data()
    step = _step_of(model, torch.optim.SGD(model.parameters(), lr=0.1))
    plan = stagetorch.jit(step, memory_budget=_chunking_budget(step, x, y)).plan(x, y)
    assert plan.chunked and "Random" not in str(plan), plan


@pytest.mark.parametrize("fraction", [4.0, 0.8, 0.6])
def test_memory_says_the_whole_batch_peak_the_plan_says_whatever_the_budget(fraction, caplog):
    """The plan's "whole batch at once" is the step's peak as stagetorch.memory reports it (nothing recomputed,
    with what the call holds beside the program), under a budget it fits, one it chunks at and one where it
    recomputes; and memory()'s probes at other batch sizes log nothing at INFO."""
    model = Attention()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = _data(16)
    step = _step_of(model, opt)
    jitted = stagetorch.jit(step)
    jitted(x, y)  # AdamW's state made: the program the later steps run
    whole = jitted.plan(x, y).whole_batch_bytes
    budget = int(whole * fraction)
    with caplog.at_level(logging.INFO, logger="stagetorch"):
        report = stagetorch.memory(step, memory_budget=budget)(x, y)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO] == []
    plan = stagetorch.jit(step, memory_budget=budget).plan(x, y)
    assert plan.whole_batch_bytes == report.peak_bytes == whole, (plan.whole_batch_bytes, report.peak_bytes, whole)
    if fraction < 1:
        assert plan.chunked or plan.peak < whole, plan


def test_a_plan_line_under_a_progress_bar_is_written_above_it(capsys):
    """A handler on the terminal gets the plan line through tqdm.write: on a line of its own, not after the
    bar's text; and no handler is added to any logger."""
    pytest.importorskip("tqdm")
    model = Attention()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()
    step = stagetorch.jit(_step_of(model, opt), memory_budget=_chunking_budget(_step_of(model, opt), x, y),
                          progress=True)
    logger = logging.getLogger("stagetorch")
    handler = logging.StreamHandler(sys.stderr)  # (capsys's stderr: the terminal here)
    handler.setFormatter(logging.Formatter("LOG %(message)s"))
    level, handlers, root_handlers = logger.level, list(logger.handlers), list(logging.root.handlers)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        step(x, y)
        assert logger.handlers == [*handlers, handler] and logging.root.handlers == root_handlers
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    err = capsys.readouterr().err
    assert "example/s]" in err, err  # the bar was drawn
    at = err.index("LOG stagetorch: step: batch 8")
    assert err[at - 1] in "\r\n", repr(err[max(at - 80, 0):at + 40])


def test_emit_without_a_bar_is_a_plain_log_call(caplog):
    with caplog.at_level(logging.INFO, logger="stagetorch"):
        emit(logging.INFO, "stagetorch: %s", "hello")
        emit(logging.DEBUG, "stagetorch: %s", "hidden")
    assert [r.getMessage() for r in caplog.records] == ["stagetorch: hello"]


def test_a_trainer_logs_its_plan_once_over_two_steps(tmp_path, caplog):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from trainer_models import BATCH, PooledClassifier, budget_for_chunks, padded_dataset
    from transformers import TrainingArguments

    from stagetorch.integrations.transformers import StagedTrainer

    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=BATCH, max_steps=2, optim="sgd", learning_rate=1e-2,
        report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True, disable_tqdm=True,
    )
    trainer = StagedTrainer(model=PooledClassifier(), args=args, train_dataset=padded_dataset("cls"), remat=False)
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.memory_budget = budget_for_chunks(trainer, lambda: trainer.step_plan(batch), 3)
    with caplog.at_level(logging.INFO, logger="stagetorch"):
        trainer.train()
    lines = _plan_lines(caplog)
    assert len(lines) == 1 and "chunks" in lines[0], lines

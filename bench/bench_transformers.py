"""Recomputation on real model code against what its users already have: ``model.gradient_checkpointing_enable()``.

Tiny configs of `transformers` models (8 layers, or 4 + 4 for encoder-decoders; hidden 64, 4 heads, vocab
97, the configs' own dropout), one example of 512 tokens, float32, CPU, a training step
``loss = model(**batch).loss; loss.backward()``. Per model: the eager step's peak; transformers' per-layer
checkpointing, its peak and step time; stagetorch at the smallest budget it accepts (the budget the
``OutOfMemoryError`` of a tiny one names), its predicted and measured peak and step time. Peaks are measured
at the CPU allocator (``tests/memtrack.py``'s ``AllocatorPeak``: every byte it hands out, the model's
parameters, the batch and the gradients held before the step counted as resident); step times are medians of
interleaved runs (checkpointing, stagetorch, checkpointing, ...), in the same process.

    PYTHONPATH=.:tests python bench/bench_transformers.py [--models gpt2,llama] [--repeats 5] [--mask]

``--mask`` passes an all-ones ``attention_mask`` too (batch 1, so nothing is padded). The column
"chunked exact, 3 chunks" is left for the chunked runs of a batch of 3 (``tests/test_transformers_zoo.py``).
Results in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from memtrack import AllocatorPeak  # noqa: E402

import stagetorch  # noqa: E402
from stagetorch.errors import OutOfMemoryError  # noqa: E402

MiB = 2**20
VOCAB, HIDDEN, HEADS, LAYERS, TOKENS = 97, 64, 4, 8, 512


def _configs() -> dict[str, Callable[[], torch.nn.Module]]:
    import transformers as tf

    small = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS, intermediate_size=2 * HIDDEN,
                 max_position_embeddings=TOKENS)
    decoder = dict(small, num_hidden_layers=LAYERS, num_key_value_heads=HEADS)
    return {
        "GPT-2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_head=HEADS, n_layer=LAYERS,
                                                          n_positions=TOKENS, bos_token_id=0, eos_token_id=0)),
        "Llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**decoder)),
        "Mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**decoder)),
        "Qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**decoder)),
        "BERT": lambda: tf.BertForMaskedLM(tf.BertConfig(**small, num_hidden_layers=LAYERS)),
        "OPT": lambda: tf.OPTForCausalLM(tf.OPTConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS,
                                                      ffn_dim=2 * HIDDEN, num_hidden_layers=LAYERS, word_embed_proj_dim=HIDDEN,
                                                      max_position_embeddings=TOKENS, bos_token_id=0, eos_token_id=0,
                                                      pad_token_id=1)),
        "GPT-NeoX": lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**small, num_hidden_layers=LAYERS)),
        "T5": lambda: tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS,
                                                                d_ff=2 * HIDDEN, num_heads=HEADS, num_layers=LAYERS // 2,
                                                                decoder_start_token_id=0, pad_token_id=0)),
        "BART": lambda: tf.BartForConditionalGeneration(tf.BartConfig(
            vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=LAYERS // 2, decoder_layers=LAYERS // 2,
            encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=2 * HIDDEN,
            decoder_ffn_dim=2 * HIDDEN, max_position_embeddings=TOKENS, pad_token_id=1, bos_token_id=0,
            eos_token_id=2, decoder_start_token_id=2)),
    }


MODELS = ("GPT-2", "Llama", "Mistral", "Qwen2", "BERT", "OPT", "GPT-NeoX", "T5", "BART")


def model_and_batch(name: str, mask: bool = False, seed: int = 0) -> tuple[torch.nn.Module, dict]:
    """The model (in training mode, its configured dropout on) and one example of ``TOKENS`` tokens."""
    torch.manual_seed(seed)
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        model = _configs()[name]()
    model.train()
    ids = torch.randint(3, VOCAB, (1, TOKENS), generator=torch.Generator().manual_seed(seed))
    batch = dict(input_ids=ids, labels=ids.clone())
    if mask:
        batch["attention_mask"] = torch.ones_like(ids)
    return model, batch


def step_of(model: torch.nn.Module) -> Callable:
    def step(**batch):
        loss = model(**batch).loss
        loss.backward()
        return loss

    return step


def _resident(model: torch.nn.Module, batch: dict) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers(), *batch.values()]


def _peak(step: Callable, model: torch.nn.Module, batch: dict) -> int:
    model.zero_grad(set_to_none=True)
    with AllocatorPeak(_resident(model, batch)) as tracker:
        step(**batch)
    return tracker.peak


@contextlib.contextmanager
def checkpointing(model: torch.nn.Module):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.gradient_checkpointing_enable()
        try:
            yield
        finally:
            model.gradient_checkpointing_disable()


def smallest_budget(staged: stagetorch.Staged, batch: dict) -> int:
    """The smallest budget ``staged`` accepts for ``batch``: what the error under a 1 KiB budget names."""
    staged.memory_budget = 1024
    try:
        staged.plan(**batch)
    except OutOfMemoryError as e:
        return e.smallest_budget
    raise AssertionError("a 1 KiB budget was accepted")


def measure(name: str, repeats: int = 5, mask: bool = False) -> dict:
    """One row of the table (bytes and seconds)."""
    model, batch = model_and_batch(name, mask)
    step = step_of(model)
    row: dict = {"model": name, "eager_peak": _peak(step, model, batch)}
    with checkpointing(model):
        step(**batch)  # warm
        row["ckpt_peak"] = _peak(step, model, batch)
    staged = stagetorch.jit(step)
    budget = row["budget"] = smallest_budget(staged, batch)
    staged.memory_budget = budget
    plan = staged.plan(**batch)
    row["predicted"], row["plan"] = plan.peak, str(plan)
    staged(**batch)  # warm
    row["stagetorch_peak"] = _peak(staged, model, batch)
    times: dict[str, list[float]] = {"ckpt": [], "stagetorch": []}
    for _ in range(repeats):
        for kind in ("ckpt", "stagetorch"):
            model.zero_grad(set_to_none=True)
            with checkpointing(model) if kind == "ckpt" else contextlib.nullcontext():
                start = time.perf_counter()
                (step if kind == "ckpt" else staged)(**batch)
                times[kind].append(time.perf_counter() - start)
    row["ckpt_time"] = statistics.median(times["ckpt"])
    row["stagetorch_time"] = statistics.median(times["stagetorch"])
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| model | eager peak | checkpointing: peak | step | stagetorch: smallest budget | predicted | measured "
        "| step | chunked exact, 3 chunks |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['error']} |  |  |  |  |  |  |  |")
            continue
        lines.append(
            f"| {r['model']} | {r['eager_peak'] / MiB:.1f} MiB | {r['ckpt_peak'] / MiB:.2f} MiB | "
            f"{r['ckpt_time'] * 1e3:.0f} ms | {r['budget'] / MiB:.2f} MiB | {r['predicted'] / MiB:.2f} MiB | "
            f"**{r['stagetorch_peak'] / MiB:.2f} MiB** ({r['stagetorch_peak'] / r['ckpt_peak']:.2f}x) | "
            f"{r['stagetorch_time'] * 1e3:.0f} ms ({r['stagetorch_time'] / r['ckpt_time']:.2f}x) |  |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mask", action="store_true", help="pass an all-ones attention_mask too")
    args = parser.parse_args(argv)
    rows = []
    for name in args.models.split(","):
        try:
            rows.append(measure(name, args.repeats, args.mask))
        except Exception as e:  # a model that fails is a row saying how, not the end of the table
            rows.append({"model": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"})
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()

"""Tiny configs of `transformers` models for the recomputation tests and bench: 8 layers (4 + 4 for
encoder-decoders), hidden 64, 4 heads, vocab 97, their configs' own dropout, one example of 512 tokens,
float32; the training step, transformers' own per-layer checkpointing around it, and the smallest budget
stagetorch accepts."""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Callable

import torch
from memtrack import AllocatorPeak

import stagetorch
from stagetorch.errors import OutOfMemoryError

MiB = 2**20
VOCAB, HIDDEN, HEADS, LAYERS, TOKENS = 97, 64, 4, 8, 512


def _configs(LAYERS: int = LAYERS, TOKENS: int = TOKENS) -> dict[str, Callable[[], torch.nn.Module]]:  # noqa: N803
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


def model_and_batch(name: str, mask: bool = False, seed: int = 0, layers: int = LAYERS,
                    tokens: int = TOKENS) -> tuple[torch.nn.Module, dict]:
    """The model (in training mode, its configured dropout on) and one example of ``tokens`` tokens."""
    torch.manual_seed(seed)
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        model = _configs(layers, tokens)[name]()
    model.train()
    ids = torch.randint(3, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(seed))
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


def allocator_peak(step: Callable, model: torch.nn.Module, batch: dict) -> int:
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

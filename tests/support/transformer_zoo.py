"""The `transformers` models of the zoo from tiny configs, their batches (padded: attention masks, labels -100 on
the padding), the step, and the comparison with eager: shared by the zoo tests, the lazy-mode tests and bench."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
T = transformers

B, S, V = 7, 16, 97
_TEXT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=V)
_NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)

# name -> (config factory, model class, batch kind)
ZOO = {
    "bert": (lambda: T.BertConfig(**_TEXT, **_NO_DROPOUT, max_position_embeddings=128), "BertForSequenceClassification", "cls"),
    "roberta": (lambda: T.RobertaConfig(**_TEXT, **_NO_DROPOUT, max_position_embeddings=128, pad_token_id=1),
                "RobertaForSequenceClassification", "cls"),
    "distilbert": (lambda: T.DistilBertConfig(dim=32, n_layers=2, n_heads=4, hidden_dim=64, vocab_size=V,
                                              max_position_embeddings=128, dropout=0.0, attention_dropout=0.0,
                                              seq_classif_dropout=0.0), "DistilBertForSequenceClassification", "cls"),
    "gpt2": (lambda: T.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=V, n_positions=128, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2), "GPT2LMHeadModel", "lm"),
    "llama": (lambda: T.LlamaConfig(**_TEXT, num_key_value_heads=2, max_position_embeddings=128), "LlamaForCausalLM", "lm"),
    "mistral": (lambda: T.MistralConfig(**_TEXT, num_key_value_heads=2, max_position_embeddings=128),
                "MistralForCausalLM", "lm"),
    "qwen2": (lambda: T.Qwen2Config(**_TEXT, num_key_value_heads=2, max_position_embeddings=128), "Qwen2ForCausalLM", "lm"),
    "gpt_neox": (lambda: T.GPTNeoXConfig(**_TEXT, max_position_embeddings=128, hidden_dropout=0.0, attention_dropout=0.0),
                 "GPTNeoXForCausalLM", "lm"),
    "opt": (lambda: T.OPTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64, vocab_size=V,
                                max_position_embeddings=128, word_embed_proj_dim=32, dropout=0.0), "OPTForCausalLM", "lm"),
    "t5": (lambda: T.T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8, vocab_size=V, dropout_rate=0.0,
                              decoder_start_token_id=0), "T5ForConditionalGeneration", "lm"),
    "bart": (lambda: T.BartConfig(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=V,
                                  max_position_embeddings=128, dropout=0.0), "BartForConditionalGeneration", "lm"),
    "whisper": (lambda: T.WhisperConfig(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=V,
                                        num_mel_bins=8, max_source_positions=8, max_target_positions=128, dropout=0.0,
                                        decoder_start_token_id=1, pad_token_id=0), "WhisperForConditionalGeneration",
                "speech"),
    "vit": (lambda: T.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                image_size=16, patch_size=4, num_labels=3, **_NO_DROPOUT), "ViTForImageClassification",
            "image"),
    "convnext": (lambda: T.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=3, image_size=16),
                 "ConvNextForImageClassification", "image"),
}
TEXT = [name for name, (_, _, kind) in ZOO.items() if kind in ("cls", "lm")]


def make_model(name: str) -> torch.nn.Module:
    config, cls, _ = ZOO[name]
    torch.manual_seed(0)
    return getattr(T, cls)(config()).double().train()


def make_batch(name: str, b: int = B, s: int = S, padded: bool = True) -> dict[str, torch.Tensor]:
    """Padded rows end in zeros of the attention mask, and their labels there are -100 (ignored)."""
    kind = ZOO[name][2]
    g = torch.Generator().manual_seed(1)
    if kind == "image":
        return dict(pixel_values=torch.randn(b, 3, 16, 16, generator=g, dtype=torch.float64),
                    labels=torch.randint(0, 3, (b,), generator=g))
    ids = torch.randint(3, V, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    if padded:
        for i in range(b):
            mask[i, s - (0, 4, 7, 0, 11, 2)[i % 6] * s // 16 :] = 0
    labels = ids.masked_fill(mask == 0, -100)
    if kind == "speech":
        return dict(input_features=torch.randn(b, 8, 16, generator=g, dtype=torch.float64), labels=labels)
    if kind == "cls":
        labels = torch.randint(0, 2, (b,), generator=g)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def step_of(model: torch.nn.Module):
    def step(**batch):
        loss = model(**batch).loss
        loss.backward()
        return loss

    return step


def assert_same(model: torch.nn.Module, reference: torch.nn.Module, loss: torch.Tensor, expected: torch.Tensor):
    tol = 1e-6 if expected.dtype == torch.float32 else 1e-12
    assert abs(loss.item() - expected.item()) <= tol * abs(expected.item()), (loss.item(), expected.item())
    grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    whole = torch.cat([g.flatten() for g in grads.values()]).norm()
    for name, p in model.named_parameters():
        if name not in grads:
            assert p.grad is None, name
            continue
        scale = max(grads[name].norm(), 1e-6 * whole)
        assert ((p.grad - grads[name]).norm() / scale).item() < 1e-9, name


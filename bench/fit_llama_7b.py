"""A 7B-parameter Llama-style model's training step, for ``python -m stagetorch fit bench/fit_llama_7b.py
--device H100-80GB``: built on the meta device from a transformers LlamaConfig (Llama-2-7B's shapes), so no
weights are read or allocated; bf16 parameters, sequences of 1024 tokens."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

config = LlamaConfig(
    hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
)
config._attn_implementation = "sdpa"
with torch.device("meta"):
    model = LlamaForCausalLM(config).to(torch.bfloat16)
SEQ = 1024


def step(input_ids):
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    return loss


def example_args(batch=None):
    return (torch.randint(0, config.vocab_size, (batch or 8, SEQ)),)

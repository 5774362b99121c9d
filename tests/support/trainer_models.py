"""Small models for the Trainer and Lightning tests (a per-token causal LM, a pooled classifier, tiny Llama and
BERT), their padded rows, and a budget bisected to a number of chunks: shared by tests/integrations' modules."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from transformers.modeling_outputs import CausalLMOutput, SequenceClassifierOutput  # noqa: E402

VOCAB, LENGTH, EXAMPLES, BATCH = 97, 12, 20, 4


class TokenLM(torch.nn.Module):
    """A causal LM of per-token ops only (no transformers masking code), which stagetorch chunks today: each
    position sees the running mean of the unmasked embeddings before it. Its loss is the summed token loss
    over ``num_items_in_batch`` when the Trainer passes it, as transformers' causal LMs do."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.mix = torch.nn.Linear(64, 32)
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, input_ids, attention_mask, labels, num_items_in_batch=None, **kwargs):
        h = self.embed(input_ids) * attention_mask.unsqueeze(-1)
        seen = h.cumsum(1) / attention_mask.cumsum(1).clamp(min=1).unsqueeze(-1)
        logits = self.head(torch.tanh(self.mix(torch.cat([h, seen], -1))))
        flat, target = logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1)
        if num_items_in_batch is None:
            loss = F.cross_entropy(flat, target, ignore_index=-100)
        else:
            loss = F.cross_entropy(flat, target, ignore_index=-100, reduction="sum") / num_items_in_batch
        return CausalLMOutput(loss=loss, logits=logits)


class PooledClassifier(torch.nn.Module):
    """A sequence classifier over the masked mean of residual per-token MLP features; a per-batch mean loss
    (its forward takes no loss kwargs, so the Trainer divides by the accumulation steps). Wide per token, so
    that activations, not weights, decide whether a batch fits, and deep enough that recomputing one layer's
    activations in the backward can be what makes a step fit."""

    def __init__(self, depth: int = 3, width: int = 512) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.up = torch.nn.ModuleList(torch.nn.Linear(16, width) for _ in range(depth))
        self.down = torch.nn.ModuleList(torch.nn.Linear(width, 16) for _ in range(depth))
        self.head = torch.nn.Linear(16, 3)

    def forward(self, input_ids, attention_mask, labels):
        h = self.embed(input_ids)
        for up, down in zip(self.up, self.down):
            h = h + down(torch.tanh(up(h)))
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        logits = self.head((h * m).sum(1) / m.sum(1))
        return SequenceClassifierOutput(loss=F.cross_entropy(logits, labels), logits=logits)


def llama_lm() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def bert_classifier() -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(config)


def padded_dataset(kind: str) -> list[dict[str, torch.Tensor]]:
    """Rows padded at the end to one length (some not at all), with -100 labels there for a language model
    and one class per row for a classifier."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(EXAMPLES):
        ids = torch.randint(0, VOCAB, (LENGTH,), generator=g)
        length = LENGTH if i % 3 == 0 else int(torch.randint(3, LENGTH, (), generator=g))
        mask = (torch.arange(LENGTH) < length).long()
        labels = ids.masked_fill(mask == 0, -100) if kind == "lm" else torch.randint(0, 3, (), generator=g)
        rows.append(dict(input_ids=ids, attention_mask=mask, labels=labels))
    return rows


MODELS = {"llama": (llama_lm, "lm"), "bert": (bert_classifier, "cls"), "token-lm": (TokenLM, "lm"),
          "pooled": (PooledClassifier, "cls")}


def budget_for_chunks(owner, plan, chunks: int) -> int:
    """A budget under which ``plan()`` (a step's plan, read with ``owner.memory_budget`` set) has at least
    ``chunks`` chunks, bisected between the whole batch's peak, too much, and budgets no plan fits in, too
    little. ``owner``: a StagedTrainer or a Lightning StagedStrategy."""
    owner.memory_budget = None
    low, high = 0, plan().peak
    while high - low > 1024:
        owner.memory_budget = mid = (low + high) // 2
        try:
            if len(plan().chunk_sizes) >= chunks:
                return mid
            high = mid
        except MemoryError:
            low = mid
    raise AssertionError(f"no budget runs this step in {chunks} chunks")

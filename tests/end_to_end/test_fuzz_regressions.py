"""What the step fuzzer's op families (tests/support/step_fuzz_families.py) found, each trained 3 optimizer steps
under ``jit`` in >= 2 chunks and under ``lazy`` with a budget against eager at float64 (loss, outputs, every
``.grad``, every parameter after each step), or refused by a named error that says what to do.

Before the fixes: ``x.new_ones(B, C) * 2`` read as rows of the examples, a slice assignment into a clone of an
activation (whose backward copies into ``new_empty_strided``) and ``h[arange(B), y] = v`` were refused where
eager is per-example; CTC with length tensors raised ``KeyError`` from lazy's replay after an out-of-memory
error, then was refused by name (it now runs in chunks); ``nn.Embedding(max_norm)`` was refused with advice (register it per-example) that is not the fix, then refused by
name though chunking it is exact (each chunk renormalises its own rows; it now runs in chunks);
``F.instance_norm`` (batch norm over the batch merged into the channels) was refused as batch statistics.
"""

from __future__ import annotations

import pytest
import step_fuzz_families as fuzz
import torch

# name -> (the model's kind, the step's lines before backward, extra Case fields)
EXACT = {
    "new_ones_rows": ("mlp", ["out = model(x)", "t = x.new_ones(x.shape[0], C) * 2",
                              "loss = -(F.log_softmax(out, 1) * t).sum(1).mean()"], {}),
    "ones_cumsum_rows": ("mlp", ["out = model(x)", "t = torch.ones(len(x), C, dtype=out.dtype).cumsum(1)",
                                 "loss = (out * t).mean()"], {}),
    "slice_assign_clone": ("mlp", ["h = model.f(x)", "o = h.clone()", "o[:, :2] = 0", "out = model.head(o)",
                                   "loss = F.cross_entropy(out, y)"], {}),
    "mul_then_slice_add": ("mlp", ["h = model.f(x)", "o = h * 1.0", "o.mul_(2.0)", "o[:, 0] += 1.0",
                                   "out = model.head(o)", "loss = -(F.log_softmax(out, 1).gather(1, y[:, None])).mean()"], {}),
    "pick_written_in_place": ("mlp", ["h = model.f(x)", "o = h.clone()", "o[torch.arange(x.shape[0]), y] = 0.0",
                                      "out = model.head(o)", "loss = F.cross_entropy(out, y)"], {"optimizer": "adamw"}),
    "zeros_written_then_gathered": ("mlp", ["h = model.f(x)", "o = torch.zeros(x.shape[0], H, dtype=h.dtype)",
                                            "o[:, PERM] = h", "out = model.head(o)",
                                            "loss = -(W * F.log_softmax(out, 1).gather(1, y[:, None])[:, 0]).mean()"],
                                    {"captured": "perm_w"}),
    "index_copy_then_gathered": ("mlp", ["h = model.f(x)", "o = torch.zeros_like(h).index_copy_(1, PERM, h)",
                                         "out = model.head(o)", "loss = -(W * F.log_softmax(out, 1)[torch.arange(len(x)), y]).mean()"],
                                 {"captured": "perm_w"}),
    "instance_norm": ("mlp", ["h = model.f(x)", "h = F.instance_norm(h[:, None, :])[:, 0]", "out = model.head(h)",
                              "loss = F.cross_entropy(out, y)"], {}),
    "instance_norm_channels": ("mlp", ["h = model.f(x)", "h = F.instance_norm(h.view(len(x), 4, -1)).flatten(1)",
                                       "out = model.head(h)", "loss = F.cross_entropy(out, y)"], {"optimizer": "adamw"}),
    "deberta_relative_gather": ("seq", ["h = model.f(x)",
                                        "r = model.rel.gather(0, POS.reshape(-1, 1).expand(-1, H)).view(T, T, H)",
                                        "s = torch.einsum('bth,tsh->bts', h, r).softmax(-1)",
                                        "z = torch.einsum('bts,bsh->bth', s, h).mean(1)", "out = model.head(z)",
                                        "loss = F.cross_entropy(out, y)"], {"captured": "pos"}),
}


def _case(name: str, kind: str, lines: list, extra: dict) -> fuzz.Case:
    case = fuzz.Case("regression", 7, 23, kind, list(lines), optimizer=extra.get("optimizer", "sgd"), note=name)
    g = torch.Generator().manual_seed(3)
    if extra.get("captured") == "perm_w":
        case.captured["PERM"] = ("global", torch.randperm(fuzz.H, generator=g))
        case.captured["W"] = ("buffer", 0.5 + torch.rand(23, generator=g, dtype=torch.float64))
        case.lines = [line.replace("W *", "model.w_b *") for line in case.lines]
    if extra.get("captured") == "pos":
        T = fuzz.T
        case.captured["POS"] = ("global", torch.arange(T)[:, None] - torch.arange(T)[None, :] + T - 1)
    return case


@pytest.mark.parametrize("name", list(EXACT))
def test_found_by_the_fuzzer_runs_in_chunks_as_eager(name):
    kind, lines, extra = EXACT[name]
    outcome = fuzz.check(_case(name, kind, lines, extra))
    assert {v: r.status for v, r in outcome.results.items()} == {"jit": "exact", "lazy": "exact"}, outcome.report()
    assert outcome.results["jit"].chunks >= 2


@pytest.mark.parametrize("lines", [
    ["out = model(x)", "loss = F.cross_entropy(out, y)"],
    # two lookups, each renormalising its own indices' rows (the second a subset of the first's)
    ["h = model.f(model.emb(x)[:, 0] + model.emb(x[:, -1]))", "out = model.head(h)", "loss = F.cross_entropy(out, y)"],
], ids=["one_lookup", "two_lookups"])
def test_embedding_max_norm_runs_in_jit_chunks_as_eager(lines):
    """``nn.Embedding(max_norm)`` renormalises, in place in the weight, the rows the batch reads. Each chunk
    renormalises its own rows; a row once renormalised is not over the norm, so a later chunk leaves it be: the
    chunks' lookups, the gradients and the weight after the step are eager's (issue 43; it was refused by name)."""
    case = fuzz.Case("regression", 5, 19, "tokens", list(lines), emb_kwargs={"max_norm": 0.5}, optimizer="adamw")
    outcome = fuzz.check(case)
    jit = outcome.results["jit"]
    assert jit.status == "exact" and jit.chunks >= 2, outcome.report()
    if not any("[:, -1]" in line for line in lines):  # (lazy refuses two lookups: ModifiedInputError, issue 43)
        assert outcome.results["lazy"].status == "exact", outcome.report()


@pytest.mark.parametrize("line", [
    # a tied output layer: reads every row of the weight, some not yet renormalised in an early chunk
    "e = model.emb(x).mean(1)\nout = model.head(model.f(e)) + (e @ model.emb.weight.t())[:, :C]",
    # a penalty on the whole weight after the lookup: it would run before the chunks, on the rows unrenormalised
    "out = model(x) + 1e-2 * model.emb.weight.pow(2).sum()",
], ids=["tied_weight", "weight_penalty"])
def test_embedding_max_norm_read_whole_after_the_lookup_is_refused_in_jit_chunks_by_name(line):
    case = fuzz.Case("regression", 5, 19, "tokens", [*line.split("\n"), "loss = F.cross_entropy(out, y)"],
                     emb_kwargs={"max_norm": 0.5}, optimizer="sgd")
    outcome = fuzz.check(case)
    jit = outcome.results["jit"]
    assert jit.status.startswith("refused") and jit.error == "BatchCouplingError", outcome.report()
    assert "embedding_renorm_" in jit.detail and "What to do: renormalise before the call" in jit.detail
    assert outcome.results["lazy"].status == "exact", outcome.report()


@pytest.mark.parametrize("reduction, lengths", [
    ("mean", "tensor"), ("sum", "tensor"), ("none", "tensor"), ("mean", "zero_infinity"), ("mean", "list"),
])
def test_ctc_with_length_tensors_runs_in_chunks_as_eager(reduction, lengths):
    """The leftovers family's CTC step (issue 43). It was refused by name by both (jit: its alignment table's
    data-dependent shape; chunks: the table as long as the batch's longest target); lazy at a budget too small
    for it, then again at the one its error names, raised KeyError from the replay of the first session's
    constants. Each chunk now runs CTC on its own examples, its table never leaving the chunk."""
    il = {"list": "il = [T] * x.shape[0]", "zero_infinity": "il = torch.full((x.shape[0],), T, dtype=torch.long) - 3 * (y == 0)"}
    tl = {"list": "tl = [1 + i % 2 for i in range(x.shape[0])]"}
    loss = f"l = F.ctc_loss(lp, tgt, il, tl, reduction={reduction!r}, zero_infinity={lengths == 'zero_infinity'})"
    case = fuzz.Case("regression", 150, 23, "seq", [
        "out = model(x)", "lp = F.log_softmax(model.head(model.f(x)), -1).transpose(0, 1)",
        "tgt = (y[:, None] + torch.arange(2)) % (C - 1) + 1",
        il.get(lengths, "il = torch.full((x.shape[0],), T, dtype=torch.long)"),
        tl.get(lengths, "tl = torch.full((x.shape[0],), 2, dtype=torch.long) - (y % 2)"), loss,
        "loss = (l.mean() if l.ndim else l) + F.cross_entropy(out, y)"], optimizer="adamw")
    outcome = fuzz.check(case)
    jit, lazy = outcome.results["jit"], outcome.results["lazy"]
    assert jit.status == "exact" and jit.chunks >= 2, outcome.report()
    if lengths != "list":
        assert lazy.status == "exact", outcome.report()
    else:  # lazy records the kernel's Python lists, which no chunk can be given its share of: named
        assert lazy.status.startswith("refused") and "pass the lengths as tensors" in lazy.detail, outcome.report()


@pytest.mark.parametrize("lines, named", [
    (["out = model(x)", "l = F.cross_entropy(out, y, reduction='none')", "loss = l[MK].mean()"], "tensor captured by the step MK"),
    (["out = model(x)", "l = F.cross_entropy(out, y, reduction='none')", "n = int(model.mk_b.sum().item())",
      "loss = (l * model.mk_b).sum() / max(n, 1)"], "buffer model.mk_b"),
], ids=["bool_index", "host_count"])
def test_a_captured_mask_read_on_the_host_is_refused_naming_the_mask_and_the_fix(lines, named):
    """jit reads on the host only what the call's arguments fix; a mask it closed over (a global, a buffer) may
    change between calls. ``l[MK]`` was said to depend on the parameters (``l``'s origin, which does not size
    the result) and a buffer's read had no advice of its own (issue 43)."""
    case = fuzz.draw(34 if "MK" in named else 8, "mask")
    assert case.lines[:len(lines)] == lines, case.lines
    outcome = fuzz.check(case)
    jit = outcome.results["jit"]
    # needed though the examples do not meet: the staged program would bake in the captured tensor's value
    assert jit.status == "refused-needed" and jit.error == "ConcretizationError", jit.detail
    assert "go stale when the tensor changes between calls" in jit.why, jit.why
    assert outcome.results["lazy"].status == "exact", outcome.report()  # lazy reads it at each call
    assert f"depends on the {named} (read from outside the step, not passed in" in jit.detail, jit.detail
    assert "parameter" not in jit.detail.split(":")[0] and "pass it as an argument" in jit.detail


@pytest.mark.parametrize("seed, line", [
    (1, "loss = l[(m > 0.5)].mean()"), (4, "loss = l[(x[:, 0] > -0.5)].mean()"), (23, "loss = l[(y != 1)].mean()"),
], ids=["argument", "input", "labels"])
def test_a_mask_selecting_per_example_losses_runs_in_lazy_chunks_as_eager(seed, line):
    """The mask family's ``l[mask].mean()``: lazy ran ``l[mask]`` for real, flushing the whole forward mid-step,
    and refused the backward's program at jit's budget ("Examples meet at aten.index_put ... backward of
    IndexBackward0", issue 43). It now computes only the mask and records the selection (see
    tests/lazymode/test_lazy_mask_select.py, which checks the chunks)."""
    case = fuzz.draw(seed, "mask")
    assert line in case.lines, case.lines
    outcome = fuzz.check(case)
    assert {v: r.status for v, r in outcome.results.items()} == {"jit": "exact", "lazy": "exact"}, outcome.report()
    assert outcome.results["jit"].chunks >= 2

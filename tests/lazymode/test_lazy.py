"""One-line mode against eager PyTorch, including every failure measured on koila 0.1.1."""

from __future__ import annotations

import copy

import models
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from budgets import budget_for
from lazy_loops import RealKernelBatchSizes, rel, seed_program

import stagetorch

pytestmark = pytest.mark.usefixtures("lazy_mode")


@pytest.mark.parametrize("chunked", [False, True])
def test_seed_readme_program_equals_eager(chunked):
    model, make = models.seed_mlp()
    x, y = make(1000)
    reference = copy.deepcopy(model)
    expected_loss, expected_grads = _eager(reference, x, y)
    options = {}
    if chunked:
        staged = stagetorch.jit(models.train_step(copy.deepcopy(model)))
        options["memory_budget"] = budget_for(staged, x, y)
    with RealKernelBatchSizes((torch.ops.aten.addmm,)) as seen:
        loss, grads = seed_program(model, x, y, **options)
    assert abs(loss - expected_loss) / expected_loss < 1e-5
    for g, e in zip(grads, expected_grads):
        assert rel(g, e) < 1e-5
    assert all(type(p.grad) is torch.Tensor for p in model.parameters())
    assert (max(seen.sizes) < 1000) == chunked, seen.sizes


def _eager(model, x, y):
    loss = nn.CrossEntropyLoss()(model(x), y)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def test_lazy_tensors_are_tensors_with_attributes_not_methods():
    x, y = stagetorch.lazy(torch.randn(4, 3), torch.arange(4), batch=0)
    assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
    assert x.dtype == torch.float32 and y.dtype == torch.int64 and x.shape == (4, 3) and len(x) == 4
    assert x.device == torch.device("cpu") and not x.requires_grad and x.ndim == 2


def test_python_scalars_broadcasting_indexing_views_and_in_place():
    base = torch.randn(6, 4)
    x = stagetorch.lazy(base)
    z = (x + 1) * 2 - x / 3
    z = z.transpose(0, 1).reshape(-1).view(4, 6)[1:, ::2]
    z += 1
    expected = ((base + 1) * 2 - base / 3).transpose(0, 1).reshape(-1).view(4, 6)[1:, ::2] + 1
    assert torch.allclose(z.value(), expected)
    assert torch.allclose(torch.tensor(z.tolist()), expected)


@pytest.mark.parametrize(
    "layer, shape",
    [
        (nn.Conv2d(3, 6, 3, padding="same"), (5, 3, 8, 8)),
        (nn.Conv2d(4, 8, 3, groups=2), (5, 4, 8, 8)),
        (nn.Linear(8, 3), (5, 8)),
    ],
    ids=["conv-padding-same", "grouped-conv", "linear"],
)
def test_layers_forward_and_backward(layer, shape):
    layer = copy.deepcopy(layer)  # the parametrized layer is shared by the runs in each mode
    x = torch.randn(*shape)
    reference = copy.deepcopy(layer)
    lx = stagetorch.lazy(x)
    layer(lx).square().mean().backward()
    reference(x).square().mean().backward()
    for p, q in zip(layer.parameters(), reference.parameters()):
        assert rel(p.grad, q.grad) < 1e-5


def test_multihead_attention_and_sdpa():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    reference = copy.deepcopy(mha)
    x = torch.randn(5, 7, 16)

    def loss_of(m, x):
        a, _ = m(x, x, x, need_weights=False)
        q = a.view(5, 7, 4, 4).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).pow(2).mean()

    loss = loss_of(mha, stagetorch.lazy(x))
    loss.backward()
    expected = loss_of(reference, x)
    expected.backward()
    assert abs(loss.item() - expected.item()) < 1e-6
    for p, q in zip(mha.parameters(), reference.parameters()):
        assert rel(p.grad, q.grad) < 1e-5


def test_reads_evaluate_once_batchnorm_and_dropout_not_redrawn():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    x = torch.randn(16, 8)
    out = model(stagetorch.lazy(x))
    loss = out.square().mean()
    first = loss.item()
    print(loss)  # a second read
    assert float(loss) == first and bool(loss > -1) and f"{loss:.3f}" == f"{first:.3f}"
    assert model[1].num_batches_tracked.item() == 1
    masked_before = out.value().clone()
    loss.backward()  # after reads: reuses the values, does not redraw dropout or update statistics again
    assert model[1].num_batches_tracked.item() == 1
    assert torch.equal(out.value(), masked_before)
    assert all(type(p.grad) is torch.Tensor for p in model.parameters())


def test_reinforcement_learning_loop_runs_unchanged():
    rng = np.random.default_rng(0)

    def env_step(actions):
        return rng.normal(size=(8, 4)).astype(np.float32), (actions == 1).astype(np.float32)

    def run(one_line: bool):
        torch.manual_seed(0)
        policy = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))
        optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
        obs = np.zeros((8, 4), dtype=np.float32)
        rng.bit_generator.state = np.random.default_rng(0).bit_generator.state
        for _ in range(3):
            states = torch.from_numpy(obs)
            if one_line:
                (states,) = (stagetorch.lazy(states, batch=0),)
            logits = policy(states)
            actions = logits.argmax(-1).numpy()
            obs, rewards = env_step(actions)
            logp = torch.log_softmax(logits, -1)[torch.arange(8), torch.from_numpy(actions)]
            loss = -(logp * torch.from_numpy(rewards)).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return [p.detach().clone() for p in policy.parameters()]

    for a, b in zip(run(True), run(False)):
        assert torch.allclose(a, b, atol=1e-6)


def test_inference_under_no_grad_still_chunks():
    model, make = models.cnn()
    model.eval()
    x, _ = make(100)
    with torch.no_grad():
        expected = model(x)
    staged = stagetorch.jit(lambda x: model(x))
    budget = budget_for(staged, x)
    with torch.no_grad(), RealKernelBatchSizes((torch.ops.aten.convolution,)) as seen:
        got = model(stagetorch.lazy(x, memory_budget=budget)).value()
    assert rel(got, expected) < 1e-5 and max(seen.sizes) < 100


def test_bad_input_and_shape_errors_name_the_line():
    with pytest.raises(ValueError, match="disagree on the batch size"):
        stagetorch.lazy(torch.randn(4, 2), torch.randn(5))
    with pytest.raises(TypeError, match="not a tensor"):
        stagetorch.lazy(torch.randn(4), [1, 2])
    with pytest.raises(ValueError, match="out of range"):
        stagetorch.lazy(torch.randn(4), batch=1)
    with pytest.raises(ValueError, match="empty"):
        stagetorch.lazy(torch.randn(0, 3))
    x = stagetorch.lazy(torch.randn(4, 3))
    with pytest.raises(stagetorch.ShapeError, match=r"test_lazy.py:\d+"):
        x @ torch.randn(4, 3)  # the bad line


def test_values_nobody_can_read_are_released():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    x = stagetorch.lazy(torch.randn(16, 8))
    loss = model(x).square().mean()
    loss.backward()
    session = x._session
    kept = set(session.values)
    assert kept <= set(session.batched) | {loss._var}, len(kept)
    assert loss.item() > 0 and all(type(p.grad) is torch.Tensor for p in model.parameters())


class MaskCheckedEncoderDecoder(nn.Module):
    """An encoder, then a read on the host of a value that depends only on an input (T5's decoder asks
    whether the encoder's attention mask is all ones after the encoder ran), then a decoder and a head."""

    def __init__(self):
        super().__init__()
        self.reads = True  # False: the same step without the read (jit stages that one)
        self.encoder = nn.Sequential(nn.Linear(16, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh())
        self.decoder = nn.Sequential(nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 24))

    def forward(self, x, mask):
        h = self.encoder(x)
        if not self.reads or not mask.all():  # the host read, mid-step
            h = h * mask[:, None, None]
        return self.decoder(h).mean(1)


@pytest.mark.parametrize("held", [False, True], ids=["logits-dropped", "logits-held"])
def test_a_read_mid_step_leaves_the_step_as_hungry_as_jit(held, monkeypatch):
    """At the budget ``jit`` runs the same step at in 5 chunks, one-line mode runs it too: the
    read of the mask's ``all()`` computes only that, and the encoder's activations stay inside the program
    the backward runs (a flush there would hold them whole). A dropped output (the logits) is not an output
    of any flush; one the script holds is, and equals eager's. Three SGD steps against eager."""
    torch.manual_seed(0)
    n = 10  # no dimension of the model's: a value of n rows is per-example
    model = MaskCheckedEncoderDecoder().double()
    reference = copy.deepcopy(model)
    x, y = torch.randn(n, 64, 16, dtype=torch.float64), torch.randint(0, 24, (n,))
    mask = torch.ones(n, dtype=torch.float64)
    mask[::3] = 0

    unread = copy.deepcopy(model)
    unread.reads = False

    def step(x, mask, y):
        out = unread(x, mask)
        loss = F.cross_entropy(out, y)
        loss.backward()
        return (loss, out) if held else loss

    staged = stagetorch.jit(step, remat=False)
    budget = budget_for(staged, x, mask, y, chunks=5)
    outputs, chunks = [], []
    run = stagetorch.runtime.executable.Executable.run

    def recorded(self, inputs, plan, **kwargs):
        outputs.extend(v.aval.shape for v in self.graph.outvars)
        chunks.append(len(plan.chunk_sizes))
        return run(self, inputs, plan, **kwargs)

    monkeypatch.setattr(stagetorch.runtime.executable.Executable, "run", recorded)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    for _ in range(3):
        outputs.clear(), chunks.clear()
        lx, lmask, ly = stagetorch.lazy(x, mask, y, batch=0, memory_budget=budget, remat=False)
        if held:
            out = model(lx, lmask)
            loss = F.cross_entropy(out, ly)
        else:
            loss = F.cross_entropy(model(lx, lmask), ly)
        loss.backward()
        expected_out = reference(x, mask)
        expected = F.cross_entropy(expected_out, y)
        expected.backward()
        assert max(chunks) >= 5, chunks  # the backward's flush chunks as jit's step does
        assert ((n, 24) in outputs) == held, outputs
        if held:
            assert rel(out.detach().value(), expected_out.detach()) < 1e-12
        assert abs(loss.item() - expected.item()) <= 1e-12 * abs(expected.item())
        for p, q in zip(model.parameters(), reference.parameters()):
            assert rel(p.grad, q.grad) < 1e-12
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()

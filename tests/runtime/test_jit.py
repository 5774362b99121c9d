"""stagetorch.jit against eager PyTorch: loss, every .grad, buffers, outputs, and the staged program itself."""

from __future__ import annotations

import collections
import copy
import dataclasses
import random

import models
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

import stagetorch

MODELS = {**models.CLASSIFIERS, "gpt2": models.gpt2}


def _step(name):
    return models.gpt2_step if name == "gpt2" else models.train_step


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("name", list(MODELS))
def test_staged_train_step_equals_eager(name):
    model, make = MODELS[name]()
    x, y = make(8)
    reference = copy.deepcopy(model)
    expected = _step(name)(reference)(x, y)
    loss = stagetorch.jit(_step(name)(model))(x, y)
    assert rel(loss, expected.detach()) < 1e-5
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if q.grad is not None:
            assert rel(p.grad, q.grad) < 1e-5, n
            assert not isinstance(p.grad, FakeTensor)


@pytest.mark.parametrize("name", list(MODELS))
def test_ir_prints_and_eval_shape_matches_real_outputs(name):
    model, make = MODELS[name]()
    x, y = make(8)
    graph = stagetorch.make_ir(_step(name)(model))(x, y)
    text = str(graph)
    lines = text.splitlines()
    assert len(lines) == len(graph.eqns) + 2 + len(graph.grads)
    assert "models.py:" in text and "backward of" in text and ".grad += " in text

    def forward(x):
        return model(x) if name != "gpt2" else model(input_ids=x).logits

    with torch.no_grad():
        real = forward(x)
    abstract = stagetorch.eval_shape(forward)(x)
    assert abstract == stagetorch.Aval(real.shape, real.dtype)


def test_tracing_leaves_real_state_untouched():
    model, make = models.cnn(norm="batch")
    x, y = make(8)
    models.train_step(model)(x, y)  # real .grad and running stats exist
    state = copy.deepcopy(model.state_dict())
    grads = [p.grad.clone() for p in model.parameters()]
    stagetorch.make_ir(models.train_step(model))(x, y)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g) and not isinstance(p.grad, FakeTensor)
    assert all(not isinstance(p, FakeTensor) for p in model.parameters())


def test_batchnorm_buffers_update_once_per_call_like_eager():
    model, make = models.cnn(norm="batch")
    reference = copy.deepcopy(model)
    staged = stagetorch.jit(models.train_step(model))
    for _ in range(2):
        x, y = make(8)
        staged(x, y)
        models.train_step(reference)(x, y)
    assert model.norm.num_batches_tracked.item() == 2
    for k, v in model.state_dict().items():
        assert torch.allclose(v.float(), reference.state_dict()[k].float(), rtol=1e-5, atol=1e-6), k
    for p, q in zip(model.parameters(), reference.parameters()):
        assert rel(p.grad, q.grad) < 1e-5  # accumulated over two calls, as eager does


def test_staging_is_cached_by_signature(monkeypatch):
    import stagetorch.runtime.staged as staged_module

    traces = []
    real_trace = staged_module.trace
    monkeypatch.setattr(staged_module, "trace", lambda *a, **k: traces.append(1) or real_trace(*a, **k))
    model, make = models.seed_mlp()
    staged = stagetorch.jit(models.train_step(model))
    staged(*make(8))
    staged(*make(8))
    assert len(traces) == 1
    staged(*make(16))  # a new batch size
    model.eval()  # train/eval changes the program
    staged(*make(16))
    assert len(traces) == 3


def test_pytree_inputs_and_outputs():
    model, make = models.seed_mlp()
    x, y = make(8)

    @dataclasses.dataclass
    class Out:
        loss: torch.Tensor
        logits: torch.Tensor

    def step(batch):
        logits = model(batch["x"])
        loss = F.cross_entropy(logits, batch["y"])
        loss.backward()
        return {"loss": loss, "stats": (logits.mean(), 3)}

    out = stagetorch.jit(step)({"x": x, "y": y})
    assert set(out) == {"loss", "stats"} and out["stats"][1] == 3
    assert rel(out["stats"][0], model(x).mean().detach()) < 1e-5


def test_transformers_model_output_is_returned():
    model, make = models.gpt2()
    ids, labels = make(4)
    out = stagetorch.jit(lambda ids, labels: model(input_ids=ids, labels=labels))(ids, labels)
    assert type(out).__name__ == "CausalLMOutputWithCrossAttentions"
    assert out.logits.shape == (4, 16, 64) and out.loss.ndim == 0


W = torch.randn(5, 3, requires_grad=True)


def test_closed_over_tensors_globals_closures_and_self():
    bias = torch.randn(3, requires_grad=True)

    def step(x):
        loss = (x @ W + bias).square().mean()
        loss.backward()
        return loss

    x = torch.randn(4, 5)
    stagetorch.jit(step)(x)
    gw, gb = W.grad.clone(), bias.grad.clone()
    W.grad, bias.grad = None, None
    step(x)
    assert rel(gw, W.grad) < 1e-6 and rel(gb, bias.grad) < 1e-6
    W.grad = None

    class Trainer:
        def __init__(self):
            self.model = nn.Linear(5, 2)

        def step(self, x):
            loss = self.model(x).sum()
            loss.backward()
            return loss

    t = Trainer()
    stagetorch.jit(t.step)(x)
    assert t.model.weight.grad is not None and not isinstance(t.model.weight.grad, FakeTensor)


def test_custom_op_with_a_fake_impl_needs_no_rule():
    @torch.library.custom_op("stagetorch_test::scaled", mutates_args=())
    def scaled(x: torch.Tensor, k: float) -> torch.Tensor:
        return x * k

    @scaled.register_fake
    def _(x, k):
        return torch.empty_like(x)

    x = torch.randn(4, 3)
    out = stagetorch.jit(lambda x: torch.ops.stagetorch_test.scaled(x, 2.5) + 1)(x)
    assert torch.allclose(out, x * 2.5 + 1)
    assert "stagetorch_test.scaled" in str(stagetorch.make_ir(lambda x: torch.ops.stagetorch_test.scaled(x, 2.5))(x))


def test_autograd_grad_inside_the_step():
    model, make = models.seed_mlp()
    x, y = make(8)

    def grads(x, y):
        loss = F.cross_entropy(model(x), y)
        return torch.autograd.grad(loss, list(model.parameters()))

    got = stagetorch.jit(grads)(x, y)
    expected = grads(x, y)
    assert all(rel(g, e) < 1e-5 for g, e in zip(got, expected))
    assert all(p.grad is None for p in model.parameters())


def test_static_argnums_steer_python_control_flow():
    def f(x, mode):
        return x * 2 if mode == "double" else x + 1

    staged = stagetorch.jit(f, static_argnums=(1,))
    x = torch.randn(3)
    assert torch.equal(staged(x, "double"), x * 2) and torch.equal(staged(x, "inc"), x + 1)


def test_the_per_call_state_walk_matches_the_trace_order():
    """Shared, tied and None parameters, buffers, and a closed-over tensor: the cheap walk every call makes
    lists the same tensors in the same order as the walk that named the staged program's inputs."""
    from stagetorch.staging.state import discover

    shared, tied = nn.Linear(4, 4), nn.Linear(4, 4)
    tied.weight = shared.weight
    model = nn.Sequential(nn.Linear(3, 4, bias=False), shared, nn.BatchNorm1d(4), shared, tied, nn.Linear(4, 2))
    extra = torch.randn(2)

    def step(x):
        return (model(x) + extra).sum()

    state = discover(step, (torch.randn(5, 3),), {})
    tensors, _ = state.tensors_and_key()
    assert [id(t) for t in tensors] == [id(t) for _, _, t in state.named_state()]
    assert len(tensors) == len({id(t) for t in tensors})


def test_a_kernel_failing_mid_program_shows_the_equation_and_its_source_in_the_traceback():
    import traceback

    from stagetorch.interpreters.eager import Program

    def step(x):
        return (x @ x.t()).relu().sum()

    graph = stagetorch.make_ir(step)(torch.randn(3, 4))
    program = Program(graph)
    assert torch.equal(program.run([torch.ones(3, 4)])[0][0], step(torch.ones(3, 4)))
    with pytest.raises(RuntimeError) as info:
        program.run([torch.ones(5, 2, 7)])  # t() of a 3-d tensor: the kernel refuses it mid-program
    text = "".join(traceback.format_exception(info.value))
    assert "<stagetorch program" in text and "aten.t at" in text and "test_jit.py:" in text


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """The ops a real run reaches, with the ids of the tensors each took and made (kept alive, so no id
    is reused)."""

    def __init__(self):
        super().__init__()
        self.ops = []
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat_in = [id(a) for a in args if isinstance(a, torch.Tensor)]
        self.ops.append((func, flat_in, id(out)))
        self.made.append(out)
        return out


def test_aliases_of_a_value_run_no_call_and_hand_out_no_tensor_twice():
    from stagetorch.interpreters.eager import Program

    x, w = torch.randn(3, 4), torch.randn(4, 5)
    # A detach and a t(t(.)) of a value nothing else reads: only the mm runs, and the outputs are its value.
    program = Program(stagetorch.make_ir(lambda x, w: ((x @ w).t().t(), (x @ w).detach()))(x, w))
    with _Ops() as seen:
        outs, _ = program.run([x, w])
    assert [op for op, _, _ in seen.ops] == [torch.ops.aten.mm.default] * 2
    assert all(torch.equal(o, x @ w) for o in outs) and outs[0] is not outs[1]
    # A value read twice (or an input) is not stood in for: each output is its own tensor.
    program = Program(stagetorch.make_ir(lambda x, w: (lambda y: (y.t().t(), y.detach(), y, x.detach()))(x @ w))(x, w))
    with _Ops() as seen:
        outs, _ = program.run([x, w])
    assert [op.__name__ for op, _, _ in seen.ops].count("t.default") == 2
    assert len({id(o) for o in outs}) == 4 and all(torch.equal(o, x @ w) for o in outs[:3]) and outs[3] is not x
    # Chains: t(t(t(.))) is one t; t(t(detach(.))) none; a same-shape view none, a size-1 dim's view runs.
    f = lambda x, w: ((x @ w).t().t().t() * 1, (x @ w).detach().t().t() * 1, (x @ w).view(3, 5) * 1, (x[:1] @ w).view(1, 5) * 1)
    program = Program(stagetorch.make_ir(f)(x, w))
    with _Ops() as seen:
        outs, _ = program.run([x, w])
    names = [op.__name__ for op, _, _ in seen.ops]
    assert names.count("t.default") == 1 and names.count("view.default") == 1 and "detach.default" not in names
    for got, want in zip(outs, f(x, w)):
        assert got.shape == want.shape and got.stride() == want.stride() and torch.equal(got, want)


def test_ones_like_takes_its_binding_only_with_no_dispatch_mode(monkeypatch):
    """A staged loss's ``ones_like`` calls ``torch.ones_like`` (not the boxed overload: ~2 us a step) on a plain
    tensor with no dispatch mode active; under a mode it calls the overload, whose ops the mode sees as
    without stagetorch (the binding would also dispatch a detach: the test above). Bitwise the same either way."""
    from stagetorch.interpreters import eager as execute

    binding, boxed = [], []
    like = execute._like_binding(
        lambda *a, **k: binding.append(1) or torch.ones_like(*a, **k),
        lambda *a, **k: boxed.append(1) or torch.ops.aten.ones_like.default(*a, **k),
    )
    x = torch.randn(3, 2).t()
    out = like(x, pin_memory=False, memory_format=torch.preserve_format)
    assert (binding, boxed) == ([1], []) and torch.equal(out, torch.ones(2, 3)) and out.stride() == x.stride()
    with _Ops() as seen:
        like(x, pin_memory=False, memory_format=torch.preserve_format)
    assert (binding, boxed) == ([1], [1])
    assert [op for op, _, _ in seen.ops] == [torch.ops.aten.ones_like.default]

    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))

    def run():
        m = copy.deepcopy(model)

        @stagetorch.jit
        def step(x, y):
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            return loss

        return step(x, y), [p.grad for p in m.parameters()]

    loss, grads = run()
    assert any(
        key[0] is torch.ops.aten.ones_like.default and callable(entry) for key, entry in execute._ENTRIES.items()
    )
    monkeypatch.setattr(execute, "_ENTRIES", {})
    monkeypatch.setattr(execute, "_LIKE_FACTORIES", frozenset())
    boxed_loss, boxed_grads = run()
    assert not any(key[0] is torch.ops.aten.ones_like.default and entry for key, entry in execute._ENTRIES.items())
    assert torch.equal(loss, boxed_loss) and all(map(torch.equal, grads, boxed_grads))


def test_a_staged_linear_backward_runs_no_transpose_pair_and_no_detach():
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    reference = copy.deepcopy(model)
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))

    @stagetorch.jit
    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    step(x, y)
    model.zero_grad()
    with _Ops() as seen:
        loss = step(x, y)
    # The weight gradients' t(t(mm)) run only the mm: a t of a t runs only where the inner t has another reader.
    t = torch.ops.aten.t.default
    made_by_t = {out for op, _, out in seen.ops if op is t}
    reads = collections.Counter(a for _, args, _ in seen.ops for a in args)
    pairs = [args[0] for op, args, _ in seen.ops if op is t and args[0] in made_by_t]
    assert all(reads[inner] > 1 for inner in pairs)
    assert sum(op is t for op, _, _ in seen.ops) <= 5  # the weights (2), t(t(weight)), the mm operands (2)
    assert torch.ops.aten.detach.default not in [op for op, _, _ in seen.ops]
    expected = F.cross_entropy(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
        assert p.grad.stride() == q.grad.stride()


@pytest.mark.parametrize("seed", range(60))
def test_random_chains_of_aliases_run_as_eager(seed):
    """Random chains of t, detach and views over computed values, some read twice, some returned: the
    program's outputs have eager's values, shapes and strides, and are the same tensor where eager's are."""
    from stagetorch.interpreters.eager import Program

    rng = random.Random(seed)
    x, w = torch.randn(3, 4), torch.randn(4, 5)
    ops = [
        lambda h: h.t(), lambda h: h.t(), lambda h: h.t(), lambda h: h.detach(), lambda h: h.view(h.shape), lambda h: h * 2,
        lambda h: h.reshape(-1).view(h.shape), lambda h: h.transpose(0, 1), lambda h: h.t().contiguous(),
    ]
    plan = [(rng.randrange(len(ops)), rng.random() < 0.3, rng.random() < 0.3) for _ in range(rng.randint(1, 8))]

    def f(x, w):
        h, outs, values = x @ w, [], []
        for k, read_twice, returned in plan:
            values.append(h)
            h = ops[k](h)
            if read_twice:
                outs.append(values[-1] + 1)
            if returned:
                outs.append(h)
        return (*outs, h)

    program = Program(stagetorch.make_ir(f)(x, w))
    got, _ = program.run([x, w])
    want = f(x, w)
    assert len(got) == len(want)
    assert [[a is b for b in got] for a in got] == [[a is b for b in want] for a in want]  # the same tensors
    for g, e in zip(got, want):
        assert g.shape == e.shape and g.stride() == e.stride() and torch.equal(g, e)


def test_clear_caches_forgets_staged_programs_and_module_caches():
    from stagetorch.staging import meta_cache

    model, make = models.seed_mlp()
    step = stagetorch.jit(models.train_step(model))
    x, y = make(4)
    step(x, y)
    assert step._cache and meta_cache.META_CACHE
    stagetorch.clear_caches()
    assert not step._cache and not meta_cache.META_CACHE
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    step(x, y)  # staged again, same answer
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)


def test_clear_caches_forgets_lazy_recordings():
    from stagetorch.lazymode import recording

    model, make = models.seed_mlp()
    x, y = stagetorch.lazy(*make(4), batch=0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    assert recording.RECORDINGS
    stagetorch.clear_caches()
    assert not recording.RECORDINGS


def test_ops_on_numbers_only_stage_and_train_as_eager():
    """Issue 43: ``torch.div(seq_len, window, rounding_mode="trunc")`` on two Python ints (transformers'
    Longformer), ``torch.mul`` / ``torch.add`` of two numbers: a 0-dim tensor of torch's promoted dtype, its
    value read on the host for a view, the step trained in chunks against eager."""
    from budgets import train_chunked_against_eager

    B, S, H, W = 12, 8, 6, 4

    def step_of(model):
        def step(x, y):
            seq_len = x.shape[1]
            chunks = torch.div(seq_len, W, rounding_mode="trunc")
            scale = torch.mul(seq_len, 2) + torch.add(W, 0.5) + torch.div(seq_len, 3)
            assert (chunks.dtype, scale.dtype) == (torch.int64, torch.float32)
            h = model(x).view(x.shape[0], int(chunks), W, H).mean(2)
            loss = F.cross_entropy(h.flatten(1) / scale, y)
            loss.backward()
            return loss

        return step

    torch.manual_seed(0)
    batches = [(torch.randn(B, S, H, dtype=torch.float64), torch.randint(0, 2 * H, (B,))) for _ in range(3)]
    train_chunked_against_eager(step_of, nn.Linear(H, H).double(), batches)

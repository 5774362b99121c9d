"""A failed step leaves the caller's state as it was without a copy of the model (issue 25): an optimizer
stepped last in a staged step is a commit (``stagetorch.execute.commit_plan``), whose temporaries live in one
workspace allocated before its first write. An out-of-memory error in the last chunk and a failure to
allocate the commit's workspace, after AdamW steps inside ``jit``: parameters, ``.grad``, buffers and optimizer
state bitwise as before, and nothing copied."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from memtrack import _events

import stagetorch
import stagetorch.execute as execute
from stagetorch.execute import COMMIT_OPS, _out_overload

BATCH = 24
_OOM = {"after": None, "calls": 0}


@torch.library.custom_op("stagetorch_test::oom_after", mutates_args=())
def oom_after(x: torch.Tensor) -> torch.Tensor:
    """Identity that runs out of memory from its ``_OOM["after"]``-th call on: the device full from the
    last chunk of a step onward (the chunk loop's retries in smaller chunks fail too)."""
    _OOM["calls"] += 1
    if _OOM["after"] is not None and _OOM["calls"] > _OOM["after"]:
        raise torch.OutOfMemoryError("injected: CUDA out of memory. Tried to allocate 2.00 MiB")
    return x.clone()


@oom_after.register_fake
def _(x):
    return torch.empty_like(x)


oom_after.register_autograd(lambda ctx, grad: grad, setup_context=lambda ctx, inputs, output: None)
stagetorch.ops.register(torch.ops.stagetorch_test.oom_after, batch=stagetorch.ops.per_example())


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 3))
    model.register_buffer("steps", torch.zeros(()))
    return model


def _step(model, opt):
    def step(x, y):
        opt.zero_grad()
        model.steps.add_(1)  # a buffer the step writes before anything can fail
        loss = F.cross_entropy(model(torch.ops.stagetorch_test.oom_after(x)), y)
        loss.backward()
        opt.step()
        return loss

    return step


def _state(model, opt) -> dict:
    out = {n: t.detach().clone() for n, t in model.state_dict().items()}
    out.update({f"{n}.grad": None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
    out["optimizer"] = copy.deepcopy(opt.state_dict())
    return out


def _assert_bitwise(before: dict, after: dict) -> None:
    for name, t in before.items():
        if name == "optimizer":
            torch.testing.assert_close(after[name], t, rtol=0, atol=0)
        else:
            assert (t is None) == (after[name] is None), name
            assert t is None or torch.equal(t, after[name]), f"{name} changed by a failed step"


def _chunk(staged, x, y) -> None:
    """The largest budget that runs the step in >= 3 chunks."""
    budget = staged.plan(x, y).full_batch_peak_bytes * 2
    while len(staged.plan(x, y).chunk_sizes) < 3:
        budget = int(budget * 0.97)
        staged.memory_budget = budget


def _staged_adamw(chunked: bool):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    staged = stagetorch.jit(_step(model, opt))
    x, y = torch.randn(BATCH, 5), torch.randint(0, 3, (BATCH,))
    staged(x, y)  # the first step makes the optimizer's state
    if chunked:
        _chunk(staged, x, y)
    staged(x, y)  # the program that updates it in place
    return model, opt, staged, x, y


@pytest.mark.parametrize("chunked", [False, True], ids=["unchunked", "chunked"])
def test_an_out_of_memory_error_in_the_last_chunk_leaves_the_state_as_it_was(chunked):
    model, opt, staged, x, y = _staged_adamw(chunked)
    chunks = len(staged.plan(x, y).chunk_sizes)
    assert (chunks >= 3) == chunked
    before = _state(model, opt)
    _OOM.update(after=chunks - 1, calls=0)  # every chunk but the last runs
    try:
        with pytest.raises(torch.OutOfMemoryError, match="injected"):
            staged(x, y)
    finally:
        _OOM["after"] = None
    assert _OOM["calls"] > chunks  # the step retried in smaller chunks before giving up
    _assert_bitwise(before, _state(model, opt))
    staged(x, y)  # and the next step runs


@pytest.mark.parametrize("chunked", [False, True], ids=["unchunked", "chunked"])
def test_a_failure_to_allocate_the_commits_temporaries_leaves_the_state_as_it_was(chunked, monkeypatch):
    carved, armed, real = [], [], execute._carve

    def carve(layout, workspace):
        if armed:
            raise torch.OutOfMemoryError("injected: out of memory for the commit's workspace")
        carved.append(workspace)
        return real(layout, workspace)

    monkeypatch.setattr(execute, "_carve", carve)  # compiled into the programs made from here on
    model, opt, staged, x, y = _staged_adamw(chunked)
    assert carved  # the second step's update ran as a commit
    before = _state(model, opt)
    armed.append(True)
    with pytest.raises(torch.OutOfMemoryError, match="commit's workspace"):
        staged(x, y)
    _assert_bitwise(before, _state(model, opt))


@pytest.mark.parametrize("kind", ["adamw", "sgd_momentum", "sgd_foreach"])
def test_an_optimizer_stepped_last_copies_nothing_and_its_commit_allocates_only_its_workspace(kind):
    """The commit's one allocation is its workspace, made before its first write: after it nothing of a
    tensor's size is allocated (the few bytes of a Python scalar wrapped as a tensor aside), so nothing can
    fail for memory once the optimizer has written. Its temporaries take twice the largest parameter
    (AdamW's square root and denominator), not a copy of the model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    make = {
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        "sgd_foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
    }[kind]
    opt = make(model.parameters())

    def step(x, y):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()

    staged = stagetorch.jit(step)
    x, y = torch.randn(32, 64), torch.randn(32, 64)
    staged(x, y)
    staged(x, y)
    executable = next(reversed(staged._cache.values())).executable
    commit = executable.program.commit
    assert commit.start is not None and not commit.saves and executable.restore_bytes == 0
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    workspace = sum(commit.workspace.values())
    assert workspace <= 2 * largest + 64 * len(commit.layout)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        staged(x, y)
    allocation = torch._C._profiler._EventType.Allocation
    sizes = [
        e.extra_fields.alloc_size
        for e in sorted(_events(prof.profiler.kineto_results.experimental_event_tree()), key=lambda e: e.start_time_ns)
        if e.tag == allocation and e.extra_fields.alloc_size > 0
    ]
    if workspace:
        assert workspace in sizes
        after = sizes[len(sizes) - 1 - sizes[::-1].index(workspace) + 1:]
    else:  # SGD's update makes no temporary: everything after the last gradient is the commit
        after = []
    assert all(n <= 64 for n in after), after


def _sample(prim):
    """Arguments for ``prim`` (tensors of 256 x 256 positive floats, scalars of 0.5, clamp's lower bound),
    or None where it takes others."""
    args, kwargs = [], {}
    for a in prim._schema.arguments:
        kind = str(a.type)
        if a.name == "min":  # clamp needs a bound
            kind = kind.removeprefix("Optional[").removesuffix("]")
        elif a.has_default_value():
            continue
        if kind == "Tensor":
            value = torch.rand(256, 256) + 0.5
        elif kind in ("Scalar", "number"):
            value = 0.5
        elif kind == "Optional[str]":
            value = None
        else:
            return None
        if a.kwarg_only:
            kwargs[a.name] = value
        else:
            args.append(value)
    return args, kwargs


_OUT = sorted((p for p in COMMIT_OPS if _out_overload(p)[0] is not None), key=str)


@pytest.mark.parametrize("prim", _OUT, ids=str)
def test_the_out_overloads_a_commit_runs_allocate_nothing_of_the_outputs_size(prim):
    overload, names = _out_overload(prim)
    sample = _sample(prim)
    assert sample is not None, f"{prim}: no sample arguments"
    args, kwargs = sample
    expected = prim(*args, **kwargs)
    out = torch.empty_like(expected)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        overload(*args, **kwargs, **{names[0]: out})
    allocation = torch._C._profiler._EventType.Allocation
    sizes = [e.extra_fields.alloc_size for e in _events(prof.profiler.kineto_results.experimental_event_tree())
             if e.tag == allocation and e.extra_fields.alloc_size > 0]
    assert all(n <= 64 for n in sizes), sizes
    assert torch.equal(out, expected)

"""A failed step leaves the caller's state as it was without a copy of the model (issue 25): an optimizer
stepped last in a staged step is a commit (``stagetorch.transforms.commit.commit_plan``), whose temporaries live in one
workspace allocated before its first write. An out-of-memory error in the last chunk and a failure to
allocate the commit's workspace, after AdamW steps inside ``jit``: parameters, ``.grad``, buffers and optimizer
state bitwise as before, and nothing copied."""

from __future__ import annotations

import contextlib
import copy
from unittest import mock

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from injected import identity_op
from memtrack import _events

import stagetorch
import stagetorch.interpreters.eager as execute
import stagetorch.transforms.commit as commit_analysis
from stagetorch.interpreters.undo import Undo
from stagetorch.ir import Aval, Eqn, Var
from stagetorch.transforms.commit import COMMIT_OPS, _out_overload

BATCH = 24
_OOM = {"after": None, "calls": 0}


def _oom_after(x: torch.Tensor) -> None:
    """Run out of memory from the ``_OOM["after"]``-th call on: the device full from the last chunk of a step
    onward (the chunk loop's retries in smaller chunks fail too)."""
    _OOM["calls"] += 1
    if _OOM["after"] is not None and _OOM["calls"] > _OOM["after"]:
        raise torch.OutOfMemoryError("injected: CUDA out of memory. Tried to allocate 2.00 MiB")


identity_op("oom_after", _oom_after)


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


# The optimizers whose update runs as the step's commit: per element, foreach (the default on CUDA) and not.
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, foreach=False),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, foreach=True),
    "adam_foreach": lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.1, foreach=True),
    "adam_amsgrad_foreach": lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True, foreach=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False),
    "sgd_momentum_foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
    "sgd_nesterov": lambda ps: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, foreach=False
    ),
    "sgd_nesterov_foreach": lambda ps: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, foreach=True
    ),
}
FOREACH = [k for k in OPTIMIZERS if k.endswith("_foreach")]


def _staged(kind: str, chunked: bool, first: bool):
    """The step with optimizer ``kind`` inside, staged; ``first``: its state not made yet (the step to come
    makes it), else one step has run and the next updates the state in place."""
    model = _model()
    opt = OPTIMIZERS[kind](model.parameters())
    staged = stagetorch.jit(_step(model, opt))
    x, y = torch.randn(BATCH, 5), torch.randint(0, 3, (BATCH,))
    if not first:
        staged(x, y)  # the first step makes the optimizer's state
    if chunked:
        _chunk(staged, x, y)
    if not first:
        staged(x, y)  # the program that updates it in place
    return model, opt, staged, x, y


class _Saves:
    """The storages a step copies to restore them (``Undo.save``), by name of what they hold."""

    def __init__(self, monkeypatch, model):
        self.names = {p.untyped_storage().data_ptr(): n for n, p in model.state_dict(keep_vars=True).items()}
        self.saved: list[str] = []
        real = Undo.save

        def save(undo, t):
            base = t if t._base is None else t._base
            key = base.untyped_storage().data_ptr()
            if key in undo.protected and key not in undo.saved:
                self.saved.append(self.names.get(key, "optimizer state"))
            real(undo, t)

        monkeypatch.setattr(Undo, "save", save)


_WHEN = [False, True]
_WHEN_IDS = ["later_step", "first_step"]


@pytest.mark.parametrize("first", _WHEN, ids=_WHEN_IDS)
@pytest.mark.parametrize("chunked", [False, True], ids=["unchunked", "chunked"])
@pytest.mark.parametrize("kind", ["adamw", *FOREACH])
def test_an_out_of_memory_error_in_the_last_chunk_leaves_the_state_as_it_was(kind, chunked, first, monkeypatch):
    model, opt, staged, x, y = _staged(kind, chunked, first)
    chunks = len(staged.plan(x, y).chunk_sizes)
    assert (chunks >= 3) == chunked
    before = _state(model, opt)
    saves = _Saves(monkeypatch, model)
    _OOM.update(after=chunks - 1, calls=0)  # every chunk but the last runs
    try:
        with pytest.raises(torch.OutOfMemoryError, match="injected"):
            staged(x, y)
    finally:
        _OOM["after"] = None
    assert _OOM["calls"] > chunks  # the step retried in smaller chunks before giving up
    _assert_bitwise(before, _state(model, opt))
    # Put back from a copy: only the buffer the forward writes; the optimizer's update is the commit.
    assert set(saves.saved) <= {"steps"}, saves.saved
    staged(x, y)  # and the next step runs


@pytest.mark.parametrize("first", _WHEN, ids=_WHEN_IDS)
@pytest.mark.parametrize("chunked", [False, True], ids=["unchunked", "chunked"])
@pytest.mark.parametrize("kind", ["adamw", *FOREACH])
def test_a_failure_to_allocate_the_commits_temporaries_leaves_the_state_as_it_was(kind, chunked, first, monkeypatch):
    carved, armed, real = [], [], execute._carve

    def carve(layout, workspace, like=()):
        if armed:
            raise torch.OutOfMemoryError("injected: out of memory for the commit's workspace")
        carved.append(workspace)
        return real(layout, workspace, like)

    monkeypatch.setattr(execute, "_carve", carve)  # compiled into the programs made from here on
    model, opt, staged, x, y = _staged(kind, chunked, first)
    assert carved or first  # the second step's update ran as a commit
    before = _state(model, opt)
    saves = _Saves(monkeypatch, model)
    armed.append(True)
    with pytest.raises(torch.OutOfMemoryError, match="commit's workspace"):
        staged(x, y)
    _assert_bitwise(before, _state(model, opt))
    assert set(saves.saved) <= {"steps"}, saves.saved
    armed.clear()
    staged(x, y)  # and the step runs
    assert carved


def _bigger_step(kind: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    opt = OPTIMIZERS[kind](model.parameters())

    def step(x, y):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()

    return model, opt, step, torch.randn(32, 64), torch.randn(32, 64)


@pytest.mark.parametrize("first", _WHEN, ids=_WHEN_IDS)
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_an_optimizer_stepped_last_copies_nothing_and_its_commit_allocates_only_its_workspace(kind, first, monkeypatch):
    """The commit's allocations (its workspace; on a first step, the state it makes) are made in one place
    before its first write: after them, the allocator sees only the few bytes the plan counts
    (``Commit.numbers``: 0-dim results of ops on numbers, Python numbers wrapped as tensors), so nothing can
    fail for memory once the optimizer has written. Its temporaries take twice the largest parameter
    (AdamW's square root and denominator), or, for a foreach optimizer, the list of square roots its eager
    step makes too: not a copy of the model."""
    real = execute._carve

    def carve(*args):
        with torch.profiler.record_function("stagetorch_test::carve"):
            return real(*args)

    monkeypatch.setattr(execute, "_carve", carve)
    model, opt, step, x, y = _bigger_step(kind)
    staged = stagetorch.jit(step)
    if not first:
        staged(x, y)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        staged(x, y)
    executable = next(reversed(staged._cache.values())).executable
    commit = executable.program.commit
    assert commit.start is not None and not commit.saves and executable.restore_bytes == 0
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    workspace = sum(commit.workspace.values())
    temporaries = sum(sizes) if kind.endswith("_foreach") else 2 * max(sizes)
    assert workspace <= temporaries + 64 * len(commit.layout)
    if first and kind.startswith("sgd") and not kind.endswith("_foreach"):
        assert commit.fresh  # the momentum buffers made after the first parameter's update
    events = sorted(_events(prof.profiler.kineto_results.experimental_event_tree()), key=lambda e: e.start_time_ns)
    (mark,) = [e for e in events if e.name == "stagetorch_test::carve"]
    allocation = torch._C._profiler._EventType.Allocation
    mine, live, most = set(), 0, 0
    for e in events:
        if e.tag != allocation or e.start_time_ns < mark.end_time_ns:
            continue
        size, ptr = e.extra_fields.alloc_size, e.extra_fields.ptr
        if size > 0:
            assert size <= commit_analysis._WRAPPED, f"the commit allocated {size} B after its first write"
            mine.add(ptr)
        elif ptr in mine:
            mine.discard(ptr)
        else:
            continue  # a free of what the step made before
        live += size
        most = max(most, live)
    assert most <= commit.numbers


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_a_staged_optimizer_step_equals_the_eager_one_bit_for_bit(kind):
    """The commit runs each functional ``_foreach_`` op as its in-place form on a copy of its first list, and
    places a first step's state beside its workspace: parameters and state equal, bit for bit, the eager
    step of the formulation staging runs (Adam's capturable one, which keeps its step count a tensor), over
    a first step and three more."""

    def run(staged: bool):
        model, opt, step, x, y = _bigger_step(kind)
        if staged:
            step = stagetorch.jit(step)
        elif "capturable" in opt.defaults:
            for group in opt.param_groups:
                group["capturable"] = True
        generator = torch.Generator().manual_seed(1)
        with mock.patch("torch.compiler.is_compiling", lambda: True) if not staged else contextlib.nullcontext():
            for _ in range(4):
                step(torch.randn(32, 64, generator=generator), torch.randn(32, 64, generator=generator))
        return list(model.parameters()), [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]

    (params, state), (ref_params, ref_state) = run(True), run(False)
    assert len(state) == len(ref_state) > 0
    for a, b in zip([*params, *state], [*ref_params, *ref_state]):
        assert torch.equal(a, b) and a.stride() == b.stride()


def _foreach_sample(prim):
    """Arguments for a functional ``_foreach_`` op: lists of three tensors of 64 x 64 positive floats (one
    transposed), scalars of 0.5, a 0-dim tensor for a Tensor; None where it takes others."""
    args = []
    for a in prim._schema.arguments:
        kind = str(a.type)
        if a.kwarg_only and a.has_default_value():
            continue
        if kind == "List[Tensor]":
            value = [torch.rand(64, 64) + 0.5, torch.rand(64, 64).t() + 0.5, torch.rand(7) + 0.5]
        elif kind == "Tensor":
            value = torch.tensor(0.25) if a.name != "scalars" else torch.tensor([0.5, 0.25, 0.75])
        elif kind in ("Scalar", "number"):
            value = 0.5
        elif kind in ("List[Scalar]", "List[number]"):
            value = [0.5, 0.25, 0.75]
        else:
            return None
        args.append(value)
    return args


_FOREACH_OPS = sorted(
    (
        getattr(packet, name)
        for packet in (getattr(torch.ops.aten, f"_foreach_{n}", None) for n in commit_analysis._COMMIT_NAMES)
        if packet is not None
        for name in packet.overloads()
        if not name.endswith("out")
    ),
    key=str,
)


@pytest.mark.parametrize("prim", _FOREACH_OPS, ids=str)
def test_a_functional_foreach_op_runs_in_a_commit_as_its_in_place_form_on_a_copy(prim):
    """What the commit runs for a functional ``_foreach_`` op, ``_foreach_copy_`` of its first list into the
    workspace (laid out as that list) then its in-place form there, allocates nothing of a tensor's size and
    gives the functional op's result bit for bit (its out= overload would compute into new tensors and
    copy). The one without an in-place form (``_foreach_pow(scalar, steps)``) runs as it is on 0-dim step
    counts only."""
    sample = _foreach_sample(prim)
    assert sample is not None, f"{prim}: no sample arguments"
    expected = prim(*sample)

    def var(t):
        return Var(Aval.of(t))

    outs = tuple(var(t) for t in expected)
    firsts = [var(t) for t in sample[0]] if isinstance(sample[0], list) else sample[0]
    in_place = commit_analysis._foreach_in_place(Eqn(prim, (firsts, *sample[1:]), {}, outs))
    if in_place is None:
        assert prim is torch.ops.aten._foreach_pow.ScalarAndTensor
        steps = [var(torch.tensor(2.0)), var(torch.tensor(3.0))]
        assert commit_analysis._cannot_fail(Eqn(prim, (0.9, steps), {}, tuple(var(torch.tensor(0.5)) for _ in steps)), set())
        assert not commit_analysis._cannot_fail(Eqn(prim, (0.9, firsts), {}, outs), set())
        return
    workspace = [torch.empty(t.shape) for t in expected]  # contiguous places, as the commit's workspace has
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        places = execute._laid_out(workspace, sample[0])  # a transposed input: a view of its place
        torch.ops.aten._foreach_copy_(places, sample[0])
        in_place(places, *sample[1:])
    allocation = torch._C._profiler._EventType.Allocation
    sizes = [e.extra_fields.alloc_size for e in _events(prof.profiler.kineto_results.experimental_event_tree())
             if e.tag == allocation and e.extra_fields.alloc_size > 0]
    assert all(n <= commit_analysis._WRAPPED for n in sizes), sizes
    for got, want in zip(places, expected):
        assert torch.equal(got, want) and got.stride() == want.stride()


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
    assert all(n <= commit_analysis._WRAPPED for n in sizes), sizes
    assert torch.equal(out, expected)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01], ids=["plain", "decay"])
def test_a_first_sgd_step_makes_its_momentum_buffers_in_the_commit_laid_out_as_eager_does(weight_decay):
    """SGD makes each momentum buffer (``clone(grad)``, with weight decay a clone of ``grad + wd * p``)
    between the updates of the parameters before and after it: the commit allocates them before its first
    write, nothing is copied, and a channels-last weight's buffer is channels-last, as eager's is."""

    def run(staged: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
        model[0].to(memory_format=torch.channels_last)
        # The convolution's weight last: its buffer is made after the linear layer's update.
        opt = torch.optim.SGD(
            [*model[2].parameters(), *model[0].parameters()], lr=0.1, momentum=0.9, weight_decay=weight_decay
        )

        def step(x, y):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()

        run = stagetorch.jit(step) if staged else step
        run(torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last), torch.randn(2, 4))
        if staged:
            commit = next(reversed(run._cache.values())).executable.program.commit
            assert len(commit.fresh) == 3 and not commit.saves
        return [opt.state[p]["momentum_buffer"] for p in opt.param_groups[0]["params"]]

    for got, want in zip(run(True), run(False)):
        assert torch.equal(got, want) and got.stride() == want.stride()

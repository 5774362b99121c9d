"""F.ctc_loss in chunks of the batch (issue 43): each example's loss and alignment table follow from its own
column of ``log_probs`` (T, N, C), its own row of padded targets (N, S) and its own lengths, so a chunk runs
CTC's forward and backward on its own examples. The table is as wide as the chunk's longest target (narrower
than the whole batch's); it never leaves the chunk. Each case trains 3 SGD steps (momentum) in >= 2 chunks
beside eager on a copy: the losses, the parameters after every step and the input's ``.grad`` agree."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import stagetorch
from tests.support.budgets import budget_for, rel

T, N, C, S, D = 10, 6, 5, 4, 3
STEPS = 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = nn.Linear(D, 8)
        self.head = nn.Linear(8, C)

    def forward(self, x):
        return F.log_softmax(self.head(torch.tanh(self.f(x))), -1).transpose(0, 1)  # (T, N, C)


def batch(k: int, *, zero_inf: bool = False) -> tuple:
    """Step ``k``'s batch: x (N, T, D), padded targets (N, S), input and target lengths (N,)."""
    g = torch.Generator().manual_seed(k)
    x = torch.randn(N, T, D, generator=g, dtype=torch.double, requires_grad=True)
    targets = torch.randint(1, C, (N, S), generator=g)
    il = torch.randint(T - 3, T + 1, (N,), generator=g)
    tl = torch.randint(1, S + 1, (N,), generator=g)
    tl[k % N] = S  # one example at the widest target: a chunk without it has a narrower table
    tl[(k + 1) % N] = 1
    if zero_inf:
        il[(k + 2) % N] = 1  # too short for its target: an infinite loss, zeroed
        tl[(k + 2) % N] = 3
    return x, targets, il, tl


def step_of(model: nn.Module, reduction: str, zero_infinity: bool = False):
    def step(x, targets, il, tl):
        loss = F.ctc_loss(model(x), targets, il, tl, reduction=reduction, zero_infinity=zero_infinity)
        if reduction == "none":
            loss = (loss * torch.linspace(0.5, 1.5, loss.shape[0], dtype=loss.dtype)).sum()
        loss.backward()
        return loss

    return step


def train_against_eager(reduction: str, *, zero_infinity: bool = False, lists: bool = False) -> list[tuple]:
    torch.manual_seed(0)
    model = Net().double()
    reference = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, reference))
    staged = stagetorch.jit(step_of(model, reduction, zero_infinity))
    eager = step_of(reference, reduction, zero_infinity)
    plans = []
    for k in range(STEPS):
        x, *rest = batch(k, zero_inf=zero_infinity)
        if lists:  # Python lists passed to the step
            rest[1:] = [t.tolist() for t in rest[1:]]
        budget_for(staged, x, *rest, chunks=2)
        plan = staged.plan(x, *rest)
        assert len(plan.chunk_sizes) >= 2, plan
        plans.append(plan.chunk_sizes)
        got = []
        for o, run in ((opt, staged), (ref_opt, eager)):
            o.zero_grad()
            xk = x.detach().clone().requires_grad_()
            got.append((run(xk, *rest).detach(), xk.grad))
            o.step()
        (loss, xg), (ref_loss, ref_xg) = got
        assert torch.isfinite(loss) and rel(loss, ref_loss) < 1e-12, (k, loss, ref_loss)
        assert rel(xg, ref_xg) < 1e-12, k
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert rel(p.detach(), q.detach()) < 1e-12, (k, name)
    return plans


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_ctc_padded_targets_length_tensors_in_chunks_equal_eager(reduction):
    train_against_eager(reduction)


def test_ctc_zero_infinity_in_chunks_equals_eager():
    train_against_eager("mean", zero_infinity=True)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_ctc_lengths_as_lists_in_chunks_equal_eager(reduction):
    """Lists of lengths (a new list each step): the trace holds them as tensor constants, which the chunks are
    cut from (the kernels' tensor overloads); ``mean`` builds a tensor of them in C++, which the trace builds
    from the same Python data instead."""
    train_against_eager(reduction, lists=True)


def test_ctc_concatenated_targets_run_whole_and_are_refused_in_chunks_naming_padded_targets():
    torch.manual_seed(0)
    model = Net().double()
    reference = copy.deepcopy(model)
    x, targets, il, tl = batch(0)
    flat = torch.cat([targets[i, : tl[i]] for i in range(N)])

    def step_of_flat(m):
        def step(x, il, tl):
            loss = F.ctc_loss(m(x), flat, il, tl)
            loss.backward()
            return loss

        return step

    staged = stagetorch.jit(step_of_flat(model))
    loss = staged(x, il, tl)
    ref = step_of_flat(reference)(x, il, tl)
    assert rel(loss.detach(), ref.detach()) < 1e-12
    for p, q in zip(model.parameters(), reference.parameters()):
        assert rel(p.grad, q.grad) < 1e-12
    staged.memory_budget = staged.plan(x, il, tl).full_batch_peak_bytes // 3
    with pytest.raises(stagetorch.UnsupportedOpError) as err:
        staged(x, il, tl)
    msg = str(err.value)
    assert "_ctc_loss" in msg and "concatenated" in msg and "pass padded 2-D targets" in msg, msg


class CtcChunks(TorchDispatchMode):
    """The batch sizes of every real ``_ctc_loss`` kernel (``log_probs`` is (T, N, C))."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten._ctc_loss and type(args[0]) is torch.Tensor:
            self.sizes.append(args[0].shape[1])
        return func(*args, **(kwargs or {}))


def test_ctc_under_lazy_with_a_budget_runs_in_chunks_and_equals_eager():
    torch.manual_seed(0)
    model = Net().double()
    reference = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, reference))
    staged = stagetorch.jit(step_of(copy.deepcopy(model), "mean"))
    for k in range(STEPS):
        x, *rest = batch(k)
        budget = budget_for(staged, x, *rest, chunks=3)
        opt.zero_grad()
        ref_opt.zero_grad()
        seen = CtcChunks()
        with seen:
            xs = stagetorch.lazy(x, *rest, batch=0, memory_budget=budget)
            loss = F.ctc_loss(model(xs[0]), *xs[1:])
            loss.backward()
            value = loss.value()
        assert len(seen.sizes) >= 2 and sum(seen.sizes) == N, seen.sizes
        ref = F.ctc_loss(reference(x), *rest)
        ref.backward()
        assert rel(value.detach(), ref.detach()) < 1e-12, k
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert rel(p.grad, q.grad) < 1e-12, (k, name)
        opt.step()
        ref_opt.step()


def test_ctc_lengths_as_lists_under_lazy_in_chunks_are_refused_naming_the_fix():
    """lazy records the kernel with its Python lists (a chunk cannot be given its share of one): named."""
    torch.manual_seed(0)
    model = Net().double()
    staged = stagetorch.jit(step_of(copy.deepcopy(model), "sum"))
    x, targets, il, tl = batch(0)
    budget = budget_for(staged, x, targets, il, tl, chunks=3)
    with pytest.raises(stagetorch.UnsupportedOpError) as err:
        xs = stagetorch.lazy(x, targets, batch=0, memory_budget=budget)
        loss = F.ctc_loss(model(xs[0]), xs[1], il.tolist(), tl.tolist(), reduction="sum")
        loss.backward()
        loss.value()
    msg = str(err.value)
    assert "_ctc_loss" in msg and "Python lists" in msg and "pass the lengths as tensors" in msg, msg


@pytest.mark.parametrize("chunks", [1, 3])
def test_ctc_plan_counts_what_the_kernels_allocate(chunks):
    """The alignment table is counted at its widest (the padded targets'), and the backward's table of
    backward log-probabilities (``empty_like(log_alpha)``) as its workspace: the plan covers the measured peak,
    whole and in chunks, within 10% (before the workspace: 42% under whole, over the budget in chunks)."""
    from memtrack import AllocatorPeak

    torch.manual_seed(0)
    t, n, c, s, d = 200, 16, 30, 40, 32
    model = nn.Linear(d, c)

    def step(x, targets, il, tl):
        loss = F.ctc_loss(F.log_softmax(model(x), -1).transpose(0, 1), targets, il, tl)
        loss.backward()
        return loss

    args = (torch.randn(n, t, d), torch.randint(1, c, (n, s)), torch.full((n,), t), torch.randint(s // 2, s + 1, (n,)))
    staged = stagetorch.jit(step)
    if chunks > 1:
        budget_for(staged, *args, chunks=chunks)
    plan = staged.plan(*args)
    assert len(plan.chunk_sizes) >= chunks
    staged(*args)
    model.zero_grad(set_to_none=True)
    with AllocatorPeak([*model.parameters(), *args]) as measured:
        staged(*args)
    assert measured.peak <= plan.peak <= 1.1 * measured.peak, (measured.peak, plan)
    if chunks > 1:
        assert measured.peak <= staged.memory_budget

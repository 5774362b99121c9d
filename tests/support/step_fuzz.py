"""A generator of training steps whose loss reads a batch-sized tensor from anywhere, and the check that each
one trains under stagetorch as in eager PyTorch or is refused by name (issue 35).

:func:`specs` (a hypothesis strategy) draws a :class:`StepSpec`: a small float64 model (Linear/ReLU/Tanh
stacks, after a Conv1d or an Embedding), a per-example weight or mask of shape (B,), (B, 1) or (B, C), or
labels of shape (B,) or (B, 1) that the step reads instead of its argument ``y``, taken from an argument, a global, a closure, a module attribute, a registered buffer, a factory inside the step or
``torch.tensor`` of Python data, meeting logits, per-example losses or gathered log-probabilities through
``*``, ``+``, ``/`` or ``torch.where``, reduced by a mean, a sum, a weighted or masked mean, or used as the
``ignore_index`` mask of a cross-entropy with or without class weights; a selection of classes or of rows;
and whether the tensor changes between steps (in place for one the step captures, new Python values for one
it builds). :func:`source` writes the step as plain Python: it is the repro printed with every failure.

:func:`check` trains the step for a few SGD steps in eager, then under ``jit`` whole, ``jit`` in >= 3
uneven chunks, ``jit(remat="auto")`` at that budget (it may recompute instead), and ``lazy`` with a budget, and
compares loss, logits, every ``.grad`` and the weights after each step at float64 tolerance. A variant may
instead raise one of stagetorch's named errors (:data:`REFUSALS`), leaving the model as it was; a raw error,
a refusal that wrote state, or a wrong number is a failure. :func:`search` runs hypothesis over many specs
(tests/end_to_end/test_exactness_fuzz.py: a derandomized slice; tools/probes/fuzz_exactness.py: the long search).
"""

from __future__ import annotations

import collections
import re
import time
import traceback

import attrs
import torch
import torch.nn as nn
import torch.nn.functional as F
from budgets import budget_for
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

import stagetorch
from stagetorch.errors import (
    BatchCouplingError,
    ConcretizationError,
    OutOfMemoryError,
    ShapeError,
    UnsupportedOpError,
)

REFUSALS = (BatchCouplingError, UnsupportedOpError, ConcretizationError, ShapeError, OutOfMemoryError)
TOL = {"rtol": 1e-9, "atol": 1e-11}
VARIANTS = ("jit", "jit_chunks", "jit_remat", "lazy")
BATCHES = (23, 29, 37)  # primes: chunks are uneven, and no other dim of a model equals the batch

ORIGINS = ("argument", "global", "closure", "attribute", "buffer", "factory", "python_data")
SHAPES = ("b", "b1", "bc")
VALUES = ("logits", "losses", "logp")
# kind -> the ways it meets the per-example value, and the reductions it can take part in. Labels (class
# indices the step reads instead of ``y``) are the value's index: they meet nothing else.
COMBINES = {"weight": ("mul", "add", "div", "where"), "mask": ("mul", "where"), "labels": ("index",)}
REDUCTIONS = {
    "weight": ("mean", "sum", "weighted_mean"),
    "mask": ("mean", "sum", "masked_mean", "ce_ignore_index", "ce_class_weights"),
    "labels": ("mean", "sum"),
}
SELECTS = ("none", "classes", "rows", "flip")

# The step's per-example value (B, C) or (B,), from the logits ``out`` and the labels ``y``.
VALUE_CODE = {
    "logits": "out",
    "losses": 'F.cross_entropy(out, y, reduction="none")',
    "logp": "F.log_softmax(out, -1).gather(1, y[:, None]).squeeze(1)",
}
SELECT_CODE = {"none": None, "rows": "v = v[ROWS]", "flip": "v = v.flip(0)"}
COMBINE_CODE = {
    ("weight", "mul"): "c = v * u",
    ("weight", "add"): "c = v + u",
    ("weight", "div"): "c = v / u",
    ("weight", "where"): "c = torch.where(u > 0, v, 0.5 * v)",
    ("mask", "mul"): "c = v * u",
    ("mask", "where"): "c = torch.where(u, v, 0.0)",
}
REDUCTION_CODE = {
    "mean": "loss = c.mean()",
    "sum": "loss = c.sum()",
    "weighted_mean": "loss = c.sum() / u.sum()",
    "masked_mean": "loss = c.sum() / u.sum().clamp_min(1)",
}
# The tensor as a (B,) mask for a cross-entropy's targets.
MASK_ROWS = {"b": "t", "b1": "t[:, 0]", "bc": "t.all(1)"}


@attrs.frozen
class StepSpec:
    net: str  # "mlp", "conv" or "embedding" in front of the Linear stack
    hidden: tuple[int, ...]
    act: str  # "relu" or "tanh"
    batch: int
    classes: int
    kind: str  # "weight", "mask" or "labels"
    origin: str
    shape: str  # "b", "b1" or "bc"
    value: str
    combine: str
    reduction: str
    select: str
    changes: bool  # the tensor's values change between steps
    column: str  # how a (B,) value becomes (B, 1): "index" ([:, None]), "unsqueeze" or "reshape" (B as a number)
    seed: int
    steps: int = 3

    @property
    def positive(self) -> bool:
        """Whether the weights must be positive (they divide)."""
        return self.combine == "div" or self.reduction == "weighted_mean"


@st.composite
def specs(draw) -> StepSpec:
    kind = draw(st.sampled_from(tuple(COMBINES)))
    reduction = draw(st.sampled_from(REDUCTIONS[kind]))
    combine = "mul" if reduction in ("weighted_mean", "masked_mean") else draw(st.sampled_from(COMBINES[kind]))
    return StepSpec(
        net=draw(st.sampled_from(("mlp", "conv", "embedding"))),
        hidden=tuple(draw(st.lists(st.sampled_from((8, 12, 16)), min_size=1, max_size=2))),
        act=draw(st.sampled_from(("relu", "tanh"))),
        batch=draw(st.sampled_from(BATCHES)),
        classes=draw(st.sampled_from((3, 5))),
        kind=kind,
        origin=draw(st.sampled_from(ORIGINS)),
        shape=draw(st.sampled_from(SHAPES[:2] if kind == "labels" else SHAPES)),
        value=draw(st.sampled_from(VALUES)),
        combine=combine,
        reduction=reduction,
        select=draw(st.sampled_from(SELECTS)),
        changes=draw(st.booleans()),
        column=draw(st.sampled_from(("index", "unsqueeze", "reshape"))),
        seed=draw(st.integers(0, 2**16)),
    )


# -- the step, as source -------------------------------------------------------------------------------------


def _factory_code(spec: StepSpec) -> str:
    """A factory inside the step that builds the tensor from the batch size (K, J: Python values that change
    between steps)."""
    n = "x.shape[0] * C" if spec.shape == "bc" else "x.shape[0]"
    if spec.kind == "weight":
        lo, hi = (0.25, 1.75) if spec.positive else (-1, 1)
        flat = f"(torch.linspace({lo}, {hi}, {n}, dtype=torch.float64) * K)"
    elif spec.kind == "mask":
        flat = f"(torch.arange({n}) % (C + 1) != J)"  # t.all(1) keeps one row in C + 1
    else:
        flat = f"((torch.arange({n}) + J) % C)"
    return {"b": flat, "b1": f"{flat}[:, None]", "bc": f"{flat}.reshape(-1, C)"}[spec.shape]


def _tensor_code(spec: StepSpec) -> str | None:
    """The line that binds ``t``, the batch-sized tensor (None where it is the argument ``t``)."""
    return {
        "argument": None,
        "global": "t = T",
        "closure": "t = T",
        "attribute": "t = model.t",
        "buffer": "t = model.tb",
        "factory": f"t = {_factory_code(spec)}",
        "python_data": "t = torch.tensor(DATA, dtype=torch.float64)" if spec.kind == "weight" else "t = torch.tensor(DATA)",
    }[spec.origin]


def _column(spec: StepSpec, name: str) -> str:
    """``name`` (B,) as (B, 1), the way the spec writes it: the reshape names the batch size as a number."""
    return {"index": f"{name}[:, None]", "unsqueeze": f"{name}.unsqueeze(1)", "reshape": f"{name}.reshape({spec.batch}, 1)"}[spec.column]


def _loss_lines(spec: StepSpec) -> list[str]:
    if spec.kind == "labels":
        index = "t[:, None]" if spec.shape == "b" else "t"
        value = {
            "logits": f"out.gather(1, {index}).squeeze(1)",
            "losses": f'F.cross_entropy(out, {index}.squeeze(1), reduction="none")',
            "logp": f"F.log_softmax(out, -1).gather(1, {index}).squeeze(1)",
        }[spec.value]
        select = [SELECT_CODE[spec.select]] if SELECT_CODE.get(spec.select) else []
        return [f"v = {value}", *select, REDUCTION_CODE[spec.reduction].replace("c.", "v.")]
    if spec.reduction.startswith("ce_"):
        weight = ", weight=CW" if spec.reduction == "ce_class_weights" else ""
        return [f"target = torch.where({MASK_ROWS[spec.shape]}, y, -100)", f"loss = F.cross_entropy(out, target{weight})"]
    lines = [f"v = {VALUE_CODE[spec.value]}"]
    if SELECT_CODE.get(spec.select):
        lines.append(SELECT_CODE[spec.select])
    # Broadcast against each other as a user would write it: (B,) meets (B, C) as t[:, None].
    if spec.value == "logits":
        lines.append(f"u = {_column(spec, 't')}" if spec.shape == "b" else "u = t")
    elif spec.shape == "b":
        lines.append("u = t")
    else:
        lines += [f"v = {_column(spec, 'v')}", "u = t"]
    return [*lines, COMBINE_CODE[spec.kind, spec.combine], REDUCTION_CODE[spec.reduction]]


def source(spec: StepSpec) -> str:
    """The step as Python, reading what :class:`World` puts in its namespace."""
    body = ["out = model(x)"]
    if spec.select == "classes":
        body.append("out = out[:, COLS]")
    if _tensor_code(spec):
        body.append(_tensor_code(spec))
    body += [*_loss_lines(spec), "loss.backward()", "return loss.detach(), out.detach()"]
    args = "x, y, t" if spec.origin == "argument" else "x, y"
    step = [f"def step({args}):", *(f"    {line}" for line in body)]
    if spec.origin == "closure":
        return "\n".join(["def make(T):", *(f"    {line}" for line in step), "    return step"]) + "\n"
    return "\n".join(step) + "\n"


# -- the world a step runs in ----------------------------------------------------------------------------------


class MeanOverTime(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(1)


def model_of(spec: StepSpec) -> nn.Module:
    torch.manual_seed(spec.seed)
    act = nn.ReLU if spec.act == "relu" else nn.Tanh
    front, width = {
        "mlp": ([], 6),
        "conv": ([nn.Conv1d(2, 4, 3), act(), nn.Flatten()], 28),
        "embedding": ([nn.Embedding(11, 8), MeanOverTime()], 8),
    }[spec.net]
    layers = list(front)
    for h in spec.hidden:
        layers += [nn.Linear(width, h), act()]
        width = h
    return nn.Sequential(*layers, nn.Linear(width, spec.classes)).double()


class World:
    """One run's model, the tensor from its origin, and the step compiled from :func:`source` over them."""

    def __init__(self, spec: StepSpec):
        self.spec = spec
        self.model = model_of(spec)
        self.t = self._draw(spec.seed)
        g = torch.Generator().manual_seed(spec.seed + 1)
        self.namespace = {
            "torch": torch, "F": F, "model": self.model, "C": spec.classes, "K": 1.0, "J": 0,
            "T": self.t, "DATA": self.t.tolist(),
            "COLS": torch.randperm(spec.classes, generator=g), "ROWS": torch.randperm(spec.batch, generator=g),
            "CW": torch.rand(spec.classes, generator=g, dtype=torch.float64) + 0.5,
        }
        if spec.origin == "attribute":
            self.model.t = self.t
        elif spec.origin == "buffer":
            self.model.register_buffer("tb", self.t)
        exec(compile(source(spec), f"<step {spec.seed}>", "exec"), self.namespace)
        self.step = self.namespace["make"](self.t) if spec.origin == "closure" else self.namespace["step"]

    def _draw(self, seed: int) -> torch.Tensor:
        spec = self.spec
        g = torch.Generator().manual_seed(seed)
        shape = {"b": (spec.batch,), "b1": (spec.batch, 1), "bc": (spec.batch, spec.classes)}[spec.shape]
        if spec.kind == "labels":
            return torch.randint(0, spec.classes, shape, generator=g)
        if spec.kind == "mask":
            t = torch.rand(shape, generator=g) < 0.7
            t.view(-1)[0] = True  # a masked mean or cross-entropy over nothing is nan in eager too
            if spec.shape == "bc":
                t[0] = True  # t.all(1) keeps example 0
            return t
        lo, hi = (0.25, 1.75) if spec.positive else (-1.0, 1.0)
        return lo + (hi - lo) * torch.rand(shape, generator=g, dtype=torch.float64)

    def args(self, k: int) -> tuple[torch.Tensor, ...]:
        """Step ``k``'s arguments, after changing the tensor for it where the spec says so."""
        spec = self.spec
        if k and spec.changes:
            if spec.origin in ("global", "closure", "attribute", "buffer"):
                if spec.kind == "labels":
                    self.t.copy_((self.t + 1) % spec.classes)
                elif spec.kind == "mask":
                    self.t.copy_(self.t.roll(1, 0))
                else:
                    self.t.mul_(0.75).add_(0.25)
            elif spec.origin == "factory":
                self.namespace["K"], self.namespace["J"] = 1.0 + 0.5 * k, k % 4
            elif spec.origin == "python_data":
                self.namespace["DATA"] = self._draw(spec.seed + 100 * k).tolist()
        g = torch.Generator().manual_seed(spec.seed + 7 * k)
        b = spec.batch
        x = {
            "mlp": lambda: torch.randn(b, 6, generator=g, dtype=torch.float64),
            "conv": lambda: torch.randn(b, 2, 9, generator=g, dtype=torch.float64),
            "embedding": lambda: torch.randint(0, 11, (b, 4), generator=g),
        }[spec.net]()
        y = torch.randint(0, spec.classes, (b,), generator=g)
        if spec.origin != "argument":
            return x, y
        return x, y, self._draw(spec.seed + 100 * k) if spec.changes else self.t.clone()


# -- running and comparing -----------------------------------------------------------------------------------


@attrs.frozen
class StepRecord:
    loss: torch.Tensor
    out: torch.Tensor  # the step's other output (the logits)
    grads: tuple
    params: tuple  # after the optimizer's step


@attrs.define
class Result:
    status: str  # "ran", "refused", "wrong", "raw" (a raw error), "dirty" (refused after writing state), or
    # "unchunkable" (no budget splits the step in enough chunks: nothing to compare)
    error: str = ""  # the exception's class name
    detail: str = ""
    chunks: tuple[int, ...] = ()  # the chunk sizes a staged variant planned or a lazy one's kernels ran
    recomputed: bool = False


# The model's first layer's forward kernel -> (its weight's argument, its input's argument).
_FIRST_LAYER_ARGS = {torch.ops.aten.addmm: (2, 1), torch.ops.aten.convolution: (1, 0), torch.ops.aten.embedding: (0, 1)}


class FirstLayerRows(TorchDispatchMode):
    """The rows of every real forward kernel of the model's first layer: the chunk sizes a lazy step ran.
    (Its weight's shape is the model's alone: the first layer is the only one reading 6, 2 or 11 features.)"""

    def __init__(self, first: nn.Module):
        super().__init__()
        self.shapes = {first.weight.shape, first.weight.t().shape if first.weight.ndim == 2 else first.weight.shape}
        self.rows: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and not isinstance(args[0], torch.Tensor):
            # A wrapped number (a Python scalar autograd saved as a tensor) reaches a mode as that number, and
            # the kernel refuses it; lazy's backward reads such saved values with .item().
            return args[0]
        # Recording (lazy tensors) and tracing (fake tensors) run no kernel.
        where = _FIRST_LAYER_ARGS.get(func.overloadpacket)
        if where and args[where[0]].shape in self.shapes and not any(
            isinstance(a, (stagetorch.LazyTensor, FakeTensor)) for a in args
        ):
            self.rows.append(args[where[1]].shape[0])
        return func(*args, **(kwargs or {}))


def train(world: World, call) -> list[StepRecord]:
    """``spec.steps`` SGD steps of ``call(world, args) -> (loss, logits)``."""
    model = world.model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    records = []
    for k in range(world.spec.steps):
        args = world.args(k)
        optimizer.zero_grad(set_to_none=True)
        before = [p.detach().clone() for p in model.parameters()]
        try:
            loss, logits = call(world, args)
        except REFUSALS as e:
            e.step, e.untouched = k, all(p.grad is None and torch.equal(p, q) for p, q in zip(model.parameters(), before))
            raise
        grads = tuple(None if p.grad is None else p.grad.clone() for p in model.parameters())
        optimizer.step()
        records.append(StepRecord(loss.detach().clone(), logits.clone(), grads, tuple(p.detach().clone() for p in model.parameters())))
    return records


def difference(got: list[StepRecord], expected: list[StepRecord], tol: dict = TOL) -> str | None:
    """What differs first (loss, outputs, a .grad, a weight after the optimizer's step), or None; NaN equals
    NaN where eager has it too. Shared by both fuzzers (step_fuzz_families passes its own ``tol``)."""
    for k, (a, b) in enumerate(zip(got, expected, strict=True)):
        pairs = [("loss", a.loss, b.loss), ("outputs", a.out, b.out)]
        pairs += [(f".grad of parameter {i}", g, e) for i, (g, e) in enumerate(zip(a.grads, b.grads))]
        pairs += [(f"parameter {i} after the step", g, e) for i, (g, e) in enumerate(zip(a.params, b.params))]
        for what, g, e in pairs:
            if (g is None) != (e is None):
                return f"step {k} {what}: {g is None=}, eager's {e is None=}"
            if e is None:
                continue
            if g.shape != e.shape:
                return f"step {k} {what}: shape {tuple(g.shape)}, eager's {tuple(e.shape)}"
            try:
                torch.testing.assert_close(g, e, **tol, equal_nan=True)
            except AssertionError as error:
                rel = ((g - e).norm() / e.norm().clamp_min(1e-30)).item()
                return f"step {k} {what}: relative error {rel:.3g}; " + " ".join(str(error).split())[:300]
    return None


def _eager(world: World, args: tuple):
    return world.step(*args)


def _plan_budget(spec: StepSpec, chunks: int) -> int:
    """The largest budget at which jit (chunks alone) plans ``spec``'s step in >= ``chunks`` chunks."""
    world = World(spec)
    return budget_for(stagetorch.jit(world.step, remat=False), *world.args(0), chunks=chunks)


def run_variant(spec: StepSpec, variant: str, expected: list[StepRecord]) -> Result:
    result = Result("ran")
    try:
        if variant == "jit":
            world = World(spec)
            staged = stagetorch.jit(world.step)
            got = train(world, lambda w, args: staged(*args))
        elif variant in ("jit_chunks", "jit_remat"):
            # remat="auto" at the budget where chunks alone need 3: the planner may recompute instead.
            remat = "auto" if variant == "jit_remat" else False
            world = World(spec)
            staged = stagetorch.jit(world.step, memory_budget=_plan_budget(spec, 3), remat=remat)
            plan = staged.plan(*world.args(0))
            result.chunks, result.recomputed = plan.chunk_sizes, getattr(plan, "recompute", None) is not None
            world = World(spec)  # args(0) again, from the start
            staged = stagetorch.jit(world.step, memory_budget=staged.memory_budget, remat=remat)
            got = train(world, lambda w, args: staged(*args))
        else:
            # jit's 4-chunk budget: lazy's flush holds less than jit's program, and at jit's 3 ran 2 in places.
            budget = _plan_budget(spec, 4)
            world = World(spec)
            seen = FirstLayerRows(world.model[0])

            def call(w, args):
                with seen:
                    loss, logits = w.step(*stagetorch.lazy(*args, batch=0, memory_budget=budget))
                    return loss.value(), logits.value()

            got = train(world, call)
            result.chunks = tuple(seen.rows[: len(seen.rows) // spec.steps])
    except REFUSALS as e:
        untouched = getattr(e, "untouched", True)
        where = f" at step {e.step}" if hasattr(e, "step") else " while planning"
        return Result("refused" if untouched else "dirty", type(e).__name__, f"{where}: " + " ".join(str(e).split())[:400])
    except AssertionError as e:
        if "no budget gives enough chunks" in str(e):
            return Result("unchunkable", "", str(e))
        return Result("raw", type(e).__name__, "".join(traceback.format_exception(e, limit=-4))[-1500:])
    except Exception as e:  # noqa: BLE001 -- any other error is what the fuzzer reports
        return Result("raw", type(e).__name__, "".join(traceback.format_exception(e, limit=-4))[-1500:])
    wrong = difference(got, expected)
    if wrong:
        result.status, result.detail = "wrong", wrong
    return result


@attrs.define
class Outcome:
    spec: StepSpec
    results: dict[str, Result]

    @property
    def failures(self) -> dict[str, Result]:
        return {v: r for v, r in self.results.items() if r.status in ("wrong", "raw", "dirty")}

    def report(self) -> str:
        lines = [f"{self.spec}", source(self.spec)]
        for variant, r in self.failures.items():
            lines.append(f"{variant}: {r.status} {r.error} chunks={r.chunks} {r.detail}")
        return "\n".join(lines)


def check(spec: StepSpec) -> Outcome:
    """Eager's training of ``spec``'s step (which must run), and each of :data:`VARIANTS` against it."""
    expected = train(World(spec), _eager)
    assert all(r.loss.isfinite() for r in expected), f"the generator drew a step whose loss is not finite:\n{source(spec)}"
    return Outcome(spec, {v: run_variant(spec, v, expected) for v in VARIANTS})


def search(max_examples: int, seconds: float | None = None, derandomize: bool = True, seed: int | None = None,
           on_outcome=None) -> list[Outcome]:
    """:func:`check` over up to ``max_examples`` specs that hypothesis draws (stopping after ``seconds``);
    every outcome, failed or not (no shrinking: a failure is reported as drawn, with its source)."""
    outcomes: list[Outcome] = []
    stop = None if seconds is None else time.monotonic() + seconds

    @settings(derandomize=derandomize, max_examples=max_examples, deadline=None, database=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(specs())
    def one(spec):
        if stop is not None and time.monotonic() > stop:
            return
        outcomes.append(check(spec))
        if on_outcome is not None:
            on_outcome(outcomes[-1])

    if seed is not None:
        one = hypothesis_seed(seed)(one)
    one()
    return outcomes


def summary(outcomes: list[Outcome]) -> str:
    """Markdown: per variant, how many ran, were refused by which error (apart: steps whose examples do not
    meet each other, which a chunked run could have run), were wrong or died raw; how many ran in >= 3
    chunks and recomputed; then the refusals' messages by count."""
    counts: dict[str, collections.Counter] = {v: collections.Counter() for v in VARIANTS}
    messages: collections.Counter = collections.Counter()
    for o in outcomes:
        separable = o.spec.select not in ("rows", "flip")
        for v, r in o.results.items():
            if r.status == "refused":
                counts[v][f"refused: {r.error}{' (separable)' if separable else ''}"] += 1
                messages[r.error + re.sub(r" at <step \d+>:\d+", "", r.detail.split(":", 1)[-1])[:160]] += 1
            else:
                counts[v][r.status] += 1
            counts[v]["ran in >= 3 chunks"] += r.status == "ran" and len(r.chunks) >= 3
            counts[v]["ran recomputing"] += r.status == "ran" and r.recomputed
    keys = sorted({k for c in counts.values() for k in c}, key=lambda k: (not k.startswith("ran"), k))
    lines = [f"{len(outcomes)} steps", "", "| | " + " | ".join(VARIANTS) + " |", "|---|" + "---|" * len(VARIANTS)]
    lines += [f"| {k} | " + " | ".join(str(counts[v][k]) for v in VARIANTS) + " |" for k in keys]
    lines += ["", "| refusals (all variants) | message |", "|---|---|"]
    lines += [f"| {n} | {m.replace('|', '/')} |" for m, n in messages.most_common()]
    return "\n".join(lines)

"""The step fuzzer's op families (issue 43): random training steps over the ops where a batch role is easy to
get wrong, each trained under ``jit`` in >= 2 chunks and under ``lazy`` with a budget, against eager.

:func:`draw` writes one random step as plain Python (:class:`Case`: its source is the repro printed with every
finding) from one of :data:`FAMILIES`:

- ``captured_source``: a batch-sized tensor the step does not receive (a global, a buffer, a module attribute,
  ``torch.tensor`` of a Python list) as the *source* of gather / take_along_dim / index_select / a pick, and a
  shared table ``(C,)``/``(C, C)`` looked up at the labels;
- ``captured_index``: such a tensor as the *index* (gather, take_along_dim, a pick, a cross-entropy's target,
  one_hot) and a shared captured index for index_select;
- ``mask``: masks of every dtype (bool, long, float, uint8) and origin (an argument, captured, computed from the
  labels or from the input) used through a product, ``where``, ``masked_fill``, boolean indexing, an
  ignore_index target, and a host read of its count;
- ``inplace``: writes into a tensor the step makes (``o = torch.zeros(B, H); o[:, PERM] = h``, ``index_copy_``,
  ``index_add_``, a pick written in place) before the head reads it;
- ``pick``: ``t[torch.arange(B), y]`` reached by a per-example gradient (weighted, focal, from a hidden layer);
- ``repeat``: repeat / expand / repeat_interleave along the batch and other dims, ``x.new_ones(B, C) * 2``;
- ``batchstats``: per-example statistics averaged over the batch, and batch statistics (BatchNorm-like
  normalisation, a loss's variance over the batch, ``F.batch_norm``);
- ``reshape``: reshape / flatten / view of the batch with another dim (``x.reshape(-1, D)``, the batch as a
  number);
- ``embedding``: ``nn.Embedding`` (padding_idx, max_norm), ``F.embedding``, ``F.embedding_bag``, a padding mask;
- ``einsum``: per-example contractions and attention, a shared weight, in-batch similarities;
- ``scatter``: one-hot by scatter, scatter_add, scatter_reduce, index_add, a captured scatter source;
- ``losses``: every loss of torch.nn.functional the families use, each reduction (mean, sum, none then
  weighted by an argument or a captured weight);
- ``ignore``: count-normalised losses (ignore_index, with class weights, a sum over the kept count);
- ``leftovers``: issue 43's named leftovers (``Embedding(max_norm)``, CTC with length tensors, DeBERTa-v2's
  relative-position gather along dim 0 of a shared table, ``x.new_ones(B, C) * 2`` paired with the examples).

:func:`check` trains a case for 3 optimizer steps (SGD with momentum or AdamW, drawn) in eager and under each
of :data:`VARIANTS`, comparing loss, outputs, every ``.grad`` and every parameter after each step, and sorts
each run into :data:`CLASSES`:

- ``exact``: equal to eager at float64 (rtol 1e-8);
- ``refused-needed``: a named stagetorch error (a :class:`StagingError`) where the examples truly meet, or
  one that :func:`needed_without_coupling` names a reason for (jit reading a captured tensor on the host);
- ``refused-needless``: a named error where eager is per-example;
- ``raw``: any other exception;
- ``wrong``: a silent mismatch;
- ``unchunkable``: no budget splits the step in 2 chunks (nothing to compare in chunks).

Whether the examples meet is measured, not assumed (:func:`couples`): eager's gradient of the loss at one
example's first activations (or at its input) is compared with the same gradient after every other example's
input, labels and mask are drawn again. A step is per-example when that gradient changes by at most a factor
common to the example's gradient (a mean over the batch, a count of kept labels, a weighted mean's divisor).
(Coupling that reaches only a parameter's gradient, ``Embedding(scale_grad_by_freq=True)``, is named by hand.)

(Over 700 lines: the fourteen family writers share :class:`_Draw` and the runner; apart, each would be a module
of a few dozen lines importing the rest.)
"""

from __future__ import annotations

import collections
import random
import re
import time
import traceback

import attrs
import step_fuzz
import torch
import torch.nn as nn
import torch.nn.functional as F
from step_fuzz import StepRecord

import stagetorch
from stagetorch.errors import OutOfMemoryError, StagingError

VARIANTS = ("jit", "lazy")
CLASSES = ("exact", "refused-needed", "refused-needless", "raw", "wrong", "unchunkable")
FAMILIES = ("captured_source", "captured_index", "mask", "inplace", "pick", "repeat", "batchstats", "reshape",
            "embedding", "einsum", "scatter", "losses", "ignore", "leftovers")
BATCHES = (19, 23, 29)  # primes: no other dim equals the batch, chunks are uneven
TOL = {"rtol": 1e-8, "atol": 1e-10}
C, H, D, T, V = 5, 48, 6, 4, 11  # classes, hidden width, input features, sequence length, vocabulary
ORIGINS = ("global", "buffer", "attribute", "python_data")
MASK_DTYPES = ("bool", "long", "float", "uint8")


# -- the model -------------------------------------------------------------------------------------------------


class Net(nn.Module):
    """``head(f(features))``: ``f`` a Linear and Tanh, its input the features of ``kind``: ``mlp`` (B, D),
    ``seq`` (B, T, D) averaged over time after ``f``, ``tokens`` (B, T) through ``emb`` then averaged.
    ``rel``: a shared relative-position table (DeBERTa-like)."""

    def __init__(self, kind: str, emb_kwargs: dict):
        super().__init__()
        self.kind = kind
        width = D
        if kind == "tokens":
            self.emb = nn.Embedding(V, D, **emb_kwargs)
        self.f = nn.Sequential(nn.Linear(width, H), nn.Tanh())
        self.head = nn.Linear(H, C)
        if kind == "seq":
            self.rel = nn.Parameter(torch.randn(2 * T, H) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "tokens":
            return self.head(self.f(self.emb(x).mean(1)))
        if self.kind == "seq":
            return self.head(self.f(x).mean(1))
        return self.head(self.f(x))


# -- a case ------------------------------------------------------------------------------------------------------


@attrs.define
class Case:
    family: str
    seed: int
    batch: int
    kind: str  # the model's kind (Net)
    lines: list[str]
    mask: str | None = None  # the mask argument's dtype, where the step takes one (argument ``m``)
    weight: bool = False  # the step takes a per-example weight argument ``w``
    captured: dict = attrs.Factory(dict)  # name -> (origin, tensor)
    emb_kwargs: dict = attrs.Factory(dict)
    optimizer: str = "sgd"
    note: str = ""  # what the variant is, in words

    @property
    def args(self) -> list[str]:
        return ["x", "y"] + (["m"] if self.mask else []) + (["w"] if self.weight else [])

    @property
    def source(self) -> str:
        body = [*self.lines, "loss.backward()", "return loss.detach(), out.detach()"]
        return f"def step({', '.join(self.args)}):\n" + "".join(f"    {line}\n" for line in body)

    def describe(self) -> str:
        caps = ", ".join(f"{n}: {o} {tuple(t.shape)} {t.dtype}" for n, (o, t) in self.captured.items())
        return (f"family={self.family} seed={self.seed} B={self.batch} model={self.kind} {self.emb_kwargs or ''} "
                f"optimizer={self.optimizer} mask={self.mask} weight={self.weight} captured=[{caps}] {self.note}")


class _Draw:
    """What a family function writes with: the random source, and the captured tensors it places."""

    def __init__(self, case: Case, r: random.Random):
        self.case, self.r = case, r
        self.g = torch.Generator().manual_seed(case.seed)

    def choice(self, options):
        return self.r.choice(list(options))

    def capture(self, name: str, tensor: torch.Tensor, origin: str | None = None) -> str:
        """``tensor`` placed where the step reads it without receiving it; the expression that reads it."""
        origin = origin or self.choice(ORIGINS)
        self.case.captured[name] = (origin, tensor)
        low = name.lower()
        return {"global": name, "buffer": f"model.{low}_b", "attribute": f"model.{low}_a",
                "python_data": f"torch.tensor({name}_L, dtype={tensor.dtype})"}[origin]

    def rand(self, *shape, lo=0.5, hi=1.5) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(shape, generator=self.g, dtype=torch.float64)

    def labels(self, *shape, n=C) -> torch.Tensor:
        return torch.randint(0, n, shape, generator=self.g)

    def batch_expr(self) -> str:
        """The batch size as the step writes it."""
        return self.choice(("x.shape[0]", "len(x)", "x.size(0)", str(self.case.batch)))

    def mask(self) -> tuple[str, str]:
        """A (B,) mask of a drawn dtype and origin: (its expression, the expression of it as bool)."""
        dtype = self.choice(MASK_DTYPES)
        origin = self.choice(("argument", "captured", "labels", "input"))
        B = self.case.batch
        if origin == "argument":
            self.case.mask = dtype
            expr = "m"
        elif origin == "captured":
            t = torch.rand(B, generator=self.g) < 0.7
            t[0] = True
            expr = self.capture("MK", _as_dtype(t, dtype))
        elif origin == "labels":
            expr = {"bool": "(y != 1)", "long": "(y != 1).long()", "float": "(y != 1).double()",
                    "uint8": "(y != 1).to(torch.uint8)"}[dtype]
        else:
            first = "x[:, 0]" if self.case.kind == "mlp" else ("x[:, 0, 0]" if self.case.kind == "seq" else "x[:, 0]")
            cond = f"({first} > -0.5)" if self.case.kind != "tokens" else f"({first} != 1)"
            expr = {"bool": cond, "long": f"{cond}.long()", "float": f"{cond}.double()", "uint8": f"{cond}.to(torch.uint8)"}[dtype]
        as_bool = {"bool": expr, "long": f"({expr} != 0)", "float": f"({expr} > 0.5)", "uint8": f"{expr}.bool()"}[dtype]
        self.case.note += f" mask {dtype} from {origin}"
        return expr, as_bool

    def weight(self) -> str:
        """A (B,) per-example weight: an argument, captured, or computed from the labels."""
        origin = self.choice(("argument", "captured", "labels"))
        self.case.note += f" weight from {origin}"
        if origin == "argument":
            self.case.weight = True
            return "w"
        if origin == "captured":
            return self.capture("W", self.rand(self.case.batch))
        return "(1.0 + y.double() / C)"


def _as_dtype(t: torch.Tensor, dtype: str) -> torch.Tensor:
    return {"bool": t, "long": t.long(), "float": t.double(), "uint8": t.to(torch.uint8)}[dtype]


LOGP_Y = "F.log_softmax(out, 1).gather(1, y[:, None])[:, 0]"


def _captured_source(d: _Draw) -> None:
    c = d.case
    shared = d.r.random() < 0.3
    if shared:
        if d.r.random() < 0.5:
            tab = d.capture("TAB", d.rand(C))
            w = d.choice((f"{tab}[y]", f"{tab}.gather(0, y)", f"{tab}.index_select(0, y)", f"torch.take({tab}, y)"))
        else:
            tab = d.capture("TAB", d.rand(C, C))
            w = d.choice((f"{tab}[y].gather(1, y[:, None])[:, 0]", f"{tab}.index_select(0, y)[torch.arange({d.batch_expr()}), y]",
                          f"{tab}[y, y]"))
    else:
        src = d.capture("PRIOR", d.rand(c.batch, C))
        idx = d.capture("IDX", torch.randperm(C, generator=d.g)[:3], d.choice(("global", "python_data")))
        w = d.choice((f"{src}.gather(1, y[:, None])[:, 0]", f"torch.take_along_dim({src}, y[:, None], 1)[:, 0]",
                      f"{src}.index_select(1, {idx}).sum(1)", f"{src}[torch.arange({d.batch_expr()}), y]",
                      f"({src} * F.one_hot(y, C)).sum(1)", f"{src}[:, {idx}].mean(1)"))
    c.lines += [f"wt = {w}", "out = model(x)", f"loss = -(wt * {LOGP_Y}).mean()"]


def _captured_index(d: _Draw) -> None:
    c = d.case
    yc = d.capture("YC", d.labels(c.batch))
    idx = d.capture("IDX", torch.randperm(C, generator=d.g)[:3], d.choice(ORIGINS))
    v = d.choice((f"out.gather(1, {yc}[:, None])[:, 0]", f"torch.take_along_dim(F.log_softmax(out, 1), {yc}[:, None], 1)[:, 0]",
                  f"out[torch.arange({d.batch_expr()}), {yc}]", f"-F.cross_entropy(out, {yc}, reduction='none')",
                  f"out.index_select(1, {idx}).sum(1)", f"(out * F.one_hot({yc}, C)).sum(1)", f"out[:, {idx}].logsumexp(1)"))
    red = d.choice(("-(v).mean()", "(v ** 2).mean()", "(v.exp() * v).sum()"))
    c.lines += ["out = model(x)", f"v = {v}", f"loss = {red}"]


def _mask(d: _Draw) -> None:
    c = d.case
    m, mb = d.mask()
    use = d.choice(("product", "where", "masked_fill", "bool_index", "ignore", "host_count", "mul_mean"))
    lines = ["out = model(x)", "l = F.cross_entropy(out, y, reduction='none')"]
    lines += {
        "product": [f"mf = {m}.to(out.dtype)", "loss = (l * mf).sum() / mf.sum().clamp_min(1)"],
        "where": [f"loss = torch.where({mb}, l, torch.zeros_like(l)).sum()"],
        "masked_fill": [f"loss = out.masked_fill(~{mb}[:, None], 0.0).pow(2).mean() + l.mean()"],
        "bool_index": [f"loss = l[{mb}].mean()"],
        "ignore": [f"loss = F.cross_entropy(out, torch.where({mb}, y, -100))"],
        "host_count": [f"n = int({m}.sum().item())", f"loss = (l * {m}).sum() / max(n, 1)"],
        "mul_mean": [f"loss = (l * {m}).mean()"],
    }[use]
    c.note += f" used by {use}"
    c.lines += lines


def _inplace(d: _Draw) -> None:
    c = d.case
    perm = d.capture("PERM", torch.randperm(H, generator=d.g), d.choice(("global", "python_data", "buffer")))
    b = d.batch_expr()
    write = d.choice((
        [f"o = torch.zeros({b}, H, dtype=h.dtype)", f"o[:, {perm}] = h"],
        [f"o = torch.zeros_like(h).index_copy_(1, {perm}, h)"],
        ["o = h.new_zeros(h.shape)", f"o[:, {perm}] = h"],
        ["o = h.clone()", "o[:, :2] = 0"],
        [f"o = torch.zeros({b}, H, dtype=h.dtype)", f"o.index_add_(1, {perm}, h)"],
        ["o = h.clone()", f"o[torch.arange({b}), y] = 0.0"],
        ["o = h * 1.0", "o.mul_(2.0)", "o[:, 0] += 1.0"],
    ))
    loss = d.choice((f"-({d.weight()} * {LOGP_Y}).mean()", "F.cross_entropy(out, y)"))
    c.lines += ["h = model.f(x)", *write, "out = model.head(o)", f"loss = {loss}"]


def _pick(d: _Draw) -> None:
    c = d.case
    ar = f"torch.arange({d.batch_expr()})"
    form = d.choice(("weighted", "focal", "hidden", "logits"))
    c.note += f" pick {form}"
    if form == "hidden":
        c.lines += ["h = model.f(x)", f"s = h[{ar}, y]", "out = model.head(h)", "loss = F.cross_entropy(out, y) + (s ** 2).mean()"]
        return
    c.lines += ["out = model(x)", f"p = F.log_softmax(out, 1)[{ar}, y]"]
    if form == "weighted":
        c.lines.append(f"loss = -({d.weight()} * p).mean()")
    elif form == "focal":
        c.lines.append("loss = -((1 - p.exp()) ** 2 * p).mean()")
    else:
        c.lines += [f"z = out[{ar}, y]", "loss = (z.exp() - z).sum() / z.numel()"]


def _repeat(d: _Draw) -> None:
    c = d.case
    b = d.batch_expr()
    body = d.choice((
        ["t = y[:, None].repeat(1, 3)", "loss = F.cross_entropy(out[:, :, None].expand(-1, -1, 3), t)"],
        ["o2 = out.repeat(1, 2)", "loss = (o2 ** 2).sum(1).mean() + F.cross_entropy(out, y)"],
        ["e = out[:, None, :].expand(-1, 3, -1)", "loss = (e * WK).sum() / e.shape[0]"],
        ["loss = F.cross_entropy(out.repeat(2, 1), y.repeat(2))"],
        ["loss = F.cross_entropy(out.repeat_interleave(2, 0), y.repeat_interleave(2))"],
        ["r = out.repeat_interleave(2, 1)", "loss = (r.tanh() ** 2).mean()"],
        [f"t = x.new_ones({b}, C) * 2", "loss = -(F.log_softmax(out, 1) * t).sum(1).mean()"],
        [f"t = torch.ones({b}, C, dtype=out.dtype).cumsum(1)", "loss = (out * t).mean()"],
        ["e = out.unsqueeze(1).expand(-1, 2, -1).reshape(-1, C)", "loss = F.cross_entropy(e, y[:, None].expand(-1, 2).reshape(-1))"],
    ))
    c.lines += ["out = model(x)", *body]


def _batchstats(d: _Draw) -> None:
    c = d.case
    form = d.choice(("var_mean", "bn_like", "f_batch_norm", "loss_var", "mean_penalty", "centred", "batch_var",
                     "two_level", "instance_norm"))
    c.note += f" {form}"
    c.lines += {
        "var_mean": ["out = model(x)", "loss = F.cross_entropy(out, y) + 0.1 * out.var(1).mean()"],
        "bn_like": ["h = model.f(x)", "h = (h - h.mean(0)) / (h.std(0) + 1e-5)", "out = model.head(h)", "loss = F.cross_entropy(out, y)"],
        "f_batch_norm": ["h = model.f(x)", "h = F.batch_norm(h, None, None, training=True)", "out = model.head(h)",
                         "loss = F.cross_entropy(out, y)"],
        "loss_var": ["out = model(x)", "l = F.cross_entropy(out, y, reduction='none')", "loss = l.mean() + 0.1 * l.var()"],
        "mean_penalty": ["out = model(x)", "loss = F.cross_entropy(out, y) + 0.1 * (out.mean(0) ** 2).sum()"],
        "centred": ["out = model(x)", "z = out - out.mean(1, keepdim=True)", "loss = z.pow(2).mean(1).mean()"],
        "batch_var": ["out = model(x)", "loss = ((out - out.mean(0)) ** 2).mean()"],
        "two_level": ["h = model.f(x)", "mu = h.mean(1, keepdim=True)", "sd = (h - mu).pow(2).mean(1, keepdim=True)",
                      "out = model.head((h - mu) / (sd + 1e-3).sqrt())", "loss = F.cross_entropy(out, y) + 0.1 * sd.mean()"],
        "instance_norm": ["h = model.f(x)", "h = F.instance_norm(h[:, None, :])[:, 0]", "out = model.head(h)",
                          "loss = F.cross_entropy(out, y)"],
    }[form]


def _reshape(d: _Draw) -> None:
    c = d.case
    c.kind = "seq"
    b = d.batch_expr()
    feat = d.choice((
        "h = model.f(x.reshape(-1, D)).reshape(x.shape[0], T, H).mean(1)",
        "h = model.f(x.flatten(0, 1)).view(-1, T, H).sum(1)",
        f"h = model.f(x.reshape({b} * T, D)).reshape({b}, T, H).mean(1)",
        "h = model.f(x).flatten(1).reshape(x.shape[0], T, H).amax(1)",
        "h = model.f(x.transpose(0, 1)).transpose(0, 1).mean(1)",
        "h = model.f(x).unflatten(2, (2, H // 2)).flatten(2).mean(1)",
        "h = model.f(x.view(-1, D)).view(x.shape[0], -1)[:, :H]",
    ))
    tail = d.choice((["out = model.head(h)"], ["out = model.head(h).flatten().view(-1, C)"]))
    c.lines += [feat, *tail, "loss = F.cross_entropy(out, y)"]


def _embedding(d: _Draw) -> None:
    c = d.case
    c.kind = "tokens"
    c.emb_kwargs = d.choice(({}, {"padding_idx": 0}, {"max_norm": 1.0}, {"padding_idx": 1, "scale_grad_by_freq": True}))
    feat = d.choice((
        "h = model.f(model.emb(x).mean(1))",
        "h = model.f(F.embedding(x, model.emb.weight).sum(1))",
        "h = model.f(F.embedding_bag(x, model.emb.weight, mode='mean'))",
        "pm = (x != 0).to(model.emb.weight.dtype)\n    h = model.f((model.emb(x) * pm[..., None]).sum(1) / pm.sum(1, keepdim=True).clamp_min(1))",
        "h = model.f(model.emb(x)[:, 0] + model.emb(x[:, -1]))",
    ))
    c.lines += [*feat.split("\n    "), "out = model.head(h)", "loss = F.cross_entropy(out, y)"]


def _einsum(d: _Draw) -> None:
    c = d.case
    form = d.choice(("shared_weight", "rowdot", "attention", "contrastive", "outer"))
    c.note += f" {form}"
    if form == "attention":
        c.kind = "seq"
        c.lines += ["h = model.f(x)", "a = torch.einsum('bth,bsh->bts', h, h).softmax(-1)",
                    "z = torch.einsum('bts,bsh->bth', a, h).mean(1)", "out = model.head(z)", "loss = F.cross_entropy(out, y)"]
        return
    c.lines += {
        "shared_weight": ["h = model.f(x)", "out = torch.einsum('bh,ch->bc', h, model.head.weight) + model.head.bias",
                          "loss = F.cross_entropy(out, y)"],
        "rowdot": ["out = model(x)", "s = torch.einsum('bc,bc->b', F.log_softmax(out, 1), F.one_hot(y, C).double())",
                   "loss = -s.mean()"],
        "contrastive": ["h = model.f(x)", "out = model.head(h)", "sim = torch.einsum('bh,ch->bc', h, h)",
                        f"loss = F.cross_entropy(sim, torch.arange({d.batch_expr()})) + F.cross_entropy(out, y)"],
        "outer": ["h = model.f(x)", "out = model.head(h)", "o = torch.einsum('bh,bc->bhc', h, out)",
                  "loss = o.pow(2).sum((1, 2)).mean() * 0.01 + F.cross_entropy(out, y)"],
    }[form]


def _scatter(d: _Draw) -> None:
    c = d.case
    form = d.choice(("onehot", "onehot_", "scatter_add", "scatter_reduce", "index_add", "captured_src"))
    c.note += f" {form}"
    lines = ["out = model(x)", "lp = F.log_softmax(out, 1)"]
    lines += {
        "onehot": ["oh = torch.zeros_like(out).scatter(1, y[:, None], 1.0)", "loss = -(oh * lp).sum(1).mean()"],
        "onehot_": [f"oh = torch.zeros({d.batch_expr()}, C, dtype=out.dtype).scatter_(1, y[:, None], 1.0)", "loss = -(oh * lp).sum(1).mean()"],
        "scatter_add": ["acc = torch.zeros_like(out).scatter_add(1, y[:, None], lp.gather(1, y[:, None]))", "loss = -acc.sum(1).mean()"],
        "scatter_reduce": ["idx = IDXC.expand(out.shape[0], -1)",
                           "r = torch.zeros_like(out).scatter_reduce(1, idx, out, reduce='amax', include_self=False)",
                           "loss = F.cross_entropy(r, y)"],
        "index_add": ["acc = torch.zeros_like(out).index_add(1, PERMC, lp)", "loss = -acc.gather(1, y[:, None]).mean()"],
        "captured_src": [f"oh = torch.zeros_like(out).scatter(1, y[:, None], {d.capture('SRC', d.rand(c.batch, 1))})",
                         "loss = -(oh * lp).sum(1).mean()"],
    }[form]
    if form == "scatter_reduce":
        d.case.captured["IDXC"] = ("global", torch.tensor([[0, 1, 1, 3, 4]]))
    if form == "index_add":
        d.case.captured["PERMC"] = ("global", torch.randperm(C, generator=d.g))
    c.lines += lines


_ELEMENTWISE = {
    "mse": "F.mse_loss(out, F.one_hot(y, C).double(), reduction={r})",
    "l1": "F.l1_loss(out, F.one_hot(y, C).double(), reduction={r})",
    "smooth_l1": "F.smooth_l1_loss(out, F.one_hot(y, C).double(), reduction={r})",
    "huber": "F.huber_loss(out, F.one_hot(y, C).double(), reduction={r}, delta=0.5)",
    "bce": "F.binary_cross_entropy_with_logits(out, F.one_hot(y, C).double(), reduction={r})",
    "kl": "F.kl_div(F.log_softmax(out, 1), F.softmax(out.detach() * 0 + F.one_hot(y, C) * 2.0, 1), reduction={r})",
    "poisson": "F.poisson_nll_loss(out, F.one_hot(y, C).double(), reduction={r})",
}
_ROWWISE = {
    "ce": "F.cross_entropy(out, y, reduction={r})",
    "ce_smooth": "F.cross_entropy(out, y, reduction={r}, label_smoothing=0.1)",
    "ce_weight": "F.cross_entropy(out, y, reduction={r}, weight=CW)",
    "nll": "F.nll_loss(F.log_softmax(out, 1), y, reduction={r})",
    "multi_margin": "F.multi_margin_loss(out, y, reduction={r})",
    "ce_probs": "F.cross_entropy(out, F.softmax(F.one_hot(y, C) * 3.0, 1), reduction={r})",
}


def _losses(d: _Draw) -> None:
    c = d.case
    name = d.choice((*_ELEMENTWISE, *_ROWWISE))
    red = d.choice(("mean", "sum", "none"))
    code = {**_ELEMENTWISE, **_ROWWISE}[name].format(r=repr(red if red != "none" else "none"))
    c.note += f" {name} {red}"
    c.lines += ["out = model(x)", f"l = {code}"]
    if red != "none":
        c.lines.append("loss = l")
        return
    if name in _ELEMENTWISE:
        c.lines.append("l = l.sum(1)")
    w = d.weight()
    c.lines.append(d.choice((f"loss = (l * {w}).mean()", f"loss = (l * {w}).sum() / {w}.sum()", f"loss = (l * {w}).sum()")))


def _ignore(d: _Draw) -> None:
    c = d.case
    _, mb = d.mask()
    form = d.choice(("where", "masked_fill", "nll", "sum_over_count", "weighted"))
    c.note += f" {form}"
    c.lines += ["out = model(x)"] + {
        "where": [f"t = torch.where({mb}, y, -100)", "loss = F.cross_entropy(out, t)"],
        "masked_fill": [f"t = y.masked_fill(~{mb}, 7)", "loss = F.cross_entropy(out, t, ignore_index=7)"],
        "nll": [f"t = torch.where({mb}, y, -100)", "loss = F.nll_loss(F.log_softmax(out, 1), t)"],
        "sum_over_count": [f"t = torch.where({mb}, y, -100)",
                           "loss = F.cross_entropy(out, t, reduction='sum') / (t != -100).sum().clamp_min(1)"],
        "weighted": [f"t = torch.where({mb}, y, -100)", "loss = F.cross_entropy(out, t, weight=CW)"],
    }[form]


def _leftovers(d: _Draw) -> None:
    c = d.case
    form = d.choice(("max_norm", "ctc", "deberta", "new_ones"))
    c.note += f" {form}"
    if form == "max_norm":
        c.kind, c.emb_kwargs = "tokens", {"max_norm": d.choice((0.5, 1.0))}
        c.lines += ["out = model(x)", "loss = F.cross_entropy(out, y)"]
    elif form == "ctc":
        c.kind = "seq"
        c.lines += ["out = model(x)", "lp = F.log_softmax(model.head(model.f(x)), -1).transpose(0, 1)",
                    "tgt = (y[:, None] + torch.arange(2)) % (C - 1) + 1",
                    "il = torch.full((x.shape[0],), T, dtype=torch.long)",
                    "tl = torch.full((x.shape[0],), 2, dtype=torch.long)",
                    f"loss = F.ctc_loss(lp, tgt, il, tl, reduction={d.choice(('mean', 'sum'))!r}) + F.cross_entropy(out, y)"]
    elif form == "deberta":
        c.kind = "seq"
        c.captured["POS"] = ("global", (torch.arange(T)[:, None] - torch.arange(T)[None, :] + T - 1).clamp(0, 2 * T - 1))
        look = d.choice(("model.rel[POS]", "model.rel.gather(0, POS.reshape(-1, 1).expand(-1, H)).view(T, T, H)",
                         "model.rel.index_select(0, POS.reshape(-1)).view(T, T, H)"))
        c.lines += ["h = model.f(x)", f"r = {look}", "s = torch.einsum('bth,tsh->bts', h, r).softmax(-1)",
                    "z = torch.einsum('bts,bsh->bth', s, h).mean(1)", "out = model.head(z)", "loss = F.cross_entropy(out, y)"]
    else:
        b = d.batch_expr()
        c.lines += ["out = model(x)", f"t = x.new_ones({b}, C) * 2", "loss = -(F.log_softmax(out, 1) * t).sum(1).mean() / 2"]


_FAMILY_FN = {
    "captured_source": _captured_source, "captured_index": _captured_index, "mask": _mask, "inplace": _inplace,
    "pick": _pick, "repeat": _repeat, "batchstats": _batchstats, "reshape": _reshape, "embedding": _embedding,
    "einsum": _einsum, "scatter": _scatter, "losses": _losses, "ignore": _ignore, "leftovers": _leftovers,
}


def draw(seed: int, family: str | None = None) -> Case:
    """Case ``seed`` (of ``family``, else one drawn from the seed)."""
    r = random.Random(seed)
    family = family or r.choice(FAMILIES)
    case = Case(family, seed, r.choice(BATCHES), "mlp", [], optimizer=r.choice(("sgd", "adamw")))
    d = _Draw(case, r)
    _FAMILY_FN[family](d)
    return case


# -- the world a case runs in --------------------------------------------------------------------------------


class World:
    """One run's model (float64), the captured tensors where the case puts them, and the compiled step."""

    def __init__(self, case: Case):
        self.case = case
        torch.manual_seed(case.seed)
        self.model = Net(case.kind, case.emb_kwargs).double()
        self.namespace = {"torch": torch, "F": F, "model": self.model, "C": C, "H": H, "D": D, "T": T,
                          "CW": torch.linspace(0.5, 1.5, C, dtype=torch.float64),
                          "WK": torch.linspace(-1, 1, 3 * C, dtype=torch.float64).reshape(3, C)}
        for name, (origin, t) in case.captured.items():
            t = t.clone()
            low = name.lower()
            if origin == "global":
                self.namespace[name] = t
            elif origin == "buffer":
                self.model.register_buffer(f"{low}_b", t)
            elif origin == "attribute":
                setattr(self.model, f"{low}_a", t)
            else:
                self.namespace[f"{name}_L"] = t.tolist()
        exec(compile(case.source, f"<fuzz {case.family} {case.seed}>", "exec"), self.namespace)
        self.step = self.namespace["step"]

    def args(self, k: int, perturb: tuple[int, ...] = ()) -> tuple[torch.Tensor, ...]:
        """Step ``k``'s arguments; the rows ``perturb`` drawn again from another generator."""
        return _args(self.case, k, perturb)


def _args(case: Case, k: int, perturb: tuple[int, ...] = ()) -> tuple[torch.Tensor, ...]:
    def one(seed):
        g = torch.Generator().manual_seed(seed)
        b = case.batch
        x = {"mlp": lambda: torch.randn(b, D, generator=g, dtype=torch.float64),
             "seq": lambda: torch.randn(b, T, D, generator=g, dtype=torch.float64),
             "tokens": lambda: torch.randint(0, V, (b, T), generator=g)}[case.kind]()
        y = torch.randint(0, C, (b,), generator=g)
        out = [x, y]
        if case.mask:
            m = torch.rand(b, generator=g) < 0.7
            out.append(_as_dtype(m, case.mask))
        if case.weight:
            out.append(0.5 + torch.rand(b, generator=g, dtype=torch.float64))
        return out

    args = one(case.seed * 31 + k)
    if perturb:
        other = one(case.seed * 31 + k + 1000)
        rows = torch.tensor(perturb)
        for a, o in zip(args, other):
            a[rows] = o[rows]
    if case.mask:
        args[2][0] = True if case.mask == "bool" else 1  # a masked mean over nothing is nan in eager too
    return tuple(args)


# -- running, comparing, classifying -----------------------------------------------------------------------------


def _optimizer(case: Case, model: nn.Module):
    if case.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)


def train(world: World, call, steps: int = 3) -> list[StepRecord]:
    model = world.model
    opt = _optimizer(world.case, model)
    records = []
    for k in range(steps):
        args = world.args(k)
        opt.zero_grad(set_to_none=True)
        loss, out = call(world, args)
        grads = tuple(None if p.grad is None else p.grad.clone() for p in model.parameters())
        opt.step()
        records.append(StepRecord(loss.detach().clone(), out.clone(), grads, tuple(p.detach().clone() for p in model.parameters())))
    return records


def difference(got: list[StepRecord], expected: list[StepRecord]) -> str | None:
    """What differs first, or None (step_fuzz's comparison, at this fuzzer's tolerance)."""
    return step_fuzz.difference(got, expected, TOL)


def _row_grads(case: Case, perturb: tuple[int, ...]) -> torch.Tensor:
    """Eager's gradient of the loss at each example's first activations (the input, or the embeddings)."""
    world = World(case)
    args = list(world.args(0, perturb))
    seen = {}
    if case.kind == "tokens":
        def hook(module, inputs, output):
            output.retain_grad()
            seen.setdefault("e", output)
        world.model.emb.register_forward_hook(hook)
    else:
        args[0] = args[0].clone().requires_grad_(True)
    world.step(*args)
    g = seen["e"].grad if case.kind == "tokens" else args[0].grad
    return torch.zeros(case.batch, 1, dtype=torch.float64) if g is None else g.reshape(case.batch, -1)


def _proportional(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` is ``c * b`` for some number c (both zero counts)."""
    nb = (b * b).sum()
    if nb == 0:
        return bool((a == 0).all())
    c = (a * b).sum() / nb
    return bool((a - c * b).norm() <= 1e-7 * (a.norm() + c.abs() * b.norm()) + 1e-14)


def couples(case: Case) -> bool:
    """Whether the examples of ``case``'s step meet: an example's gradient changes (beyond a factor) when
    every other example's input, labels and mask are drawn again. Checked for the first and the last example."""
    if case.emb_kwargs.get("scale_grad_by_freq"):
        return True  # the table's gradient is scaled by counts over the batch (activations' gradients are not)
    B = case.batch
    base = _row_grads(case, ())
    for row, others in ((0, tuple(range(1, B))), (B - 1, tuple(range(B - 1))), (B // 2, tuple(range(B // 2)))):
        if not _proportional(_row_grads(case, others)[row], base[row]):
            return True
    return False


def _chunk_budget(case: Case, chunks: int) -> tuple[int, int]:
    """A budget at which jit (chunks alone) plans ``case`` in >= ``chunks`` chunks, and its chunk count."""
    world = World(case)
    staged = stagetorch.jit(world.step, remat=False)
    args = world.args(0)
    whole = staged.plan(*args).full_batch_peak_bytes
    for fraction in (0.7, 0.55, 0.45, 0.38, 0.32, 0.27, 0.22, 0.18, 0.14, 0.11, 0.08, 0.06):
        staged.memory_budget = int(whole * fraction)
        try:
            n = len(staged.plan(*args).chunk_sizes)
        except OutOfMemoryError:
            continue  # below the step's floor
        if n >= chunks:
            return staged.memory_budget, n
    raise _Unchunkable(f"no budget down to 6% of {whole} bytes gives {chunks} chunks")


class _Unchunkable(Exception):
    pass


@attrs.define
class Result:
    status: str  # one of CLASSES, or "refused" before the classifier ran
    error: str = ""
    detail: str = ""
    chunks: int = 0
    memory: str = ""  # for an exact jit run: "" (memory() reported), else its error
    why: str = ""  # for a refusal needed though the examples do not meet: why (see needed_without_coupling)


def _real(t: torch.Tensor) -> torch.Tensor:
    return t.value() if isinstance(t, stagetorch.LazyTensor) else t


def _summarise(e: BaseException) -> str:
    return " ".join(str(e).split())[:2000]


def run_variant(case: Case, variant: str, expected: list[StepRecord]) -> Result:
    result = Result("exact")
    try:
        if variant == "jit":
            budget, result.chunks = _chunk_budget(case, 2)
            world = World(case)
            staged = stagetorch.jit(world.step, memory_budget=budget)
            got = train(world, lambda w, args: staged(*args))
            try:
                stagetorch.memory(World(case).step)(*world.args(0))
            except Exception as e:  # noqa: BLE001 -- reported beside the run
                result.memory = f"{type(e).__name__}: {_summarise(e)}"
        else:
            try:
                budget, _ = _chunk_budget(case, 3)
            except (StagingError, _Unchunkable):
                budget = 24_000  # jit cannot say: a budget below these steps' whole peaks (tens of KB)

            def call(w, args):
                loss, out = w.step(*stagetorch.lazy(*args, batch=0, memory_budget=budget))
                return _real(loss), _real(out)

            try:
                got = train(World(case), call)
            except OutOfMemoryError as e:
                # Below what lazy's flush needs beside its chunks: again at the smallest budget it names.
                if getattr(e, "smallest_budget", None) is None:
                    raise
                budget = e.smallest_budget
                got = train(World(case), call)
    except _Unchunkable as e:
        return Result("unchunkable", detail=str(e))
    except StagingError as e:
        return Result("refused", type(e).__name__, _summarise(e))
    except Exception as e:  # noqa: BLE001 -- any other error is what the fuzzer reports
        return Result("raw", type(e).__name__, "".join(traceback.format_exception(e, limit=-3))[-1200:])
    wrong = difference(got, expected)
    if wrong:
        result.status, result.detail = "wrong", wrong
    return result


@attrs.define
class Outcome:
    case: Case
    results: dict[str, Result]
    coupled: bool | None = None

    @property
    def failures(self) -> dict[str, Result]:
        return {v: r for v, r in self.results.items() if r.status in ("wrong", "raw")}

    def report(self) -> str:
        lines = [self.case.describe(), self.case.source.rstrip()]
        for v, r in self.results.items():
            if r.status not in ("exact",) or r.memory:
                lines.append(f"  {v}: {r.status} {r.error} {r.detail[:600]}" + (f" memory(): {r.memory}" if r.memory else "")
                             + (f"\n  (needed: {r.why})" if r.why else ""))
        return "\n".join(lines)


# Refusals that are right whether or not the examples meet: (pattern in the error, variants, why).
_NEEDED = (
    ("(read from outside the step, not passed in", ("jit",),
     "jit stages one program per call signature and state key, and a captured tensor's value (a global, a "
     "buffer) is neither: a host read of it (its count, the positions of its mask) would be baked into the "
     "program and go stale when the tensor changes between calls, a silent wrong result; passed as an argument "
     "it is read per call (lazy reads it at each call, and runs these steps)"),
)


def needed_without_coupling(variant: str, result: Result) -> str | None:
    """Why ``variant``'s refusal ``result`` is needed though the examples may not meet, or None."""
    for pattern, variants, why in _NEEDED:
        if variant in variants and pattern in result.detail:
            return why
    return None


def check(case: Case) -> Outcome:
    expected = train(World(case), lambda w, args: w.step(*args))
    assert all(r.loss.isfinite() for r in expected), f"the generator drew a step whose loss is not finite:\n{case.source}"
    outcome = Outcome(case, {v: run_variant(case, v, expected) for v in VARIANTS})
    if any(r.status == "refused" for r in outcome.results.values()):
        outcome.coupled = couples(case)
        for v, r in outcome.results.items():
            if r.status != "refused":
                continue
            why = None if outcome.coupled else needed_without_coupling(v, r)
            r.status = "refused-needed" if outcome.coupled or why else "refused-needless"
            r.why = why or ""
    return outcome


def search(seeds, seconds: float | None = None, on_outcome=None, family: str | None = None) -> list[Outcome]:
    """:func:`check` over the cases of ``seeds`` (stopping after ``seconds``)."""
    stop = None if seconds is None else time.monotonic() + seconds
    outcomes = []
    for seed in seeds:
        if stop is not None and time.monotonic() > stop:
            break
        case = draw(seed, family)
        try:
            outcome = check(case)
        except AssertionError as e:  # the generator's own fault: a step eager cannot train
            print(f"skipped seed {seed}: {e}")
            continue
        outcomes.append(outcome)
        if on_outcome is not None:
            on_outcome(outcome)
    return outcomes


def summary(outcomes: list[Outcome]) -> str:
    """Markdown: the classes per variant, then per family, then the refusals' messages by count."""
    lines = [f"{len(outcomes)} steps", "", "| | " + " | ".join(CLASSES) + " | memory() failed |", "|---|" + "---|" * (len(CLASSES) + 1)]
    for v in VARIANTS:
        c = collections.Counter(o.results[v].status for o in outcomes)
        mem = sum(bool(o.results[v].memory) for o in outcomes)
        lines.append(f"| {v} | " + " | ".join(str(c[k]) for k in CLASSES) + f" | {mem if v == 'jit' else ''} |")
    lines += ["", "| family | steps | " + " | ".join(f"{v} {k}" for v in VARIANTS for k in ("exact", "needed", "needless", "raw", "wrong")) + " |",
              "|---|---|" + "---|" * (2 * 5)]
    for fam in FAMILIES:
        os_ = [o for o in outcomes if o.case.family == fam]
        if not os_:
            continue
        cells = []
        for v in VARIANTS:
            c = collections.Counter(o.results[v].status for o in os_)
            cells += [str(c["exact"]), str(c["refused-needed"]), str(c["refused-needless"]), str(c["raw"]), str(c["wrong"])]
        lines.append(f"| {fam} | {len(os_)} | " + " | ".join(cells) + " |")
    messages = collections.Counter()
    for o in outcomes:
        for r in o.results.values():
            if r.status.startswith("refused"):
                messages[f"{r.status} {r.error}: " + re.sub(r"<fuzz [a-z_]+ \d+>:\d+", "<step>", r.detail)[:200]] += 1
    lines += ["", "| refusals | message |", "|---|---|"]
    lines += [f"| {n} | {m.replace('|', '/')} |" for m, n in messages.most_common()]
    return "\n".join(lines)

"""Graph -> Graph passes and what they share: which equations have side effects, dead-code elimination, the
alias shortcuts (a rule table), the one schedule (liveness) that the executor compiles and the memory
interpreter costs, and the graph part of the chunk split (every pass must leave a graph that
:func:`stagetorch.ir.check` accepts).

A pass returns a new Graph and never mutates the one it is given (equations and vars of the input that it
keeps unchanged are shared). It knows the IR only: no registry, no real tensors, no batch analysis or chunk
runner.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from ..ir import Eqn, Graph, SourceInfo, Var, iter_vars
from ..registry import slot
from ..utils import collector
from ..utils.tree import map_leaves

__all__ = [
    "Liveness", "liveness", "scheduled", "steals", "add_into", "take_as", "writes", "is_random", "draws_random", "has_effect", "dce", "AliasRule",
    "ALIASES", "Folded", "fold_partials",
]

aten = torch.ops.aten

# Ops that update arguments in place although their schema does not say so: BatchNorm in training mode
# writes its running statistics. By packet: (the training flag's position, the positions written when set).
_HIDDEN_WRITES: dict = {
    aten.native_batch_norm: (5, (3, 4)),
    aten.cudnn_batch_norm: (5, (3, 4)),
    aten.miopen_batch_norm: (5, (3, 4)),
    aten._native_batch_norm_legit: (5, (3, 4)),
    aten.batch_norm: (5, (3, 4)),
}


def writes(e: Eqn) -> list[Var]:
    """The vars whose storage ``e`` writes in place: the schema's written arguments (lists of tensors too, by
    position or keyword) and the hidden writes above. The one account of in-place writes that the batch
    interpreter, the restore-on-failure of a step and recomputation all read."""
    out: list[Var] = []
    schema = getattr(e.prim, "_schema", None)
    if schema is not None:
        for a, x in zip(schema.arguments, e.args):
            if a.alias_info is not None and a.alias_info.is_write:
                out += iter_vars(x)
        for name, x in e.kwargs.items():
            arg = next((a for a in schema.arguments if a.name == name), None)
            if arg is not None and arg.alias_info is not None and arg.alias_info.is_write:
                out += iter_vars(x)
    hidden = _HIDDEN_WRITES.get(getattr(e.prim, "overloadpacket", None))
    if hidden is not None and len(e.args) > hidden[0] and e.args[hidden[0]]:
        out += [e.args[i] for i in hidden[1] if isinstance(e.args[i], Var)]
    return out


def is_random(e: Eqn) -> bool:
    """``e`` draws from a random generator: running it again gives other values and moves the generator."""
    tags = getattr(e.prim, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def draws_random(e: Eqn) -> bool:
    """``e`` draws random numbers: a random op, unless it is an attention kernel whose ``dropout_p`` is 0
    (tagged random for the dropout it may apply, it then takes no number) or a dropout with ``train`` off.
    A dropout or ``bernoulli_`` of probability 0 in training still takes its numbers (measured: the
    generator moves), as does every other random op. tests/transforms/test_draws.py checks each against
    the generator."""
    if not is_random(e):
        return False
    schema = getattr(e.prim, "_schema", None)
    if schema is None:
        return True
    names = [a.name for a in schema.arguments]
    if "dropout_p" not in names and "train" not in names:
        return True
    named = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    named |= dict(zip(names, e.args)) | e.kwargs
    if "dropout_p" in names:
        return not (isinstance(named.get("dropout_p"), (int, float)) and named["dropout_p"] == 0)
    return named.get("train") is not False


def has_effect(e: Eqn) -> bool:
    """Running ``e`` does something besides computing its outputs: writes an argument, draws random numbers,
    returns nothing (an assertion), or is not an ATen op (a collective, a user's custom op, a Python function
    a pass inserted) whose effects stagetorch cannot see."""
    kind = _EFFECT_KIND.get(e.prim)
    if kind is None:
        kind = _EFFECT_KIND[e.prim] = _effect_kind(e.prim)
    return kind == "always" or (kind == "writes" and bool(writes(e)))


_EFFECT_KIND: dict = {}


def _effect_kind(prim: Any) -> str:
    """``"always"``, ``"writes"`` (when :func:`writes` finds a var) or ``"never"``: what ``prim``'s schema
    alone says, remembered per op because passes ask for every equation of every graph they see."""
    if getattr(prim, "pure", False):
        return "never"  # a prim a pass inserted that says it has none (stagetorch.transforms.rng's)
    schema = getattr(prim, "_schema", None)
    if not isinstance(prim, torch._ops.OpOverload) or schema is None or prim.namespace not in ("aten", "prims"):
        return "always"
    if torch.Tag.nondeterministic_seeded in prim.tags or not schema.returns:
        return "always"
    if prim.overloadpacket in _HIDDEN_WRITES or any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return "writes"
    return "never"


# ---------------------------------------------------------------------------------------------------------
# Aliases: equations whose output is, below autograd, a value the program already has.


@attrs.frozen
class AliasRule:
    """When an op's output is, below autograd, another value with the same sizes and strides.

    ``source(e, made_by)`` returns the vars ``e``'s output stands for, from its argument outward (``[x]``
    for ``detach(x)``; ``[a, x]`` for ``t(a)`` with ``a = t(x)``), or ``None`` when this call is not such
    an alias; ``made_by`` maps each var defined so far to its equation. The output then shares the last
    var's tensor: the executor does not run the equation (nor those of the vars between, which only this
    chain reads), and the memory interpreter counts its storage as that var's.

    ``exclusive``: the output may stand for the value only when no other equation reads the chain and the
    value is not kept (else one tensor object would be handed out twice, or shared by two names that an
    in-place op tells apart). A non-exclusive rule (``detach``) needs that only when its output is kept.
    """

    source: Callable[[Eqn, Mapping[Var, Eqn]], list[Var] | None]
    exclusive: bool = True


def _detach_source(e: Eqn, made_by: Mapping[Var, Eqn]) -> list[Var] | None:
    return [e.args[0]] if len(e.args) == 1 else None


def _same_view_source(e: Eqn, made_by: Mapping[Var, Eqn]) -> list[Var] | None:
    # A dim of size 0 or 1 may get another stride from view: only all-large shapes keep every stride.
    src = e.args[0]
    shape = src.aval.shape
    if len(e.args) == 2 and tuple(e.args[1]) == shape and all(type(n) is int and n > 1 for n in shape):
        return [src]
    return None


def _double_t_source(e: Eqn, made_by: Mapping[Var, Eqn]) -> list[Var] | None:
    inner = made_by.get(e.args[0])
    if len(e.args) == 1 and inner is not None and inner.prim is aten.t.default and type(inner.args[0]) is Var:
        return [e.args[0], inner.args[0]]
    return None


# A staged backward is full of these: autograd detaches what it saves and what it accumulates, and a linear
# layer's weight gradient is t(t(mm)). Keyed by overload. Add a rule only for an op whose output really is
# the value (same storage, sizes and strides): the executor hands that value out in its place.
ALIASES: dict[Any, AliasRule] = {
    aten.detach.default: AliasRule(_detach_source, exclusive=False),
    aten.view.default: AliasRule(_same_view_source),
    aten.t.default: AliasRule(_double_t_source),
}


def _resolve_aliases(
    graph: Graph, live: list[bool], kept: set[Var], uses: dict[Var, int]
) -> tuple[dict[Var, Var], set[Var]]:
    """Apply :data:`ALIASES` to the live equations: each aliased output maps to the var whose tensor it
    is (never an input: the caller's tensor is not handed back as another value); the set holds the
    outputs of the equations between (their readers all skipped, they need not run either)."""
    inputs = set(graph.invars)
    alias: dict[Var, Var] = {}
    skipped: set[Var] = set()
    made_by: dict[Var, Eqn] = {}
    for i, e in enumerate(graph.eqns):
        if not live[i]:
            continue
        rule = ALIASES.get(e.prim)
        if rule is not None and len(e.outvars) == 1 and not e.kwargs and e.args and type(e.args[0]) is Var:
            out = e.outvars[0]
            chain = rule.source(e, made_by)
            # (The chain may end at a var whose own equation is skipped: t(t(t(x))) is t(x), not t(skipped).)
            if chain and chain[-1] not in skipped:
                root = alias.get(chain[-1], chain[-1])
                shared = root in kept or any(v in kept or uses.get(v) != 1 for v in chain)
                if root not in inputs and not (shared and (rule.exclusive or out in kept)):
                    alias[out] = root
                    skipped.update(chain[:-1])
        for v in e.outvars:
            if v is not None:
                made_by[v] = e
    return alias, skipped


# ---------------------------------------------------------------------------------------------------------
# Liveness.


@attrs.frozen
class Liveness:
    """The schedule the executor runs and the memory interpreter costs: which equations run, which tensor
    each var is, and where each storage and each tensor is last used.

    ``last_use[r]`` is the index of the last running equation that reads any var living in storage ``r``
    (``len(graph.eqns)`` for storage the graph's outputs or gradients keep to the end); a storage missing
    from it is never read. ``defined[r]`` is the index of the equation that first made it (-1 for an
    input). Storage is named by its root var: see :meth:`storage`.

    ``runs[i]`` is false for an equation nothing needs (:func:`dce`) and for one whose output is an alias
    (:data:`ALIASES`); ``alias`` maps such an output to the var whose tensor it is. ``frees[i]`` lists the
    tensors (by var, never an alias) to drop after equation ``i``: their last reader, or their maker when
    nobody reads or keeps them. Inputs and kept values are never dropped.

    ``steal`` maps the output of a gradient accumulation to the operand whose storage it is written into
    (:func:`steals`): a storage of its own for the executor's tensors, but the operand's for the memory.
    """

    last_use: dict[Var, int]
    defined: dict[Var, int]
    runs: list[bool] = attrs.field(factory=list)
    alias: dict[Var, Var] = attrs.field(factory=dict)
    frees: list[Sequence[Var]] = attrs.field(factory=list)
    steal: dict[Var, Var] = attrs.field(factory=dict)

    def tensor(self, v: Var) -> Var:
        """The var whose tensor ``v`` is at run time (``v`` itself unless it is an alias)."""
        return self.alias.get(v, v)

    def storage(self, v: Var) -> Var:
        """The root var of the storage ``v`` lives in, aliases and stolen operands followed."""
        return _storage(v, {**self.alias, **self.steal} if self.steal else self.alias)


def _storage(v: Var, alias: Mapping[Var, Var]) -> Var:
    # A root may itself be an alias (a view of a detach's output lives where the detach's source does).
    r = alias.get(v, v).root
    while r in alias:
        r = alias[r].root
    return r


@collector.paused()  # many small lists and dicts that all stay alive: the collector's passes would find nothing
def liveness(graph: Graph, keep: Sequence[Var] = ()) -> Liveness:
    """The schedule of ``graph``: dead equations dropped (:func:`dce`), aliases resolved (:data:`ALIASES`),
    and each storage and each tensor freed after its last use, in program order. The memory interpreter and
    the executor both follow it, so the bytes costed are the bytes run. ``keep``: values the caller reads
    after the run besides the outputs and gradients."""
    n = len(graph.eqns)
    kept = {v for v in graph.outvars if isinstance(v, Var)} | {v for _, v in graph.grads} | set(keep)
    reads = [e.invars for e in graph.eqns]
    live = _needed(graph, kept, reads)
    uses: dict[Var, int] = {}
    for k, vs in zip(live, reads):
        if k:
            for v in vs:
                uses[v] = uses.get(v, 0) + 1
    alias, skipped = _resolve_aliases(graph, live, kept, uses)
    runs = [
        k and not (e.outvars and (e.outvars[0] in alias or e.outvars[0] in skipped)) for k, e in zip(live, graph.eqns)
    ]
    # (An accumulation's operand must be its own tensor; a copied value may be an alias of one.)
    steal = {
        y: x for y, x in steals(graph, kept).items()
        if x not in skipped and alias.get(x, x) not in skipped and not (x.base is None and x in alias)
    }
    if steal:
        # A stolen copy's buffer is never made: its equation does not run, and the copy reads only the value.
        for i, e in enumerate(graph.eqns):
            if e.prim is aten.new_empty_strided.default and e.outvars[0] in steal:
                runs[i] = False
            elif e.prim is aten.copy_.default and e.args[0] in steal:
                reads[i] = [v for v in reads[i] if v is not e.args[0]]
    shares = {**alias, **steal} if steal else alias  # where each value's storage is
    last: dict[Var, int] = {}
    tensor_last: dict[Var, int] = {}
    defined: dict[Var, int] = {v.root: -1 for v in graph.invars}
    for i, e in enumerate(graph.eqns):
        if not runs[i]:
            continue
        for v in reads[i]:
            tensor_last[alias.get(v, v)] = i
            last[_storage(v, shares)] = i
        for v in e.outvars:
            if v is not None:
                defined.setdefault(_storage(v, shares), i)
    kept_tensors = {alias.get(v, v) for v in kept}
    for v in kept:
        last[_storage(v, shares)] = n
    inputs = set(graph.invars)
    # Most equations free nothing: they share one empty tuple, and a list is made only where needed.
    frees: list = [()] * n

    def free(i: int, t: Var) -> None:
        if frees[i]:
            frees[i].append(t)
        else:
            frees[i] = [t]

    for t, i in tensor_last.items():
        if t not in kept_tensors and t not in inputs:
            free(i, t)
    for i, e in enumerate(graph.eqns):  # a value no equation reads and nobody keeps dies at once
        if runs[i]:
            for v in e.outvars:
                if v is not None and v not in tensor_last and v not in kept_tensors:
                    free(i, v)
    return Liveness(last, defined, runs, alias, frees, steal)


def steals(graph: Graph, kept: set[Var] | None = None) -> dict[Var, Var]:
    """Where the backward takes over a dying value's storage instead of allocating, as autograd's engine
    does; keyed by the var whose storage is taken over, mapped to the value it is taken from:

    - a gradient accumulation ``add.Tensor(x, y)`` (the output, to ``x``; or to ``y`` without ``alpha``):
      eager's input buffer adds the second contribution into the first in place;
    - AccumulateGrad's copy ``b = new_empty_strided(...); copy_(b, x)`` (``b``, to ``x``): eager's
      AccumulateGrad steals the gradient as ``.grad`` where nothing else holds it.

    Each only where the value taken (``x``) fills its whole storage, has the shape and dtype of what takes
    it, is neither an input nor kept (``kept``: the outputs and gradients if not given), and nothing but
    this equation (and views of it) reads its storage. Without them the staged backward held three
    gradients of a weight where eager holds two (a weight decay term's backward ran at 1.32x eager's peak)
    and one more weight's size for each ``.grad`` an optimizer reads in the step (SGD inside the step:
    1.05x). A rule on the graph alone (its reads, not the schedule), so the recomputation planner's
    simulator applies it as the memory interpreter does."""
    if kept is None:
        kept = {v for v in graph.outvars if isinstance(v, Var)} | {v for _, v in graph.grads}
    kept_roots = {v.root for v in kept}
    inputs = {v.root for v in graph.invars}
    reads: dict[Var, list[Eqn]] = {}  # per storage root: the equations that read it for its values
    readers: dict[Var, list[Eqn]] = {}  # per var: every equation that reads it
    owners: dict[Var, int] = {}  # per root: how many vars live in it
    for v in graph.invars:
        owners[v.root] = owners.get(v.root, 0) + 1
    for e in graph.eqns:
        outs = [v for v in e.outvars if v is not None]
        view = (
            outs and all(v.root is outs[0].root for v in outs) and not writes(e)
            and any(type(a) is Var and a.root is outs[0].root for a in e.invars)
        )
        for v in e.invars:
            readers.setdefault(v, []).append(e)
            if not (view and v.root is outs[0].root) and e.prim is not aten.new_empty_strided.default:
                reads.setdefault(v.root, []).append(e)
        for v in outs:
            owners[v.root] = owners.get(v.root, 0) + 1

    def dying(x: Any, by: Eqn, taker: Var) -> bool:
        if type(x) is not Var:
            return False
        r = x.root
        return (
            r not in inputs and r not in kept_roots and x.aval == taker.aval and r.owned_nbytes == x.aval.nbytes
            and len(reads.get(r, ())) == 1 and reads[r][0] is by
        )

    out: dict[Var, Var] = {}
    for e in graph.eqns:
        if not e.source.backward or len(e.outvars) != 1 or e.outvars[0] is None:
            continue
        y = e.outvars[0]
        if e.prim is aten.add.Tensor and y.base is None:
            for p in ((0, 1) if e.kwargs.get("alpha", 1) == 1 else (0,)):
                x, other = e.args[p], e.args[1 - p]
                if dying(x, e, y) and x.base is None and owners.get(x) == 1 and not (
                    isinstance(other, Var) and other.root is x
                ) and adds_in_place(x, other, y):
                    out[y] = x
                    break
        elif e.prim is aten.new_empty_strided.default and y.base is None and not e.kwargs.get("pin_memory"):
            copy = readers.get(y, [])
            if len(copy) == 1 and copy[0].prim is aten.copy_.default and copy[0].args[0] is y and len(copy[0].args) == 2:
                x = copy[0].args[1]
                if dying(x, copy[0], y) and x.root is not y and x.aval.device == y.aval.device and (
                    x.strides is None or _same_strides(x.strides, tuple(e.args[2]), x.aval.shape)
                ):  # take_as copies a gradient laid out otherwise
                    out[y] = x
    return out


def _same_strides(a: Sequence[int], b: Sequence[int], shape: Sequence[int]) -> bool:
    """Strides ``a`` and ``b`` agree on every dim of more than one element."""
    return all(x == y or n <= 1 for x, y, n in zip(a, b, shape))


def adds_in_place(x: Var, other: Any, out: Var) -> bool:
    """Whether :func:`add_into` adds into ``x`` (contiguous, or laid out as ``other``), and the sum is then
    laid out as the out-of-place ``add`` lays out ``out`` (the strides the memory rules read for it), as far
    as the vars' strides show (unknown: it does)."""
    if x.strides is None:
        return True
    if out.strides is not None and not _same_strides(x.strides, out.strides, x.aval.shape):
        return False
    contiguous, acc = [], 1
    for n in reversed(x.aval.shape):
        contiguous.append(acc)
        acc *= max(n, 1)
    if _same_strides(x.strides, tuple(reversed(contiguous)), x.aval.shape):
        return True
    if not isinstance(other, Var) or other.strides is None:
        return True
    return other.aval.shape == x.aval.shape and _same_strides(x.strides, other.strides, x.aval.shape)


def take_as(x: torch.Tensor, size: Sequence[int], stride: Sequence[int]) -> torch.Tensor:
    """AccumulateGrad's copy of ``x`` laid out as ``stride``, where nothing else reads ``x`` (a stolen copy:
    :func:`steals`): ``x`` itself where it is laid out so, else the copy."""
    if all(a == b or n <= 1 for a, b, n in zip(x.stride(), stride, size)):
        return x
    return torch.empty_strided(size, stride, dtype=x.dtype, device=x.device).copy_(x)


def add_into(x: torch.Tensor, y: torch.Tensor, alpha: Any = 1) -> torch.Tensor:
    """``x + alpha * y`` written into ``x`` (a stolen operand: :func:`steals`). Where ``x``'s layout is not
    the one the out-of-place sum would take (``x`` strided otherwise than ``y`` and not contiguous), a new
    tensor as ``add`` makes: the values are the same, only the memory differs from the plan."""
    if x.is_contiguous() or (x.shape == y.shape and _same_strides(x.stride(), y.stride(), x.shape)):
        return x.add_(y, alpha=alpha)
    return torch.add(x, y, alpha=alpha)


def scheduled(graph: Graph, live: Liveness | None = None) -> Graph:
    """The graph the executor runs: only the equations that run (``live.runs``; ``live`` defaults to
    :func:`liveness` of ``graph``), each alias replaced by the var whose tensor it is, in equations, outputs
    and gradients alike. Its equations, in order, are the ones ``live.frees`` speaks of."""
    live = live if live is not None else liveness(graph)
    alias = live.alias
    if not alias and not live.steal and all(live.runs):
        return graph

    taken: dict[Var, Var] = {}  # a gradient buffer that takes its dying gradient over: the copy's result is it

    def tensor(v: Var) -> Var:
        return alias.get(v, taken.get(v, v))

    eqns = []
    buffers = {e.outvars[0]: e for e in graph.eqns if e.prim is aten.new_empty_strided.default} if live.steal else {}
    for e, runs in zip(graph.eqns, live.runs):
        if not runs:
            continue
        out = e.outvars[0] if e.outvars else None
        if e.prim is aten.copy_.default and e.args[0] in live.steal:
            # AccumulateGrad's copy of a dying gradient: the gradient itself where it is laid out so.
            made = buffers[e.args[0]]
            x = tensor(live.steal[e.args[0]])
            eqns.append(Eqn(take_as, (x, made.args[1], made.args[2]), {}, e.outvars, e.source))
            if e.outvars and e.outvars[0] is not None:
                taken[e.args[0]] = e.outvars[0]  # a flush's output names the buffer (one-line mode's .grad)
            continue
        if out in live.steal and e.prim is aten.add.Tensor:
            # The accumulation into its dying operand (its own tensor: add_into may fall back to a new one).
            x = live.steal[out]
            y = e.args[1] if e.args[0] is x else e.args[0]
            args = map_leaves((x, y), Var, tensor)
            eqns.append(Eqn(add_into, args, map_leaves(e.kwargs, Var, tensor), e.outvars, e.source))
            continue
        if any(v in alias for v in e.invars):
            e = Eqn(e.prim, map_leaves(e.args, Var, tensor), map_leaves(e.kwargs, Var, tensor), e.outvars, e.source)
        eqns.append(e)
    outvars = [tensor(v) if isinstance(v, Var) else v for v in graph.outvars]
    return attrs.evolve(graph, eqns=eqns, outvars=outvars, grads=[(i, tensor(v)) for i, v in graph.grads])


def _needed(graph: Graph, kept: set[Var], reads: list[list[Var]] | None = None) -> list[bool]:
    """Per equation: does anything need it? It has an effect, or a kept value or a needed equation reads
    what it makes. ``reads``: each equation's invars, when the caller has them."""
    needed = set(kept)
    keep: list[bool] = [False] * len(graph.eqns)
    for i in range(len(graph.eqns) - 1, -1, -1):
        e = graph.eqns[i]
        if has_effect(e) or any(v is not None and v in needed for v in e.outvars):
            keep[i] = True
            needed.update(e.invars if reads is None else reads[i])
            # A view's storage belongs to its base: keeping the view keeps the equation that made the base.
            needed.update(v.base for v in e.outvars if v is not None and v.base is not None)
    return keep


def dce(graph: Graph) -> Graph:
    """Drop the equations whose results nobody needs: no output, gradient or live equation reads them, and
    they have no side effect (:func:`has_effect`)."""
    keep = _needed(graph, {v for v in graph.outvars if isinstance(v, Var)} | {v for _, v in graph.grads})
    eqns = [e for e, k in zip(graph.eqns, keep) if k]
    if len(eqns) == len(graph.eqns):
        return graph
    return attrs.evolve(graph, eqns=eqns)


# ---------------------------------------------------------------------------------------------------------
# The chunk split's graph part: one chunk's graph made into the first-chunk and later-chunk graphs.


@attrs.frozen
class Folded:
    """A chunk's graph with its results folded into accumulators (see :func:`fold_partials`).

    ``first_extra`` and ``rest_extra`` say what each input past the body's own is: ``("into", k)`` the rows
    of result ``k`` in its full per-example tensor, ``("acc", k)`` the accumulator of result ``k``.
    ``handed`` lists the result each output of ``first`` stands for. ``acc_bytes``: the bytes held across
    the chunks by the accumulators and the values handed over as they are (those in storage of their own).
    """

    first: Graph
    rest: Graph
    first_extra: list[tuple[str, int]]
    rest_extra: list[tuple[str, int]]
    handed: list[int]
    acc_bytes: int


def fold_partials(body: Graph, kinds: Sequence[str], folds: Mapping[str, Callable]) -> Folded:
    """Fold each of ``body``'s outputs into its accumulator right after its last reader, so no partial
    outlives its use.

    ``kinds`` runs parallel to ``body.outvars``: ``"cat"`` (a per-example result: copied into its rows of the
    full tensor, in both graphs), ``"same"`` (never written: handed over as it is) or a reduction
    (``"sum"``, ``"max"``, ``"min"``). ``folds[kind](acc, x)`` writes ``x`` into ``acc`` in place and returns
    it (``folds["cat"]`` copies into the rows). The first chunk hands each reduction's partial over as the
    accumulator (a copy only for one whose storage it does not own outright); a later chunk reads the
    accumulators as inputs and folds into them in place.
    """
    source = body.eqns[0].source if body.eqns else SourceInfo()
    outs = list(body.outvars)
    input_roots = {v.root for v in body.invars}
    first_in, first_extra, first_folds, first_outs, handed = list(body.invars), [], [], [], []
    rest_in, rest_extra, rest_folds = list(body.invars), [], []
    # Storage the accumulators must not take over: what a never-written result lives in.
    owned = {x.root for x, kind in zip(outs, kinds) if kind == "same"}
    made = {v: (e, j) for e in body.eqns for j, v in enumerate(e.outvars) if v is not None}
    for k, (x, kind) in enumerate(zip(outs, kinds)):
        if kind == "cat":
            for ins, extra, pending in ((first_in, first_extra, first_folds), (rest_in, rest_extra, rest_folds)):
                rows = Var(x.aval)
                ins.append(rows)
                extra.append(("into", k))
                pending.append((x, Eqn(folds["cat"], (rows, x), {}, (Var(x.aval, base=rows),), source)))
            continue
        handed.append(k)
        if kind == "same":
            first_outs.append(x)
            continue
        r = x.root
        if r in input_roots or r in owned or _storage_nbytes(r, made) != x.aval.nbytes:
            copy = Var(x.aval)
            first_folds.append((x, Eqn(aten.clone.default, (x,), {}, (copy,), source)))
            first_outs.append(copy)
        else:
            owned.add(r)
            first_outs.append(x)
        acc = Var(x.aval)
        rest_in.append(acc)
        rest_extra.append(("acc", k))
        rest_folds.append((x, Eqn(folds[kind], (acc, x), {}, (Var(x.aval, base=acc),), source)))
    acc_bytes = sum(x.aval.nbytes for x, kind in zip(outs, kinds) if kind not in ("cat", "same"))
    kept_roots = {x.root for x, kind in zip(outs, kinds) if kind == "same"} - input_roots
    acc_bytes += sum(r.owned_nbytes for r in kept_roots)
    first = Graph(first_in, _after_last_use(body.eqns, first_folds), first_outs)
    rest = Graph(rest_in, _after_last_use(body.eqns, rest_folds), [])
    return Folded(first, rest, first_extra, rest_extra, handed, acc_bytes)


def _storage_nbytes(r: Var, made: Mapping[Var, tuple[Eqn, int]]) -> int:
    """The bytes of ``r``'s storage: its var's, or what its op's memory rule says it keeps (a reduced CPU loss
    keeps the storage of its unreduced loss: stagetorch/ops/losses.py)."""
    if r in made:
        e, j = made[r]
        rule = slot(e.prim, "memory")
        if rule is not None:
            outputs = getattr(rule(e), "outputs", {})
            return outputs.get(j, r.owned_nbytes)
    return r.owned_nbytes


def _after_last_use(eqns: list[Eqn], folds: list[tuple[Var, Eqn]]) -> list[Eqn]:
    """``eqns`` with each fold equation placed right after the last equation that reads (or defines) its
    value, so the value dies there."""
    last: dict[Var, int] = {}
    for i, e in enumerate(eqns):
        for v in e.outvars:
            if v is not None:
                last.setdefault(v, i)
        for v in e.invars:
            last[v] = i
    after: dict[int, list[Eqn]] = {}
    for v, e in folds:
        after.setdefault(last.get(v, -1), []).append(e)
    out = list(after.get(-1, []))
    for i, e in enumerate(eqns):
        out.append(e)
        out.extend(after.get(i, []))
    return out

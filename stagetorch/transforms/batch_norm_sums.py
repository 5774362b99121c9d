"""BatchNorm in training mode written as sums over the batch: a Graph -> Graph pass.

``aten.native_batch_norm`` in training reads the whole batch in one kernel, and its backward too: the batch
analysis can only refuse them. Written out, each is per-example work and a few per-channel sums over the
examples, which the analysis labels as reductions and the passes of :mod:`stagetorch.planning.multipass` compute
over the chunks:

- forward: per example and channel, the mean over the spatial dims and the sum of squares about it (in the
  input's dtype; per-example work); over the batch, in float64 from those ``[batch, channels]`` values, the
  sums of the examples' means shifted by ``k`` (the running mean before the step; 0 without running
  statistics), of their squares, and of the examples' sums of squares; the mean and ``1 / sqrt(var + eps)``
  from them, then the normalised output; the running statistics updated in place as the kernel does
  (unbiased variance for ``running_var``);
- backward: ``sum(g)`` and ``sum(g * xhat)`` per channel, which are the bias's and the weight's gradients,
  and the input's gradient from them.

Numerics (issue 43). ``var = s2 / n - (s1 / n)^2`` cancels when the shift is far from the batch mean (early
training, a fresh ``running_mean`` of zeros): summed in float32 over ``(x - k)^2``, a 4-block CNN's ``.grad``
was 77x further from float64 than eager float32's (``tests/planning/test_bn_numerics.py``). Each example's
spatial statistics are now about its own mean, which is well conditioned, and only the between-example part,
``[batch, channels]`` values, is summed and combined in float64, where the cancellation costs nothing (eager's
CPU kernel accumulates in double too): as accurate as eager float32 on every seed and depth measured. Chosen
over the alternatives: a float64 ``sum(dtype=...)`` of the activation copies it to float64 inside the kernel (on
CPU, ``self.to(dtype)``: measured with ``AllocatorPeak``, twice the activation's bytes, unseen by the sum's
memory rule), and an explicit float64 activation would cost the same in the plan; a Chan merge of per-chunk
(count, mean, M2) needs a combiner other than a sum in the reductions; a better shift from an earlier pass costs
a pass per layer. Here the per-example work allocates what the old sums did (an activation-sized centred value
and its square), plus float64 vectors of ``[batch, channels]``, all traced, so the plan stays exact. The
backward's two sums stay in the input's dtype (no cancellation measured there).

Each replacement is traced from a small function (:func:`_forward`, :func:`_backward`) by the tracer itself,
so its equations carry the shape, memory and batch rules of any traced op. This module knows the IR and the
tracer; it runs nothing.
"""

from __future__ import annotations

import attrs
import torch

from ..errors import UnsupportedOpError
from ..ir import Aval, Eqn, Graph, Var, op_name
from ..staging.tracer import trace
from ..utils.tree import map_leaves

__all__ = ["as_batch_sums", "batch_norms_in_training"]

aten = torch.ops.aten

# The BatchNorm ops written out here (the overloads whose arguments _written_out reads), with the position of
# their ``training`` flag.
_FORWARD = {aten.native_batch_norm.default: 5, aten._native_batch_norm_legit.default: 5}
_BACKWARD = {aten.native_batch_norm_backward.default: 7}


def batch_norms_in_training(graph: Graph) -> list[Eqn]:
    """The BatchNorm equations of ``graph`` in training mode, forward and backward."""
    return [e for e in graph.eqns if (i := {**_FORWARD, **_BACKWARD}.get(e.prim)) is not None and e.args[i]]


def _channel_view(x: torch.Tensor) -> list[int]:
    return [1, -1] + [1] * (x.ndim - 2)


def _wide(t):  # noqa: ANN001, ANN202
    return t if t.dtype == torch.float64 else t.to(torch.float64)


def _forward(x, weight, bias, running_mean, running_var, momentum, eps):  # noqa: ANN001, ANN202
    n = x.numel() // x.shape[1]
    shape = _channel_view(x)
    spatial = list(range(2, x.ndim))
    if spatial:
        # Per example and channel (per-example work): the mean over the spatial dims and the sum of squares
        # about it, in x's dtype, each shifted by its own mean (well conditioned).
        per_example = x.numel() // (x.shape[0] * x.shape[1])
        example_mean = x.mean(spatial)
        centred = x - example_mean.view(*example_mean.shape, *[1] * len(spatial))
        within = _wide((centred * centred).sum(spatial)).sum(0)
    else:
        per_example, example_mean, within = 1, x, None
    # Over the batch (the reductions), in float64 from [batch, channels] values: the between-example
    # part cancels when the running mean is far from the batch mean, harmlessly in float64.
    d = _wide(example_mean) if running_mean is None else _wide(example_mean) - _wide(running_mean)
    s1, s2 = d.sum(0) * per_example, (d * d).sum(0) * per_example
    if within is not None:
        s2 = s2 + within
    shifted_mean = s1 / n
    var64 = s2 / n - shifted_mean * shifted_mean
    mean = (shifted_mean if running_mean is None else shifted_mean + _wide(running_mean)).to(x.dtype)
    var = var64.to(x.dtype)
    invstd = torch.rsqrt(var64 + eps).to(x.dtype)
    out = (x - mean.view(shape)) * invstd.view(shape)
    if weight is not None:
        out = out * weight.view(shape)
    if bias is not None:
        out = out + bias.view(shape)
    if running_mean is not None:
        running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
    if running_var is not None:
        running_var.mul_(1 - momentum).add_(var * (n / max(n - 1, 1)), alpha=momentum)
    return out, mean, invstd


def _backward(grad, x, weight, save_mean, save_invstd, mask):  # noqa: ANN001, ANN202
    dims = [0, *range(2, x.ndim)]
    n = x.numel() // x.shape[1]
    shape = _channel_view(x)
    xhat = (x - save_mean.view(shape)) * save_invstd.view(shape)
    grad_bias, grad_weight = grad.sum(dims), (grad * xhat).sum(dims)
    scale = save_invstd if weight is None else weight * save_invstd
    grad_input = (grad - (grad_bias / n).view(shape) - xhat * (grad_weight / n).view(shape)) * scale.view(shape)
    return tuple(g for g, wanted in zip((grad_input, grad_weight, grad_bias), mask) if wanted)


def _written_out(e: Eqn) -> tuple[object, list, list]:
    """The function that writes ``e`` out, its arguments (Vars where ``e`` has them) and ``e``'s outvars
    it returns, in order."""
    if e.prim in _FORWARD:
        x, weight, bias, running_mean, running_var, _, momentum, eps = e.args[:8]
        return _forward, [x, weight, bias, running_mean, running_var, momentum, eps], list(e.outvars[:3])
    grad, x, weight, _, _, save_mean, save_invstd, _, _, mask = e.args[:10]
    outs = [v for v, wanted in zip(e.outvars, mask) if wanted]
    return _backward, [grad, x, weight, save_mean, save_invstd, list(mask)], outs


def _replacement(e: Eqn) -> list[Eqn]:
    """``e``'s equations written as batch sums, over ``e``'s own Vars (its outvars made by them)."""
    fn, args, outs = _written_out(e)
    tensors = [a for a in args if isinstance(a, Var)]
    traced = trace(fn, [Aval(a.aval.shape, a.aval.dtype, a.aval.device) if isinstance(a, Var) else a for a in args], {})
    differ = [a for v, a in zip(traced.graph.outvars, outs) if a is not None and v.aval != a.aval]
    if differ or tensors[0].aval.dtype not in (torch.float32, torch.float64):
        # Half precision: the kernel keeps its statistics in float (and may return them so); sums in half
        # precision would not make what it makes.
        raise UnsupportedOpError(
            f"{op_name(e.prim)} at {e.source} normalises a {tensors[0].aval} (in half precision, or with statistics "
            "of another dtype), which its batch sums would not compute as its kernel does"
        )
    laid_out = [a for a in tensors if a.strides is not None and not _contiguous(a.aval.shape, a.strides)]
    if laid_out:
        # Measured (tests/end_to_end/test_random_steps.py, a transposed Conv1d sequence and a channels-last image): the
        # sums over a permuted layout copy what the contiguous trace does not show (one activation per example
        # under the plan), so such a BatchNorm keeps the step out of passes until the trace follows its layout.
        raise UnsupportedOpError(
            f"{op_name(e.prim)} at {e.source} normalises a {laid_out[0].aval} laid out with strides "
            f"{laid_out[0].strides} (channels-last or transposed), whose batch sums are not yet costed exactly"
        )
    sub: dict[Var, Var] = dict(zip(traced.graph.invars, tensors))
    for made, mine in zip(traced.graph.outvars, outs):
        if mine is not None:
            sub[made] = mine
    eqns = []
    for d in traced.graph.eqns:
        outvars = []
        for v in d.outvars:
            if v is not None and v not in sub:
                base = None if v.base is None else sub.get(v.base, v.base)
                sub[v] = Var(v.aval, base, v.storage_nbytes, v.strides)
            outvars.append(None if v is None else sub[v])
        args, kwargs = map_leaves((d.args, d.kwargs), Var, lambda v: sub.get(v, v))
        eqns.append(Eqn(d.prim, args, kwargs, tuple(outvars), e.source))
    return eqns


def _contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether ``strides`` lay ``shape`` out row-major (the strides of dims of size 1 do not matter)."""
    step = 1
    for n, s in zip(reversed(shape), reversed(strides)):
        if n != 1 and s != step:
            return False
        step *= n
    return True


def as_batch_sums(graph: Graph) -> Graph:
    """``graph`` with each BatchNorm in training mode (forward and backward) written as per-example work and
    per-channel sums over the batch. The same inputs, outputs and gradients; the same values, but for
    rounding."""
    training = {id(e) for e in batch_norms_in_training(graph)}
    eqns: list[Eqn] = []
    for e in graph.eqns:
        eqns.extend(_replacement(e) if id(e) in training else [e])
    return attrs.evolve(graph, eqns=eqns)

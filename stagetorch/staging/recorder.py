"""The recorder: each ATen call on fake tensors staged as an equation.

:class:`Recorder` holds the mutable state of one trace (``jit``'s) or of one lazy session's recording. For
each call it runs the fake kernel, or answers from :mod:`stagetorch.staging.meta_cache`; believes the op's
registered rules where the meta kernel differs from the real one (its output strides, a shape rule that
refuses the operands or stands in for a missing kernel) and makes fresh outputs tensors of their own; lifts
the real tensors it meets to constant inputs; and, in a trace that tracks host-known values
(:mod:`stagetorch.staging.host_reads`), reads a value on the host where an op needs one.

What it must not know: how a function runs under it (the dispatch mode, the state swapped for fakes: the
tracer's and the lazy session's), or what a step does to ``.grad``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.utils._python_dispatch import _disable_current_modes

from ..errors import ConcretizationError, ShapeError, StagingError, UnsupportedOpError
from ..ir import Aval, Eqn, SourceInfo, Var, iter_vars, op_name
from ..registry import NO_TENSOR, slot
from ..utils.tree import flatten, map_leaves
from .host_reads import HostTrace, mask_positions
from .messages import concretization_message, host_read_message, shape_message, unsupported_message
from .meta_cache import META_CACHE, from_entry, meta_key, remember
from .source import code_line, source_info

__all__ = ["Recorder", "is_leaf", "no_grad_read_warning"]


@contextlib.contextmanager
def no_grad_read_warning() -> Iterator[None]:
    """Describing a non-leaf (an argument computed before the call, a detached view of one), torch's meta
    converter reads its .grad, and warns about that read: the read is torch's, not the user's."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The .grad attribute of a Tensor that is not a leaf", UserWarning)
        yield


def _grad_of_another_shape(t: torch.Tensor) -> bool:
    """Whether leaf ``t`` holds a ``.grad`` whose shape is not its own (its ``.data`` was replaced since)."""
    grad = t.grad
    return grad is not None and grad.shape != t.shape


def is_leaf(t: torch.Tensor) -> bool:
    """``t.is_leaf``; False for a view made under no_grad whose base was changed in place since, whose
    autograd metadata torch refuses to read (a weight a replayed lazy step transposed, recorded again after
    ``optimizer.step()``): its value is still a value, and is lifted as one."""
    try:
        return t.is_leaf
    except RuntimeError:
        return False


class Recorder:
    """The mutable state of one trace. Every fake tensor it sees is kept alive, so ids stay unique.

    ``jit``'s trace and each ``lazy`` session that records use one: :meth:`record` stages one ATen call on
    fake tensors into ``eqns``, lifting the real tensors it meets to constant inputs (``consts``, with the
    input each became in ``const_vars``); :meth:`var` is the variable of a fake tensor it made."""

    def __init__(self, fake_mode: FakeTensorMode):
        self.fake_mode = fake_mode
        self.var_of: dict[int, Var] = {}
        self.storage_owner: dict[int, Var] = {}
        self.keep: list[torch.Tensor] = []
        self.eqns: list[Eqn] = []
        self.invars: list[Var] = []
        self.roles: list[str] = []
        self.names: list[str] = []
        self.fakes: list[torch.Tensor] = []
        self.consts: list[torch.Tensor] = []
        self.lifted: dict[int, torch.Tensor] = {}
        self.const_vars: dict[int, Var] = {}  # id of a lifted real tensor -> the input it became
        self.grad_leaks: list[tuple[torch.Tensor, Any, SourceInfo]] = []
        self.module_names: dict[int, str] = {}
        self.module_stack: list[str] = []
        # Host-known values and the reads of them (jit's traces; a lazy session reads values for real instead).
        self.host: HostTrace | None = None

    def new_var(self, t: torch.Tensor) -> Var:
        untyped = t.untyped_storage()
        storage = untyped._cdata
        owner = self.storage_owner.get(storage)
        if owner is None:
            v = Var(Aval.of(t), storage_nbytes=untyped.nbytes(), strides=t.stride())
            self.storage_owner[storage] = v
        else:
            v = Var(Aval.of(t), base=owner, strides=t.stride())
        self.var_of[id(t)] = v
        self.keep.append(t)
        return v

    def add_input(self, fake: torch.Tensor, role: str, name: str) -> Var:
        # from_tensor copies a real .grad onto the fake; the staged program starts from none and the
        # executor accumulates into the real .grad as autograd would.
        fake.grad = None
        v = self.new_var(fake)
        self.invars.append(v)
        self.roles.append(role)
        self.names.append(name)
        self.fakes.append(fake)
        return v

    def lift(self, t: torch.Tensor) -> torch.Tensor:
        """A real tensor reached an op: make it a constant input of the graph."""
        if isinstance(t, FakeTensor):
            return t
        fake = self.lifted.get(id(t))
        if fake is None:
            # A non-leaf (a weight transposed eagerly, in lazy mode) is lifted as the value it is.
            leaf = is_leaf(t)
            source = t if leaf else t.detach()
            with self.fake_mode, no_grad_read_warning():
                try:
                    fake = self.fake_mode.from_tensor(source, static_shapes=True)
                except (AssertionError, RuntimeError) as e:
                    # torch's meta converter rejects some views whose base has a .grad (a transposed
                    # weight after a first backward), and a leaf whose .grad has another shape than it now
                    # has (``p.data = torch.randn(new_shape)`` with the old .grad held, which eager allows:
                    # autograd adds the new gradient into it, broadcasting, or raises there); a fresh fake
                    # with the same layout stands in for it.
                    if isinstance(e, RuntimeError) and not (leaf and _grad_of_another_shape(t)):
                        raise
                    fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
            self.lifted[id(t)] = fake
            self.consts.append(t)
            self.const_vars[id(t)] = self.add_input(fake, "const", f"const{len(self.consts) - 1}")
            if self.host is not None:
                self.host.seed_const(self.const_vars[id(t)], t)
            if t.requires_grad and leaf:
                self.grad_leaks.append((t, t.grad, source_info()))
        return fake

    def constant(self, fake: torch.Tensor) -> torch.Tensor | None:
        """The real tensor behind ``fake`` when the function built it from Python data (``torch.tensor([1,
        3])``, lifted as a constant) and has not changed it in place since; else None."""
        v = self.var_of.get(id(fake))
        if v is None or fake._version != 0:
            return None
        made = next((e for e in reversed(self.eqns) if v in e.outvars), None)
        if made is None or made.prim is not torch.ops.aten.lift_fresh.default:
            return None
        source = made.args[0]
        return next((t for t in self.consts if self.const_vars[id(t)] is source), None)

    def var(self, t: torch.Tensor) -> Var:
        v = self.var_of.get(id(t))
        if v is None:
            raise StagingError(
                f"stagetorch met a fake tensor {Aval.of(t)} that no recorded op produced; "
                "this is a bug in stagetorch, please report it with the code that triggered it"
            )
        return v

    def current_module(self) -> str:
        return self.module_stack[-1] if self.module_stack else ""

    def _bind(self, tree: Any) -> tuple[Any, Any]:
        """(the tree with real tensors lifted to fakes, the tree with Vars for tensors), in one pass."""
        if isinstance(tree, torch.Tensor):
            fake = self.lift(tree)
            return fake, self.var(fake)
        if isinstance(tree, (list, tuple)):
            if not tree:
                return tree, tree
            pairs = [self._bind(x) for x in tree]
            kind = type(tree)
            return kind(p[0] for p in pairs), kind(p[1] for p in pairs)
        return tree, tree

    def record(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict, src: SourceInfo | None = None) -> Any:
        if func in _LENGTH_LISTS and self.host is not None:
            # (jit's traces only: a lazy session replays a recording with the constants among a call's own
            # arguments, which these are not)
            func, args, kwargs = _lengths_as_tensors(func, args, kwargs)
        args, in_args = self._bind(args)
        if kwargs:
            bound = {k: self._bind(v) for k, v in kwargs.items()}
            kwargs, in_kwargs = {k: b[0] for k, b in bound.items()}, {k: b[1] for k, b in bound.items()}
        else:
            in_kwargs = {}
        if src is None:
            node = torch._C._current_autograd_node()
            src = source_info(self.current_module(), node.name() if node is not None else "")
        key = meta_key(func, args, kwargs)
        entry = META_CACHE.get(key) if key is not None else None
        if entry is not None:
            out = from_entry(entry, args, self.fake_mode)
        else:
            try:
                out = self._dispatch(func, args, kwargs, src, self.fake_mode)
            except ConcretizationError:
                if self.host is None:
                    raise
                return self._read_on_host(func, args, kwargs, in_args, in_kwargs, src)
            _check_rule(func, args, kwargs, src)
            out = _relayout(func, args, kwargs, out, self.fake_mode)
            out = _unshared(func, out, self.fake_mode)
            if key is not None:
                remember(key, func, args, out)
        flat = flatten(out)
        if any(isinstance(t, torch.Tensor) and t.layout != torch.strided for t in flat):
            raise UnsupportedOpError(
                f"{op_name(func)} at {src} returns a {next(t.layout for t in flat if isinstance(t, torch.Tensor) and t.layout != torch.strided)} "
                f"tensor; stagetorch stages dense (strided) tensors only.{code_line(src)}\nWhat to do: keep "
                "sparse work outside the staged function, or convert with .to_dense() before it."
            )
        outvars = tuple(self.new_var(t) if isinstance(t, torch.Tensor) else None for t in flat)
        eqn = Eqn(func, in_args, in_kwargs, outvars, src)
        self.eqns.append(eqn)
        if self.host is not None:
            self.host.note(eqn)
        return out

    def _read_on_host(self, func: Any, args: tuple, kwargs: dict, in_args: tuple, in_kwargs: dict, src: SourceInfo) -> Any:
        """An op that needs a value (``.item()``, ``nonzero``, ``x[mask]``) in a trace that tracks host-known
        values (see :mod:`stagetorch.staging.host_reads`): run for real where its inputs are host-known, its outcome a read
        the program is chosen by; else a ConcretizationError naming the line."""
        host = self.host
        assert host is not None
        ins = list(iter_vars((in_args, in_kwargs)))
        masks = _host_masks(func, in_args, host)
        if masks is not None:
            # x[mask] over a host-known mask: x[positions], the positions found on the host and fed as inputs.
            mask_vars = tuple(in_args[1][d] for d in masks)
            positions = host.call(Eqn(mask_positions, mask_vars, {}, (), src))
            fakes = [self.lift(t) for t in positions]
            host.shaped(Eqn(mask_positions, mask_vars, {}, tuple(self.var(f) for f in fakes), src), positions, src)
            indices, it = [], iter(fakes)
            for d, index in enumerate(args[1]):
                if d in masks:
                    indices += [next(it) for _ in range(index.ndim)]
                else:
                    indices.append(index)
            return self.record(func, (args[0], indices, *args[2:]), kwargs, src)
        if host.is_known(ins):
            real = host.call(Eqn(func, in_args, in_kwargs, (), src))
            if not any(isinstance(t, torch.Tensor) for t in flatten(real)):
                host.read(Eqn(func, in_args, in_kwargs, (None,), src), real, src)
                return real
            # A shape made from data (nonzero, unique): the whole batch's value, fed to the program as an input.
            out = map_leaves(real, torch.Tensor, self.lift)
            outvars = tuple(self.var(t) if isinstance(t, torch.Tensor) else None for t in flatten(out))
            host.shaped(Eqn(func, in_args, in_kwargs, outvars, src), real, src)
            return out
        if func in _MASKABLE and len(in_args) > 1 and (masks := [
                t for t in in_args[1] if isinstance(t, Var) and t.aval.dtype in (torch.bool, torch.uint8)]):
            # x[mask]: only the masks' values size the result, whatever ``x`` was computed from (issue 43)
            ins = masks
        depends_on = self._depends_on([v for v in ins if not host.is_known([v])])
        known = [v for v in ins if host.is_known([v])]
        if known and (names := _operand_names(func, in_args, in_kwargs)):
            # An op whose output's shape follows from some of its operands' values (CTC's from its lengths):
            # those are known at call time, but the op cannot run on the host without the others.
            unknown = [names[v] for v in ins if v in names and v not in known]
            depends_on = (
                f"{depends_on} through its operand(s) {', '.join(unknown)} (its operand(s) "
                f"{', '.join(names[v] for v in known if v in names)} are known at call time, but stagetorch has no "
                "rule that sizes its output from them alone)"
            )
        raise ConcretizationError(host_read_message(func, src, depends_on))

    def _depends_on(self, needed: list[Var]) -> str:
        """What values ``needed`` follow from that the host does not know: the inputs they were computed from
        (through their makers and every write into their storage) that are not host-known, by role and name;
        and draws from a generator of their own."""
        host = self.host
        assert host is not None
        inputs = dict(zip(self.invars, zip(self.roles, self.names)))
        by_root: dict[Var, list[Eqn]] = {}
        for e in self.eqns:
            for v in e.outvars:
                if v is not None:
                    by_root.setdefault(v.root, []).append(e)
        found: dict[str, list[Var]] = {}
        draws: list[str] = []
        seen: set[Var] = set()
        todo = [v for v in needed if not host.is_known([v])]
        while todo:
            root = todo.pop().root
            if root in seen:
                continue
            seen.add(root)
            if root in inputs and not host.is_known([root]):
                found.setdefault(inputs[root][0], []).append(root)
            for e in by_root.get(root, ()):
                if not e.invars and torch.Tag.nondeterministic_seeded in getattr(e.prim, "tags", ()):
                    draws.append(str(e.source))
                todo.extend(v for v in e.invars if not host.is_known([v]) or v.root in host.tainted)
        kinds = {"param": "parameter", "arg": "argument", "buffer": "buffer", "const": "tensor captured by the step"}
        order = {v: i for i, v in enumerate(self.invars)}
        parts = []
        for role in sorted(found, key=lambda r: min(order[v] for v in found[r])):
            names = [inputs[v][1] for v in sorted(found[role], key=order.__getitem__)]
            kind = kinds.get(role, role)
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            parts.append(f"the {kind}s {shown}" if len(names) > 1 else f"the {kind} {shown}")
            grad = [self.fakes[order[v]].requires_grad for v in found[role]]
            if role in ("arg", "const") and all(grad):
                parts[-1] += " (which requires grad)" if len(names) == 1 else " (which require grad)"
            elif role in ("const", "buffer") and not any(grad):
                # (a global or attribute needing no gradient: the program is staged once, its value may change)
                parts[-1] += (" (read from outside the step, not passed in: its value may change between calls; "
                              "pass it as an argument to read it on the host)")
        parts += [f"a draw from a generator of its own at {d}" for d in dict.fromkeys(draws)]
        return " and on ".join(parts) if parts else "the parameters or on activations"

    @staticmethod
    def _dispatch(func: Any, args: tuple, kwargs: dict, src: SourceInfo, mode: FakeTensorMode) -> Any:
        """Run the fake kernel; its failures become stagetorch's named errors, except where an explicit
        shape rule accepts what the meta kernel refuses (``_grouped_mm``'s meta kernel wants bfloat16, its CPU
        kernel runs float32): the rule speaks for the kernel, as it does in the shape interpreter."""
        try:
            return func(*args, **kwargs)
        except StagingError:
            raise
        except (DataDependentOutputException, DynamicOutputShapeException) as e:
            # An explicit shape rule that sizes the output from the operands' shapes alone (CTC's alignment
            # table, as wide as its padded targets allow) speaks for a kernel whose size follows from data.
            out = _from_rule(func, args, kwargs, mode)
            if out is not None:
                return out
            raise ConcretizationError(concretization_message(func, src)) from e
        except UnsupportedOperatorException as e:
            out = _from_rule(func, args, kwargs, mode)
            if out is not None:
                return out
            raise UnsupportedOpError(unsupported_message(func, src)) from e
        except (RuntimeError, ValueError, IndexError, TypeError) as e:
            out = _from_rule(func, args, kwargs, mode)
            if out is not None:
                return out
            if "fake" in str(e).lower() and ("impl" in str(e).lower() or "kernel" in str(e).lower()):
                raise UnsupportedOpError(unsupported_message(func, src, str(e))) from e
            raise ShapeError(shape_message(func, args, kwargs, src, _rule_says(func, args, kwargs) or e)) from e


def _operand_names(func: Any, args: tuple, kwargs: dict) -> dict[Var, str]:
    """The schema's name of each tensor operand of ``func`` (``log_probs``, ``input_lengths``)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return {}
    names: dict[Var, str] = {}
    for i, a in enumerate(schema.arguments):
        x = args[i] if i < len(args) else kwargs.get(a.name)
        for v in iter_vars(x):
            names.setdefault(v, a.name)
    return names


def _relayout(func: Any, args: tuple, kwargs: dict, out: Any, mode: FakeTensorMode) -> Any:
    """``out`` as the real kernel returns it, where the op's layout rule says its meta kernel's strides
    differ, or that the kernel returns no tensor (see :mod:`stagetorch.ops.layout_rules`). Done before the
    metadata cache remembers the call."""
    rule = slot(func, "layout")
    if rule is None:
        return out
    strides = rule(*args, **kwargs)
    if not strides:
        return out
    single = isinstance(out, torch.Tensor)
    outs = [out] if single else list(out)
    for k, (t, stride) in enumerate(zip(outs, strides)):
        if stride is NO_TENSOR:
            outs[k] = None
        elif stride is not None and type(t) is FakeTensor and tuple(stride) != t.stride():
            with torch._C._DisableTorchDispatch():
                empty = torch.empty_strided(t.shape, stride, dtype=t.dtype, device="meta")
            outs[k] = FakeTensor(mode, empty, t.fake_device)
    return outs[0] if single else type(out)(outs)


def _unshared(func: Any, out: Any, mode: FakeTensorMode) -> Any:
    """``out`` with each output that its schema declares fresh made a tensor of its own where the fake kernel
    returned one tensor twice. The meta kernel of ``mkldnn_rnn_layer_backward`` returns its bias gradient as
    both biases' gradients; the CPU kernel returns two tensors, and so does FakeTensorMode once its dispatch
    cache is warm: the trace would otherwise depend on that cache. Done before the metadata cache remembers
    the call."""
    schema = getattr(func, "_schema", None)
    if not isinstance(out, tuple) or schema is None or any(r.alias_info is not None for r in schema.returns):
        return out
    seen: set[int] = set()
    outs = list(out)
    for k, t in enumerate(outs):
        if type(t) is not FakeTensor:
            continue
        storage = t.untyped_storage()._cdata
        if storage in seen:
            with torch._C._DisableTorchDispatch():
                empty = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            outs[k] = FakeTensor(mode, empty, t.fake_device)
        else:
            seen.add(storage)
    return type(out)(outs)


def _from_rule(func: Any, args: tuple, kwargs: dict, mode: FakeTensorMode) -> Any:
    """Fresh contiguous fakes of the avals the op's explicit shape rule gives for these operands; None where
    it has no rule, the rule refuses them, or the op returns other than tensors."""
    rule = slot(func, "shape")
    schema = getattr(func, "_schema", None)
    if rule is None or schema is None or not all(isinstance(r.type, torch.TensorType) for r in schema.returns):
        return None
    abstract = map_leaves((args, kwargs), torch.Tensor, Aval.of)
    try:
        avals = rule(*abstract[0], **abstract[1])
    except Exception:  # noqa: BLE001 - the kernel's own error is the one to report
        return None
    single = isinstance(avals, Aval)
    outs = [avals] if single else list(avals)
    if len(outs) != len(schema.returns) or not all(isinstance(a, Aval) for a in outs):
        return None
    fakes = []
    for a in outs:
        with torch._C._DisableTorchDispatch():
            empty = torch.empty(a.shape, dtype=a.dtype, device="meta")
        fakes.append(FakeTensor(mode, empty, a.device))
    return fakes[0] if single else tuple(fakes)


def _check_rule(func: Any, args: tuple, kwargs: dict, src: SourceInfo) -> None:
    """Some meta kernels accept what the real kernel refuses (relu of a bool tensor). An explicit shape
    rule that refuses the call is believed, so the error comes at trace time with the user's line rather
    than from the kernel mid-run. Checked when the fake kernel runs: once per signature, as the metadata
    cache answers repeats."""
    reason = _rule_says(func, args, kwargs)
    if reason is not None:
        raise ShapeError(shape_message(func, args, kwargs, src, reason))


def _rule_says(func: Any, args: tuple, kwargs: dict) -> str | None:
    """The explicit shape rule's account of why these operands fail, when the op has one: it names the op
    and the shapes more plainly than most kernels do."""
    rule = slot(func, "shape")
    if rule is None:
        return None
    abstract = map_leaves((args, kwargs), torch.Tensor, Aval.of)
    try:
        rule(*abstract[0], **abstract[1])
    except ShapeError as e:
        return str(e)
    except Exception:  # the rule has nothing clearer to say than the kernel
        return None
    return None


# CTC's kernels given their lengths as Python lists -> the overload that takes them as tensors, and the
# positions of the lengths. As tensors they are constants of the trace, which a chunk of the batch is cut
# from (a chunk cannot be given its share of a list: stagetorch.ops.losses, ctc_loss_batch_rule); the
# kernels compute the same (the tensor overloads read the lengths back as lists).
_LENGTH_LISTS = {
    torch.ops.aten._ctc_loss.default: (torch.ops.aten._ctc_loss.Tensor, (2, 3)),
    torch.ops.aten._ctc_loss_backward.default: (torch.ops.aten._ctc_loss_backward.Tensor, (3, 4)),
}


def _lengths_as_tensors(func: Any, args: tuple, kwargs: dict) -> tuple[Any, tuple, dict]:
    overload, positions = _LENGTH_LISTS[func]
    if kwargs or any(not isinstance(args[i], (list, tuple)) for i in positions if i < len(args)):
        return func, args, kwargs
    with _disable_current_modes():  # real tensors, lifted as constants
        args = tuple(torch.tensor(a, dtype=torch.long) if i in positions else a for i, a in enumerate(args))
    return overload, args, kwargs


_MASKABLE = frozenset({
    torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default,
    torch.ops.aten._unsafe_index.Tensor,
})


def _host_masks(func: Any, in_args: tuple, host: HostTrace) -> list[int] | None:
    """The positions of the boolean indices of an advanced index (``x[mask]``, ``x[mask] = v``) when they are
    all host-known, else None."""
    if func not in _MASKABLE or len(in_args) < 2:
        return None
    indices = in_args[1]
    masks = [d for d, t in enumerate(indices) if isinstance(t, Var) and t.aval.dtype in (torch.bool, torch.uint8)]
    if masks and host.is_known([indices[d] for d in masks]):
        return masks
    return None

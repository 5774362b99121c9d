"""The tracer: runs a function on fake tensors under a dispatch mode and records the ATen calls as a Graph.

It stages forward *and* backward: autograd emits its backward ATen calls through the same mode. It knows
the IR and the errors; it knows nothing about memory, batching or execution.

Real state is never touched. The parameters and buffers of every module the function refers to (a global,
a closure variable, ``self``, an argument) are swapped for fake copies for the duration of the trace, so
autograd accumulates into fake ``.grad`` and in-place buffer updates land on fakes. Real tensors that reach
an op anyway are lifted into the graph as constants.

Its parts are apart: the state is found by :mod:`stagetorch.staging.state`, each call is staged by the
:class:`~stagetorch.staging.recorder.Recorder`, and what the step does to each ``.grad`` is settled by
:mod:`stagetorch.staging.grads`. Here: the trace itself, its dispatch modes, and the optimizers it stages.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import torch
import torch.nn.modules.module as _module_globals
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import ConcretizationError, UnsupportedOpError
from ..ir import Aval, Graph, Literal, SourceInfo, Var
from ..utils import collector
from .grads import lay_out_as_parameters, one_grad_each, settle_grads, steal_accumulated_grads
from .host_reads import HostProgram, HostTrace
from .messages import reads_data_message
from .recorder import Recorder, is_leaf, no_grad_read_warning
from .source import code_line, is_user_code, source_info
from .state import State, arg_names, discover, held_values, join_name

__all__ = ["trace", "Traced", "leaf_names", "staging_device"]


class _StagingMode(TorchDispatchMode):
    def __init__(self, recorder: Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func is _PRIM_DEVICE:  # x.device, thousands of times a trace
            fake_device = getattr(args[0], "fake_device", None)
            return fake_device if fake_device is not None else func(*args)
        if func.namespace == "prim":
            return func(*args, **(kwargs or {}))
        return self.recorder.record(func, args, kwargs or {})


_PRIM_DEVICE = torch.ops.prim.device.default

# What torch says when a kernel reads the data of a fake tensor, which has none.
_NO_DATA = "its data is not allocated yet"


class _ReadsData(Exception):
    """A composite kernel read a tensor's data in C++, where no dispatch mode sees it: ``trace`` runs the
    function again under :class:`_ReadConstants`."""


_SPLITS = frozenset({torch.tensor_split, torch.Tensor.tensor_split})
_CTC = frozenset({torch.nn.functional.ctc_loss, torch.ctc_loss})


def _ctc_length_tensors(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """CTC's lengths given as Python lists, as the tensors eager's ``mean`` builds from them in C++ (which reads
    a tensor's data): built here from the same Python data, constants of the trace, the same losses."""
    args = list(args)
    for i, name in ((2, "input_lengths"), (3, "target_lengths")):
        if i < len(args) and isinstance(args[i], (list, tuple)):
            args[i] = torch.tensor(args[i], dtype=torch.long)
        elif isinstance(kwargs.get(name), (list, tuple)):
            kwargs = {**kwargs, name: torch.tensor(kwargs[name], dtype=torch.long)}
    return tuple(args), kwargs


class _ReadConstants(TorchFunctionMode):
    """The torch-level calls of a trace, watched for a composite kernel that reads a tensor argument's
    data in C++ (below the staging mode, which never sees the read). The split points of
    ``torch.tensor_split`` given as a tensor the function built from Python data (``torch.tensor([1,
    3])``) are read from the constant the recorder lifted, as eager reads them; any other such read is a
    ConcretizationError at the user's line. Only a trace that met such a read runs under it: it costs
    every torch call of the trace a Python call."""

    def __init__(self, recorder: Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func in _SPLITS:
            args, kwargs = self._split_points(func, args, kwargs)
        elif func in _CTC:
            args, kwargs = _ctc_length_tensors(args, kwargs)
        try:
            return func(*args, **kwargs)
        except RuntimeError as e:
            if _NO_DATA not in str(e):
                raise
            raise ConcretizationError(reads_data_message(func, source_info())) from e

    def _split_points(self, func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``args``, ``kwargs`` with split points given as a constant tensor replaced by its Python value."""
        key = next((k for k in ("tensor_indices_or_sections", "indices", "sections") if k in kwargs), None)
        points = args[1] if len(args) > 1 else kwargs.get(key)
        if not isinstance(points, torch.Tensor):
            return args, kwargs
        real = self.recorder.constant(points)
        if real is None:
            raise ConcretizationError(reads_data_message(func, source_info()))
        value = real.tolist()
        if len(args) > 1:
            return (args[0], value, *args[2:]), kwargs
        kwargs = {k: x for k, x in kwargs.items() if k != key}
        kwargs["indices" if isinstance(value, list) else "sections"] = value
        return args, kwargs


# What a fake tensor's autograd graph says when a backward reaches it: the fake of a real non-leaf (a
# tensor computed from parameters before the call) has a placeholder graph that raises this.
_THROUGH_INPUT = "Tried to backward() through example input"


def _through_input_message(e: RuntimeError, leaves: list, names: list[str], state: State) -> str:
    tensors = [*zip(names, leaves), *((name, t) for name, t in state.tensors)]
    outside = [name for name, t in tensors if isinstance(t, torch.Tensor) and t.requires_grad and not is_leaf(t)]
    tb, frame = e.__traceback__, None
    while tb is not None:
        if is_user_code(tb.tb_frame.f_code):
            frame = tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next
    where = code = ""
    if frame is not None:
        where = f" at {frame[0].f_code.co_filename}:{frame[1]}"
        code = code_line(SourceInfo(frame[0].f_code.co_filename, frame[1]))
    return (
        f"the backward{where} reaches {', '.join(outside) or 'a tensor'}, which requires grad and was computed "
        "outside the staged function: its autograd graph is eager's, which the staged backward cannot follow."
        f"{code}\nWhat to do: compute it inside the staged function (from its parameters), or pass it "
        "detached (x.detach()) if its gradient is not wanted."
    )


@attrs.define
class Traced:
    """A graph and what the caller needs to run it again.

    ``consts`` are the real tensors it captured (its last inputs). ``grad_params`` are the inputs whose
    ``.grad`` is an input, in order, after the state (zeros where it is None, which then become its
    ``.grad``); ``assign_grads`` the inputs whose ``.grad`` the step replaces (rather than adds to),
    ``clear_grads`` those it sets to None. ``state_outs`` are (optimizer, parameter, key) for the outputs
    after the function's own: optimizer state the step created.
    """

    graph: Graph
    consts: list[torch.Tensor]
    grad_params: list[int] = attrs.field(factory=list)
    assign_grads: list[int] = attrs.field(factory=list)
    clear_grads: list[int] = attrs.field(factory=list)
    state_outs: list[tuple] = attrs.field(factory=list)
    # The values it read on the host, and what computes them again for a call (see stagetorch.staging.host_reads).
    host: HostProgram | None = None


# A trace allocates many small objects that all stay alive until it ends: the cyclic collector's passes
# over them found nothing and cost a quarter of a deep model's trace.
@collector.paused()
def trace(
    fn: Callable,
    args: Sequence,
    kwargs: dict,
    *,
    static_argnums: Sequence[int] = (),
    state: State | None = None,
    device: torch.device | None = None,
) -> Traced:
    """Stage ``fn(*args, **kwargs)`` into a Graph. Real tensors are left exactly as they were.

    An argument given as an :class:`~stagetorch.Aval` stands for a contiguous tensor of that aval.
    ``device`` (a CUDA device): stage as if every tensor argument, parameter and buffer lived there, whatever
    device it is on (the host's, ``meta``): see :func:`staging_device`.
    """
    state = discover(fn, args, kwargs) if state is None else state
    try:
        return _trace(fn, args, kwargs, static_argnums, state, watch=False, device=device)
    except _ReadsData:
        return _trace(fn, args, kwargs, static_argnums, state, watch=True, device=device)


def staging_device(device: torch.device) -> torch.device:
    """The device a step staged for ``device`` (CUDA) is traced on: ``device`` itself, as fake CUDA tensors,
    where this torch can run autograd on them (a GPU is present: its device guard); else the host's CPU, whose
    values the graph then labels ``device`` (:func:`_relabel`). A CPU-only torch has no CUDA device guard,
    and its autograd aborts the process on the first fake CUDA tensor that requires grad."""
    if device.type == "cuda" and torch.cuda.is_available():
        return device
    return torch.device("cpu")


def _fake_on(fake_mode: FakeTensorMode, t: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """A fake of ``t`` (same shape, strides, dtype, requires_grad) on ``device`` (None: on ``t``'s own)."""
    if device is None or t.device == device:
        return fake_mode.from_tensor(t, static_shapes=True)
    meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta", requires_grad=t.requires_grad)
    return fake_mode.fake_tensor_converter.from_meta_and_device(fake_mode, meta, device)


def _relabel(graph: Graph, host: torch.device, device: torch.device) -> None:
    """Label every value ``graph`` holds on ``host`` as living on ``device`` (a step staged for a CUDA
    device on the host's CPU: see :func:`staging_device`)."""
    for v in graph.vars():
        if v.aval.device == host:
            v.aval = Aval(v.aval.shape, v.aval.dtype, device)


def _trace(
    fn: Callable, args: Sequence, kwargs: dict, static_argnums: Sequence[int], state: State, watch: bool,
    device: torch.device | None = None,
) -> Traced:
    """One trace; with ``watch``, under :class:`_ReadConstants`; with ``device``, every tensor staged as if there."""
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    on = None if device is None else staging_device(device)
    made: dict[int, torch.Tensor] = {}  # id(real) -> its fake on ``on`` (a tensor met twice is one fake)

    def fake_of(t: torch.Tensor) -> torch.Tensor:
        if on is None:
            return fake_mode.from_tensor(t, static_shapes=True)
        if id(t) not in made:
            made[id(t)] = _fake_on(fake_mode, t, on)
        return made[id(t)]
    rec = Recorder(fake_mode)
    rec.host = HostTrace()
    static = set(static_argnums)

    leaves, tree = pytree.tree_flatten((tuple(args), kwargs))
    names = leaf_names(fn, args, kwargs)
    leaves = held_values(leaves, lambda: names)
    arg_is_static = _static_mask(args, kwargs, static)
    fake_leaves = []
    n_tensors = 0  # the position of each tensor argument among the call's (what a host read of it reads)
    for leaf, name, is_static in zip(leaves, names, arg_is_static):
        if isinstance(leaf, torch.Tensor) and not is_static and leaf.layout != torch.strided:
            raise UnsupportedOpError(
                f"argument {name} is a {leaf.layout} tensor; stagetorch stages dense (strided) tensors only. "
                "Pass x.to_dense(), or keep sparse work outside the staged function."
            )
        if isinstance(leaf, torch.Tensor) and not is_static:
            with fake_mode, no_grad_read_warning():
                fake = fake_of(leaf)
            rec.host.seed_arg(rec.add_input(fake, "arg", name), n_tensors, leaf)
            n_tensors += 1
            fake_leaves.append(fake)
        elif isinstance(leaf, Aval):
            # An argument known by its aval only (a process group's global batch): laid out as its strides
            # say (the rank's shard's layout), else contiguous.
            strides = getattr(leaf, "strides", ())
            with fake_mode:
                if strides:
                    fake = torch.empty_strided(leaf.shape, strides, dtype=leaf.dtype, device=leaf.device)
                else:
                    fake = torch.empty(leaf.shape, dtype=leaf.dtype, device=leaf.device)
            rec.add_input(fake, "arg", name)
            n_tensors += 1
            fake_leaves.append(fake)
        else:
            fake_leaves.append(leaf)

    swapped: dict[int, torch.Tensor] = {}
    with_grad: list[tuple[int, str, torch.Tensor]] = []
    for role, name, t in state.named_state():
        with fake_mode:
            fake = fake_of(t)
        swapped[id(t)] = fake
        if t.requires_grad and t.is_leaf:
            # A hook on a parameter (``p.register_hook(lambda g: g * 3)``) changes the gradient autograd
            # accumulates: the fake the trace differentiates carries it too, so its math is staged.
            for hook in (t._backward_hooks or {}).values():
                fake.register_hook(hook)
            for hook in (t._post_accumulate_grad_hooks or {}).values():
                fake.register_post_accumulate_grad_hook(hook)
        rec.add_input(fake, role, name)
        if t.requires_grad and t.is_leaf:
            with_grad.append((len(rec.invars) - 1, name, t))
    # Every .grad is an input, so a step that reads .grad (clip_grad_norm_) sees the gradient accumulated
    # so far plus this call's, as in eager (the caller feeds zeros where .grad is None: 0 + g is g, to the
    # bit). settle_grads drops each one the step only adds to, so a plain step's program is unchanged.
    grad_inputs: dict[int, Var] = {}
    for i, name, t in with_grad:
        with fake_mode:
            fake_grad = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=on or t.device)
        grad_inputs[i] = rec.add_input(fake_grad, "grad", f"{name}.grad")
        rec.fakes[i].grad = fake_grad
    for prefix, m in state.modules:
        for sub_name, sub in m.named_modules(remove_duplicate=False):
            rec.module_names.setdefault(id(sub), join_name(prefix, sub_name) or type(sub).__name__)

    optimizers = [_TracedOptimizer(opt, swapped) for _, opt in state.optimizers]
    restore = _swap(state, swapped)
    # A torch.compile'd module warns when global module hooks exist (they fire again for its wrapper):
    # where they are only the tracer's own (module paths for source info), the warning is not the user's.
    own_hooks_only = not _module_globals._has_any_global_hook()
    hooks = _module_hooks(rec)
    # FakeTensorMode logs every kernel failure at ERROR level; stagetorch raises its own named error instead.
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    log_level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    try:
        fake_args, fake_kwargs = pytree.tree_unflatten(fake_leaves, tree)
        with (
            fake_mode, _StagingMode(rec), _ReadConstants(rec) if watch else contextlib.nullcontext(),
            warnings.catch_warnings() if own_hooks_only else contextlib.nullcontext(),
        ):
            if own_hooks_only:
                warnings.filterwarnings("ignore", _COMPILED_MODULE_HOOKS, UserWarning)
            try:
                out = fn(*fake_args, **fake_kwargs)
            except RuntimeError as e:
                if _THROUGH_INPUT in str(e):
                    raise UnsupportedOpError(_through_input_message(e, leaves, names, state)) from e
                if watch or _NO_DATA not in str(e):
                    raise
                raise _ReadsData from e
        out_leaves, out_tree = pytree.tree_flatten(out)
        with fake_mode:
            out_leaves = [rec.lift(x) if isinstance(x, torch.Tensor) else x for x in out_leaves]
        outvars = [rec.var(x) if isinstance(x, torch.Tensor) else Literal(x) for x in out_leaves]
        state_outs = []
        for opt in optimizers:
            for target, x in opt.created():
                state_outs.append(target)
                outvars.append(rec.var(rec.lift(x)) if isinstance(x, torch.Tensor) else Literal(x))
        # An input computed before the call (a non-leaf) has no .grad to accumulate into, as in eager.
        final = {
            i: None if fake.grad is None else rec.var(fake.grad)
            for i, fake in enumerate(rec.fakes) if fake.requires_grad and fake.is_leaf
        }
    finally:
        rec.host.finish()
        fake_log.setLevel(log_level)
        for h in hooks:
            h.remove()
        for opt in optimizers:
            opt.restore()
        restore()
        leaks = rec.grad_leaks
        for t, old_grad, _ in leaks:
            t.grad = old_grad
    if leaks:
        t, _, src = leaks[0]
        raise UnsupportedOpError(
            f"a tensor that requires grad ({Aval.of(t)}, first used at {src}) is not reachable from the "
            f"function's globals, closure, self or arguments, so stagetorch cannot stage its gradient."
            f"{code_line(src)}\nRefer to its module directly in the function (a global or closure "
            "variable, an attribute of self, or an argument)."
        )
    eqns, grads, assign, clear, unused = settle_grads(rec.eqns, final, grad_inputs, outvars)
    strides = {rec.var_of[id(t)]: t.stride() for t in rec.keep if id(t) in rec.var_of}
    eqns, grads = steal_accumulated_grads(eqns, grads, outvars, strides)
    eqns, grads = lay_out_as_parameters(eqns, grads, strides, rec.fakes)
    eqns, grads = one_grad_each(eqns, grads)
    keep = [i for i, v in enumerate(rec.invars) if v not in unused]
    index = {old: new for new, old in enumerate(keep)}
    graph = Graph(
        [rec.invars[i] for i in keep], eqns, outvars, [rec.roles[i] for i in keep], [rec.names[i] for i in keep],
        [(index[i], g) for i, g in grads], out_tree,
    )
    if on is not None and on != device:
        _relabel(graph, on, device)
    return Traced(
        graph, rec.consts,
        grad_params=[index[i] for i, v in grad_inputs.items() if v not in unused],
        assign_grads=[index[i] for i in assign], clear_grads=[index[i] for i in clear], state_outs=state_outs,
        host=rec.host.program(),
    )


class _TracedOptimizer:
    """An optimizer pointed at the fakes for a trace: its parameters (through the swap) and its state,
    re-keyed by the fake parameters, each state tensor the fake the trace made for it. A first step's
    state, created during the trace, becomes outputs the caller installs after each run."""

    def __init__(self, opt: torch.optim.Optimizer, fakes: dict[int, torch.Tensor]):
        self.opt, self.real_state = opt, opt.state
        self.pairs = [(p, fakes[id(p)]) for group in opt.param_groups for p in group["params"]]
        self.state: collections.defaultdict = collections.defaultdict(dict)
        self.inputs: set[int] = set()
        for p, fake in self.pairs:
            if p in self.real_state:
                entries = {k: fakes.get(id(x), x) if isinstance(x, torch.Tensor) else x for k, x in self.real_state[p].items()}
                self.state[fake] = entries
                self.inputs.update(id(x) for x in entries.values())
        opt.state = self.state
        self.undo_step = _stage_optimizer_step(opt)

    def created(self) -> Iterator[tuple[tuple, Any]]:
        """((optimizer, real parameter, key), value) for each state entry the trace created or rebound."""
        for p, fake in self.pairs:
            for k, x in self.state.get(fake, {}).items():
                if id(x) not in self.inputs:
                    yield (self.opt, p, k), x

    def restore(self) -> None:
        self.opt.state = self.real_state
        self.undo_step()


def _stage_optimizer_step(opt: torch.optim.Optimizer) -> Callable[[], None]:
    """Make ``opt.step`` stageable for the trace; return the undo.

    Adam-like optimizers read their step count with ``.item()`` unless ``capturable``; their capturable
    formulation keeps it a tensor, so the trace runs that (its device check, which only guards CUDA graph
    capture, is skipped as torch.compile skips it). An optimizer without such a mode cannot be staged."""
    # An LR scheduler wraps ``opt.step`` as an instance attribute; it is put back as it was.
    own = vars(opt).get("step")

    def undo() -> None:
        if own is None:
            vars(opt).pop("step", None)
        else:
            opt.step = own

    if "capturable" not in opt.defaults and not isinstance(opt, _STAGEABLE_OPTIMIZERS):
        def refuse(*args: Any, **kwargs: Any) -> Any:
            src = source_info()
            raise UnsupportedOpError(
                f"{type(opt).__name__}.step at {src} cannot be staged: it reads its state as Python numbers."
                f"{code_line(src)}\nCall the optimizer outside the staged function: loss = step(x, y); "
                "opt.step(); opt.zero_grad()."
            )

        opt.step = refuse
        return undo
    if "capturable" not in opt.defaults:
        return lambda: None
    original = opt.step

    def capturable_step(*args: Any, **kwargs: Any) -> Any:
        flags = [g.get("capturable") for g in opt.param_groups]
        is_compiling = torch.compiler.is_compiling
        for g in opt.param_groups:
            g["capturable"] = True
        torch.compiler.is_compiling = lambda: True
        try:
            return original(*args, **kwargs)
        finally:
            torch.compiler.is_compiling = is_compiling
            for g, flag in zip(opt.param_groups, flags):
                g["capturable"] = flag

    opt.step = capturable_step
    return undo


_STAGEABLE_OPTIMIZERS = (torch.optim.SGD,)


def _swap(state: State, fakes: dict[int, torch.Tensor]) -> Callable[[], None]:
    """Point every module slot and every discovered reference at the fakes; return the undo."""
    undo: list[Callable[[], None]] = []
    for _, root in state.modules:
        for m in root.modules():
            for table in (m._parameters, m._buffers):
                for name, t in list(table.items()):
                    if t is not None and id(t) in fakes:
                        table[name] = fakes[id(t)]
                        undo.append(functools.partial(table.__setitem__, name, t))
    for (_, t), setters in zip(state.tensors, state.setters):
        for set_ref in setters:
            set_ref(fakes[id(t)])
            undo.append(functools.partial(set_ref, t))

    def restore() -> None:
        for u in reversed(undo):
            u()

    return restore


# The start of the warning torch.compile's OptimizedModule gives when any global module hook exists.
_COMPILED_MODULE_HOOKS = r"Using `torch\.compile\(module\)` when there are global hooks on modules"


def _module_hooks(rec: Recorder) -> list[Any]:
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    def push(module: torch.nn.Module, args: Any) -> None:
        rec.module_stack.append(rec.module_names.get(id(module), type(module).__name__))

    def pop(module: torch.nn.Module, args: Any, out: Any) -> None:
        if rec.module_stack:
            rec.module_stack.pop()

    return [register_module_forward_pre_hook(push), register_module_forward_hook(pop, always_call=True)]


def leaf_names(fn: Callable, args: Sequence, kwargs: dict) -> list[str]:
    names = arg_names(fn, len(args))
    out = []
    for i, a in enumerate(args):
        out += _named_leaves(names[i], a)
    for k, a in kwargs.items():
        out += _named_leaves(k, a)
    return out


def _named_leaves(name: str, tree: Any) -> list[str]:
    paths, _ = pytree.tree_flatten_with_path(tree)
    return [name + pytree.keystr(path) for path, _ in paths]


def _static_mask(args: Sequence, kwargs: dict, static: set[int]) -> list[bool]:
    mask = []
    for i, a in enumerate(args):
        mask += [i in static] * len(pytree.tree_leaves(a))
    for a in kwargs.values():
        mask += [False] * len(pytree.tree_leaves(a))
    return mask

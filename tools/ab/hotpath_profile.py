"""A/B: what each part of a staged (and a one-line) call costs, in microseconds per call. Last run: 2026-11-26.

What each part of a staged call costs, in microseconds per call (issue 27).

Run from the repository root: ``python tools/ab/hotpath_profile.py`` (``--runs 3 --alternations 400``
for the interleaved ratios as well, ``--lazy`` for the one-line mode's ratios, ``--lazy-parts`` for what each
part of a warm one-line step costs).

Each part of ``Staged.__call__`` is run on its own, as a warm call runs it, in blocks of ``--block`` calls; a
part's cost is the least block mean of thread CPU time (the machine is shared: the least is what the part
costs when nothing else runs; give --threads 1 so that torch's kernels run in the timed thread). "whole call, no kernels" is ``staged(x, y)`` with the compiled program replaced by one that
returns the outputs of a real run: everything a call does but the ATen kernels. The parts of
``Staged._stage`` below it are the ones the tree has (``discover`` and ``tensors_and_key`` run on every call
before issue 27, on a guard miss only after it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import _paths  # noqa: F401  (tools/_paths.py: the tree and tests/support on sys.path)
import attrs
import bench_step
import models
import torch
import torch.utils._pytree as pytree

import stagetorch
from stagetorch.interpreters import eager as execute
from stagetorch.interpreters.eager import _NOTHING
from stagetorch.runtime import staged as staged_module

try:
    from stagetorch.staging import guards
except ImportError:  # the tree before issue 27
    guards = None
from stagetorch.staging.state import discover, held_values

CASES = {case: bench_step.CASES[case] for case in ("seed_mlp_b256", "encoder_b32", "ln_mlp_b256")}


def per_call(f, block: int, blocks: int) -> float:
    """The least mean of ``blocks`` blocks of ``block`` calls of ``f``, in microseconds of this thread's CPU
    time (a shared machine preempts it; torch runs in this thread at --threads 1)."""
    best = float("inf")
    for _ in range(blocks):
        t = time.thread_time()
        for _ in range(block):
            f()
        best = min(best, (time.thread_time() - t) / block)
    return best * 1e6


def _old_install(inputs, grads, executable, traced):
    """Staged.__call__'s gradient install before issue 27 (the tree before it has no install_grads)."""
    from stagetorch.runtime.grads import accumulate_grad, grad_to_install

    first = len(inputs) - len(executable.consts) - len(traced.grad_params)
    fed = {i for i in traced.grad_params if inputs[i].grad is None}
    assigned = set(traced.assign_grads)
    grads = [
        (i, grad_to_install(inputs[i], g) if i in assigned or (inputs[i].grad is None and i not in fed) else g)
        for i, g in grads
    ]
    for i, g in zip(traced.grad_params, inputs[first:]):
        if inputs[i].grad is None:
            inputs[i].grad = g
    for i in traced.assign_grads:
        inputs[i].grad = None
    for i, g in grads:
        accumulate_grad(inputs[i], g, fresh=True)
    for i in traced.clear_grads:
        inputs[i].grad = None


def _case(case: str) -> tuple:
    """(model, x, y, its eager training step, that step staged) of a bench case, seeded."""
    torch.manual_seed(0)
    factory, batch = CASES[case]
    model, make = factory()
    x, y = make(batch)
    step = models.train_step(model)
    return model, x, y, step, stagetorch.jit(step)


def parts(case: str, block: int, blocks: int) -> dict[str, float]:
    model, x, y, step, staged = _case(case)
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        staged(x, y)
    args, kwargs = (x, y), {}
    entry, inputs, _ = staged._stage(args, kwargs)
    executable, traced = entry.executable, entry.traced
    program = executable.program
    with torch._C._AutoDispatchBelowAutograd():
        env = program._run(inputs, _NOTHING)
    grads = [(i, env[s]) for i, s in program.grad_slots]
    real_run = program._run
    walk = getattr(staged, "_walk", None)  # the guarded state walk (issue 27)
    flatten = getattr(guards, "flatten_args", None) if guards else None
    flatten = flatten or (lambda a, k: pytree.tree_flatten((a, k)))
    install = getattr(execute, "install_grads", None)
    out: dict[str, float] = {}

    def zero():
        model.zero_grad(set_to_none=True)

    def call():
        model.zero_grad(set_to_none=True)
        staged(x, y)

    def full_walk():
        state = discover(step, args, kwargs)
        return state.tensors_and_key()

    def key_lookup():
        leaves = [x, y]
        key = (tree, staged_module._signature(leaves, set(), None), state_key, None, torch.is_grad_enabled())
        return staged._cache.get(key)

    def install_after_zero():
        model.zero_grad(set_to_none=True)
        if install is not None:
            first = len(inputs) - len(executable.consts) - len(traced.grad_params)
            install(inputs, grads, inputs[first:], traced.grad_params, traced.assign_grads, traced.clear_grads)
        else:
            _old_install(inputs, grads, executable, traced)

    tree = flatten(args, kwargs)[1]
    state_key = full_walk()[1]
    budget = staged._budget(executable)
    plan = executable.plan(budget)
    program._run = lambda inputs, undo: env  # everything but the kernels
    try:
        t = {
            "whole call, no kernels": call,
            "zero_grad (eager pays it too)": zero,
            "Staged._stage": lambda: staged._stage(args, kwargs),
            "flatten the arguments + held_values": lambda: held_values(flatten(args, kwargs)[0], lambda: []),
            "the state walk as a call makes it": (lambda: walk.walk(step, args, kwargs, [x, y])) if walk else full_walk,
            "discover + tensors_and_key (a full walk)": full_walk,
            "_signature + cache lookup": key_lookup,
            "Staged._step_plan": lambda: staged._step_plan(entry, inputs),
            "Staged._held": lambda: staged._held(entry, inputs),
            "free_memory": lambda: staged._budget(executable),
            "Executable.plan": lambda: executable.plan(budget),
            "attrs.evolve of the plan": lambda: attrs.evolve(plan, held_bytes=0, budget_bytes=budget),
            "Executable.run, no kernels": lambda: executable.run(inputs, plan),
            "install .grad (zero_grad included)": install_after_zero,
        }
        for name, f in t.items():
            out[name] = per_call(f, block, blocks)
    finally:
        program._run = real_run
    out["install .grad"] = out.pop("install .grad (zero_grad included)") - out["zero_grad (eager pays it too)"]
    if walk is not None:  # what a call pays where something changed: the full walk and a new guard
        def missed():
            walk.forget()
            walk.walk(step, args, kwargs, [x, y])

        out["a guard miss: full walk + new guard"] = per_call(missed, block, blocks)

    def eager():
        model.zero_grad(set_to_none=True)
        step(x, y)

    out["eager step (zero_grad included)"] = per_call(eager, max(block // 20, 5), blocks)
    out["staged step (zero_grad included)"] = per_call(call, max(block // 20, 5), blocks)
    return out


def lazy_parts(batch: int, steps: int, blocks: int) -> dict[str, tuple[float, float]]:
    """What each part of a warm one-line step (bench/bench_lazy.py's seed MLP step) costs: (thread CPU us,
    wall us) per step, each the least mean over ``blocks`` blocks of ``steps`` steps (the least: what the part
    costs when nothing else runs). The parts are timed inside whole steps (a lazy step's parts cannot run
    alone: each moves its session on), by timers around them whose own cost is taken off. "no kernels": the
    flush's staged program replaced by one that hands back a real run's outputs."""
    import copy

    from stagetorch.lazymode import session as session_module
    from stagetorch.runtime import executable as executable_module

    torch.manual_seed(0)
    model, make = models.seed_mlp()
    x, y = make(batch)
    eager_model = copy.deepcopy(model)
    loss_fn = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    eager_optimizer = torch.optim.SGD(eager_model.parameters(), lr=0.01)
    cpu: dict[str, int] = {}
    wall: dict[str, int] = {}
    clock_cpu, clock_wall = time.thread_time_ns, time.perf_counter_ns

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            c, w = clock_cpu(), clock_wall()
            try:
                return fn(*args, **kwargs)
            finally:
                cpu[name] = cpu.get(name, 0) + clock_cpu() - c
                wall[name] = wall.get(name, 0) + clock_wall() - w

        return wrapper

    def part(name, fn, *args):
        return timed(name, fn)(*args)

    def lazy_step():
        inputs, labels = part("lazy(x, y)", stagetorch.lazy, x, y)
        part("zero_grad", optimizer.zero_grad)
        loss = part("forward (4 guarded calls, loss included)", lambda: loss_fn(model(inputs), labels))
        part("backward", loss.backward)
        part("optimizer.step (its flush hook included)", optimizer.step)

    def eager_step():
        part("eager: zero_grad", eager_optimizer.zero_grad)
        loss = part("eager: forward", lambda: loss_fn(eager_model(x), y))
        part("eager: backward", loss.backward)
        part("eager: optimizer.step", eager_optimizer.step)

    def overhead():  # one timer around nothing: what each timer adds, taken off every part
        part("(timer)", lambda: None)

    run = executable_module.Executable.run
    flush = session_module._Session.flush
    backward = session_module._Session.backward
    out: dict[str, tuple[float, float]] = {}
    kernels: dict = {}

    def no_kernels(self, *args, **kwargs):  # a real run's outputs, once per executable
        if id(self) not in kernels:
            kernels[id(self)] = run(self, *args, **kwargs)
        return kernels[id(self)]

    try:
        session_module._Session.flush = timed("flush (the program included)", flush)
        session_module._Session.backward = timed("session.backward (the flush included)", backward)
        for mode in ("kernels", "no kernels"):
            executable_module.Executable.run = timed("the staged program (Executable.run)", no_kernels if mode == "no kernels" else run)
            for _ in range(20):
                lazy_step()
                eager_step()
            best: dict[str, tuple[float, float]] = {}
            for _ in range(blocks):
                cpu.clear()
                wall.clear()
                c, w = clock_cpu(), clock_wall()
                for _ in range(steps):
                    lazy_step()
                cpu["whole lazy step"], wall["whole lazy step"] = clock_cpu() - c, clock_wall() - w
                c, w = clock_cpu(), clock_wall()
                for _ in range(steps):
                    eager_step()
                cpu["whole eager step"], wall["whole eager step"] = clock_cpu() - c, clock_wall() - w
                for _ in range(steps):
                    overhead()
                timer = cpu.pop("(timer)") / steps, wall.pop("(timer)") / steps
                for name in cpu:  # each part is timed once per step; a whole step has no timer around it
                    c_us = (cpu[name] / steps - (0 if name.startswith("whole") else timer[0])) / 1e3
                    w_us = (wall[name] / steps - (0 if name.startswith("whole") else timer[1])) / 1e3
                    old = best.get(name, (float("inf"), float("inf")))
                    best[name] = (min(old[0], c_us), min(old[1], w_us))
            for name, v in best.items():
                out[f"{name}" if mode == "kernels" else f"{name}, no kernels"] = v
    finally:
        executable_module.Executable.run = run
        session_module._Session.flush = flush
        session_module._Session.backward = backward
    return out


def interleaved(case: str, alternations: int, clock=time.perf_counter) -> tuple[float, float]:
    """Medians of eager and staged steps run alternately (as bench/bench_step.py's test_interleaved_ratio),
    timed by ``clock`` (``time.thread_time`` for CPU time: robust to a shared machine's preemption where
    torch runs in the one thread)."""
    model, x, y, step, staged = _case(case)
    for _ in range(20):
        for run in (step, staged):
            model.zero_grad(set_to_none=True)
            run(x, y)
    times: dict[str, list[float]] = {"eager": [], "staged": []}
    for _ in range(alternations):
        for name, run in (("eager", step), ("staged", staged)):
            model.zero_grad(set_to_none=True)
            t = clock()
            run(x, y)
            times[name].append(clock() - t)
    return statistics.median(times["eager"]), statistics.median(times["staged"])


def lazy_interleaved(batch: int, alternations: int, clock=time.perf_counter) -> tuple[float, float]:
    """bench/bench_lazy.py's test_interleaved_ratio (seed MLP, SGD, one-line mode), timed by ``clock``."""
    import copy

    from bench_lazy import seed_step

    torch.manual_seed(0)
    model, make = models.seed_mlp()
    x, y = make(batch)
    eager, lazy = seed_step(model, x, y, "eager"), seed_step(copy.deepcopy(model), x, y, "lazy")
    for _ in range(20):
        eager()
        lazy()
    times: dict[str, list[float]] = {"eager": [], "lazy": []}
    for _ in range(alternations):
        for name, step in (("eager", eager), ("lazy", lazy)):
            t = clock()
            step()
            times[name].append(clock() - t)
    return statistics.median(times["eager"]), statistics.median(times["lazy"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", nargs="*", default=list(CASES))
    p.add_argument("--block", type=int, default=200)
    p.add_argument("--blocks", type=int, default=7)
    p.add_argument("--runs", type=int, default=0, help="interleaved ratio runs per case (0: none)")
    p.add_argument("--alternations", type=int, default=400)
    p.add_argument("--no-parts", action="store_true")
    p.add_argument("--lazy", action="store_true", help="the one-line mode's ratios too (batch 8 and 256)")
    p.add_argument("--threads", type=int, default=2, help="torch's intra-op threads (the bench steps use 2)")
    p.add_argument("--lazy-parts", nargs="*", type=int, default=None, help="the parts of a warm one-line step, at these batch sizes")
    p.add_argument("--cpu", action="store_true", help="time the interleaved steps in thread CPU time (with --threads 1)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if a.lazy_parts is not None:
        batches = a.lazy_parts or [8, 256]
        table = {b: lazy_parts(b, a.block, a.blocks) for b in batches}
        print("| part of a one-line step (us per step: thread CPU / wall) | " + " | ".join(f"batch {b}" for b in batches) + " |")
        print("|---|" + "---|" * len(batches))
        for row in table[batches[0]]:
            print(f"| {row} | " + " | ".join(f"{table[b][row][0]:.1f} / {table[b][row][1]:.1f}" for b in batches) + " |")
        return
    if not a.no_parts:
        table = {case: parts(case, a.block, a.blocks) for case in a.cases}
        rows = list(next(iter(table.values())))
        print("| part (us per call) | " + " | ".join(a.cases) + " |")
        print("|---|" + "---|" * len(a.cases))
        for row in rows:
            print(f"| {row} | " + " | ".join(f"{table[c][row]:.1f}" for c in a.cases) + " |")
    for case in a.cases:
        for _ in range(a.runs):
            e, s = interleaved(case, a.alternations, time.thread_time if a.cpu else time.perf_counter)
            clock = "cpu" if a.cpu else "wall"
            print(f"{case}: eager {e * 1e6:.0f} us, staged {s * 1e6:.0f} us ({clock}), staged / eager {s / e:.3f}")
    if a.lazy:
        for batch in (8, 256):
            for _ in range(max(a.runs, 1)):
                e, z = lazy_interleaved(batch, a.alternations, time.thread_time if a.cpu else time.perf_counter)
                clock = "cpu" if a.cpu else "wall"
                print(f"lazy batch {batch}: eager {e * 1e6:.0f} us, lazy {z * 1e6:.0f} us ({clock}), lazy / eager {z / e:.3f}")


if __name__ == "__main__":
    main()

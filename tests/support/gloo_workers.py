"""Run a test module's distributed cases on spawned gloo processes, once per module: every process runs
every case in turn and sends back each result, which the tests read by (case, rank).

A case is a module-level function of the test module (so that a spawned process finds it by name) that
returns a dict; one that raises reports ``{"crash": "Error: message"}`` instead, and :func:`result` fails the
test with it. A rank that never reports (hung, killed) fails its tests by name rather than the whole run.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["spawn", "result"]


def _worker(rank: int, world: int, store: str, results: mp.Queue, cases: dict[str, Callable[[int], dict]],
            names: list[str], argument: str, collective_timeout: float, timed: bool, barrier: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=collective_timeout))
    try:
        for name in names:
            try:
                start = time.perf_counter()
                out = cases[name](rank if argument == "rank" else world)
                if timed:
                    out["seconds"] = time.perf_counter() - start
            except Exception as e:  # reported to the test, which fails with it
                out = {"crash": f"{type(e).__name__}: {e}"}
            results.put((name, rank, out))
        if barrier:
            dist.barrier()  # without it one rank may leave while another still waits in gloo (an abort at exit)
    finally:
        dist.destroy_process_group()


def spawn(store: str, world: int, cases: dict[str, Callable[[int], dict]], names: list[str] | None = None, *,
          argument: str = "rank", collective_timeout: float = 20, result_timeout: float = 120, timed: bool = False,
          barrier: bool = False) -> dict:
    """Run ``cases`` (those ``names``, default all, in order) on ``world`` spawned gloo processes that meet at
    the file ``store``; each case gets the process's rank (``argument="rank"``) or the world size
    (``"world"``). **Returns** {(case, rank): its dict}, without the cases a rank never reported (waited for
    ``result_timeout`` seconds each). ``timed``: each result gets the case's ``seconds``. ``barrier``: the
    processes meet once more after the last case before leaving the group."""
    if argument not in ("rank", "world"):
        raise ValueError(f"argument must be 'rank' or 'world', not {argument!r}")
    names = list(cases) if names is None else names
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(r, world, store, results, cases, names, argument, collective_timeout,
                                          timed, barrier))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out = {}
    try:
        while len(out) < world * len(names):
            name, rank, value = results.get(timeout=result_timeout)
            out[name, rank] = value
    except queue.Empty:
        pass
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return out


def result(ranks: dict, name: str, rank: int) -> dict:
    """What ``rank`` returned for case ``name``; the test fails where it never reported or crashed."""
    if (name, rank) not in ranks:
        pytest.fail(f"rank {rank} never reported case {name} (hung or died)")
    value = ranks[name, rank]
    if "crash" in value:
        pytest.fail(f"rank {rank}, case {name}: {value['crash']}")
    return value

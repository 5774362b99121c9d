"""Grid: oneDNN convolution weight-gradient workspaces, the rule against the allocator. Last run: 2026-11-29.

oneDNN convolution weight gradients: the workspace rule against the allocator over a random grid (issue 25).

    python tools/grids/conv_weight_grad_grid.py --seed 1 --cases 300 --out /tmp/grid.jsonl

Each case (1-d/2-d/3-d, 1-64 input channels, kernels 1-5, strides 1-3, padding 0-2, groups incl. depthwise,
contiguous or channels-last, 1-3 threads) runs in a worker process; a case that hangs (oneDNN's strided 1x1
backward-weights kernel over channels-last tensors at 3 threads on 2 cores did) is skipped after 90 s. Prints
the rule / allocator distribution for the weight gradient alone (mask F,T,T), with the input gradient (T,T,T),
for the input gradient alone (T,F,F) and for the forward (fwd).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

import _paths  # noqa: F401  (tools/_paths.py: the tree and tests/support on sys.path)


def cases(seed: int, count: int) -> list:
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        nd = rng.choice([1, 2, 2, 3, 3])
        c, o = rng.choice([1, 2, 3, 4, 5, 8, 12, 16, 24, 32, 48, 64]), rng.choice([4, 8, 12, 16, 24, 32, 64])
        k = rng.choice([1, 1, 2, 3, 3, 4, 5])
        p = rng.choice([0, 0, 1, 2]) if k > 1 else rng.choice([0, 0, 0, 1])
        s, g, r = rng.choice([1, 1, 2, 3]), 1, rng.random()
        if r < 0.15 and c % 2 == 0 and o % 2 == 0:
            g = 2
        elif r < 0.25 and c >= 4 and c % 4 == 0 and o % 4 == 0:
            g = 4
        elif r < 0.35 and c >= 2:
            g, o = c, c * rng.choice([1, 1, 2])
        size = {1: rng.choice([20, 40, 64]), 2: rng.choice([6, 8, 12, 17]), 3: rng.choice([4, 6, 8])}[nd]
        if (size + 2 * p - k) // s + 1 <= 0 or p >= k:
            continue
        out.append([(rng.choice([2, 2, 4, 8]), c, size, o, k, g, p, nd, s), rng.choice([1, 2, 3]), nd > 1 and rng.random() < 0.3])
    return out


def _load(path: str):  # noqa: ANN202
    with open(path) as f:
        return json.load(f)


def _lines(path: str) -> list[str]:
    with open(path) as f:
        return f.read().splitlines()


def worker(todo: str, out: str) -> None:
    import torch
    from memtrack import op_workspace
    from test_workspace import _rule

    from stagetorch.ir import Aval
    from stagetorch.ops import conv as rules

    aten = torch.ops.aten
    with open(out, "a") as f:
        for (n, c, size, o, k, g, p, nd, s), threads, cl in _load(todo):
            torch.set_num_threads(threads)
            torch.manual_seed(0)
            x, w = torch.randn(n, c, *[size] * nd), torch.randn(o, c // g, *[k] * nd)
            fmt = {2: torch.channels_last, 3: torch.channels_last_3d}.get(nd)
            x = x.contiguous(memory_format=fmt) if cl else x
            conv = (x, w, torch.randn(o), [s] * nd, [p] * nd, [1] * nd, False, [0] * nd, g)
            go = torch.randn_like(aten.convolution(*conv))
            go = go.contiguous(memory_format=fmt) if cl else go
            lift = (lambda t: (*t.shape[:2], 1, *t.shape[2:])) if nd == 1 else (lambda t: tuple(t.shape))
            onednn = rules._uses_mkldnn(Aval(lift(x), x.dtype, x.device), Aval(lift(w), w.dtype, w.device),
                                        [s] * max(nd, 2), [1] * max(nd, 2), False, g)
            res = {}
            aten.convolution(*conv)  # oneDNN's primitive cache warm
            res["fwd"] = (op_workspace(aten.convolution, *conv), _rule(aten.convolution, *conv))
            for mask in ((False, True, True), (True, True, True), (True, False, False)):
                args = (go, x, w, [o], [s] * nd, [p] * nd, [1] * nd, False, [0] * nd, g, list(mask))
                op_workspace(aten.convolution_backward, *args)  # oneDNN's primitive cache warm
                res["".join("FT"[m] for m in mask)] = (op_workspace(aten.convolution_backward, *args),
                                                       _rule(aten.convolution_backward, *args))
            f.write(json.dumps({"case": [n, c, size, o, k, g, p, nd, s], "threads": threads, "cl": cl, "onednn": onednn,
                                "res": res}) + "\n")
            f.flush()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cases", type=int, default=300)
    ap.add_argument("--out", default="/tmp/conv_weight_grad_grid.jsonl")
    ap.add_argument("--worker", nargs=2)
    a = ap.parse_args()
    if a.worker:
        return worker(*a.worker)
    todo, done = cases(a.seed, a.cases), 0
    with open(a.out, "w"):
        pass
    while done < len(todo):
        with open(a.out + ".todo", "w") as f:
            json.dump(todo[done:], f)
        proc = subprocess.Popen([sys.executable, __file__, "--worker", a.out + ".todo", a.out], stderr=subprocess.DEVNULL)
        seen, last = done, time.time()
        while proc.poll() is None:
            time.sleep(2)
            n = len(_lines(a.out))
            seen, last = (n, time.time()) if n > seen else (seen, last)
            if time.time() - last > 90:
                proc.kill()
                proc.wait()
        done = len(_lines(a.out))
        if done < len(todo):
            print("skipped (hang or crash):", todo[done])
            del todo[done]
    rows = [json.loads(line) for line in _lines(a.out)]
    for mask in ("FTT", "TTT", "TFF", "fwd"):
        for grouped in (False, True):
            r = [row["res"][mask][1] / row["res"][mask][0] for row in rows if mask in row["res"]
                 and row["onednn"] and (row["case"][5] > 1) == grouped and row["res"][mask][0] > 0]
            if not r:
                continue
            print(f"{mask} {'grouped' if grouped else 'groups=1'}: n={len(r)} within 2%={sum(1 <= x <= 1.02 for x in r)} "
                  f"over={sum(x > 1.02 for x in r)} under={sum(x < 1 for x in r)} min={min(r):.3f} "
                  f"median={sorted(r)[len(r) // 2]:.3f} max={max(r):.2f}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    main()

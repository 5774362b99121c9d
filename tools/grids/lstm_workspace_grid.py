"""Grid: oneDNN's CPU LSTM workspaces, the rules against the allocator. Last run: 2026-11-26.

oneDNN's CPU LSTM layer: the workspace rules against the allocator over a random grid (issue 25).

    python tools/grids/lstm_workspace_grid.py --seed 1 --cases 200 --out /tmp/lstm_grid.jsonl

Each case is an ``nn.LSTM`` (input and hidden 8-256, 1-3 layers, bidirectional or not, batch_first or not)
trained on a batch of 1-64 sequences of 1-64 steps, at 1 or 2 threads, from zero initial states or given
ones (two tensors, or one tensor for both), its loss reading the output alone or the final states too. The training step (forward, a sum,
backward) is staged, and every ``mkldnn_rnn_layer`` and ``mkldnn_rnn_layer_backward`` equation of it runs
alone at the allocator (tests/support/memtrack.op_workspace) on tensors laid out as the trace recorded them (a
bidirectional layer's output gradient is a strided slice, the last layer's an expanded one), beside the
workspace rule's answer for it. Prints rule / allocator per op: median, max, within 2%, under.
"""

from __future__ import annotations

import argparse
import json
import os
import random

import _paths  # noqa: F401  (tools/_paths.py: the tree and tests/support on sys.path)


def cases(seed: int, count: int) -> list:
    rng = random.Random(seed)
    sizes = [8, 12, 16, 24, 32, 48, 64, 100, 128, 200, 256]
    out = []
    for _ in range(count):
        out.append({
            "input": rng.choice(sizes), "hidden": rng.choice(sizes), "layers": rng.choice([1, 2, 3]),
            "bidirectional": rng.random() < 0.4, "batch_first": rng.random() < 0.5,
            "batch": rng.choice([1, 2, 3, 4, 8, 16, 32, 64]), "steps": rng.choice([1, 2, 5, 7, 16, 33, 64]),
            "threads": rng.choice([1, 2]), "states": rng.random() < 0.3,
            "initial": rng.choice([None, None, "separate", "shared"]),
        })
    return out


def _real(v, layouts):  # noqa: ANN001, ANN202
    """A random tensor of ``v``'s shape laid out as the trace recorded it (contiguous where unknown; an
    expanded value as a broadcast of one)."""
    import torch

    shape, dtype = v.aval.shape, v.aval.dtype
    strides = layouts(v)
    if strides is None:
        return torch.randn(shape, dtype=dtype)
    if 0 in strides:
        return torch.randn([1 if s == 0 else n for n, s in zip(shape, strides)], dtype=dtype).expand(shape)
    return torch.empty_strided(shape, strides, dtype=dtype).copy_(torch.randn(shape, dtype=dtype))


def measure(case: dict) -> list:
    import torch
    from memtrack import op_workspace

    import stagetorch
    from stagetorch.interpreters.memory import Layouts, workspace
    from stagetorch.ir import Var

    aten = torch.ops.aten
    torch.set_num_threads(case["threads"])
    torch.manual_seed(0)
    model = torch.nn.LSTM(case["input"], case["hidden"], case["layers"], bidirectional=case["bidirectional"],
                          batch_first=case["batch_first"])
    shape = (case["batch"], case["steps"]) if case["batch_first"] else (case["steps"], case["batch"])
    x = torch.randn(*shape, case["input"])
    h0 = torch.randn(case["layers"] * (1 + case["bidirectional"]), case["batch"], case["hidden"])
    c0 = h0 if case["initial"] == "shared" else torch.randn_like(h0)

    def step(x, h0, c0):  # noqa: ANN001, ANN202
        out, (hn, cn) = model(x, None if case["initial"] is None else (h0, c0))
        loss = out.sum() + (hn.sum() + cn.sum() if case["states"] else 0)
        loss.backward()

    graph = stagetorch.make_ir(step)(x, h0, c0)
    layouts = Layouts(graph)
    forward = {}
    rows = []
    for e in graph.eqns:
        if e.prim not in (aten.mkldnn_rnn_layer.default, aten.mkldnn_rnn_layer_backward.default):
            continue
        args = [_real(a, layouts) if isinstance(a, Var) else a for a in e.args]
        hx, cx = e.args[5], e.args[6]
        if isinstance(hx, Var) and isinstance(cx, Var) and hx.root is cx.root:
            args[6] = args[5]  # one storage, as the initial states given as one tensor are
        if e.prim is aten.mkldnn_rnn_layer.default:
            with torch._C._AutoDispatchBelowAutograd():
                forward[e.outvars[3]] = aten.mkldnn_rnn_layer(*args)[3]
        else:
            args[-1] = forward[e.args[-1]]
        op_workspace(e.prim, *args)  # oneDNN's primitive cache warm
        rows.append(["backward" if e.prim is aten.mkldnn_rnn_layer_backward.default else "forward",
                     op_workspace(e.prim, *args), workspace(e, layouts=layouts)])
    return rows


def summary(rows: list) -> None:
    for op in ("forward", "backward"):
        r = sorted(rule / measured for kind, measured, rule in rows if kind == op and measured > 0)
        if r:
            print(f"{op}: n={len(r)} median={r[len(r) // 2]:.4f} max={r[-1]:.4f} min={r[0]:.4f} "
                  f"within 2%={sum(1 <= x <= 1.02 for x in r)} over 2%={sum(x > 1.02 for x in r)} "
                  f"under={sum(x < 1 for x in r)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cases", type=int, default=200)
    ap.add_argument("--out", default="/tmp/lstm_workspace_grid.jsonl")
    a = ap.parse_args()
    rows = []
    with open(a.out, "w") as f:
        for case in cases(a.seed, a.cases):
            got = measure(case)
            rows += got
            f.write(json.dumps({"case": case, "rows": got}) + "\n")
            f.flush()
    summary(rows)


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    main()

"""Grid: the half-precision CPU matmul workspace rule against the allocator. Last run: 2026-11-26.

The half-precision CPU matmul workspace rule (stagetorch/ops/linalg.py) against the allocator, over a grid of
products or random ones (issue 25).

Measure (each product run once below autograd, its allocations beyond its output recorded by
tests/support/memtrack.op_workspace; about 0.1 s a product), writing one JSON row a product:

    python tools/grids/onednn_matmul_grid.py measure --grid --threads 3 > grid3.jsonl
    python tools/grids/onednn_matmul_grid.py measure --random 600 --seed 1 --threads 1 2 3 > random.jsonl
    python tools/grids/onednn_matmul_grid.py measure --random 90 --seed 3 --big --threads 1 2 3 4 8 16 > big.jsonl

Compare the rule (as a staged program's equation sees it, strides included) and the bound it falls back to, per
dtype and thread count: exact / over / under, median and largest ratio to the allocator:

    python tools/grids/onednn_matmul_grid.py check grid3.jsonl random.jsonl big.jsonl

The fallback (issue 25): ``check --fallback`` takes the rule with the replay off (as on another oneDNN
version). Other ISAs run on this CPU by capping oneDNN's (measure and check under the same cap; the rule then
falls back by itself), e.g. bfloat16 on AVX512-BF16 without AMX, on AVX10.1 (AMX off), and on AVX512 without
BF16 (gemm_bf16_matmul):

    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 python tools/grids/onednn_matmul_grid.py measure --random 300 --threads 1 2 3 4 > bf16isa.jsonl
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 python tools/grids/onednn_matmul_grid.py check bf16isa.jsonl
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import math
import random
import statistics
from pathlib import Path

import _paths  # noqa: F401  (tools/_paths.py: the tree and tests/support on sys.path)
import torch

import stagetorch
from stagetorch.interpreters.memory import Layouts, workspace
from stagetorch.ops import linalg

aten = torch.ops.aten
SIZES = [1, 3, 8, 16, 17, 32, 64, 100, 256, 512, 1000]
HIDDEN = [16, 32, 64, 96, 128, 256, 384, 512, 768, 1024, 2048, 3072, 4096]


def _layout(shape: list[int], transposed: bool) -> list[int]:
    if len(shape) == 2:
        return [1, shape[0]] if transposed else [shape[1], 1]
    b, r, c = shape
    return [r * c, 1, r] if transposed else [r * c, c, 1]


def _case(dtype: str, op: str, a_shape: list[int], ta: bool, b_shape: list[int], tb: bool) -> list:
    return [dtype, op, a_shape, _layout(a_shape, ta), b_shape, _layout(b_shape, tb)]


def grid() -> list[list]:
    """mm over M, K, N in SIZES, A and B each plain or transposed (transposed only up to 2^20 multiply-adds)."""
    cases = []
    for dtype in ("bfloat16", "float16"):
        for m, k, n in itertools.product(SIZES, SIZES, SIZES):
            for ta, tb in itertools.product((False, True), repeat=2):
                if (ta or tb) and m * k * n > 64**3 * 4:
                    continue
                cases.append(_case(dtype, "mm", [m, k], ta, [k, n], tb))
    return cases


def random_cases(count: int, seed: int, big: bool) -> list[list]:
    """Linear layers (M tokens, K and N hidden sizes; weight gradients with K tokens), other 2-D products and
    batched ones (attention), up to 2^29 multiply-adds, or 2^33 with ``big``."""
    rng = random.Random(seed)

    def dim(lo: int, hi: int) -> int:
        return round(math.exp(rng.uniform(math.log(lo), math.log(hi))))

    cases: list[list] = []
    while len(cases) < count:
        dtype = rng.choice(["bfloat16", "float16"])
        ta, tb = rng.random() < 0.3, rng.random() < 0.5
        if rng.random() < (0.75 if big else 0.67):
            op = rng.choice(["mm", "addmm"])
            if big:
                m, k, n = dim(256, 16384), rng.choice([*HIDDEN[2:], dim(1000, 16384)]), rng.choice(HIDDEN[2:])
                if rng.random() < 0.3:
                    m, k = k, m
            elif rng.random() < 0.6:
                m, k, n = dim(1, 4096), rng.choice(HIDDEN), rng.choice(HIDDEN)
            else:
                m, k, n = dim(1, 3000), dim(1, 3000), dim(1, 3000)
            if m * k * n > 2 ** (33 if big else 29):
                continue
            cases.append(_case(dtype, op, [m, k], ta, [k, n], tb))
        else:
            op = rng.choice(["bmm", "baddbmm"])
            b, m, k, n = dim(1, 64), dim(1, 512), dim(1, 512), dim(1, 512)
            if big:
                b, m, k, n = dim(4, 256), dim(64, 2048), rng.choice([32, 64, 128, dim(64, 2048)]), dim(64, 2048)
            if b * m * k * n > 2 ** (32 if big else 28):
                continue
            cases.append(_case(dtype, op, [b, m, k], ta, [b, k, n], tb))
    return cases


# The products the fitted fallback bound was under for (issue 25), and larger ones: a Linear's forward, input
# and weight gradients at 2048-8192 tokens, 4096^3.
NAMED = [
    ("mm", 2048, 2048, 512, False, True), ("mm", 4096, 4096, 4096, False, False), ("mm", 4096, 4096, 4096, True, False),
    ("mm", 8192, 4096, 4096, False, True), ("mm", 8192, 4096, 1024, False, False), ("mm", 4096, 8192, 4096, True, False),
    ("addmm", 2048, 4096, 11008, False, True), ("mm", 1024, 8192, 1024, True, False),
]


def named_cases() -> list[list]:
    return [_case(dtype, op, [m, k], ta, [k, n], tb) for dtype in ("bfloat16", "float16")
            for op, m, k, n, ta, tb in NAMED]


def _tensors(case: list) -> tuple:
    dtype, op, a_shape, a_strides, b_shape, b_strides = case
    dt = getattr(torch, dtype)

    def strided(shape: list[int], strides: list[int]) -> torch.Tensor:
        return torch.zeros(1 + sum((s - 1) * t for s, t in zip(shape, strides)), dtype=dt).as_strided(shape, strides)

    a, b = strided(a_shape, a_strides), strided(b_shape, b_strides)
    if op == "addmm":
        return aten.addmm, (torch.zeros(b_shape[-1], dtype=dt), a, b)
    if op == "baddbmm":
        return aten.baddbmm, (torch.zeros(a_shape[0], a_shape[1], b_shape[-1], dtype=dt), a, b)
    return getattr(aten, op), (a, b)


def rule(op: torch._ops.OpOverloadPacket, args: tuple) -> int:
    graph = stagetorch.make_ir(lambda *ts: op(*ts))(*args)
    (eqn,) = [e for e in graph.eqns if e.prim is op.default]
    return workspace(eqn, layouts=Layouts(graph))


def measure(cases: list[list], threads: list[int], dtype: str | None = None) -> None:
    from memtrack import op_workspace

    cases = [c for c in cases if dtype in (None, c[0])]
    for t in threads:
        torch.set_num_threads(t)
        for case in cases:
            op, args = _tensors(case)
            print(json.dumps([*case, t, op_workspace(op, *args)]), flush=True)


def check(files: list[str], fallback: bool = False) -> None:
    if fallback:
        linalg._replay_caches = lambda: None
    rows: dict = collections.defaultdict(list)
    for name in files:
        for line in Path(name).read_text().splitlines():
            *case, t, measured = json.loads(line)
            torch.set_num_threads(t)
            op, args = _tensors(case)
            a, b = (args[1], args[2]) if op in (aten.addmm, aten.baddbmm) else args
            m, k, n = *a.shape[-2:], b.shape[-1]
            count = a.shape[0] if a.dim() == 3 else 1
            bound = 0 if count * m * k * n <= 4096 else linalg._bound(m, k, n, count, t, a.dtype, a.stride(-2) == 1 and a.stride(-1) == m and m > 1 and k > 1)
            rows[(case[0], t)].append((measured, rule(op, args), bound))
    print("dtype     threads products | rule: exact over under  median  max   | bound: under median  max")
    for (dtype, t), found in sorted(rows.items()):
        ratios = [r / w for w, r, _ in found if w] or [math.nan]
        bounds = [b / w for w, _, b in found if w] or [math.nan]
        exact, over = sum(r == w for w, r, _ in found), sum(r > w for w, r, _ in found)
        print(f"{dtype:9} {t:7} {len(found):8} | {exact:11} {over:4} {len(found) - exact - over:5}"
              f"  {statistics.median(ratios):6.3f} {max(ratios):5.3f} | {sum(b < w for w, _, b in found):12}"
              f" {statistics.median(bounds):6.2f} {max(bounds):5.1f}")
    print("(ratios over products the allocator gave a workspace; bound: oneDNN's scratchpad bound alone, without"
          " ATen's copies)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--grid", action="store_true")
    m.add_argument("--random", type=int, default=0)
    m.add_argument("--seed", type=int, default=1)
    m.add_argument("--big", action="store_true")
    m.add_argument("--named", action="store_true", help="the large products of NAMED")
    m.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    m.add_argument("--dtype", choices=["bfloat16", "float16"], help="only the products of this dtype")
    c = sub.add_parser("check")
    c.add_argument("files", nargs="+")
    c.add_argument("--fallback", action="store_true", help="the rule with the replay off")
    args = parser.parse_args()
    if args.mode == "measure":
        measure((grid() if args.grid else []) + (named_cases() if args.named else []) + random_cases(args.random, args.seed, args.big), args.threads, args.dtype)
    else:
        check(args.files, args.fallback)


if __name__ == "__main__":
    main()

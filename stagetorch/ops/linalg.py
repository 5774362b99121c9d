"""Rules for the linalg op family."""

from __future__ import annotations

import functools
from typing import Any

import torch

from .. import _caches, batching, flops
from ..ir import Eqn, Var
from . import _layout, _shape

aten = torch.ops.aten

# Shape rules: op -> rule(*args with Avals, **kwargs) -> Aval | tuple[Aval, ...]
SHAPE: dict = {
    aten.mm: _shape.matmul,
    aten.addmm: _shape.addmm,
    aten.bmm: _shape.bmm,
    aten.t: _shape.transpose_2d,
}


# Batch rules: op -> rule(eqn, label) -> Chunked (see stagetorch/batching.py)
BATCH: dict = {
    aten.mm: batching.contraction("ij,jk->ik"),
    aten.bmm: batching.contraction("bij,bjk->bik"),
    aten.addmm: batching.contraction("ij,jk->ik", bias=True),
    aten.baddbmm: batching.contraction("bij,bjk->bik", bias=True),
    aten.mv: batching.contraction("ij,j->i"),
    aten.dot: batching.contraction("i,i->"),
    aten.addmv: batching.contraction("ij,j->i", bias=True),
    aten.addr: batching.contraction("i,j->ij", bias=True),
    aten.addbmm: batching.contraction("bij,bjk->ik", bias=True),
    aten.vdot: batching.contraction("i,i->"),
    aten.linalg_cross: batching.along(2, default=-1),
    # Linear algebra over the two trailing dims, batched over the leading ones.
    **{op: batching.along(None, last=2) for op in (
        aten.linalg_inv_ex, aten.linalg_cholesky_ex, aten.cholesky, aten._linalg_eigh, aten._linalg_svd,
        aten.linalg_qr, aten.linalg_lu_factor_ex, aten.linalg_lu, aten._linalg_solve_ex,
        aten.linalg_solve_triangular, aten.linalg_matrix_exp, aten.linalg_ldl_factor_ex,
    )},
}


# FLOP rules: op -> rule(eqn) -> int (see stagetorch/flops.py)
FLOPS: dict = {op: flops.matmul_rule for op in (aten.mm, aten.addmm, aten.bmm, aten.baddbmm)}


# -- Workspace: oneDNN's half-precision matmul on the CPU ------------------------------------------------------
#
# On the CPU, a float16 or bfloat16 mm/addmm/bmm/baddbmm over more than 16 * 16 * 16 multiply-adds runs oneDNN's
# brgemm matmul (ATen's ``use_mkldnn_matmul``; below that size, or with oneDNN disabled, ATen's own gemm, which
# allocates nothing). oneDNN books a scratchpad per thread: the blocks of A and B it copies (reordered for its
# kernels, float32 for float16 on AVX512-FP16, VNNI pairs for bfloat16 on AMX), a float32 accumulator block,
# its batch descriptors and AMX tile state. Their sizes come from oneDNN's blocking heuristics, a search over
# blockings that scores thread balance (src/cpu/x64/matmul/brgemm_matmul_utils.cpp,
# amx_blocking_heuristics.cpp); the rule does not replay that search. It bounds each buffer by the size it
# takes at the blocking's limits, fitted to the allocator on torch 2.13 (oneDNN 3.12) on a Sapphire Rapids
# CPU (AMX-BF16, AVX512-FP16, 2 MiB of L2) at 1 and 2 threads, over a grid of 13,000 products and 1,200 random
# ones (bench/RESULTS.md, tests/test_workspace.py): never below the allocator; at the median 2x above it for
# bfloat16, 1.3x for float16 (up to 8x for small products). More threads are taken to book as many buffers
# (measured at 2). Elsewhere (no AMX, no AVX512-FP16) oneDNN runs kernels these limits were not measured on:
# the larger of the two bounds stands for them.


def _ru(x: int, m: int) -> int:
    return -(-x // m) * m


def _f16_thread_bytes(m: int, k: int, n: int, a_transposed: bool, batch: int, threads: int) -> int:
    """AVX512-FP16 brgemm: A copied to float32 in blocks of up to 256 rows and 512 of K (1024 past K 1024),
    rows padded to 16 and by 16 more; B copied to float32, 64 columns wide; a float32 accumulator as wide as
    N's block (up to 64 columns) while one block of K covers K, else as a chunk of up to 1024 columns. A
    weight's gradient (A transposed) over K >= 2048 with fewer 64-column blocks of N than threads splits K
    across threads, each summing the whole M x N in float32 (oneDNN's ``bwd_w_par_k_blk``)."""
    mx = min(m, 256)
    kx = _ru(min(k, 512 if k <= 1024 else 1024), 16)
    acc = 4 * mx * (min(_ru(n, 16), 64) if k <= 512 else min(_ru(n, 64), 1024))
    if batch == 1 and a_transposed and k >= 2048 and threads > -(-n // 64):
        acc = max(acc, 4 * m * n)
    return 4096 + 4 * kx * 64 + 4 * mx * (kx + 16) + acc


def _bf16_amx_thread_bytes(m: int, k: int, n: int, a_transposed: bool) -> int:
    """AMX-BF16 brgemm: B copied in VNNI pairs, K padded to 32, N to 32 (64 past 32, at least 64 for a
    transposed A or a single column), up to the L2 cache's size of it (caps of 1 and 1.5 MiB were each
    missed by a shape); A copied, up to 256 rows in float32 pairs where it is transposed, else up to 64 rows
    (seen where K is not a multiple of 64, and for a batch of 8 over 8 threads); a float32 accumulator of up
    to 256 x 64 for an odd K, of up to 64 x 256 past K 1024 (K in chunks). One row (M = 1) runs as one
    column, A and B swapped. oneDNN sizes its blocks to the L2 cache: at most 0.82 of it was measured per
    thread (a 291 x 2048 by 2048 x 512 product), where these terms grow with K (a weight's gradient over many
    tokens: up to 30x above the allocator); the sum is capped at 1.25 L2."""
    if m == 1:
        m, n = n, 1
    kr = _ru(k, 32)
    nr = _ru(n, 32) if n <= 32 else _ru(n, 64)
    nb = min(max(nr, 64 if (n == 1 or a_transposed) else 0), max(64, _l2() // (2 * kr)))
    mx = min(m, 64)
    a = 4 * (min(m, 256) + 16) * kr if a_transposed else 2 * mx * kr
    c = max(4 * min(m, 256) * min(nr, 64) if k % 2 else 0, 4 * mx * min(nr, 256) if k > 1024 else 0)
    return min(8192 + 2 * kr * nb + a + c, 5 * _l2() // 4)


@functools.cache
def _cpu_capability() -> dict:
    """What the CPU has (ISA extensions, cache sizes) as PyTorch's cpuinfo says; empty where it cannot say."""
    try:
        return dict(torch._C._cpu._get_cpu_capability())
    except (AttributeError, RuntimeError):
        return {}


@functools.cache
def _l2() -> int:
    """The CPU's L2 cache per core (at least 2 MiB: the size the bounds were measured at)."""
    return max(_cpu_capability().get("l2_cache_size") or 0, 2 << 20)


@functools.cache
def _onednn_half(dtype: torch.dtype) -> str | None:
    """Which of the fitted bounds covers oneDNN's matmul for ``dtype`` on this CPU: "amx" (bfloat16 on AMX),
    "avx512" (float16 on AVX512-FP16), "other" (a kernel the bounds were not measured on), None (ATen's gemm)."""
    if dtype not in (torch.float16, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return None
    supported = torch.ops.mkldnn._is_mkldnn_bf16_supported if dtype == torch.bfloat16 else torch.ops.mkldnn._is_mkldnn_fp16_supported
    if not supported():
        return None
    isa = _cpu_capability()
    if dtype == torch.bfloat16 and isa.get("amx_bf16"):
        return "amx"
    if dtype == torch.float16 and isa.get("avx512_fp16") and not isa.get("amx_fp16"):
        return "avx512"
    return "other"


_caches.on_clear(_onednn_half.cache_clear)


def _mkldnn_dense(shape: tuple[int, ...], strides: tuple[int, ...] | None) -> bool:
    """Whether ATen's ``mkldnn_matmul`` takes the operand as it is: contiguous, or its last two dims
    transposed from contiguous (else it copies it contiguous). Unknown strides: copied, the costlier case."""
    if strides is None:
        return False
    t = torch.empty_strided(shape, strides, device="meta")
    if t.is_contiguous():
        return True
    if len(shape) == 2:
        return strides[0] == 1 and strides[1] == shape[0]
    return strides[0] == shape[1] * shape[2] and strides[1] == 1 and strides[2] == shape[1]


def _a_transposed(shape: tuple[int, ...], strides: tuple[int, ...] | None) -> bool:
    """A laid out column-major (a weight's gradient: grad_out.t() @ input), as oneDNN reads it; unknown
    strides count as transposed, the larger bound."""
    if strides is None:
        return True
    m, k = shape[-2:]
    return m > 1 and k > 1 and strides[-2] == 1 and strides[-1] == m


def matmul_workspace(operands: tuple[int, int]):  # noqa: ANN201
    """The workspace rule of a matmul whose A and B are arguments ``operands``: oneDNN's scratchpad for a CPU
    half-precision product (bounded, see above), and the contiguous copy ATen makes of an operand laid out
    otherwise than contiguous or transposed."""

    def rule(e: Eqn, layouts: Any) -> int:
        a, b = (e.args[i] for i in operands)
        if not (isinstance(a, Var) and isinstance(b, Var)) or a.aval.device.type != "cpu":
            return 0
        kernel = _onednn_half(a.aval.dtype)
        if kernel is None or b.aval.dtype != a.aval.dtype or not torch._C._get_mkldnn_enabled():
            return 0
        if e.kwargs.get("alpha", 1) == 0:
            return 0
        (*batch, m, k), n = a.aval.shape, b.aval.shape[-1]
        count = batch[0] if batch else 1
        if count * m * k * n <= 16 * 16 * 16 or not a.aval.nbytes or not b.aval.nbytes:
            return 0
        a_strides, b_strides = _layout.strides_of(a, layouts), _layout.strides_of(b, layouts)
        a_dense, b_dense = _mkldnn_dense(a.aval.shape, a_strides), _mkldnn_dense(b.aval.shape, b_strides)
        copies = (0 if a_dense else a.aval.nbytes) + (0 if b_dense else b.aval.nbytes)
        # Unknown strides: copied and read transposed, each the costlier case.
        transposed = a_strides is None or (a_dense and _a_transposed(a.aval.shape, a_strides))
        threads = torch.get_num_threads()
        if kernel == "amx":
            per_thread = _bf16_amx_thread_bytes(m, k, n, transposed)
        elif kernel == "avx512":
            per_thread = _f16_thread_bytes(m, k, n, transposed, count, threads)
        else:
            per_thread = max(_bf16_amx_thread_bytes(m, k, n, True), _f16_thread_bytes(m, k, n, True, count, threads))
        return copies + threads * per_thread

    rule.reads_layouts = True  # type: ignore[attr-defined]
    return rule


# Workspace rules: op -> rule(eqn, layouts) -> bytes (see stagetorch/costing.py).
WORKSPACE: dict = {
    aten.mm: matmul_workspace((0, 1)),
    aten.bmm: matmul_workspace((0, 1)),
    aten.addmm: matmul_workspace((1, 2)),
    aten.baddbmm: matmul_workspace((1, 2)),
}

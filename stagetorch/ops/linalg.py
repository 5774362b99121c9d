"""Rules for the linalg op family."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch

from ..interpreters import batch_rules, flops, shape_rules
from ..ir import Eqn, Var
from ..utils import caches
from . import layout_rules
from .kernels import onednn_matmul

aten = torch.ops.aten

# Shape rules: op -> rule(*args with Avals, **kwargs) -> Aval | tuple[Aval, ...]
SHAPE: dict = {
    aten.mm: shape_rules.matmul,
    aten.addmm: shape_rules.addmm,
    aten.bmm: shape_rules.bmm,
    aten.t: shape_rules.transpose_2d,
}


def _cdist(backward: bool):
    """``_cdist_forward(x1, x2, p, mode)`` (``[..., P, M]`` against ``[..., R, M]`` -> ``[..., P, R]``) and
    ``_cdist_backward(grad, x1, x2, p, cdist)`` (-> ``[..., P, M]``) as contractions: rows of ``x1`` against
    rows of ``x2`` (a batch there stays per-example in the output), leading dims broadcast; the features ``m``
    combine under a root (refused as the batch dim). The backward sums over the rows of ``x2``: a partial sum
    when they are the examples (the gradient of a shared ``x1`` against per-example rows of ``x2``)."""
    letters = "abcdefgh"

    def rule(eqn: Eqn, label: Any) -> Any:
        out_ndim = eqn.outvars[0].aval.ndim
        lead = letters[: out_ndim - 2]
        positions = (0, 1, 2, 4) if backward else (0, 1)
        bases = ("pr", "pm", "rm", "pr") if backward else ("pm", "rm")
        specs = [
            lead[len(lead) - (eqn.args[i].aval.ndim - 2):] + base if eqn.args[i].aval.ndim > 2 else base
            for i, base in zip(positions, bases)
        ]
        spec = ",".join(specs) + "->" + lead + ("pm" if backward else "pr")
        return batch_rules.contraction(spec, positions=positions, mixes="" if backward else "m")(eqn, label)

    return rule


# Batch rules: op -> rule(eqn, label) -> Chunked (see stagetorch/interpreters/batching.py)
BATCH: dict = {
    aten._cdist_forward: _cdist(backward=False),
    aten._cdist_backward: _cdist(backward=True),
    aten.mm: batch_rules.contraction("ij,jk->ik"),
    aten.bmm: batch_rules.contraction("bij,bjk->bik"),
    aten.addmm: batch_rules.contraction("ij,jk->ik", bias=True),
    aten.baddbmm: batch_rules.contraction("bij,bjk->bik", bias=True),
    aten.mv: batch_rules.contraction("ij,j->i"),
    aten.dot: batch_rules.contraction("i,i->"),
    aten.addmv: batch_rules.contraction("ij,j->i", bias=True),
    aten.addr: batch_rules.contraction("i,j->ij", bias=True),
    aten.addbmm: batch_rules.contraction("bij,bjk->ik", bias=True),
    aten.vdot: batch_rules.contraction("i,i->"),
    aten.linalg_cross: batch_rules.along(2, default=-1),
    # Linear algebra over the two trailing dims, batched over the leading ones.
    **{op: batch_rules.along(None, last=2) for op in (
        aten.linalg_inv_ex, aten.linalg_cholesky_ex, aten.cholesky, aten._linalg_eigh, aten._linalg_svd,
        aten.linalg_qr, aten.linalg_lu_factor_ex, aten.linalg_lu, aten._linalg_solve_ex,
        aten.linalg_solve_triangular, aten.linalg_matrix_exp, aten.linalg_ldl_factor_ex,
    )},
}


# FLOP rules: op -> rule(eqn) -> int (see stagetorch/interpreters/flops.py)
FLOPS: dict = {op: flops.matmul_rule for op in (aten.mm, aten.addmm, aten.bmm, aten.baddbmm)}


# -- Workspace: oneDNN's half-precision matmul on the CPU ------------------------------------------------------
#
# On the CPU, a float16 or bfloat16 mm/addmm/bmm/baddbmm over more than 16 * 16 * 16 multiply-adds runs oneDNN's
# brgemm matmul (ATen's ``use_mkldnn_matmul``; below that size, or with oneDNN disabled, ATen's own gemm, which
# allocates nothing). oneDNN books a scratchpad per thread: the blocks of A and B it copies (reordered for its
# kernels, float32 for float16 on AVX512-FP16, VNNI pairs for bfloat16 on AMX), a float32 accumulator block,
# its batch descriptors and AMX tile state, sized by its blocking search. Where the kernel is one it was checked
# on (bfloat16 on AMX-BF16, float16 on AVX512-FP16, oneDNN 3.12 as torch 2.13 bundles it) and both operands'
# strides are known and dense, the rule replays that search (stagetorch/ops/onednn_matmul.py): the allocator's bytes
# exactly over a grid of 27,000 products at 1-3 threads and 2,300 random ones at 1-16 (docs/history/results-log.md,
# tools/grids/onednn_matmul_grid.py, tests/ops/test_workspace.py), but for K = 1 (an outer product: which of two
# blockings runs depends on oneDNN's primitive cache, the larger is taken) and, with an operand's strides
# unknown, the larger of the ways it may be read. Elsewhere (another ISA, oneDNN's ISA capped by
# ONEDNN_MAX_CPU_ISA, another oneDNN version, 16 threads or more where the AMX search may split K, an operand
# laid out otherwise) the rule falls back to a bound from above over every blocking oneDNN's searches may choose
# (onednn_matmul.bound, derived from oneDNN's sources): never under the allocator on the grids of docs/history/results-log.md
# (section halfsafe), at most a few times over for large products.


@functools.cache
def _cpu_capability() -> dict:
    """What the CPU has (ISA extensions, cache sizes) as PyTorch's cpuinfo says; empty where it cannot say."""
    try:
        return dict(torch._C._cpu._get_cpu_capability())
    except (AttributeError, RuntimeError):
        return {}


@functools.cache
def _l2() -> tuple[int, int]:
    """The per-core L2 bytes, at least and at most, as PyTorch's cpuinfo and Linux's sysfs say (oneDNN reads
    cpuid): the bound sizes the AMX searches' blocks by it. Where neither can say, 256 KiB to 4 MiB."""
    sysfs = _sysfs_caches()
    known = [size for size in (_cpu_capability().get("l2_cache_size") or 0, sysfs[2][0] if sysfs else 0) if size]
    return (min(known), max(known)) if known else (256 << 10, 4 << 20)


caches.on_clear(_l2.cache_clear)


@functools.cache
def _onednn_half(dtype: torch.dtype) -> str | None:
    """Which kernel runs oneDNN's matmul for ``dtype`` on this CPU: "amx" (bfloat16 on AMX-BF16), "avx512"
    (float16 on AVX512-FP16), the two the replay follows; "other" (a kernel it does not follow: another ISA, or
    oneDNN's ISA capped by ``ONEDNN_MAX_CPU_ISA``); None (ATen's gemm)."""
    if dtype not in (torch.float16, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return None
    supported = torch.ops.mkldnn._is_mkldnn_bf16_supported if dtype == torch.bfloat16 else torch.ops.mkldnn._is_mkldnn_fp16_supported
    if not supported():
        return None
    if _max_isa_capped():
        return "other"
    isa = _cpu_capability()
    if dtype == torch.bfloat16 and isa.get("amx_bf16"):
        return "amx"
    if dtype == torch.float16 and isa.get("avx512_fp16") and not isa.get("amx_fp16"):
        return "avx512"
    return "other"


def _isa_cap() -> str | None:
    """The ISA oneDNN is capped at (``ONEDNN_MAX_CPU_ISA``, or its older name ``DNNL_MAX_CPU_ISA``), upper case;
    None where it is not capped (unset, or ALL)."""
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        value = os.environ.get(name, "").strip().upper()
        if value:
            return None if value == "ALL" else value
    return None


def _max_isa_capped() -> bool:
    """Whether oneDNN's ISA is capped: its kernels are then not the ones cpuinfo implies."""
    return _isa_cap() is not None


def _kernel_families(dtype: torch.dtype) -> tuple[bool, bool, bool]:
    """Which of oneDNN's matmul kernels may run a ``dtype`` product here: (an AMX brgemm kernel, any brgemm
    kernel, gemm_bf16_matmul). AMX where the CPU has it for the type and oneDNN's ISA is not capped below it;
    bfloat16's gemm fallback where no brgemm kernel takes bfloat16 (no AVX512-BF16, AMX-BF16 or AVX-NE-CONVERT,
    or the ISA capped below them); float16 below AVX512-FP16 runs oneDNN's reference kernel (no scratchpad).
    Where cpuinfo cannot say, any of them."""
    isa, cap = _cpu_capability(), _isa_cap()
    if not isa:
        return True, True, dtype == torch.bfloat16
    amx = bool(isa.get("amx_bf16" if dtype == torch.bfloat16 else "amx_fp16")) and (cap is None or "AMX" in cap)
    if dtype == torch.float16:
        return amx, cap is None or cap in _F16_BRGEMM_CAPS or cap not in _KNOWN_CAPS, False
    native = any(isa.get(name) for name in ("avx512_bf16", "amx_bf16", "avx_ne_convert"))
    brgemm = native and (cap is None or cap in _BF16_BRGEMM_CAPS or cap not in _KNOWN_CAPS)
    return amx, brgemm, not brgemm or (cap is not None and cap not in _KNOWN_CAPS)


# The ISA caps (oneDNN's names) at which a half-precision brgemm kernel is still allowed, where the CPU has it.
_F16_BRGEMM_CAPS = {
    "AVX2_VNNI_2", "AVX512_CORE_FP16", "AVX10_1_512", "AVX512_CORE_AMX", "AVX10_1_512_AMX", "AVX512_CORE_AMX_FP16",
    "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2",
}
_BF16_BRGEMM_CAPS = _F16_BRGEMM_CAPS | {"AVX512_CORE_BF16"}
_KNOWN_CAPS = _BF16_BRGEMM_CAPS | {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX512_CORE", "AVX512_CORE_VNNI"}


caches.on_clear(_onednn_half.cache_clear)


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


def _transposed(shape: tuple[int, ...], strides: tuple[int, ...] | None) -> bool:
    """An operand laid out column-major (A of a weight's gradient: grad_out.t() @ input), as oneDNN reads it;
    unknown strides count as transposed, the larger bound."""
    if strides is None:
        return True
    m, k = shape[-2:]
    return m > 1 and k > 1 and strides[-2] == 1 and strides[-1] == m


def _bound(m: int, k: int, n: int, count: int, threads: int, dtype: torch.dtype, a_transposed: bool | None) -> int:
    """The bound from above on oneDNN's scratchpad over every blocking it may choose (stagetorch/ops/onednn_matmul.py);
    ``a_transposed``: A read column-major (None: either way). A single row or column counted either way round
    (oneDNN may swap A and B, ATen may transpose the result)."""
    amx, brgemm, gemm = _kernel_families(dtype)
    shapes = {(m, n), (n, m)} if 1 in (m, n) else {(m, n)}
    plain_a = a_transposed is not True or 1 in (m, n)
    return max(onednn_matmul.bound(r, k, c, count, threads, dtype == torch.float16, _l2(), amx, plain_a, brgemm, gemm)
               for r, c in shapes)


@functools.cache
def _replay_caches() -> onednn_matmul.Caches | None:
    """This CPU's per-core L1d and L2 sizes and L2 ways, as oneDNN reads them, where oneDNN is the version the
    replay follows; None where it is not, or where the caches are unknown."""
    if "MKL-DNN v3.12." not in torch.__config__.show():
        return None
    found = _sysfs_caches()
    return onednn_matmul.Caches(found[1][0], *found[2]) if found else None


@functools.cache
def _sysfs_caches() -> dict[int, tuple[int, int]] | None:
    """Per-core L1d and L2 (bytes, ways) as oneDNN reads them (cpuid leaf 4, here through Linux's sysfs); None
    where either is unknown."""
    found = {}
    try:
        for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
            kind, level = (entry / "type").read_text().strip(), int((entry / "level").read_text())
            if kind in ("Data", "Unified") and level in (1, 2):
                size = (entry / "size").read_text().strip()
                sharing = _cpu_count((entry / "shared_cpu_list").read_text().strip())
                nbytes = int(size[:-1]) * {"K": 1 << 10, "M": 1 << 20}[size[-1]] if size[-1] in "KM" else int(size)
                found[level] = (nbytes // sharing, int((entry / "ways_of_associativity").read_text()))
    except (OSError, ValueError, KeyError, ZeroDivisionError):
        return None
    return found if set(found) == {1, 2} else None


def _cpu_count(cpu_list: str) -> int:
    """How many CPUs a sysfs list names ("0", "0-1", "0,4")."""
    count = 0
    for part in cpu_list.split(","):
        first, _, last = part.partition("-")
        count += int(last or first) - int(first) + 1
    return count


caches.on_clear(_replay_caches.cache_clear)
caches.on_clear(_sysfs_caches.cache_clear)


def _replayed(kernel: str, m: int, k: int, n: int, count: int | None, threads: int, a_transposed: bool,
              b_transposed: bool) -> int | None:
    """oneDNN's scratchpad for the product ATen hands it (``count`` products of a bmm, None for an mm), replayed
    (None where the replay does not apply). A 2-D product with one column is computed transposed (ATen's gemm treats the n x 1 result as column-major: one
    row of N = M); oneDNN tags a single row of A as transposed (its strides match both layouts)."""
    caches = _replay_caches()
    if caches is None or kernel not in ("amx", "avx512"):
        return None
    if count is None and n == 1 and m > 1:
        m, n, a_transposed, b_transposed = 1, m, True, not a_transposed
    # With K = 1 both operands' strides fit both layouts, and oneDNN reuses the primitive its cache holds for
    # the first layout seen (a 1000 x 1 by 1 x 1000 bfloat16 product: 69,120 B or 42,240): the larger.
    a_tags = (False, True) if k == 1 else (a_transposed or m == 1,)
    b_tags = (False, True) if k == 1 else (b_transposed,)
    try:
        return max(onednn_matmul.scratchpad(kernel, m, k, n, count or 1, threads, ta, tb, caches)
                   for ta in a_tags for tb in b_tags)
    except NotImplementedError:
        return None


def _read_as(shape: tuple[int, ...], strides: tuple[int, ...] | None, dense: bool) -> tuple[bool, ...]:
    """How oneDNN may read an operand (transposed or not): as it lies where dense; copied contiguous where
    ATen copies it (strides known, laid out otherwise); either way where its strides are unknown."""
    if dense:
        return (_transposed(shape, strides),)
    return (False, True) if strides is None or (len(shape) == 2 and 1 in strides) else (False,)


def matmul_workspace(operands: tuple[int, int]):  # noqa: ANN201
    """The workspace rule of a matmul whose A and B are arguments ``operands``: oneDNN's scratchpad for a CPU
    half-precision product (replayed, or bounded: see above), and the contiguous copy ATen makes of an operand
    laid out otherwise than contiguous or transposed."""

    def rule(e: Eqn, layouts: Any) -> int:
        a, b = (e.args[i] for i in operands)
        if not (isinstance(a, Var) and isinstance(b, Var)) or a.aval.device.type != "cpu":
            return 0
        kernel = _onednn_half(a.aval.dtype)
        if kernel is None or b.aval.dtype != a.aval.dtype or not torch._C._get_mkldnn_enabled():
            return 0
        alpha = e.kwargs.get("alpha", 1)
        if alpha == 0:
            return 0
        (*batch, m, k), n = a.aval.shape, b.aval.shape[-1]
        count = batch[0] if batch else 1
        if count * m * k * n <= 16 * 16 * 16 or not a.aval.nbytes or not b.aval.nbytes:
            return 0
        a_strides, b_strides = layout_rules.strides_of(a, layouts), layout_rules.strides_of(b, layouts)
        a_dense, b_dense = _mkldnn_dense(a.aval.shape, a_strides), _mkldnn_dense(b.aval.shape, b_strides)
        copies = (0 if a_dense else a.aval.nbytes) + (0 if b_dense else b.aval.nbytes)
        threads = torch.get_num_threads()
        # ATen's own float16 gemv takes a row (or a column) against a transposed operand: nothing allocated.
        if (kernel == "avx512" and a_dense and b_dense and not batch and 1 in (m, n) and k > 1 and alpha == 1
                and tuple(a_strides) == (k, 1) and tuple(b_strides) == (1, k)):
            return 0
        a_ways, b_ways = _read_as(a.aval.shape, a_strides, a_dense), _read_as(b.aval.shape, b_strides, b_dense)
        replays = [_replayed(kernel, m, k, n, batch[0] if batch else None, threads, ta, tb)
                   for ta in a_ways for tb in b_ways]
        bound = _bound(m, k, n, count, threads, a.aval.dtype, None if len(a_ways) > 1 else a_ways[0])
        if None in replays:
            return copies + bound
        if not batch and any(s is not None and not d and 1 in s for s, d in ((a_strides, a_dense), (b_strides, b_dense))):
            # A matrix with padded rows (a slice's): ATen's gemm may read it as it lies; not replayed.
            return copies + max(*replays, bound)
        return copies + max(replays)

    rule.reads_layouts = True  # type: ignore[attr-defined]
    return rule


# Workspace rules: op -> rule(eqn, layouts) -> bytes (see stagetorch/interpreters/memory.py).
WORKSPACE: dict = {
    aten.mm: matmul_workspace((0, 1)),
    aten.bmm: matmul_workspace((0, 1)),
    aten.addmm: matmul_workspace((1, 2)),
    aten.baddbmm: matmul_workspace((1, 2)),
}

"""The scratchpad oneDNN's brgemm matmul books for a float16/bfloat16 product on the CPU, by replaying its blocking.

torch 2.13's CPU build runs a half-precision mm/addmm/bmm/baddbmm over 16^3 multiply-adds through oneDNN 3.12
(``brg_matmul``), which books one scratchpad per call: per thread, the blocks of A and B it copies, a float32
accumulator, its batch descriptors and AMX tile buffers, each sized by a blocking search. This module replays that
search (``src/cpu/x64/matmul/brgemm_matmul_utils.cpp``, ``amx_blocking_heuristics.cpp`` and
``src/cpu/x64/brgemm/brgemm_utils.cpp`` at oneDNN 80afa710) for the two kernels it was checked on, byte for byte
against the allocator (docs/history/results-log.md): bfloat16 on AMX (``avx10_1_512_amx``, with its fallback to
``avx10_1_512`` for small shapes) and float16 on AVX512-FP16 (``avx10_1_512``, which converts both operands to
float32). The scores oneDNN compares are float32; they are computed here rounded to float32 at each step, as the
C++ does, since near ties decide between blockings whose buffers differ by megabytes.

Why one module of ~850 lines: it is one search, replayed as oneDNN writes it (the problem, its blockings, their
scores and the buffers of the winner); its parts mean nothing apart, and the file reads beside oneDNN's sources.

Plain ints in, bytes out: it knows nothing of the IR, of ATen's dispatch, or of which CPU it runs on (the caller
passes the cache sizes and says which kernel runs).
"""

from __future__ import annotations

import functools
import struct
from typing import NamedTuple

_F32 = struct.Struct("f")


def _f(x: float) -> float:
    """``x`` rounded to float32 (a double result of +, -, *, / on float32 values rounds to the float32 result)."""
    return _F32.unpack(_F32.pack(x))[0]


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def _rnd_up(a: int, b: int) -> int:
    return -(-a // b) * b


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


class Caches(NamedTuple):
    """The per-core cache geometry oneDNN reads (cpuid leaf 4): L1d bytes, L2 bytes, L2 ways."""

    l1: int
    l2: int
    l2_ways: int


def _book(threads: int, *per_thread: int) -> int:
    """oneDNN's registrar: each buffer booked for all threads, plus 128 B of alignment; empty ones not at all."""
    return sum(threads * size + 128 for size in per_thread if size)


# -- float16 on AVX512-FP16 (and bfloat16 on AVX512 for the shapes AMX turns away) ----------------------------


def _avx512_blocking(m: int, n: int, k: int, batch: int, nthr: int, a_tag_transposed: bool, copy_a: bool,
                     bf16: bool) -> tuple[int, int, int, int, int]:
    """``compute_blocking_heuristic_avx512``: (m_blk, n_chunk_size, nthr_k, n_blk, k_blk), the first blocking of
    least imbalance in the search's order."""
    max_m_blk = min(256, m)
    min_m_blk = min(32, m)
    n_blk = min(64, n)  # B's plain layout fixes the 64-column block: never narrowed to 32
    n_chunks = _div_up(n, n_blk)
    n_chunks_start = min(16 if copy_a else 1, n_chunks)
    k_blk = min(k, 1024 if (k > 1024 and not a_tag_transposed) else 512)
    start_nthr_k = 1
    if nthr > batch * n_chunks:
        min_m_blk = min(m, 16)
        if batch == 1 and a_tag_transposed and (not bf16 or _pow2(k)) and k >= 2048:
            start_nthr_k = min(nthr, 4)

    def disbalance(work: int, block: int) -> float:
        mod = work % block
        return _f((block - mod if work < block else min(block - mod, mod)) / block)

    num_n_blk = n_chunks
    d_k = {t: disbalance(k, t * k_blk) for t in range(1, start_nthr_k + 1)}
    d_m = {}
    best, best_imbalance = None, 1.0
    for nthr_k in range(start_nthr_k, 0, -1):
        cur_nthr = nthr // nthr_k
        alloc = _f((nthr - cur_nthr * nthr_k) / nthr) if cur_nthr * nthr_k != nthr else 0.0
        found = False
        for n_chunk in range(n_chunks_start, 0, -1):
            n_work = _div_up(n, n_blk * n_chunk)
            par = _div_up(num_n_blk, n_chunk)
            d_n = _f(_f(par * n_chunk - num_n_blk) / num_n_blk)
            for m_blk in range(max_m_blk, min_m_blk - 1, -1):
                m_chunks = _div_up(m, m_blk)
                work = batch * m_chunks * n_work
                if work < cur_nthr * 3 and work % cur_nthr and start_nthr_k == 1:
                    continue
                if m_blk not in d_m:
                    d_m[m_blk] = _f(_f((m_blk * m_chunks) % m) / m)
                score = _f(_f(_f(_f(_f(disbalance(work, cur_nthr) + d_m[m_blk]) + d_n) + alloc) + d_k[nthr_k]) / 5)
                if score < best_imbalance:
                    best, best_imbalance, found = (m_blk, n_chunk, nthr_k), score, True
        if not found:
            m_blk = min_m_blk
            work = batch * _div_up(m, m_blk) * _div_up(n, n_blk)
            d_n = _f(_f(num_n_blk - num_n_blk) / num_n_blk)
            score = _f(_f(_f(_f(_f(disbalance(work, cur_nthr) + _f(_f((m_blk * _div_up(m, m_blk)) % m) / m)) + d_n)
                                + alloc) + d_k[nthr_k]) / 5)
            if score < best_imbalance:
                best, best_imbalance = (m_blk, 1, nthr_k), score
    assert best is not None
    return (*best, n_blk, k_blk)


def _avx512_scratchpad(m: int, k: int, n: int, batch: int, nthr: int, a_tag_transposed: bool,
                       a_transposed: bool, f16: bool) -> int:
    """The scratchpad of the AVX512 brgemm matmul: float16 copies both operands to float32 (4-byte elements,
    K blocked by 16); bfloat16 copies B in VNNI pairs (K blocked by 32) and A only when transposed (or a big
    power-of-two K over many rows). The float32 accumulator is always booked (for a half-precision destination
    ``is_buffer_c_required`` reads a K chunk not yet set: zero)."""
    size, lane = (4, 16) if f16 else (2, 32)
    copy_a = f16 or a_transposed or (not a_transposed and _pow2(k) and k >= 4096 and m >= 1024)
    m_blk, n_chunk, nthr_k, n_blk, k_blk = _avx512_blocking(m, n, k, batch, nthr, a_tag_transposed, copy_a, not f16)
    lda = _rnd_up(k_blk, lane) + (lane if _rnd_up(k_blk, lane) >= 512 and _pow2(_rnd_up(k_blk, lane)) else 0)
    c_chunk = 4 * (n if nthr_k > 1 else n_blk) * (m if nthr_k > 1 else m_blk)
    c = c_chunk if (nthr_k > 1 or k_blk >= k) else c_chunk * n_chunk
    a = size * m_blk * lda if copy_a else 0
    b = size * _rnd_up(n_blk, 64) * _rnd_up(k_blk, 16 if f16 else 32)
    return _book(nthr, 16 * 40, a, b, c)


# -- bfloat16 on AMX ------------------------------------------------------------------------------------------


class _Problem(NamedTuple):
    m: int
    k: int
    n: int
    batch: int
    nthr: int
    plain_a: bool  # A's tag plain: the macro heuristic applies
    transposed_a: bool  # A copied transposed (a plain-tagged single row is not)
    transposed_b: bool
    caches: Caches

    @property
    def l2_thr(self) -> int:
        return 3 * self.caches.l2 // 4

    @property
    def l1_thr(self) -> int:
        return 5 * self.caches.l1 // 6


class _Blocking:
    """One candidate blocking of ``matmul_amx_blocking_params_t`` (fields as oneDNN names them, shortened)."""

    def __init__(self, p: _Problem, copy_a: bool, n_blk: int) -> None:
        self.p = p
        self.wei_n_blk = 32 if p.plain_a else 64  # B's column block: 32 where the macro heuristic applies
        self.nthr, self.nthr_m, self.nthr_n, self.nthr_k, self.nthr_b = p.nthr, 1, 1, 1, 1
        self.m_per = self.k_per = self.n_per = self.b_per = 0
        self.m_tmul = self.n_tmul = self.k_tmul = 0
        self.m_dec = self.n_dec = 32
        self.m_blk, self.n_blk, self.k_blk = 0, n_blk, 0
        self.m_chunk = self.n_chunk = self.k_chunk = 1
        self.bs = 0
        self.need_buf_a, self.need_buf_c = copy_a, False
        self.extendable_k = self.fused_copy_a = self.horizontal = False
        self.a_nt = True
        self.lda = 0
        self.score = 0.0

    def copy(self) -> _Blocking:
        other = _Blocking.__new__(_Blocking)
        other.__dict__.update(self.__dict__)
        return other

    def actual_lda(self) -> int:
        if not self.need_buf_a:
            return self.p.k
        lda = _rnd_up(self.k_blk, 32)
        return lda + 32 if lda >= 512 and _pow2(lda) else lda

    def set_core_divs(self, b: int, m: int, k: int, n: int) -> None:
        p = self.p
        self.nthr_b, self.nthr_m, self.nthr_k, self.nthr_n = b, m, k, n
        self.m_per, self.k_per = _div_up(p.m, m), _div_up(p.k, k)
        self.n_per, self.b_per = _div_up(p.n, n), _div_up(p.batch, b)

    def set_tmul_and_decomposition(self) -> None:
        p = self.p
        self.m_tmul = _div_up(self.m_per, _div_up(self.m_per, 16))
        self.n_tmul, self.k_tmul = 16, min(32, p.k)
        self.m_dec, self.n_dec = min(p.m, 2 * self.m_tmul), min(p.n, 2 * self.n_tmul)

    def skip_extendable_k(self) -> bool:
        def fits(k: int) -> bool:
            steps = _div_up(k, 32)
            return k % steps == 0 and k // steps <= 32 and (k // steps) % 2 == 0

        tail = self.p.k % self.k_blk
        return fits(self.k_blk) and fits(tail) if tail else fits(self.k_blk)


def _small_dims(p: _Problem, best: _Blocking) -> bool:
    """``maybe_small_dims_heuristics``: a memory-bound product (M, K or N small) split along its large matrix."""

    def common() -> None:
        best.k_blk, best.k_chunk, best.bs = p.k, 1, 1
        best.need_buf_c = best.need_buf_a = False
        best.extendable_k = p.k % 32 != 0 and not best.skip_extendable_k()
        best.score = 1.0
        best.lda = best.actual_lda()

    if p.m <= 32 and p.transposed_b and p.batch == 1:
        best.n_dec, best.m_dec = min(p.n, 32), p.m
        per_core = _rnd_up(_div_up(p.n, p.nthr), best.n_dec)
        best.set_core_divs(1, 1, 1, _div_up(p.n, per_core))
        if best.nthr_n < 0.75 * best.nthr or p.m * p.k > p.l2_thr:
            return False
        best.m_blk, best.m_chunk, best.n_blk, best.n_chunk = p.m, 1, best.n_dec, per_core // best.n_dec
    elif p.k <= 32 and p.batch == 1:
        per_core = _div_up(p.m, p.nthr)
        best.set_core_divs(1, _div_up(p.m, per_core), 1, 1)
        best.set_tmul_and_decomposition()
        if best.nthr_m < 0.75 * best.nthr:
            return False
        best.m_blk, best.m_chunk = best.m_dec, _div_up(per_core, best.m_dec)
        best.n_chunk = _div_up(p.n * p.k + p.n * _rnd_up(p.k, 32) + p.n * best.m_dec, p.l2_thr)
        best.n_blk = _rnd_up(_div_up(p.n, best.n_chunk), 32)
    elif p.n <= 32 and p.batch == 1:
        per_core = _div_up(p.m, p.nthr)
        best.m_per = per_core
        best.m_dec = _div_up(per_core, _div_up(per_core, 32))
        best.n_tmul, best.n_dec, best.k_tmul = 16, 32, min(32, p.k)
        best.set_core_divs(1, _div_up(p.m, _rnd_up(per_core, best.m_dec)), 1, 1)
        if best.nthr_m < 0.75 * best.nthr:
            return False
        best.m_blk, best.m_chunk, best.n_blk, best.n_chunk = best.m_dec, _div_up(per_core, best.m_dec), p.n, 1
    else:
        return False
    common()
    return True


def _candidates(per_thread: int, decomposition: int) -> list[int]:
    inner = _div_up(per_thread, decomposition)
    return sorted({_div_up(inner, groups) for groups in range(1, inner + 1)}, reverse=True)


def _l2_usage(q: _Blocking, k_chunk: int, mn_blk: int, k_blk: int, horizontal: bool, transform: bool = False) -> int:
    p = q.p
    kk = min(k_blk * k_chunk, q.k_per)
    size = 2 * 2 * (q.m_dec if horizontal else q.n_dec) * kk + 2 * mn_blk * kk
    if transform:
        size += 2 * mn_blk * k_blk * k_chunk
    size += 2 * q.m_dec * _rnd_up(mn_blk * 2, 64) if horizontal else 2 * _rnd_up(q.n_dec * 2, 64) * mn_blk
    if k_blk == p.k:
        size += 2 * q.m_dec * q.n_dec * 4
    else:
        size += 2 * (q.m_dec if horizontal else q.n_dec) * mn_blk * 4
    return size


def _l2_and_c(q: _Blocking, k_chunk: int, mn_blk: int, k_blk: int, horizontal: bool) -> int:
    per = q.m_per if horizontal else q.n_per
    kk = min(k_blk * k_chunk, q.k_per)
    return 2 * 2 * per * kk + 2 * 2 * mn_blk * kk + per * mn_blk * 4


def _single_core_score(q: _Blocking, k_chunk: int, mn_blk: int, k_blk: int, horizontal: bool,
                       transform: bool = False) -> float:
    p = q.p
    if _l2_usage(q, k_chunk, mn_blk, k_blk, horizontal, transform) > p.l2_thr:
        return 0.0
    m_blk, n_blk = (q.m_dec, mn_blk) if horizontal else (mn_blk, q.n_dec)
    kk = min(k_blk * k_chunk, q.k_per)
    traffic = 2 * m_blk * kk + 2 * n_blk * kk
    if not ((_l2_and_c(q, k_chunk, n_blk if horizontal else m_blk, k_blk, horizontal) < p.l2_thr or kk == p.k)
            and q.nthr_k == 1):
        traffic += m_blk * n_blk * 4
    return _f(_f(m_blk * kk * n_blk) / _f(traffic))


def _calc_k_blk(q: _Blocking, l1_dim: int) -> int:
    p = q.p
    space = p.l1_thr - (q.m_dec * q.n_dec * 4 * 2 + q.m_dec * _rnd_up(q.n_dec * 2, 64))
    largest_k_tiles = space // (l1_dim * 2) // q.k_tmul
    per_thread_tiles = _div_up(_div_up(p.k, q.k_tmul), q.nthr_k)
    blocks = _div_up(per_thread_tiles, largest_k_tiles)
    return min(_div_up(per_thread_tiles, blocks) * q.k_tmul, p.k)


def _set_macro_blocking(q: _Blocking, force_horizontal: bool = False, b_transform_to_l2: bool = False) -> bool:
    """``matmul_amx_blocking_params_macro_t::set_blocking_parameters``."""
    p = q.p
    m_cands, n_cands = _candidates(q.m_per, q.m_dec), _candidates(q.n_per, q.n_dec)
    s = {"k_h": 0, "n_h": 0, "m_v": 0, "k_v": 0, "h": 0.0, "v": 0.0, "no_h": False, "no_v": force_horizontal}

    def horizontal(k_blk: int, min_k_chunk: int = 0) -> None:
        if _rnd_up(q.m_per, q.m_dec) * (q.nthr_m - 1) >= p.m or _rnd_up(q.k_per, k_blk) * (q.nthr_k - 1) >= p.k:
            s["no_h"] = True
            return
        s["n_h"] = 0
        for n in n_cands:
            for kc in _candidates(q.k_per, k_blk):
                score = _single_core_score(q, kc, n * q.n_dec, k_blk, True, b_transform_to_l2)
                if score > s["h"] and kc >= min_k_chunk:
                    s["h"], s["k_h"], s["n_h"] = score, kc, n
        if s["n_h"] == 0:
            s["no_h"] = True
            return
        if (_rnd_up(q.n_per, s["n_h"] * q.n_dec) * (q.nthr_n - 1) >= p.n
                or _rnd_up(q.k_per, s["k_h"] * k_blk) * (q.nthr_k - 1) >= p.k):
            s["no_h"] = True

    def vertical(k_blk: int, min_k_chunk: int = 0) -> None:
        if _rnd_up(q.n_per, q.n_dec) * (q.nthr_n - 1) >= p.n or _rnd_up(q.k_per, k_blk) * (q.nthr_k - 1) >= p.k:
            s["no_v"] = True
            return
        for m in m_cands:
            for kc in _candidates(q.k_per, k_blk):
                score = _single_core_score(q, kc, m * q.m_dec, k_blk, False)
                if score > s["v"] and kc >= min_k_chunk:
                    s["v"], s["k_v"], s["m_v"] = score, kc, m
        if s["m_v"] == 0:
            s["no_v"] = True
            return
        if (_rnd_up(q.m_per, s["m_v"] * q.m_dec) * (q.nthr_m - 1) >= p.m
                or _rnd_up(q.k_per, s["k_v"] * k_blk) * (q.nthr_k - 1) >= p.k):
            s["no_v"] = True
        l2 = 0
        if not s["no_v"]:
            l2 = _l2_and_c(q, s["k_v"], s["m_v"] * q.m_dec, k_blk, False)
            if l2 > p.l2_thr:
                l2 = _l2_usage(q, s["k_v"], s["m_v"] * q.m_dec, k_blk, False)
        k_loops = _div_up(p.k, k_blk * s["k_v"])
        if k_loops != 1 and (k_loops != q.nthr_k or l2 * q.nthr_k >= p.l2_thr):
            s["no_v"] = True
        # The output's rows fall in few L2 sets (N * 2 bytes a multiple of a page fraction): go horizontally.
        set_span = p.caches.l2 // p.caches.l2_ways
        stride = (p.n * 2) % 4096 or 4096
        if set_span % stride == 0 and _div_up(stride * q.m_per, set_span) >= 3 * p.caches.l2_ways // 4:
            s["no_v"] = True

    k_blk_h = _calc_k_blk(q, q.m_dec)
    horizontal(k_blk_h)
    k_blk_v = _calc_k_blk(q, q.n_dec)
    vertical(k_blk_v)
    if s["no_v"] and s["no_h"]:
        return False
    if s["no_h"] or s["no_v"]:
        q.horizontal = not s["no_h"]
    elif q.m_per < 2 * q.m_tmul or q.n_per < 2 * q.n_tmul:
        q.horizontal = q.m_per < 2 * q.m_tmul  # too few tiles along M to go vertically, else along N
    else:
        q.horizontal = q.m_per >= q.n_per
    if q.horizontal:
        a_l1 = k_blk_h * q.m_dec * 2
        c_l1 = q.n_dec * q.m_dec * 4
        d_post = q.m_dec * _rnd_up(q.n_dec * 2, 64)
        q.a_nt = False
        if k_blk_h < p.k and _div_up(p.k, k_blk_h) * a_l1 + 2 * c_l1 + d_post > p.l1_thr:
            s["h"] = 0.0
            horizontal(32, k_blk_h // 32)
            k_blk_h = min(32 * s["k_h"], p.k)
            s["k_h"] = 1
            q.a_nt = True
        q.k_blk, q.k_chunk = k_blk_h, s["k_h"]
        q.n_blk, q.n_chunk = min(s["n_h"] * q.n_dec, p.n), 1
        q.m_blk, q.m_chunk = q.m_dec, _div_up(q.m_per, q.m_dec)
        q.fused_copy_a = p.k % 32 != 0 and q.n_blk >= 3 * q.n_dec and q.k_blk >= 128
        q.extendable_k = p.k % 32 != 0 and not q.skip_extendable_k() and not q.fused_copy_a
    else:
        q.k_blk, q.k_chunk = k_blk_v, s["k_v"]
        q.n_blk, q.n_chunk = q.n_dec, _div_up(q.n_per, q.n_dec)
        q.m_blk, q.m_chunk = min(s["m_v"] * q.m_dec, p.m), 1
        q.a_nt = True
        q.fused_copy_a = False
        q.extendable_k = p.k % 32 != 0 and not q.skip_extendable_k()
    q.bs = 1
    q.lda = q.actual_lda()
    q.need_buf_c = q.nthr_k != 1 or q.k_blk != p.k  # the float32 accumulator differs from the destination
    q.score = _macro_score(q)
    return True


# Bandwidths oneDNN's model assumes (bytes per cycle, measured on an Emerald Rapids).
_L1_HIT, _L1_LOAD_MISS, _L1_STORE_MISS, _LLC = _f(106.41), _f(106.41 / 2.28), _f(106.41 / 2.85), _f(6.0)
_DRAM = ((1, _f(2.28)), (2, _f(0.9)), (4, _f(2.39)), (8, _f(2.98)), (16, _f(3.31)), (32, _f(4.06)))


def _dram_bw(sharing: int) -> float:
    for i, (cores, bw) in enumerate(_DRAM):
        if cores >= sharing:
            if i == 0:
                return bw
            c0, b0 = _DRAM[i - 1]
            return _f(b0 + _f(_f(_f(bw - b0) * _f(sharing - c0)) / (cores - c0)))
    return _DRAM[-1][1]


def _macro_score(q: _Blocking) -> float:
    """``matmul_amx_blocking_params_macro_t::calculate_blocking_scores``: peak cycles over modelled cycles, in
    float32 as oneDNN computes it (no post-ops: their cost term is zero)."""
    p = q.p
    f = _f
    a_size, b_size, d_size = q.m_per * q.k_per * 2, q.n_per * q.k_per * 2, q.m_per * q.n_per * 2
    tmul_cycles = q.m_tmul * 64 * 16 // 1024
    out = 2 if q.nthr_k == 1 else 4
    if q.horizontal:
        dst = q.m_dec * q.n_per * out
        tmuls = q.m_dec * q.k_per * q.n_per // (q.m_tmul * q.k_tmul * q.n_tmul)
        strips, nt_miss, l1_reuse = _div_up(q.m_per, q.m_dec), b_size, _div_up(q.n_blk, q.n_dec)
        s1_shared, s1_private, s1_coef = b_size, q.m_dec * q.k_per * 2 + dst, q.nthr_m
        mid_shared, mid_coef = q.m_dec * q.k_per * 2, max(1, q.nthr_n)
    else:
        dst = q.n_dec * q.m_per * out
        tmuls = q.n_dec * q.k_per * q.m_per // (q.m_tmul * q.k_tmul * q.n_tmul)
        strips, nt_miss, l1_reuse = _div_up(q.n_per, q.n_dec), a_size, _div_up(q.m_blk, q.m_dec)
        s1_shared, s1_private, s1_coef = a_size, q.n_dec * q.k_per * 2 + dst, q.nthr_n
        mid_shared, mid_coef = q.n_dec * q.k_per * 2, max(1, q.nthr_m)
    s1_transform = q.horizontal  # B is always copied here
    mid_transform = not q.horizontal
    s1_shared, s1_private, mid_shared, mid_private = f(s1_shared), f(s1_private), f(mid_shared), f(dst)
    c_elems = f(q.m_blk * q.n_blk)
    post_miss = f(q.m_blk * _div_up(q.n_blk, q.n_dec) * _rnd_up(q.n_dec * 2, 64))
    post_total = f(q.m_blk * _div_up(q.n_blk, q.n_dec) * _div_up(q.n_dec, 16) * 64)
    c_tmp = f(f(f(4 * c_elems) * q.k_chunk) / (_L1_HIT if q.k_blk == p.k else _L1_STORE_MISS))
    c_l1 = f(f(f(f(post_miss / _L1_STORE_MISS) + f(f(post_total - post_miss) / _L1_HIT)) + f(f(c_elems * 4) / _L1_HIT))
             + c_tmp)
    l1 = f(f(f(f(f(mid_shared * 2) / _L1_LOAD_MISS) + f(f(mid_shared * f(l1_reuse - 1)) / _L1_HIT))
             + f(f(nt_miss) / _L1_LOAD_MISS)) + c_l1)
    transform_h = f(s1_shared / _dram_bw(s1_coef)) if s1_transform else 0.0
    transform_v = f(mid_shared / _dram_bw(mid_coef)) if mid_transform else 0.0
    if mid_transform:
        dram, llc = f(mid_private / _dram_bw(1)), f(mid_private / _LLC)
    else:
        dram = f(f(mid_shared / _dram_bw(mid_coef)) + f(mid_private / _dram_bw(1)))
        llc = f(f(mid_private + mid_shared) / _LLC)
    mid = f(transform_v + max(dram, llc, l1, f(f(tmuls) * tmul_cycles), 0.0))
    if not s1_transform:
        first = f(f(s1_shared / _dram_bw(s1_coef)) + f(s1_private / _dram_bw(1)))
    elif _l2_usage(q, q.k_chunk, q.n_blk, q.k_blk, True, True) < p.l2_thr:
        first = mid
    else:
        first = f(s1_shared / _LLC)
    gemm = f(f(transform_h + first) + f(f(strips - 1) * mid))
    reduction = 0.0
    if q.nthr_k != 1:
        if not (q.m_per * q.n_per * 4 * 2 < p.l2_thr and p.batch == 1):
            return 0.0
        read = f((p.m * _rnd_up(p.n, 16) * 4) * (q.nthr_k - 1) // (q.nthr_m * q.nthr_n))
        read = f(read / (_dram_bw(2) if a_size + b_size + d_size < p.l2_thr else _LLC))
        write = f((p.m * p.n * 2) // (q.nthr_m * q.nthr_n))
        reduction = f(f(read + f(write / _dram_bw(1))) + 25000)
    total = f(f(gemm + reduction) * q.b_per)
    peak = f(f(p.m * p.k * p.n * p.batch) / f(512 * p.nthr))
    return f(peak / total)


def _tie_break(a: _Blocking, b: _Blocking) -> bool:
    """``operator>`` between blockings of equal score."""
    p = a.p
    if not a.horizontal and b.horizontal:
        return a.m_per * p.k + a.m_per * p.n < p.l2_thr and b.a_nt
    if a.horizontal and not b.horizontal:
        return not (b.m_per * p.k + b.m_per * p.n < p.l2_thr and a.a_nt)
    return a.m_chunk * a.n_chunk > b.m_chunk * b.n_chunk


def _better(a: _Blocking, b: _Blocking) -> bool:
    return a.score > b.score if a.score != b.score else _tie_break(a, b)


def _macro(p: _Problem) -> _Blocking:
    """``matmul_amx_blocking_params_macro_t::find_best_blocking``: every split of the threads over batch, M, K
    and N (fewer threads too), each traversed horizontally or vertically, scored by a cycle model."""
    best, cur = _Blocking(p, False, min(32, p.n)), _Blocking(p, False, min(32, p.n))
    if _small_dims(p, best):
        return best
    for nthr in range(p.nthr, 0, -1):
        cur.nthr = nthr
        for b in (d for d in range(1, nthr + 1) if nthr % d == 0):
            for m in (d for d in range(1, nthr // b + 1) if (nthr // b) % d == 0):
                for k in (d for d in range(1, nthr // b // m + 1) if (nthr // b // m) % d == 0):
                    cur.set_core_divs(b, m, k, nthr // b // m // k)
                    cur.set_tmul_and_decomposition()
                    if _divs_acceptable(cur) and _set_macro_blocking(cur) and _better(cur, best):
                        best = cur.copy()
    if not p.transposed_b and not best.horizontal:
        # A vertical pick over a plain B is tried again horizontally (the last split's tile sizes kept).
        cur.nthr = best.nthr_b * best.nthr_m * best.nthr_n * best.nthr_k
        cur.set_core_divs(best.nthr_b, best.nthr_m, best.nthr_k, best.nthr_n)
        if _set_macro_blocking(cur, True) and _better(cur, best):
            best = cur.copy()
        if _set_macro_blocking(cur, True, True) and _better(cur, best):
            best = cur.copy()
    return best


def _divs_acceptable(q: _Blocking) -> bool:
    p = q.p
    if _rnd_up(q.m_per, q.m_tmul) < 32 and q.nthr_m > 1:
        return False
    if q.k_per < 128 and q.nthr_k > 1:
        return False
    least_n = 128 if (q.nthr_k == 1 and q.k_per < 128) else 32
    if _rnd_up(q.n_per, q.n_tmul) < least_n and q.nthr_n > 1:
        return False
    return q.nthr_b <= p.batch


def _micro_set(q: _Blocking, copy_a: bool, lda_big_pow2: bool, n_blk: int, n_chunk: int, m_blk: int,
               m_chunk: int) -> None:
    """``matmul_amx_blocking_params_micro_t::set_blocking_parameters`` (one thread along K: under 8 threads)."""
    p = q.p
    q.nthr_k, q.nthr = 1, p.nthr
    q.n_blk, q.n_chunk, q.m_blk, q.m_chunk = n_blk, n_chunk, m_blk, m_chunk
    if p.k < 32:
        q.k_blk, q.bs = _rnd_up(p.k, 2), 1
    else:
        q.k_blk = 32
        blocks = _div_up(p.k, 32)
        q.bs = blocks
        size = _chunk_memory(q)
        div_min, div_max = size // p.l2_thr, _div_up(size, p.l2_thr)
        if div_min > (2 if lda_big_pow2 else 0) and q.bs > 1:
            kc1, kc2 = max(q.bs // div_min, 1), _div_up(q.bs, div_max)
            t1, t2 = blocks % kc1, blocks % kc2
            q.bs = kc2 if (not (t1 == 0 or t2 < t1) or t2 == 0) else kc1
        k_elems, tail = q.k_blk * q.bs, p.k % q.k_blk
        q.extendable_k = p.k % 32 != 0 and k_elems > 32 and not copy_a and q.lda == p.k
        if q.extendable_k:
            q.k_blk, q.k_chunk, q.bs = min(k_elems, p.k), 1, 1
        elif tail == 0 and p.k % k_elems == 0:
            q.k_blk, q.bs = k_elems, 1
        elif p.k == k_elems + tail:
            q.k_blk, q.bs = k_elems, 2
    q.need_buf_a = copy_a or (not q.extendable_k and p.k % 2 != 0)
    memory = _chunk_memory(q)
    q.score = _micro_score(q, memory)


def _chunk_memory(q: _Blocking) -> int:
    p = q.p
    k_elems = q.k_blk * q.k_chunk * q.bs
    q.lda = q.actual_lda()
    q.need_buf_c = p.k > k_elems or p.k % q.k_blk > 0
    m_elems, n_elems = q.m_blk * q.m_chunk, q.n_blk * q.n_chunk
    return (2 * k_elems * m_elems + (2 * q.lda * q.bs * m_elems if q.need_buf_a else 0) + 2 * k_elems * n_elems
            + 2 * q.n_blk * k_elems + 2 * m_elems * n_elems + (4 * m_elems * n_elems if q.need_buf_c else 0))


def _micro_score(q: _Blocking, memory: int) -> float:
    p = q.p
    f = _f
    m_elems, n_elems = q.m_blk * q.m_chunk, q.n_blk * q.n_chunk
    coeff = f(min(p.nthr, 100))
    balance, cache = f(f(coeff - 1) / coeff), f(1 / coeff)
    l2 = f(1 - f(abs(f(p.l2_thr - f(memory))) / f(max(p.l2_thr, memory))))
    reuse_m = min(f(m_elems / min(p.m, 256)), 1.0)
    reuse_n = min(f(n_elems / min(p.n, 64 * (4 if q.need_buf_a else 1))), 1.0)
    score = f(f(cache * l2) + f(0.5 * f(reuse_m + reuse_n)))
    if balance > 0:
        chunks = p.batch * _div_up(p.m, m_elems) * _div_up(p.n, n_elems)
        spread = f(f(f(f(p.batch * f(p.m / m_elems)) * f(p.n / n_elems)) / _rnd_up(chunks, p.nthr)) * p.nthr)
        score = f(score + f(balance * f(spread / p.nthr)))
    return f(score / f(f(1 + balance) + cache))


def _hash_set_order(values: list[int]) -> list[int]:
    """The order a libstdc++ ``std::unordered_set<int>`` (13 buckets up to 13 values, identity hash) walks the
    values inserted: a value whose bucket is empty goes to the front of the list, else to the front of its
    bucket's run."""
    order: list[int] = []
    for v in values:
        if v in order:
            continue
        same = [i for i, u in enumerate(order) if u % 13 == v % 13]
        order.insert(same[0] if same else 0, v)
    return order


def _micro(p: _Problem, copy_a: bool) -> _Blocking:
    """``matmul_amx_blocking_params_micro_t::find_best_blocking``: the first blocking of the best score, M's
    block sizes walked in oneDNN's hash-set order."""
    if p.nthr >= 16 and p.batch == 1 and p.k > 1024:
        raise NotImplementedError  # K split across threads (and the tie skip off): not replayed
    m_blk = next((s * r for r in range(16, 12, -1) for s in range(4, 1, -1) if p.m % (s * r) == 0), min(p.m, 64))
    n_blk = min(64, p.n)
    lda_big_pow2 = not p.transposed_a and _pow2(p.k) and p.k >= 4096
    m_blocks, n_blocks = _div_up(p.m, m_blk), _div_up(p.n, n_blk)
    work = p.batch * m_blocks * n_blocks
    min_m = _div_up(m_blk, 2) if work < 1.5 * p.nthr and m_blk > 32 else m_blk
    m_chunks, n_chunks = min(4, m_blocks), min(6 if work > 16 * p.nthr else 4, n_blocks)
    m_cands = []
    m = m_blk
    while m >= min_m:
        m_cands.append(m)
        m = _div_up(m, 2) if m > 1 else m - 1
    if p.m > 16:
        m_cands += range(min(p.m // 16 * 16, 64), _rnd_up(min_m, 16) - 1, -16)
    if len(set(m_cands)) > 13:
        raise NotImplementedError  # the hash set would rehash: its order not replayed
    skip_ok = p.m == 4 and (p.n, p.k) in ((4096, 4096), (11008, 4096), (4096, 11008))
    q = _Blocking(p, copy_a, n_blk)
    best = None
    for mb in _hash_set_order(m_cands):
        for nc in range(n_chunks, 0, -1):
            for mc in range(m_chunks, 0, -1):
                chunks = p.batch * _div_up(p.m, mb * mc) * _div_up(p.n, n_blk * nc)
                if chunks < 3 * p.nthr and chunks % p.nthr and not skip_ok:
                    continue
                _micro_set(q, copy_a, lda_big_pow2, n_blk, nc, mb, mc)
                if q.score > (best.score if best else 0.0):
                    best = q.copy()
    if best is None:
        _micro_set(q, copy_a, lda_big_pow2, n_blk, 1, min_m, 1)
        best = q.copy()
    return best


def _tiles(bd: int, ld: int, k: int, l1: int) -> int:
    """``brgemm_blocking_tmm``: the AMX tiles the kernel keeps C in (its workspace holds one 1 KiB tile each)."""
    b = {"ld_block": 16, "ldb": ld // 16, "ldb_tail": ld % 16, "bd_block": 0, "bdb": 0, "bdb_tail": 0,
         "bd_block2": 0, "ld_block2": 0, "m_tail": False}

    def by_ld() -> None:
        if b["bd_block2"] == 1 and b["ldb"] > 0 and b["ldb_tail"] == 0:
            b["ld_block2"] = 3 if b["ldb"] % 3 == 0 else 2 if b["ldb"] % 2 == 0 else 1
        else:
            b["ld_block2"] = 2 if (b["ldb"] > 0 and b["ldb"] % 2 == 0 and b["ldb_tail"] == 0
                                   and b["bd_block2"] < 3) else 1
        if b["ld_block2"] == 1 and not b["m_tail"] and b["ldb_tail"] == 0:
            b["bd_block2"] = 3 if b["bdb"] >= 3 else 2 if b["bdb"] >= 2 else 1

    def three_by_one(width: int) -> bool:
        b["m_tail"] = False
        if not ((width - 1) * 16 < bd < width * 16 and b["ldb_tail"] == 0):
            return False
        b.update(bd_block=16, bdb=_div_up(bd, 16), bdb_tail=bd % 16, m_tail=True, bd_block2=width)
        by_ld()
        return True

    def two_by_two() -> bool:
        b["bd_block"] = next(m for m in range(16, 0, -1) if bd % m == 0)
        if b["bd_block"] == 1:
            b["bd_block"], b["bdb_tail"] = min(16, bd), bd % 16
            for i in range(16, 0, -1):
                if bd % i > b["bdb_tail"] or bd % i == 0:
                    b["bd_block"], b["bdb_tail"] = i, bd % i
                    if bd % i == 0:
                        break
        b["bdb"], b["bdb_tail"] = bd // b["bd_block"], bd % b["bd_block"]
        b["bd_block2"] = 2 if b["bdb"] >= 2 else 1
        b["m_tail"] = False
        by_ld()
        return not (b["ld_block2"] == 1 or b["bd_block2"] == 1 or b["bd_block"] < 8)

    def recalc(bd_block: int, ld_block: int, bd_block2: int, ld_block2: int) -> None:
        if bd_block:
            b.update(bd_block=bd_block, bdb=_div_up(bd, bd_block), bdb_tail=bd % bd_block)
        if ld_block:
            b.update(ld_block=ld_block, ldb=_div_up(ld, ld_block), ldb_tail=ld % ld_block)
        if bd_block2:
            b["bd_block2"] = bd_block2
        if ld_block2:
            b["ld_block2"] = ld_block2

    if not (two_by_two() or three_by_one(3) or three_by_one(2)):
        two_by_two()
    recalc(b["bd_block"], b["ld_block"], b["bd_block2"], b["ld_block2"])
    eff_k, low_k = 2 * k, (l1 - 4096) // 96
    bd_tail = not (b["bd_block"] > 12 and bd % b["bd_block"] == 0)
    ld_tail = ld % 16 != 0
    if not bd_tail and not ld_tail:
        k5, k4 = low_k <= eff_k < (l1 - 5 * 1024) // 80, low_k <= eff_k < (l1 - 4 * 1024) // 64
        if ld % 80 == 0 and k5 and bd > 32:
            recalc(0, 16, 1, 5)
        elif ld % 64 == 0 and k4 and bd > 32:
            recalc(0, 16, 1, 4)
        elif bd % 80 == 0 and k5 and ld > 32:
            recalc(0, 16, 5, 1)
        elif bd % 64 == 0 and k4 and ld > 32:
            recalc(16, 16, 4, 1)
    weak_ld = b["ld_block"] < 8 or b["ldb_tail"] > 0
    weak_bd = b["bd_block"] < 8 or b["bdb_tail"] > 0
    ld_only, bd_only = ld_tail and not bd_tail, bd_tail and not ld_tail
    ld16, bd16 = _rnd_up(ld, 16), _rnd_up(bd, 16)
    if ld_only and ld > 64 and b["ld_block"] < 8:
        recalc(0, 16, 2, 1)
    elif ld_only and weak_ld and ld16 in (64, 48, 32):
        recalc(0, 16, *{64: (1, 4), 48: (1, 3), 32: (2, 2)}[ld16])
    elif bd <= 16:
        recalc(bd, 16, 0, 0)
        recalc(0, 0, 1, min((3 if b["ldb"] > 4 else 4) if ld_tail else 5, _div_up(ld, 16)))
    elif bd_only and weak_bd and bd > 64:
        recalc(16, 16, 1, 2)
    elif bd_only and weak_bd and bd16 in (64, 48):
        recalc(16, 16, {64: 4, 48: 3}[bd16], 1)
    elif bd_only and weak_bd and bd16 == 32 and ld % 32 == 0:
        recalc(16, 16, 2, 2)
    elif ld <= 16:
        recalc(16, 16, 0, 0)
        recalc(0, 0, min((3 if b["bdb"] > 4 else 4) if b["bdb_tail"] else 5, _div_up(bd, 16)), 1)
    elif bd_tail and ld_tail and bd16 == 32 and ld16 == 32 and (weak_ld or weak_bd):
        recalc(16, 16, 2, 2)
    rows = b["bdb"] if b["bdb"] <= b["bd_block2"] else b["bd_block2"] + (1 if b["bdb_tail"] else 0)
    cols = b["ldb"] if b["ldb"] <= b["ld_block2"] else b["ld_block2"] + (1 if b["ldb_tail"] else 0)
    return rows * cols


def _amx_scratchpad(p: _Problem, q: _Blocking) -> int | None:
    """``init_aux_values`` and ``init_scratchpad`` for an AMX blocking; None where oneDNN turns AMX away (A's
    block under 127 bytes: the AVX512 kernel runs instead)."""
    if 2 * q.m_blk * q.lda <= 126:
        return None
    ldb = _rnd_up(q.n_blk, 16) if q.wei_n_blk > q.n_blk != p.n else q.wei_n_blk
    ldc = min(32, q.n_blk) if q.need_buf_c and q.nthr_k <= 1 else p.n
    k_elems = q.k_blk * q.k_chunk * q.bs
    c_chunk = _rnd_up(q.n_blk, ldc) * q.m_blk * 4 if q.nthr_k == 1 else 4 * ldc * p.m
    c = c_chunk if (q.nthr_k > 1 or k_elems >= p.k) else c_chunk * q.m_chunk * q.n_chunk
    a = 2 * q.m_blk * q.lda * q.bs * q.k_chunk * q.m_chunk if q.need_buf_a else 0
    b = 2 * _rnd_up(q.n_blk, ldb) * _rnd_up(q.k_blk, 32) * q.bs * q.k_chunk
    # Tile workspace: the largest over the kernels built (full and tail blocks along M, N, K and the batch).
    k_tail = (p.k % q.k_blk if (q.extendable_k or q.fused_copy_a) else _rnd_up(p.k % q.k_blk, 2)) if p.k > q.k_blk else 0
    last = (max(p.k, q.k_blk) - (_div_up(p.k, k_elems) - 1) * k_elems) // q.k_blk
    bs_tail = last % q.bs
    tiles = 0
    for vm in {q.m_blk, p.m % q.m_blk} - {0}:
        for vn in {q.n_blk, p.n % q.n_blk} - {0}:
            for vk, bs in {(q.k_blk, q.bs), (q.k_blk, bs_tail), (k_tail, 1)}:
                if not (vk and bs) or q.lda < vk:
                    continue
                size = _tiles(vm, vn, vk, p.caches.l1) * 1024
                if q.extendable_k and (vk % 2 or (vk > 32 and vk % 32)):
                    size += 1024
                if q.fused_copy_a:
                    size += bs * vm * _rnd_up(vk, 32) * 2
                tiles = max(tiles, size)
    return _book(q.nthr, 16 * q.bs * 40, a, b, c if q.need_buf_c else 0, tiles)


@functools.lru_cache(maxsize=4096)
def scratchpad(kernel: str, m: int, k: int, n: int, batch: int, threads: int, a_tag_transposed: bool,
               b_transposed: bool, caches: Caches) -> int:
    """The bytes oneDNN's brgemm matmul books for ``batch`` products of M x K by K x N at ``threads`` threads.

    **Arguments**: ``kernel``: "amx" (bfloat16 on AMX-BF16) or "avx512" (float16 on AVX512-FP16);
    ``a_tag_transposed``: A laid out column-major as oneDNN tags it (a single row counts as such: see linalg.py);
    ``b_transposed``: B column-major; ``caches``: the CPU's per-core cache geometry.

    **Returns**: the scratchpad's size; where the micro search runs but is not replayed (16 threads or more,
    which may split K), :func:`bound` without the macro search's terms."""
    transposed_a = a_tag_transposed and m > 1
    if kernel == "avx512":
        return _avx512_scratchpad(m, k, n, batch, threads, a_tag_transposed, transposed_a, True)
    p = _Problem(m, k, n, batch, threads, not a_tag_transposed, transposed_a, b_transposed, caches)
    best = _macro(p) if p.plain_a else None
    if best is None or best.score == 0:
        try:
            best = _micro(p, transposed_a or (_pow2(k) and k >= 4096 and m >= 1024))
        except NotImplementedError:
            # The micro search runs (the macro one declined), but not as replayed: bounded, without the macro
            # search's terms.
            return bound(m, k, n, batch, threads, False, (caches.l2, caches.l2), plain_a=False, gemm=False)
    size = _amx_scratchpad(p, best)
    if size is None:
        return _avx512_scratchpad(m, k, n, batch, threads, a_tag_transposed, transposed_a, False)
    return size


# -- A bound from above over every blocking (other ISAs, other oneDNN versions) --------------------------------
#
# Where the search is not replayed, the scratchpad is bounded by what any blocking of oneDNN's brgemm matmul can
# book (``init_aux_values`` and ``init_scratchpad`` in brgemm_matmul_utils.cpp, and the caps each blocking search
# puts on its blocks: ``compute_blocking_heuristic_avx512``/``_avx2`` there, the AMX micro and macro searches in
# amx_blocking_heuristics.cpp; read at oneDNN 3.12, the K split checked back to 3.0), or, for bfloat16 on a CPU
# without a bfloat16 brgemm kernel, by gemm_bf16_matmul's float32 result. Per thread, any blocking books:
#   - A's copy: M_blk * M_chunk rows (blocks of at most 64 rows in up to 4 chunks, or one block of at most 256:
#     under M + min(M, 64), at most 256) by a K chunk: LDA (K's block padded to 32, plus 32 past 512 for a
#     power of two) times the batch of blocks. The AVX512/AVX2 searches block K by at most 1024; the AMX ones
#     may take all of K, and the micro search's two-block batch where K % 32 != 0 books it twice.
#   - B's copy: N_blk (at most 64 columns) by the same K chunk; in the AMX macro search (A plain) a strip of up
#     to N columns whose L2 check bounds it by 3/4 of L2, up to the rounding of N_blk to 32 and of K's chunk.
#   - the float32 accumulator: one block (at most 256 x 64; the macro search's 32 rows by N or M rows by 32)
#     where a thread's K chunk covers K; else a chunk of blocks: at most 256 rows by 16 blocks of 64 columns
#     (LDC rounding included), or the macro search's whole share of M x N (all threads: under
#     (M + 64 T)(N + 64 T), times the threads split over the batch). K is chunked only past 512 (AVX512/AVX2),
#     past 256 (macro: its K block fills L1, 8 tiles of 32 at a 32 KiB L1), or in the micro search where A, B
#     and C's chunk (at most 1920 B per element of K plus 6 B per element of a 256 x 384 C) outgrow 3/4 of L2.
#     Where K is split across threads (nthr_k > 1), all of M x N per thread: the AVX512 search for K >= 2048
#     with fewer 64-column blocks than threads (any batch before 3.4); the micro search at 16 threads or more,
#     K > 1024, one product; the macro search for one product whose per-thread share, twice in float32, fits
#     3/4 of L2.
#   - batch descriptors (16 * batch of 40 B), AMX tile state (at most 8 tiles of 1 KiB and one more for an
#     extendable K; the macro search's fused copy of A: up to 32 rows by the K chunk).
# Each buffer is booked for all threads plus 128 B of alignment. float16 on AVX512-FP16 copies both operands to
# float32 (4-byte elements); bfloat16 stays 2 bytes in every kernel. The bound is loosest where the macro search
# may run (the AMX kernels on A plain): its strips may span all of N or M, which only its cycle model rules out.


def bound(m: int, k: int, n: int, batch: int, threads: int, f16: bool, l2: tuple[int, int], amx: bool = True,
          plain_a: bool = True, brgemm: bool = True, gemm: bool = True) -> int:
    """The largest scratchpad any blocking oneDNN's brgemm matmul (or its gemm fallback) may book for ``batch``
    products of M x K by K x N at ``threads`` threads, whatever the oneDNN 3.x version.

    **Arguments**: ``f16``: float16 (its operands may be copied as float32); ``l2``: the per-core L2 bytes
    (at least, at most) the AMX searches size blocks by; ``amx``: whether an AMX kernel may run (the micro
    search's terms); ``plain_a``: whether A may be read plain (the macro search's terms, with ``amx``);
    ``brgemm``: whether a brgemm kernel may run; ``gemm``: whether gemm_bf16_matmul may (no brgemm kernel for
    bfloat16 on this ISA).

    **Returns**: bytes, never under what such a blocking books (see the comment above for each term)."""
    t, (l2_low, l2_high) = threads, l2
    macro = amx and plain_a
    size = 4 if f16 else 2
    kp = _rnd_up(k, 32)
    # A K chunk as a buffer's LDA * batch * K chunks may book it: at most 1024 of K in the AVX512/AVX2 searches;
    # in the AMX ones all of K, twice in the micro search's two-block batch where K % 32 != 0.
    kc = (2 if k % 32 else 1) * (kp + 32) if amx else min(kp, 1024) + 32
    copy_a = size * min(m + min(m, 64), 256) * kc
    copy_b = size * 64 * kc
    fixed = 640 * (_div_up(k, 32) + 2)
    # The accumulator: one block where a thread's K chunk covers K, else a chunk of blocks.
    block = 4 * min(m, 256) * 64
    chunked = 0
    # AVX512/AVX2 searches block K past 512; the AMX micro search where its chunk of A, B and C (at most 256
    # rows, 384 columns) would outgrow 3/4 of L2.
    if k > 512 or (amx and kp >= (3 * l2_low // 4 - 6 * 256 * 384) // 1920):
        chunked = t * 4 * min(m + min(m, 64), 256) * min(n + 96, 1056)
    k_split = t >= 2 and k >= 2048 and t > batch * _div_up(n, 64)
    if amx:
        fixed += 9 * 1024
        k_split = k_split or (batch == 1 and t >= 16 and k > 1024)
    if macro:
        copy_b = max(copy_b, min(2 * (n + 32) * kc, 2 * l2_high + 2 * 32 * kc))
        fixed += 2 * 32 * kc
        block = max(block, 4 * 32 * (max(m, n) + 32))
        if k > 256:
            chunked = max(chunked, 4 * min(batch, t) * (m + 64 * t) * (n + 64 * t))
        k_split = k_split or (batch == 1 and t >= 2 and k >= 256 and 8 * m * n < t * l2_high)
    accumulator = max(t * block, chunked, t * 4 * m * (n + 64) if k_split else 0)
    total = t * (copy_a + copy_b + fixed) + accumulator + 8 * 128 if brgemm else 0
    if gemm:
        # gemm_bf16_matmul's float32 result: a product's M x N per thread (the whole result in one call only
        # where B is broadcast over the batch, which ATen's bmm does not hand it), blocks rounded to 64.
        total = max(total, 4 * (min(batch, t) * m * n + 64 * t) + 128)
    return total

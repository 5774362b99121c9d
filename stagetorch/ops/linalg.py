"""Rules for the linalg op family."""

from __future__ import annotations

import torch

from .. import batching, flops
from . import _shape

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

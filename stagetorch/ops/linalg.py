"""Rules for the linalg op family."""

from __future__ import annotations

import torch

from . import _batch, _memory, _shape  # noqa: F401

aten = torch.ops.aten

# Shape rules: op -> rule(*args with Avals, **kwargs) -> Aval | tuple[Aval, ...]
SHAPE: dict = {
    aten.mm: _shape.matmul,
    aten.addmm: _shape.addmm,
    aten.bmm: _shape.bmm,
    aten.t: _shape.transpose_2d,
}



# Memory rules: op -> rule(eqn) -> transient workspace bytes
MEMORY: dict = {
}



# Batch rules: op -> rule(eqn, label) -> Chunked (see stagetorch/batching.py)
BATCH: dict = {
    aten.mm: _batch.contraction("ij,jk->ik"),
    aten.bmm: _batch.contraction("bij,bjk->bik"),
    aten.addmm: _batch.contraction("ij,jk->ik", bias=True),
    aten.baddbmm: _batch.contraction("bij,bjk->bik", bias=True),
    aten.mv: _batch.contraction("ij,j->i"),
    aten.dot: _batch.contraction("i,i->"),
    aten.addmv: _batch.contraction("ij,j->i", bias=True),
    aten.addr: _batch.contraction("i,j->ij", bias=True),
    aten.addbmm: _batch.contraction("bij,bjk->ik", bias=True),
    aten.vdot: _batch.contraction("i,i->"),
    aten.linalg_cross: _batch.along(2, default=-1),
    # Linear algebra over the two trailing dims, batched over the leading ones.
    **{op: _batch.along(None, last=2) for op in (
        aten.linalg_inv_ex, aten.linalg_cholesky_ex, aten.cholesky, aten._linalg_eigh, aten._linalg_svd,
        aten.linalg_qr, aten.linalg_lu_factor_ex, aten.linalg_lu, aten._linalg_solve_ex,
        aten.linalg_solve_triangular, aten.linalg_matrix_exp, aten.linalg_ldl_factor_ex,
    )},
}


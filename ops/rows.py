"""Fused row kernels of the head optimizers' lazy steps (C++, CPU), with a PyTorch fallback.

A lazy step of ``HeadSGD`` / ``HeadAdamW`` updates the R active rows of a (L, d) shard and its
state, and ``update: lazy_exact`` first catches stale rows up on the steps they skipped
(ds_xc/head/lazy_exact.py). In PyTorch each is a gather of every tensor's rows, a few
element-wise passes with temporaries and a scatter back; the kernels of ops/csrc/rows_cpu.cpp
read and write each row once, in place (about 7x faster on 10^5 rows of d = 128, one thread:
docs/ops.md). They compute the same formulas in the same order, in the weight's dtype, fusing
multiply-adds where PyTorch's kernels do (``torch_fuses``): the same bits as the PyTorch path.

Each function returns True when the kernel ran and False when the caller must take its PyTorch
path: tensors on another device than the CPU, a dtype other than float32 / float64 (or mixed
dtypes), non-contiguous tensors, ``DS_XC_NATIVE_ROWS=0`` in the environment, or an op that
does not build (logged once by ds_xc_ops.builders). Row ids are trusted to be in range
(the optimizers derive them from the shard's own gradient and counters); the step kernels
need distinct rows (a coalesced sparse gradient), the catch-up kernels take duplicates.
"""
from __future__ import annotations

import os

import torch

from ds_xc_ops import builders

__all__ = ["ENV", "native_op", "torch_fuses", "sgd_step", "sgd_catch_up", "adamw_step", "adamw_catch_up", "gather_rows",
           "rerank_scores"]

ENV = "DS_XC_NATIVE_ROWS"  # "0": always the PyTorch path
_DTYPES = (torch.float32, torch.float64)


def torch_fuses() -> bool:
    """Whether PyTorch's vectorised CPU kernels fuse multiply-adds here (capability above DEFAULT):
    the kernels then use the FMA build of their loops, so both paths give the same bits."""
    return torch.backends.cpu.get_cpu_capability() != "DEFAULT"


def native_op(*tensors: torch.Tensor):
    """The built rows op when the kernels can take these (value) tensors, else None."""
    if os.environ.get(ENV, "1") == "0" or not tensors:
        return None
    dtype = tensors[0].dtype
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != dtype or dtype not in _DTYPES or not t.is_contiguous():
            return None
    return builders.load_op("rows")


def _ids_ok(*ids: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.int64 and t.is_contiguous() and t.dim() == 1 for t in ids)


def sgd_step(w, buf, rows, grad, lr: float, mu: float, wd: float, nesterov: bool) -> bool:
    """w[rows], buf[rows] <- one SGD step (momentum mu, L2 decay wd) with gradient rows grad (R, d)."""
    op = native_op(w, buf, grad)
    if op is None or not _ids_ok(rows) or w.dim() != 2 or grad.shape != (rows.numel(), w.shape[1]) \
            or buf.shape != w.shape:
        return False
    op.sgd_step(w, buf, rows, grad, float(lr), float(mu), float(wd), bool(nesterov), torch_fuses())
    return True


def sgd_catch_up(w, buf, last, rows, coef, steps: int) -> bool:
    """Catch the stale rows among ``rows`` (R,) of w and buf up to step ``steps`` with coef (n + 1, 2, 2)
    float64 (coef[k] = product of the last k zero-gradient step matrices); marks them in last (L,)."""
    op = native_op(w, buf)
    if op is None or not _ids_ok(rows, last) or not _coef_ok(coef) or buf.shape != w.shape:
        return False
    op.sgd_catch_up(w, buf, last, rows, coef, int(steps), torch_fuses())
    return True


def adamw_step(w, m, v, rows, grad, lr, b1, b2, eps, wd, bc1, bc2) -> bool:
    """w[rows], m[rows], v[rows] <- one AdamW step (decoupled decay; bias corrections bc1, bc2)."""
    op = native_op(w, m, v, grad)
    if op is None or not _ids_ok(rows) or w.dim() != 2 or grad.shape != (rows.numel(), w.shape[1]) \
            or m.shape != w.shape or v.shape != w.shape:
        return False
    op.adamw_step(w, m, v, rows, grad, *(float(a) for a in (lr, b1, b2, eps, wd, bc1, bc2)), torch_fuses())
    return True


def adamw_catch_up(w, m, v, last, rows, coef, steps: int, b1: float, b2: float) -> bool:
    """AdamW's catch-up of the stale rows among ``rows``: w = D*w - C*m/sqrt(v), m *= b1^k, v *= b2^k."""
    op = native_op(w, m, v)
    if op is None or not _ids_ok(rows, last) or not _coef_ok(coef) or m.shape != w.shape or v.shape != w.shape:
        return False
    op.adamw_catch_up(w, m, v, last, rows, coef, int(steps), float(b1), float(b2), torch_fuses())
    return True


def _coef_ok(coef: torch.Tensor) -> bool:
    return (coef.device.type == "cpu" and coef.dtype == torch.float64 and coef.is_contiguous()
            and coef.dim() == 3 and coef.shape[1:] == (2, 2))


def gather_rows(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """src[index] for a 2-D src and 1-D int64 index: (n, d), written into ``out`` when given.

    The rows of a large shard are scattered: the kernel prefetches a few rows ahead (7.4 vs 9.5 ms
    for ``torch.index_select`` on 10^5 of 10^6 rows of d = 128, one thread). Any dtype;
    other devices, non-contiguous tensors or an unbuilt op take ``torch.index_select``. Rows out
    of range raise (IndexError from torch, RuntimeError from the kernel)."""
    if out is None:
        out = torch.empty((index.numel(),) + tuple(src.shape[1:]), dtype=src.dtype, device=src.device)
    op = None
    if os.environ.get(ENV, "1") != "0" and src.device.type == "cpu" and src.dim() == 2 and src.is_contiguous() \
            and _ids_ok(index) and out.is_contiguous() and out.dtype == src.dtype and out.shape == (index.numel(),
                                                                                                 src.shape[1]):
        op = builders.load_op("rows")
    if op is None:
        return torch.index_select(src, 0, index, out=out)
    op.gather_rows(src, index, out)
    return out


def rerank_scores(queries: torch.Tensor, weight: torch.Tensor, candidates: torch.Tensor, cosine: bool):
    """Scores (N, R) of candidate rows (N, R) int64 (-1: none, scored -inf) against queries (N, d):
    q . w (over |w|, at least 1e-12, when ``cosine``), each row read once; or None when the kernel cannot
    take the tensors (float32 contiguous CPU queries and weight, contiguous int64 candidates) and the
    caller gathers the rows itself."""
    op = native_op(queries, weight)
    if op is None or queries.dtype != torch.float32 or candidates.dtype != torch.int64 or candidates.dim() != 2 \
            or not candidates.is_contiguous() or candidates.device.type != "cpu" or weight.dim() != 2 \
            or queries.shape != (candidates.shape[0], weight.shape[1]):
        return None
    return op.rerank_scores(queries, weight, candidates, bool(cosine))

"""Triton kernels of the fused class-parallel margin softmax (driven by ds_xc/head/triton_softmax.py).

Legend: N rows (the global batch chunk), K active classes of this shard, d embedding dim,
S class splits, BM / BN / BD the row / class / hidden-dim tile sizes.

Both kernels recompute the logits of one (BM, BN) tile in registers from x (N, d) and
w (K, d): an fp32 accumulation over d-chunks with ``tl.dot``, then
``z = scale * rx_i * rw_j * <x_i, w_j>`` (plain softmax: scale 1, rx = rw = 1). The target
column of each row is replaced by ``zt_i``, the margin logit computed in torch (-inf for
D-Softmax, whose target leaves the partition function). No (N, K) tensor is ever written.

Inputs are loaded in their storage dtype (fp32, fp16 or bf16) and upcast right after the
load: all arithmetic, and every ``tl.dot``, runs in fp32 (the interpreter computes bf16
arithmetic on the raw bits, and fp32 products of 16-bit values are exact anyway). With
``NATIVE`` (16-bit inputs on a GPU, ``TileConfig.native_dot``) the loaded 16-bit tiles go into
``tl.dot`` as they are (tensor cores, fp32 accumulation; the same products), and the backward
rounds its fp32 coefficient tile and the normalised x tile to the input dtype before its two
dots, as Cut Cross-Entropy does; the element-wise work stays fp32.

This module calls ``@triton.jit`` at import, which is when Triton reads
``TRITON_INTERPRET``: set that variable before the first import.
"""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["forward_stats_kernel", "backward_kernel"]

# finite start of the running max, so exp(m_old - m_new) never sees -inf - -inf; a constexpr
# because compiled kernels may read no other globals (the interpreter does not check this)
_FLOOR = tl.constexpr(-1.0e30)


@triton.jit
def _logits_tile(x_ptr, w_ptr, rows, cols, row_ok, col_ok, D,
                 BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr,
                 NATIVE: tl.constexpr):
    """(BM, BN) fp32 raw dot products <x_i, w_j> of one tile (0 outside the masks)."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    x_base = x_ptr + rows.to(tl.int64)[:, None] * D  # (BM, 1) row starts, int64 offsets
    w_base = w_ptr + cols.to(tl.int64)[:, None] * D  # (BN, 1)
    for d0 in range(0, D, BD):
        dd = d0 + tl.arange(0, BD)
        d_ok = dd < D
        xt = tl.load(x_base + dd[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        wt = tl.load(w_base + dd[None, :], mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        if NATIVE:  # 16-bit operands, fp32 accumulation
            acc = tl.dot(xt, tl.trans(wt), acc)  # (BM, BN)
        else:
            acc = tl.dot(xt.to(tl.float32), tl.trans(wt.to(tl.float32)), acc, input_precision=PRECISION)
    return acc


@triton.jit
def forward_stats_kernel(x_ptr, w_ptr, rx_ptr, rw_ptr, t_ptr, zt_ptr, m_ptr, l_ptr,
                         N, K, D, tiles_per_split, scale,
                         BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr,
                         NATIVE: tl.constexpr = False):
    """Grid (cdiv(N, BM), S). Program (r, s) covers rows [r BM, r BM + BM) and the class tiles
    [s T, s T + T) (T = tiles_per_split), and writes the per-row running max m[s, i] and
    sum-exp l[s, i] = sum_j exp(z_ij - m[s, i]) of its classes (m = -1e30, l = 0 when every
    class is masked)."""
    pid_r = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_r * BM + tl.arange(0, BM)
    row_ok = rows < N
    t = tl.load(t_ptr + rows, mask=row_ok, other=-1)  # (BM,) target column or -1
    rx = tl.load(rx_ptr + rows, mask=row_ok, other=0.0)
    zt = tl.load(zt_ptr + rows, mask=row_ok, other=0.0)
    m = tl.full((BM,), _FLOOR, dtype=tl.float32)
    lsum = tl.zeros((BM,), dtype=tl.float32)
    for i in range(tiles_per_split):
        cols = (split * tiles_per_split + i) * BN + tl.arange(0, BN)
        col_ok = cols < K
        rw = tl.load(rw_ptr + cols, mask=col_ok, other=0.0)
        z = _logits_tile(x_ptr, w_ptr, rows, cols, row_ok, col_ok, D, BM, BN, BD, PRECISION, NATIVE)
        z = z * (scale * rx[:, None] * rw[None, :])  # (BM, BN) logits
        z = tl.where(cols[None, :] == t[:, None], zt[:, None], z)  # the margin target logit
        z = tl.where(col_ok[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        lsum = lsum * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
        m = m_new
    out = split.to(tl.int64) * N + rows
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(l_ptr + out, lsum, mask=row_ok)


@triton.jit
def _grad_tile(x_ptr, w_ptr, rx, rw, t, lse, gt, rows, cols, row_ok, col_ok, D, scale,
               BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr,
               NATIVE: tl.constexpr):
    """(BM, BN) fp32 gradient coefficients times rw_j: d(sum of loss rows)/d(c_ij) * rw_j, where
    c is the cosine (raw logit for plain softmax): scale * p_ij off the target, gt_i on it."""
    z = _logits_tile(x_ptr, w_ptr, rows, cols, row_ok, col_ok, D, BM, BN, BD, PRECISION, NATIVE)
    z = z * (scale * rx[:, None] * rw[None, :])
    g = scale * tl.exp(z - lse[:, None])  # (BM, BN) scale * softmax probability
    g = tl.where(cols[None, :] == t[:, None], gt[:, None], g)
    g = tl.where(row_ok[:, None] & col_ok[None, :], g, 0.0)
    return g * rw[None, :]


@triton.jit
def backward_kernel(x_ptr, w_ptr, rx_ptr, rw_ptr, t_ptr, lse_ptr, gt_ptr, gxp_ptr, gw_ptr,
                    N, K, D, tiles_per_split, scale,
                    NEED_GX: tl.constexpr, NEED_GW: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr,
                    NATIVE: tl.constexpr = False):
    """Grid (S,). Program s owns the class tiles [s T, s T + T) and loops over all row tiles:

    - gxp[s] (N, d) += G Wt, the partial of A = G W over its classes (the caller sums the S
      partials); G is the (BM, BN) output of ``_grad_tile``;
    - gw[j] (d,) += sum_i G_ij rx_i x_i, i.e. rw_j d/d(w_j / |w_j|), for its own rows j (the
      caller zeroes or keeps gw, and applies the normalisation's backward).

    Every output element has exactly one writer: no atomics, deterministic.
    """
    split = tl.program_id(0)
    for i in range(tiles_per_split):
        cols = (split * tiles_per_split + i) * BN + tl.arange(0, BN)
        col_ok = cols < K
        rw = tl.load(rw_ptr + cols, mask=col_ok, other=0.0)
        w_base = w_ptr + cols.to(tl.int64)[:, None] * D  # (BN, 1)
        gw_base = gw_ptr + cols.to(tl.int64)[:, None] * D
        for r0 in range(0, N, BM):
            rows = r0 + tl.arange(0, BM)
            row_ok = rows < N
            t = tl.load(t_ptr + rows, mask=row_ok, other=-1)
            rx = tl.load(rx_ptr + rows, mask=row_ok, other=0.0)
            lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
            gt = tl.load(gt_ptr + rows, mask=row_ok, other=0.0)
            g = _grad_tile(x_ptr, w_ptr, rx, rw, t, lse, gt, rows, cols, row_ok, col_ok, D, scale,
                           BM, BN, BD, PRECISION, NATIVE)  # (BM, BN)
            x_base = x_ptr + rows.to(tl.int64)[:, None] * D  # (BM, 1)
            gx_base = gxp_ptr + (split.to(tl.int64) * N + rows.to(tl.int64))[:, None] * D
            for d0 in range(0, D, BD):
                dd = d0 + tl.arange(0, BD)
                d_ok = dd < D
                if NEED_GX:
                    wt = tl.load(w_base + dd[None, :], mask=col_ok[:, None] & d_ok[None, :], other=0.0)  # (BN, BD)
                    gmask = row_ok[:, None] & d_ok[None, :]
                    part = tl.load(gx_base + dd[None, :], mask=gmask, other=0.0)
                    if NATIVE:
                        part = tl.dot(g.to(wt.dtype), wt, part)  # (BM, BD)
                    else:
                        part = tl.dot(g, wt.to(tl.float32), part, input_precision=PRECISION)
                    tl.store(gx_base + dd[None, :], part, mask=gmask)
                if NEED_GW:
                    xr = tl.load(x_base + dd[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
                    xt = xr.to(tl.float32) * rx[:, None]  # (BM, BD) normalised rows
                    wmask = col_ok[:, None] & d_ok[None, :]
                    acc = tl.load(gw_base + dd[None, :], mask=wmask, other=0.0)
                    if NATIVE:
                        acc = tl.dot(tl.trans(g.to(xr.dtype)), xt.to(xr.dtype), acc)  # (BN, BD)
                    else:
                        acc = tl.dot(tl.trans(g), xt, acc, input_precision=PRECISION)
                    tl.store(gw_base + dd[None, :], acc, mask=wmask)

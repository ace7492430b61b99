"""Fused class-parallel margin softmax with Triton kernels: the (N, K) logits never exist.

Legend: N rows of the global batch, K active classes of this shard, d embedding dim,
S class splits.

Same contract as :func:`ds_xc.head.softmax.fused_loss_and_grads` (the PyTorch path that
defines the semantics): the sum of the loss rows and its gradients, class-parallel over
``group``. Three phases per call:

1. torch, O(N d): fp32 inverse row norms rx, rw (cosine losses), each row's target cosine
   by a gather-dot (the target column lives on exactly one rank), and the margin logit
   (z_t, dz_t) from :class:`ds_xc.head.margins.TargetLoss` (margins need acos, which has no
   Triton equivalent under the interpreter).
2. ``forward_stats_kernel``: per (row tile, class split) the running (max, sum-exp) of the
   local logits, target replaced by z_t (masked out for D-Softmax). torch merges the splits,
   then all-reduces MAX of the row max and SUM of [rescaled sum-exp, target term] over
   ``group`` through :class:`~ds_xc.head.softmax.Reducer`, exactly as the PyTorch path.
3. ``backward_kernel`` (only when a gradient is asked): recomputes every tile, forms
   p = exp(z - lse) and the gradient coefficients, and accumulates A = G W (S partials
   of (N, d), summed here) and rw * d/d(w/|w|) (K, d) per class tile (one writer per
   element: deterministic). torch then applies the normalisation's backward,
   dX_i = rx_i (A_i - (A_i . xhat_i) xhat_i), and :func:`finish_weight_grad` for W.

``chunk_size`` is accepted for the contract and ignored: the kernels hold one tile of
logits at a time, and the extra memory is S (N, d) fp32 partials of dX plus O(S N).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ds_xc.head.margins import TargetLoss
from ds_xc.head.row_terms import DEFAULT_TERMS, RowTerms
from ds_xc_ops.triton_util import device_guard, interpreting
from ds_xc.head.softmax import Reducer, finish_weight_grad, inverse_row_norms, merge_row_stats, normalise_grad_scale

__all__ = ["triton_fused_loss_and_grads", "TileConfig", "default_tiles", "gpu_tiles", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_EPS = 1e-12  # the PyTorch path's floor under the row norms


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Launch parameters. block_* are powers of two >= 16 (tl.dot's minimum); ``splits`` is
    the number of class splits S (programs of the backward, second grid axis of the forward);
    ``precision`` is tl.dot's input_precision: "ieee" (full fp32) or "tf32" (GPU only, faster);
    ``max_partial_bytes`` caps the backward's S (N, d) fp32 dX partials by using fewer splits
    there (at least one); ``native_dot`` feeds 16-bit inputs to tl.dot without the fp32 upcast
    (tensor cores; the backward's coefficients rounded to the input dtype), ignored for fp32 inputs
    and under the interpreter (which computes bf16 on raw bits)."""
    block_m: int = 64
    block_n: int = 64
    block_d: int = 32
    splits: int = 128
    precision: str = "ieee"
    num_warps: int = 4
    max_partial_bytes: int = 1 << 30
    native_dot: bool = False  # 16-bit tiles straight into tl.dot (GPU only; ops/triton_softmax_kernels.py)
    num_stages: Optional[int] = None  # software pipelining depth (None: Triton's default)

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_d"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"TileConfig.{name} = {v} must be a power of two >= 16")
        if self.splits < 1:
            raise ValueError(f"TileConfig.splits = {self.splits} must be >= 1")
        if self.precision not in ("ieee", "tf32"):
            raise ValueError(f"TileConfig.precision = {self.precision!r}: allowed 'ieee', 'tf32'")


def gpu_tiles(dtype: torch.dtype, num_sms: int) -> TileConfig:
    """GPU tiles for inputs stored in ``dtype``. 16-bit inputs go into tl.dot as they are (tensor
    cores, fp32 accumulation) in 128 x 128 x 64 tiles, 8 warps, 3 stages: the fastest of the
    configurations swept on an H200 (benchmarks/results/gpu_check_run3.md: forward + backward at
    N = 1024, d = 128 in 2.27 ms for K = 10^5 and 13.2 ms for K = 10^6, against 3.25 / 26.0 ms for the
    PyTorch path in one chunk and 4.6 / 30.9 ms for the earlier fp32-upcast tf32 64 x 64 x 32 tiles).
    float32 inputs keep "ieee" (fp32 FMA, like torch's default matmul): 4x slower than the PyTorch
    path in that run, which ``softmax_backend: auto`` therefore keeps for float32 weights."""
    if dtype in (torch.bfloat16, torch.float16):
        return TileConfig(block_m=128, block_n=128, block_d=64, splits=2 * num_sms, precision="tf32", num_warps=8,
                          native_dot=True, num_stages=3)
    return TileConfig(block_m=64, block_n=32, block_d=16, splits=2 * num_sms, precision="ieee", num_warps=8)


def default_tiles(device: torch.device, dtype: torch.dtype = torch.float32) -> TileConfig:
    """Small tiles under the interpreter (numpy per block), :func:`gpu_tiles` otherwise."""
    if interpreting() or device.type != "cuda":
        return TileConfig(block_m=16, block_n=16, block_d=16, splits=3, num_warps=1)
    return gpu_tiles(dtype, torch.cuda.get_device_properties(device).multi_processor_count)


def _check(x, w, targets, gw, accumulate):
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"expected x (N, d) and w (K, d) with equal d, got {tuple(x.shape)} and {tuple(w.shape)}")
    for name, t in (("x", x), ("w", w)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"triton softmax: {name}.dtype = {t.dtype}; allowed {SUPPORTED_DTYPES} "
                             "(use the torch backend for float64)")
    if targets.shape != (x.shape[0],):
        raise ValueError(f"targets must have shape ({x.shape[0]},), got {tuple(targets.shape)}")
    if gw is not None and (gw.dtype != torch.float32 or gw.shape != w.shape or not gw.is_contiguous()):
        raise ValueError(f"gw must be a contiguous float32 tensor of shape {tuple(w.shape)}, got "
                         f"{gw.dtype} {tuple(gw.shape)}")
    if accumulate and gw is None:
        raise ValueError("accumulate=True needs the gw buffer to add to")


def _target_cosines(x, w, targets, rx, rw, has_t):
    """(N,) fp32 target cosine (raw target logit for plain softmax), 0 where the target is elsewhere."""
    tt = torch.where(has_t, targets, torch.zeros_like(targets))
    c = (x.float() * w.index_select(0, tt).float()).sum(dim=1)  # (N,) gather-dot
    c = c * rx * rw.index_select(0, tt)
    return torch.where(has_t, c, torch.zeros_like(c))


def _row_stats(x, w, rx, rw, t32, zt, tiles, scale):
    """Launch the forward kernel; (N,) local row max and sum-exp (sum-exp 0 where all masked)."""
    from ds_xc_ops.triton_softmax_kernels import forward_stats_kernel
    n, d = x.shape
    k = w.shape[0]
    num_tiles = _cdiv(k, tiles.block_n)
    per = _cdiv(num_tiles, min(tiles.splits, num_tiles))
    splits = _cdiv(num_tiles, per)
    m = torch.empty((splits, n), dtype=torch.float32, device=x.device)  # (S, N)
    lsum = torch.empty_like(m)
    grid = (_cdiv(n, tiles.block_m), splits)
    with device_guard(x):  # launched on the tensors' GPU, whatever the current device
        forward_stats_kernel[grid](x, w, rx, rw, t32, zt, m, lsum, n, k, d, per, scale,
                                   BM=tiles.block_m, BN=tiles.block_n, BD=tiles.block_d,
                                   PRECISION=tiles.precision, NATIVE=_native(tiles, x, w), **_launch(tiles))
    m_loc = m.max(dim=0).values  # (N,)
    lsum = torch.where(lsum > 0, lsum * torch.exp(m - m_loc[None, :]), torch.zeros_like(lsum)).sum(dim=0)
    return m_loc, lsum


def _native(tiles: TileConfig, x: torch.Tensor, w: torch.Tensor) -> bool:
    """16-bit operands into tl.dot: asked for, both inputs of one 16-bit dtype, compiled (not interpreted)."""
    return (tiles.native_dot and x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16)
            and not interpreting())


def _launch(tiles: TileConfig) -> dict:
    return {"num_warps": tiles.num_warps, **({"num_stages": tiles.num_stages} if tiles.num_stages else {})}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _gradients(x, w, rx, rw, t32, lse, gt, need_gx, need_gw, gw, tiles, scale):
    """Launch the backward kernel; returns A (N, d) fp32 or None, and adds into gw (K, d)."""
    from ds_xc_ops.triton_softmax_kernels import backward_kernel
    n, d = x.shape
    k = w.shape[0]
    num_tiles = _cdiv(k, tiles.block_n)
    cap = max(1, tiles.max_partial_bytes // max(4 * n * d, 1)) if need_gx else tiles.splits
    per = _cdiv(num_tiles, min(tiles.splits, cap, num_tiles))
    splits = _cdiv(num_tiles, per)
    gxp = torch.zeros((splits, n, d) if need_gx else (1,), dtype=torch.float32, device=x.device)  # (S, N, d)
    gw_arg = gw if need_gw else torch.zeros((1,), dtype=torch.float32, device=x.device)
    with device_guard(x):
        backward_kernel[(splits,)](x, w, rx, rw, t32, lse, gt, gxp, gw_arg, n, k, d, per, scale,
                                   NEED_GX=need_gx, NEED_GW=need_gw,
                                   BM=tiles.block_m, BN=tiles.block_n, BD=tiles.block_d,
                                   PRECISION=tiles.precision, NATIVE=_native(tiles, x, w), **_launch(tiles))
    return gxp.sum(dim=0) if need_gx else None  # (N, d)


@dataclasses.dataclass
class _Rows:
    """Per-row fp32 inputs of the kernels, all (N,) except rw (K,)."""
    rx: torch.Tensor  # 1 / |x_i| (ones for plain softmax)
    rw: torch.Tensor  # 1 / |w_j| (ones for plain softmax)
    t32: torch.Tensor  # target column or -1, int32
    has_t: torch.Tensor  # bool: the target lives on this shard
    c_t: torch.Tensor  # target cosine (raw logit for plain softmax), 0 elsewhere
    zt: torch.Tensor  # target logit with the margin; -inf for D-Softmax (masked out)
    dz_t: Optional[torch.Tensor]  # d zt / d c_t (None for D-Softmax)
    scale: float


def _prepare(x, w, targets, loss: TargetLoss, rw) -> _Rows:
    """Norms, the target gather-dot and the margin, in torch on (N,) vectors."""
    n, k, dev = x.shape[0], w.shape[0], x.device
    targets = targets.to(device=dev, dtype=torch.int64)
    has_t = targets >= 0
    if loss.normalised:
        rx = 1.0 / x.float().norm(dim=1).clamp_min(_EPS)  # (N,)
        rw = (rw if rw is not None else inverse_row_norms(w, loss)).float().contiguous()  # (K,)
    else:
        rx = torch.ones(n, dtype=torch.float32, device=dev)
        rw = torch.ones(k, dtype=torch.float32, device=dev)
    c_t = _target_cosines(x, w, targets, rx, rw, has_t) if k else torch.zeros(n, device=dev)  # (N,)
    dz_t = None
    if loss.separate_target:
        zt = torch.full((n,), float("-inf"), dtype=torch.float32, device=dev)
    else:
        zt, dz_t = loss.target_logit(c_t)
        zt = torch.where(has_t, zt, torch.zeros_like(zt)).float().contiguous()
    return _Rows(rx, rw, targets.to(torch.int32).contiguous(), has_t, c_t, zt, dz_t,
                 float(loss.scale) if loss.normalised else 1.0)


def _combine(m_loc, l_loc, r: _Rows, loss: TargetLoss, red: Reducer, terms: RowTerms, zsum):
    """Class-parallel merge of the local row stats, as the PyTorch path: one all-gather of
    [row max, sum-exp against it, target term, (smoothing) logit sum], merged by
    :func:`merge_row_stats`. Returns (weighted rows (N,), lse (N,), a (N,), gt (N,)): the loss
    rows v_i row_i, the log partition function, each row's factor a_i = v_i (1 + 2 z_loss lse_i) of its
    probabilities in the gradient, and v_i d row / d c at the target."""
    zero = torch.zeros((), dtype=torch.float32, device=m_loc.device)
    target = r.c_t if loss.separate_target else torch.where(r.has_t, r.zt, zero)
    cols = [m_loc, l_loc, target.to(m_loc.dtype)] + ([zsum.to(m_loc.dtype)] if terms.smoothing else [])
    m, sumexp, target, *zs = merge_row_stats(red.gather(torch.stack(cols, 1)).result(), loss.separate_target)
    lse = m + torch.log(sumexp)
    rows, d_intra = terms.rows(lse, target, zs[0] if zs else None, loss)
    v = terms.weight
    rows = terms.record(rows, lse, v)
    pfac = 1.0 + 2.0 * terms.z_loss * lse if terms.z_loss else torch.ones_like(lse)
    p_t = None if loss.separate_target else torch.exp(r.zt - lse)
    gt = terms.target_grad(p_t, pfac, r.dz_t, r.scale, d_intra, loss)
    if v is not None:
        gt, pfac = gt * v, pfac * v
    gt = torch.where(r.has_t, gt, zero).float().contiguous()
    return rows, lse.contiguous(), pfac, gt


def _signed_gradients(x, w, r: _Rows, lse, a, gt, need_gx, need_gw, gw, tiles, signed: bool):
    """The backward kernel for per-row factors ``a`` (N,) (off the target: scale p_ij a_i) and target terms
    ``gt``: the kernel's exp(z - lse_k) with lse_k = lse - log a takes a > 0 only, so rows whose factor may
    be negative (``signed``: sample weights, or reduction none's upstream gradient) run in a second launch
    with |a| and -gt, subtracted (gw through a scratch). Returns A (N, d) fp32 or None; adds into gw."""
    def lse_for(f):
        return torch.where(f > 0, lse - torch.log(f.clamp_min(1e-30)), float("inf")).float().contiguous()
    if not signed:
        return _gradients(x, w, r.rx, r.rw, r.t32, lse_for(a), gt, need_gx, need_gw, gw, tiles, r.scale)
    neg = a < 0
    zero = torch.zeros_like(gt)
    pos_gt = torch.where(neg, zero, gt).contiguous()
    out = _gradients(x, w, r.rx, r.rw, r.t32, lse_for(a), pos_gt, need_gx, need_gw, gw, tiles, r.scale)
    scratch = torch.zeros_like(gw) if need_gw else None
    back = _gradients(x, w, r.rx, r.rw, r.t32, lse_for(-a), torch.where(neg, -gt, zero).contiguous(), need_gx,
                      need_gw, scratch, tiles, r.scale)
    if need_gw:
        gw -= scratch
    return None if out is None else out - back


def _logit_sums(x, w, r: _Rows, loss: TargetLoss):
    """(N,) the sum of this shard's logits per row (the target's with its margin) and (d,) the column
    sum sum_j rw_j w_j it is made of, in torch: O((N + K) d), no pass over the logits."""
    wsum = (w.float() * r.rw[:, None]).sum(dim=0)  # (d,)
    zsum = r.scale * r.rx * (x.float() @ wsum)  # (N,)
    if not loss.separate_target:  # the target's logit with its margin instead of s c_t
        zsum = zsum + torch.where(r.has_t, r.zt - r.scale * r.c_t, torch.zeros_like(zsum))
    return zsum, wsum


def triton_fused_loss_and_grads(x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, loss: TargetLoss,
                                group=None, chunk_size: int = 0, need_gx: bool = True, need_gw: bool = True,
                                *, rw: Optional[torch.Tensor] = None, gw: Optional[torch.Tensor] = None,
                                accumulate: bool = False, finish: bool = True,
                                tiles: Optional[TileConfig] = None, terms: Optional[RowTerms] = None):
    """Sum of the N loss rows and its gradients, as :func:`ds_xc.head.softmax.fused_loss_and_grads`.

    x (N, d) and w (K, d) fp32, bf16 or fp16 (x is cast to a 16-bit w's dtype first, as the PyTorch
    path does; element-wise work in fp32); targets (N,) int
    column of each row's class in w, or -1 where it lives on another rank of ``group``.
    Returns (total: fp32 scalar, gx (N, d) fp32 or None, gw (K, d) fp32 or None). ``rw``,
    ``gw``, ``accumulate`` and ``finish`` mean what they mean there; ``tiles`` overrides
    :func:`default_tiles`. Every rank of ``group`` must call it with the same N. ``terms``: the
    per-row terms (weights, label smoothing, z-loss; softcap is refused by ``resolve_softmax``).
    """
    terms = DEFAULT_TERMS if terms is None else terms
    if terms.softcap:
        raise ValueError("the Triton softmax kernels do not support extreme_classification.loss.softcap")
    _check(x, w, targets, gw, accumulate)
    if w.dtype in (torch.bfloat16, torch.float16) and x.dtype != w.dtype:
        x = x.to(w.dtype)  # as the PyTorch path (x.to(w.dtype)): one 16-bit tile type, on tensor cores
    tiles = tiles or default_tiles(x.device, w.dtype if w.dtype == x.dtype else torch.float32)
    n, k, dev = x.shape[0], w.shape[0], x.device
    x, w = x.contiguous(), w.contiguous()
    r = _prepare(x, w, targets, loss, rw)
    if n and k:
        m_loc, l_loc = _row_stats(x, w, r.rx, r.rw, r.t32, r.zt, tiles, r.scale)  # (N,), (N,)
    else:
        m_loc = torch.full((n,), -1.0e30, dtype=torch.float32, device=dev)
        l_loc = torch.zeros(n, dtype=torch.float32, device=dev)
    zsum = wsum = None
    if terms.smoothing:
        zsum, wsum = _logit_sums(x, w, r, loss)
    rows, lse, a_rows, gt = _combine(m_loc, l_loc, r, loss, Reducer(group), terms, zsum)
    total = rows.sum()
    if need_gw and gw is None:
        gw = torch.empty((k, w.shape[1]), dtype=torch.float32, device=dev)  # (K, d)
    if need_gw and not accumulate:
        gw.zero_()
    if not (need_gx or need_gw):
        return total, None, None
    a = None
    if n and k:
        a = _signed_gradients(x, w, r, lse, a_rows, gt, need_gx, need_gw, gw, tiles, terms.signed)  # (N, d)
    if terms.smoothing:  # the rank-1 term -b_i s rw_j of every entry (the kernel's gt holds the target's rest)
        b = torch.full_like(lse, terms.smoothing / terms.num_classes)
        if terms.weight is not None:
            b = b * terms.weight.float()
        if need_gx and a is not None:
            a = a - (r.scale * b)[:, None] * wsum[None, :]
        if need_gw and n:
            bx = (b[:, None] * x.float() * r.rx[:, None]).sum(dim=0)  # (d,)
            gw.addcmul_((r.scale * r.rw)[:, None], bx[None, :], value=-1.0)
    gx = None
    if need_gx:
        gx = a if a is not None else torch.zeros(x.shape, dtype=torch.float32, device=dev)
        if loss.normalised:  # through x/|x|: remove the radial part, divide by |x|
            xhat = x.float() * r.rx[:, None]  # (N, d)
            gx = (gx - xhat * (gx * xhat).sum(dim=1, keepdim=True)) * normalise_grad_scale(x.float())[:, None]
    if need_gw and finish:
        finish_weight_grad(gw, w, r.rw, loss)
    return total, gx, gw

"""Class-sharded softmax / margin cross entropy, fused with its gradient, in row chunks.

Legend: N rows of the global batch, K active classes of this shard, d embedding dim,
n rows of one chunk.

Each rank holds K of the classes. For every chunk of rows it computes the chunk's logits
(n, K), all-reduces the row max and then [sum-exp, target term] over the group, and,
because the loss is the last operation of the graph, turns the logits buffer straight
into d(loss)/d(logits) and multiplies it out into the gradients of the embeddings
(N, d) and of the active weight rows (K, d). The (N, K) logits never exist at once
(Cut Cross-Entropy and Liger's fused linear cross entropy do the same in one process);
backward only rescales the stored gradients by ``grad_output``.

Cosine losses never materialise normalised copies of x or W: logits are x.W^T scaled by
the inverse row norms, and the normalisation's backward is applied at the end
(dw_j = G_j - rw_j^2 <W_j, G_j> W_j with G = (g * rw)^T xn).

The maths in :func:`_chunk_step` is plain tensor code; communication goes through a
``Reducer`` so that one process can test the maths alone.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist

from ds_xc.head.margins import TargetLoss
from ds_xc.parallel.groups import is_distributed

__all__ = ["sharded_margin_loss", "fused_loss_and_grads", "finish_weight_grad", "inverse_row_norms", "Reducer"]

_EPS = 1e-12


class Reducer:
    """All-reduces over ``group`` (no-ops with one rank). In place, returns the tensor."""

    def __init__(self, group=None):
        self.group = group
        self.active = is_distributed(group)

    def max_(self, t: torch.Tensor) -> torch.Tensor:
        if self.active:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        if self.active:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics run in at least float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_step(x, w, rw, t, loss: TargetLoss, red: Reducer, need_grad: bool, buf: torch.Tensor):
    """Loss rows of one chunk and, if asked, its gradient in factored form.

    x (n, d) chunk rows; w (K, d) active weights; rw (K,) inverse row norms (cosine losses)
    or None; t (n,) target column in [0, K) or -1 when the target lives elsewhere; buf
    (n, K) scratch for the logits, reused across chunks.

    Returns (loss (n,), M (n, K) or None, inv (n,), xs (n, d)). The gradient of the summed
    loss rows with respect to the cosines (raw logits for plain softmax), times rw per
    column for cosine losses, is ``inv[:, None] * M``: the softmax's row normalisation is
    kept out of the (n, K) buffer and applied to the small (n, d) products instead. ``xs``
    is the chunk's normalised rows (cosine losses) or the chunk itself.
    """
    sd = buf.dtype
    if loss.normalised:
        rx = 1.0 / x.to(sd).norm(dim=1).clamp_min(_EPS)  # (n,)
        xs = x.to(sd) * rx[:, None]  # (n, d) normalised rows
        _mm(xs * loss.scale, w, buf)  # (n, K) = s * x/|x| . w
        logits = buf.mul_(rw[None, :])  # s * cos
    else:
        xs = x
        logits = _mm(x, w, buf)
    has_t = t >= 0
    tt = torch.where(has_t, t, torch.zeros_like(t))[:, None]  # (n, 1)
    zero = torch.zeros((), dtype=sd, device=x.device)
    c_t = torch.where(has_t, logits.gather(1, tt).squeeze(1) / loss.scale, zero)  # target cosine / raw logit

    if loss.separate_target:  # D-Softmax: the target leaves the partition function
        logits.scatter_(1, tt, torch.where(has_t, float("-inf"), logits.gather(1, tt).squeeze(1))[:, None])
        m = red.max_(logits.amax(dim=1)).clamp_min_(0.0)  # the "1 +" term is logit 0
    else:
        z_t, dz_t = loss.target_logit(c_t)
        z_t = torch.where(has_t, z_t, logits.gather(1, tt).squeeze(1))
        logits.scatter_(1, tt, z_t[:, None])
        m = red.max_(logits.amax(dim=1))  # (n,)

    e = logits.sub_(m[:, None]).exp_()  # (n, K) unnormalised probabilities, in the buffer
    stats = torch.stack([e.sum(dim=1), c_t if loss.separate_target else torch.where(has_t, z_t, zero)], 1)
    red.sum_(stats)  # (n, 2): sum-exp over all classes, target term (lives on exactly one rank)
    sumexp, target = stats[:, 0], stats[:, 1]
    if loss.separate_target:
        sumexp = sumexp + torch.exp(-m)
        intra, d_intra = loss.target_term(target)
        rows = m + torch.log(sumexp) + intra
    else:
        rows = m + torch.log(sumexp) - target
    if not need_grad:
        return rows, None, None, xs

    inv = 1.0 / sumexp  # (n,)
    # off the target: d rows / d logit = e * inv, and d logit / d cos = s
    if loss.separate_target:
        g_t = d_intra
    else:
        g_t = (e.gather(1, tt).squeeze(1) * inv - 1.0) * dz_t
    if loss.normalised:
        e.mul_((loss.scale * rw)[None, :])
        g_t = g_t * rw[tt.squeeze(1)]
    # the target entry in the same units: M = g / inv
    e.scatter_(1, tt, torch.where(has_t, g_t * sumexp, e.gather(1, tt).squeeze(1))[:, None])
    return rows, e, inv, xs


_MM_ROWS = 1 << 14  # weight rows per float32 block of a low-precision logits matmul on CPU
_CUDA_OUT_DTYPE = [True]  # whether torch.mm(..., out_dtype=) works on CUDA (checked at first use)


def _mm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (n, K) = a (n, d) @ w^T, in the statistics dtype.

    Low-precision (bf16) weights: the products are accumulated and written in float32, never
    rounded to bf16 (a bf16 logit of magnitude 32-64 would be off by up to 0.125): on CUDA one
    matmul with a float32 output; elsewhere (no such kernel) float32 blocks of weight rows.
    """
    if a.dtype == w.dtype == out.dtype:
        return torch.mm(a, w.t(), out=out)
    if w.is_cuda and out.dtype == torch.float32 and _CUDA_OUT_DTYPE[0]:
        try:
            out.copy_(torch.mm(a.to(w.dtype), w.t(), out_dtype=torch.float32))
            return out
        except (RuntimeError, NotImplementedError, TypeError) as exc:  # a torch without mm(out_dtype=)
            _CUDA_OUT_DTYPE[0] = False
            logging.getLogger(__name__).warning("torch.mm(out_dtype=float32) unavailable (%s): bf16 logits "
                                                "use float32 blocks of weight rows", exc)
    a32 = a.to(out.dtype)
    for k in range(0, w.shape[0], _MM_ROWS):
        torch.mm(a32, w[k: k + _MM_ROWS].to(out.dtype).t(), out=out[:, k: k + _MM_ROWS])  # (n, block)
    return out


def _accumulate(gw: torch.Tensor, m: torch.Tensor, x: torch.Tensor, first: bool) -> None:
    """gw (K, d) (+)= m^T (K, n) @ x (n, d), in place; the first chunk overwrites (no zero fill)."""
    if m.dtype == gw.dtype and x.dtype == gw.dtype:
        if first:
            torch.mm(m.t(), x, out=gw)
        else:
            gw.addmm_(m.t(), x)
        return
    prod = (m.t().to(x.dtype) @ x).to(gw.dtype)  # low-precision weights: accumulate in float32
    if first:
        gw.copy_(prod)
    else:
        gw += prod


def inverse_row_norms(w: torch.Tensor, loss: TargetLoss) -> Optional[torch.Tensor]:
    """(K,) 1/|w_j| in the statistics dtype for cosine losses; None for plain softmax."""
    return (1.0 / w.to(_stat_dtype(w.dtype)).norm(dim=1).clamp_min(_EPS)) if loss.normalised else None


def finish_weight_grad(gw: torch.Tensor, w: torch.Tensor, rw: Optional[torch.Tensor], loss: TargetLoss) -> None:
    """Cosine losses: turn the accumulated G = rw * d/d(w/|w|) into d/dW, in place, row-wise:
    dW_j = G_j - rw_j^2 <W_j, G_j> W_j (no (K, d) temporary). Plain softmax: nothing to do."""
    if not loss.normalised:
        return
    wf = w.to(gw.dtype)
    radial = torch.bmm(wf.unsqueeze(1), gw.unsqueeze(2)).view(w.shape[0])  # (K,)
    gw.addcmul_(wf, (rw * rw * radial)[:, None], value=-1.0)


def fused_loss_and_grads(x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, loss: TargetLoss,
                         group=None, chunk_size: int = 0, need_gx: bool = True, need_gw: bool = True, *,
                         rw: Optional[torch.Tensor] = None, gw: Optional[torch.Tensor] = None,
                         accumulate: bool = False, finish: bool = True, backend: str = "torch"):
    """Sum of the N loss rows and its gradients, in one pass over row chunks (no autograd).

    x (N, d), w (K, d), targets (N,) as for :func:`sharded_margin_loss`. Returns
    (total: scalar sum of the rows, gx (N, d) or None, gw (K, d) or None), in the
    statistics dtype: the gradients of ``total`` itself (divide by N for the mean).
    Every rank of ``group`` must call it with the same N (the softmax statistics are
    all-reduced per chunk).

    The overlap schedule (ds_xc/overlap) calls it once per micro-chunk with the same
    weights, so the O(K d) work is hoisted: ``rw`` (:func:`inverse_row_norms`, computed
    once), ``gw`` a (K, d) buffer that the call overwrites or, with ``accumulate``, adds
    to, and ``finish=False`` to leave the cosine normalisation's backward to one
    :func:`finish_weight_grad` at the end.

    ``backend`` (``extreme_classification.softmax_backend``): "torch" runs the code below;
    "triton" or "auto" may hand the call to the fused Triton kernels (ds_xc/head/softmax_backend.py).
    """
    if backend != "torch":
        from ds_xc.head.softmax_backend import resolve_softmax  # lazy: triton loads only when asked
        fused = resolve_softmax(backend, x, w)
        out = None if fused is None else fused(x, w, targets, loss, group, chunk_size, need_gx, need_gw,
                                               rw=rw, gw=gw, accumulate=accumulate, finish=finish)
        if out is not None:  # None: auto fell back (the kernels could not launch here)
            return out
    need_grad = need_gx or need_gw
    red = Reducer(group)
    n_rows, k = x.shape[0], w.shape[0]
    sd = _stat_dtype(w.dtype)
    xw = x.to(w.dtype)
    if rw is None:
        rw = inverse_row_norms(w, loss)  # (K,)
    gx = torch.empty(x.shape, dtype=sd, device=x.device) if need_gx else None  # (N, d)
    if need_gw and gw is None:
        gw = torch.empty((k, w.shape[1]), dtype=sd, device=w.device)  # (K, d)
    total = torch.zeros((), dtype=sd, device=x.device)
    step = chunk_size if chunk_size > 0 else max(n_rows, 1)
    buf = torch.empty((min(step, n_rows), k), dtype=sd, device=x.device)  # (n, K), one for all chunks
    for a in range(0, n_rows, step):
        xc = xw[a: a + step]
        rows, m, inv, xs = _chunk_step(xc, w, rw, targets[a: a + step], loss, red, need_grad,
                                       buf[: xc.shape[0]])
        total += rows.sum()
        if m is None:
            continue
        if need_gx:
            gxs = _mm_rows(m, w) * inv[:, None]  # (n, d): d/d(xs)
            if loss.normalised:  # through x/|x|: remove the radial part, divide by |x|
                radial = (gxs * xs).sum(dim=1, keepdim=True)
                gxs = (gxs - xs * radial) * (1.0 / xc.to(sd).norm(dim=1).clamp_min(_EPS))[:, None]
            gx[a: a + step] = gxs
        if need_gw:
            _accumulate(gw, m, xs.to(sd) * inv[:, None], first=a == 0 and not accumulate)
    if need_gw and n_rows == 0 and not accumulate:
        gw.zero_()
    if need_gw and finish:
        finish_weight_grad(gw, w, rw, loss)
    return total, gx, gw


class _ShardedMarginLoss(torch.autograd.Function):
    """forward: mean loss over the N rows (and the gradients, computed on the fly);
    backward: the stored gradients times grad_output."""

    @staticmethod
    def forward(ctx, x, w, targets, loss, group, chunk_size, backend="torch"):
        total, gx, gw = fused_loss_and_grads(x, w, targets, loss, group, chunk_size,
                                             ctx.needs_input_grad[0], ctx.needs_input_grad[1], backend=backend)
        ctx.grads = (gx, gw)
        ctx.n_rows = max(x.shape[0], 1)
        ctx.dtypes = (x.dtype, w.dtype)
        return total / ctx.n_rows

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.grads is None:
            raise RuntimeError("the ds_xc head's backward ran twice on one forward; "
                               "retain_graph is not supported by the fused loss")
        gx, gw = ctx.grads
        ctx.grads = None  # release our references: autograd may adopt the buffers as .grad
        scale = grad_out / ctx.n_rows
        if gx is not None:
            gx = gx.mul_(scale).to(ctx.dtypes[0])
        if gw is not None:
            gw = gw.mul_(scale).to(ctx.dtypes[1])
        return gx, gw, None, None, None, None, None


def _mm_rows(m: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """m (n, K) @ w (K, d) -> (n, d) in m's dtype."""
    if m.dtype == w.dtype:
        return m @ w
    return (m.to(w.dtype) @ w).to(m.dtype)


def sharded_margin_loss(x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, loss: TargetLoss,
                        group=None, chunk_size: int = 0, backend: str = "torch") -> torch.Tensor:
    """Mean loss over the rows of ``x`` for classes sharded over ``group``.

    x (N, d): the global batch (identical on every rank); w (K, d): this rank's active
    class rows; targets (N,): column of each row's class in ``w``, or -1 where the class
    is on another rank. Every class of the batch must be active on exactly one rank.
    Gradients follow the loss value (the global mean); ``chunk_size`` rows per chunk (0: all);
    ``backend``: "torch" | "triton" | "auto", as for :func:`fused_loss_and_grads`.
    """
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"expected x (N, d) and w (K, d) with equal d, got {tuple(x.shape)} and {tuple(w.shape)}")
    if targets.shape != (x.shape[0],):
        raise ValueError(f"targets must have shape ({x.shape[0]},), got {tuple(targets.shape)}")
    return _ShardedMarginLoss.apply(x, w, targets, loss, group, int(chunk_size), backend)

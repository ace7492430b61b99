"""Class-sharded softmax / margin cross entropy, fused with its gradient, in row chunks.

Legend: N rows of the global batch, K active classes of this shard, d embedding dim,
n rows of one chunk.

Each rank holds K of the classes. For every chunk of rows it computes the chunk's logits
(n, K), exponentiates them against its own row max, all-gathers [row max, sum-exp, target
term] over the group (one collective per chunk, in flight while the chunk's M @ w product
runs) and merges them (:func:`merge_row_stats`), and, because the loss is the last operation
of the graph, turns the logits buffer straight into d(loss)/d(logits) and multiplies it out
into the gradients of the embeddings (N, d) and of the active weight rows (K, d). The (N, K) logits never exist at once
(Cut Cross-Entropy and Liger's fused linear cross entropy do the same in one process);
backward only rescales the stored gradients by ``grad_output``.

Cosine losses never materialise normalised copies of x or W: logits are x.W^T scaled by
the inverse row norms, and the normalisation's backward is applied at the end
(dw_j = G_j - rw_j^2 <W_j, G_j> W_j with G = (g * rw)^T xn).

The maths in :func:`_chunk_step` is plain tensor code; communication goes through a
``Reducer`` so that one process can test the maths alone.
"""
from __future__ import annotations

from typing import Optional

import torch

from ds_xc.head.margins import TargetLoss
from ds_xc.head.row_terms import DEFAULT_TERMS, RowTerms, mean_of
from ds_xc.parallel import collectives
from ds_xc.parallel.groups import group_size, is_distributed
from ds_xc_ops.accumulate import add_rows_
from ds_xc_ops.matmul import addmm_f32_, mm_f32, tensor_cores
from ds_xc_ops.softmax_rows import exp_rows_

__all__ = ["sharded_margin_loss", "fused_loss_and_grads", "finish_weight_grad", "inverse_row_norms", "Reducer",
           "merge_row_stats", "normalise_grad_scale"]

_EPS = 1e-12


class Reducer:
    """The collective of the softmax statistics over ``group`` (a no-op with one rank):
    :meth:`gather` all-gathers a (n, c) block of row statistics into (P, n, c), asynchronously
    when asked (``.result()`` waits)."""

    def __init__(self, group=None):
        self.group = group
        self.active = is_distributed(group)

    def gather(self, t: torch.Tensor, async_op: bool = False) -> "_Gathered":
        if not self.active:
            return _Gathered(t.unsqueeze(0), None)
        t = t.contiguous()
        p = group_size(self.group)
        out = torch.empty((p * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)  # (P n, c)
        work = collectives.gather_flat(out, t, group=self.group, async_op=async_op)
        return _Gathered(out.view((p,) + tuple(t.shape)), work)  # (P, n, c)


class _Gathered:
    """An all-gather's output and its pending work (None: done)."""

    def __init__(self, out: torch.Tensor, work):
        self.out, self.work = out, work

    def result(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.out


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics run in at least float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def merge_row_stats(stats: torch.Tensor, separate_target: bool):
    """Merge every rank's row statistics into the global ones (the same bits on every rank).

    stats (P, n, c): per rank [row max m_r, sum of exp(logit - m_r) over its classes, target
    term (non-zero on the one rank that holds the row's target), and with c = 4 the sum of its
    logits (label smoothing)], in rank order. Returns (m (n,), sumexp (n,), target (n,)) and, with
    c = 4, the summed logits (n,) last, with sumexp relative to the global max m; for
    D-Softmax (``separate_target``) m >= 0 and sumexp includes the "1 +" term exp(-m).
    One all-gather per chunk instead of a MAX and then a SUM all-reduce: the local sums are
    taken against the local max and rescaled here (the online-softmax merge)."""
    m_all = stats[..., 0]  # (P, n)
    m = m_all.amax(dim=0)
    if separate_target:
        m = m.clamp_min(0.0)  # the "1 +" term of D-Softmax is logit 0
    scale = torch.where(m_all > float("-inf"), torch.exp(m_all - m), torch.zeros_like(m_all))  # (P, n)
    sumexp = (stats[..., 1] * scale).sum(dim=0)
    if separate_target:
        sumexp = sumexp + torch.exp(-m)
    return (m, sumexp) + tuple(stats[..., 2:].sum(dim=0).unbind(-1))


class _Local:
    """One chunk's local pass: e (n, K) = exp(logit - m_loc) in the logits buffer, its row
    statistics (n, 3) to merge, and what the gradient needs of the target column."""

    def __init__(self, x, w, rw, t, loss: TargetLoss, buf: torch.Tensor, folded=None,
                 terms: RowTerms = DEFAULT_TERMS, fbuf: Optional[torch.Tensor] = None):
        sd = buf.dtype
        self.folded = folded is not None
        if loss.normalised:
            rx = 1.0 / x.to(sd).norm(dim=1).clamp_min(_EPS)  # (n,)
            self.xs = x.to(sd) * rx[:, None]  # (n, d) normalised rows
            if self.folded:  # folded (K, d) = w * s / |w|: no pass over the (n, K) buffer
                logits = _mm(self.xs, folded, buf)  # (n, K) = s * cos
            else:
                _mm(self.xs * loss.scale, w, buf)  # (n, K) = s * x/|x| . w
                logits = buf.mul_(rw[None, :])  # s * cos
        else:
            self.xs = x
            logits = _mm(x, w, buf)
            if terms.softcap:  # z = cap tanh(x.w / cap); fbuf (n, K) = dz/d(x.w) = 1 - tanh^2
                logits.div_(terms.softcap).tanh_()
                torch.mul(logits, logits, out=fbuf).neg_().add_(1.0)
                logits.mul_(terms.softcap)
        self.fbuf = fbuf if terms.softcap else None
        self.has_t = t >= 0
        self.tt = torch.where(self.has_t, t, torch.zeros_like(t))[:, None]  # (n, 1)
        zero = torch.zeros((), dtype=sd, device=x.device)
        at_t = logits.gather(1, self.tt).squeeze(1)  # (n,)
        self.c_t = torch.where(self.has_t, at_t / loss.scale, zero)  # target cosine / raw logit
        zsum = None
        if loss.separate_target:  # D-Softmax: the target leaves the partition function
            if terms.smoothing:  # its smoothing term sums every class's s cos, the target's too
                zsum = logits.sum(dim=1)
            logits.scatter_(1, self.tt, torch.where(self.has_t, float("-inf"), at_t)[:, None])
            floor = 0.0  # the row max >= 0 keeps exp finite with no class but the target
            target = self.c_t
            self.dz_t = None
        else:
            z_t, self.dz_t = loss.target_logit(self.c_t)
            z_t = torch.where(self.has_t, z_t, at_t)
            logits.scatter_(1, self.tt, z_t[:, None])
            floor = None
            target = torch.where(self.has_t, z_t, zero)
            if terms.smoothing:
                zsum = logits.sum(dim=1)  # (n,) this shard's logits, the target's with its margin
        m, sumexp = _exp_rows_(logits, floor)  # (n,), (n,)
        self.e = logits  # (n, K) unnormalised probabilities exp(logit - m), in the buffer
        self.stats = torch.stack([m, sumexp, target] + ([zsum] if zsum is not None else []), 1)  # (n, 3 or 4)

    def factor(self, loss: TargetLoss, rw) -> None:
        """Turn e into the gradient's off-target part in factored form (times inv per row, see
        :func:`_chunk_step`): the target column set to 0 (its term is added separately, so no
        entry ever holds a value divided by this rank's tiny share of a row's mass) and, for
        cosine losses, every column times s * rw. Keeps e at the target in ``e_t``."""
        self.e_t = self.e.gather(1, self.tt).squeeze(1)  # (n,)
        self.e.scatter_(1, self.tt, torch.where(self.has_t, 0.0, self.e_t)[:, None])
        if loss.normalised and not self.folded:  # folded: the column factors live in the folded rows
            self.e.mul_((loss.scale * rw)[None, :])
        if self.fbuf is not None:  # softcap: each entry times the cap's derivative
            self.f_t = self.fbuf.gather(1, self.tt).squeeze(1)  # (n,)
            self.e.mul_(self.fbuf)


def _exp_rows_(logits: torch.Tensor, floor: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (n, K) <- exp(logits - m[:, None]) in place, m = row max (at least ``floor``; -inf for a
    shard without active classes); returns (m (n,), row sums (n,)). float32 on CPU: one C++ kernel
    (ds_xc_ops.softmax_rows, two passes instead of four), else these PyTorch passes."""
    fused = exp_rows_(logits, floor)
    if fused is not None:
        return fused
    if logits.shape[1] == 0:
        m = torch.full((logits.shape[0],), float("-inf"), dtype=logits.dtype, device=logits.device)
    else:
        m = logits.amax(dim=1)
    if floor is not None:
        m = m.clamp_min_(floor)
    return m, logits.sub_(m[:, None]).exp_().sum(dim=1)


def _chunk_step(x, w, rw, t, loss: TargetLoss, red: Reducer, need_grad: bool, need_gx: bool, buf: torch.Tensor,
                folded=None, terms: RowTerms = DEFAULT_TERMS, fbuf=None):
    """Loss rows of one chunk and, if asked, its gradient in factored form.

    x (n, d) chunk rows; w (K, d) active weights; rw (K,) inverse row norms (cosine losses)
    or None; t (n,) target column in [0, K) or -1 when the target lives elsewhere; buf
    (n, K) scratch for the logits, reused across chunks; ``terms`` the chunk's per-row terms
    (ds_xc/head/row_terms.py: weights, smoothing, z-loss, softcap) and, with softcap, ``fbuf`` (n, K)
    a second scratch for the cap's derivative.

    Returns (loss (n,), M (n, K) or None, inv (n,), xs (n, d), gt (n,), ew (n, d) or None, b (n,) or None).
    The gradient of the summed (weighted) loss rows with respect to the raw dot products xs . w_j is
    ``inv[:, None] * M - b[:, None] * F`` off the target column and ``gt - b F_t`` at it (M is 0 there;
    gt is 0 on rows whose target is elsewhere), with F_ij the column factor d z_ij / d(xs . w_j) (the
    scale s rw_j, 1, or under softcap ``fbuf``) and b = v eps / C the smoothing's share (None without
    smoothing): the softmax's row normalisation stays out of the (n, K) buffer. With 16-bit
    weights on a tensor-core device M is returned in the weight's dtype, the input of both gradient
    GEMMs (ds_xc_ops.matmul). ``ew`` = M @ w (need_gx), computed
    while the statistics' all-gather is in flight. ``xs`` is the chunk's normalised rows
    (cosine losses) or the chunk itself. With ``folded`` (K, d) = w * s rw (cosine losses), M
    leaves out the column factors s rw_j (ew = M @ folded carries them; the caller scales dW).
    """
    loc = _Local(x, w, rw, t, loss, buf, folded, terms, fbuf)
    pending = red.gather(loc.stats, async_op=True)  # (P, n, 3 or 4)
    ew, grad_m = None, loc.e
    if need_grad:
        loc.factor(loss, rw)
        if tensor_cores(w.dtype, w.device):  # 16-bit weights: both gradient GEMMs take M in 16 bits (once)
            grad_m = loc.e.to(w.dtype)  # (n, K)
        if need_gx:
            ew = _mm_rows(grad_m, w if folded is None else folded)  # (n, d), overlapping the all-gather
    m, sumexp, target, *zsum = merge_row_stats(pending.result(), loss.separate_target)
    lse = m + torch.log(sumexp)
    rows, d_intra = terms.rows(lse, target, zsum[0] if zsum else None, loss)
    v = terms.weight
    rows = terms.record(rows, lse, v)
    if not need_grad:
        return rows, None, None, loc.xs, None, None, None
    inv = torch.exp(loc.stats[:, 0] - m) / sumexp  # (n,): this rank's share of the row's mass / e
    pfac = 1.0 + 2.0 * terms.z_loss * lse if terms.z_loss else 1.0  # the z-loss scales every probability
    p_t = None if loss.separate_target else loc.e_t * inv
    unit = loss.scale if loss.normalised else 1.0
    g_t = terms.target_grad(p_t, pfac, loc.dz_t, unit, d_intra, loss)  # d row / d c_t
    inv = inv * pfac
    if v is not None:
        inv, g_t = inv * v, g_t * v
    if loc.fbuf is not None:
        g_t = g_t * loc.f_t
    if loss.normalised:
        g_t = g_t * rw[loc.tt.squeeze(1)]
    g_t = torch.where(loc.has_t, g_t, torch.zeros_like(g_t))
    b = None
    if terms.smoothing:
        b = torch.full_like(inv, terms.smoothing / terms.num_classes) if v is None \
            else v * (terms.smoothing / terms.num_classes)  # (n,)
    return rows, grad_m, inv, loc.xs, g_t, ew, b


def _mm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (n, K) = a (n, d) @ w^T, in the statistics dtype.

    Low-precision (bf16) weights: the products are accumulated and written in float32, never
    rounded to bf16 (a bf16 logit of magnitude 32-64 would be off by up to 0.125): on a tensor-core
    device one 16-bit GEMM writing float32 straight into ``out`` (no second (n, K) buffer); elsewhere
    float32 blocks of weight rows (ds_xc_ops.matmul.mm_f32).
    """
    if a.dtype == w.dtype == out.dtype:
        return torch.mm(a, w.t(), out=out)
    return mm_f32(a.to(w.dtype) if tensor_cores(w.dtype, w.device) else a, w.t(), out=out)


def _accumulate(gw: torch.Tensor, m: torch.Tensor, x: torch.Tensor, first: bool) -> None:
    """gw (K, d) (+)= m^T (K, n) @ x (n, d), in place; the first chunk overwrites (no zero fill).
    A 16-bit m (tensor-core devices, see _chunk_step): x joins it in 16 bits, accumulated in float32."""
    if tensor_cores(m.dtype, m.device):
        if first:
            mm_f32(m.t(), x.to(m.dtype), out=gw)
        else:
            addmm_f32_(gw, m.t(), x.to(m.dtype))
        return
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
    return (1.0 / w.to(stat_dtype(w.dtype)).norm(dim=1).clamp_min(_EPS)) if loss.normalised else None


def normalise_grad_scale(x: torch.Tensor) -> torch.Tensor:
    """(n,) the factor of the normalisation's backward for the rows of ``x`` (n, d): 1/|x_i|, and 0 for a row of
    norm <= eps (an all-zero embedding has no direction: its gradient is defined as 0, where F.normalize's
    1/eps would multiply it by 10^12). Both softmax backends use it."""
    norm = x.norm(dim=1)
    return torch.where(norm > _EPS, 1.0 / norm.clamp_min(_EPS), torch.zeros_like(norm))


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
                         accumulate: bool = False, finish: bool = True, backend: str = "torch",
                         workspace=None, terms: Optional[RowTerms] = None):
    """Sum of the N loss rows and its gradients, in one pass over row chunks (no autograd).

    x (N, d), w (K, d), targets (N,) as for :func:`sharded_margin_loss`. Returns
    (total: scalar sum of the rows, gx (N, d) or None, gw (K, d) or None), in the
    statistics dtype: the gradients of ``total`` itself (divide by N for the mean).
    Every rank of ``group`` must call it with the same N (the softmax statistics are
    all-gathered per chunk).

    The overlap schedule (ds_xc/overlap) calls it once per micro-chunk with the same
    weights, so the O(K d) work is hoisted: ``rw`` (:func:`inverse_row_norms`, computed
    once), ``gw`` a (K, d) buffer that the call overwrites or, with ``accumulate``, adds
    to, and ``finish=False`` to leave the cosine normalisation's backward to one
    :func:`finish_weight_grad` at the end.

    ``workspace`` (:class:`ds_xc.head.workspace.Workspace`): where the (n, K) logits scratch comes
    from (kept between calls when small), else a fresh buffer. Cosine losses whose (K, d) rows the
    workspace keeps also get them with the factors s / |w_j| folded in, once per call: the logits
    and M @ w then need no pass over the (n, K) buffer for them (dW takes them once at the end).

    ``backend`` (``extreme_classification.softmax_backend``): "torch" runs the code below;
    "triton" or "auto" may hand the call to the fused Triton kernels (ds_xc/head/softmax_backend.py).

    ``terms`` (:class:`ds_xc.head.row_terms.RowTerms`): the rows' weights (ignored rows weigh 0),
    label smoothing, z-loss and softcap; the total is then the weighted sum sum_i v_i row_i, and
    ``terms.rows_out`` / ``terms.lse_out`` receive each row's v_i row_i and lse_i.
    """
    terms = DEFAULT_TERMS if terms is None else terms
    if backend != "torch" and not (terms.softcap and backend == "auto"):  # auto: softcap runs the code below
        from ds_xc.head.softmax_backend import resolve_softmax  # lazy: triton loads only when asked
        fused = resolve_softmax(backend, x, w, *([terms] if terms.softcap else []))  # triton refuses softcap
        out = None if fused is None else fused(x, w, targets, loss, group, chunk_size, need_gx, need_gw,
                                               rw=rw, gw=gw, accumulate=accumulate, finish=finish, terms=terms)
        if out is not None:  # None: auto fell back (the kernels could not launch here)
            return out
    need_grad = need_gx or need_gw
    red = Reducer(group)
    n_rows, k = x.shape[0], w.shape[0]
    sd = stat_dtype(w.dtype)
    xw = x.to(w.dtype)
    if rw is None:
        rw = inverse_row_norms(w, loss)  # (K,)
    gx = torch.empty(x.shape, dtype=sd, device=x.device) if need_gx else None  # (N, d)
    if need_gw and gw is None:
        gw = torch.empty((k, w.shape[1]), dtype=sd, device=w.device)  # (K, d)
    step = chunk_size if chunk_size > 0 else max(n_rows, 1)
    shape = (min(step, n_rows), k)
    buf = torch.empty(shape, dtype=sd, device=x.device) if workspace is None \
        else workspace.buffer("logits", shape, sd, x.device)  # (n, K), one for all chunks
    folded = None
    if loss.normalised and need_grad and not accumulate and w.dtype == sd and workspace is not None \
            and workspace.keeps((k, w.shape[1]), sd):  # the cosine's column factors folded into W once
        folded = torch.mul(w, (loss.scale * rw)[:, None], out=workspace.buffer("folded", (k, w.shape[1]), sd,
                                                                                 w.device))  # (K, d)
    fbuf = None
    if terms.softcap:  # the cap's derivative (n, K), kept for the gradient
        fbuf = torch.empty(shape, dtype=sd, device=x.device) if workspace is None \
            else workspace.buffer("softcap", shape, sd, x.device)
    total = _run_chunks(xw, w, rw, targets, loss, red, step, buf, folded, gx, gw, need_gx, need_gw, accumulate,
                        terms, fbuf)
    if need_gw and n_rows == 0 and not accumulate:
        gw.zero_()
    if need_gw and finish:
        finish_weight_grad(gw, w, rw, loss)
    return total, gx, gw


def _run_chunks(xw, w, rw, targets, loss: TargetLoss, red: Reducer, step: int, buf, folded, gx, gw,
                need_gx: bool, need_gw: bool, accumulate: bool, terms: RowTerms = DEFAULT_TERMS,
                fbuf=None) -> torch.Tensor:
    """The chunk loop of :func:`fused_loss_and_grads`: returns the summed loss rows, writes gx (N, d)
    and accumulates gw (K, d) (scaled by the folded column factors at the end)."""
    sd = buf.dtype
    total = torch.zeros((), dtype=sd, device=xw.device)
    targets_gw = []  # folded: the target terms of dW, added once dW has its column factors
    n_rows = xw.shape[0]
    need_grad = need_gx or need_gw
    colfac = None if not loss.normalised else loss.scale * rw  # (K,) d z_j / d(xs . w_j) off the target
    wsum = bx = None
    if terms.smoothing and need_grad and fbuf is None:  # the smoothing's rank-1 term: sum_j colfac_j w_j (d,)
        wf = w.to(sd)
        wsum = wf.sum(dim=0) if colfac is None else (wf * colfac[:, None]).sum(dim=0)
        bx = torch.zeros(w.shape[1], dtype=sd, device=w.device)  # (d,) sum_i b_i xs_i
    for a in range(0, n_rows, step):
        xc, tc = xw[a: a + step], targets[a: a + step]
        rows, m, inv, xs, g_t, ew, b = _chunk_step(xc, w, rw, tc, loss, red, need_grad, need_gx,
                                                   buf[: xc.shape[0]], folded, terms.slice(a, a + step),
                                                   None if fbuf is None else fbuf[: xc.shape[0]])
        total += rows.sum()
        if m is None:
            continue
        fc = None if fbuf is None or b is None else fbuf[: xc.shape[0]]  # (n, K): softcap with smoothing
        # every row takes its target term: g_t is 0 on rows whose target is on another rank (static
        # shapes, no host sync); those rows point at column 0 and add exact zeros there
        tcol = tc.clamp_min(0)  # (n,)
        if need_gx:  # in place on ew (this chunk's own (n, d)): one (n, d) less at the peak
            gxs = ew.mul_(inv[:, None])  # (n, d): d/d(xs)
            gxs.addcmul_(w.index_select(0, tcol).to(sd), g_t[:, None])
            if b is not None:  # the smoothing: -b_i sum_j F_ij w_j
                gxs -= b[:, None] * (wsum[None, :] if fc is None else _mm_rows(fc, w))
            if loss.normalised:  # through x/|x|: remove the radial part, divide by |x|
                radial = (gxs * xs).sum(dim=1, keepdim=True)
                gxs = (gxs - xs * radial) * normalise_grad_scale(xc.to(sd))[:, None]
            gx[a: a + step] = gxs
        if need_gw:
            xs_sd = xs.to(sd)
            _accumulate(gw, m, xs_sd * inv[:, None], first=a == 0 and not accumulate)
            if b is not None:
                bxs = b[:, None] * xs_sd  # (n, d)
                if fc is None:
                    bx += bxs.sum(dim=0)
                else:  # softcap: dW_j -= sum_i F_ij b_i xs_i
                    gw.addmm_(fc.t(), bxs, alpha=-1.0)
            t_rows = g_t[:, None] * xs_sd  # (n, d)
            if folded is None:
                _add_rows(gw, tcol, t_rows)
            else:
                targets_gw.append((tcol, t_rows))
        rows = m = xs = ew = gxs = t_rows = None  # this chunk's (n, d) temporaries freed before the next's
    if bx is not None and need_gw and n_rows:  # the smoothing's rank-1 share of dW: -colfac_j bx
        if folded is not None or colfac is None:  # folded: the column factors come with the multiply below
            gw -= bx[None, :]
        else:
            gw.addcmul_(colfac[:, None], bx[None, :], value=-1.0)
    if folded is not None and need_gw and n_rows:
        gw.mul_((loss.scale * rw)[:, None])
        for tcol, t_rows in targets_gw:
            _add_rows(gw, tcol, t_rows)
    return total


def _add_rows(gw: torch.Tensor, cols: torch.Tensor, rows: torch.Tensor) -> None:
    """gw[cols[i]] += rows[i], summing repeated columns deterministically on every device
    (ds_xc_ops.accumulate: sorted on a GPU, serial on a CPU)."""
    add_rows_(gw, cols, rows)


class _ShardedMarginLoss(torch.autograd.Function):
    """forward: the weighted sum of the N loss rows (the gradients computed on the fly), or with
    ``per_row`` the (N,) weighted rows; backward: the stored gradients times grad_output, or for
    ``per_row`` a second pass whose row weights are v_i times grad_output's rows (all-reduced over
    the group first when ``sum_grad_rows``: each rank holds the upstream gradient of its own rows)."""

    @staticmethod
    def forward(ctx, x, w, targets, loss, group, chunk_size, backend="torch", workspace=None, terms=None,
                per_row=False, sum_grad_rows=False):
        terms = DEFAULT_TERMS if terms is None else terms
        ctx.dtypes = (x.dtype, w.dtype)
        if per_row:
            rows = torch.empty(x.shape[0], dtype=stat_dtype(w.dtype), device=x.device)  # (N,)
            terms = terms.but(rows_out=rows)
            fused_loss_and_grads(x, w, targets, loss, group, chunk_size, False, False, backend=backend,
                                 workspace=workspace, terms=terms)
            ctx.replay = (x.detach(), w.detach(), targets, loss, group, chunk_size, backend, workspace,
                          terms.with_weight(terms.weight), sum_grad_rows, ctx.needs_input_grad[:2])
            ctx.grads = None
            return rows
        ctx.replay = None
        total, gx, gw = fused_loss_and_grads(x, w, targets, loss, group, chunk_size,
                                             ctx.needs_input_grad[0], ctx.needs_input_grad[1], backend=backend,
                                             workspace=workspace, terms=terms)
        ctx.grads = (gx, gw)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.replay is not None:
            gx, gw = _replay_rows(ctx.replay, grad_out)
        else:
            if ctx.grads is None:
                raise RuntimeError("the ds_xc head's backward ran twice on one forward; "
                                   "retain_graph is not supported by the fused loss")
            gx, gw = ctx.grads
            ctx.grads = None  # release our references: autograd may adopt the buffers as .grad
            if gx is not None:
                gx = gx.mul_(grad_out)
            if gw is not None:
                gw = gw.mul_(grad_out)
        gx = None if gx is None else gx.to(ctx.dtypes[0])
        gw = None if gw is None else gw.to(ctx.dtypes[1])
        return gx, gw, None, None, None, None, None, None, None, None, None


def _replay_rows(replay, grad_rows: torch.Tensor):
    """reduction 'none': the gradients of sum_i g_i v_i row_i, g the upstream gradient of the rows (N,)."""
    x, w, targets, loss, group, chunk_size, backend, workspace, terms, sum_grad_rows, needs = replay
    g = grad_rows.to(stat_dtype(w.dtype)).contiguous().clone()
    if sum_grad_rows:  # every rank passed the gradient of its own rows (zeros elsewhere)
        collectives.all_reduce_sum_(g, group)
    weight = g if terms.weight is None else g * terms.weight
    _, gx, gw = fused_loss_and_grads(x, w, targets, loss, group, chunk_size, needs[0], needs[1], backend=backend,
                                     workspace=workspace, terms=terms.with_weight(weight, signed=True))
    return gx, gw


def _mm_rows(m: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """m (n, K) @ w (K, d) -> (n, d) in the statistics dtype: 16-bit operands on a tensor-core device
    into float32; on a CPU, float32 M against 16-bit w as before (a 16-bit product, then float32)."""
    if tensor_cores(m.dtype, m.device):
        return mm_f32(m, w.to(m.dtype))
    if m.dtype == w.dtype:
        return m @ w
    return (m.to(w.dtype) @ w).to(m.dtype)


def sharded_margin_loss(x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, loss: TargetLoss,
                        group=None, chunk_size: int = 0, backend: str = "torch", workspace=None,
                        terms: Optional[RowTerms] = None, reduction: str = "mean",
                        sum_grad_rows: bool = False) -> torch.Tensor:
    """The loss over the rows of ``x`` for classes sharded over ``group``.

    x (N, d): the global batch (identical on every rank); w (K, d): this rank's active
    class rows; targets (N,): column of each row's class in ``w``, or -1 where the class
    is on another rank. Every class of the batch must be active on exactly one rank.
    ``terms`` (ds_xc/head/row_terms.py): row weights v (N,) and the loss options.
    ``reduction``: "mean" (sum_i v_i row_i / sum_i v_i; N rows of weight 1 without ``terms``),
    "sum" (sum_i v_i row_i) or "none" ((N,) v_i row_i; ``sum_grad_rows``: the upstream
    gradient of the rows is all-reduced over ``group`` in backward, each rank having its own rows').
    Gradients follow the value; ``chunk_size`` rows per chunk (0: all);
    ``backend``: "torch" | "triton" | "auto" and ``workspace``, as for :func:`fused_loss_and_grads`.
    """
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"expected x (N, d) and w (K, d) with equal d, got {tuple(x.shape)} and {tuple(w.shape)}")
    if targets.shape != (x.shape[0],):
        raise ValueError(f"targets must have shape ({x.shape[0]},), got {tuple(targets.shape)}")
    out = _ShardedMarginLoss.apply(x, w, targets, loss, group, int(chunk_size), backend, workspace, terms,
                                   reduction == "none", sum_grad_rows)
    if reduction != "mean":
        return out
    if terms is None or terms.weight is None:
        return out / max(x.shape[0], 1)
    return mean_of(out, terms.weight.sum())

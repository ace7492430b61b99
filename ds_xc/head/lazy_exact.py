"""Exact lazy updates of the head optimizers (``update: lazy_exact``).

A row outside a step's active set has a zero gradient, so what a dense optimizer does to it
over k skipped steps is a known function of the skipped steps' scalars: the row can be
skipped and brought up to date later ("caught up") in O(d), whatever k is.

SGD (torch.optim.SGD: momentum mu, L2 weight decay wd, Nesterov): with g = 0, g' = wd*w and

    [w; buf] <- M_s [w; buf],   M_s = [[1 - lr_s*wd, -lr_s*mu], [wd, mu]]           (plain)
                                M_s = [[1 - lr_s*wd*(1+mu), -lr_s*mu^2], [wd, mu]]  (Nesterov)

so a row last updated at step a is caught up to step T by Q = M_T ... M_{a+1}, exactly
(up to floating point rounding).

AdamW (torch.optim.AdamW, decoupled decay): with g = 0, m and v decay by b1^k and b2^k and
each skipped step s still moves w by -lr_s/bc1_s * m_s / (sqrt(v_s/bc2_s) + eps). Dropping
eps from those skipped-step denominators makes the sum separable:

    w_T = D(a) * w_a - C(a) * m_a / sqrt(v_a),
    D(a) = prod_{s=a+1..T} (1 - lr_s*wd),
    C(a) = sum_{s=a+1..T} [prod_{u=s+1..T} (1 - lr_u*wd)] * lr_s*sqrt(bc2_s)/bc1_s * r^(s-a),
    r = b1 / sqrt(b2).

(D, C) obey a linear recurrence in a, (D, C)(a-1) = N_a (D, C)(a) with
N_a = [[d_a, 0], [r*q_a, r]], so both optimizers reduce to products of 2x2 matrices.
The eps error: each dropped term is too large by the factor (sqrt(v̂_s) + eps)/sqrt(v̂_s), so
the catch-up displacement C(a)*m/sqrt(v) has relative error at most eps/min_s sqrt(v̂_s)
(v̂_s = b2^(s-a) v_a / bc2_s), i.e. about eps/sqrt(v̂) for the usual v̂ >> eps^2 (1e-8
relative with eps = 1e-8 and gradients of order 1; tests/test_lazy_exact.py measures it).
Betas are taken as fixed (the config's); lr and weight decay may change every step.

Cost: the history is one row of float64 scalars per step (kept on the CPU, trimmed to the
steps after the oldest row's last update). Catching up R rows whose oldest last update is n
steps back costs one batched scan of n 2x2 matrices (O(n log n) flops, log n torch calls)
plus O(R*d). Rows not caught up hold stale values: the head catches the active rows up
before each forward and every row up before topk / index rebuilds / checkpoint saves.
"""
from __future__ import annotations

import torch

from ds_xc import config as cfg

LAST, HIST, STEPS, BASE = "lazy_last", "lazy_hist", "lazy_steps", "lazy_base"
_BLOCK = 1 << 15  # rows per block of a catch-up
_TRIM_EVERY = 1024  # steps between history trims (an O(L) min over the row counters)


def suffix_products(mats: torch.Tensor) -> torch.Tensor:
    """mats (n, 2, 2), one per step in step order -> (n + 1, 2, 2) with out[k] = M_n ... M_{n-k+1}
    (the product over the last k steps, the latest on the left; out[0] = I). A Hillis-Steele scan:
    log2(n) batched matmuls instead of n Python-level ones."""
    p = mats.flip(0).clone()  # p[i] = M_{n-i}
    shift = 1
    while shift < p.shape[0]:
        p[shift:] = torch.matmul(p[:-shift], p[shift:])  # p[i] = M_n ... M_{n-i} once shift >= i
        shift *= 2
    eye = torch.eye(2, dtype=mats.dtype).expand(1, 2, 2)
    return torch.cat([eye, p])


def _mat(a, b, c, d) -> torch.Tensor:
    """(n, 2, 2) from four (n,) entries [[a, b], [c, d]]."""
    return torch.stack([torch.stack([a, b], -1), torch.stack([c, d], -1)], -2)


def sgd_mats(h: torch.Tensor) -> torch.Tensor:
    """SGD history rows (n, 4) = (lr, mu, wd, nesterov) -> the zero-gradient step matrices M_s (n, 2, 2)."""
    lr, mu, wd, nest = h.unbind(1)
    a = torch.where(nest > 0, 1.0 - lr * wd * (1.0 + mu), 1.0 - lr * wd)
    b = torch.where(nest > 0, -lr * mu * mu, -lr * mu)
    return _mat(a, b, wd, mu)


def adamw_mats(h: torch.Tensor) -> torch.Tensor:
    """AdamW history rows (n, 6) = (lr, wd, b1, b2, bc1, bc2) -> N_s^T (n, 2, 2), so that the suffix
    product over steps a+1..T has D(a) at [0, 0] and C(a) at [0, 1] (module docstring)."""
    lr, wd, b1, b2, bc1, bc2 = h.unbind(1)
    d = 1.0 - lr * wd
    r = b1 / b2.sqrt()
    q = lr * bc2.sqrt() / bc1
    return _mat(d, r * q, torch.zeros_like(d), r)


class ExactLazyMixin:
    """Per-row "last updated at" counters and the per-step scalar history, in ``optimizer.state[p]``
    (LAST: int64 (L,) on the weight's device; HIST: float64 (capacity, width) on the CPU; STEPS,
    BASE: ints; history row i is step BASE + 1 + i). Subclasses give ``_exact_mats(hist)``,
    ``_exact_apply(p, state, group, rows, q, k)`` (PyTorch) and ``_exact_native(p, state, group, rows,
    coef)`` (the fused kernel of ds_xc_ops.rows; False where it cannot run)."""

    def _exact_begin(self, p: torch.Tensor, rows, scalars) -> None:
        """Before this step's update of ``p``: catch the rows about to be updated (``rows`` (R,), or
        None: all) up to the last step, record this step's scalars and mark the rows current."""
        if p.dtype == torch.bfloat16:
            raise cfg.ConfigError(f"{cfg.HEAD_SECTION}.optimizer.update: 'lazy_exact' does not support "
                                  f"dtype bfloat16 heads; use update 'lazy' or 'dense', or dtype float32")
        state = self.state[p]
        if LAST not in state:
            state[LAST] = torch.zeros(p.shape[0], dtype=torch.int64, device=p.device)  # (L,)
            state[HIST] = torch.zeros(64, len(scalars), dtype=torch.float64)  # (capacity, width)
            state[STEPS], state[BASE] = 0, 0
        self._exact_catch_up(p, state, rows)
        n = state[STEPS] - state[BASE]
        if n == state[HIST].shape[0]:  # grow by doubling: amortised O(1) per step
            state[HIST] = torch.cat([state[HIST], state[HIST].new_zeros(max(64, n), len(scalars))])
        state[HIST][n] = torch.tensor(scalars, dtype=torch.float64)
        state[STEPS] += 1
        if rows is None:
            state[LAST].fill_(state[STEPS])
        else:
            state[LAST].index_fill_(0, rows, state[STEPS])
        if state[STEPS] % _TRIM_EVERY == 0:
            self._exact_trim(state)

    def _exact_catch_up(self, p: torch.Tensor, state: dict, rows) -> None:
        """Bring rows (R,) (None: all) of p and its state to step STEPS, as zero-gradient steps would."""
        last, steps = state[LAST], state[STEPS]
        if last.device != p.device:
            state[LAST] = last = last.to(p.device)
        if rows is None:
            sel = (last < steps).nonzero().squeeze(1)  # (S,) the stale rows
        else:
            sel = rows[last.index_select(0, rows) < steps]
        if sel.numel() == 0:
            return
        a = last.index_select(0, sel)  # (S,) their last update steps
        first = int(a.min())
        h = state[HIST][first - state[BASE]: steps - state[BASE]]  # (n, width) steps first+1..steps
        coef = suffix_products(self._exact_mats(h)).to(p.device)  # (n + 1, 2, 2) float64
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        if self._exact_native(p, state, group, sel, coef):  # the fused C++ kernel marked the rows current
            return
        k = steps - a  # (S,) skipped steps per row
        for b in range(0, sel.numel(), _BLOCK):
            s = slice(b, b + _BLOCK)
            self._exact_apply(p, state, group, sel[s], coef.index_select(0, k[s]), k[s])
        last.index_fill_(0, sel, steps)

    @staticmethod
    def _exact_trim(state: dict) -> None:
        """Drop the history of steps every row is past (keeps HIST at the live window)."""
        oldest = int(state[LAST].min())
        drop = oldest - state[BASE]
        if drop > 0:
            state[HIST] = state[HIST][drop:].clone()
            state[BASE] = oldest

    @torch.no_grad()
    def catch_up(self, rows=None) -> None:
        """Bring local rows ``rows`` (R,) of every parameter (None: every row) up to date: call before
        reading weights that may be stale (the head calls it before forward, topk, index rebuilds;
        XCEngine.save_checkpoint calls :meth:`catch_up_all`). A no-op without ``lazy_exact``."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p, {})
                if LAST in state:
                    self._exact_catch_up(p, state, None if rows is None else rows.to(p.device))

    @torch.no_grad()
    def catch_up_all(self) -> None:
        """Every row of every parameter up to date (then the history is trimmed to nothing)."""
        self.catch_up(None)
        for group in self.param_groups:
            for p in group["params"]:
                if LAST in self.state.get(p, {}):
                    self._exact_trim(self.state[p])

    @staticmethod
    def exact_state_for_saving(entry: dict) -> dict:
        """One parameter's saved state: without the counters and the history when every row is current
        (after :meth:`catch_up_all`, as XCEngine.save_checkpoint does), so the checkpoint holds the state
        of a dense run, one row per class (export, reshard and other update modes read it as such); a
        resumed lazy_exact run restarts its counters from there, which is the same as keeping them. With
        stale rows (a state_dict taken mid-run) everything is kept."""
        last = entry.get(LAST)
        if last is None or (last.numel() and int(last.min()) < entry[STEPS]):
            return entry
        return {k: v for k, v in entry.items() if k not in (LAST, HIST, STEPS, BASE)}

    @torch.no_grad()
    def finish_exact_lazy(self) -> None:
        """For parameters of groups not in lazy_exact mode that still hold its state (a lazy_exact
        checkpoint loaded with another ``update``): catch every row up, then drop that state."""
        for group in self.param_groups:
            if group.get("exact"):
                continue
            for p in group["params"]:
                state = self.state.get(p, {})
                if LAST in state:
                    self._exact_catch_up(p, state, None)
                    for key in (LAST, HIST, STEPS, BASE):
                        state.pop(key, None)

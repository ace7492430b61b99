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

Static and sync-free (docs/head.md, "The GPU step"): the state is fixed-size device tensors.
``lazy_suffix`` (W + 1, 2, 2) float64 holds, at k, the product of the last k steps' matrices
(entry 0 the identity); each step multiplies the new matrix in from the left (four small ops
whose scalars are the step's Python numbers: no host data, no host sync), and a row last current
k steps ago is caught up by entry k, so a catch-up is a gather of its rows' entries whatever
their ages (rows already current take the identity). No row may fall more than W steps behind:
every W steps (W = :data:`WINDOW`) every row is caught up, O(L*d) once per W steps. Catching up
R rows costs O(R*d), R may repeat rows.

Rows not caught up hold stale values: the head catches the active rows up before each forward
and every row up before topk / index rebuilds / checkpoint saves.

Captured steps (``graphed``, ds_xc/head/graphs.py): a CUDA graph replays kernels with the arguments
they were captured with, so the step count the kernels read is a device tensor (``lazy_steps_t``),
the step's matrix is formed on the device from the optimizer's device scalars, and the products are
updated in place (fixed addresses); the host counters are advanced by :meth:`after_replay`.
"""
from __future__ import annotations

import torch

from ds_xc import config as cfg

LAST, SUFFIX, STEPS, BASE = "lazy_last", "lazy_suffix", "lazy_steps", "lazy_base"
STEPS_T = "_lazy_steps_t"  # captured steps: STEPS as a device tensor (not saved: rebuilt from STEPS)
HIST = "lazy_hist"  # the scalar history of checkpoints of earlier revisions (converted when loaded)
WINDOW = 1024  # steps a row may fall behind before the periodic catch-up of every row
BLOCK_BYTES = 256 << 20  # temporaries of one block of a catch-up (about four row copies of the block)


def _block_rows(p: torch.Tensor) -> int:
    """Rows per block of a catch-up: its temporaries stay under BLOCK_BYTES (131,072 rows at d = 128
    float32: the re-ranked rows of a 512-row batch in one block)."""
    return max(1, BLOCK_BYTES // (4 * p.shape[1] * p.element_size()))


def suffix_products(mats: torch.Tensor) -> torch.Tensor:
    """mats (n, 2, 2), one per step in step order -> (n + 1, 2, 2) with out[k] = M_n ... M_{n-k+1}
    (the product over the last k steps, the latest on the left; out[0] = I). A Hillis-Steele scan:
    log2(n) batched matmuls (used to convert the history of an older checkpoint)."""
    p = mats.flip(0).clone()  # p[i] = M_{n-i}
    shift = 1
    while shift < p.shape[0]:
        p[shift:] = torch.matmul(p[:-shift], p[shift:])  # p[i] = M_n ... M_{n-i} once shift >= i
        shift *= 2
    eye = torch.eye(2, dtype=mats.dtype, device=mats.device).expand(1, 2, 2)
    return torch.cat([eye, p])


def sgd_entries(lr: float, mu: float, wd: float, nesterov: bool) -> tuple:
    """The zero-gradient step matrix M_s of SGD as four Python floats (a, b, c, d) = [[a, b], [c, d]]."""
    if nesterov:
        return 1.0 - lr * wd * (1.0 + mu), -lr * mu * mu, wd, mu
    return 1.0 - lr * wd, -lr * mu, wd, mu


def adamw_entries(lr: float, wd: float, b1: float, b2: float, bc1: float, bc2: float) -> tuple:
    """N_s^T of AdamW (module docstring) as four Python floats, so that the suffix product over steps
    a+1..T has D(a) at [0, 0] and C(a) at [0, 1]."""
    r = b1 / b2 ** 0.5
    return 1.0 - lr * wd, r * (lr * bc2 ** 0.5 / bc1), 0.0, r


def _entries_of_history(kind: str, h: torch.Tensor) -> torch.Tensor:
    """An older checkpoint's history rows (n, width) -> their step matrices (n, 2, 2) float64."""
    rows = [sgd_entries(*r[:3], bool(r[3])) if kind == "sgd" else adamw_entries(*r) for r in h.tolist()]
    return torch.tensor(rows, dtype=torch.float64).view(-1, 2, 2)


class ExactLazyMixin:
    """Per-row "last current at" counters and the suffix products of the last steps, in
    ``optimizer.state[p]`` (LAST: int64 (L,), SUFFIX: float64 (WINDOW + 1, 2, 2), both on the weight's
    device; STEPS: steps recorded; BASE: the last step at which every row was current). Subclasses
    give ``_exact_kind`` ("sgd" | "adamw"), ``_exact_apply(p, state, group, rows, q, k)`` (PyTorch)
    and ``_exact_native(p, state, group, rows, coef)`` (the fused kernel of ds_xc_ops.rows; False
    where it cannot run)."""

    _exact_kind = "sgd"
    graphed = False  # set by HeadStepGraph: the step's kernels read device counters (module docstring)

    def _exact_begin(self, p: torch.Tensor, rows, entries: tuple) -> None:
        """Before this step's update of ``p``: catch the rows about to be updated (``rows`` (R,), or
        None: all) up to the last step, record this step's matrix (``entries``, four floats) and mark
        the rows current."""
        if p.dtype == torch.bfloat16:
            raise cfg.ConfigError(f"{cfg.HEAD_SECTION}.optimizer.update: 'lazy_exact' does not support "
                                  f"dtype bfloat16 heads; use update 'lazy' or 'dense', or dtype float32")
        state = self.state[p]
        if LAST not in state:
            state[LAST] = torch.zeros(p.shape[0], dtype=torch.int64, device=p.device)  # (L,)
            state[SUFFIX] = _identity_suffix(p.device)
            state[STEPS], state[BASE] = 0, 0
        _follow(state, p)
        if state[STEPS] - state[BASE] >= WINDOW:  # the oldest rows would leave the window: all current
            self._exact_catch_up(p, state, None)
        if rows is None or not self._caught_up_now(state):
            self._exact_catch_up(p, state, rows)
        _push(state, entries, in_place=self.graphed)
        if self.graphed:
            self._steps_arg(state).add_(1)
        state[STEPS] += 1
        steps = self._steps_arg(state)
        if rows is None:
            state[LAST].fill_(steps)
            state[BASE] = state[STEPS]
        else:
            state[LAST].index_fill_(0, rows, steps)

    def _steps_arg(self, state: dict):
        """STEPS as the kernels take it: the Python int, or (captured steps) the device counter."""
        if not self.graphed:
            return state[STEPS]
        t = state.get(STEPS_T)
        if t is None or t.device != state[LAST].device:
            t = state[STEPS_T] = torch.full((), state[STEPS], dtype=torch.int64, device=state[LAST].device)
        return t

    def exact_after_replay(self) -> None:
        """The host side of a replayed step (HeadStepGraph): the counters an eager step advances."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p, {})
                if LAST in state and group.get("exact"):
                    if "_active_at" in state:  # the forward caught its active rows up at this step
                        state["_active_at"] = state[STEPS]
                    state[STEPS] += 1

    def exact_host_work_due(self) -> bool:
        """Whether the next step catches every row up (WINDOW reached): host work a replay cannot do."""
        return any(state[STEPS] - state[BASE] >= WINDOW for state in self.state.values() if LAST in state)

    # Set by build_head_optimizer when the gradient rows of a step are always rows the head caught up
    # with ``active=True`` since the last step (its forward's active sets; not with a 2-D layout, whose
    # gradient also holds the other replicas' rows): the step then skips a second catch-up of them.
    trust_active_rows = False

    def _caught_up_now(self, state: dict) -> bool:
        """Whether this step's gradient rows are current: the head caught its active rows up since the
        last step (``catch_up(rows, active=True)``) and nothing stepped since (``trust_active_rows``)."""
        return self.trust_active_rows and state.get("_active_at") == state[STEPS]

    def _exact_catch_up(self, p: torch.Tensor, state: dict, rows) -> None:
        """Bring rows (R,) (None: all; repeats allowed) of p and its state to step STEPS, as
        zero-gradient steps would: a gather of their suffix products by age, no host sync."""
        _follow(state, p)
        if state[STEPS] == state[BASE] and not self.graphed:  # every row is current
            return
        steps = self._steps_arg(state)
        if rows is None:
            rows = torch.arange(p.shape[0], device=p.device)
            state[BASE] = state[STEPS]
        if rows.numel() == 0:
            return
        last, coef = state[LAST], state[SUFFIX]
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        if not self.graphed and self._exact_native(p, state, group, rows, coef):  # fused C++ kernel (CPU)
            return
        block = _block_rows(p)
        for b in range(0, rows.numel(), block):
            sel = rows[b: b + block]
            k = steps - last.index_select(0, sel)  # (S,) steps each row skipped (0: current)
            self._exact_apply(p, state, group, sel, coef.index_select(0, k), k)
        last.index_fill_(0, rows, steps)

    @torch.no_grad()
    def catch_up(self, rows=None, active: bool = False) -> None:
        """Bring local rows ``rows`` (R,) of every parameter (None: every row) up to date: call before
        reading weights that may be stale (the head calls it before forward, topk, index rebuilds;
        XCEngine.save_checkpoint calls :meth:`catch_up_all`). A no-op without ``lazy_exact``.
        ``active``: these are rows of a forward's active set, whose gradient the next step applies."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p, {})
                if LAST in state:
                    self._exact_catch_up(p, state, None if rows is None else rows.to(p.device))
                    if active:
                        state["_active_at"] = state[STEPS]

    @torch.no_grad()
    def catch_up_all(self) -> None:
        """Every row of every parameter up to date."""
        self.catch_up(None)

    @staticmethod
    def exact_state_for_saving(entry: dict) -> dict:
        """One parameter's saved state: without the counters and the products when every row is
        current (after :meth:`catch_up_all`, as XCEngine.save_checkpoint does), so the checkpoint holds
        the state of a dense run, one row per class (export, reshard and other update modes read it as
        such); a resumed lazy_exact run restarts its counters from there, which is the same as keeping
        them. With stale rows (a state_dict taken mid-run) the counters and products are kept."""
        entry = {k: v for k, v in entry.items() if not k.startswith("_")}
        if LAST not in entry or entry[BASE] != entry[STEPS]:
            return entry
        return {k: v for k, v in entry.items() if k not in (LAST, SUFFIX, STEPS, BASE)}

    def convert_exact_state(self, p: torch.Tensor, state: dict) -> None:
        """A state loaded from a checkpoint of an earlier revision (a CPU history of per-step scalars
        instead of the suffix products): every row is caught up from that history now, exactly, and
        the state restarts in this revision's form."""
        hist = state.pop(HIST, None)
        if hist is None or LAST not in state:
            return
        steps, base = state[STEPS], state[BASE]
        last = state[LAST].to(p.device)
        first = int(last.min()) if last.numel() else steps
        mats = _entries_of_history(self._exact_kind, hist[first - base: steps - base])
        coef = suffix_products(mats).to(p.device)  # (n + 1, 2, 2): k steps back from now
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        k = steps - last  # (L,)
        rows, block = torch.arange(p.shape[0], device=p.device), _block_rows(p)
        for b in range(0, rows.numel(), block):
            self._exact_apply(p, state, group, rows[b: b + block], coef.index_select(0, k[b: b + block]),
                              k[b: b + block])
        state[LAST] = torch.full_like(last, steps)
        state[SUFFIX] = _identity_suffix(p.device)
        state[BASE] = steps

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
                    for key in (LAST, SUFFIX, STEPS, BASE, "_active_at", "_spare", STEPS_T):
                        state.pop(key, None)


def _identity_suffix(device) -> torch.Tensor:
    """(WINDOW + 1, 2, 2) float64 identities: no step recorded yet."""
    return torch.eye(2, dtype=torch.float64, device=device).repeat(WINDOW + 1, 1, 1)


def _follow(state: dict, p: torch.Tensor) -> None:
    """The counters and products follow the weight's device (``head.to``)."""
    for key in (LAST, SUFFIX, STEPS_T):
        if key in state and state[key].device != p.device:
            state[key] = state[key].to(p.device)
    state.pop("_spare", None) if "_spare" in state and state["_spare"].device != p.device else None


def _push(state: dict, entries: tuple, in_place: bool = False) -> None:
    """suffix[k] <- M suffix[k - 1] for k >= 1 (entry 0 stays the identity), M = [[a, b], [c, d]] the
    step's matrix: Python floats (four device ops into a second buffer, swapped in; no host data) or,
    ``in_place`` (captured steps), 0-dim device tensors, the products updated where they are."""
    old = state[SUFFIX]
    if in_place:
        a, b, c, d = entries
        prev = old[:-1].clone()  # (W, 2, 2)
        torch.mul(prev[:, 0], a, out=old[1:, 0]).add_(prev[:, 1] * b)
        torch.mul(prev[:, 0], c, out=old[1:, 1]).add_(prev[:, 1] * d)
        return
    a, b, c, d = (float(v) for v in entries)
    new = state.pop("_spare", None)
    if new is None or new.shape != old.shape:
        new = _identity_suffix(old.device)
    top, bottom = old[:-1, 0], old[:-1, 1]  # (W, 2) rows of the previous products
    torch.mul(top, a, out=new[1:, 0]).add_(bottom, alpha=b)
    torch.mul(top, c, out=new[1:, 1]).add_(bottom, alpha=d)
    state[SUFFIX], state["_spare"] = new, old

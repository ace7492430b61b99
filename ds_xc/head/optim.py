"""Optimizers for the head shards: SGD (momentum) and AdamW, dense or lazy.

A head shard is large (10^6 rows x d per rank is usual), so both optimizers work in
place, in blocks of rows: a dense step allocates at most one block-sized temporary,
never a second shard-sized tensor (torch's SGD with weight decay allocates a full copy
of the gradient); a lazy step likewise gathers the active rows block by block. The formulas are torch.optim.SGD's and torch.optim.AdamW's.

Lazy semantics (``lazy=True``; like torch.optim.SparseAdam and TensorFlow's lazy Adam):
given a row-sparse gradient (the sampled head with ``update: lazy``), a step touches only
the rows present in the gradient, i.e. the active classes. For those rows the update is
exactly the dense formula; other rows are left alone: their momentum does not decay,
weight decay does not shrink them and, for AdamW, their moments keep their values while
the bias correction uses the global step count. A step then costs O(K*d), not O(L*d).
Given a dense gradient (every row active) lazy and dense steps are identical. A dense
optimizer given a sparse gradient densifies it (exact dense semantics).

Exact lazy semantics (``exact=True``, ``update: lazy_exact``): lazy steps, but a row is first
caught up on the zero-gradient steps it skipped, so the trajectory is the dense one (SGD
exactly, AdamW up to the eps of the skipped steps); ``catch_up_all()`` brings every row up
to date. See ds_xc/head/lazy_exact.py.

On the CPU the lazy step and the exact catch-up of float32 / float64 rows run in fused C++ row
kernels (ds_xc_ops.rows: one in-place pass per row, SGD with the PyTorch path's bits, AdamW within
an ulp); other devices and dtypes, and ``DS_XC_NATIVE_ROWS=0``, take the PyTorch code below.

State lives in ``optimizer.state[p]`` so that ``state_dict()`` round-trips. Devices and
dtypes: state tensors follow the weight's device at the next step (after ``head.to(device)``;
``step`` stays a CPU scalar, as torch keeps it); their dtype is the one they were created
with (the weight's at the first step) and survives ``head.to(dtype)``, so the update accepts
moments of another dtype than the weight. torch's ``load_state_dict`` casts floating state
to the weight's device and dtype.

bfloat16 weights (``bf16_update``, see ds_xc/head/bf16.py): the update is computed in
float32 on block-sized temporaries and rounded back stochastically (``stochastic_rounding``:
bf16 weights and first moments, float32 AdamW second moment), from a float32 master copy
(``master_fp32``: float32 master and states, bf16 weight = its rounded copy), or to nearest
(``plain``: every state bf16; updates below half a bf16 ulp are lost). float32/float64
weights ignore ``bf16_update`` and take the original in-place path.
"""
from __future__ import annotations

import math

import torch
from torch.optim import Optimizer
from torch.utils.weak import WeakIdKeyDictionary

from ds_xc import config as cfg
from ds_xc.host_syncs import host_side
from ds_xc_ops import rows as native_rows
from ds_xc.head.bf16 import BF16_UPDATES, round_to_bf16
from ds_xc.head.lazy_exact import HIST, LAST, STEPS, SUFFIX, ExactLazyMixin, adamw_entries, sgd_entries

__all__ = ["HeadSGD", "HeadAdamW", "build_head_optimizer", "resolved_update"]

_BLOCK = 1 << 15  # rows per block of a dense step and of the gathered rows of a lazy step


def _rows(p: torch.Tensor, lazy: bool, sorted_rows=None):
    """(row ids (R,) or None for all rows, gradient rows (R, d) or the dense gradient).

    A row-sparse gradient whose rows are sorted and distinct is read as it is: no sort, no host sync.
    It is known to be so when it is marked coalesced, or when its row ids are the very tensor
    ``sorted_rows()`` returns (the head's last active set: its gather builds the gradient on those ids,
    and torch's gradient accumulation keeps them but drops the coalesced mark). Any other (summed over
    several gathers: sample groups, accumulation) is coalesced here, a host sync on a GPU."""
    g = p.grad
    if not g.is_sparse:
        return None, g
    if not lazy or g.sparse_dim() != 1:  # dense semantics, or element-wise COO: densify
        return None, g.to_dense()
    if g.is_coalesced():
        return g.indices()[0], g.values()
    rows = g._indices()[0]
    known = sorted_rows() if sorted_rows is not None else None
    if known is not None and known.numel() == rows.numel() and known.data_ptr() == rows.data_ptr():
        return rows, g._values()  # the head's own sorted, distinct active rows
    g = g.coalesce()
    return g.indices()[0], g.values()


def _follow_device(state: dict, p: torch.Tensor) -> None:
    """Move one parameter's state tensors to ``p``'s device (the head may have moved since the
    last step); ``step`` stays on the CPU."""
    for key, value in state.items():
        if key not in ("step", HIST) and torch.is_tensor(value) and value.device != p.device:
            state[key] = value.to(p.device)


def _host_step(counts, p: torch.Tensor, state: dict) -> int:
    """Advance AdamW's step count of ``p`` and return it as a Python int. ``state["step"]`` stays the
    CPU tensor torch keeps (what checkpoints hold); ``counts`` (per parameter) mirrors it on the host,
    read from that tensor once after a load, so a step never reads a tensor."""
    t = counts.get(p)
    if t is None:
        t = int(host_side(state["step"]).item())  # once after a load: a CPU tensor, no device sync
    counts[p] = t + 1
    state["step"].fill_(t + 1)
    return t + 1


def _device_step(state: dict, device, t: int) -> torch.Tensor:
    """AdamW's step count as a float64 device counter (graphed steps): made from the host count ``t``
    once, then advanced by one on the device each step, replays included."""
    dev = state.get("_step_t")
    if dev is None or dev.device != torch.device(device):
        dev = state["_step_t"] = torch.full((), float(t - 1), dtype=torch.float64, device=device)
    return dev.add_(1.0)


def _blocks(n: int):
    for a in range(0, n, _BLOCK):
        yield slice(a, min(a + _BLOCK, n))


def _get(t: torch.Tensor, sel) -> torch.Tensor:
    """Rows ``sel`` (a block slice: a view; row ids: a gathered copy) as float32 (a view if t is)."""
    rows = t[sel] if isinstance(sel, slice) else t.index_select(0, sel)
    return rows.float()


class _HeadOptimizer(ExactLazyMixin, Optimizer):
    """Shared bf16 machinery (the update mode, the rounding generator and its state dict entry) and
    the exact lazy catch-up (ds_xc/head/lazy_exact.py)."""

    _FP32_KEYS: dict = {}  # mode -> state keys kept in float32 for bf16 weights

    def __init__(self, params, defaults: dict, bf16_update: str, seed: int):
        if bf16_update not in BF16_UPDATES:
            raise cfg.ConfigError(f"{cfg.HEAD_SECTION}.optimizer.bf16_update: got {bf16_update!r}; "
                                  f"allowed: {list(BF16_UPDATES)}")
        super().__init__(params, defaults)
        self.bf16_update, self.seed = bf16_update, int(seed)
        self._gen = None
        self._step_counts = WeakIdKeyDictionary()  # parameter -> its step count on the host (AdamW)

    # Set by build_head_optimizer: returns the head's last active rows (sorted, distinct) or None, so that a
    # gradient built on them is used as it is (_rows)
    sorted_rows = None

    # ------------------------------------------------------------------ captured steps (ds_xc/head/graphs.py)
    def _lr(self, index: int, group: dict, device):
        """The group's learning rate as a step's kernels take it: the Python float, or (``graphed``) a
        0-dim device tensor that :meth:`prepare_graphed_step` fills before each step or replay."""
        if not self.graphed:
            return group["lr"]
        dev = self.__dict__.setdefault("_lr_dev", {})
        t = dev.get(index)
        if t is None or t.device != torch.device(device):
            t = dev[index] = torch.full((), float(group["lr"]), dtype=torch.float64, device=device)
        return t

    def prepare_graphed_step(self) -> None:
        """Before a captured step or its replay: the current learning rates into their device tensors (a
        fill launch each, no host data copied up)."""
        for index, group in enumerate(self.param_groups):
            t = self.__dict__.get("_lr_dev", {}).get(index)
            if t is not None:
                t.fill_(float(group["lr"]))

    def after_replay(self) -> None:
        """The host side of a replayed step: what an eager step advances on the host."""
        self.exact_after_replay()

    def rounding_generator(self):
        """The generator of the bf16 stochastic rounding (None before a bf16 step made it)."""
        return self._gen

    def _generator(self, device) -> torch.Generator:
        if self._gen is None:
            self._gen = torch.Generator(device=device).manual_seed(self.seed)
        return self._gen

    def _state_dtype(self, p: torch.Tensor, key: str) -> torch.dtype:
        if key in (HIST, SUFFIX):
            return torch.float64
        if p.dtype == torch.bfloat16 and key in self._FP32_KEYS.get(self.bf16_update, ()):
            return torch.float32
        return p.dtype

    def _put(self, t: torch.Tensor, sel, x: torch.Tensor) -> None:
        """Store float32 rows x into t's rows ``sel``, rounding to bf16 as the mode says."""
        if t.dtype == torch.bfloat16:
            x = round_to_bf16(x, self.bf16_update == "stochastic_rounding", self._gen)
        elif isinstance(sel, slice):
            return  # x is t's own float32 view, already updated in place
        if isinstance(sel, slice):
            t[sel].copy_(x)
        else:
            t.index_copy_(0, sel, x)

    def _bf16_weight(self, p: torch.Tensor, state: dict) -> torch.Tensor:
        """The tensor the update reads and writes: the float32 master (master_fp32) or p."""
        if self.bf16_update != "master_fp32":
            return p
        if "master" not in state:
            state["master"] = p.detach().float()  # (L, d)
        return state["master"]

    def state_dict(self):
        sd = super().state_dict()
        sd["state"] = {i: self.exact_state_for_saving(entry) for i, entry in sd["state"].items()}
        if self._gen is not None:
            sd["bf16_rng"] = self._gen.get_state()
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        rng = state_dict.pop("bf16_rng", None)
        # the hyperparameters (lr, momentum, weight decay, betas, eps, nesterov) and the update mode are
        # config, not state: a resume with edited values follows them (torch's load_state_dict would put
        # back the checkpoint's; ds_xc/checkpoint/options.py logs what changed)
        configured = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        mine = "betas" if "betas" in configured[0] else "momentum"  # AdamW's and SGD's own hyperparameter
        other = [g for g in state_dict.get("param_groups", []) if mine not in g]
        if other:  # another optimizer's state: refused before anything changes (it used to fail at the first step)
            raise ValueError(f"{type(self).__name__}.load_state_dict: the state was saved by another head optimizer "
                             f"(its param groups have {sorted(k for k in other[0] if k != 'params')}, no "
                             f"{mine!r}); nothing was loaded. Resume with extreme_classification.optimizer.type "
                             "it was saved with")
        super().load_state_dict(state_dict)  # casts floating state to the parameter's dtype ...
        for g, mine in zip(self.param_groups, configured):
            for key in set(g) - set(mine) - {"params"}:  # another optimizer's keys (refused earlier by a resume)
                del g[key]
            g.update(mine)
        params = [p for g in self.param_groups for p in g["params"]]
        for idx, saved in state_dict.get("state", {}).items():  # ... so restore float32 states
            p = params[idx]
            for key, value in saved.items():
                if torch.is_tensor(value) and value.dim() >= 1 and key in self.state[p]:
                    device = "cpu" if key == HIST else p.device  # an older checkpoint's history: on the CPU
                    dtype = self._state_dtype(p, key) if value.is_floating_point() else value.dtype  # counters
                    self.state[p][key] = value.to(device=device, dtype=dtype, copy=True)
            self.convert_exact_state(p, self.state[p])  # an earlier revision's lazy_exact history, if any
        self._step_counts = WeakIdKeyDictionary()  # re-read from the loaded step tensors
        if rng is not None and params:
            self._generator(params[0].device).set_state(rng)
        self.finish_exact_lazy()  # a lazy_exact checkpoint resumed in another mode: rows made current


class HeadSGD(_HeadOptimizer):
    """torch.optim.SGD's update (momentum, L2 weight decay, Nesterov), in place, dense or lazy.

    bf16 weights: see ``bf16_update`` in the module docstring; ``seed`` seeds the rounding."""

    _FP32_KEYS = {"master_fp32": ("master", "momentum_buffer")}

    def __init__(self, params, lr: float, momentum: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False, lazy: bool = False, bf16_update: str = "stochastic_rounding",
                 seed: int = 0, exact: bool = False):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      nesterov=nesterov, lazy=lazy or exact, exact=exact), bf16_update, seed)

    _exact_kind = "sgd"

    @staticmethod
    def _exact_apply(p, state, group, rows, q, k):
        """Catch rows (S,) up by their suffix products q (S, 2, 2) of the zero-gradient steps.

        The products are formed in float64 (lazy_exact.suffix_products); the per-row combination
        runs in the weight's dtype, in place on the gathered rows (two gathers, two scatters and
        four fused passes over (S, d)): one rounding of each result, as one dense step has."""
        q = q.to(p.dtype)
        w = p.index_select(0, rows)  # (S, d)
        buf = state.get("momentum_buffer")
        if buf is None:  # no momentum: M_s = [[1 - lr*wd, 0], [wd, 0]], only the decay matters
            p.index_copy_(0, rows, w.mul_(q[:, 0, 0, None]))
            return
        b = buf.index_select(0, rows).to(p.dtype)  # (S, d)
        w2 = torch.addcmul(b * q[:, 0, 1, None], w, q[:, 0, 0, None])  # q00*w + q01*b
        b.mul_(q[:, 1, 1, None]).addcmul_(w, q[:, 1, 0, None])  # q10*w + q11*b
        p.index_copy_(0, rows, w2)
        buf.index_copy_(0, rows, b.to(buf.dtype))

    @staticmethod
    def _exact_native(p, state, group, rows, coef):
        """The catch-up in one fused pass per row (ds_xc_ops.rows); False: take _exact_apply."""
        buf = state.get("momentum_buffer")
        return buf is not None and native_rows.sgd_catch_up(p, buf, state[LAST], rows, coef, state[STEPS])

    @staticmethod
    def _update(p, g, buf, lr, mu, wd, nesterov):
        """One block (or gathered rows): returns the step d; updates buf in place."""
        d = g.add(p, alpha=wd) if wd else g.clone()
        if buf is not None:
            buf.mul_(mu).add_(d)
            d = d.add_(buf, alpha=mu) if nesterov else d.copy_(buf)
        return d

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for index, group in enumerate(self.param_groups):
            mu, wd, nest = group["momentum"], group["weight_decay"], group["nesterov"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                lr = self._lr(index, group, p.device)  # a float, or a device tensor (graphed)
                rows, g = _rows(p, group["lazy"], self.sorted_rows)
                buf = None
                if mu:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros_like(p, dtype=self._state_dtype(p, "momentum_buffer"))
                    _follow_device(state, p)
                    buf = state["momentum_buffer"]
                if group.get("exact"):
                    self._exact_begin(p, rows, sgd_entries(lr, mu, wd, nest))
                if p.dtype == torch.bfloat16:
                    self._step_bf16(p, rows, g, buf, lr, mu, wd, nest)
                    continue
                if rows is None:
                    for s in _blocks(p.shape[0]):
                        d = self._update(p[s], g[s], None if buf is None else buf[s], lr, mu, wd, nest)
                        p[s].add_(d, alpha=-lr) if not torch.is_tensor(lr) else p[s].sub_(d.mul_(lr))
                    continue
                if not self.graphed and buf is not None and native_rows.sgd_step(p, buf, rows, g, lr, mu, wd, nest):
                    continue  # one fused pass per row (CPU)
                for s in _blocks(rows.numel()):  # gathered row copies: block-sized temporaries
                    r = rows[s]
                    b = None if buf is None else buf.index_select(0, r)  # (R_block, d)
                    d = self._update(p.index_select(0, r), g[s], b, lr, mu, wd, nest)
                    if b is not None:
                        buf.index_copy_(0, r, b)
                    if torch.is_tensor(lr):
                        p.index_add_(0, r, d.to(p.dtype).mul_(-lr))
                    else:
                        p.index_add_(0, r, d.to(p.dtype), alpha=-lr)
        return loss

    def _step_bf16(self, p, rows, g, buf, lr, mu, wd, nest):
        """bf16 weight: the float32 update of each block, rounded back per ``bf16_update``."""
        self._generator(p.device)
        w_src = self._bf16_weight(p, self.state[p])
        n = p.shape[0] if rows is None else rows.numel()
        for s in _blocks(n):
            sel = s if rows is None else rows[s]  # a block of rows, or a block of row ids
            w = _get(w_src, sel)  # (B, d) float32
            b = None if buf is None else _get(buf, sel)
            d = self._update(w, g[s].float(), b, lr, mu, wd, nest)
            w.add_(d, alpha=-lr) if not torch.is_tensor(lr) else w.sub_(d.mul_(lr))
            if b is not None:
                self._put(buf, sel, b)
            if w_src is not p:
                self._put(w_src, sel, w)
            self._put(p, sel, w)


class HeadAdamW(_HeadOptimizer):
    """torch.optim.AdamW's update (decoupled weight decay), in place, dense or lazy.

    bf16 weights: see ``bf16_update`` in the module docstring; ``seed`` seeds the rounding."""

    _FP32_KEYS = {"master_fp32": ("master", "exp_avg", "exp_avg_sq"), "stochastic_rounding": ("exp_avg_sq",)}

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 lazy: bool = False, bf16_update: str = "stochastic_rounding", seed: int = 0,
                 exact: bool = False):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      lazy=lazy or exact, exact=exact), bf16_update, seed)

    _exact_kind = "adamw"

    @staticmethod
    def _exact_apply(p, state, group, rows, q, k):
        """Catch rows (S,) up: w = D*w - C*m/sqrt(v) (eps dropped, see lazy_exact), m *= b1^k, v *= b2^k."""
        b1, b2 = group["betas"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        q = q.to(p.dtype)  # float64 products; the per-row combination in the weight's dtype, in place
        w, mr, vr = p.index_select(0, rows), m.index_select(0, rows), v.index_select(0, rows)  # (S, d) each
        ratio = torch.where(vr > 0, mr.to(p.dtype) / vr.to(p.dtype).sqrt(),  # sqrt: vr is kept for the decay
                            torch.zeros((), dtype=p.dtype, device=p.device))
        p.index_copy_(0, rows, w.mul_(q[:, 0, 0, None]).sub_(ratio.mul_(q[:, 0, 1, None])))
        kf = k.to(torch.float64)[:, None]  # (S, 1)
        m.index_copy_(0, rows, mr.mul_((b1 ** kf).to(m.dtype)))
        v.index_copy_(0, rows, vr.mul_((b2 ** kf).to(v.dtype)))

    @staticmethod
    def _exact_native(p, state, group, rows, coef):
        """The catch-up in one fused pass per row (ds_xc_ops.rows); False: take _exact_apply."""
        b1, b2 = group["betas"]
        return native_rows.adamw_catch_up(p, state["exp_avg"], state["exp_avg_sq"], state[LAST], rows, coef,
                                          state[STEPS], b1, b2)

    @staticmethod
    def _update(p, g, m, v, lr, b1, b2, eps, wd, bc1, bc2):
        """One block, in place on p, m, v (p, m, v may be gathered row copies)."""
        if wd:
            p.mul_(1.0 - lr * wd)
        m.lerp_(g.to(m.dtype), 1.0 - b1)  # m may keep another dtype than p (head.to(dtype))
        v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
        if torch.is_tensor(lr):  # graphed: lr and the bias corrections are device tensors
            p.sub_(m / (v.sqrt() / bc2.sqrt()).add_(eps) * (lr / bc1))
            return
        denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
        p.addcdiv_(m, denom, value=-lr / bc1)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for index, group in enumerate(self.param_groups):
            (b1, b2), eps, wd = group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                lr = self._lr(index, group, p.device)  # a float, or a device tensor (graphed)
                rows, g = _rows(p, group["lazy"], self.sorted_rows)
                state = self.state[p]
                if "step" not in state:
                    state["step"] = host_side(torch.zeros((), dtype=torch.float32))  # on the CPU, as torch keeps it
                    state["exp_avg"] = torch.zeros_like(p, dtype=self._state_dtype(p, "exp_avg"))
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=self._state_dtype(p, "exp_avg_sq"))
                _follow_device(state, p)
                t = _host_step(self._step_counts, p, state)
                if self.graphed:  # the step count the kernels read: a device counter
                    t = _device_step(state, p.device, t)
                hyper = (lr, b1, b2, eps, wd, 1.0 - b1 ** t, 1.0 - b2 ** t)
                if group.get("exact"):
                    self._exact_begin(p, rows, adamw_entries(lr, wd, b1, b2, hyper[5], hyper[6]))
                m, v = state["exp_avg"], state["exp_avg_sq"]
                if p.dtype == torch.bfloat16:
                    self._step_bf16(p, rows, g, m, v, hyper)
                    continue
                if rows is None:
                    for s in _blocks(p.shape[0]):
                        self._update(p[s], g[s], m[s], v[s], *hyper)
                    continue
                if not self.graphed and native_rows.adamw_step(p, m, v, rows, g, *hyper):
                    continue  # one fused pass per row (CPU)
                for s in _blocks(rows.numel()):  # gathered row copies: block-sized temporaries
                    r = rows[s]
                    pr, mr, vr = p.index_select(0, r), m.index_select(0, r), v.index_select(0, r)
                    self._update(pr, g[s], mr, vr, *hyper)
                    m.index_copy_(0, r, mr)
                    v.index_copy_(0, r, vr)
                    p.index_copy_(0, r, pr)
        return loss

    def after_replay(self) -> None:
        """The host side of a replayed step: the step counts (host mirror and the CPU ``step``) too."""
        super().after_replay()
        for group in self.param_groups:
            for p in group["params"]:
                if "step" in self.state.get(p, {}):
                    _host_step(self._step_counts, p, self.state[p])

    def _step_bf16(self, p, rows, g, m, v, hyper):
        """bf16 weight: the float32 update of each block, rounded back per ``bf16_update``."""
        self._generator(p.device)
        w_src = self._bf16_weight(p, self.state[p])
        n = p.shape[0] if rows is None else rows.numel()
        if rows is not None and w_src is not p and not self.graphed and \
                native_rows.adamw_step(w_src, m, v, rows, g.float(), *hyper):
            for s in _blocks(n):  # master_fp32: the fused kernel, as a float32 head's lazy step runs it
                self._put(p, rows[s], w_src.index_select(0, rows[s]))
            return
        for s in _blocks(n):
            sel = s if rows is None else rows[s]  # a block of rows, or a block of row ids
            w, mb, vb = _get(w_src, sel), _get(m, sel), _get(v, sel)  # (B, d) float32 each
            self._update(w, g[s].float(), mb, vb, *hyper)
            self._put(m, sel, mb)
            self._put(v, sel, vb)
            if w_src is not p:
                self._put(w_src, sel, w)
            self._put(p, sel, w)


def resolved_update(head, update: str) -> str:
    """The mode an optimizer with ``update`` runs for ``head``: "auto" follows the head (its resolved
    ``update``: the gradients it produces), dense for a module without one; lazy_exact is refused for a
    bfloat16 weight (config.resolve_update's error)."""
    dtype = str(head.weight.dtype).replace("torch.", "")
    if update == "auto":
        update = getattr(head, "update", "dense")
        update = "dense" if update not in cfg.UPDATE_MODES else update
    return cfg.resolve_update(update, "full", dtype)[0]


def build_head_optimizer(head, section) -> Optimizer:
    """The head's optimizer from ``extreme_classification.optimizer`` (dict or model); ``update: auto``
    runs the head's mode (ClassParallelHead resolves auto: dense for the full sampler, lazy_exact for
    sampled heads, lazy for bfloat16 sampled heads).

    A head with a replica group (2-D layout) gets a step pre-hook that sums the shard gradient
    over its replicas (``head.replicas.reduce_grad_``): every replica then steps on the same
    gradient, with the same bf16 rounding stream (seeded by the class rank), into the same state."""
    c = cfg.validate_section(cfg.HeadOptimizerConfig, section, f"{cfg.HEAD_SECTION}.optimizer")
    update = resolved_update(head, c.update)
    lazy, exact = update in ("lazy", "frozen"), update == "lazy_exact"
    # the rounding stream: per rank (shards must not share bits), reproducible from the head seed
    seed = (1_000_003 * int(getattr(head, "seed", 0)) + 7919 * (int(getattr(head, "rank", 0)) + 1)) % (2**63)
    bf16 = dict(bf16_update=c.bf16_update, seed=seed)
    if c.type == "sgd":
        opt = HeadSGD([head.weight], lr=c.lr, momentum=c.momentum, weight_decay=c.weight_decay,
                      nesterov=c.nesterov, lazy=lazy, exact=exact, **bf16)
    else:
        opt = HeadAdamW([head.weight], lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay,
                        lazy=lazy, exact=exact, **bf16)
    replicas = getattr(head, "replicas", None)
    if hasattr(head, "active_rows"):  # its gathers' gradients are on its active rows: no coalesce needed
        opt.sorted_rows = head.active_rows
    if exact and hasattr(head, "lazy_catch_up"):  # the head catches rows up before it reads them
        head.lazy_catch_up = opt.catch_up
        # its gradient rows are its forward's active rows, caught up there (not with replicas: see there)
        opt.trust_active_rows = replicas is None or not replicas.active
    if replicas is not None and replicas.active:  # 2-D layout: the replicas' gradients summed before each step
        opt.register_step_pre_hook(lambda optimizer, args, kwargs: replicas.reduce_grad_(head.weight))
    return opt

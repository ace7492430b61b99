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

State lives in ``optimizer.state[p]`` so that ``state_dict()`` round-trips. Devices and
dtypes: state tensors follow the weight's device at the next step (after ``head.to(device)``;
``step`` stays a CPU scalar, as torch keeps it); their dtype is the one they were created
with (the weight's at the first step) and survives ``head.to(dtype)``, so the update accepts
moments of another dtype than the weight. torch's ``load_state_dict`` casts floating state
to the weight's device and dtype.
"""
from __future__ import annotations

import math

import torch
from torch.optim import Optimizer

from ds_xc import config as cfg

__all__ = ["HeadSGD", "HeadAdamW", "build_head_optimizer"]

_BLOCK = 1 << 15  # rows per block of a dense step and of the gathered rows of a lazy step


def _rows(p: torch.Tensor, lazy: bool):
    """(row ids (R,) or None for all rows, gradient rows (R, d) or the dense gradient)."""
    g = p.grad
    if not g.is_sparse:
        return None, g
    if not lazy or g.sparse_dim() != 1:  # dense semantics, or element-wise COO: densify
        return None, g.to_dense()
    if not g.is_coalesced():
        rows = g._indices()[0]
        if rows.numel() < 2 or bool((rows[1:] > rows[:-1]).all()):
            return rows, g._values()  # sorted and distinct already (a sampler's active set): no sort
        g = g.coalesce()
    return g.indices()[0], g.values()


def _follow_device(state: dict, p: torch.Tensor) -> None:
    """Move one parameter's state tensors to ``p``'s device (the head may have moved since the
    last step); ``step`` stays on the CPU."""
    for key, value in state.items():
        if key != "step" and torch.is_tensor(value) and value.device != p.device:
            state[key] = value.to(p.device)


def _blocks(n: int):
    for a in range(0, n, _BLOCK):
        yield slice(a, min(a + _BLOCK, n))


class HeadSGD(Optimizer):
    """torch.optim.SGD's update (momentum, L2 weight decay, Nesterov), in place, dense or lazy."""

    def __init__(self, params, lr: float, momentum: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False, lazy: bool = False):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      nesterov=nesterov, lazy=lazy))

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
        for group in self.param_groups:
            lr, mu, wd, nest = group["lr"], group["momentum"], group["weight_decay"], group["nesterov"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                rows, g = _rows(p, group["lazy"])
                buf = None
                if mu:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros_like(p)
                    _follow_device(state, p)
                    buf = state["momentum_buffer"]
                if rows is None:
                    for s in _blocks(p.shape[0]):
                        d = self._update(p[s], g[s], None if buf is None else buf[s], lr, mu, wd, nest)
                        p[s].add_(d, alpha=-lr)
                    continue
                for s in _blocks(rows.numel()):  # gathered row copies: block-sized temporaries
                    r = rows[s]
                    b = None if buf is None else buf.index_select(0, r)  # (R_block, d)
                    d = self._update(p.index_select(0, r), g[s], b, lr, mu, wd, nest)
                    if b is not None:
                        buf.index_copy_(0, r, b)
                    p.index_add_(0, r, d.to(p.dtype), alpha=-lr)
        return loss


class HeadAdamW(Optimizer):
    """torch.optim.AdamW's update (decoupled weight decay), in place, dense or lazy."""

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 lazy: bool = False):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, lazy=lazy))

    @staticmethod
    def _update(p, g, m, v, lr, b1, b2, eps, wd, bc1, bc2):
        """One block, in place on p, m, v (p, m, v may be gathered row copies)."""
        if wd:
            p.mul_(1.0 - lr * wd)
        m.lerp_(g.to(m.dtype), 1.0 - b1)  # m may keep another dtype than p (head.to(dtype))
        v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
        denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
        p.addcdiv_(m, denom, value=-lr / bc1)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                rows, g = _rows(p, group["lazy"])
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                _follow_device(state, p)
                state["step"] += 1
                t = float(state["step"])
                bc1, bc2 = 1.0 - b1 ** t, 1.0 - b2 ** t
                m, v = state["exp_avg"], state["exp_avg_sq"]
                if rows is None:
                    for s in _blocks(p.shape[0]):
                        self._update(p[s], g[s], m[s], v[s], lr, b1, b2, eps, wd, bc1, bc2)
                    continue
                for s in _blocks(rows.numel()):  # gathered row copies: block-sized temporaries
                    r = rows[s]
                    pr, mr, vr = p.index_select(0, r), m.index_select(0, r), v.index_select(0, r)
                    self._update(pr, g[s], mr, vr, lr, b1, b2, eps, wd, bc1, bc2)
                    m.index_copy_(0, r, mr)
                    v.index_copy_(0, r, vr)
                    p.index_copy_(0, r, pr)
        return loss


def build_head_optimizer(head, section) -> Optimizer:
    """The head's optimizer from ``extreme_classification.optimizer`` (dict or model)."""
    c = cfg.validate_section(cfg.HeadOptimizerConfig, section, f"{cfg.HEAD_SECTION}.optimizer")
    lazy = c.update == "lazy"
    if c.type == "sgd":
        return HeadSGD([head.weight], lr=c.lr, momentum=c.momentum, weight_decay=c.weight_decay,
                       nesterov=c.nesterov, lazy=lazy)
    return HeadAdamW([head.weight], lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay, lazy=lazy)

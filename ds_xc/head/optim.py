"""Optimizers for the head shards: dense (torch's own) and lazy (row-sparse) updates.

Lazy semantics (like torch.optim.SparseAdam, and TensorFlow's lazy Adam): a step touches
only the rows that have a gradient in that step, i.e. the active classes. For those rows
the update is exactly the dense formula; rows outside the active set are left alone:
their momentum does not decay, weight decay does not shrink them and, for AdamW, their
moments keep their values while the bias correction uses the global step count. A
step then costs O(K*d) instead of O(L*d). Given a dense gradient (every row active)
the lazy optimizers equal torch's SGD and AdamW.

State lives in ``optimizer.state[p]`` so that ``state_dict()`` round-trips.
"""
from __future__ import annotations

import torch
from torch.optim import Optimizer

from ds_xc import config as cfg

__all__ = ["LazySGD", "LazyAdamW", "build_head_optimizer"]


def _rows(p: torch.Tensor):
    """(row ids (R,) or None for all rows, gradient rows (R, d))."""
    g = p.grad
    if g.is_sparse:
        if g.sparse_dim() != 1:  # element-wise COO: not row-sparse, treat as dense
            return None, g.to_dense()
        g = g.coalesce()
        return g.indices()[0], g.values()
    return None, g


class LazySGD(Optimizer):
    """SGD with momentum and (L2) weight decay, applied to the gradient's rows only."""

    def __init__(self, params, lr: float, momentum: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                rows, g = _rows(p)
                w = p if rows is None else p.index_select(0, rows)  # (R, d)
                d = g.add(w, alpha=wd) if wd else g.clone()
                if mu:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros_like(p)
                    buf = state["momentum_buffer"]
                    b = (buf if rows is None else buf.index_select(0, rows)).mul_(mu).add_(d)
                    if rows is not None:
                        buf.index_copy_(0, rows, b)
                    d = d.add(b, alpha=mu) if group["nesterov"] else b
                if rows is None:
                    p.add_(d, alpha=-lr)
                else:
                    p.index_add_(0, rows, d.to(p.dtype), alpha=-lr)
        return loss


class LazyAdamW(Optimizer):
    """AdamW (decoupled weight decay) applied to the gradient's rows only."""

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                rows, g = _rows(p)
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = float(state["step"])
                bc1, bc2 = 1.0 - b1 ** t, 1.0 - b2 ** t
                m_all, v_all = state["exp_avg"], state["exp_avg_sq"]
                m = m_all if rows is None else m_all.index_select(0, rows)  # (R, d)
                v = v_all if rows is None else v_all.index_select(0, rows)
                m.mul_(b1).add_(g, alpha=1.0 - b1)
                v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
                upd = (m / bc1).div_((v / bc2).sqrt_().add_(eps))
                if rows is None:
                    if wd:
                        p.mul_(1.0 - lr * wd)
                    p.add_(upd, alpha=-lr)
                else:
                    m_all.index_copy_(0, rows, m)
                    v_all.index_copy_(0, rows, v)
                    if wd:
                        upd.add_(p.index_select(0, rows), alpha=wd)
                    p.index_add_(0, rows, upd.to(p.dtype), alpha=-lr)
        return loss


def build_head_optimizer(head, section) -> Optimizer:
    """The head's optimizer from ``extreme_classification.optimizer`` (dict or model)."""
    c = cfg.validate_section(cfg.HeadOptimizerConfig, section, f"{cfg.HEAD_SECTION}.optimizer")
    params = [head.weight]
    if c.type == "sgd":
        if c.update == "lazy":
            return LazySGD(params, lr=c.lr, momentum=c.momentum, weight_decay=c.weight_decay, nesterov=c.nesterov)
        return torch.optim.SGD(params, lr=c.lr, momentum=c.momentum, weight_decay=c.weight_decay,
                               nesterov=c.nesterov)
    if c.update == "lazy":
        return LazyAdamW(params, lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay)
    return torch.optim.AdamW(params, lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay)

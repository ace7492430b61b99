"""Dense, single-process float64 references: the formulas of docs/design.md written plainly,
differentiated by autograd. Everything the head computes is checked against these."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

LOSSES = {
    "softmax": {"type": "softmax"},
    "cosface": {"type": "cosface", "scale": 30.0, "margin": 0.35},
    "arcface": {"type": "arcface", "scale": 30.0, "margin": 0.5},
    "combined": {"type": "combined", "scale": 30.0, "m1": 1.0, "m2": 0.3, "m3": 0.2},
    "dsoftmax": {"type": "dsoftmax", "scale": 30.0, "d": 0.9},
}


def target_logit(name: str, cfg: dict, cos_t: torch.Tensor) -> torch.Tensor:
    s = cfg.get("scale", 1.0)
    if name == "cosface":
        return s * (cos_t - cfg["margin"])
    if name == "arcface":
        m = cfg["margin"]
        theta = torch.acos(cos_t)
        return torch.where(theta + m <= math.pi, s * torch.cos(theta + m), s * (cos_t - m * math.sin(m)))
    if name == "combined":
        theta = torch.acos(cos_t)
        return s * (torch.cos(cfg["m1"] * theta + cfg["m2"]) - cfg["m3"])
    raise KeyError(name)


def per_row_loss(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, cfg: dict) -> torch.Tensor:
    """Loss of every row: x (N, d), w (C, d), y (N,) -> (N,)."""
    name = cfg["type"]
    if name == "softmax":
        return F.cross_entropy(x @ w.t(), y, reduction="none")
    s = cfg["scale"]
    cos = F.normalize(x, dim=1) @ F.normalize(w, dim=1).t()  # (N, C)
    cos_t = cos.gather(1, y[:, None]).squeeze(1)
    if name == "dsoftmax":
        neg = (s * cos).masked_fill(F.one_hot(y, w.shape[0]).bool(), float("-inf"))
        zero = torch.zeros((x.shape[0], 1), dtype=x.dtype)
        return F.softplus(s * (cfg["d"] - cos_t)) + torch.logsumexp(torch.cat([neg, zero], 1), 1)
    z = (s * cos).scatter(1, y[:, None], target_logit(name, cfg, cos_t)[:, None])
    return F.cross_entropy(z, y, reduction="none")


def reference(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, cfg: dict):
    """(mean loss, d loss/dx, d loss/dw), float64, global mean over the rows."""
    x = x.detach().to(torch.float64).requires_grad_()
    w = w.detach().to(torch.float64).requires_grad_()
    loss = per_row_loss(x, w, y, cfg).mean()
    loss.backward()
    return loss.detach(), x.grad, w.grad

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


def option_rows(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, cfg: dict, opts: dict):
    """Every row's loss with the loss options (docs/head.md, "Loss options"), unweighted, and its lse:
    x (N, d), w (C, d), y (N,) (rows labelled ``ignore_index`` get a placeholder class) -> (N,), (N,)."""
    name, c = cfg["type"], w.shape[0]
    eps, zl, cap = opts.get("label_smoothing", 0.0), opts.get("z_loss", 0.0), opts.get("softcap", 0.0)
    ignored = (y == opts.get("ignore_index", -100))[:, None]  # (N, 1): no target, so no margin in their lse
    y = torch.where(ignored[:, 0], torch.zeros_like(y), y)
    if name == "softmax":
        z = x @ w.t()  # (N, C)
        if cap:
            z = cap * torch.tanh(z / cap)
    else:
        s = cfg["scale"]
        cos = F.normalize(x, dim=1) @ F.normalize(w, dim=1).t()
        cos_t = cos.gather(1, y[:, None]).squeeze(1)
        if name == "dsoftmax":
            z = s * cos
            neg = z.masked_fill(F.one_hot(y, c).bool() & ~ignored, float("-inf"))
            lse = torch.logsumexp(torch.cat([neg, torch.zeros((x.shape[0], 1), dtype=x.dtype)], 1), 1)
            intra = F.softplus(s * (cfg["d"] - cos_t))
            return lse + (1 - eps) * intra - eps * z.mean(dim=1) + zl * lse ** 2, lse
        z = (s * cos).scatter(1, y[:, None], target_logit(name, cfg, cos_t)[:, None])
        z = torch.where(ignored, s * cos, z)
    lse = torch.logsumexp(z, dim=1)
    rows = lse - (1 - eps) * z.gather(1, y[:, None]).squeeze(1) - eps * z.mean(dim=1) + zl * lse ** 2
    return rows, lse


def option_loss(x, w, y, cfg: dict, opts: dict, sample_weight=None):
    """The head's output with the loss options, float64: mean / sum (a scalar) or none ((N,) v_i row_i),
    v = sample weight (1 without) times (label != ignore_index); and every row's lse."""
    rows, lse = option_rows(x, w, y, cfg, opts)
    v = (y != opts.get("ignore_index", -100)).to(rows.dtype)
    if sample_weight is not None:
        v = v * sample_weight.to(rows.dtype)
    rows = torch.where(v != 0, rows * v, torch.zeros_like(rows))
    red = opts.get("reduction", "mean")
    if red == "none":
        return rows, lse
    return (rows.sum() / v.sum() if red == "mean" else rows.sum()), lse


def option_reference(x, w, y, cfg: dict, opts: dict, sample_weight=None, upstream=None):
    """(value, d/dx, d/dw, lse) in float64 for :func:`option_loss`; reduction none: the gradients of
    sum(upstream * rows) (``upstream`` (N,))."""
    x = x.detach().to(torch.float64).requires_grad_()
    w = w.detach().to(torch.float64).requires_grad_()
    out, lse = option_loss(x, w, y, cfg, opts, sample_weight)
    (out if upstream is None else (out * upstream).sum()).backward()
    return out.detach(), x.grad, w.grad, lse.detach()

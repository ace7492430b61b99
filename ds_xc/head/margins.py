"""Target-logit functions of the margin losses (pure math on the target cosines).

Each loss maps the target cosine ``c = <x/|x|, w_y/|w_y|>`` to the target logit and its
derivative; non-target logits are ``scale * c`` (or ``x.w`` for plain softmax). The
derivatives are exact derivatives of the formulas in docs/design.md (tests compare them with
autograd in float64). D-Softmax is not a softmax over all logits: its target enters a
separate softplus term, flagged by ``separate_target``.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from ds_xc import config as cfg

__all__ = ["TargetLoss", "build_loss", "LOSSES"]

_TINY = 1e-12  # floor under sin(theta) so that cos -> +-1 yields a large, finite slope


def _sin_from_cos(c: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(torch.clamp(1.0 - c * c, min=_TINY))


class TargetLoss:
    """Base: plain softmax cross entropy on unnormalised logits (target logit unchanged)."""

    normalised = False
    separate_target = False
    scale = 1.0

    def target_logit(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(z_y, dz_y/dc) for target cosines (or raw logits) ``c`` of shape (n,)."""
        return c, torch.ones_like(c)

    def describe(self) -> str:
        return type(self).__name__


class CosFace(TargetLoss):
    normalised = True

    def __init__(self, scale: float, margin: float):
        self.scale, self.margin = float(scale), float(margin)

    def target_logit(self, c):
        return self.scale * (c - self.margin), torch.full_like(c, self.scale)


class ArcFace(TargetLoss):
    """s cos(theta + m); beyond theta + m > pi (c < -cos m) the logit is s (c - m sin m)."""

    normalised = True

    def __init__(self, scale: float, margin: float):
        self.scale, self.margin = float(scale), float(margin)
        self.cos_m, self.sin_m = math.cos(margin), math.sin(margin)

    def target_logit(self, c):
        s = self.scale
        c = c.clamp(-1.0, 1.0)
        sin = _sin_from_cos(c)
        inside = c >= -self.cos_m  # theta + m <= pi
        z = torch.where(inside, s * (c * self.cos_m - sin * self.sin_m), s * (c - self.margin * self.sin_m))
        dz = torch.where(inside, s * (self.cos_m + self.sin_m * c / sin), torch.full_like(c, s))
        return z, dz


class Combined(TargetLoss):
    """s (cos(m1 theta + m2) - m3), theta = acos(c)."""

    normalised = True

    def __init__(self, scale: float, m1: float, m2: float, m3: float):
        self.scale, self.m1, self.m2, self.m3 = float(scale), float(m1), float(m2), float(m3)

    def target_logit(self, c):
        s = self.scale
        c = c.clamp(-1.0, 1.0)
        theta = torch.acos(c)
        arg = self.m1 * theta + self.m2
        z = s * (torch.cos(arg) - self.m3)
        dz = s * self.m1 * torch.sin(arg) / _sin_from_cos(c)
        return z, dz


class DSoftmax(TargetLoss):
    """D-Softmax: softplus(s (d - c_y)) + log(1 + sum_{k != y} exp(s c_k))."""

    normalised = True
    separate_target = True

    def __init__(self, scale: float, d: float):
        self.scale, self.d = float(scale), float(d)

    def target_term(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(intra-class loss, its derivative in c) for target cosines c (n,)."""
        u = self.scale * (self.d - c)
        return torch.nn.functional.softplus(u), -self.scale * torch.sigmoid(u)


LOSSES: dict[str, Callable[..., TargetLoss]] = {
    "softmax": lambda c: TargetLoss(),
    "cosface": lambda c: CosFace(c.scale, c.margin),
    "arcface": lambda c: ArcFace(c.scale, c.margin),
    "combined": lambda c: Combined(c.scale, c.m1, c.m2, c.m3),
    "dsoftmax": lambda c: DSoftmax(c.scale, c.d),
}


def build_loss(loss) -> TargetLoss:
    """A TargetLoss from a loss config (model, dict, or the bare type name)."""
    if isinstance(loss, TargetLoss):
        return loss
    loss = cfg.parse_loss(loss)
    return LOSSES[loss.type](loss)

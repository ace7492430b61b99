"""LARS (You, Gitman, Ginsburg 2017, "Large Batch Training of Convolutional Networks",
arXiv 1708.03888, Algorithm 1), written from the paper's formulas.

For each parameter tensor w with gradient g (SGD with momentum and a layer-wise local lr):

    local = eta * ||w|| / (||g|| + weight_decay * ||w|| + eps), and 1 if ||w|| = 0 or ||g|| = 0
    v = momentum * v + lr * local * (g + weight_decay * w)
    w = w - v

``eta`` is ``trust_coefficient`` (the paper's 0.001 by default); ``eps`` (0 by default, not
in the paper) keeps the quotient finite for tiny norms. The momentum buffer starts at 0, so
the first step is ``lr * local * (g + weight_decay * w)``. As in the paper the global lr
multiplies inside the momentum: a change of lr applies to the new gradient, not to the
accumulated velocity. With ``exclude_bias_and_norm`` a 1-D tensor takes local = 1 and no
weight decay (plain SGD with momentum at ``lr``). ``lr`` is read from the param group at
every step (DeepSpeed's schedulers set it). DeepSpeed has no LARS: ds_xc always runs this one.
"""
from __future__ import annotations

import torch

from ds_xc.optim.trust import LayerwiseOptimizer, excluded_of, layer_norms, trust_ratio, where_excluded

__all__ = ["Lars"]


class Lars(LayerwiseOptimizer):
    """LARS with per-tensor (layer-wise) local learning rate; see the module docstring.

    ``layouts`` ({flat parameter: PartitionLayout}) is set by ds_xc under ZeRO 1/2 (attach_partition_layouts)."""

    def __init__(self, params, lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coefficient: float = 0.001, eps: float = 0.0, exclude_bias_and_norm: bool = False):
        if lr < 0 or weight_decay < 0 or eps < 0 or trust_coefficient <= 0:
            raise ValueError(f"Lars: lr={lr}, weight_decay={weight_decay}, eps={eps} must be >= 0 and "
                             f"trust_coefficient={trust_coefficient} > 0")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Lars: momentum={momentum}: must be in [0, 1)")
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "trust_coefficient": trust_coefficient,
                    "eps": eps, "exclude_bias_and_norm": exclude_bias_and_norm}
        super().__init__(params, defaults)


    def _update(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        g = p.grad.to(buf.dtype)
        w = p.detach().to(buf.dtype)
        excluded = excluded_of(self, p, group["exclude_bias_and_norm"])
        decay = where_excluded(excluded, group["weight_decay"], 0.0)
        w_norm, g_norm = layer_norms(self, p, g)
        local = trust_ratio(group["trust_coefficient"] * w_norm, g_norm + decay * w_norm + group["eps"],
                            w_norm, g_norm)
        local = where_excluded(excluded, local, 1.0)
        buf.mul_(group["momentum"]).add_(group["lr"] * local * (g + decay * w))
        p.sub_(buf.to(p.dtype))

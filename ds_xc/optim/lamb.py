"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76
minutes", arXiv 1904.00962, Algorithm 2), written from the paper's formulas.

For each parameter tensor w with gradient g, at its step t (counted per tensor):

    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g^2
    m_hat = m / (1 - beta1^t),  v_hat = v / (1 - beta2^t)       (bias_correction; else m, v)
    r = m_hat / (sqrt(v_hat) + eps)                               (eps_inside_sqrt: / sqrt(v_hat + eps))
        + weight_decay * w
    trust = clamp(||w|| / ||r||, min_coeff, max_coeff), and 1 if ||w|| = 0 or ||r|| = 0
    w = w - lr * trust * r

With ``exclude_bias_and_norm`` a 1-D tensor (bias, norm-layer scale or shift) takes trust 1
and no weight decay: a plain Adam step. ``lr`` is read from the param group at every step,
so DeepSpeed's schedulers (which set ``param_group["lr"]``) drive it. The clamp is the
paper's scaling function phi with DeepSpeed FusedLamb's bounds (``min_coeff`` 0.01,
``max_coeff`` 10 by default); the ratio 1 at a zero norm is FusedLamb's rule too.

Differences from DeepSpeed's FusedLamb (CUDA), which ds_xc uses on GPUs where it builds:
FusedLamb folds the bias correction into the step size (``lr * sqrt(1 - beta2^t) / (1 -
beta1^t)``) and so adds eps to sqrt(v), not sqrt(v_hat), and scales the weight decay term
and the update whose norm it takes by that factor; the trajectories agree closely but not
bit for bit (docs/optimizers.md).
"""
from __future__ import annotations

import torch

from ds_xc.optim.trust import LayerwiseOptimizer, excluded_of, layer_norms, trust_ratio, where_excluded

__all__ = ["Lamb"]


class Lamb(LayerwiseOptimizer):
    """LAMB with per-tensor (layer-wise) trust ratio; see the module docstring for the formulas.

    ``layouts`` ({flat parameter: PartitionLayout}) is set by ds_xc under ZeRO 1/2, where
    a parameter is a flat partition of many layers (ds_xc/optim/deepspeed.py: attach_partition_layouts)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 max_coeff: float = 10.0, min_coeff: float = 0.01, bias_correction: bool = True,
                 eps_inside_sqrt: bool = False, exclude_bias_and_norm: bool = False):
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"Lamb: lr={lr}, eps={eps}, weight_decay={weight_decay}: each must be >= 0")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lamb: betas={tuple(betas)}: each must be in [0, 1)")
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(f"Lamb: min_coeff={min_coeff}, max_coeff={max_coeff}: need 0 <= min_coeff <= max_coeff")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay, "max_coeff": max_coeff,
                    "min_coeff": min_coeff, "bias_correction": bias_correction, "eps_inside_sqrt": eps_inside_sqrt,
                    "exclude_bias_and_norm": exclude_bias_and_norm}
        super().__init__(params, defaults)


    def _update(self, p: torch.Tensor, group: dict) -> None:
        beta1, beta2 = group["betas"]
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        t, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
        g = p.grad.to(m.dtype)
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        m_hat, v_hat = (m / (1 - beta1 ** t), v / (1 - beta2 ** t)) if group["bias_correction"] else (m, v)
        eps = group["eps"]
        denom = (v_hat + eps).sqrt() if group["eps_inside_sqrt"] else v_hat.sqrt().add_(eps)
        r = m_hat / denom
        excluded = excluded_of(self, p, group["exclude_bias_and_norm"])
        decay = where_excluded(excluded, group["weight_decay"], 0.0)
        if not isinstance(decay, float) or decay != 0.0:
            r = r + decay * p.detach().to(r.dtype)
        w_norm, r_norm = layer_norms(self, p, r)
        trust = where_excluded(excluded, trust_ratio(w_norm, r_norm, w_norm, r_norm, group["min_coeff"],
                                                     group["max_coeff"]), 1.0)
        p.sub_((group["lr"] * trust * r).to(p.dtype))

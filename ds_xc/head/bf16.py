"""bfloat16 head weights: rounding of the optimizer's float32 update back into bf16 storage.

A bf16 weight has 8 significant bits: an update smaller than half a unit in the last place
(|lr * step| < 2^-9 |w|) is lost by round-to-nearest, every step, so small learning rates,
weight decay and the tiny gradients of easy negatives stop training a bf16 head ("plain").
Two fixes, chosen by ``extreme_classification.optimizer.bf16_update``:

* ``stochastic_rounding`` (the default): the optimizer computes the update in float32 on
  block-sized temporaries and rounds the result to one of its two neighbouring bf16 values
  with probabilities proportional to the distances, so the stored value equals the float32
  value in expectation and small updates accumulate on average. Weights and first-moment
  states are stored in bf16; AdamW's second moment stays float32 (its EMA with beta2 ~ 0.999
  adds 1e-3 relative per step, and SR noise there would enter every step through 1/sqrt(v)).
* ``master_fp32``: a float32 copy of the weights (and float32 optimizer states) is what the
  optimizer updates; the bf16 weight is its round-to-nearest copy. Exactly the float32
  optimizer's trajectory, but it costs more persistent memory than a float32 head.

The random bits come from a ``torch.Generator`` owned by the optimizer (never the global
RNG), seeded from the head seed and rank, and saved in its state dict, so a resumed run
draws the same bits as an uninterrupted one.
"""
from __future__ import annotations

import torch

__all__ = ["BF16_UPDATES", "stochastic_round", "round_to_bf16", "persistent_bytes"]

BF16_UPDATES = ("stochastic_rounding", "master_fp32", "plain")
_LOW16 = 1 << 16
_HIGH_MASK = -_LOW16  # int32 0xFFFF0000: keeps sign, exponent and the 7 stored mantissa bits


def stochastic_round(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """x (float32, any shape) -> bf16 tensor of the same shape, stochastically rounded.

    bf16 is the top 16 bits of a float32. Adding a uniform integer in [0, 2^16) to the
    float32's bit pattern and truncating the low 16 bits rounds the magnitude up with
    probability (low 16 bits) / 2^16, i.e. the distance to the lower neighbour over the gap:
    unbiased, and the result is always one of the two neighbours (sign-magnitude bits, so
    negative values round symmetrically; a carry into the exponent is the next binade's
    first value, as it should be). Inf stays Inf (its low bits are zero).
    """
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round: x must be float32, got {x.dtype}")
    x = x.contiguous()
    bits = torch.randint(0, _LOW16, x.shape, generator=generator, dtype=torch.int32, device=x.device)
    bits.add_(x.view(torch.int32)).bitwise_and_(_HIGH_MASK)
    return bits.view(torch.float32).to(torch.bfloat16)  # exact: the low 16 bits are zero


def round_to_bf16(x: torch.Tensor, stochastic: bool, generator) -> torch.Tensor:
    """x (float32) -> bf16: stochastic (``generator`` required) or round-to-nearest-even."""
    return stochastic_round(x, generator) if stochastic else x.to(torch.bfloat16)


def persistent_bytes(optimizer: torch.optim.Optimizer) -> dict:
    """Bytes held between steps by the parameters and their optimizer state, measured from
    the tensors: {"weights": ..., "state": ..., "total": ..., "state_keys": {key: dtype}}."""
    weights = state = 0
    keys = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            weights += p.numel() * p.element_size()
            for k, v in optimizer.state.get(p, {}).items():
                if torch.is_tensor(v) and v.dim() >= 1:
                    state += v.numel() * v.element_size()
                    keys[k] = str(v.dtype).replace("torch.", "")
    return {"weights": weights, "state": state, "total": weights + state, "state_keys": keys}

"""The softmax's row exponentials of a float32 logits buffer, in place (C++, CPU), or None.

``exp_rows_(x, floor)`` does what ``m = x.amax(1).clamp_min(floor); x.sub_(m[:, None]).exp_();
s = x.sum(1)`` does, in two passes instead of four and with a polynomial exp (AVX-512, checked at
run time): the fused loss's exp was its largest cost after the matmuls on CPU (ops/csrc/softmax_cpu.cpp
says how it is computed and how accurate it is). It returns None when the kernel cannot take the
tensor, and the caller runs the PyTorch passes: not a contiguous 2-D float32 CPU tensor,
``DS_XC_NATIVE_SOFTMAX=0`` in the environment, or an op that does not build (logged once by
ds_xc_ops.builders).
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch

from ds_xc_ops import builders

__all__ = ["ENV", "exp_rows_"]

ENV = "DS_XC_NATIVE_SOFTMAX"  # "0": always the PyTorch passes


def exp_rows_(x: torch.Tensor, floor: Optional[float] = None) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """x (n, K) <- exp(x - m[:, None]) in place with m = max(row max, floor) (NaN rows stay NaN);
    returns (m (n,), row sums (n,)) float32, or None (nothing done) when the kernel cannot run."""
    if os.environ.get(ENV, "1") == "0" or x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 \
            or not x.is_contiguous():
        return None
    op = builders.load_op("softmax")
    if op is None:
        return None
    return op.exp_rows(x, -math.inf if floor is None else float(floor))

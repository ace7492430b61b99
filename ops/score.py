"""The score that ``select_by: update`` ranks: out = v / sqrt(max(exp_avg_sq x scale, floor)).

ds_xc/compression/score.py computes it once per compressed step over every compressed element
(millions on the CPU text task). As a PyTorch expression that is five passes over the gradient's
size (a scaled copy of Adam's second moment, a clamp, a square root, the division) and a
temporary; the C++ kernel (``update_score_`` in ops/csrc/select_cpu.cpp) makes one pass that reads
v and the second moment and writes the score. Its float32 steps are PyTorch's, in PyTorch's order,
each correctly rounded: the IEEE float32 result bit for bit, on the AVX-512 and the scalar path
alike (tested). PyTorch's own vectorised float32 sqrt is not always correctly rounded, so the two
backends can differ by 1 ulp. ``DS_XC_NATIVE_SCORE=0`` keeps "auto" on PyTorch.
"""
from __future__ import annotations

import math
import os
from typing import Union

import torch

from ds_xc_ops import builders

__all__ = ["update_score", "update_score_torch", "SCORE_BACKENDS", "NATIVE_ENV"]

SCORE_BACKENDS = ("auto", "torch", "cpu")
NATIVE_ENV = "DS_XC_NATIVE_SCORE"  # "0": "auto" never picks the C++ kernel


def update_score_torch(v: torch.Tensor, exp_avg_sq: torch.Tensor, scale: float,
                       floor: Union[float, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Reference: ``out`` (n,) = v / sqrt(max(exp_avg_sq * scale, floor)); returns ``out``.

    ``floor`` may be a 0-dim tensor on v's device (no host sync on a GPU)."""
    vhat = exp_avg_sq.mul(scale)  # (n,) a copy
    return torch.div(v, vhat.clamp_(min=floor).sqrt_(), out=out)


def _native_reason(v, exp_avg_sq, out, floor) -> str | None:
    """Why the C++ kernel cannot take these arguments (None: it can)."""
    for name, t in (("v", v), ("exp_avg_sq", exp_avg_sq), ("out", out)):
        if t.device.type != "cpu" or t.dtype != torch.float32 or t.dim() != 1 or not t.is_contiguous():
            return f"{name} must be a contiguous 1-D float32 CPU tensor, got {t.dtype} of {t.dim()} dims on {t.device}"
    if not (v.numel() == exp_avg_sq.numel() == out.numel()):
        return f"sizes differ: v {v.numel()}, exp_avg_sq {exp_avg_sq.numel()}, out {out.numel()}"
    if not math.isfinite(float(floor)):  # torch.clamp propagates a NaN bound; the kernel's max would not
        return f"floor must be finite, got {float(floor)}"
    if builders.load_op("select") is None:
        return "the ds_xc_select_cpu op did not build (see the warning logged by ds_xc_ops.builders)"
    return None


def update_score(v: torch.Tensor, exp_avg_sq: torch.Tensor, scale: float, floor: Union[float, torch.Tensor],
                 out: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """``out`` (n,) = v / sqrt(max(exp_avg_sq * scale, floor)), all three (n,); returns ``out``.

    backend: "torch" (the reference), "cpu" (the C++ kernel: contiguous 1-D float32 CPU tensors,
    finite floor), or "auto": the C++ kernel where it can run (and ``DS_XC_NATIVE_SCORE`` is not
    "0"), else torch. They agree within 1 ulp (see the module docstring)."""
    if backend not in SCORE_BACKENDS:
        raise ValueError(f"update_score: backend = {backend!r} is not one of {SCORE_BACKENDS}")
    if backend == "torch" or (backend == "auto" and (v.device.type != "cpu" or os.environ.get(NATIVE_ENV, "1") == "0")):
        return update_score_torch(v, exp_avg_sq, scale, floor, out)
    why = _native_reason(v, exp_avg_sq, out, floor)
    if why is None:
        builders.load_op("select").update_score_(v, exp_avg_sq, float(scale), float(floor), out)
        return out
    if backend == "cpu":
        raise ValueError(f"update_score: backend='cpu' cannot run here: {why}")
    return update_score_torch(v, exp_avg_sq, scale, floor, out)

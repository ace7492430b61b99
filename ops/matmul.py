"""16-bit matrix products with float32 results, on tensor cores where the device has them.

The head's bf16 (or fp16) weights must multiply as 16-bit inputs with float32 accumulation: on a
GPU that is a tensor-core GEMM (``torch.mm(a, b, out_dtype=torch.float32)``, written straight into
the caller's float32 buffer), while upcasting the inputs first runs float32 SIMT GEMMs, about ten
times slower on an H100/H200 (``cutlass_80_simt_sgemm`` in the profile of
benchmarks/results/gpu_check_run3.md). CPUs have no such kernel in torch: there the inputs are
upcast to float32, in blocks of rows so that no float32 copy of a large weight exists at once. The
results are never rounded to 16 bits.

Which devices take the 16-bit path is :data:`TENSOR_CORE_DEVICES`: CUDA, and the meta device, on
which tests run the head's step shape-only to check which GEMMs it issues. float32 and float64
inputs always take plain ``torch.mm`` (the user's ``torch.backends.cuda.matmul`` precision setting
applies, TF32 included).
"""
from __future__ import annotations

import logging

import torch

from ds_xc_ops.logs import log_once

__all__ = ["LOW_PRECISION", "TENSOR_CORE_DEVICES", "tensor_cores", "mm_f32", "bmm_f32", "addmm_f32_"]

log = logging.getLogger(__name__)

LOW_PRECISION = (torch.bfloat16, torch.float16)
TENSOR_CORE_DEVICES = ("cuda", "meta")
_BLOCK = 1 << 14  # rows of the second operand upcast at a time where there is no 16-bit kernel
_UNAVAILABLE: set = set()  # device types whose torch lacks mm(out_dtype=) (found at first use)


def tensor_cores(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``dtype`` operands on ``device`` multiply as 16-bit inputs into float32 results."""
    return dtype in LOW_PRECISION and device.type in TENSOR_CORE_DEVICES and device.type not in _UNAVAILABLE


def _fall_back(device: torch.device, exc: Exception) -> None:
    _UNAVAILABLE.add(device.type)
    log_once(log, logging.WARNING, f"torch.mm(out_dtype=float32) is unavailable on {device.type} ({exc}): "
                                   "16-bit matmuls upcast their inputs to float32 (slower, same precision)")


def mm_f32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """(n, m) float32 = a (n, k) @ b (k, m), a and b of one 16-bit dtype, accumulated in float32;
    written into ``out`` (n, m) float32 when given (no second buffer)."""
    if tensor_cores(a.dtype, a.device) and b.dtype == a.dtype:
        try:
            if out is None:
                return torch.mm(a, b, out_dtype=torch.float32)
            return torch.mm(a, b, out_dtype=torch.float32, out=out)
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            _fall_back(a.device, exc)
    if out is None:
        out = torch.empty((a.shape[0], b.shape[1]), dtype=torch.float32, device=a.device)
    a32 = a.float()
    for k in range(0, b.shape[1], _BLOCK):  # (k, block) of b upcast at a time
        torch.mm(a32, b[:, k: k + _BLOCK].float(), out=out[:, k: k + _BLOCK])
    return out


def bmm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(B, n, m) float32 = a (B, n, k) @ b (B, k, m): 16-bit inputs on tensor cores, else float32."""
    if tensor_cores(a.dtype, a.device) and b.dtype == a.dtype:
        try:
            return torch.bmm(a, b, out_dtype=torch.float32)
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            _fall_back(a.device, exc)
    return torch.bmm(a.float(), b.float())


def addmm_f32_(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """c (n, m) float32 += a (n, k) @ b (k, m), in place: 16-bit a and b on tensor cores, else the
    product in float32."""
    if tensor_cores(a.dtype, a.device) and b.dtype == a.dtype:
        try:
            return torch.addmm(c, a, b, out_dtype=torch.float32, out=c)
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            _fall_back(a.device, exc)
    return c.addmm_(a.float(), b.float())

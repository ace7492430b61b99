"""Whether Triton kernels can run here, and how (GPU or the CPU interpreter).

Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a kernel, so the kernel
modules (``ds_xc_ops.hamming_triton``, ``ds_xc_ops.triton_select``) must be imported after it is set
(tests set it before importing them when no GPU is present). Under the interpreter the
kernels run on CPU tensors, one program at a time, with no libdevice: the popcount uses
a bit trick there instead of libdevice's ``popc`` (see docs/ops.md).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os

import torch

__all__ = ["HAVE_TRITON", "interpreting", "triton_usable", "triton_unusable_reason", "device_guard"]

# Found, not imported: importing triton takes about a second, and ds_xc_ops.hamming (imported by
# every sampler) only needs to know. The kernels are optional: callers fall back to PyTorch.
HAVE_TRITON = importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when TRITON_INTERPRET is set (as triton reads it: 1, true, on, yes)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def triton_unusable_reason(device: torch.device) -> str | None:
    """None when a Triton kernel can run on tensors of `device`, else why not."""
    if not HAVE_TRITON:
        return "triton is not installed (pip install triton)"
    if interpreting():
        return None  # the interpreter runs CPU tensors (and copies CUDA ones through the host)
    if device.type != "cuda":
        return (f"tensors on {device} need TRITON_INTERPRET=1 (the Triton interpreter); "
                "compiled Triton kernels need CUDA tensors")
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    return None


def triton_usable(device: torch.device) -> bool:
    """Whether a Triton kernel can run on tensors of `device` in this process."""
    return triton_unusable_reason(device) is None


def device_guard(t: torch.Tensor):
    """A context that makes ``t``'s GPU the current device around a Triton launch (a no-op for CPU
    tensors, the interpreter's). Triton launches on the *current* device and its current stream, not on
    the device of the tensors it is given: with tensors on cuda:k and another current device the kernel
    ran on the wrong GPU (an illegal address, or a slow peer access). The CUDA op does the same
    (ops/hamming.py)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()

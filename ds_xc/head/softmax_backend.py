"""Which implementation runs the head's fused softmax: the PyTorch path or the Triton kernels.

The config key ``extreme_classification.softmax_backend`` takes

- ``torch``: :func:`ds_xc.head.softmax.fused_loss_and_grads` (any device and dtype; the
  semantics);
- ``triton``: :func:`ds_xc.head.triton_softmax.triton_fused_loss_and_grads`; an error naming the
  key when Triton does not import, when the tensors are on the CPU without
  ``TRITON_INTERPRET=1`` (the interpreter, slow, for tests), or for float64;
- ``auto``: triton for CUDA tensors with 16-bit (bf16, fp16) weights when Triton imports, else
  torch: on an H200 the kernels with 16-bit tiles ran forward + backward 1.4-2x faster than the
  PyTorch path, and with float32 weights (fp32 FMA, no tensor cores) 4x slower
  (benchmarks/results/gpu_check_run3.md). CPU runs keep the PyTorch path. The choice is logged
  once per (device type, dtype, choice). Where the kernels cannot launch (Triton's OutOfResources:
  a GPU with less shared memory than their tiles need), ``auto`` logs a warning, runs the PyTorch
  path for that call and every later one; an explicit ``triton`` raises.

As ``ds_xc_ops.builders.load_op``, the kernel module is imported at most once per process, lazily
(Triton reads ``TRITON_INTERPRET`` when the kernels are decorated), and a failed import is
logged once and remembered.
"""
from __future__ import annotations

import functools
import importlib
import logging
from typing import Callable, Optional

import torch

from ds_xc_ops.logs import log_once
from ds_xc_ops.triton_util import interpreting

__all__ = ["SOFTMAX_BACKENDS", "KEY", "check_backend", "triton_usable", "load_triton_softmax",
           "resolve_softmax"]

logger = logging.getLogger(__name__)

SOFTMAX_BACKENDS = ("auto", "torch", "triton")
KEY = "extreme_classification.softmax_backend"
_SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)
_STATE: dict = {}  # "fn" -> the loaded entry point or None, "error" -> why not


def check_backend(backend: str) -> str:
    """The name itself, or ValueError naming the key and the allowed values."""
    if backend not in SOFTMAX_BACKENDS:
        raise ValueError(f"{KEY}: got {backend!r}; allowed: {', '.join(map(repr, SOFTMAX_BACKENDS))}")
    return backend


def load_triton_softmax() -> Optional[Callable]:
    """``triton_fused_loss_and_grads``, or None when Triton does not import (logged once)."""
    if "fn" not in _STATE:
        try:
            mod = importlib.import_module("ds_xc.head.triton_softmax")
            importlib.import_module("ds_xc_ops.triton_softmax_kernels")  # triton itself, and the jit decoration
        except Exception as exc:  # ImportError, or a Triton that fails to initialise
            _STATE["fn"], _STATE["error"] = None, f"{type(exc).__name__}: {exc}"
            log_once(logger, logging.WARNING, f"ds_xc triton softmax unavailable ({_STATE['error']}); "
                      "the PyTorch path runs")
        else:
            _STATE["fn"], _STATE["error"] = mod.triton_fused_loss_and_grads, None
            mode = "the interpreter (TRITON_INTERPRET=1)" if interpreting() else "compiled kernels"
            log_once(logger, logging.INFO, f"ds_xc triton softmax loaded: {mode}")
    return _STATE["fn"]


def triton_usable(device: torch.device) -> tuple[bool, str]:
    """(usable, reason) for tensors on ``device``: the softmax kernels import and either the
    device is CUDA or the interpreter is on (:func:`ds_xc_ops.triton_util.interpreting`, the one
    reading of TRITON_INTERPRET that the scan and selection kernels use too)."""
    if device.type != "cuda" and not interpreting():
        return False, f"tensors are on {device.type}; triton needs CUDA tensors (or TRITON_INTERPRET=1 for tests)"
    if load_triton_softmax() is None:
        return False, f"triton does not import: {_STATE['error']}"
    return True, ""


def resolve_softmax(backend: str, x: torch.Tensor, w: torch.Tensor, terms=None) -> Optional[Callable]:
    """The Triton entry point when ``backend`` selects it for these tensors, None for the
    PyTorch path. ``triton`` that cannot run raises ValueError naming the key. The kernels take
    every loss option (ds_xc/head/row_terms.py) but ``softcap``: 'triton' refuses it, 'auto' runs
    the PyTorch path for it."""
    check_backend(backend)
    if backend == "torch":
        return None
    if terms is not None and terms.softcap:
        if backend == "triton":
            raise ValueError(f"{KEY} = 'triton' does not support extreme_classification.loss.softcap "
                             f"(got {terms.softcap}); use softmax_backend 'torch' or 'auto', or softcap 0")
        return None
    dtype_ok = x.dtype in _SUPPORTED and w.dtype in _SUPPORTED
    if backend == "triton":
        if not dtype_ok:
            raise ValueError(f"{KEY} = 'triton': dtypes x {x.dtype}, w {w.dtype}; the kernels support "
                             f"{', '.join(map(str, _SUPPORTED))} (use 'torch' or 'auto' for float64)")
        ok, why = triton_usable(w.device)
        if not ok:
            raise ValueError(f"{KEY} = 'triton' cannot run: {why}; use 'auto' or 'torch'")
        return load_triton_softmax()
    use = (w.device.type == "cuda" and dtype_ok and w.dtype in (torch.bfloat16, torch.float16)
           and "auto_off" not in _STATE and load_triton_softmax() is not None)
    log_once(logger, logging.INFO, f"{KEY} = 'auto' uses {'triton' if use else 'torch'} for {w.device.type} "
              f"tensors ({w.dtype} weights)")
    if not use:
        return None
    if "auto_fn" not in _STATE:  # wrapped once, not at every forward
        _STATE["auto_fn"] = _fall_back_on_launch_failure(load_triton_softmax())
    return _STATE["auto_fn"]


def _fall_back_on_launch_failure(fn: Callable) -> Callable:
    """``fn`` that returns None instead of raising Triton's OutOfResources (the launch fails before
    any output is written), and turns ``auto`` to the PyTorch path from then on (logged once)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if type(exc).__name__ != "OutOfResources":
                raise
            _STATE["auto_off"] = f"{type(exc).__name__}: {exc}"
            log_once(logger, logging.WARNING, f"{KEY} = 'auto': the triton kernels cannot launch here "
                     f"({_STATE['auto_off']}); the PyTorch path runs from now on")
            return None
    return run

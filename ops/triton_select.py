"""Threshold selection with compaction: the indices and values of the entries with |v| >= t.

The first step of the gradient compressors' selection (ds_xc/compression/bayes.py: the
elements whose own coin is drawn), as one function with a PyTorch reference, a Triton
kernel (GPU, or the CPU interpreter under TRITON_INTERPRET=1) and a C++ kernel for float32
CPU tensors (ops/csrc/select_cpu.cpp: one counting and one writing pass, no |v| copy or mask;
``DS_XC_NATIVE_SELECT=0`` turns it off in "auto").

Semantics (:func:`select_above_torch` defines them): for a floating tensor ``v`` of any
shape, flattened to (n,), the result is ``(idx (m,) int64, val (m,) v.dtype)``: the flat
positions i with ``|v_i| >= threshold``, ascending, and ``val = v.flatten()[idx]``.
For float16, bfloat16 and float32 the comparison is made in float32 with ``threshold``
rounded to float32 (exact for these dtypes; this is also what ``a >= t`` does for a
float32 tensor, while for a bfloat16 tensor torch rounds t to bfloat16); float64 is
compared in float64 (reference only). NaN entries are never kept; a NaN threshold keeps
nothing, a threshold <= 0 keeps every non-NaN entry.

Triton layout: blocks of BLOCK entries. Pass 1, one program per block, counts the kept
entries; a torch exclusive cumsum gives each block its output start (and the total m,
one host sync, as torch.nonzero); pass 2 recomputes the mask, ranks the kept entries
of its block with an in-block exclusive cumsum and scatters (position, value) to
start + rank. The output is in ascending index order without a sort, and deterministic.
Loads are upcast to float32 right after the load (the interpreter would otherwise
compare bfloat16 raw bits); the values are stored as loaded.
"""
from __future__ import annotations

import os

import torch

from ds_xc_ops import builders
from ds_xc_ops.triton_util import HAVE_TRITON, device_guard, triton_unusable_reason

__all__ = ["select_above", "select_above_torch", "SELECT_BACKENDS", "TRITON_DTYPES", "DEFAULT_BLOCK", "NATIVE_ENV"]

SELECT_BACKENDS = ("auto", "torch", "triton", "cpu")
NATIVE_ENV = "DS_XC_NATIVE_SELECT"  # "0": "auto" never picks the C++ kernel
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEFAULT_BLOCK = 1024

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _count_kernel(v_ptr, counts_ptr, n, threshold, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
        inside = offs < n
        x = tl.load(v_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        keep = (tl.abs(x) >= threshold) & inside
        tl.store(counts_ptr + pid, tl.sum(keep.to(tl.int32), axis=0))

    @triton.jit
    def _scatter_kernel(v_ptr, starts_ptr, idx_ptr, val_ptr, n, threshold, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
        inside = offs < n
        raw = tl.load(v_ptr + offs, mask=inside, other=0.0)
        keep = (tl.abs(raw.to(tl.float32)) >= threshold) & inside
        k32 = keep.to(tl.int32)
        dst = tl.load(starts_ptr + pid) + (tl.cumsum(k32, axis=0) - k32)  # (BLOCK,) int64 slots
        tl.store(idx_ptr + dst, offs, mask=keep)
        tl.store(val_ptr + dst, raw, mask=keep)


def _check_v(v) -> None:
    if not isinstance(v, torch.Tensor) or not v.is_floating_point():
        desc = f"dtype {v.dtype}" if isinstance(v, torch.Tensor) else type(v)
        raise ValueError(f"select_above: v must be a floating torch.Tensor, got {desc}")


def _threshold32(threshold: float) -> float:
    """threshold rounded to float32 (as a Python float, exactly representable)."""
    return float(torch.tensor(float(threshold), dtype=torch.float32))


def select_above_torch(v: torch.Tensor, threshold: float):
    """Reference: (idx (m,) int64 ascending, val (m,) v.dtype) of the entries |v| >= threshold."""
    _check_v(v)
    flat = v.reshape(-1)  # (n,)
    if flat.dtype == torch.float64:
        mask = flat.abs() >= float(threshold)
    else:
        t = torch.tensor(_threshold32(threshold), dtype=torch.float32, device=flat.device)
        mask = flat.float().abs() >= t
    idx = torch.nonzero(mask).squeeze(1)  # (m,)
    return idx, flat[idx]


def _select_triton(v: torch.Tensor, threshold: float, block: int):
    flat = v.reshape(-1).contiguous()  # (n,)
    n = flat.numel()
    if n == 0:
        return (torch.empty(0, dtype=torch.int64, device=v.device),
                torch.empty(0, dtype=v.dtype, device=v.device))
    t32 = _threshold32(threshold)
    nblocks = triton.cdiv(n, block)
    counts = torch.empty(nblocks, dtype=torch.int32, device=v.device)  # (nblocks,)
    with device_guard(flat):  # launched on the tensors' GPU, whatever the current device
        _count_kernel[(nblocks,)](flat, counts, n, t32, BLOCK=block)
    ends = torch.cumsum(counts, 0, dtype=torch.int64)  # (nblocks,)
    starts = ends - counts
    total = int(ends[-1])  # host sync: the output size
    idx = torch.empty(total, dtype=torch.int64, device=v.device)  # (m,)
    val = torch.empty(total, dtype=v.dtype, device=v.device)
    if total:
        with device_guard(flat):
            _scatter_kernel[(nblocks,)](flat, starts, idx, val, n, t32, BLOCK=block)
    return idx, val


def _native_op(v: torch.Tensor, required: bool):
    """The C++ op when it can take ``v`` (float32 on the CPU) and builds, else None (or an error if
    ``required``)."""
    why = None
    if v.device.type != "cpu" or v.dtype != torch.float32:
        why = f"a float32 CPU tensor is needed, got {v.dtype} on {v.device}"
    op = builders.load_op("select") if why is None else None
    if op is None and why is None:
        why = "the ds_xc_select_cpu op did not build (see the warning logged by ds_xc_ops.builders)"
    if why is not None and required:
        raise ValueError(f"select_above: backend='cpu' cannot run here: {why}")
    return op


def _resolve(backend: str, v: torch.Tensor) -> str:
    if backend not in SELECT_BACKENDS:
        raise ValueError(f"select_above: backend = {backend!r} is not one of {SELECT_BACKENDS}")
    if backend in ("torch", "cpu"):
        return backend
    if backend == "auto" and v.device.type == "cpu":
        native = os.environ.get(NATIVE_ENV, "1") != "0" and _native_op(v, required=False) is not None
        return "cpu" if native else "torch"
    why = triton_unusable_reason(v.device)
    if why is None and v.dtype not in TRITON_DTYPES:
        why = f"dtype {v.dtype} is not one of {[str(d) for d in TRITON_DTYPES]}"
    if backend == "triton":
        if why is not None:
            raise ValueError(f"select_above: backend='triton' cannot run here: {why}")
        return backend
    return "triton" if why is None and v.device.type == "cuda" else "torch"


def select_above(v: torch.Tensor, threshold: float, backend: str = "auto", block: int | None = None):
    """(idx (m,) int64 ascending, val (m,) v.dtype): the entries of v.flatten() with |v| >= threshold.

    backend: "torch" (the reference), "triton" (CUDA tensors, or CPU tensors under
    TRITON_INTERPRET=1; float32/float16/bfloat16), "cpu" (the C++ kernel; float32 CPU tensors), or
    "auto": for CUDA tensors triton when it is usable and the dtype supported, for float32 CPU
    tensors the C++ kernel when it builds (and ``DS_XC_NATIVE_SELECT`` is not "0"), else torch.
    All give identical results.
    block: entries per Triton program (a power of two, default 1024).
    """
    _check_v(v)
    block = DEFAULT_BLOCK if block is None else int(block)
    if block < 16 or block & (block - 1):
        raise ValueError(f"select_above: block = {block} must be a power of two >= 16")
    chosen = _resolve(backend, v)
    if chosen == "torch":
        return select_above_torch(v, threshold)
    if chosen == "cpu":
        return _native_op(v, required=True).select_above(v.reshape(-1).contiguous(), _threshold32(threshold))
    return _select_triton(v, threshold, block)

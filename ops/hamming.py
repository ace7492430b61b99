"""Hamming top-k over packed binary codes: the public API of the ANN sampler's scan.

Layout (see docs/ops.md): codes are packed bits, ``torch.uint8`` of shape
(rows, code_bits // 8), code_bits a multiple of 32 in [32, 1024]; bit j of a code is in
byte j // 8 at bit position j % 8 (LSB first, as faiss). An inverted file is given in
CSR form: ``list_offsets`` (L+1,) int64, ``list_ids`` (R,) int64 and ``list_codes``
(R, B) uint8 in the same order, contiguous per list.

Result of a scan: ``(dist (N, k) int32, ids (N, k) int64)``, the k candidates of
smallest (distance, id) among the union of each query's probed lists, ascending, ties
broken by the smaller id (this makes every backend agree exactly); padded with
(code_bits + 1, -1) when fewer than k candidates exist. Repeated probes of a query are
scanned once; -1 probes are skipped.

Backends: "torch" (reference, any device), "cpu" (C++/OpenMP, JIT-built once),
"cuda" (CUDA tensors, JIT-built once), "triton" (ops/hamming_triton.py: CUDA tensors,
or CPU tensors under TRITON_INTERPRET=1; k <= 1024, ids < 2^52), "faiss"
(IndexBinaryIVF/IndexBinaryFlat with our own lists, CPU tensors; its ties are
re-resolved, see ops/hamming_faiss.py), and "auto": for CUDA tensors cuda if it
builds, else triton, else torch; for CPU tensors cpu if it builds, else torch (logged
once).
"""
from __future__ import annotations

import logging
import operator

import torch

from ds_xc_ops import builders
from ds_xc_ops.hamming_torch import topk_ivf_torch
from ds_xc_ops.logs import log_once
from ds_xc_ops.triton_util import triton_unusable_reason

__all__ = ["hamming_topk_ivf", "hamming_topk_flat", "pack_signs", "pack_signs_min_abs", "unpack_bits",
           "available_backends", "BACKENDS", "CUDA_MAX_K", "TRITON_MAX_K"]

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "cpu", "cuda", "triton", "faiss")
CUDA_MAX_K = 2048  # the CUDA kernel keeps the k results in shared memory
TRITON_MAX_K = 1024  # = ds_xc_ops.hamming_triton.TRITON_MAX_K (keys in registers); not imported: triton is optional
TRITON_ID_LIMIT = 1 << 52  # the Triton kernel packs ids below the distance in an int64 key


# --------------------------------------------------------------------------- packing
def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Pack sign bits: x (n, bits) float -> (n, bits // 8) uint8, bit = x > 0, LSB first.

    bits must be a multiple of 8 (the scans further need a multiple of 32). NaN packs as 0.
    """
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"pack_signs: x must be a 2-D floating tensor (n, bits), got "
                         f"dtype {x.dtype} shape {tuple(x.shape)}")
    n, bits = x.shape
    if bits % 8:
        raise ValueError(f"pack_signs: x.shape[1] (bits) = {bits} must be a multiple of 8")
    b = (x > 0).view(n, bits // 8, 8).to(torch.uint8)  # (n, bytes, 8)
    out = torch.zeros(n, bits // 8, dtype=torch.uint8, device=x.device)
    for j in range(8):  # bit j of each byte; uint8 ops keep memory at n * bits bytes
        out |= b[:, :, j] << j
    return out


def pack_signs_min_abs(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(pack_signs(z), z.abs().amin(dim=1)) of projections z (n, bits): the codes and each row's
    smallest |projection| (how far it is from flipping a bit), in one pass of the CPU op for a
    contiguous float32 or bfloat16 CPU tensor (``DS_XC_HAMMING_SIMD=0``: its scalar loop), else
    torch ops. The same values either way (NaN: bit 0, min NaN); min_abs is float32 from the op."""
    if z.dim() == 2 and z.dtype in (torch.float32, torch.bfloat16) and z.device.type == "cpu" \
            and z.is_contiguous() and z.shape[1] % 8 == 0:
        op = _cpu_op()
        if op is not None:
            codes, min_abs = op.pack_signs_min_abs(z)
            return codes, min_abs
    return pack_signs(z), z.abs().amin(dim=1)


def unpack_bits(codes: torch.Tensor, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """Inverse of pack_signs: codes (n, bytes) uint8 -> (n, bytes * 8) of 0/1 in `dtype`."""
    if codes.dtype != torch.uint8 or codes.dim() != 2:
        raise ValueError(f"unpack_bits: codes must be a 2-D uint8 tensor, got dtype "
                         f"{codes.dtype} shape {tuple(codes.shape)}")
    shifts = torch.arange(8, device=codes.device, dtype=torch.uint8)
    bits = (codes.unsqueeze(-1) >> shifts) & 1  # (n, bytes, 8)
    return bits.reshape(codes.shape[0], -1).to(dtype)


# --------------------------------------------------------------------------- checks
def _check_codes(name: str, t, nbytes: int | None = None) -> int:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 2:
        desc = f"dtype {t.dtype} shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t)
        raise ValueError(f"{name} must be a 2-D torch.uint8 tensor (rows, code_bits // 8), got {desc}")
    bits = t.shape[1] * 8
    if nbytes is None and (bits % 32 or not 32 <= bits <= 1024):
        raise ValueError(f"{name}: code_bits = {bits} ({name}.shape[1] = {t.shape[1]} bytes) "
                         "must be a multiple of 32 in [32, 1024]")
    if nbytes is not None and t.shape[1] != nbytes:
        raise ValueError(f"{name}.shape[1] = {t.shape[1]} bytes does not match q_codes.shape[1] "
                         f"= {nbytes} (the code sizes must agree)")
    return t.shape[1]


def _check_int64(name: str, t, dim: int) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != dim:
        desc = f"dtype {t.dtype} shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t)
        raise ValueError(f"{name} must be a {dim}-D torch.int64 tensor, got {desc}")


def _check_k(k) -> int:
    """k as a Python int (numpy and 0-d integer tensors accepted); ValueError otherwise."""
    try:
        kk = operator.index(k)
    except TypeError:
        kk = None
    if kk is None or isinstance(k, bool) or kk < 0:
        raise ValueError(f"k = {k!r} must be an int >= 0")
    return kk


def _check_ivf(q_codes, list_codes, list_ids, list_offsets, probes, k, check_values) -> int:
    """Validate shapes, dtypes and devices (always) and values (when check_values); returns k."""
    nbytes = _check_codes("q_codes", q_codes)
    _check_codes("list_codes", list_codes, nbytes)
    _check_int64("list_ids", list_ids, 1)
    _check_int64("list_offsets", list_offsets, 1)
    _check_int64("probes", probes, 2)
    k = _check_k(k)
    rows = list_codes.shape[0]
    if list_ids.shape[0] != rows:
        raise ValueError(f"list_ids has {list_ids.shape[0]} entries but list_codes has {rows} rows")
    if list_offsets.shape[0] < 1:
        raise ValueError("list_offsets must have nlist + 1 >= 1 entries, got 0")
    if probes.shape[0] != q_codes.shape[0]:
        raise ValueError(f"probes has {probes.shape[0]} rows but q_codes has {q_codes.shape[0]} queries")
    devs = {t.device for t in (q_codes, list_codes, list_ids, list_offsets, probes)}
    if len(devs) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devs))}")
    if not check_values:
        return k
    nlist = list_offsets.shape[0] - 1
    off = list_offsets
    if int(off[0]) != 0 or int(off[-1]) != rows or bool((off[1:] < off[:-1]).any()):
        raise ValueError(f"list_offsets must be non-decreasing from 0 to rows = {rows}, got "
                         f"first {int(off[0])}, last {int(off[-1])}")
    if probes.numel():
        lo, hi = int(probes.min()), int(probes.max())
        if lo < -1 or hi >= nlist:
            raise ValueError(f"probes must lie in [-1, nlist - 1] = [-1, {nlist - 1}], got "
                             f"min {lo}, max {hi}")
    if rows and int(list_ids.min()) < 0:
        raise ValueError(f"list_ids must be >= 0, got min {int(list_ids.min())}")
    return k


def _unique_probes(probes: torch.Tensor) -> torch.Tensor:
    """(N, P) probes with repeats within a row replaced by -1 (a list is scanned once)."""
    if probes.shape[1] < 2:
        return probes.contiguous()
    s = torch.sort(probes, dim=1).values
    dup = torch.zeros_like(s, dtype=torch.bool)
    dup[:, 1:] = s[:, 1:] == s[:, :-1]
    return s.masked_fill(dup, -1).contiguous()


# --------------------------------------------------------------------------- backends
def _cpu_op():
    return builders.load_op("cpu")


def _cuda_op():
    return builders.load_op("cuda")


def available_backends(build: bool = True) -> list:
    """Backends usable in this process. With build=True the native ops are built (cached)."""
    out = ["torch"]
    if build and _cpu_op() is not None:
        out.append("cpu")
    if build and torch.cuda.is_available() and _cuda_op() is not None:
        out.append("cuda")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if triton_unusable_reason(dev) is None:
        out.append("triton")
    try:
        import faiss  # noqa: F401
        out.append("faiss")
    except ImportError:
        pass
    return out


def _resolve(backend: str, device: torch.device, k: int) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend = {backend!r} is not one of {BACKENDS}")
    if backend != "auto":
        if backend == "cuda" and device.type != "cuda":
            raise ValueError(f"backend='cuda' needs CUDA tensors, got device {device}")
        if backend in ("cpu", "faiss") and device.type != "cpu":
            raise ValueError(f"backend={backend!r} needs CPU tensors, got device {device}")
        if backend == "cuda" and k > CUDA_MAX_K:
            raise ValueError(f"backend='cuda' supports k <= {CUDA_MAX_K}, got k = {k}")
        if backend == "triton":
            why = triton_unusable_reason(device)
            if why is not None:
                raise ValueError(f"backend='triton' cannot run here: {why}")
            if k > TRITON_MAX_K:
                raise ValueError(f"backend='triton' supports k <= {TRITON_MAX_K}, got k = {k}")
        return backend
    if device.type == "cuda" and k <= CUDA_MAX_K and _cuda_op() is not None:
        choice = "cuda"
    elif device.type == "cuda" and k <= TRITON_MAX_K and triton_unusable_reason(device) is None:
        choice = "triton"
    elif device.type == "cpu" and _cpu_op() is not None:
        choice = "cpu"
    else:
        choice = "torch"
    log_once(logger, logging.INFO, f"hamming_topk: backend 'auto' uses '{choice}' for {device.type} tensors")
    return choice


def _run_native(name, q_codes, list_codes, list_ids, list_offsets, probes, k):
    op = _cpu_op() if name == "cpu" else _cuda_op()
    if op is None:
        raise RuntimeError(f"backend={name!r} is unavailable: its op did not build (see the "
                           "warning logged by ds_xc_ops.builders); use backend='auto' or 'torch'")
    args = [t.contiguous() for t in (q_codes, list_codes, list_ids, list_offsets, probes)]
    if name == "cpu":
        return op.hamming_topk_ivf(*args, k)
    with torch.cuda.device(q_codes.device):
        stream = torch.cuda.current_stream(q_codes.device).cuda_stream
        return op.hamming_topk_ivf(*args, k, stream)


def _run_triton(q_codes, list_codes, list_ids, list_offsets, probes, k, check):
    """The Triton scan (imported here: triton is optional and its import is slow)."""
    if check and list_ids.numel() and int(list_ids.max()) >= TRITON_ID_LIMIT:
        raise ValueError(f"backend='triton' needs list_ids < 2^52, got max {int(list_ids.max())}")
    from ds_xc_ops.hamming_triton import topk_ivf_triton
    return topk_ivf_triton(q_codes, list_codes, list_ids, list_offsets, probes, k)


def hamming_topk_ivf(q_codes, list_codes, list_ids, list_offsets, probes, k: int,
                     backend: str = "auto", check: bool = True):
    """Top-k of the probed inverted lists by (Hamming distance, id).

    q_codes (N, B) uint8, list_codes (R, B) uint8, list_ids (R,) int64 (>= 0),
    list_offsets (L+1,) int64, probes (N, P) int64 list ids (-1 = skip; repeats are
    scanned once), k >= 0. Returns dist (N, k) int32 and ids (N, k) int64 (see the module
    docstring). check=True also validates values (offsets, probe range, ids >= 0), which
    costs a pass over the ids and, on CUDA, host syncs; shapes and dtypes are always checked.
    backend: one of BACKENDS (see the module docstring).
    """
    k = _check_ivf(q_codes, list_codes, list_ids, list_offsets, probes, k, check)
    name = _resolve(backend, q_codes.device, k)
    n = q_codes.shape[0]
    if n == 0 or k == 0 or probes.shape[1] == 0:
        dev = q_codes.device
        return (torch.full((n, k), q_codes.shape[1] * 8 + 1, dtype=torch.int32, device=dev),
                torch.full((n, k), -1, dtype=torch.int64, device=dev))
    probes = _unique_probes(probes)
    if name == "torch":
        return topk_ivf_torch(q_codes, list_codes, list_ids, list_offsets, probes, k)
    if name == "triton":
        return _run_triton(q_codes, list_codes, list_ids, list_offsets, probes, k, check)
    if name == "faiss":
        from ds_xc_ops.hamming_faiss import FaissBinaryIVF
        return FaissBinaryIVF(list_codes, list_ids, list_offsets).search(q_codes, probes, k)
    return _run_native(name, q_codes, list_codes, list_ids, list_offsets, probes, k)


def hamming_topk_flat(q_codes, db_codes, k: int, backend: str = "auto"):
    """Brute-force top-k over all rows of db_codes (R, B); ids are row numbers.

    Equal to hamming_topk_ivf with one list holding every row.
    """
    nbytes = _check_codes("q_codes", q_codes)
    _check_codes("db_codes", db_codes, nbytes)
    k = _check_k(k)
    if q_codes.device != db_codes.device:
        raise ValueError(f"q_codes and db_codes must be on one device, got {q_codes.device} "
                         f"and {db_codes.device}")
    if backend == "faiss" and db_codes.device.type == "cpu" and k > 0:
        from ds_xc_ops.hamming_faiss import faiss_topk_flat
        return faiss_topk_flat(q_codes, db_codes, k)
    dev, rows, n = db_codes.device, db_codes.shape[0], q_codes.shape[0]
    ids = torch.arange(rows, dtype=torch.int64, device=dev)
    offsets = torch.tensor([0, rows], dtype=torch.int64, device=dev)
    probes = torch.zeros(n, 1, dtype=torch.int64, device=dev)
    return hamming_topk_ivf(q_codes, db_codes, ids, offsets, probes, k, backend=backend, check=False)

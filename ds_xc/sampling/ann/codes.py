"""Binary codes of unit vectors: b = sign(x P) with a projection P (d, bits), packed to bytes.

Legend: n rows, d dim, b = code_bits.

* ``random``: P is a random orthogonal matrix (SimHash: the chance that a bit differs is
  angle / pi); for b > d, ceil(b / d) independent orthogonal blocks side by side.
* ``itq``: iterative quantisation (Gong & Lazebnik): P = PCA_b @ R, with the rotation R
  (b, b) learned to minimise ||sign(V R) - V R|| on a sample of the rows. Needs b <= d.

Codes are packed as ``ds_xc_ops.hamming.pack_signs`` packs them (uint8, LSB first), the layout
the scan kernels read; Hamming distance between codes estimates the angle between the vectors.
"""
from __future__ import annotations

import sys

import torch

from ds_xc_ops.hamming import pack_signs, pack_signs_min_abs

__all__ = ["random_projection", "itq_projection", "encode", "encode_with_margins", "pack", "resolve_precision",
           "bf16_matmul_native"]


def _orthogonal(dim: int, gen: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))[None, :]).float()  # Haar-distributed


def random_projection(dim: int, bits: int, seed: int) -> torch.Tensor:
    """(d, b) random orthogonal projection, a pure function of (dim, bits, seed)."""
    gen = torch.Generator().manual_seed(int(seed) % (2**63))
    blocks = [_orthogonal(dim, gen) for _ in range(-(-bits // dim))]
    return torch.cat(blocks, dim=1)[:, :bits].contiguous()


def itq_projection(x: torch.Tensor, bits: int, iterations: int, seed: int) -> torch.Tensor:
    """(d, b) ITQ projection learned on x (n, d) (unit rows; a few thousand are enough)."""
    d = x.shape[1]
    if bits > d:
        raise ValueError(f"rotation 'itq' needs code_bits <= embedding_dim, got code_bits={bits} > {d}; "
                         "use rotation 'random'")
    x = x.double()
    mean = x.mean(0, keepdim=True)
    _, _, vh = torch.linalg.svd(x - mean, full_matrices=False)  # principal directions
    pca = vh[:bits].t()  # (d, b)
    v = x @ pca  # (n, b); no centring at query time, so the codes stay angle-based
    gen = torch.Generator().manual_seed(int(seed) % (2**63))
    r = _orthogonal(bits, gen).double()
    for _ in range(iterations):
        b = torch.sign(v @ r)
        b[b == 0] = 1
        u, _, wt = torch.linalg.svd(v.t() @ b)  # orthogonal Procrustes: R = U W^T
        r = u @ wt
    return (pca @ r).float().contiguous()


_GATHER_BITS = 0x0102040810204080  # times 8 bytes of 0/1: byte j's bit lands at bit 56 + j


def pack(v: torch.Tensor) -> torch.Tensor:
    """The layout of ``ds_xc_ops.hamming.pack_signs`` (bit j = v[:, j] > 0, LSB first): (n, b) -> (n, b // 8).

    The 8 booleans of each output byte are read as one int64 (a bool is one byte of 0 or
    1) and gathered into its top byte by one multiplication (wrapping), no per-bit passes.
    A contiguous float32 or bfloat16 CPU tensor goes to the one-pass CPU op instead.
    """
    if v.dtype in (torch.float32, torch.bfloat16) and v.device.type == "cpu":
        return pack_signs_min_abs(v.contiguous())[0]
    if sys.byteorder != "little":  # the trick reads bytes in little-endian order
        return pack_signs(v)
    n, bits = v.shape
    words = (v > 0).view(torch.uint8).view(torch.int64).view(n, bits // 8)  # (n, b/8), 8 flags each
    return ((words * _GATHER_BITS) >> 56).to(torch.uint8)


def bf16_matmul_native(device: torch.device) -> bool:
    """Whether bf16 matmuls run on bf16 hardware here: CUDA with bf16, or a CPU whose flags (Linux
    /proc/cpuinfo) list AVX512_BF16 or AMX-BF16; elsewhere they are emulated and slower than float32."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    if _CPU_BF16[0] is None:
        try:
            with open("/proc/cpuinfo") as f:
                flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
        except OSError:
            flags = []
        _CPU_BF16[0] = "avx512_bf16" in flags or "amx_bf16" in flags
    return _CPU_BF16[0]


_CPU_BF16 = [None]  # cached /proc/cpuinfo answer


def resolve_precision(precision: str, device: torch.device) -> str:
    """``code_precision`` as used on ``device``: "auto" -> "bfloat16" where bf16 matmuls are native."""
    if precision not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"code_precision={precision!r}: allowed 'auto', 'float32', 'bfloat16'")
    if precision == "auto":
        return "bfloat16" if bf16_matmul_native(device) else "float32"
    return precision


def encode(x: torch.Tensor, projection: torch.Tensor, chunk: int = 1 << 13, precision: str = "float32") -> torch.Tensor:
    """Packed codes (n, b // 8) uint8 of the rows of x (n, d), in row chunks (the float
    projections of a chunk, chunk x b x 4 bytes, are the memory this costs: 16 MiB at 512 bits).

    Signs do not depend on the row norms, so x need not be normalised. ``precision`` "bfloat16":
    x and the projection rounded to bf16, products summed in float32 by the bf16 matmul, the signs
    of its output (rounded to bf16, which keeps every sign); bf16 rounding is relative, so there a rescaled row may flip
    a bit whose projection is within rounding of zero.
    """
    out = torch.empty((x.shape[0], projection.shape[1] // 8), dtype=torch.uint8, device=x.device)
    low = precision == "bfloat16"
    p = projection.to(x.device, torch.bfloat16 if low else torch.float32)
    for a in range(0, x.shape[0], chunk):
        rows = x[a: a + chunk]
        out[a: a + chunk] = pack(rows.to(torch.bfloat16) @ p if low else rows.float() @ p)  # bf16 output: same signs
    return out


def encode_with_margins(x: torch.Tensor, projection: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes (n, b // 8) uint8, margins (n,) float32) of the rows of x (n, d) (one chunk: the float
    projections, n x b, are held). margin = min_j |x.p_j| / |x|, computed from the very float32
    projections whose signs are the code: how far the unit row is from the nearest sign boundary,
    in units of the column norms of P (see AnnIndex.refresh for how it bounds a code change)."""
    z = x.float() @ projection.to(x.device)  # (n, b)
    norms = torch.linalg.vector_norm(x.float(), dim=1)  # (n,)
    codes, min_abs = pack_signs_min_abs(z) if z.device.type == "cpu" else (pack(z), z.abs().amin(dim=1))
    margins = min_abs / norms.clamp_min(torch.finfo(torch.float32).tiny)
    return codes, torch.where(norms > 0, margins, torch.zeros_like(margins))

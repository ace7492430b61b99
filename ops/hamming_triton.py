"""Hamming top-k over probed inverted lists: a Triton kernel (GPU, or the CPU interpreter).

Same semantics as ``ds_xc_ops.hamming_torch.topk_ivf_torch`` (the reference); called through
``ds_xc_ops.hamming.hamming_topk_ivf(..., backend="triton")``, which validates the inputs and
removes repeated probes first.

Layout: a 2-D grid (query, probe split). Program (i, s) scans the probes
``[s * pps, (s + 1) * pps)`` of query i (pps = ceil(P / S)); each probed list is read in
tiles of BLOCK_R rows x BLOCK_W int32 words (code_bits / 32 words, zero-padded to a
power of two). The distance of a row is the sum over words of popcount(q xor c):
libdevice ``popc`` on a GPU, a SWAR bit trick under the interpreter (no libdevice
there). Each candidate becomes one int64 key ``dist << 52 | id`` (ids < 2^52), so
ordering keys is ordering by (distance, id) with ties to the smaller id. A program
keeps its K_PAD smallest keys sorted (K_PAD = next power of two >= k, BLOCK_R =
max(K_PAD, 128)); a tile is merged only when its smallest key beats the current K_PAD-th
(a constexpr picks how): "sort" (the GPU default) sorts the tile, keeps its K_PAD
smallest, joins them with the running keys, sorts the 2 K_PAD and keeps the first half;
"rank" (the interpreter default, where tl.sort is ~100x slower) ranks the tile's keys
by counting over a comparison matrix and merges them with the running keys by rank.
The splits' keys (N, S, K_PAD) are merged by one torch sort, decoded and padded with
(code_bits + 1, -1).

Shape legend: N queries, W int32 words per code, R rows, L lists, P probes, S splits.
"""
from __future__ import annotations

import math

import torch

from ds_xc_ops.triton_util import HAVE_TRITON, device_guard, interpreting

__all__ = ["topk_ivf_triton", "TRITON_MAX_K", "ID_LIMIT"]

TRITON_MAX_K = 1024    # K_PAD keys in registers, sorted 2 K_PAD at a time; (K_PAD, K_PAD) <= 2^20 elements
ID_LIMIT = 1 << 52     # ids are packed below the distance in one int64 key
_EMPTY = (1 << 63) - 1  # key of an empty slot: sorts after every candidate
_MIN_BLOCK_R = 128      # rows per tile (at least K_PAD, so that a tile can fill the keys)
# Triton decides interpreted or compiled when it decorates a kernel, i.e. at this import:
# the popcount and merge defaults follow that, not a later change of TRITON_INTERPRET.
_INTERPRETED = interpreting()

if HAVE_TRITON:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def _popcount32(x, USE_POPC: tl.constexpr):
        """Set bits of each int32 element (arithmetic shifts are safe: the masks drop bit 31)."""
        if USE_POPC:
            out = libdevice.popc(x)
        else:
            x = x - ((x >> 1) & 0x55555555)
            x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
            x = (x + (x >> 4)) & 0x0F0F0F0F
            out = ((x * 0x01010101) >> 24) & 0xFF  # the multiply wraps in int32, as on a GPU
        return out

    @triton.jit
    def _smallest_by_rank(x, N: tl.constexpr, M: tl.constexpr):
        """The M smallest of x (N,), sorted, by rank counting over an (N, N) comparison.

        The interpreter's merge: tl.sort runs its bitonic network op by op there (about
        0.3 s per 512 keys), while these few whole-matrix ops take milliseconds. Equal
        keys (empty slots, a repeated id) are ranked by position.
        """
        pos = tl.arange(0, N)
        before = (x[None, :] < x[:, None]) | ((x[None, :] == x[:, None]) & (pos[None, :] < pos[:, None]))
        rank = tl.sum(before.to(tl.int32), axis=1)  # (N,) a permutation of 0..N-1
        slot = tl.arange(0, M)
        return tl.sum(tl.where(rank[:, None] == slot[None, :], x[:, None], 0), axis=0)  # (M,)

    @triton.jit
    def _merge_sorted_by_rank(a, b, K: tl.constexpr):
        """The K smallest of two sorted (K,) key vectors, sorted: a stable merge by rank.

        a_i goes to i + #(b < a_i), b_j to j + #(a <= b_j) (a permutation of 0..2K-1); only
        (K, K) matrices, within Triton's 2^20-element limit up to K = 1024.
        """
        pos = tl.arange(0, K)
        rank_a = pos + tl.sum((b[None, :] < a[:, None]).to(tl.int32), axis=1)  # (K,)
        rank_b = pos + tl.sum((a[None, :] <= b[:, None]).to(tl.int32), axis=1)  # (K,)
        out = tl.sum(tl.where(rank_a[:, None] == pos[None, :], a[:, None], 0), axis=0)  # (K,)
        return out + tl.sum(tl.where(rank_b[:, None] == pos[None, :], b[:, None], 0), axis=0)

    @triton.jit
    def _merge_keys(best, key, K_PAD: tl.constexpr, BLOCK_R: tl.constexpr, RANK_MERGE: tl.constexpr):
        """The K_PAD smallest of best (K_PAD,) sorted and key (BLOCK_R,), sorted."""
        if RANK_MERGE:
            t = _smallest_by_rank(key, BLOCK_R, K_PAD)  # (K_PAD,)
            out = _merge_sorted_by_rank(best, t, K_PAD)
        else:
            t = tl.sort(key)  # (BLOCK_R,)
            if BLOCK_R > K_PAD:  # sorted, so row 0 of the (BLOCK_R / K_PAD, K_PAD) view is the minimum
                t = tl.min(tl.reshape(t, (BLOCK_R // K_PAD, K_PAD)), axis=0)  # (K_PAD,)
            both = tl.sort(tl.reshape(tl.join(best, t), (2 * K_PAD,)))  # (2 K_PAD,)
            out = tl.min(tl.reshape(both, (2, K_PAD)), axis=0)  # (K_PAD,) the first half
        return out

    @triton.jit
    def _ivf_scan_kernel(q_ptr, codes_ptr, ids_ptr, off_ptr, probes_ptr, out_ptr,
                         num_probes, num_lists, probes_per_split, num_splits,
                         W: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_R: tl.constexpr,
                         K_PAD: tl.constexpr, USE_POPC: tl.constexpr,
                         RANK_MERGE: tl.constexpr):
        qi = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        wo = tl.arange(0, BLOCK_W)
        wmask = wo < W
        q = tl.load(q_ptr + qi * W + wo, mask=wmask, other=0)  # (BLOCK_W,) int32 words
        best = tl.full((K_PAD,), 0x7FFFFFFFFFFFFFFF, tl.int64)
        ro = tl.arange(0, BLOCK_R)
        j0 = split * probes_per_split
        j1 = tl.minimum(j0 + probes_per_split, num_probes)
        for j in range(j0, j1):
            lst = tl.load(probes_ptr + qi * num_probes + j)
            ok = (lst >= 0) & (lst < num_lists)  # -1 (skipped) and, defensively, out of range
            safe = tl.where(ok, lst, 0)
            start = tl.load(off_ptr + safe)
            end = tl.where(ok, tl.load(off_ptr + safe + 1), start)
            for r0 in range(start, end, BLOCK_R):
                rows = r0 + ro  # (BLOCK_R,) int64
                rmask = rows < end
                c = tl.load(codes_ptr + rows[:, None] * W + wo[None, :],
                            mask=rmask[:, None] & wmask[None, :], other=0)  # (BLOCK_R, BLOCK_W)
                d = tl.sum(_popcount32(c ^ q[None, :], USE_POPC), axis=1)  # (BLOCK_R,)
                ids = tl.load(ids_ptr + rows, mask=rmask, other=0)
                key = tl.where(rmask, (d.to(tl.int64) << 52) | ids, 0x7FFFFFFFFFFFFFFF)
                if tl.min(key, axis=0) < tl.max(best, axis=0):
                    best = _merge_keys(best, key, K_PAD, BLOCK_R, RANK_MERGE)
        out = out_ptr + (qi * num_splits + split) * K_PAD
        tl.store(out + tl.arange(0, K_PAD), best)


def _words(codes: torch.Tensor) -> torch.Tensor:
    """(rows, B) uint8 -> (rows, B // 4) int32, the same bytes (copied only if misaligned)."""
    codes = codes.contiguous()
    try:
        return codes.view(torch.int32)
    except RuntimeError:  # storage offset not a multiple of 4 bytes
        return codes.clone().view(torch.int32)


def default_splits(num_queries: int, num_probes: int, device: torch.device) -> int:
    """Probe splits per query: enough programs to fill the GPU (4 per SM), 1 when interpreting."""
    if _INTERPRETED or device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(num_probes, math.ceil(4 * sms / max(num_queries, 1))))


def topk_ivf_triton(q_codes, list_codes, list_ids, list_offsets, probes, k: int,
                    splits: int | None = None, merge: str | None = None):
    """Triton IVF scan; same arguments and result as ``ds_xc_ops.hamming_torch.topk_ivf_torch``.

    Inputs are already validated by ``ds_xc_ops.hamming`` (probes without repeats, ids in
    [0, 2^52)); 1 <= k <= TRITON_MAX_K. ``splits`` (probe splits per query, default
    ``default_splits``) trades parallelism for a larger final merge. ``merge`` is how a
    tile enters the running keys: "sort" (tl.sort, the GPU default) or "rank" (rank
    counting over a (BLOCK_R, BLOCK_R) matrix, the interpreter default: fast there, too
    many registers on a GPU beyond small k).
    Returns dist (N, k) int32 and ids (N, k) int64.
    """
    if not HAVE_TRITON:
        raise RuntimeError("backend='triton' needs triton (pip install triton)")
    if not 1 <= k <= TRITON_MAX_K:
        raise ValueError(f"backend='triton' supports 1 <= k <= {TRITON_MAX_K}, got k = {k}")
    merge = merge or ("rank" if _INTERPRETED else "sort")
    if merge not in ("sort", "rank"):
        raise ValueError(f"merge = {merge!r} must be 'sort' or 'rank'")
    n, nbytes = q_codes.shape
    num_probes = probes.shape[1]
    dev = q_codes.device
    s = default_splits(n, num_probes, dev) if splits is None else int(splits)
    if not 1 <= s <= max(num_probes, 1):
        raise ValueError(f"splits = {splits} must be in [1, probes.shape[1] = {num_probes}]")
    pps = math.ceil(num_probes / s)
    s = math.ceil(num_probes / pps)  # no empty trailing split
    words = nbytes // 4
    k_pad = triton.next_power_of_2(k)
    block_r = max(k_pad, _MIN_BLOCK_R)
    keys = torch.empty(n, s, k_pad, dtype=torch.int64, device=dev)  # (N, S, K_PAD)
    with device_guard(keys):  # launched on the tensors' GPU, whatever the current device
        _ivf_scan_kernel[(n, s)](
            _words(q_codes), _words(list_codes), list_ids.contiguous(), list_offsets.contiguous(),
            probes.contiguous(), keys, num_probes, list_offsets.shape[0] - 1, pps, s,
            W=words, BLOCK_W=triton.next_power_of_2(words), BLOCK_R=block_r, K_PAD=k_pad,
            USE_POPC=not _INTERPRETED, RANK_MERGE=merge == "rank", num_warps=8 if k_pad >= 512 else 4)
    keys = keys.view(n, s * k_pad)
    if s > 1:
        keys = torch.sort(keys, dim=1).values
    keys = keys[:, :k]  # (N, k)
    empty = keys == _EMPTY
    dist = torch.where(empty, nbytes * 8 + 1, keys >> 52).to(torch.int32)
    ids = torch.where(empty, -1, keys & (ID_LIMIT - 1))
    return dist, ids

"""Pure-PyTorch Hamming top-k scan: the reference that defines the semantics.

Every other backend (C++, CUDA, faiss) is tested for exact equality against this one.
Semantics (inputs already validated by ``ds_xc_ops.hamming``): for query i, the candidates are
the rows of every probed list (``probes[i, j] >= 0``; ``probes`` holds no repeats); the
result is the k candidates of smallest (Hamming distance, id), ascending, ties broken by
the smaller id; missing entries are padded with (code_bits + 1, -1).

The scan is vectorised and memory-bounded: queries go in chunks of at most
``pair_budget`` (query, row) pairs (a single query with more candidates forms its own
chunk), and each chunk's pairs are scored in blocks of at most ``block_bytes`` bytes of
codes. Each block keeps, per query, only the candidates within its own k-th distance
(a histogram threshold), sorts those by (query, distance, id) and merges them into the
running top-k. It runs on any device (CUDA tensors included).

Shape legend: N queries, B code bytes, R rows, L lists, P probes per query, M (query,
row) pairs of a chunk, m of a block, Q queries of a chunk.
"""
from __future__ import annotations

import torch

__all__ = ["topk_ivf_torch", "popcount_lut"]

PAIR_BUDGET = 1 << 22   # (query, row) pairs per query chunk: bounds the index tensors
BLOCK_BYTES = 1 << 23   # bytes of codes scored at once (the xor and its popcounts)


def popcount_lut(device) -> torch.Tensor:
    """(256,) uint8: the number of set bits of each byte value."""
    v = torch.arange(256, device=device)
    bits = (v.unsqueeze(1) >> torch.arange(8, device=device)) & 1
    return bits.sum(1).to(torch.uint8)


def _lex_order(q: torch.Tensor, d: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Permutation sorting (q, d, ids) lexicographically (stable sorts, least key first)."""
    order = torch.sort(ids, stable=True).indices
    order = order[torch.sort(d[order], stable=True).indices]
    return order[torch.sort(q[order], stable=True).indices]


def _merge(best_d, best_i, new_d, new_i, k):
    """Top-k of two (Q, k) candidate sets by (distance, id); padding sorts last."""
    d = torch.cat([best_d, new_d], dim=1)  # (Q, 2k)
    i = torch.cat([best_i, new_i], dim=1)
    order = torch.sort(i, dim=1, stable=True).indices
    order = order.gather(1, torch.sort(d.gather(1, order), dim=1, stable=True).indices)
    order = order[:, :k]
    return d.gather(1, order), i.gather(1, order)


def _block_topk(qloc, d, ids, bound, num_q, k, pad_d):
    """Per-query top-k of one block of scored pairs, as (Q, k) padded tensors.

    qloc (m,) query index within the chunk, d (m,) int32 distances, ids (m,) int64,
    bound (Q,) the running k-th distance (pad_d while fewer than k are known): candidates
    above it cannot enter the result. Candidates beyond the block's own k-th distance are
    dropped before the sort, so the sort only sees about k (plus ties) pairs per query.
    """
    nb = pad_d + 1  # distance bins 0..pad_d
    hist = torch.bincount(qloc * nb + d.long(), minlength=num_q * nb).view(num_q, nb)
    # threshold t[q] = smallest distance whose cumulative count reaches k (pad_d if none)
    t = (hist.cumsum(1) < k).sum(1).clamp(max=pad_d)  # (Q,)
    t = torch.minimum(t, bound.long())
    keep = d.long() <= t[qloc]
    qloc, d, ids = qloc[keep], d[keep], ids[keep]
    order = _lex_order(qloc, d, ids)
    qloc, d, ids = qloc[order], d[order], ids[order]
    counts = torch.bincount(qloc, minlength=num_q)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(qloc.numel(), device=d.device) - starts[qloc]
    sel = rank < k
    out_d = torch.full((num_q, k), pad_d, dtype=torch.int32, device=d.device)
    out_i = torch.full((num_q, k), -1, dtype=torch.int64, device=d.device)
    out_d[qloc[sel], rank[sel]] = d[sel]
    out_i[qloc[sel], rank[sel]] = ids[sel]
    return out_d, out_i


def _pairs(offsets, probes_c, sizes_c):
    """Flatten a chunk's probed lists into (query, row) pairs.

    probes_c (Q, P) with -1 entries, sizes_c (Q, P) list sizes (0 for -1 entries).
    Returns qloc (M,) query index within the chunk and rows (M,) row numbers.
    """
    num_q, p = probes_c.shape
    flat_sizes = sizes_c.reshape(-1)  # (Q*P,)
    starts = offsets[probes_c.clamp(min=0).reshape(-1)]  # (Q*P,)
    total = int(flat_sizes.sum())
    qloc = torch.arange(num_q, device=offsets.device).repeat_interleave(sizes_c.sum(1))
    before = torch.cumsum(flat_sizes, 0) - flat_sizes  # pairs before each probe
    rows = torch.arange(total, device=offsets.device) + torch.repeat_interleave(
        starts - before, flat_sizes, output_size=total)
    return qloc, rows


def _chunks(cand: torch.Tensor, budget: int):
    """Split queries into consecutive ranges of at most `budget` candidate pairs each."""
    cum = torch.cumsum(cand.cpu(), 0)  # (N,)
    n, a, before = cand.numel(), 0, 0
    while a < n:
        b = int(torch.searchsorted(cum, before + budget, right=True))
        b = max(b, a + 1)
        yield a, b
        before = int(cum[b - 1])
        a = b


def topk_ivf_torch(q_codes, list_codes, list_ids, list_offsets, probes, k: int,
                   pair_budget: int = PAIR_BUDGET, block_bytes: int = BLOCK_BYTES):
    """Reference IVF scan. Same arguments and result as ``ds_xc_ops.hamming.hamming_topk_ivf``.

    q_codes (N, B) uint8, list_codes (R, B) uint8, list_ids (R,) int64, list_offsets
    (L+1,) int64, probes (N, P) int64 (-1 = skip, no repeats). Returns dist (N, k) int32
    and ids (N, k) int64.
    """
    n, nbytes = q_codes.shape
    dev = q_codes.device
    pad_d = nbytes * 8 + 1
    out_d = torch.full((n, k), pad_d, dtype=torch.int32, device=dev)
    out_i = torch.full((n, k), -1, dtype=torch.int64, device=dev)
    if n == 0 or k == 0 or probes.shape[1] == 0:
        return out_d, out_i
    lut = popcount_lut(dev)
    list_sizes = list_offsets[1:] - list_offsets[:-1]  # (L,)
    valid = probes >= 0
    sizes = torch.where(valid, list_sizes[probes.clamp(min=0)] if list_sizes.numel()
                        else torch.zeros_like(probes), 0)  # (N, P)
    block_pairs = max(1, block_bytes // nbytes)
    for a, b in _chunks(sizes.sum(1), pair_budget):
        qloc, rows = _pairs(list_offsets, probes[a:b], sizes[a:b])
        best_d, best_i = out_d[a:b], out_i[a:b]  # views: merged in place
        for s in range(0, rows.numel(), block_pairs):
            ql, rw = qloc[s:s + block_pairs], rows[s:s + block_pairs]
            lo, hi = int(ql[0]), int(ql[-1]) + 1  # pairs come in query order
            x = q_codes[a + ql] ^ list_codes[rw]  # (m, B)
            # popcount by table lookup; index_select is ~2x faster than lut[x.long()]
            d = lut.index_select(0, x.view(-1).long()).view(x.shape).sum(1, dtype=torch.int32)
            blk = _block_topk(ql - lo, d, list_ids[rw], best_d[lo:hi, k - 1], hi - lo, k, pad_d)
            best_d[lo:hi], best_i[lo:hi] = _merge(best_d[lo:hi], best_i[lo:hi], *blk, k)
    return out_d, out_i

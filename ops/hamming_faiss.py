"""faiss backend of the Hamming scan: IndexBinaryIVF / IndexBinaryFlat with our lists.

Used as an option and as an independent cross-check of the other backends. The inverted
lists are filled directly (``invlists.add_entries``) with our list assignment, ids and
storage order, and queried with ``search_preassigned`` using our probes; the coarse
quantizer is never used.

Ties: faiss keeps, among candidates at the k-th distance, whichever it met first (its
heap admits only strictly smaller distances), not the smallest ids. Its distances are
exact, so the k-th distance t of each full result is exact too; a range search with
radius t + 1 (faiss returns distance < radius) then yields every candidate at distance
<= t, from which the k smallest (distance, id) are taken. The result equals the
reference exactly, at the cost of a second scan. ``exact_ties=False`` skips that scan
and only re-sorts faiss's own k by (distance, id).

Shape legend: N queries, B code bytes, R rows, L lists, P probes per query.
"""
from __future__ import annotations

import faiss
import numpy as np
import torch

__all__ = ["FaissBinaryIVF", "faiss_topk_flat"]


def _sorted_topk(lims, dist, ids, k, pad_d):
    """Per-query k smallest (distance, id) of CSR results -> (n, k) int32, (n, k) int64."""
    lims = lims.astype(np.int64)  # faiss returns size_t
    n = lims.shape[0] - 1
    seg = np.repeat(np.arange(n), np.diff(lims))
    order = np.lexsort((ids, dist, seg))  # by segment, then distance, then id
    seg, dist, ids = seg[order], dist[order], ids[order]
    rank = np.arange(seg.shape[0]) - lims[seg]
    keep = rank < k
    out_d = np.full((n, k), pad_d, dtype=np.int32)
    out_i = np.full((n, k), -1, dtype=np.int64)
    out_d[seg[keep], rank[keep]] = dist[keep]
    out_i[seg[keep], rank[keep]] = ids[keep]
    return out_d, out_i


def _resolve_ties(knn_d, knn_i, k, pad_d, range_search=None):
    """Exact (distance, id) top-k from faiss's knn result plus range searches.

    knn_d/knn_i (n, k) from faiss; range_search(rows (m,), radius) -> lims, D, I for the
    query rows `rows` with distance < radius. Queries with fewer than k results already
    hold every candidate and are only re-sorted; range_search=None only re-sorts.
    """
    n = knn_d.shape[0]
    valid = knn_i >= 0
    lims = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(valid.sum(1), out=lims[1:])
    out_d, out_i = _sorted_topk(lims, knn_d[valid], knn_i[valid], k, pad_d)
    full = np.nonzero(valid[:, -1])[0] if k else np.zeros(0, dtype=np.int64)
    if full.size and range_search is not None:
        # one radius per query is not in faiss's API: group queries by their k-th distance
        kth = knn_d[full, -1]
        for t in np.unique(kth):
            rows = full[kth == t]
            lims_r, d_r, i_r = range_search(rows, int(t) + 1)
            out_d[rows], out_i[rows] = _sorted_topk(lims_r, d_r, i_r, k, pad_d)
    return out_d, out_i


class FaissBinaryIVF:
    """An IndexBinaryIVF holding our inverted file as is (lists, ids, storage order).

    list_codes (R, B) uint8, list_ids (R,) int64, list_offsets (L+1,) int64, CPU tensors.
    Building copies the codes into faiss (O(R)); keep the object to search repeatedly.
    """

    def __init__(self, list_codes: torch.Tensor, list_ids: torch.Tensor,
                 list_offsets: torch.Tensor):
        self.nbytes = list_codes.shape[1]
        self.nlist = list_offsets.shape[0] - 1
        codes = np.ascontiguousarray(list_codes.numpy())
        ids = np.ascontiguousarray(list_ids.numpy())
        off = list_offsets.numpy()
        self.quantizer = faiss.IndexBinaryFlat(self.nbytes * 8)  # unused, but required
        self.index = faiss.IndexBinaryIVF(self.quantizer, self.nbytes * 8, max(self.nlist, 1))
        self.index.is_trained = True
        invlists = self.index.invlists
        for lst in np.nonzero(np.diff(off))[0]:
            a, b = int(off[lst]), int(off[lst + 1])
            invlists.add_entries(int(lst), b - a, faiss.swig_ptr(ids[a:b]), faiss.swig_ptr(codes[a:b]))
        self.index.ntotal = int(codes.shape[0])

    def search(self, q_codes: torch.Tensor, probes: torch.Tensor, k: int, exact_ties: bool = True):
        """q_codes (N, B) uint8, probes (N, P) int64 (-1 = skip, no repeats) -> (dist, ids)."""
        n, pad_d = q_codes.shape[0], self.nbytes * 8 + 1
        q = np.ascontiguousarray(q_codes.numpy())
        # faiss clamps nprobe to nlist: put the valid probes first, keep <= nlist columns
        pr = probes.numpy()
        pr = np.take_along_axis(pr, np.argsort(pr < 0, axis=1, kind="stable"), axis=1)
        pr = np.ascontiguousarray(pr[:, :min(pr.shape[1], self.nlist)])
        if n == 0 or k == 0 or pr.shape[1] == 0 or self.index.ntotal == 0:
            return (torch.full((n, k), pad_d, dtype=torch.int32),
                    torch.full((n, k), -1, dtype=torch.int64))
        self.index.nprobe = pr.shape[1]
        knn_d, knn_i = self.index.search_preassigned(q, k, pr, None)

        def range_search(rows, radius):
            return self.index.range_search_preassigned(q[rows], radius, pr[rows], None)

        d, i = _resolve_ties(knn_d, knn_i, k, pad_d, range_search if exact_ties else None)
        return torch.from_numpy(d), torch.from_numpy(i)


def faiss_topk_flat(q_codes: torch.Tensor, db_codes: torch.Tensor, k: int, exact_ties: bool = True):
    """Brute force with IndexBinaryFlat: q_codes (N, B), db_codes (R, B) uint8 -> (dist, ids)."""
    n, nbytes = q_codes.shape
    pad_d = nbytes * 8 + 1
    if n == 0 or k == 0 or db_codes.shape[0] == 0:
        return (torch.full((n, k), pad_d, dtype=torch.int32),
                torch.full((n, k), -1, dtype=torch.int64))
    index = faiss.IndexBinaryFlat(nbytes * 8)
    index.add(np.ascontiguousarray(db_codes.numpy()))
    q = np.ascontiguousarray(q_codes.numpy())
    knn_d, knn_i = index.search(q, k)
    d, i = _resolve_ties(knn_d, knn_i, k, pad_d,
                         (lambda rows, radius: index.range_search(q[rows], radius))
                         if exact_ties else None)
    return torch.from_numpy(d), torch.from_numpy(i)

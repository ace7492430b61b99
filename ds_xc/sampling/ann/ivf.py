"""Inverted file over unit vectors: spherical k-means centroids and CSR lists.

Legend: n rows, d dim, c centroids (nlist).

``spherical_kmeans`` trains on at most ``max_points_per_centroid * c`` sampled rows (as
faiss does; 64 per centroid: the lists only need to be coarse cells), assigning by the largest cosine and re-normalising the means; an empty
cluster is re-seeded from a random row. ``build_lists`` turns an assignment into the
CSR layout of ops/hamming.py (ids grouped by list, ascending inside a list). Every step is
deterministic on the GPU too: no accumulation through atomics (tests/test_determinism.py).
"""
from __future__ import annotations

import logging

import torch

from ds_xc_ops.accumulate import add_rows_

__all__ = ["spherical_kmeans", "kmeans_sample", "assign", "build_lists"]

MAX_POINTS_PER_CENTROID = 64

log = logging.getLogger(__name__)


def assign(x: torch.Tensor, centroids: torch.Tensor, chunk: int = 1 << 15) -> torch.Tensor:
    """Index of the nearest centroid (largest cosine) for each row of x: (n,) int64."""
    out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    for a in range(0, x.shape[0], chunk):
        out[a: a + chunk] = (x[a: a + chunk] @ centroids.t()).argmax(dim=1)
    return out


def kmeans_sample(n: int, num_centroids: int, gen: torch.Generator,
                  max_points_per_centroid: int = MAX_POINTS_PER_CENTROID) -> torch.Tensor:
    """Row ids (sorted) that k-means trains on: all n rows, or max_points_per_centroid * c of them."""
    c = min(num_centroids, n)
    if n <= c * max_points_per_centroid:
        return torch.arange(n)
    return torch.randperm(n, generator=gen)[: c * max_points_per_centroid].sort().values


def spherical_kmeans(x: torch.Tensor, num_centroids: int, iterations: int, seed: int,
                     max_points_per_centroid: int = MAX_POINTS_PER_CENTROID) -> torch.Tensor:
    """(c, d) unit centroids for the unit rows of x (n, d)."""
    n = x.shape[0]
    c = min(num_centroids, n)
    gen = torch.Generator().manual_seed(int(seed) % (2**63))
    if n > c * max_points_per_centroid:
        x = x[kmeans_sample(n, c, gen, max_points_per_centroid).to(x.device)]
        n = x.shape[0]
    cent = x[torch.randperm(n, generator=gen)[:c].to(x.device)].clone()  # (c, d)
    for _ in range(iterations):
        a = assign(x, cent)
        # (c, d) sums per centroid, deterministic on every device (ds_xc_ops.accumulate: sorted on a GPU,
        # serial on a CPU, where index_put_'s accumulation uses parallel atomics)
        sums = add_rows_(torch.zeros_like(cent), a, x)
        counts = torch.bincount(a, minlength=c)
        empty = counts == 0
        if bool(empty.any()):
            reseed = torch.randint(0, n, (int(empty.sum()),), generator=gen).to(x.device)
            sums[empty] = x[reseed]
        cent = torch.nn.functional.normalize(sums, dim=1)
    return cent


def build_lists(assignment: torch.Tensor, num_lists: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(list_offsets (c+1,), list_ids (n,)): ids grouped by list, ascending within a list."""
    ids = torch.argsort(assignment, stable=True)  # (n,)
    counts = torch.bincount(assignment, minlength=num_lists)
    offsets = torch.zeros(num_lists + 1, dtype=torch.int64, device=assignment.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return offsets, ids

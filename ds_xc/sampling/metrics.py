"""Sampler quality, measured against the exact logits (class-parallel, in row chunks).

Legend: N rows of the global batch, L classes of this shard, k the recall depth.

For every row: its exact top-k classes over ALL classes (each rank scores its shard in
row chunks, the per-shard top-k are gathered and merged), then

* ``recall_active@k``: the share of those k classes present in the row's active set
  (its group's set on the shard that owns the class);
* ``recall_retrieved@k``: the share present in the row's own retrieved list (ANN);
* ``softmax_mass``: the share of the row's softmax mass (sum of exp of the plain logits,
  no margin) that its active set covers.

Every rank must call it (it runs collectives); it costs one exact pass over the shard.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ds_xc.parallel.collectives import merge_topk
from ds_xc.parallel.groups import is_distributed

__all__ = ["active_set_quality"]


@torch.no_grad()
def active_set_quality(x: torch.Tensor, weight: torch.Tensor, class_start: int, active, normalised: bool,
                       scale: float = 1.0, retrieved: Optional[torch.Tensor] = None, k: int = 10,
                       group=None, chunk: int = 64) -> dict:
    """Recall and covered softmax mass of ``active`` (an ActiveSet) for the rows of x (N, d)."""
    num_local = weight.shape[0]
    w = weight.detach().float()
    q = x.detach().float()
    if normalised:
        w, q = F.normalize(w, dim=1), F.normalize(q, dim=1) * scale
    total = torch.tensor([num_local], dtype=torch.int64, device=w.device)
    if is_distributed(group):  # k must be the same on every rank: capped by all classes, not this shard
        dist.all_reduce(total, group=group)
    k = min(k, int(total.item()))
    kl = min(k, num_local)  # this shard's candidates, padded to k with (-inf, -1) below
    hits = torch.zeros(4, dtype=torch.float64, device=w.device)  # active, retrieved, mass, -
    masks = []
    for rows, idx in active.groups():  # which local classes are active, per group
        m = torch.ones(num_local, dtype=torch.bool, device=w.device)
        if idx is not None:
            m.zero_()
            m[idx] = True
        masks.append((rows, m))
    for a in range(0, q.shape[0], chunk):
        z = q[a: a + chunk] @ w.t()  # (n, L) plain logits
        n = z.shape[0]
        top = torch.topk(z, kl, dim=1)
        vals = torch.full((n, k), float("-inf"), dtype=z.dtype, device=z.device)  # (n, k) padded
        ids = torch.full((n, k), -1, dtype=torch.int64, device=z.device)
        vals[:, :kl], ids[:, :kl] = top.values, top.indices + class_start
        best = merge_topk(vals, ids, k, group)  # (n, k) global ids; k <= C real candidates: no pad
        local = best - class_start
        mine = (local >= 0) & (local < num_local)
        lc = local.clamp(0, num_local - 1)
        row_mask = torch.zeros((n, num_local), dtype=torch.bool, device=w.device)
        for rows, m in masks:
            lo, hi = max(rows.start - a, 0), min(rows.stop - a, n)
            if lo < hi:
                row_mask[lo:hi] = m
        hits[0] += (mine & row_mask.gather(1, lc)).sum()
        if retrieved is not None:
            ret = retrieved[a: a + n]  # (n, r)
            found = (ret[:, None, :] == lc[:, :, None]).any(dim=2)  # (n, k)
            hits[1] += (mine & found).sum()
        zmax = z.max(dim=1).values
        if is_distributed(group):
            dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
        e = torch.exp(z - zmax[:, None])
        sums = torch.stack([(e * row_mask).sum(dim=1), e.sum(dim=1)], 1).double()  # (n, 2)
        if is_distributed(group):
            dist.all_reduce(sums, group=group)
        hits[2] += (sums[:, 0] / sums[:, 1]).sum()
    if is_distributed(group):
        dist.all_reduce(hits[:2], group=group)
    n_rows = max(q.shape[0], 1)
    out = {f"recall_active@{k}": hits[0].item() / (n_rows * k), "softmax_mass": hits[2].item() / n_rows}
    if retrieved is not None:
        out[f"recall_retrieved@{k}"] = hits[1].item() / (n_rows * k)
    return out

"""Assembling a fixed-size active set: positives, then ranked candidates, then uniform fill.

Legend: L classes of the shard, K budget, n rows, r candidates per row.

Every sampler that is not ``full`` builds its active set here, so the rules are one:
the positives of the rows are always kept (K grows past the budget only when they alone
exceed it); candidates are taken in rank order across rows (every row's best, then every
row's second best, ...), duplicates and positives skipped, until the budget is reached;
what did not fit is counted as cut; the rest is filled with uniformly drawn classes.
The result is sorted, so targets are remapped with a binary search.
"""
from __future__ import annotations

import math

from typing import Optional

import torch

__all__ = ["assemble", "remap_targets", "ranked_unique"]


def ranked_unique(candidates: torch.Tensor, num_local: int) -> torch.Tensor:
    """Distinct ids in [0, L) of candidates (n, r) (-1 = none), in rank-major order of first
    appearance. O(n r + L), no sort: each id's first position is found by a scatter-min."""
    flat = candidates.t().reshape(-1)  # rank 0 of every row, then rank 1, ...
    flat = flat[flat >= 0]
    if flat.numel() == 0:
        return flat
    order = torch.arange(flat.numel(), device=flat.device)
    first = torch.full((num_local,), flat.numel(), dtype=torch.int64, device=flat.device)
    first.scatter_reduce_(0, flat, order, reduce="amin")
    return flat[first[flat] == order]


def _uniform_fill(taken: torch.Tensor, count: int, num_local: int, gen: torch.Generator) -> torch.Tensor:
    """``count`` distinct ids of [0, L) not marked in ``taken`` (L,) bool, uniformly at random."""
    if count <= 0:
        return torch.empty(0, dtype=torch.int64, device=taken.device)
    free = num_local - int(taken.sum())
    if count * 4 > free:  # dense case: one random score per class
        score = torch.rand(num_local, generator=gen, device=gen.device).to(taken.device)
        score[taken] = -1.0
        return torch.topk(score, count, sorted=False).indices
    picked = []
    mask = taken.clone()
    need = count
    while need > 0:  # sparse case: draw with replacement, drop repeats and taken ids
        draw = torch.randint(0, num_local, (need + need // 4 + 16,), generator=gen, device=gen.device)
        draw = draw.to(taken.device)
        draw = draw[~mask[draw]]
        draw = ranked_unique(draw[None, :], num_local)[:need]  # distinct, in draw order
        mask[draw] = True
        picked.append(draw)
        need -= draw.numel()
    return torch.cat(picked)


def assemble(positives: torch.Tensor, candidates: Optional[torch.Tensor], budget: int, num_local: int,
             gen: torch.Generator, candidate_share: float = 1.0) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """(sorted active ids (K,), counts, kept candidates) from positives (P,) and ranked
    candidates (n, r) or None; candidates take at most ``candidate_share`` of the room
    left after the positives, uniform fill the rest."""
    device = positives.device
    taken = torch.zeros(num_local, dtype=torch.bool, device=device)
    taken[positives] = True
    k = max(budget, int(positives.numel()))
    room = k - int(positives.numel())
    ranked = ranked_unique(candidates, num_local) if candidates is not None else positives[:0]
    ranked = ranked[~taken[ranked]]
    kept = ranked[:room if candidate_share >= 1.0 else math.ceil(candidate_share * room)]
    taken[kept] = True
    fill = _uniform_fill(taken, room - kept.numel(), num_local, gen)
    index = torch.cat([positives, kept, fill]).sort().values
    stats = {"active": index.numel(), "positives": int(positives.numel()), "retrieved": int(ranked.numel()),
             "kept": int(kept.numel()), "cut": int(ranked.numel() - kept.numel()), "fill": int(fill.numel())}
    return index, stats, kept


def remap_targets(index: torch.Tensor, local: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
    """Each row's column in the sorted active ``index`` (K,), or -1 (off shard or not active)."""
    pos = torch.searchsorted(index, local.clamp(0, None))
    pos = pos.clamp(max=max(index.numel() - 1, 0))
    found = mine & (index[pos] == local)
    return torch.where(found, pos, torch.full_like(pos, -1))

"""Assembling a fixed-size active set on the device: positives, then ranked candidates, then uniform fill.

Legend: L classes of the shard, K active classes, N rows, E candidate entries (N x r, flattened in
priority order), C the core prefix (positives and kept candidates, a static bound).

Every sampler that is not ``full`` builds its active set here, so the rules are one:

* the size is fixed: ``K = max(budget, min(N, L))`` (:func:`active_size`), a function of the
  shapes only, so a step has static shapes (what CUDA graphs need) and no host sync: the positives
  of N rows are at most min(N, L) classes, so they always fit, and when there are fewer the rest is
  filled (where the budget is smaller than the batch, K is larger than the budget, never smaller);
* the positives of the rows are always active;
* candidates are taken in priority order (for ANN every row's best, then every row's second
  best, ...), duplicates and positives skipped, at most ``ceil(candidate_share * (K - positives))``
  of them; what did not fit is counted as cut;
* the rest is filled with uniformly drawn classes (fill.py: one score per class on the device).

All of it is Partial FC's score-and-topk pattern: one score per class of the shard (3 for a
positive, 2 for a kept candidate, a uniform draw in [0, 1) otherwise), then ``topk(K)``. A class has
one score, so duplicates cost nothing; the K winners are sorted, and each row's target column is
read from an (L+1,) map (the extra slot is a sink for rows whose class is elsewhere). The counts
(positives, retrieved, kept, cut, fill) stay on the device until they are read (:class:`Stats`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ds_xc.sampling.fill import FillStream

__all__ = ["active_size", "core_size", "assemble", "Assembled", "Stats"]

POSITIVE, KEPT = 3.0, 2.0  # scores above every uniform draw in [0, 1)


def active_size(budget: int, rows: int, num_local: int) -> int:
    """K = max(budget, min(N, L)): room for every positive of N rows, at least the budget."""
    return min(int(num_local), max(int(budget), int(rows)))


def core_size(size: int, rows: int, num_local: int, candidate_share: float) -> int:
    """A static bound on positives + kept candidates among K = ``size`` active classes: the first C
    of the ranked winners hold them all (min(N, L) positives at most, ceil(share * K) candidates)."""
    cap = size if candidate_share >= 1.0 else math.ceil(candidate_share * size)
    return min(int(size), min(int(rows), int(num_local)) + cap)


class Stats:
    """The counts of one assembly, kept as device tensors (no host sync when a step makes them) or
    as a function that computes one when read; :meth:`read` turns them into Python ints, for logging."""

    def __init__(self, **counts):
        self._counts = counts  # name -> int, 0-dim tensor or a function returning either

    def read(self) -> dict:
        return {k: int(v() if callable(v) else v) for k, v in self._counts.items()}

    @staticmethod
    def total(parts: list) -> "Stats":
        """The sums over several assemblies (sample groups)."""
        if len(parts) == 1:
            return parts[0]
        return Stats(**{k: (lambda k=k: sum(p.read()[k] for p in parts)) for k in parts[0]._counts})


@dataclass
class Assembled:
    index: torch.Tensor  # (K,) sorted local ids
    targets: torch.Tensor  # (N,) column of each row's class in index, -1 elsewhere
    stats: Stats
    core: Optional[torch.Tensor] = None  # (C,) local ids: every positive and kept candidate, then other winners


def _slots(local: torch.Tensor, mine: torch.Tensor, num_local: int) -> torch.Tensor:
    """(N,) each row's class on this shard, or the sink slot L for rows whose class is elsewhere."""
    return torch.where(mine, local, num_local)


def assemble(local: torch.Tensor, mine: torch.Tensor, num_local: int, size: int, fill: FillStream,
             candidates: Optional[torch.Tensor] = None, candidate_share: float = 1.0,
             core: int = 0) -> Assembled:
    """The active set of K = ``size`` classes (see the module docstring).

    local (N,) the rows' labels minus the shard's first class, mine (N,) whether on this shard;
    candidates (E,) local ids in priority order (-1: none) or None; ``core`` > 0 also returns ``core``
    winners that include every positive and kept candidate (:func:`_core`).
    """
    device = local.device
    slots = _slots(local, mine, num_local)  # (N,)
    scores = fill.scores(torch.empty(num_local + 1, dtype=torch.float32, device=device))  # (L+1,)
    scores.index_fill_(0, slots, POSITIVE)
    if candidates is not None:  # the cap on candidates needs the count of distinct positives now
        positives = (scores[:num_local] == POSITIVE).sum()  # ()
        counts = {"active": size, "positives": positives}
        counts.update(_keep_candidates(scores, candidates, num_local, size, positives, candidate_share))
        counts["fill"] = size - positives - counts["kept"]
    else:  # counted when read (a log line), not in the step
        def distinct():
            return int(torch.unique(slots[slots < num_local]).numel())
        counts = {"active": size, "positives": distinct, "retrieved": 0, "kept": 0, "cut": 0,
                  "fill": lambda: size - distinct()}
    top = torch.topk(scores[:num_local], size, sorted=False)  # (K,) winners
    index = top.indices.sort().values  # (K,)
    column = torch.full((num_local + 1,), -1, dtype=torch.int64, device=device)  # (L+1,) class -> column
    column.index_copy_(0, index, torch.arange(size, device=device))
    out = Assembled(index=index, targets=column.index_select(0, slots), stats=Stats(**counts))
    if core > 0:
        out.core = _core(top, core)
    return out


def _core(top, core: int) -> torch.Tensor:
    """(C,) ids holding every positive and kept candidate among the winners (scores >= KEPT), first, in
    a static size: their places by a running count (no sort), the rest of the C slots other winners."""
    keep = top.values >= KEPT  # (K,)
    out = torch.empty(core + 1, dtype=torch.int64, device=keep.device)  # slot C: a sink for the others
    out[:core] = top.indices[:core]
    out.scatter_(0, torch.where(keep, torch.cumsum(keep, 0) - 1, core), top.indices)
    return out[:core]


def _keep_candidates(scores: torch.Tensor, candidates: torch.Tensor, num_local: int, size: int,
                     positives: torch.Tensor, share: float) -> dict:
    """Mark the kept candidates' scores KEPT: the first appearance of each non-positive class in
    priority order, the first ``cap`` of them; returns the counts (device tensors)."""
    e = candidates.reshape(-1)  # (E,) in priority order
    num = e.numel()
    slots = torch.where(e >= 0, e, num_local)  # (E,) -1 -> the sink
    order = torch.arange(num, device=e.device)
    first = torch.full((num_local + 1,), num, dtype=torch.int64, device=e.device)
    first.scatter_reduce_(0, slots, order, reduce="amin")  # (L+1,) each class's first entry
    new = (first.index_select(0, slots) == order) & (scores.index_select(0, slots) < POSITIVE) & (e >= 0)  # (E,)
    ordinal = torch.cumsum(new, 0)  # (E,) 1-based rank among the distinct new candidates
    room = size - positives
    cap = room if share >= 1.0 else torch.ceil(room.double() * share).long()  # as math.ceil in float64
    keep = new & (ordinal <= cap)
    scores.index_fill_(0, torch.where(keep, slots, num_local), KEPT)
    retrieved = ordinal[-1] if num else torch.zeros((), dtype=torch.int64, device=e.device)
    kept = torch.minimum(retrieved, cap)
    return {"retrieved": retrieved, "kept": kept, "cut": retrieved - kept}

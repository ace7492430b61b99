"""Weight imprinting (Qi et al., CVPR 2018): a new class's row from its samples' embeddings.

The imprinted row of class c is the normalised mean of the normalised embeddings of c's
training samples, ``w_c = normalize(mean_i normalize(x_i))``; the caller scales it to the
old rows' typical norm (launch/grow.py: the median row norm of the checkpoint's old rows).

Class-parallel: every rank embeds its own part of the samples and accumulates per-class sums
of its new-class rows; the (sum, count) of each class is then reduced to the one rank that
owns the class among the new classes (contiguous ranges, Partial FC's split of the K new
classes over the P ranks of ``group``, a range may be empty when K < P). One reduce per
owner on the group the caller names; memory per rank is one owner's (K_o, d + 1) block.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ds_xc.parallel.groups import group_rank, group_ranks, group_size, is_distributed

__all__ = ["ImprintSums", "imprint_rows", "new_class_range"]


def new_class_range(num_new: int, world_size: int, rank: int) -> tuple[int, int]:
    """(offset, count) of the new classes that ``rank`` owns: ``K // P + (rank < K % P)`` contiguous
    classes, counted from the first new class (empty ranges allowed, unlike the head's split)."""
    if num_new < 0 or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"new_class_range: num_new={num_new}, world_size={world_size}, rank={rank}; expected "
                         "num_new >= 0, world_size >= 1 and 0 <= rank < world_size")
    base, extra = divmod(num_new, world_size)
    return rank * base + min(rank, extra), base + (rank < extra)


class ImprintSums:
    """This rank's float64 per-class sums of normalised embeddings of new classes [first, num_classes).

    ``add(emb, labels)`` keeps the rows whose label is a new class (others are ignored): emb (B, d),
    labels (B,). Summing in float64 makes the result independent of how the samples were split.
    """

    def __init__(self, first: int, num_classes: int, dim: int):
        if not 0 <= first < num_classes:
            raise ValueError(f"imprinting: first new class {first} must be in [0, num_classes={num_classes})")
        self.first, self.num_classes, self.dim = int(first), int(num_classes), int(dim)
        self.sums = torch.zeros(num_classes - first, dim + 1, dtype=torch.float64)  # (K, d + 1): sums, count

    def add(self, emb: torch.Tensor, labels: torch.Tensor) -> int:
        """Accumulate the new-class rows of a batch; returns how many there were."""
        if emb.dim() != 2 or emb.shape[1] != self.dim or labels.shape != emb.shape[:1]:
            raise ValueError(f"imprinting: embeddings {tuple(emb.shape)} and labels {tuple(labels.shape)}; "
                             f"expected (B, {self.dim}) and (B,)")
        labels = labels.to(torch.int64).cpu()
        keep = (labels >= self.first) & (labels < self.num_classes)
        if not bool(keep.any()):
            return 0
        x = F.normalize(emb.detach().cpu()[keep].double(), dim=1)  # (n, d)
        rows = torch.cat([x, torch.ones(x.shape[0], 1, dtype=torch.float64)], 1)  # (n, d + 1)
        self.sums.index_add_(0, labels[keep] - self.first, rows)
        return int(keep.sum())


def imprint_rows(sums: ImprintSums, group) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Reduce the sums of every rank to the owners; returns this rank's (first class id, unit rows
    (K_o, d) float64, sample counts (K_o,) int64). A class without samples gets a zero row and count 0
    (the caller initialises it otherwise). Collective over ``group`` (every rank calls it)."""
    world, rank = group_size(group), group_rank(group)
    num_new = sums.sums.shape[0]
    mine = None
    members = group_ranks(group) if is_distributed(group) else [0]
    for owner in range(world):
        off, count = new_class_range(num_new, world, owner)
        block = sums.sums[off: off + count].clone()  # (K_o, d + 1)
        if is_distributed(group) and count:
            dist.reduce(block, dst=members[owner], op=dist.ReduceOp.SUM, group=group)
        if owner == rank:
            mine = (off, block)
    off, block = mine
    counts = block[:, -1]
    rows = block[:, :-1] / counts.clamp_min(1.0)[:, None]  # (K_o, d) mean of unit embeddings
    rows = F.normalize(rows, dim=1)  # zero rows (no sample) stay zero
    return sums.first + off, rows, counts.round().to(torch.int64)

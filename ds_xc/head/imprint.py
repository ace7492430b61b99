"""Weight imprinting (Qi et al., CVPR 2018): a new class's row from its samples' embeddings.

The imprinted row of class c is the normalised mean of the normalised embeddings of c's
training samples, ``mu_c = normalize(mean_i normalize(x_i))``; the caller scales it to the
old rows' typical norm (launch/grow.py: the median row norm of the checkpoint's old rows).

Calibration (``calibrate=True``, used when old-class statistics were added): a class mean is
the direction of highest mean cosine with its own samples, so a pure imprinted row is more
confident than a trained row (whose samples' mean cosine with it is a_old < a_new) and takes
old classes' samples. Each imprinted row is turned away from the embeddings by the angle that
brings its own-class mean cosine down to the old rows' a_old,
``w_c = k * mu_c + sqrt(1 - k^2) * r_c`` with ``k = min(1, a_old / a_new)`` and r_c the unit
direction of least variance of the embeddings (the smallest eigenvector of their second moment)
made orthogonal to mu_c: every cosine of the row with an embedding then shrinks by about k, i.e.
its logits get the temperature of an old class.

Class-parallel: every rank embeds its own part of the samples and accumulates per-class sums
of its new-class rows; the (sum, count) of each class is then reduced to the one rank that
owns the class among the new classes (contiguous ranges, Partial FC's split of the K new
classes over the P ranks of ``group``, a range may be empty when K < P). One reduce per
owner on the group the caller names; memory per rank is one owner's (K_o, d + 1) block.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ds_xc.parallel.groups import comm_device, group_rank, group_ranks, group_size, is_distributed

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
    ``device``: where the sums live (the rank's device; None: the CPU); embeddings and rows are moved
    there. :func:`imprint_rows` reduces them on the group's communication device.
    """

    def __init__(self, first: int, num_classes: int, dim: int, device=None):
        if not 0 <= first < num_classes:
            raise ValueError(f"imprinting: first new class {first} must be in [0, num_classes={num_classes})")
        self.first, self.num_classes, self.dim = int(first), int(num_classes), int(dim)
        self.device = torch.device("cpu") if device is None else torch.device(device)
        f64 = dict(dtype=torch.float64, device=self.device)
        self.sums = torch.zeros(num_classes - first, dim + 1, **f64)  # (K, d + 1): sums, count
        self.moment = torch.zeros(dim, dim, **f64)  # sum of x x^T of the unit embeddings added
        self.old = torch.zeros(2, **f64)  # sum of cos(old row, its sample), samples

    def add_old(self, emb: torch.Tensor, rows: torch.Tensor) -> None:
        """Old-class samples for the calibration: emb (n, d) and their classes' trained rows (n, d)."""
        if emb.shape != rows.shape or emb.dim() != 2 or emb.shape[1] != self.dim:
            raise ValueError(f"imprinting: old-class embeddings {tuple(emb.shape)} and rows {tuple(rows.shape)}; "
                             f"expected two (n, {self.dim}) tensors")
        x = F.normalize(emb.detach().to(self.device, torch.float64), dim=1)  # (n, d)
        cos = (x * F.normalize(rows.detach().to(self.device, torch.float64), dim=1)).sum()
        self.old[0] += cos
        self.old[1] += x.shape[0]
        self.moment += x.t() @ x

    def add(self, emb: torch.Tensor, labels: torch.Tensor) -> int:
        """Accumulate the new-class rows of a batch; returns how many there were."""
        if emb.dim() != 2 or emb.shape[1] != self.dim or labels.shape != emb.shape[:1]:
            raise ValueError(f"imprinting: embeddings {tuple(emb.shape)} and labels {tuple(labels.shape)}; "
                             f"expected (B, {self.dim}) and (B,)")
        labels = labels.to(self.device, torch.int64)
        keep = (labels >= self.first) & (labels < self.num_classes)
        count = int(keep.sum())
        if not count:
            return 0
        x = F.normalize(emb.detach().to(self.device)[keep].double(), dim=1)  # (n, d)
        rows = torch.cat([x, x.new_ones(x.shape[0], 1)], 1)  # (n, d + 1)
        self.sums.index_put_((labels[keep] - self.first,), rows, accumulate=True)  # deterministic on CUDA too
        self.moment += x.t() @ x
        return count


def imprint_rows(sums: ImprintSums, group, calibrate: bool = True) -> tuple[int, torch.Tensor, torch.Tensor, dict]:
    """Reduce the sums of every rank to the owners; returns this rank's (first class id, unit rows
    (K_o, d) float64, sample counts (K_o,) int64, {"kappa", "a_old", "a_new"}). A class without
    samples gets a zero row and count 0 (the caller initialises it otherwise). Calibrated when
    ``calibrate`` and old-class samples were added (module docstring). Collective over ``group``."""
    world, rank = group_size(group), group_rank(group)
    num_new = sums.sums.shape[0]
    mine = None
    members = group_ranks(group) if is_distributed(group) else [0]
    comm = comm_device(group)  # NCCL: this rank's GPU; gloo: the CPU
    for owner in range(world):
        off, count = new_class_range(num_new, world, owner)
        block = sums.sums[off: off + count].to(comm, copy=True)  # (K_o, d + 1)
        if is_distributed(group) and count:
            dist.reduce(block, dst=members[owner], op=dist.ReduceOp.SUM, group=group)
        if owner == rank:
            mine = (off, block.to(sums.device))
    off, block = mine
    counts = block[:, -1]
    mu = F.normalize(block[:, :-1], dim=1)  # (K_o, d) normalised class means; zero rows (no sample) stay zero
    # global statistics: old rows' own-class cosine, new means' (sum_c |sum_c| / n), the second moment
    stats = torch.cat([sums.old, torch.stack([block[:, :-1].norm(dim=1).sum(), counts.sum()]),
                       sums.moment.flatten()]).to(comm)  # (4 + d * d,)
    if is_distributed(group):
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
    stats = stats.cpu()  # a few numbers and the (d, d) moment, read on the host below
    a_old = float(stats[0] / stats[1]) if stats[1] > 0 else float("nan")
    a_new = float(stats[2] / stats[3]) if stats[3] > 0 else float("nan")
    kappa = min(1.0, a_old / a_new) if calibrate and stats[1] > 0 and a_new > 0 else 1.0
    if kappa < 1.0:
        mu = _turn(mu, stats[4:].view(sums.dim, sums.dim).to(mu.device), kappa)
    return sums.first + off, mu, counts.round().to(torch.int64), {"kappa": kappa, "a_old": a_old, "a_new": a_new}


def _turn(mu: torch.Tensor, moment: torch.Tensor, kappa: float) -> torch.Tensor:
    """k * mu + sqrt(1 - k^2) * r, r the least-variance direction made orthogonal to each row of mu
    (K_o, d); the next eigenvector where the first is (nearly) parallel to a row; zero rows stay zero."""
    _, vecs = torch.linalg.eigh(moment)  # ascending eigenvalues: column 0 the least variance
    vecs = vecs * vecs.gather(0, vecs.abs().argmax(0, keepdim=True)).sign()  # a fixed sign: largest entry > 0
    out = mu.clone()
    for j in range(min(2, vecs.shape[1])):
        r = vecs[:, j].expand_as(mu)
        r = r - (r * mu).sum(1, keepdim=True) * mu  # (K_o, d) orthogonal to each mean
        ok = (r.norm(dim=1) > 1e-3) & (mu.norm(dim=1) > 0) & (out.eq(mu).all(1) if j else True)
        turned = kappa * mu + math.sqrt(1.0 - kappa * kappa) * F.normalize(r, dim=1)
        out[ok] = turned[ok]
    return out

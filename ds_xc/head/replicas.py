"""The replica dimension of a 2-D head layout: one class shard held by several ranks.

``ClassParallelHead(..., group=class_group, replica_group=data_group)`` shards the classes
over ``class_group`` (Pc ranks) and replicates each shard over ``replica_group`` (Pr ranks,
one per class group, all holding the same class rank). The world is Pc x Pr ranks, each
with its own rows; the global batch is the union of all of them (docs/head.md, "2-D layout").

Legend: n rows of this rank's class group (its all-gathered batch), N = sum of n over the
replica group (the global batch), Pr replicas, d embedding dim, R gradient rows.

What this module adds to a step (the class group's work is the 1-D head's, unchanged):

* :meth:`Replicas.agree_rows`: one (3,) all-reduce over the replica group of
  [n, skipped, failed], so every class group learns N and whether another one skips the
  step (non-finite input) or raised (bad input): nobody waits in a collective that a
  failed group never enters.
* :meth:`Replicas.global_mean`: the class group's weighted sum of its rows' losses is divided by
  the global batch's weight (N rows, less the ignored, times the sample weights), which rides
  with that sum in one all-reduce over the replica group (so the embedding and weight gradients
  are those of the global mean); its value is the global mean, the same on every rank
  (:meth:`Replicas.global_sum` for reduction "sum").
* :meth:`Replicas.reduce_grad_`: the shard gradients of the replicas summed (each is
  already the gradient of its n / N share, so the sum is the global mean's gradient; with
  equal batches the mean of the replicas' local-mean gradients). A row-sparse gradient
  (sampled heads, lazy updates: the active rows differ between replicas) becomes the union
  of the replicas' rows: indices and values all-gathered in replica order and coalesced
  (duplicates summed), the same bits on every replica, so every replica's optimizer applies
  the identical update and keeps identical state. ``build_head_optimizer`` runs it as a
  step pre-hook of the head optimizer; with another optimizer, call it before ``step()``.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist

from ds_xc.head.row_terms import mean_of
from ds_xc.parallel.collectives import all_gather_no_grad, gather_stacked
from ds_xc.parallel.groups import group_rank, group_ranks, group_size, is_distributed, resolve_group

log = logging.getLogger(__name__)

__all__ = ["Replicas"]


class Replicas:
    """The replica group of a head shard (``group=None``: no replicas, every method a no-op)."""

    def __init__(self, group=None):
        self.group = None if group is None else resolve_group(group)  # None: no replica dimension
        self.active = self.group is not None and is_distributed(self.group)
        self.rank = group_rank(self.group) if self.active else 0
        self.size = group_size(self.group) if self.active else 1

    def describe(self) -> str:
        return f"replica {self.rank}/{self.size} (world ranks {group_ranks(self.group)})" if self.active else ""

    def sampler_rank(self, class_rank: int, class_size: int) -> int:
        """The rank that seeds this rank's sampler stream: replicas of a shard draw their own
        negatives (the class rank itself without replicas, as in 1-D)."""
        return class_rank + class_size * self.rank

    # ------------------------------------------------------------------ the step
    def agree_rows(self, rows: Optional[int], failed: bool = False, device=None) -> Optional[int]:
        """N, the rows of the global batch, from this class group's ``rows`` (None: it skips the
        step); None when any class group skips. ``failed``: this group raised its input error and
        only tells the others, which raise too. Collective over the replica group."""
        if not self.active:
            return rows
        t = torch.tensor([rows or 0, rows is None, failed], dtype=torch.int64, device=device)  # (3,)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        total, skipped, failures = t.tolist()
        if failures and not failed:
            raise ValueError(f"bad input in {failures} other class group(s) of the replica group of world ranks "
                             f"{group_ranks(self.group)} (replica {self.rank}); see the error on those ranks")
        return None if skipped else int(total)

    def global_mean(self, total: torch.Tensor, weight_sum: torch.Tensor) -> torch.Tensor:
        """The class group's weighted sum ``total`` of its rows' losses and their weight ``weight_sum``
        (rows for an unweighted batch; ignored rows weigh 0) -> the global-batch mean: one all-reduce of
        [total, weight] over the replica group; the value is sum total / sum weight, the gradients those
        of total / sum weight (the group's share). NaN without gradients when every row is ignored."""
        if not self.active:
            return mean_of(total, weight_sum)
        both = torch.stack([total.detach(), weight_sum.to(total.dtype)])  # (2,)
        dist.all_reduce(both, op=dist.ReduceOp.SUM, group=self.group)
        part = mean_of(total, both[1])
        return part + (mean_of(both[0], both[1]) - part.detach())

    def global_sum(self, total: torch.Tensor) -> torch.Tensor:
        """The class group's sum ``total`` -> the global batch's (the value all-reduced over the replica
        group, the gradients those of the group's own rows)."""
        if not self.active:
            return total
        value = total.detach().clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.group)
        return total + (value - total.detach())

    @torch.no_grad()
    def reduce_grad_(self, weight: torch.Tensor) -> None:
        """Sum ``weight.grad`` over the replica group, in place (dense: one all-reduce; row-sparse:
        the coalesced union of the replicas' rows). A replica without a gradient counts as zero.
        Collective over the replica group: every replica calls it at the same steps."""
        if not self.active:
            return
        g = weight.grad
        sparse = g is not None and g.is_sparse and g.sparse_dim() == 1
        if sparse:
            g = g.coalesce()
        rows = g.indices().shape[1] if sparse else 0
        flags = torch.tensor([[g is not None, sparse, rows]], dtype=torch.int64, device=weight.device)
        table = gather_stacked(flags, self.group).view(self.size, 3).tolist()  # (Pr, 3)
        if not any(r[0] for r in table):
            return
        if all(r[1] for r in table if r[0]):  # every present gradient row-sparse: the union of rows
            weight.grad = self._union(weight, g, [r[2] for r in table])
            return
        dense = torch.zeros_like(weight) if g is None else (g.to_dense() if g.is_sparse else g)
        dense = dense.contiguous()
        dist.all_reduce(dense, op=dist.ReduceOp.SUM, group=self.group)
        weight.grad = dense

    def _union(self, weight: torch.Tensor, g, sizes: list) -> torch.Tensor:
        """The replicas' row-sparse gradients (R_r rows each) as one coalesced (L, d) sparse tensor:
        the same input in the same (replica) order on every rank, so the same bits."""
        d = weight.shape[1]
        if g is None:
            idx = torch.zeros(0, dtype=torch.int64, device=weight.device)
            val = torch.zeros((0, d), dtype=weight.dtype, device=weight.device)
        else:
            idx, val = g.indices()[0], g.values()  # (R,), (R, d)
        every = sizes if len(set(sizes)) > 1 else None
        idx_all = all_gather_no_grad(idx.contiguous(), self.group, every)  # (sum R_r,)
        val_all = all_gather_no_grad(val.contiguous(), self.group, every)  # (sum R_r, d)
        return torch.sparse_coo_tensor(idx_all[None], val_all, tuple(weight.shape)).coalesce()

    # ------------------------------------------------------------------ checkpoints
    def gather_states(self, state: dict) -> Optional[list]:
        """Every replica's ``state`` (a sampler's state dict), in replica order, on every replica;
        None without replicas. Collective over the replica group."""
        if not self.active:
            return None
        out: list = [None] * self.size
        dist.all_gather_object(out, state, group=self.group)
        return out

    def restore_sampler(self, sampler, saved: Optional[list]) -> None:
        """After a shard is loaded (its sampler state is replica 0's): a checkpoint of the same
        replica count gives each replica its own saved stream back; otherwise replicas > 0 derive
        a fresh stream from the loaded one and their replica rank (deterministic)."""
        if not self.active:
            return
        if saved is not None and len(saved) == self.size:
            sampler.load_state_dict(saved[self.rank])
        elif self.rank > 0:
            sampler.fill.derive(1_000_003 * self.rank)
            log.info("replica %d: the checkpoint holds %s replica sampler streams; a fresh stream is derived",
                     self.rank, "no" if saved is None else len(saved))

"""The topology-aware all-reduce: reduce-scatter inside a node, rank-aligned all-reduce across
nodes, all-gather inside the node (the scheme of EFLOPS, docs/papers.md).

With L ranks on each of N nodes, a flat tensor of n elements is padded to L*s (s = ceil(n/L)),
summed inside the node by a reduce-scatter (local rank i keeps shard i, (s,)), shard i is
all-reduced among the N ranks with local index i (one per node: the inter-node step is L
disjoint rings of N ranks, one per local index, each carrying 1/L of the data, instead of one
ring of N*L ranks whose every hop may cross a node boundary), and the node all-gathers the shards
back to (L*s,). Each rank sends 2(L-1)s bytes inside its node and 2(N-1)s/N across nodes;
a flat ring all-reduce over N*L ranks sends about 2n per rank, much of it across nodes.

The sum is the same as the flat one up to the order of the additions (bitwise when the
values add exactly, e.g. integers; within float rounding otherwise). :class:`PendingHierarchical`
runs the three stages asynchronously: :meth:`~PendingHierarchical.progress` moves a bucket to
its next stage when the current one has completed, without blocking, so the bucketed reducer
(ds_xc/parallel/buckets.py) can keep several buckets in flight during the backward. The two
intra-node stages use two groups (``intra`` and ``intra_gather``), so reduce-scatters and
all-gathers of different buckets are issued in bucket order on each group on every rank.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ds_xc.parallel.collectives import gather_flat, reduce_scatter_flat
from ds_xc.parallel.groups import node_groups, world_rank_and_size
from ds_xc.parallel.topology import NodeLayout

log = logging.getLogger(__name__)

__all__ = ["HierarchicalAllReduce", "PendingHierarchical"]


class HierarchicalAllReduce:
    """Sum or mean of flat tensors over every rank of ``layout`` (the world), node by node.

    Collective to build (every rank creates the node groups: ds_xc.parallel.groups.node_groups);
    ``layout`` must be regular (the same number of ranks on every node)."""

    def __init__(self, layout: NodeLayout, backend=None):
        if not layout.regular:
            raise ValueError(f"HierarchicalAllReduce: {layout.describe()} is not regular (every node must hold "
                             "the same number of ranks)")
        self.layout = layout
        self.node, self.local_rank = layout.locate(world_rank_and_size()[0])
        self.local_size, self.num_nodes = layout.ranks_per_node, layout.num_nodes
        self.world = self.local_size * self.num_nodes
        self.intra, self.intra_gather, self.inter = node_groups(layout.nodes, backend)
        log.info("hierarchical all-reduce: %s, this rank node %d local %d", layout.describe(), self.node,
                 self.local_rank)

    def sum_(self, tensor: torch.Tensor, async_op: bool = False) -> "PendingHierarchical":
        """``tensor`` (contiguous) becomes its sum over every rank, in place (after ``wait()`` with ``async_op``)."""
        return PendingHierarchical(self, tensor, 1, async_op)

    def mean_(self, tensor: torch.Tensor, async_op: bool = False) -> "PendingHierarchical":
        """``tensor`` becomes its mean over every rank (the sum, then / P), in place."""
        return PendingHierarchical(self, tensor, self.world, async_op)


class PendingHierarchical:
    """One hierarchical all-reduce in flight: stage 0 reduce-scatter, 1 all-reduce, 2 all-gather, 3 done."""

    def __init__(self, h: HierarchicalAllReduce, tensor: torch.Tensor, divide: int, async_op: bool):
        if not tensor.is_contiguous():
            raise ValueError("HierarchicalAllReduce: the tensor must be contiguous (it is reduced in place)")
        self.h, self.tensor, self.divide = h, tensor, int(divide)
        flat = tensor.view(-1)
        n, L = flat.numel(), h.local_size
        s = -(-n // L)  # shard length; the last shards are padded with zeros
        self.padded = flat
        if n != L * s:
            self.padded = flat.new_zeros(L * s)  # (L*s,)
            self.padded[:n] = flat
        self.shard = self.padded if L == 1 else self.padded.new_empty(s)  # (s,)
        self.stage, self.work = -1, None
        self._advance(0)
        if not async_op:
            self.wait()

    def _advance(self, limit: int = 3) -> None:
        """Issue the next stages up to ``limit`` (the current one has completed); skip stages without a group."""
        h = self.h
        while self.work is None and self.stage < min(limit, 3):
            self.stage += 1
            if self.stage == 0 and h.intra is not None:
                self.work = reduce_scatter_flat(self.shard, self.padded, group=h.intra, async_op=True)
            elif self.stage == 1 and h.inter is not None:
                self.work = dist.all_reduce(self.shard, op=dist.ReduceOp.SUM, group=h.inter, async_op=True)
            elif self.stage == 2:
                if self.divide != 1:  # the division on the shard: s elements instead of n, the same values
                    self.shard.div_(self.divide)
                if h.intra_gather is not None:
                    self.work = gather_flat(self.padded, self.shard, group=h.intra_gather, async_op=True)
            elif self.stage == 3 and self.padded.data_ptr() != self.tensor.data_ptr():
                self.tensor.view(-1).copy_(self.padded[: self.tensor.numel()])

    def progress(self, limit: int = 3) -> int:
        """Move on as far as the completed stages allow, without blocking, issuing no stage past ``limit``;
        returns the stage issued last. Several reductions in flight: pass each the previous one's return
        value, so that every group sees its stages in the same order on every rank."""
        while True:
            if self.work is not None:
                if not self.work.is_completed():
                    break
                self.work.wait()
                self.work = None
            before = self.stage
            self._advance(limit)
            if self.stage == before:
                break
        return self.stage

    def wait(self, waiter: Optional[Callable] = None) -> torch.Tensor:
        """Complete every stage (each wait through ``waiter(work)`` when given, e.g. to time it); the tensor."""
        while self.stage < 3 or self.work is not None:
            if self.work is not None:
                waiter(self.work) if waiter is not None else self.work.wait()
                self.work = None
            self._advance()
        return self.tensor


"""The topology-aware all-reduce: reduce-scatter inside a node, rank-aligned all-reduce across
nodes, all-gather inside the node (the scheme of EFLOPS, docs/papers.md).

With L ranks on each of N nodes, a flat tensor of n elements is padded to L*s (s = ceil(n/L)),
summed inside the node by a reduce-scatter (local rank i keeps shard i, (s,)), shard i is
all-reduced among the N ranks with local index i (one per node: the inter-node step is L
disjoint rings of N ranks, one per local index, each carrying 1/L of the data, instead of one
ring of N*L ranks whose every hop may cross a node boundary), and the node all-gathers the shards
back to (L*s,). Each rank sends 2(L-1)s bytes inside its node and 2(N-1)s/N across nodes: a
node's link carries 2(N-1)n/N, where a flat ring over N*L ranks puts 2(N*L-1)n/(N*L) on it.

The node stages have three implementations (``intra_mode``), equal in value:

- ``alltoall`` (gloo's default): the reduce-scatter is an ``all_to_all_single`` of the padded
  chunk (rank j receives block j of every node rank, (L, s)) followed by a local sum over the L
  blocks in local-rank order, and the all-gather is gloo's list ``all_gather`` into views of the
  padded chunk. Each rank sends (L-1)s elements per stage, the reduce-scatter's minimum. (gloo's
  ``reduce_scatter_single`` took as long as an all-reduce here, torch 2.13; docs/multinode.md.)
- ``allreduce``: the node's reduce-scatter is an all-reduce of the chunk whose shard i is kept and
  the all-gather an all-reduce of a buffer holding only this rank's shard (zeros elsewhere: adding
  zeros is exact); 2(L-1)s per stage, twice the bytes. Kept for comparison (the benchmark).
- ``native`` (other backends): ``reduce_scatter_single`` and ``all_gather_single``.

Tensors are cut into chunks of ``chunk_numel`` that are pipelined: chunk k+1's node stage runs
while chunk k crosses the nodes. :class:`PendingHierarchical` runs one chunk's three stages
asynchronously; :meth:`~PendingHierarchical.progress` moves it on when the current stage has
completed, without blocking, never past the stage of the chunk issued before it, so that every
group sees the same sequence of collectives on every rank. The two intra-node stages use two
groups (``intra`` and ``intra_gather``) for the same reason. The sum is the flat one up to the
order of the additions (bitwise when the values add exactly, e.g. integers).
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

__all__ = ["HierarchicalAllReduce", "PendingHierarchical", "PendingChunks", "INTRA_MODES"]

DONE = 3
INTRA_MODES = ("alltoall", "allreduce", "native")


class HierarchicalAllReduce:
    """Sum or mean of flat tensors over every rank of ``layout`` (the world), node by node.

    Collective to build (every rank creates the node groups: ds_xc.parallel.groups.node_groups);
    ``layout`` must be regular (the same number of ranks on every node). ``chunk_numel``: the
    pipelining granularity (0: one chunk). ``intra_mode``: how the node stages run (module docstring;
    None: ``alltoall`` on gloo, ``native`` elsewhere)."""

    def __init__(self, layout: NodeLayout, backend=None, chunk_numel: int = 1 << 20,
                 intra_mode: Optional[str] = None):
        if not layout.regular:
            raise ValueError(f"HierarchicalAllReduce: {layout.describe()} is not regular (every node must hold "
                             "the same number of ranks)")
        self.layout, self.chunk_numel = layout, int(chunk_numel)
        self.node, self.local_rank = layout.locate(world_rank_and_size()[0])
        self.local_size, self.num_nodes = layout.ranks_per_node, layout.num_nodes
        self.world = self.local_size * self.num_nodes
        self.intra, self.intra_gather, self.inter = node_groups(layout.nodes, backend)
        if intra_mode is None:
            intra_mode = "alltoall" if self.intra is None or dist.get_backend(self.intra) == "gloo" else "native"
        if intra_mode not in INTRA_MODES:
            raise ValueError(f"HierarchicalAllReduce: intra_mode={intra_mode!r}; allowed: {', '.join(INTRA_MODES)}")
        self.intra_mode = intra_mode
        log.info("hierarchical all-reduce: %s, this rank node %d local %d, chunks of %d, node stages by %s",
                 layout.describe(), self.node, self.local_rank, self.chunk_numel, intra_mode)

    def sum_(self, tensor: torch.Tensor, async_op: bool = False) -> "PendingChunks":
        """``tensor`` (contiguous) becomes its sum over every rank, in place (after ``wait()`` with ``async_op``)."""
        return PendingChunks(self, tensor, 1, async_op)

    def mean_(self, tensor: torch.Tensor, async_op: bool = False) -> "PendingChunks":
        """``tensor`` becomes its mean over every rank (the sum, then / P), in place."""
        return PendingChunks(self, tensor, self.world, async_op)


class PendingHierarchical:
    """One chunk's hierarchical all-reduce in flight: stage 0 node reduce(-scatter), 1 all-reduce across
    nodes, 2 node all-gather, 3 done."""

    def __init__(self, h: HierarchicalAllReduce, flat: torch.Tensor, divide: int):
        self.h, self.flat, self.divide = h, flat, int(divide)
        n, L = flat.numel(), h.local_size
        s = -(-n // L)  # shard length; the last shard is padded with zeros
        self.padded = flat
        if n != L * s:
            self.padded = flat.new_zeros(L * s)  # (L*s,)
            self.padded[:n] = flat
        mine = self.padded[h.local_rank * s: (h.local_rank + 1) * s]  # (s,) a view
        self.shard = mine if (L == 1 or h.intra_mode != "native") else self.padded.new_empty(s)
        self.received = None  # alltoall: (L*s,) block j of every node rank, summed into the shard at stage 1
        self.stage, self.work = -1, None
        self._advance(0)

    @property
    def done(self) -> bool:
        return self.stage == DONE and self.work is None

    def _advance(self, limit: int = DONE) -> None:
        """Issue the next stages up to ``limit`` (the current one has completed); skip stages without a group."""
        h = self.h
        while self.work is None and self.stage < min(limit, DONE):
            self.stage += 1
            if self.stage == 0 and h.intra is not None:
                self.work = self._node_reduce()
            elif self.stage == 1:
                if self.received is not None:  # (L, s) summed over the node ranks, in local-rank order
                    torch.sum(self.received.view(h.local_size, -1), dim=0, out=self.shard)
                    self.received = None
                if h.inter is not None:
                    self.work = dist.all_reduce(self.shard, op=dist.ReduceOp.SUM, group=h.inter, async_op=True)
            elif self.stage == 2:
                if self.divide != 1:  # the division on the shard: s elements instead of n, the same values
                    self.shard.div_(self.divide)
                if h.intra_gather is not None:
                    self.work = self._node_gather()
            elif self.stage == DONE and self.padded.data_ptr() != self.flat.data_ptr():
                self.flat.copy_(self.padded[: self.flat.numel()])

    def _node_reduce(self):
        """Stage 0: the node's reduce-scatter of the padded chunk (this rank's shard summed over the node)."""
        h = self.h
        if h.intra_mode == "alltoall":
            self.received = torch.empty_like(self.padded)  # (L*s,)
            return dist.all_to_all_single(self.received, self.padded, group=h.intra, async_op=True)
        if h.intra_mode == "allreduce":
            return dist.all_reduce(self.padded, op=dist.ReduceOp.SUM, group=h.intra, async_op=True)
        return reduce_scatter_flat(self.shard, self.padded, group=h.intra, async_op=True)

    def _node_gather(self):
        """Stage 2: the node's all-gather of the shards back into the padded chunk."""
        h = self.h
        if h.intra_mode == "alltoall":  # gloo's list all-gather, into (s,) views of the chunk
            return dist.all_gather(list(self.padded.view(h.local_size, -1).unbind(0)), self.shard,
                                   group=h.intra_gather, async_op=True)
        if h.intra_mode == "allreduce":
            s = self.shard.numel()
            self.padded[: h.local_rank * s].zero_()
            self.padded[(h.local_rank + 1) * s:].zero_()
            return dist.all_reduce(self.padded, op=dist.ReduceOp.SUM, group=h.intra_gather, async_op=True)
        return gather_flat(self.padded, self.shard, group=h.intra_gather, async_op=True)

    def progress(self, limit: int = DONE) -> int:
        """Move on as far as the completed stages allow, without blocking, issuing no stage past ``limit``;
        returns the stage issued last."""
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

    def wait_current(self, waiter: Optional[Callable] = None) -> None:
        """Block until the stage in flight has completed (through ``waiter(work)`` when given)."""
        if self.work is not None:
            waiter(self.work) if waiter is not None else self.work.wait()
            self.work = None


class PendingChunks:
    """A tensor's hierarchical all-reduce, as a pipeline of chunks (:class:`PendingHierarchical`)."""

    def __init__(self, h: HierarchicalAllReduce, tensor: torch.Tensor, divide: int, async_op: bool):
        if not tensor.is_contiguous():
            raise ValueError("HierarchicalAllReduce: the tensor must be contiguous (it is reduced in place)")
        self.tensor = tensor
        flat = tensor.view(-1)
        step = h.chunk_numel if h.chunk_numel > 0 else max(flat.numel(), 1)
        self.chunks = [PendingHierarchical(h, flat[i: i + step], divide) for i in range(0, max(flat.numel(), 1), step)]
        if not async_op:
            self.wait()

    def progress(self, limit: int = DONE) -> int:
        """Progress every chunk in order (see :meth:`PendingHierarchical.progress`); the last chunk's stage,
        the limit for a reduction issued after this one."""
        for c in self.chunks:
            limit = c.progress(limit)
        return limit

    def wait(self, waiter: Optional[Callable] = None) -> torch.Tensor:
        """Complete every chunk (each blocking wait through ``waiter(work)`` when given); the tensor."""
        while self.progress() != DONE or not self.chunks[-1].done:
            next(c for c in self.chunks if not c.done).wait_current(waiter)
        return self.tensor

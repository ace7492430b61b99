"""The head's row exchange across nodes: a rank-aligned two-stage all-gather and its reduce-scatter.

The class-parallel head all-gathers every rank's (B_r, d) embeddings (and labels) to the global
batch (N, d) and, in the backward, reduce-scatters the (N, d) gradient back to (B_r, d). A flat
ring over P = nodes x L ranks forwards every block over P - 1 hops; with a node's ranks
consecutive in the ring, each node's link carries P - 1 blocks each way.

:class:`NodeGather` runs the exchange in two stages, rank-aligned as EFLOPS does for the
all-reduce (docs/papers.md, docs/multinode.md):

1. across nodes: each rank-aligned group (the ranks with the same local index on every node)
   all-gathers its members' blocks, so every block leaves its node once, on its own rank's flow
   (with one NIC per rank, on that rank's link): a node's links carry L (nodes - 1) blocks;
2. inside the node: the node's ranks all-gather what stage 1 gave them, so each holds every block.

The rows are then permuted into the flat gather's rank order, so the forward equals the flat
all-gather bit for bit. The backward runs the stages in reverse (reduce-scatter inside the node,
then among the rank-aligned ranks): the flat reduce-scatter's sum up to the order of the additions.
Bound on one link per node: (P - 1) / (L (nodes - 1)) fewer bytes, 1.5 for 2 x 2; one NIC per rank:
(P - 1) / (nodes - 1), 3 for 2 x 2; two latency rounds of nodes - 1 and L - 1 hops instead of P - 1.

Blocks of different lengths are padded by the one padding rule (:class:`PaddedGather`,
:class:`PaddedReduceScatter`); every rank's B_r must be known (``sizes``), as for the flat gather.
The group must span the world (torch creates groups with every rank of the world) and the layout
be regular (the same number of ranks on every node).
"""
from __future__ import annotations

import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ds_xc.parallel.collectives import PaddedGather, PaddedReduceScatter, scale_grad
from ds_xc.parallel.groups import block_groups, group_ranks, group_size, resolve_group, spans_world, \
    world_rank_and_size
from ds_xc.parallel.topology import NodeLayout

__all__ = ["NodeGather", "node_gather_rows", "time_exchange"]


class NodeGather:
    """Two-stage all-gather / reduce-scatter of row blocks over ``group`` laid out as ``layout``.

    Collective to build (every rank of the world creates the node and rank-aligned groups,
    :func:`ds_xc.parallel.groups.block_groups`). ``layout``: the node layout of ``group``
    (:func:`ds_xc.parallel.topology.detect_layout`), regular, covering every rank of ``group``.
    """

    def __init__(self, layout: NodeLayout, group=None, backend=None):
        group = resolve_group(group)
        members = group_ranks(group)  # world ranks in group-rank order
        if not layout.regular:
            raise ValueError(f"NodeGather: {layout.describe()} is not regular (every node must hold the same number "
                             "of ranks)")
        if sorted(r for node in layout.nodes for r in node) != sorted(members):
            raise ValueError(f"NodeGather: the layout's ranks {layout.nodes} are not the group's {members}")
        if not spans_world(group):
            raise ValueError("NodeGather: the group must span the world (the node groups are created by every rank "
                             "of the world)")
        self.layout, self.world = layout, len(members)
        self.intra, self.aligned = block_groups(layout.nodes, backend)
        me = world_rank_and_size()[0]
        node, local = layout.locate(me)
        position = {w: i for i, w in enumerate(members)}  # world rank -> rank in `group`
        # torch orders a new group's ranks ascending: the stage groups' rank orders, as group ranks of `group`
        aligned_sets = [sorted(n[i] for n in layout.nodes) for i in range(layout.ranks_per_node)]
        node_members = sorted(layout.nodes[node])
        for handle, expected in ((self.intra, node_members), (self.aligned, aligned_sets[local])):
            if group_ranks(handle) != expected:
                raise RuntimeError(f"NodeGather: a stage group has ranks {group_ranks(handle)}, expected {expected}")
        self._aligned = [position[w] for w in aligned_sets[local]]  # stage 1's members, their order
        self._node = [[position[w] for w in aligned_sets[layout.locate(u)[1]]] for u in node_members]  # stage 2
        self.intra_rank, self.aligned_rank = node_members.index(me), aligned_sets[local].index(me)
        self._perm_key, self._perm = None, None

    def sizes_of(self, x: torch.Tensor, sizes: Optional[Sequence[int]]) -> list:
        """Every rank's row count: ``sizes``, or this rank's B for all (equal blocks)."""
        return [int(x.shape[0])] * self.world if sizes is None else [int(s) for s in sizes]

    def _plan(self, sizes: list, device) -> tuple:
        """(stage-1 sizes, stage-2 sizes, permutation stage order -> rank order, its inverse) for ``sizes``; the
        permutations on ``device``, kept for the next call with the same sizes (no host copy per step)."""
        key = tuple(sizes)
        if key != self._perm_key:
            order = [r for block in self._node for r in block]  # group ranks in the order stage 2 leaves them
            starts, offset = {}, 0
            for r in order:
                starts[r], offset = offset, offset + sizes[r]
            perm = torch.cat([torch.arange(starts[r], starts[r] + sizes[r]) for r in range(self.world)])  # (N,)
            self._perm_key, self._perm = key, {torch.device("cpu"): (perm, torch.argsort(perm))}
        device = torch.device(device)
        if device not in self._perm:
            self._perm[device] = tuple(t.to(device) for t in self._perm[torch.device("cpu")])
        stage1 = [sizes[r] for r in self._aligned]
        stage2 = [sum(sizes[r] for r in block) for block in self._node]
        return (stage1, stage2) + self._perm[device]

    def gather(self, x: torch.Tensor, sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
        """Every rank's rows in rank order: (B_r, ...) -> (sum_r B_r, ...), equal to the flat all-gather."""
        sizes = self.sizes_of(x, sizes)
        stage1, stage2, perm, _ = self._plan(sizes, x.device)
        y = x.contiguous()
        if group_size(self.aligned) > 1:
            y = PaddedGather(y, self.aligned, stage1).result()  # (sum stage1, ...)
        if group_size(self.intra) > 1:
            y = PaddedGather(y, self.intra, stage2).result()  # (N, ...) in stage order
        return y.index_select(0, perm)  # (N, ...) in rank order

    def reduce_scatter(self, g: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
        """Sum over ranks of ``g`` (sum_r B_r, ...), this rank's (B_r, ...) rows kept."""
        stage1, stage2, _, inverse = self._plan(list(sizes), g.device)
        y = g.contiguous().index_select(0, inverse)  # (N, ...) in stage order
        if group_size(self.intra) > 1:
            y = PaddedReduceScatter(y, self.intra, stage2, rank=self.intra_rank).result()  # (stage2[me], ...)
        if group_size(self.aligned) > 1:
            y = PaddedReduceScatter(y, self.aligned, stage1, rank=self.aligned_rank).result()  # (B_me, ...)
        return y


class _NodeGatherRows(torch.autograd.Function):
    """forward: NodeGather.gather; backward: NodeGather.reduce_scatter times grad_scale."""

    @staticmethod
    def forward(ctx, x, plan, sizes, grad_scale):
        ctx.plan, ctx.sizes, ctx.grad_scale = plan, sizes, grad_scale
        return plan.gather(x, sizes)

    @staticmethod
    def backward(ctx, grad):
        out = ctx.plan.reduce_scatter(grad, ctx.sizes)
        if ctx.grad_scale != 1.0:
            out = out * ctx.grad_scale
        return out, None, None, None


def time_exchange(plan: NodeGather, group, mode: str, rows: torch.Tensor) -> float:
    """Seconds of one row exchange of ``rows`` (B, d) over ``group`` from a barrier: the all-gather, then the
    reduce-scatter of its result; flat (one collective each) or through ``plan`` (``topology.head_collectives``'
    auto probe, ds_xc.parallel.reduction_probe)."""
    dist.barrier(group=group)
    start = time.perf_counter()
    if mode == "flat":
        out = PaddedReduceScatter(PaddedGather(rows, group).result(), group).result()
    else:
        out = plan.reduce_scatter(plan.gather(rows), plan.sizes_of(rows, None))
    if out.is_cuda:  # NCCL returns before the collective ends
        torch.cuda.synchronize(out.device)
    return time.perf_counter() - start


def node_gather_rows(x: torch.Tensor, plan: NodeGather, sizes: Optional[Sequence[int]] = None,
                     grad_scale: float = 1.0) -> torch.Tensor:
    """:func:`ds_xc.parallel.collectives.all_gather_rows` through ``plan``'s two stages: (B_r, d) ->
    (sum_r B_r, d), differentiable; the backward reduce-scatters and multiplies by ``grad_scale``."""
    if plan.world == 1:
        return x if grad_scale == 1.0 else scale_grad(x, grad_scale)
    return _NodeGatherRows.apply(x, plan, plan.sizes_of(x, sizes), grad_scale)

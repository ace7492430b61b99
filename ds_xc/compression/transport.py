"""Moving compressed gradients between ranks, and counting the bytes.

* :func:`sparse_allgather_mean`: every rank contributes (index, value) pairs, in varying
  numbers; every rank rebuilds the same dense mean. Wire format per rank: a header of
  one int32 count per 65536-element block of the bucket, then the pairs as a 16-bit
  offset inside their block plus the value (``value_dtype``), 6 bytes per fp32 pair
  instead of 8 with int32 indices. gloo's all_gather needs equal sizes, so the headers
  (fixed size) go first; they tell every rank all the counts, and the payloads are
  padded to the largest. Decoding adds the ranks' pairs in rank order, so every rank
  computes a bit-identical result.
* :func:`values_allreduce_mean`: random-k, whose indices agree on all ranks: an
  all-reduce of the values only.
* :func:`dense_allreduce_mean_`: the uncompressed path (small tensors, warm-up, method none).
* :class:`NodeGroups` and the intra-node reduce-scatter / all-gather of the hierarchy.

Byte counts are per rank and use the ring algorithms' volumes (what gloo and NCCL move
for these collectives): all-gather of b bytes per rank sends and receives (P-1) b;
all-reduce and reduce-scatter + all-gather of N bytes send and receive 2 (P-1) N / P.
benchmarks/compression_netns.py checks them against the bytes a veth pair really carried.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ds_xc.parallel.collectives import all_reduce_mean_, allreduce_bytes, gather_flat, reduce_scatter_flat
from ds_xc.parallel.groups import block_groups, group_rank, group_ranks, group_size, is_distributed, spans_world
from ds_xc.parallel.timeline import wait_work

__all__ = ["BLOCK", "WireCounter", "sparse_allgather_mean", "start_sparse_allgather_mean", "PendingSparseMean", "values_allreduce_mean", "dense_allreduce_mean_",
           "NodeGroups", "build_node_groups", "reduce_scatter_sum", "all_gather_slices", "DTYPES"]

BLOCK_BITS = 16
BLOCK = 1 << BLOCK_BITS
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class WireCounter:
    """Bytes this rank put on / took off the wire (cumulative); ``intra_*`` = inside a node."""
    bytes_sent: int = 0
    bytes_received: int = 0
    intra_bytes_sent: int = 0
    intra_bytes_received: int = 0

    def add(self, sent: int, received: int, intra: bool = False) -> None:
        self.bytes_sent += int(sent)
        self.bytes_received += int(received)
        if intra:
            self.intra_bytes_sent += int(sent)
            self.intra_bytes_received += int(received)

    def snapshot(self) -> dict:
        return dict(self.__dict__)


def _encode(idx: torch.Tensor, vals: torch.Tensor, n: int, value_dtype: torch.dtype):
    """(m,) sorted indices + (m,) values -> header (blocks,) int32, offsets (m,) int16, values (m,)."""
    blocks = (n + BLOCK - 1) // BLOCK
    header = torch.bincount(idx >> BLOCK_BITS, minlength=blocks).to(torch.int32)  # (blocks,)
    offsets = ((idx & (BLOCK - 1)) - (BLOCK // 2)).to(torch.int16)  # (m,), shifted into int16
    return header, offsets, vals.to(value_dtype)


def _decode_into(acc: torch.Tensor, header: torch.Tensor, offsets: torch.Tensor, vals: torch.Tensor) -> None:
    """acc[idx] += vals for the pairs of one rank's message (indices unique within it)."""
    block_ids = torch.repeat_interleave(torch.arange(header.numel(), device=acc.device),
                                        header.to(torch.int64))  # (m,)
    idx = (block_ids << BLOCK_BITS) + (offsets.to(torch.int64) + BLOCK // 2)
    acc.index_add_(0, idx, vals.to(acc.dtype))


def sparse_allgather_mean(idx: torch.Tensor, vals: torch.Tensor, n: int, group, value_dtype: torch.dtype,
                          counter: WireCounter, intra: bool = False, out: Optional[torch.Tensor] = None):
    """Mean over the ranks of ``group`` of the sparse vectors (idx, vals), dense (n,) float32.

    ``idx`` (m,) sorted int64 in [0, n), unique; ``vals`` (m,) float. Returns the dense
    mean (in ``out`` when given: a reused (n,) float32 buffer saves the page faults of a
    fresh one every step) and the (P,) int64 pair counts of all ranks.
    """
    return start_sparse_allgather_mean(idx, vals, n, group, value_dtype, counter, intra, out).wait()


class PendingSparseMean:
    """A sparse all-gather whose payload may still be in flight; :meth:`wait` decodes the mean."""

    def __init__(self, acc, counts, headers=None, rows=None, m_max=0, value_dtype=None, work=None, nbytes=0,
                 counter=None, intra=False):
        self.acc, self.counts, self.headers, self.rows = acc, counts, headers, rows
        self.m_max, self.value_dtype, self.work = m_max, value_dtype, work
        self.nbytes, self.counter, self.intra = nbytes, counter, intra

    def wait(self, timeline=None):
        """(dense (n,) float32 mean, (P,) int64 counts); waits for the payload, then decodes."""
        wait_work(self.work, timeline, "grad_reduce")
        self.work = None
        if self.rows is not None:
            world = self.headers.shape[0]
            rows = self.rows.view(world, -1)  # (P, row)
            vbytes = torch.empty((), dtype=self.value_dtype).element_size()
            for r in range(world):  # rank order: the same sum on every rank
                m = int(self.counts[r])
                offs = rows[r, : 2 * self.m_max].view(torch.int16)[:m]
                vs = rows[r, 2 * self.m_max: 2 * self.m_max + vbytes * m].view(self.value_dtype)
                _decode_into(self.acc, self.headers[r], offs, vs)
            self.acc.div_(world)
            self.rows = None
        if self.counter is not None:
            self.counter.add(self.nbytes, self.nbytes, self.intra)
            self.counter = None
        return self.acc, self.counts


def start_sparse_allgather_mean(idx: torch.Tensor, vals: torch.Tensor, n: int, group, value_dtype: torch.dtype,
                                counter: WireCounter, intra: bool = False, out: Optional[torch.Tensor] = None,
                                async_op: bool = False) -> PendingSparseMean:
    """:func:`sparse_allgather_mean` in two halves: the headers are exchanged now (small, blocking:
    they size the payload), the payload all-gather is issued (``async_op``: left in flight)."""
    header, offsets, values = _encode(idx, vals, n, value_dtype)
    acc = out.zero_() if out is not None else torch.zeros(n, dtype=torch.float32, device=vals.device)
    if not is_distributed(group):
        _decode_into(acc, header, offsets, values)
        return PendingSparseMean(acc, torch.tensor([idx.numel()], dtype=torch.int64))
    world, vbytes = group_size(group), values.element_size()
    headers = torch.empty(world * header.numel(), dtype=torch.int32, device=header.device)
    gather_flat(headers, header, group=group)
    headers = headers.view(world, -1)  # (P, blocks)
    counts = headers.to(torch.int64).sum(1).cpu()  # (P,)
    m_max = int(counts.max())
    m_max += m_max % 2  # keeps the value region 4-byte aligned
    if m_max == 0:  # nobody sent anything: the headers were the whole message
        nbytes = (world - 1) * header.numel() * 4
        return PendingSparseMean(acc, counts, nbytes=nbytes, counter=counter, intra=intra)
    row = m_max * (2 + vbytes)
    payload = torch.zeros(row, dtype=torch.uint8, device=vals.device)  # [offsets | values], padded
    payload[: 2 * idx.numel()] = offsets.view(torch.uint8)
    payload[2 * m_max: 2 * m_max + vbytes * idx.numel()] = values.view(torch.uint8)
    rows = torch.empty(world * row, dtype=torch.uint8, device=vals.device)
    work = gather_flat(rows, payload, group=group, async_op=async_op)
    nbytes = (world - 1) * (header.numel() * 4 + row)
    return PendingSparseMean(acc, counts, headers, rows, m_max, value_dtype, work, nbytes, counter, intra)


def values_allreduce_mean(vals: torch.Tensor, group, value_dtype: torch.dtype, counter: WireCounter,
                          intra: bool = False) -> torch.Tensor:
    """Mean over ranks of values at indices that agree on every rank: (m,) -> (m,) float32."""
    if not is_distributed(group):
        return vals.to(value_dtype).float()
    world = group_size(group)
    buf = vals.to(value_dtype)
    dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
    nbytes = allreduce_bytes(buf.numel() * buf.element_size(), world)
    counter.add(nbytes, nbytes, intra)
    return buf.float().div_(world)


def dense_allreduce_mean_(tensors: list[torch.Tensor], group, counter: WireCounter, intra: bool = False) -> None:
    """In place: each tensor becomes its mean over the ranks (one flat all-reduce per dtype)."""
    if not tensors or not is_distributed(group):
        return
    world = group_size(group)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype, ts in by_dtype.items():
        flat = torch.cat([t.reshape(-1) for t in ts])  # (sum numel,)
        all_reduce_mean_(flat, group)
        offset = 0
        for t in ts:
            t.copy_(flat[offset: offset + t.numel()].view_as(t))
            offset += t.numel()
        nbytes = allreduce_bytes(flat.numel() * flat.element_size(), world)
        counter.add(nbytes, nbytes, intra)


# ---------------------------------------------------------------------------- hierarchy
@dataclass
class NodeGroups:
    """The process groups of a node-aware reduction.

    ``intra``: the ranks of this node; ``inter``: the ranks with this local rank on every node.
    """
    intra: Optional["dist.ProcessGroup"]
    inter: Optional["dist.ProcessGroup"]
    local_rank: int
    local_size: int
    num_nodes: int


def build_node_groups(ranks_per_node: int, group=None) -> NodeGroups:
    """Split ``group`` into nodes of ``ranks_per_node`` consecutive ranks (collective over the world:
    every rank calls it, so ``group`` must span the world; for a proper subgroup build the node groups
    of every data-parallel group on every rank, ``ds_xc.parallel.groups.new_groups``, and pass
    ``node_groups=`` to CompressedOptimizer)."""
    world = group_size(group)
    if ranks_per_node < 1 or world % ranks_per_node:
        from ds_xc.config import ConfigError
        raise ConfigError(f"gradient_compression.hierarchy.ranks_per_node={ranks_per_node} must divide the "
                          f"data-parallel group size {world}")
    if not spans_world(group):
        raise ValueError(f"build_node_groups: the data-parallel group of world ranks {group_ranks(group)} is a proper "
                         "subgroup; torch creates groups with every rank of the world, so its members alone cannot: "
                         "create the node groups on every rank with ds_xc.parallel.groups.new_groups and pass "
                         "node_groups= (NodeGroups) to CompressedOptimizer")
    members, rank = group_ranks(group), group_rank(group)
    intra, inter = block_groups([members[a: a + ranks_per_node] for a in range(0, world, ranks_per_node)])
    num_nodes = world // ranks_per_node
    return NodeGroups(intra=intra, inter=inter, local_rank=rank % ranks_per_node,
                      local_size=ranks_per_node, num_nodes=num_nodes)


def reduce_scatter_sum(flat: torch.Tensor, nodes: NodeGroups, counter: WireCounter) -> torch.Tensor:
    """Sum ``flat`` (L*s,) over the node's ranks; return this local rank's slice (s,)."""
    out = flat.new_empty(flat.numel() // nodes.local_size)
    reduce_scatter_flat(out, flat, group=nodes.intra)
    nbytes = (nodes.local_size - 1) * out.numel() * out.element_size()
    counter.add(nbytes, nbytes, intra=True)
    return out


def all_gather_slices(piece: torch.Tensor, nodes: NodeGroups, counter: WireCounter) -> torch.Tensor:
    """Concatenate the node's slices (s,) -> (L*s,) in local-rank order."""
    out = piece.new_empty(piece.numel() * nodes.local_size)
    gather_flat(out, piece.contiguous(), group=nodes.intra)
    nbytes = (nodes.local_size - 1) * piece.numel() * piece.element_size()
    counter.add(nbytes, nbytes, intra=True)
    return out

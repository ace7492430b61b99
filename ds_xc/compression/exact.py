"""The exact mean of a dense step (warm-up, ``method: none``), the cheaper of two ways.

A dense step must give every rank the exact mean, but a ring all-reduce of the whole gradient is not
always the cheapest way to get it: an embedding table's gradient is zero outside the rows a batch
looked up (on launch/train.py's text task ~3% of the table per rank). The compressed tensors of a
step are laid out in one flat bucket; when this rank's nonzeros, padded to the largest count over
the ranks, move fewer bytes as (offset, float32 value) pairs in a sparse all-gather than the bucket
does in a ring all-reduce, the nonzeros are exchanged and summed rank by rank (the same mean up to
the order of the float additions), else the bucket is all-reduced. Every rank takes the same
decision from the same maximum count (one all-reduce of one integer). The warm-up that freezes
Adam's variance (``adam_variance``) is 100 such steps by default: over a slow link this is what
keeps it from costing as much as the compressed steps after it.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from ds_xc.compression.layout import gather_flat, scatter_flat
from ds_xc.compression.transport import WireCounter, dense_allreduce_mean_, sparse_allgather_mean
from ds_xc.parallel.collectives import allreduce_bytes
from ds_xc.parallel.groups import group_size, is_distributed

__all__ = ["PAIR_BYTES", "sparse_pays", "exact_mean_"]

PAIR_BYTES = 6  # a 16-bit offset inside its 65536-element block and a float32 value (transport.py)


def sparse_pays(max_nonzero: int, numel: int, world: int) -> bool:
    """Whether a sparse all-gather of ``max_nonzero`` pairs per rank moves fewer bytes than a ring
    all-reduce of ``numel`` float32 elements over ``world`` ranks (headers left out: 4 bytes a block)."""
    return (world - 1) * max_nonzero * PAIR_BYTES < allreduce_bytes(4 * numel, world)


def exact_mean_(grads: list[torch.Tensor], sparse: list[int], starts: list[int], padded: int, group,
                counter: WireCounter, scratch: Callable[[str, int, torch.device], torch.Tensor]) -> None:
    """In place: every tensor of ``grads`` becomes its mean over ``group``.

    ``sparse``/``starts``: the indices into ``grads`` of the bucket's tensors and their offsets in a
    flat (padded,) float32 bucket; the other tensors are all-reduced. ``scratch(name, numel, device)``
    lends reused float32 buffers."""
    world = group_size(group)
    flat_ok = sparse and all(grads[i].dtype == torch.float32 for i in sparse)
    if not flat_ok or not is_distributed(group) or world < 2:
        return dense_allreduce_mean_(grads, group, counter)
    device = grads[sparse[0]].device
    flat = gather_flat(grads, sparse, starts, scratch("flat", padded, device))  # (padded,), padding stays zero
    top = torch.count_nonzero(flat).reshape(1)  # (1,) int64
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    counter.add(allreduce_bytes(8, world), allreduce_bytes(8, world))
    if not sparse_pays(int(top), padded, world):
        return dense_allreduce_mean_(grads, group, counter)
    chosen = set(sparse)
    dense_allreduce_mean_([g for i, g in enumerate(grads) if i not in chosen], group, counter)
    idx = torch.nonzero(flat).squeeze(1)  # (m,) sorted
    mean, _ = sparse_allgather_mean(idx, flat[idx], padded, group, torch.float32, counter,
                                    out=scratch("reduced", padded, device))  # (padded,)
    scatter_flat(mean, grads, sparse, starts)

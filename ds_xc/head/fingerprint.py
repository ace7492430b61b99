"""The fingerprint of a head's weight shard saved with its checkpoint (``weight_checksum``):
``ClassParallelHead`` stores it in its extra state, and a load whose weights differ from the ones
the saved ANN index / kNN graph describes has the sampler rebuild its index instead of using it.
"""
from __future__ import annotations

import torch

__all__ = ["weight_checksum", "CHECKSUM_BLOCK"]

CHECKSUM_BLOCK = 1 << 22  # at most this many elements of the shard are in float64 at once (32 MB)


def weight_checksum(weight: torch.Tensor) -> tuple:
    """A cheap fingerprint of a weight shard: (sum, sum of squares) in float64, accumulated over blocks
    of rows on the shard's device with one host read at the end.

    Only one block is ever converted (at most an eighth of the shard and CHECKSUM_BLOCK elements) and
    its squares are summed by a dot product, never formed: a float64 copy of the whole shard and its
    square were 16 bytes per element (80 GB for a 10^7 x 512 shard), made at every ``state_dict()``
    and load. The extra memory is at most half the shard's bytes (bfloat16), a quarter (float32)."""
    w = weight.detach()
    if w.dim() != 2:
        w = w.reshape(w.shape[0] if w.dim() else 1, -1)
    rows = max(1, min(CHECKSUM_BLOCK, -(-w.numel() // 8)) // max(w.shape[1], 1))
    acc = torch.zeros(2, dtype=torch.float64, device=w.device)  # (sum, sum of squares)
    for block in w.split(rows):  # (r, d) views of the shard
        b = block.double().reshape(-1)  # (r * d,): the one float64 block
        acc[0] += b.sum()
        acc[1] += torch.dot(b, b)
        del b
    total, squares = acc.tolist()
    return (total, squares)


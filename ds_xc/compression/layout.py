"""Which parameters are compressed, and where each lives in the flat gradient bucket.

The compressed parameters are concatenated (in the optimizer's parameter order) into
one flat fp32 bucket of n elements. Without a hierarchy every rank compresses the whole
bucket. With L ranks per node the bucket is padded to a multiple of L and local rank l
owns the slice [l*s, (l+1)*s), s = n_pad / L: it compresses only that slice, after the
dense reduce-scatter inside the node. A *segment* is the part of one parameter inside
this rank's region; thresholds and statistics are kept per segment, so per parameter
(a contiguous parameter meets a contiguous region in at most one piece). With
``granularity: bucket`` the whole region is one segment: one threshold for all tensors,
so the budget goes to the largest |v| wherever they are.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["Segment", "BucketLayout", "plan_layout", "gather_flat", "scatter_flat"]


@dataclass(frozen=True)
class Segment:
    """Elements [start, end) of this rank's region = elements [offset, offset + end - start) of a parameter."""
    index: int  # the parameter's position in the optimizer's parameter list
    start: int
    end: int
    offset: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass
class BucketLayout:
    """Compressed (``sparse``) and dense parameter positions, bucket offsets and this rank's region."""
    sparse: list[int] = field(default_factory=list)
    dense: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # bucket offset of each sparse parameter
    numel: int = 0  # n: elements of the compressed parameters together
    padded: int = 0  # n rounded up to a multiple of the ranks per node
    region: tuple[int, int] = (0, 0)  # this rank's [lo, hi) in the padded bucket
    segments: list[Segment] = field(default_factory=list)

    @property
    def region_numel(self) -> int:
        return self.region[1] - self.region[0]


def plan_layout(params: list[torch.Tensor], min_numel: int, compress: bool, local_rank: int = 0,
                local_size: int = 1, per_tensor: bool = True, min_dim: int = 1) -> BucketLayout:
    """Split ``params`` into dense and compressed ones and place the compressed ones in the bucket.

    Compressed: ``min_numel`` elements or more and ``min_dim`` dimensions or more (PowerSGD
    compresses matrices only).

    ``per_tensor=False`` makes this rank's whole region one segment (one threshold for the
    bucket), its state kept with the first parameter that overlaps the region.
    """
    layout = BucketLayout()
    for i, p in enumerate(params):
        if compress and p.numel() >= min_numel and p.dim() >= min_dim:
            layout.sparse.append(i)
            layout.starts.append(layout.numel)
            layout.numel += p.numel()
        else:
            layout.dense.append(i)
    size = -(-layout.numel // local_size) if layout.numel else 0  # ceil(n / L)
    layout.padded = size * local_size
    lo, hi = local_rank * size, (local_rank + 1) * size
    layout.region = (lo, hi)
    for i, start in zip(layout.sparse, layout.starts):
        a, b = max(start, lo), min(start + params[i].numel(), hi)
        if a < b:
            layout.segments.append(Segment(index=i, start=a - lo, end=b - lo, offset=a - start))
    if not per_tensor and layout.segments:
        first = layout.segments[0]
        layout.segments = [Segment(index=first.index, start=0, end=layout.segments[-1].end, offset=first.offset)]
    return layout


Grads = Sequence[torch.Tensor] | Mapping[int, torch.Tensor]  # indexed by parameter position


def gather_flat(grads: Grads, sparse: list[int], starts: list[int], flat: torch.Tensor) -> torch.Tensor:
    """Copy the bucket's tensors ``grads[i]`` (i in ``sparse``) into ``flat`` at their ``starts``; returns
    ``flat`` (its padding is left as it is). ``grads`` is indexed by parameter position (a list of all,
    or a dict of some: the overlapped reducer passes one bucket's)."""
    for i, start in zip(sparse, starts):
        flat[start: start + grads[i].numel()].copy_(grads[i].reshape(-1))
    return flat


def scatter_flat(flat: torch.Tensor, grads: Grads, sparse: list[int], starts: list[int]) -> None:
    """The inverse of :func:`gather_flat`: each ``grads[i]`` (i in ``sparse``) takes its slice of ``flat``,
    in its own dtype."""
    for i, start in zip(sparse, starts):
        grads[i].copy_(flat[start: start + grads[i].numel()].view_as(grads[i]))

"""Asynchronous row all-gather and reduce-scatter for the chunked head schedule.

The same padding rule as ds_xc.parallel.collectives (gloo needs equal block sizes),
split into *issue* (pad, launch with ``async_op=True``) and *wait* (unpad), so that a
collective can be in flight while the caller computes. Row counts of every rank are
passed in, so no call synchronises with the host. With ``blocking=True`` every
collective is waited for at once: the serial reference schedule, timed the same way.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ds_xc.parallel.collectives import gather_flat, reduce_scatter_flat
from ds_xc.parallel.groups import group_size, is_distributed
from ds_xc.parallel.timeline import Timeline, wait_work

__all__ = ["PendingGather", "PendingReduceScatter", "split_sizes"]


def split_sizes(n: int, parts: int) -> list[int]:
    """Row counts of ``torch.tensor_split(range(n), parts)``: the first n % parts get one more."""
    return [n // parts + (i < n % parts) for i in range(parts)]


class PendingGather:
    """All-gather of row blocks: (sizes[rank], d) on each rank -> (sum(sizes), d) in rank order."""

    def __init__(self, x: torch.Tensor, sizes: Sequence[int], group, timeline: Optional[Timeline],
                 kind: str = "gather", blocking: bool = False):
        self.sizes, self.timeline, self.kind = list(sizes), timeline, kind
        self.work = None
        if not is_distributed(group):
            self.out = x
            return
        rows = max(self.sizes)
        x = x.contiguous()
        if x.shape[0] != rows:
            x = torch.cat([x, x.new_zeros((rows - x.shape[0],) + tuple(x.shape[1:]))], 0)
        self.out = x.new_empty((group_size(group) * rows,) + tuple(x.shape[1:]))  # (P*rows, d)
        self._rows = rows
        self.work = gather_flat(self.out, x, group=group, async_op=True)
        if timeline is not None:
            timeline.issued(kind, x.numel() * x.element_size())
        if blocking:
            self._wait()

    def _wait(self) -> None:
        wait_work(self.work, self.timeline, self.kind)
        self.work = None

    def wait(self) -> torch.Tensor:
        """The gathered rows (sum(sizes), d); unpadded."""
        self._wait()
        if len(self.sizes) == 1 or all(s == self._rows for s in self.sizes):
            return self.out
        rows = self._rows
        return torch.cat([self.out[r * rows: r * rows + s] for r, s in enumerate(self.sizes)], 0)


class PendingReduceScatter:
    """Sum of (sum(sizes), d) over ranks, this rank's block (sizes[rank], d) kept."""

    def __init__(self, g: torch.Tensor, sizes: Sequence[int], rank: int, group, timeline: Optional[Timeline],
                 kind: str = "reduce_scatter", blocking: bool = False):
        self.sizes, self.rank, self.timeline, self.kind = list(sizes), rank, timeline, kind
        self.work = None
        if not is_distributed(group):
            self.out = g
            return
        rows = max(self.sizes)
        g = g.contiguous()
        if any(s != rows for s in self.sizes):
            padded = g.new_zeros((len(self.sizes) * rows,) + tuple(g.shape[1:]))
            offset = 0
            for r, s in enumerate(self.sizes):
                padded[r * rows: r * rows + s] = g[offset: offset + s]
                offset += s
            g = padded
        self.out = g.new_empty((rows,) + tuple(g.shape[1:]))  # (rows, d)
        self.work = reduce_scatter_flat(self.out, g, group=group, async_op=True)
        if timeline is not None:
            timeline.issued(kind, g.numel() * g.element_size())
        if blocking:
            self._wait()

    def _wait(self) -> None:
        wait_work(self.work, self.timeline, self.kind)
        self.work = None

    def wait(self) -> torch.Tensor:
        """This rank's rows of the sum: (sizes[rank], d)."""
        self._wait()
        return self.out[: self.sizes[self.rank]]

"""Asynchronous row all-gather and reduce-scatter for the chunked head schedule.

The padding rule of ds_xc.parallel.collectives (gloo needs equal block sizes; its
PaddedGather / PaddedReduceScatter) in two halves: *issue* (pad, launch with
``async_op=True``) and *wait* (unpad), recorded in the timeline, so that a
collective can be in flight while the caller computes. Row counts of every rank are
passed in, so no call synchronises with the host. With ``blocking=True`` every
collective is waited for at once: the serial reference schedule, timed the same way.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ds_xc.parallel.collectives import PaddedGather, PaddedReduceScatter
from ds_xc.parallel.groups import is_distributed
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
        self.work, self._gather, self.out = None, None, x
        if not is_distributed(group):
            return
        self._gather = PaddedGather(x, group, self.sizes, async_op=True)  # (P*rows, d) in flight
        self.work = self._gather.work
        if timeline is not None:
            timeline.issued(kind, self._gather.nbytes)
        if blocking:
            self._wait()

    def _wait(self) -> None:
        wait_work(self.work, self.timeline, self.kind)
        self.work = None

    def wait(self) -> torch.Tensor:
        """The gathered rows (sum(sizes), d); unpadded."""
        self._wait()
        return self.out if self._gather is None else self._gather.result()


class PendingReduceScatter:
    """Sum of (sum(sizes), d) over ranks, this rank's block (sizes[rank], d) kept."""

    def __init__(self, g: torch.Tensor, sizes: Sequence[int], rank: int, group, timeline: Optional[Timeline],
                 kind: str = "reduce_scatter", blocking: bool = False):
        self.sizes, self.rank, self.timeline, self.kind = list(sizes), rank, timeline, kind
        self.work, self._scatter, self.out = None, None, g
        if not is_distributed(group):
            return
        self._scatter = PaddedReduceScatter(g, group, self.sizes, rank, async_op=True)  # (rows, d) in flight
        self.work = self._scatter.work
        if timeline is not None:
            timeline.issued(kind, self._scatter.nbytes)
        if blocking:
            self._wait()

    def _wait(self) -> None:
        wait_work(self.work, self.timeline, self.kind)
        self.work = None

    def wait(self) -> torch.Tensor:
        """This rank's rows of the sum: (sizes[rank], d)."""
        self._wait()
        return self.out[: self.sizes[self.rank]] if self._scatter is None else self._scatter.result()

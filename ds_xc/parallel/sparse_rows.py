"""The mean of a row-sparse gradient over a group, sent as its nonzero rows.

An embedding table's gradient is zero on every row that the local batch did not look up:
a text backbone's 20,001 x 256 table gets a few thousand nonzero rows per step. A dense
all-reduce moves the whole table (a ring moves 2 (P-1)/P of it per rank); sending only the
nonzero rows, as DDP does for ``nn.Embedding(sparse=True)`` and DeepSpeed's
``sparse_gradients`` for embedding modules, moves (P-1) k_max (4 d + 8) bytes per rank,
where k_max is the largest count of nonzero rows on any rank. The result is the same mean:
the rows that are not sent are zero on their rank.

:class:`RowSparseMean` first all-gathers every rank's count (one int64 each, a blocking
collective), so that every rank takes the same decision from the same numbers: rows when they
move fewer bytes than the dense ring, else the dense all-reduce. Then the indices and the
rows go out in two (asynchronous) all-gathers, padded to k_max (ds_xc.parallel.collectives'
padding rule), and :meth:`RowSparseMean.wait` sums every rank's rows into a zeroed table in rank
order and divides by P. With two ranks
this is bitwise the dense mean (a + b = b + a, 0 + a = a); with more, the summation order
differs from the ring's, so the two agree within float rounding.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ds_xc.parallel.collectives import PaddedGather, PendingMean, allreduce_bytes, exchange_sizes
from ds_xc.parallel.groups import group_size, is_distributed

__all__ = ["RowSparseMean", "nonzero_rows", "rows_pay", "rows_bytes"]

INDEX_BYTES = 8  # int64 row indices


def nonzero_rows(grad_ND: torch.Tensor) -> torch.Tensor:
    """Indices (k,) of the rows of a 2-D gradient that hold a nonzero (or non-finite) element, ascending."""
    return (grad_ND != 0).any(dim=1).nonzero().squeeze(1)  # NaN != 0: a NaN row is sent and stays NaN


def rows_bytes(k_max: int, dim: int, element_size: int, world: int) -> float:
    """Bytes the two all-gathers send per rank: (P-1) k_max rows of ``dim`` values and an index each."""
    return float((world - 1) * k_max * (dim * element_size + INDEX_BYTES))


def rows_pay(k_max: int, shape: tuple, element_size: int, world: int) -> bool:
    """Whether sending k_max rows per rank moves fewer bytes than the dense ring (the same answer on every
    rank: it reads only numbers every rank has)."""
    n, dim = shape
    return rows_bytes(k_max, dim, element_size, world) < allreduce_bytes(n * dim * element_size, world)


class RowSparseMean:
    """``grad`` (N, d) becomes its mean over ``group``: its nonzero rows all-gathered, or a dense all-reduce.

    Issued on construction (the count exchange blocks; the payload is left in flight with
    ``async_op``); :meth:`wait` returns ``grad`` holding the mean. Attributes: ``mode`` ('rows'
    or 'dense'), ``nbytes`` (what this rank sent, as the ring and the all-gather move it),
    ``counts`` (nonzero rows of each rank)."""

    def __init__(self, grad: torch.Tensor, group=None, async_op: bool = False):
        if grad.dim() != 2:
            raise ValueError(f"RowSparseMean: a 2-D gradient is needed, got shape {tuple(grad.shape)}")
        self.grad, self.world = grad, group_size(group)
        self._pending = None
        self._gathered = False
        if not is_distributed(group):
            self.mode, self.nbytes, self.counts = "dense", 0.0, None
            return
        idx_K = nonzero_rows(grad)
        self.counts = exchange_sizes(idx_K.numel(), group, grad.device)  # blocking: every rank decides alike
        k_max = max(self.counts)
        esize = grad.element_size()
        if not rows_pay(k_max, tuple(grad.shape), esize, self.world):
            self.mode = "dense"
            self.nbytes = allreduce_bytes(grad.numel() * esize, self.world)
            self._pending = PendingMean(grad, group, async_op)
            return
        self.mode = "rows"
        self.nbytes = rows_bytes(k_max, grad.shape[1], esize, self.world)
        # (k,) and (k, d) per rank, padded to k_max by the gather and unpadded by result(): (sum_r k_r, ...)
        self._gathers = [] if k_max == 0 else [  # every rank's rows are zero: nothing to send
            PaddedGather(idx_K, group, self.counts, async_op=async_op),
            PaddedGather(grad.index_select(0, idx_K), group, self.counts, async_op=async_op)]

    def progress(self, limit: int) -> int:
        """The staged-work interface of the hierarchical reduction (BucketedGradReducer): nothing to advance."""
        return limit

    def wait(self, waiter: Optional[Callable] = None) -> torch.Tensor:
        """Wait (through ``waiter(work)`` when given, e.g. to time it) and return ``grad`` holding the mean."""
        if self._pending is not None:
            out = self._pending.wait(waiter)
            self._pending = None
            return out
        if self.mode != "rows" or self._gathered:
            return self.grad
        for g in self._gathers:
            if g.work is not None:
                waiter(g.work) if waiter is not None else g.work.wait()
        self.grad.zero_()
        if self._gathers:
            idx, rows = (g.result() for g in self._gathers)  # (sum_r k_r,), (sum_r k_r, d), rank order
            offset = 0
            for k in self.counts:  # one rank's block at a time: its indices are unique, so even atomic
                if k:              # adds (CUDA) give every rank the same sum, in rank order
                    self.grad.index_add_(0, idx[offset: offset + k], rows[offset: offset + k])
                offset += k
        self.grad.div_(self.world)
        self._gathered = True
        return self.grad


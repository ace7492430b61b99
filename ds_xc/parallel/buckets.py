"""Backbone gradients reduced in buckets, issued from gradient hooks while the backward runs.

The parameters are cut into buckets of about ``bucket_bytes`` in reverse registration
order (roughly the order in which backward produces their gradients, as DDP assumes).
Once :meth:`arm` has been called (before the last backward of a gradient-accumulation
window), every parameter's post-accumulate-grad hook marks it ready; a bucket whose
parameters are all ready is copied into its flat buffer and all-reduced asynchronously.
Buckets are launched strictly in bucket order, so every rank issues the same
collectives in the same order whatever the timing. :meth:`finish` launches what is left
(parameters without a gradient count as zeros), waits, and writes the mean over the
group back into each ``.grad``: the same values as one all-reduce after the backward.

On the parallel floor (not in ds_xc.overlap) because both the overlap pipeline and the
compressed reduction of ds_xc/compression/overlapped.py build on it.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from ds_xc.parallel.collectives import all_reduce_mean_, allreduce_bytes
from ds_xc.parallel.groups import copy_group, group_size, is_distributed, resolve_group
from ds_xc.parallel.sparse_rows import RowSparseMean
from ds_xc.parallel.timeline import Timeline, wait_work

log = logging.getLogger(__name__)

__all__ = ["BucketedGradReducer", "plan_buckets"]


def plan_buckets(params: list, bucket_bytes: int, alone: frozenset = frozenset()) -> list[list[int]]:
    """Indices of ``params`` per bucket, last parameter first; a bucket holds one dtype and about
    ``bucket_bytes`` (a larger parameter gets a bucket of its own, and so does every index in ``alone``)."""
    buckets: list[list[int]] = []
    size, dtype = 0, None
    for i in reversed(range(len(params))):
        p = params[i]
        nbytes = p.numel() * p.element_size()
        if i in alone:
            buckets.append([i])
            size, dtype = bucket_bytes, p.dtype  # nothing joins it
            continue
        if not buckets or p.dtype != dtype or size + nbytes > bucket_bytes and size > 0:
            buckets.append([])
            size, dtype = 0, p.dtype
        buckets[-1].append(i)
        size += nbytes
    return buckets


class BucketedGradReducer:
    """Averages the gradients of ``params`` over ``group`` in buckets launched from backward hooks.

    Args:
        params: the replicated parameters (a backbone's); their order decides the buckets.
        group: the data-parallel group (None: the world).
        bucket_bytes: target bucket size.
        timeline: where issue and wait times are recorded.
        comm_group: the group the buckets travel on (default: a new copy of ``group``, so
            that they never queue behind other traffic; every rank must construct the reducer).
        overlap: False launches every bucket in :meth:`finish` (the serial reduction, timed
            the same way).
        buckets: an explicit plan, lists of parameter indices in launch order (default:
            :func:`plan_buckets`).
        reduction: a :class:`ds_xc.parallel.hierarchical.HierarchicalAllReduce` over ``group``'s
            nodes (None: one flat all-reduce per bucket on ``comm_group``); its buckets move through
            their stages whenever a later bucket is launched, and in :meth:`finish`.
        row_sparse: the parameters (2-D, e.g. embedding tables) whose gradients are sent as their
            nonzero rows (:class:`ds_xc.parallel.sparse_rows.RowSparseMean`, flat on ``comm_group``,
            dense when the rows would move more bytes); each gets a bucket of its own.

    ``bytes_sent``: what this rank sent in the last window (ring volumes: dense 2 (P-1)/P of a
    bucket, rows (P-1) k_max (4 d + 8)); ``row_modes``: 'rows' or 'dense' per row-sparse
    parameter in the last window.

    Subclasses change what a bucket sends by overriding ``_launch(b)`` (the compressed
    reducer, ds_xc/compression/overlapped.py); they use the public :meth:`launch_remaining`
    and :meth:`wait_comm`, and the attributes ``params``, ``buckets``, ``world``, ``active``,
    ``comm_group``, ``timeline`` and ``armed``.
    """

    def __init__(self, params, group=None, bucket_bytes: int = 4 << 20, timeline: Optional[Timeline] = None,
                 comm_group=None, overlap: bool = True, buckets: Optional[list[list[int]]] = None,
                 reduction=None, row_sparse=()):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("BucketedGradReducer: no parameters with requires_grad=True")
        sparse_ids = {id(p) for p in row_sparse}
        self._row_sparse = frozenset(i for i, p in enumerate(self.params) if id(p) in sparse_ids)
        for i in self._row_sparse:
            if self.params[i].dim() != 2:
                raise ValueError(f"BucketedGradReducer: row_sparse parameter {i} has shape "
                                 f"{tuple(self.params[i].shape)}; only 2-D tables are sent as rows")
        group = resolve_group(group)  # None: the world, named explicitly
        self.world = group_size(group)
        self.active = is_distributed(group)
        self.reduction = reduction
        if comm_group is None and (reduction is None or self._row_sparse):
            comm_group = copy_group(group)
        self.comm_group = comm_group
        self.timeline, self.overlap = timeline, bool(overlap)
        if buckets is None:
            self.buckets = plan_buckets(self.params, int(bucket_bytes), self._row_sparse)
        else:
            self.buckets = [list(b) for b in buckets]
            if any(len(b) > 1 and self._row_sparse.intersection(b) for b in self.buckets):
                raise ValueError("BucketedGradReducer: a row_sparse parameter must have a bucket of its own")
        self._bucket_of = {i: b for b, idx in enumerate(self.buckets) for i in idx}
        self._buffers = [None] * len(self.buckets)
        self._works: list = [None] * len(self.buckets)
        self._missing = [0] * len(self.buckets)
        self._next = 0
        self.armed = False
        self.launched_in_backward = 0  # buckets of the last window launched from hooks (overlapped)
        self.bytes_sent = 0.0
        self.row_modes: list[str] = []
        self._handles = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)]
        log.info("BucketedGradReducer: %d parameters in %d buckets of <= %.1f MiB, %d ranks", len(self.params),
                 len(self.buckets), bucket_bytes / 2**20, self.world)

    def _make_hook(self, i: int):
        def hook(param):
            if self.armed:
                self._ready(i)
        return hook

    def arm(self) -> None:
        """Reduce from the hooks of the next backward (call before the last backward of the window)."""
        self._missing = [len(b) for b in self.buckets]
        self._works = [None] * len(self.buckets)
        self._next = 0
        self.launched_in_backward = 0
        self.bytes_sent = 0.0
        self.row_modes = []
        self.armed = True

    def _ready(self, i: int) -> None:
        b = self._bucket_of[i]
        self._missing[b] -= 1
        if self.overlap:
            while self._next < len(self.buckets) and self._missing[self._next] <= 0:
                self._launch(self._next)
                self._next += 1
                self.launched_in_backward += 1

    @torch.no_grad()
    def _launch(self, b: int) -> None:
        idx = self.buckets[b]
        if self.active and idx[0] in self._row_sparse:
            self._launch_rows(b)
            return
        params = [self.params[i] for i in idx]
        numel = sum(p.numel() for p in params)
        buf = self._buffers[b]
        if buf is None or buf.numel() != numel or buf.device != params[0].device:
            buf = self._buffers[b] = torch.empty(numel, dtype=params[0].dtype, device=params[0].device)
        offset = 0
        for p in params:
            view = buf[offset: offset + p.numel()]
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad.reshape(-1))
            offset += p.numel()
        if self.active and self.reduction is not None:  # earlier buckets' next stages first, then this one
            limit = 3
            for work in self._works[:b]:  # in bucket order: a bucket's stage never passes the previous one's
                if work is not None:
                    limit = work.progress(limit)
            self._works[b] = self.reduction.mean_(buf, async_op=True)
        elif self.active:  # the mean in flight; the division waits for finish()
            self._works[b] = all_reduce_mean_(buf, self.comm_group, async_op=True)
        if self.active:
            self.bytes_sent += allreduce_bytes(buf.numel() * buf.element_size(), self.world)
            if self.timeline is not None:
                self.timeline.issued("grad_reduce", buf.numel() * buf.element_size())

    def _launch_rows(self, b: int) -> None:
        """A row-sparse table's bucket: its nonzero rows all-gathered (or dense, when that moves fewer bytes)."""
        p = self.params[self.buckets[b][0]]
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        buf = self._buffers[b]
        if buf is None or buf.shape != grad.shape or buf.device != grad.device:
            buf = self._buffers[b] = torch.empty_like(grad)
        buf.copy_(grad)
        work = RowSparseMean(buf, self.comm_group, async_op=True)
        self._works[b] = work
        self.bytes_sent += work.nbytes
        self.row_modes.append(work.mode)
        if self.timeline is not None:
            self.timeline.issued("grad_reduce", int(work.nbytes))

    def launch_remaining(self) -> None:
        """Launch the buckets not launched yet, in bucket order (parameters without a gradient count as zeros)."""
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1

    @torch.no_grad()
    def finish(self) -> None:
        """Launch the remaining buckets, wait for all, write the means into ``.grad``."""
        if not self.armed:
            self.arm()
        self.launch_remaining()
        for b, idx in enumerate(self.buckets):
            buf = self._buffers[b] if self._works[b] is None else self._works[b].wait(self.wait_comm)
            buf = buf.reshape(-1)
            offset = 0
            for i in idx:
                p = self.params[i]
                view = buf[offset: offset + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = view.clone()
                else:
                    p.grad.copy_(view)
                offset += p.numel()
        self._works = [None] * len(self.buckets)
        self.armed = False

    def wait_comm(self, work) -> None:
        """Wait for one of this reducer's collectives (None: done), timed as ``grad_reduce``."""
        wait_work(work, self.timeline, "grad_reduce")

    def remove(self) -> None:
        """Remove the gradient hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []

"""Collectives used by the class-parallel head, one autograd.Function per pattern.

``all_gather_rows``      forward: all-gather of row blocks; backward: reduce-scatter (sum),
                         times ``grad_scale``.
``all_gather_no_grad``   all-gather of row blocks without autograd (labels).
``replicated_rows``      forward: identity (rows already identical on every rank); backward:
                         all-reduce (sum) of the partial gradients.

All return early when the group has one rank. gloo's all_gather needs equal sizes, so
blocks of different lengths are padded to the longest one; the row counts must then be
passed in (``sizes``), which keeps the collectives free of host synchronisation. That
padding rule lives in one place, :class:`PaddedGather` and :class:`PaddedReduceScatter`
(issue now, unpad after the wait), which the overlap schedule's asynchronous collectives
also use. :func:`all_reduce_mean_` is the one in-place mean of dense tensors (SUM
all-reduce, then / P), for the compression wrapper's dense path and the bucketed reducers.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ds_xc.parallel.groups import comm_device, group_rank, group_size, is_distributed

__all__ = ["all_gather_rows", "all_gather_no_grad", "replicated_rows", "exchange_sizes", "gather_flat",
           "reduce_scatter_flat", "PaddedGather", "PaddedReduceScatter", "gather_stacked", "merge_topk",
           "all_reduce_mean_", "all_reduce_sum_", "PendingMean", "scale_grad", "allreduce_bytes"]

def _flat_collective(new_name: str, old_name: str):
    """torch 2.13 renamed the flat-tensor collectives; older torch (>= 2.4) has the old names. Looked up at
    every call, not bound at import, so that a wrapper of torch.distributed's collectives (the device
    audit, ds_xc/parallel/device_audit.py) sees these calls too."""
    return getattr(dist, new_name, None) or getattr(dist, old_name)


def gather_flat(out: torch.Tensor, x: torch.Tensor, group=None, async_op: bool = False):
    """All-gather equal blocks ``x`` (n, ...) into ``out`` (P*n, ...), rank order."""
    return _flat_collective("all_gather_single", "all_gather_into_tensor")(out, x, group=group, async_op=async_op)


def reduce_scatter_flat(out: torch.Tensor, x: torch.Tensor, group=None, async_op: bool = False):
    """Sum ``x`` (P*n, ...) over ranks and keep this rank's block in ``out`` (n, ...)."""
    return _flat_collective("reduce_scatter_single", "reduce_scatter_tensor")(out, x, group=group,
                                                                                async_op=async_op)


def exchange_sizes(num_rows: int, group=None, device=None) -> list[int]:
    """All ranks' row counts (one small all-gather; a host sync, so call it outside hot loops).
    ``device``: where the count travels (None: where the group's backend takes tensors)."""
    if not is_distributed(group):
        return [num_rows]
    device = comm_device(group) if device is None else device
    out = gather_stacked(torch.tensor([num_rows], dtype=torch.int64, device=device), group)  # (P, 1)
    return [int(v) for v in out.view(-1).tolist()]


class PaddedGather:
    """All-gather of row blocks of different lengths, issued now, unpadded by :meth:`result`.

    gloo's all_gather needs equal blocks: each rank's (B_r, ...) block is padded with zeros to
    the longest, gathered flat into (P*rows, ...), and the padding is cut out again. ``sizes``:
    every rank's B_r (None: all equal to ``x.shape[0]``). With ``async_op`` the gather is left
    in flight (``work``); wait for it before :meth:`result`. ``nbytes``: this rank's input.
    """

    def __init__(self, x: torch.Tensor, group, sizes: Optional[Sequence[int]] = None, async_op: bool = False):
        self.sizes = list(sizes) if sizes is not None else None
        x = x.contiguous()
        self.rows = max(self.sizes) if self.sizes is not None else x.shape[0]
        if x.shape[0] != self.rows:  # pad to the common length
            x = torch.cat([x, x.new_zeros((self.rows - x.shape[0],) + tuple(x.shape[1:]))], 0)
        self.nbytes = x.numel() * x.element_size()
        self.out = x.new_empty((group_size(group) * self.rows,) + tuple(x.shape[1:]))  # (P*rows, ...)
        self.work = gather_flat(self.out, x, group=group, async_op=async_op)

    def result(self) -> torch.Tensor:
        """(sum_r B_r, ...) in rank order, once the gather is complete."""
        rows = self.rows
        if self.sizes is None or all(s == rows for s in self.sizes):
            return self.out
        return torch.cat([self.out[r * rows: r * rows + s] for r, s in enumerate(self.sizes)], 0)


class PaddedReduceScatter:
    """Sum over ranks of (sum_r B_r, ...), this rank's (B_r, ...) block kept; issued now.

    The padding rule of :class:`PaddedGather`: with uneven ``sizes`` each rank's block is
    copied into a zero-padded (P*rows, ...) input, so every rank receives ``rows`` rows and
    :meth:`result` keeps its first B_r. ``sizes`` None: equal blocks of ``g.shape[0] / P``.
    """

    def __init__(self, g: torch.Tensor, group, sizes: Optional[Sequence[int]] = None, rank: Optional[int] = None,
                 async_op: bool = False):
        world = group_size(group)
        self.keep = None
        g = g.contiguous()
        rows = g.shape[0] // world
        if sizes is not None:
            rows, self.keep = max(sizes), sizes[group_rank(group) if rank is None else rank]
            if any(s != rows for s in sizes):
                padded = g.new_zeros((world * rows,) + tuple(g.shape[1:]))
                offset = 0
                for r, s in enumerate(sizes):
                    padded[r * rows: r * rows + s] = g[offset: offset + s]
                    offset += s
                g = padded
        self.nbytes = g.numel() * g.element_size()
        self.out = g.new_empty((rows,) + tuple(g.shape[1:]))  # (rows, ...)
        self.work = reduce_scatter_flat(self.out, g, group=group, async_op=async_op)

    def result(self) -> torch.Tensor:
        """This rank's rows of the sum, (B_r, ...), once the reduce-scatter is complete."""
        return self.out if self.keep is None else self.out[: self.keep]


def gather_stacked(t: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather equal blocks: (n, ...) on each rank -> (P, n, ...), rank order."""
    world = group_size(group)
    out = t.new_empty((world * t.shape[0],) + tuple(t.shape[1:]))  # gloo wants a flat (P*n, ...)
    gather_flat(out, t.contiguous(), group=group)
    return out.view((world,) + tuple(t.shape))


def merge_topk(vals: torch.Tensor, ids: torch.Tensor, k: int, group=None) -> torch.Tensor:
    """Global top-k ids (n, k) from every rank's (n, k') candidates ``vals``/``ids`` for the same n
    rows (a class-sharded top-k): gathered to (n, P*k') in rank order, then the k best."""
    if is_distributed(group):
        n = vals.shape[0]
        vals = gather_stacked(vals, group).permute(1, 0, 2).reshape(n, -1)  # (P, n, k') -> (n, P*k')
        ids = gather_stacked(ids, group).permute(1, 0, 2).reshape(n, -1)
    return ids.gather(1, torch.topk(vals, k, dim=1).indices)


class PendingMean:
    """An in-place mean over a group: the SUM all-reduce, then the division by P after the wait."""

    def __init__(self, tensor: torch.Tensor, group, async_op: bool):
        self.tensor, self.world = tensor, group_size(group)
        self.work = None
        if is_distributed(group):
            self.work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
        self._divided = not is_distributed(group)  # one rank: the sum is the mean already
        if not async_op:
            self.wait()

    def wait(self, waiter: Optional[Callable] = None) -> torch.Tensor:
        """Wait for the sum (through ``waiter(work)`` when given, e.g. to time it), divide, return it."""
        if self.work is not None:
            waiter(self.work) if waiter is not None else self.work.wait()
            self.work = None
        if not self._divided:
            self.tensor.div_(self.world)
            self._divided = True
        return self.tensor


def allreduce_bytes(num_bytes: int, world: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-reduce of ``num_bytes``: 2 (P-1)/P of them."""
    return 2 * (world - 1) * num_bytes // world if world > 1 else 0


def all_reduce_sum_(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """``tensor`` becomes its sum over ``group``, in place (a no-op with one process); returns it."""
    if is_distributed(group):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_reduce_mean_(tensor: torch.Tensor, group=None, async_op: bool = False) -> PendingMean:
    """``tensor`` becomes its mean over ``group``, in place: a SUM all-reduce, then / P.

    The mean of dense gradients (the compression wrapper's dense path, the bucketed reducers).
    Returns a :class:`PendingMean`; with ``async_op`` the sum is left in flight and the tensor
    holds the mean only after ``wait()``, otherwise it is done on return."""
    return PendingMean(tensor, group, async_op)


class _AllGatherRows(torch.autograd.Function):
    """forward: all-gather rows; backward: reduce-scatter (sum) times grad_scale."""

    @staticmethod
    def forward(ctx, x, group, sizes, grad_scale):
        ctx.group, ctx.sizes, ctx.grad_scale = group, sizes, grad_scale
        return PaddedGather(x, group, sizes).result()

    @staticmethod
    def backward(ctx, grad):
        out = PaddedReduceScatter(grad, ctx.group, ctx.sizes).result()
        if ctx.grad_scale != 1.0:
            out = out * ctx.grad_scale
        return out, None, None, None


def all_gather_rows(x: torch.Tensor, group=None, sizes: Optional[Sequence[int]] = None,
                    grad_scale: float = 1.0) -> torch.Tensor:
    """Concatenate every rank's rows of ``x``: (B_r, d) -> (sum_r B_r, d), differentiable.

    The backward pass sums the gradient over ranks and returns this rank's rows,
    multiplied by ``grad_scale`` (the head uses N / B_r so that each rank receives the
    gradient of its *local* mean loss, the data-parallel convention). ``sizes`` lists
    every rank's row count when they differ (``None``: all equal to ``x.shape[0]``).
    """
    if not is_distributed(group):
        return x if grad_scale == 1.0 else _ScaleGrad.apply(x, grad_scale)
    return _AllGatherRows.apply(x, group, list(sizes) if sizes is not None else None, grad_scale)


def all_gather_no_grad(x: torch.Tensor, group=None, sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Concatenate every rank's rows of ``x`` (no autograd; for labels and evaluation)."""
    if not is_distributed(group):
        return x
    with torch.no_grad():
        return PaddedGather(x.detach(), group, sizes).result()


class _ReplicatedRows(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group (every rank gets the same sum)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()  # all_reduce works in place
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def replicated_rows(x: torch.Tensor, group=None) -> torch.Tensor:
    """Rows that are identical on every rank of ``group`` (tensor parallelism), used as they are.

    Each rank's loss depends on them through its own shard only, so its gradient is partial;
    the backward all-reduces (sums) it, so every rank receives the full gradient with respect
    to the shared rows: (B, d) -> (B, d), no copy in the forward."""
    if not is_distributed(group):
        return x
    return _ReplicatedRows.apply(x, group)


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` as it is, with its gradient multiplied by ``scale`` in backward (no-op for 1.0)."""
    return x if scale == 1.0 else _ScaleGrad.apply(x, float(scale))


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by a constant."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None

"""Collectives used by the class-parallel head, one autograd.Function per pattern.

``all_gather_rows``      forward: all-gather of row blocks; backward: reduce-scatter (sum),
                         times ``grad_scale``.
``all_gather_no_grad``   all-gather of row blocks without autograd (labels).

Both return early when the group has one rank. gloo's all_gather needs equal sizes, so
blocks of different lengths are padded to the longest one; the row counts must then be
passed in (``sizes``), which keeps the collectives free of host synchronisation.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ds_xc.parallel.groups import group_rank, group_size, is_distributed

__all__ = ["all_gather_rows", "all_gather_no_grad", "exchange_sizes", "gather_flat", "reduce_scatter_flat"]

# torch 2.13 renamed the flat-tensor collectives; keep older torch (>= 2.4) working too
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def gather_flat(out: torch.Tensor, x: torch.Tensor, group=None, async_op: bool = False):
    """All-gather equal blocks ``x`` (n, ...) into ``out`` (P*n, ...), rank order."""
    return _ALL_GATHER(out, x, group=group, async_op=async_op)


def reduce_scatter_flat(out: torch.Tensor, x: torch.Tensor, group=None, async_op: bool = False):
    """Sum ``x`` (P*n, ...) over ranks and keep this rank's block in ``out`` (n, ...)."""
    return _REDUCE_SCATTER(out, x, group=group, async_op=async_op)


def exchange_sizes(num_rows: int, group=None, device=None) -> list[int]:
    """All ranks' row counts (one small all-gather; a host sync, so call it outside hot loops)."""
    if not is_distributed(group):
        return [num_rows]
    t = torch.tensor([num_rows], dtype=torch.int64, device=device)
    out = torch.empty(group_size(group), dtype=torch.int64, device=device)
    gather_flat(out, t, group=group)
    return [int(v) for v in out.tolist()]


def _gather(x: torch.Tensor, group, sizes: Optional[Sequence[int]]) -> torch.Tensor:
    """(B_r, ...) on each rank -> (sum_r B_r, ...) in rank order."""
    world = group_size(group)
    x = x.contiguous()
    rows = max(sizes) if sizes is not None else x.shape[0]
    if x.shape[0] != rows:  # pad to the common length
        pad = x.new_zeros((rows - x.shape[0],) + tuple(x.shape[1:]))
        x = torch.cat([x, pad], 0)
    out = x.new_empty((world * rows,) + tuple(x.shape[1:]))
    gather_flat(out, x, group=group)
    if sizes is None or all(s == rows for s in sizes):
        return out
    return torch.cat([out[r * rows: r * rows + s] for r, s in enumerate(sizes)], 0)


def _reduce_scatter(g: torch.Tensor, group, sizes: Optional[Sequence[int]]) -> torch.Tensor:
    """(sum_r B_r, ...) on each rank -> this rank's (B_r, ...) block of the sum over ranks."""
    world, rank = group_size(group), group_rank(group)
    g = g.contiguous()
    if sizes is None:
        rows = g.shape[0] // world
        out = g.new_empty((rows,) + tuple(g.shape[1:]))
        reduce_scatter_flat(out, g, group=group)
        return out
    rows = max(sizes)
    padded = g.new_zeros((world * rows,) + tuple(g.shape[1:]))
    offset = 0
    for r, s in enumerate(sizes):
        padded[r * rows: r * rows + s] = g[offset: offset + s]
        offset += s
    out = g.new_empty((rows,) + tuple(g.shape[1:]))
    reduce_scatter_flat(out, padded, group=group)
    return out[: sizes[rank]]


class _AllGatherRows(torch.autograd.Function):
    """forward: all-gather rows; backward: reduce-scatter (sum) times grad_scale."""

    @staticmethod
    def forward(ctx, x, group, sizes, grad_scale):
        ctx.group, ctx.sizes, ctx.grad_scale = group, sizes, grad_scale
        return _gather(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        out = _reduce_scatter(grad, ctx.group, ctx.sizes)
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
        return _gather(x.detach(), group, sizes)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by a constant."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None

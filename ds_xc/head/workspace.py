"""Scratch buffers the head keeps between steps, and the gather of the active weight rows.

Each step of a sampled head needs an (n, K) logits scratch and a (K, d) copy of its K active
weight rows. Allocated fresh, every step pays the page faults of new memory on CPU (glibc hands
blocks of more than 32 MiB, and freed ones above its trim threshold, back to the system): 39,000
minor faults and about 65 ms per step for the ANN head at 10^6 classes on one core, 7% of its
step. :class:`Workspace` keeps buffers up to ``keep_bytes`` (256 MiB) each and hands them out again;
larger ones (an exact head's scratch over the columns of a large shard) stay transient so that
the memory is free for the backbone between steps. 256 MiB holds a sampled head's one-chunk
logits at its defaults (the global batch in one chunk: 512 x 10^5 float32 is 195 MiB), the
fastest layout of its matmuls; the memory is what each step allocates anyway, held between steps
as CUDA's caching allocator holds it. On CUDA the workspace changes nothing but the bookkeeping.

A buffer handed out is only valid until the next request of the same name: the callers use them
as scratch inside one forward (the fused loss reads the active rows and the logits during its
forward only; its backward reads the gradients it stored).
"""
from __future__ import annotations

import math

import torch

from ds_xc_ops import rows as native_rows

__all__ = ["Workspace", "KEEP_BYTES", "gather_rows"]

KEEP_BYTES = 256 << 20  # largest buffer kept between steps


class Workspace:
    """Named scratch buffers reused across calls (see the module docstring)."""

    def __init__(self, keep_bytes: int = KEEP_BYTES):
        self.keep_bytes = int(keep_bytes)
        self._kept: dict[str, torch.Tensor] = {}

    def buffer(self, name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised contiguous tensor of ``shape``: the kept one of ``name`` when it fits,
        else a new one (kept if at most ``keep_bytes``, and not made under ``torch.inference_mode``)."""
        numel = math.prod(int(s) for s in shape)
        if torch.is_inference_mode_enabled():  # a tensor made now is an inference tensor, and one handed out now
            return torch.empty(shape, dtype=dtype, device=device)  # could become one: transient, nothing kept
        kept = self._kept.get(name)
        if kept is not None and kept.dtype == dtype and kept.device == torch.device(device) \
                and kept.numel() >= numel:
            return kept[:numel].view(shape)
        if not self.keeps(shape, dtype):
            self._kept.pop(name, None)
            return torch.empty(shape, dtype=dtype, device=device)
        kept = torch.empty(numel, dtype=dtype, device=device)
        self._kept[name] = kept
        return kept.view(shape)

    def keeps(self, shape: tuple, dtype: torch.dtype) -> bool:
        """Whether a buffer of ``shape`` and ``dtype`` would be kept (at most ``keep_bytes``)."""
        return math.prod(int(s) for s in shape) * dtype.itemsize <= self.keep_bytes

    def clear(self) -> None:
        """Free every kept buffer (e.g. before a memory-hungry phase)."""
        self._kept.clear()

    def kept_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._kept.values())


class _GatherRows(torch.autograd.Function):
    """weight[index] into a workspace buffer; the gradient goes back row-sparse (as
    ``F.embedding(sparse=True)``: a COO tensor over ``index``, marked coalesced when ``distinct``) or dense."""

    @staticmethod
    def forward(ctx, weight, index, sparse, workspace, distinct=False):
        ctx.index, ctx.sparse, ctx.shape, ctx.distinct = index, sparse, weight.shape, distinct
        shape = (index.numel(),) + tuple(weight.shape[1:])
        out = workspace.buffer("active_rows", shape, weight.dtype, weight.device) if workspace is not None \
            else torch.empty(shape, dtype=weight.dtype, device=weight.device)
        native_rows.gather_rows(weight.detach(), index, out)
        # a tensor of its own over the buffer's storage (not a view of it), so autograd's graph
        # metadata is never attached to the kept buffer
        return torch.empty(0, dtype=out.dtype, device=out.device).set_(out.untyped_storage(),
                                                                        out.storage_offset(), out.shape, out.stride())

    @staticmethod
    def backward(ctx, grad):
        if ctx.sparse:
            # the rows are the sampler's ids, in range by construction: no invariant check (as F.embedding);
            # sorted and distinct ids make a coalesced tensor as they are (no sort, no host sync later)
            g = torch.sparse_coo_tensor(ctx.index.view(1, -1), grad, ctx.shape, check_invariants=False,
                                        is_coalesced=ctx.distinct)
        elif ctx.distinct:  # distinct rows: a copy, no accumulation (deterministic on every device)
            g = grad.new_zeros(ctx.shape).index_copy_(0, ctx.index, grad)
        else:
            g = grad.new_zeros(ctx.shape).index_add_(0, ctx.index, grad)
        return g, None, None, None, None


def gather_rows(weight: torch.Tensor, index: torch.Tensor, sparse: bool, workspace: Workspace | None = None,
                distinct: bool = False):
    """(K, d) = weight[index] with autograd: the gradient flows back into ``weight`` row-sparse
    (``sparse``) or dense, as ``F.embedding(index, weight, sparse=sparse)`` would send it. With a
    ``workspace`` the rows land in its kept buffer (valid until the next call). ``distinct``: the ids
    are sorted and distinct (a sampler's active set), so the sparse gradient is coalesced as built."""
    return _GatherRows.apply(weight, index, bool(sparse), workspace, bool(distinct))

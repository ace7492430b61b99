"""Summing rows into a tensor at repeated indices, deterministically on every device.

``target[index[i]] += rows[i]`` with repeated indices is a race on a GPU when done by ``index_add_``: its
CUDA kernel adds with atomics in whatever order the threads run, so two runs of a step differ in their
last bits. ``index_put_(..., accumulate=True)`` sorts the indices on a GPU and sums each run of equal
indices in order: deterministic there. On a CPU it is the other way round: ``index_put_`` with
accumulate adds float rows with parallel atomics (two threads already give other bits from run to run,
measured), while ``index_add_`` runs serially in index order. :func:`add_rows_` takes the deterministic
one for the device (:data:`SORTED_DEVICES`: CUDA, and meta, on which tests read which op a GPU runs).
"""
from __future__ import annotations

import torch

__all__ = ["add_rows_", "SORTED_DEVICES"]

SORTED_DEVICES = ("cuda", "meta")  # devices whose index_put_(accumulate=True) sorts (deterministic)


def add_rows_(target: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """target (R, d) += rows (n, d) at rows index (n,) (repeats summed), in place, deterministically."""
    if target.device.type in SORTED_DEVICES:
        return target.index_put_((index,), rows, accumulate=True)
    return target.index_add_(0, index, rows)

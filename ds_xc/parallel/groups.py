"""Rank and size of an explicit process group, with a single-process fallback.

Every ds_xc component takes ``group`` as an argument. ``None`` means the default (world)
group when torch.distributed is initialised, and a single process otherwise, so the
same code runs in a notebook and under the DeepSpeed launcher.
"""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist

ProcessGroup = Optional["dist.ProcessGroup"]


def is_distributed(group: ProcessGroup = None) -> bool:
    """True when collectives on ``group`` involve more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def group_size(group: ProcessGroup = None) -> int:
    """Number of ranks in ``group`` (1 without torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def group_rank(group: ProcessGroup = None) -> int:
    """This process's rank inside ``group`` (0 without torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)

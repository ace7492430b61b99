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


_COMM_TIMEOUT_S: list = [None]  # set by ds_xc.init_distributed (or set_comm_timeout); None: torch's default


def set_comm_timeout(seconds: Optional[float]) -> None:
    """The timeout of the process groups ds_xc creates (:func:`new_group`): the world's, normally.

    torch gives a new group its own default (30 minutes for gloo), not the timeout the world
    group was started with, so a stopped peer would hold a collective on it that long.
    ``ds_xc.engine.init_distributed`` calls this; call it yourself if you start torch.distributed."""
    _COMM_TIMEOUT_S[0] = None if seconds is None else float(seconds)


def new_group(ranks=None, backend=None):
    """``dist.new_group`` with the timeout of :func:`set_comm_timeout` (collective: every rank calls it)."""
    import datetime
    timeout = None if _COMM_TIMEOUT_S[0] is None else datetime.timedelta(seconds=_COMM_TIMEOUT_S[0])
    return dist.new_group(ranks=ranks, backend=backend, timeout=timeout)


def world_rank_and_size() -> tuple[int, int]:
    """(rank, size) of this process in the world; (0, 1) without torch.distributed.

    For naming per-rank files (RNG states, manifest shares) and for messages only: a
    collective still takes its explicit group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def copy_group(group: ProcessGroup = None):
    """A new process group with the same ranks as ``group`` (None: the world), on the same
    backend and with the timeout of :func:`set_comm_timeout`; None in a single process.

    Traffic on the copy never queues behind collectives on ``group`` (collective: every
    rank calls it)."""
    if not is_distributed(group):
        return None
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    return new_group(ranks=ranks, backend=dist.get_backend(group))

"""``topology.reduction = auto``: time the flat and the hierarchical all-reduce on a probe, keep the faster.

Whether the hierarchical scheme pays depends on the links, not on the layout alone: behind a slow
inter-node link it cuts the bytes crossing the nodes (docs/multinode.md), on fast links its three
stages cost more than one flat ring. So at ``ds_xc.initialize``, on a layout where the scheme
applies, every rank of the group reduces a probe of the configured bucket size (``numel``
float32) both ways, alternating (the machine's load drifts), ``repeats`` times after one warm-up
each. A repeat's time is the slowest rank's (one MAX all-reduce of every rank's times, a tensor
of the same shape on every rank); the group's first rank compares the medians and broadcasts the
choice, so every rank uses the same mode even where the clocks disagree. Hierarchical is kept
only when its median is below ``margin`` times the flat one (flat, DeepSpeed's own reduction, wins
ties). ``measure`` (tests) replaces the timing of one reduction: ``measure(mode, buffer) -> s``.
"""
from __future__ import annotations

import logging
import statistics
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ds_xc.parallel.groups import comm_device, group_rank, group_ranks, group_size

log = logging.getLogger(__name__)

__all__ = ["probe_reduction", "time_one"]

MODES = ("flat", "hierarchical")
MARGIN = 0.95  # hierarchical must be at least 5% faster than flat to be chosen


def time_one(hier, group, mode: str, buf: torch.Tensor) -> float:
    """Seconds of one mean of ``buf`` over ``group`` (flat: one all-reduce; hierarchical: ``hier``), from a barrier."""
    dist.barrier(group=group)
    start = time.perf_counter()
    if mode == "flat":
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
        buf.div_(group_size(group))
    else:
        hier.mean_(buf)
    if buf.is_cuda:  # NCCL returns before the reduction ends: time it to the end
        torch.cuda.synchronize(buf.device)
    return time.perf_counter() - start


def probe_reduction(hier, group, numel: int, repeats: int, measure: Optional[Callable] = None,
                    margin: float = MARGIN, label: str = "reduction") -> tuple[str, dict]:
    """('flat' or 'hierarchical', {mode: median seconds of the slowest rank}) agreed by every rank of ``group``.

    Collective over ``group`` (every rank calls it with the same ``numel`` and ``repeats``). ``measure``
    also serves other flat-vs-hierarchical choices (the head's row exchange, ``label`` names it in the log)."""
    if measure is None:
        def measure(mode, buf):
            return time_one(hier, group, mode, buf)
    dev = comm_device(group)
    probe = torch.randn(max(int(numel), 1), generator=torch.Generator().manual_seed(group_rank(group))).to(dev)  # (numel,)
    times = torch.zeros(len(MODES), repeats, dtype=torch.float64, device=dev)  # (modes, repeats)
    for it in range(repeats + 1):  # the first round warms up (connections, allocations)
        for mode in (MODES if it % 2 == 0 else MODES[::-1]):
            took = float(measure(mode, probe.clone()))
            if it > 0:
                times[MODES.index(mode), it - 1] = took
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)  # each repeat: the slowest rank
    medians = {mode: statistics.median(times[m].tolist()) for m, mode in enumerate(MODES)}
    choice = torch.tensor([1 if medians["hierarchical"] < margin * medians["flat"] else 0], dtype=torch.int64,
                          device=dev)
    dist.broadcast(choice, src=group_ranks(group)[0], group=group)  # the first rank's decision, for every rank
    mode = MODES[int(choice)]
    log.info("topology: auto probe of the %s, %d float32 (median of %d, slowest rank): flat %.4f s, hierarchical "
             "%.4f s -> %s", label, numel, repeats, medians["flat"], medians["hierarchical"], mode)
    return mode, medians

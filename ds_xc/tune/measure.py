"""Measuring one candidate: a few real head steps (speed, memory) and the sampler's recall.

The head is built as a job builds it (``ClassParallelHead.from_config`` and
``build_head_optimizer`` on the candidate's ``extreme_classification`` section, on the head's
group), and trained for ``warmup + steps`` steps on embeddings the caller supplies (launch/tune.py:
the user's data set through its backbone at initialisation, frozen, so that every candidate sees
the same inputs). One step = forward (input check, gathers, sampler: index upkeep, retrieval,
active set), backward, optimizer step; its wall time is the median over the timed steps, and the
max over the ranks of the group. The index build at the first step is timed apart and amortised
over ``rebuild_interval`` as the time model does.

The head lives on the device of the embeddings (``batch_device``: the rank's GPU in a GPU job,
launch/tune.py moves them there), and each step is timed to the end of its work on that device
(ds_xc/cost/timing.py). Memory per rank is that device's: on a GPU torch's allocator
(``memory_allocated``; peak ``max_memory_allocated``, reset before the timed steps), on the CPU
/proc/self/status; persistent = the memory after the warm-up less the memory before the head was
built (weights, optimizer state, index); peak = the high-water mark (VmHWM, reset through
/proc/self/clear_refs, on the CPU) over the timed steps less the same baseline.

Recall: after the steps, on held-out batches, the sampler's active set for each gathered batch
(built under no_grad, so no step is counted and the index is not changed) against the exact
top-10 over all classes (``ds_xc.sampling.metrics.active_set_quality``, the library's own metric:
``recall_active@10``; ``recall_retrieved@10`` for the ANN sampler's retrieved lists).
"""
from __future__ import annotations

import copy
import gc
import logging
import math
import statistics
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

from ds_xc.cost.timing import timed
from ds_xc.head import ClassParallelHead, build_head_optimizer
from ds_xc.parallel.groups import comm_device, is_distributed
from ds_xc.sampling.metrics import active_set_quality

log = logging.getLogger(__name__)

__all__ = ["rss_bytes", "hwm_bytes", "reset_peak", "measure_candidate", "sampler_recall", "one_step", "batch_device",
           "device_bytes", "device_peak_bytes", "reset_device_peak"]


def _status_kib(name: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(name + ":"):
                return int(line.split()[1])
    return 0


def rss_bytes() -> int:
    """Resident set size of this process now."""
    return _status_kib("VmRSS") * 1024


def hwm_bytes() -> int:
    """Peak resident set size since the last ``reset_peak`` (or the start)."""
    return _status_kib("VmHWM") * 1024


def reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux: writing 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:  # not Linux, or not permitted: the peak then counts from the start
        pass


def batch_device(train_batch: Callable[[int], tuple]) -> torch.device:
    """The device of the embeddings ``train_batch`` yields: where a measured head is built (a GPU job's
    embeddings are on the rank's GPU, so its heads, their collectives and their memory are too)."""
    return train_batch(0)[0].device


def device_bytes(device: torch.device) -> int:
    """Memory held now on ``device``: torch's allocated bytes on a GPU, the process's RSS on the CPU."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else rss_bytes()


def device_peak_bytes(device: torch.device) -> int:
    """The high-water mark on ``device`` since :func:`reset_device_peak`."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else hwm_bytes()


def reset_device_peak(device: torch.device) -> None:
    """Start a new high-water mark on ``device`` (torch's allocator statistics, or VmHWM)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_peak()


def release_free_memory() -> None:
    """Collect garbage and hand freed heap pages back to the system (glibc malloc_trim), so that
    the next baseline RSS does not include a previous candidate's freed tensors."""
    gc.collect()
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def tensor_bytes(head: ClassParallelHead, opt) -> dict:
    """Bytes of the tensors a head holds between steps, by component: its weight, the optimizer
    state (lazy_exact bookkeeping included), the sampler's index or graph."""
    def nbytes(obj) -> int:
        if isinstance(obj, torch.Tensor):
            return obj.numel() * obj.element_size()
        if isinstance(obj, dict):
            return sum(nbytes(v) for v in obj.values())
        if isinstance(obj, (list, tuple)):
            return sum(nbytes(v) for v in obj)
        return 0
    index = getattr(head.sampler, "index", None)
    sampler = nbytes(vars(index)) if index is not None else nbytes(getattr(head.sampler, "graph", None))
    return {"head_weight": nbytes(head.weight), "head_optimizer": nbytes(dict(opt.state)), "sampler": sampler}


def _max_over(values: list, group) -> list:
    """Element-wise max of a few floats over the head's group (every rank calls it)."""
    t = torch.tensor(values, dtype=torch.float64, device=comm_device(group))
    if is_distributed(group):
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


@torch.no_grad()
def sampler_recall(head: ClassParallelHead, batches: Iterable, k: int = 10) -> dict:
    """Mean recall_active@k (and recall_retrieved@k for ANN) of the head's sampler over held-out
    (embeddings, labels) batches of this rank; collective over the head's group."""
    head.catch_up()
    sums, count = {}, 0
    for x, y in batches:
        verdict = head.check_batch(x, y, None)
        xg, yg = head.gather(x, y, verdict.sizes)  # (N, d), (N,)
        active = head.sampler.sample(yg, xg if head.sampler.needs_embeddings else None, head.weight)
        retrieved = getattr(head.sampler, "last_retrieved", None) if head.sampler_config.type == "ann" else None
        q = active_set_quality(xg, head.weight, head.class_start, active, head.loss_fn.normalised,
                               head.loss_fn.scale, retrieved=retrieved, k=k, group=head.group)
        for key, value in q.items():
            sums[key] = sums.get(key, 0.0) + float(value)
        count += 1
    return {key: value / max(count, 1) for key, value in sums.items()}


def one_step(head, opt, x, y) -> float:
    """Seconds of one training step of ``head``: forward, backward, optimizer step (the probe's
    steps and the measured ones are the same code), to the end of its work on the head's device."""
    def step():
        head(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return timed(step, head.weight.device)


def measure_candidate(section: dict, train_batch: Callable[[int], tuple], eval_batches: Callable[[], Iterable],
                      *, steps: int = 4, warmup: int = 2, group=None, recall: bool = True,
                      init_weight: Optional[torch.Tensor] = None, sampler_state: Optional[dict] = None,
                      build_s: Optional[float] = None) -> dict:
    """Build the head of ``section`` (an extreme_classification dict) on ``group``, train it for
    ``warmup + steps`` steps on ``train_batch(step) -> (x (B, d), y (B,))`` of this rank, and return
    the median step time, the amortised index build, memory per rank and the sampler recall on
    ``eval_batches()``. Every rank of the group calls it with its own batches. ``init_weight`` (this
    rank's shard) replaces the initial weights; ``sampler_state`` (an ANN sampler's state_dict built
    on those weights) and its ``build_s`` replace the index build."""
    release_free_memory()
    device = batch_device(train_batch)
    baseline = device_bytes(device)
    head = ClassParallelHead.from_config(section, group=group, device=device)
    opt = build_head_optimizer(head, section.get("optimizer", {}))
    if init_weight is not None:  # this rank's shard of shared trained weights
        with torch.no_grad():
            head.weight.copy_(init_weight)
    if sampler_state is not None:  # the index of those weights, built once by the screen
        head.sampler.load_state_dict(copy.deepcopy(sampler_state))  # a copy: the steps re-encode rows
    elif hasattr(head.sampler, "rebuild"):  # the first step's index build, timed apart
        build_s = timed(head.rebuild_index, device)
    build_s = build_s or 0.0
    times = []
    for i in range(warmup + steps):
        x, y = train_batch(i)
        if i == warmup:
            reset_device_peak(device)
        dt = one_step(head, opt, x.detach().requires_grad_(True), y)
        if i >= warmup:
            times.append(dt)
    peak = device_peak_bytes(device) - baseline
    release_free_memory()  # the steps' freed buffers are the allocator's, not the head's: handed back first
    persistent = device_bytes(device) - baseline  # what the head holds between steps
    every = getattr(head.sampler_config, "rebuild_interval", 0)
    tensors = tensor_bytes(head, opt)
    step_s, step_min = statistics.median(times), min(times)
    step_s, step_min, build_s, persistent, peak, held = _max_over(
        [step_s, step_min, build_s, float(persistent), float(peak), float(sum(tensors.values()))], group)
    recall = sampler_recall(head, eval_batches()) if recall else {}
    stats = head.sampler_stats()
    amortise = build_s / every if every else 0.0
    out = {"step_s": step_s, "step_min_s": step_min, "build_s": build_s, "amortised_s": step_s + amortise,
           "amortised_min_s": step_min + amortise, "persistent_bytes": persistent, "peak_bytes": peak,
           "tensor_bytes": held, "tensors": tensors, "steps": steps,
           "recall": recall.get("recall_active@10", 1.0), "recall_retrieved": recall.get("recall_retrieved@10"),
           "softmax_mass": recall.get("softmax_mass"), "active": stats.get("active"),
           "num_local": head.num_local, "update": head.update}
    del head, opt
    release_free_memory()
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}

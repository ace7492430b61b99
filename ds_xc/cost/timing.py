"""Wall time of work on the device it runs on.

A GPU runs kernels (NCCL collectives included) asynchronously: a host clock read right after a
launch measures the launch (microseconds), not the work. :func:`timed` synchronises the device
before starting the clock and before stopping it; on the CPU it is a plain ``perf_counter``.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch

__all__ = ["synchronize", "timed", "best_time"]


def synchronize(device: Optional[torch.device]) -> None:
    """Wait for the work queued on ``device`` (a no-op for the CPU and None)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: Optional[torch.device] = None) -> float:
    """Seconds ``fn()`` takes on ``device``, its queued work included."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def best_time(fn: Callable[[], object], device: Optional[torch.device] = None, repeats: int = 4) -> float:
    """The fastest of ``repeats`` timed runs after a warm-up: on a shared machine the minimum is the
    estimate least disturbed by other processes (the tuner compares it with the fastest step)."""
    fn()  # warm-up: allocator, thread pool, code pages, kernel compilation
    return min(timed(fn, device) for _ in range(repeats))

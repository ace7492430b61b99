"""Per-step timeline of the overlap pipeline: compute, communication issued, communication exposed.

Exposed communication is the time the step spends *waiting* for a collective, the
part that the schedule failed to hide; compute is the rest of the step. On CPU the
waits are host waits on async work handles (``work.wait()`` blocks until the data is
there), so the host clock measures them directly. On GPU a wait only makes the
current stream wait, so each wait is bracketed by two CUDA events and resolved when
the step ends (one synchronisation per step, only for steps that are read).

Collecting costs two clock reads per collective; nothing is logged unless asked.
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Optional

import torch

__all__ = ["Timeline", "wait_work"]


class Timeline:
    """Accumulates one step's communication record, then the totals over all steps."""

    def __init__(self, device: Optional[torch.device] = None):
        self.cuda = device is not None and torch.device(device).type == "cuda"
        self.steps = 0
        self.totals: dict = defaultdict(float)
        self.last: dict = {}
        self._reset()

    def _reset(self) -> None:
        self._t0: Optional[float] = None
        self._exposed: dict = defaultdict(float)
        self._issued: dict = defaultdict(int)
        self._bytes: dict = defaultdict(int)
        self._events: list = []  # (kind, start event, end event) on GPU

    def begin_step(self) -> None:
        self._reset()
        self._t0 = time.perf_counter()

    def issued(self, kind: str, nbytes: int) -> None:
        """A collective of ``nbytes`` (this rank's input) was issued."""
        self._issued[kind] += 1
        self._bytes[kind] += int(nbytes)

    def wait(self, work, kind: str) -> None:
        """Wait for ``work`` (an async handle, or None for finished work); the wait is exposed time."""
        if work is None:
            return
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work.wait()
            end.record()
            self._events.append((kind, start, end))
            return
        t = time.perf_counter()
        work.wait()
        self._exposed[kind] += time.perf_counter() - t

    def end_step(self) -> dict:
        """Close the step; returns {step_s, compute_s, exposed_s, issued, issued_mb, exposed_<kind>_s}."""
        if self._t0 is None:
            return {}
        if self._events:
            torch.cuda.synchronize()
            for kind, start, end in self._events:
                self._exposed[kind] += start.elapsed_time(end) / 1000.0
        step = time.perf_counter() - self._t0
        exposed = sum(self._exposed.values())
        rec = {"step_s": step, "compute_s": max(step - exposed, 0.0), "exposed_s": exposed,
               "issued": sum(self._issued.values()), "issued_mb": sum(self._bytes.values()) / 2**20}
        for kind, value in self._exposed.items():
            rec[f"exposed_{kind}_s"] = value
        for key, value in rec.items():
            self.totals[key] += value
        self.steps += 1
        self.last = rec
        self._t0 = None
        return rec

    def summary(self) -> dict:
        """Mean per step over all closed steps (plus ``steps``)."""
        out = {k: v / max(self.steps, 1) for k, v in self.totals.items()}
        out["steps"] = self.steps
        return out

    @staticmethod
    def format(rec: dict) -> str:
        if not rec:
            return "no step recorded"
        parts = [f"step {rec['step_s'] * 1e3:.1f} ms", f"compute {rec['compute_s'] * 1e3:.1f} ms",
                 f"exposed comm {rec['exposed_s'] * 1e3:.1f} ms"]
        kinds = sorted(k for k in rec if k.startswith("exposed_") and k != "exposed_s")
        if kinds:
            parts.append("(" + ", ".join(f"{k[8:-2]} {rec[k] * 1e3:.1f}" for k in kinds) + ")")
        parts.append(f"{rec['issued']:.0f} collectives issued, {rec['issued_mb']:.2f} MiB")
        return ", ".join(parts)


def wait_work(work, timeline: Optional[Timeline], kind: str) -> None:
    """Wait for ``work`` (None: finished), recording the wait in ``timeline`` when there is one."""
    if work is None:
        return
    if timeline is not None:
        timeline.wait(work, kind)
    else:
        work.wait()

"""Per-step timeline of the overlap pipeline: compute, communication issued, communication exposed.

Exposed communication is the time the step spends *waiting* for a collective, the
part that the schedule failed to hide; compute is the rest of the step. On CPU the
waits are host waits on async work handles (``work.wait()`` blocks until the data is
there), so the host clock measures them directly. On GPU a wait only makes the
current stream wait, so each wait is bracketed by two CUDA events and resolved when
the step's events are done: checked without blocking when later steps end, and waited
for (on those events, never the whole device) only when a record is read or the backlog
of pending steps exceeds its bound.

Collecting costs two clock reads per collective; nothing is logged unless asked. On the
parallel floor because the overlap pipeline and the compressed transport both wait on
async work through :func:`wait_work`.
"""
from __future__ import annotations

import time
from collections import defaultdict, deque
from typing import Optional

import torch

__all__ = ["Timeline", "wait_work"]


class Timeline:
    """Accumulates one step's communication record, then the totals over all steps.

    On GPU a closed step whose events have not all completed stays pending (at most
    ``max_pending`` steps; the oldest then waits on its own events, never on the whole
    device). Pending steps are resolved when their events are done (checked without
    blocking at every ``end_step``), when a record is read (``last``, ``totals``,
    ``summary()``, ``flush()``) or when ``end_step(read=True)`` asks for the step's record.
    """

    def __init__(self, device: Optional[torch.device] = None, max_pending: int = 64):
        if max_pending < 1:
            raise ValueError(f"Timeline max_pending={max_pending}: must be >= 1")
        self.cuda = device is not None and torch.device(device).type == "cuda"
        self.max_pending = int(max_pending)
        self.steps = 0  # closed steps, resolved or pending
        self._totals: dict = defaultdict(float)
        self._last: dict = {}
        self._pending: deque = deque()  # (partial record, [(kind, start, end)]) of closed GPU steps
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

    @property
    def in_step(self) -> bool:
        """True between :meth:`begin_step` and :meth:`end_step` (a caller that finds no step open
        opens and closes its own)."""
        return self._t0 is not None

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

    def end_step(self, read: bool = False) -> Optional[dict]:
        """Close the step. Returns its record {step_s, compute_s, exposed_s, issued, issued_mb,
        exposed_<kind>_s} once known: always on CPU; on GPU when its events are done, or with
        ``read=True`` (which waits for them); else None (the step stays pending). {} when no
        step was open."""
        if self._t0 is None:
            return {}
        rec = {"step_s": time.perf_counter() - self._t0, "issued": sum(self._issued.values()),
               "issued_mb": sum(self._bytes.values()) / 2**20, "_exposed": dict(self._exposed)}
        events, self._events, self._t0 = self._events, [], None
        self.steps += 1
        self._pending.append((rec, events))
        self._resolve(block=False)
        if read:
            self.flush()
        while len(self._pending) > self.max_pending:  # bounded backlog: wait for the oldest step only
            self._resolve_one(block=True)
        return None if any(r is rec for r, _ in self._pending) else self._last

    def _resolve_one(self, block: bool) -> bool:
        """Resolve the oldest pending step; with ``block`` False only if its events are done."""
        rec, events = self._pending[0]
        if not block and not all(end.query() for _, _, end in events):
            return False
        for _, _, end in events:
            end.synchronize()  # this event only (a no-op when done), not the device
        exposed = rec.pop("_exposed")
        for kind, start, end in events:
            exposed[kind] = exposed.get(kind, 0.0) + start.elapsed_time(end) / 1000.0
        total = sum(exposed.values())
        rec["compute_s"], rec["exposed_s"] = max(rec["step_s"] - total, 0.0), total
        for kind, value in exposed.items():
            rec[f"exposed_{kind}_s"] = value
        for key, value in rec.items():
            self._totals[key] += value
        self._last = rec
        self._pending.popleft()
        return True

    def _resolve(self, block: bool) -> None:
        while self._pending and self._resolve_one(block):
            pass

    def flush(self) -> None:
        """Resolve every pending step (waits for their events)."""
        self._resolve(block=True)

    @property
    def last(self) -> dict:
        """The record of the last closed step (resolves pending steps)."""
        self.flush()
        return self._last

    @property
    def totals(self) -> dict:
        """Sums over all closed steps (resolves pending steps)."""
        self.flush()
        return self._totals

    def summary(self) -> dict:
        """Mean per step over all closed steps (plus ``steps``)."""
        totals = self.totals
        out = {k: v / max(self.steps, 1) for k, v in totals.items()}
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

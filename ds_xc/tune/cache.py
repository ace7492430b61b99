"""The tuner's measurement cache: one JSON file, so that an interrupted run resumes.

Entries are keyed by the context (a hash of everything a measurement depends on besides the
candidate: the user's config without the tuned keys, the world size, the global batch, the
data set, the steps measured, the library version) and the candidate's key. The file is
rewritten atomically after every measurement (a temporary file, then os.replace), so a run
killed mid-write leaves the previous version; only rank 0 writes it, every rank reads what
rank 0 loaded (``load_shared``).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Optional

import torch.distributed as dist

from ds_xc.parallel.groups import is_distributed

log = logging.getLogger(__name__)

__all__ = ["MeasurementCache", "context_key"]


def context_key(context: dict) -> str:
    """A stable hash of a JSON-able dict."""
    return hashlib.sha1(json.dumps(context, sort_keys=True, default=str).encode()).hexdigest()[:16]


class MeasurementCache:
    """{context key: {candidate key: measurement}} in ``path`` (None: in memory only)."""

    def __init__(self, path: Optional[str], context: dict, writer: bool = True):
        self.path, self.context, self.writer = path, context, writer
        self.ctx = context_key(context)
        self.data: dict = {}
        self.hits = 0

    def load(self) -> "MeasurementCache":
        if self.path and os.path.exists(self.path):
            try:
                with open(self.path) as fh:
                    self.data = json.load(fh)
            except (OSError, json.JSONDecodeError) as exc:  # a damaged cache is a fresh start, said once
                log.warning("tuner cache %s unreadable (%s); starting without it", self.path, exc)
                self.data = {}
        return self

    def load_shared(self, group=None) -> "MeasurementCache":
        """Rank 0 of ``group`` reads the file and sends it to the others."""
        if not is_distributed(group):
            return self.load()
        box = [self.load().data if dist.get_rank(group=group) == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0, group=group)
        self.data = box[0] or {}
        return self

    def entries(self) -> dict:
        return self.data.get(self.ctx, {}).get("measurements", {})

    def get(self, cand) -> Optional[dict]:
        got = self.entries().get(cand.key())
        if got is not None:
            self.hits += 1
        return got

    def put(self, cand, measurement: dict) -> None:
        slot = self.data.setdefault(self.ctx, {"context": self.context, "measurements": {}})
        slot["measurements"][cand.key()] = dict(measurement, label=cand.label())
        self.save()

    def get_screen(self, cand) -> Optional[float]:
        return self.data.get(self.ctx, {}).get("screen", {}).get(cand.key())

    def put_screens(self, pairs: list) -> None:
        """[(candidate, screened recall)] at once (the screen runs before any measurement)."""
        slot = self.data.setdefault(self.ctx, {"context": self.context, "measurements": {}})
        slot.setdefault("screen", {}).update({c.key(): v for c, v in pairs})
        self.save()

    def get_probe(self, cand, setting: str) -> Optional[dict]:
        """The accuracy probe of ``cand`` under ``setting`` (steps and held-out batches), if cached."""
        return self.data.get(self.ctx, {}).get("probe", {}).get(f"{cand.key()}:{setting}")

    def put_probe(self, cand, setting: str, result: dict) -> None:
        slot = self.data.setdefault(self.ctx, {"context": self.context, "measurements": {}})
        slot.setdefault("probe", {})[f"{cand.key()}:{setting}"] = dict(result, label=cand.label())
        self.save()

    def save(self) -> None:
        if not (self.path and self.writer):
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "w") as fh:
            json.dump(self.data, fh, indent=1)
        os.replace(tmp, self.path)

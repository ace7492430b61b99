"""The sampler interface: which classes of this shard are active in a step.

Legend: N rows of the global batch, K active classes of this shard, L = num_local.

A sampler returns an :class:`ActiveSet`: ``index`` (K,), sorted local class ids (``None``
means every class of the shard, with no gather), and ``targets`` (N,), each row's column
in the active set, or -1 when its class belongs to another shard. Every positive class
of the batch that lives on this shard is always active (docs/design.md: exactness contract).
With sample groups, ``bounds`` (G+1 row offsets) splits the global batch into G blocks of
rows, ``index`` is a list of G sorted id tensors (one active set per group) and each
row's target is its column in its own group's set.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from ds_xc.sampling.fill import FillStream

log = logging.getLogger(__name__)

__all__ = ["ActiveSet", "Sampler", "local_targets", "budget"]


@dataclass
class ActiveSet:
    index: Union[None, torch.Tensor, list]  # (K,) sorted local ids; None: whole shard; list: per group
    targets: torch.Tensor  # (N,) int64 in [-1, K)
    bounds: Optional[list] = None  # G+1 row offsets of the groups, or None (one group)

    def groups(self) -> list:
        """[(row slice, index or None)] for each group."""
        if self.bounds is None:
            return [(slice(0, self.targets.numel()), self.index)]
        return [(slice(a, b), idx) for a, b, idx in zip(self.bounds[:-1], self.bounds[1:], self.index)]

    def union(self) -> Optional[torch.Tensor]:
        """Distinct active ids over all groups (None: the whole shard)."""
        if self.index is None or isinstance(self.index, torch.Tensor):
            return self.index
        return torch.unique(torch.cat(self.index))


def budget(sample_rate: float, num_local: int) -> int:
    """ceil(sample_rate * num_local), robust to float round-off (0.1 * 1000 is 100, not 101)."""
    return max(1, min(num_local, math.ceil(sample_rate * num_local * (1.0 - 1e-12))))


def rebuild_due(steps: int, built_at: int, interval: int, warmup: int) -> bool:
    """True when an index (or graph) built at step ``built_at`` is due for a rebuild at ``steps``.

    Weights move fastest early in training, and an index built from the initial weights
    describes almost nothing a few hundred steps later (its k-means lists are cells of the
    random init). So with ``warmup`` w > 0 the gap between rebuilds starts at w and doubles
    (rebuilds at w, 2w, 4w, ...) until it reaches ``interval``; then it stays there.
    ``interval`` 0: never (only at start and after loading).
    """
    if not interval:
        return False
    gap = min(interval, max(warmup, built_at)) if warmup else interval
    return steps - built_at >= gap


def local_targets(labels: torch.Tensor, class_start: int, num_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(local ids (N,), mask of rows whose class is on this shard (N,))."""
    local = labels - class_start
    mine = (local >= 0) & (local < num_local)
    return local, mine


class Sampler:
    """Base class. Subclasses implement :meth:`sample`; state (the fill stream, indexes)
    round-trips through :meth:`state_dict` / :meth:`load_state_dict`.

    A training step of every sampler is static and sync-free on the device (docs/head.md, "The GPU
    step"): the active set has a size fixed by the shapes (active.py), the uniform fill is drawn on
    the device from a counter-based stream (``self.fill``, fill.py: reproducible and
    checkpoint-portable, its state three integers), and the counts of the last step stay on the
    device until read (:attr:`last_stats`). Device-bound state (a kNN graph, an ANN index) follows
    :meth:`to`, which the head calls from ``head.to(...)``; so does the fill stream.
    """

    needs_embeddings = False  # True when the sampler looks at the gathered embeddings
    # Called with local row ids (R,) or None (every row) before the sampler reads those weight rows
    # (index or graph builds, re-encodes, re-ranking): the head sets it to its exact-lazy catch-up,
    # so that with update lazy_exact the sampler never reads a stale row.
    before_read = None

    def read_rows(self, rows: Optional[torch.Tensor] = None) -> None:
        """Make weight rows ``rows`` (None: all) current before reading them (``before_read``)."""
        if self.before_read is not None:
            self.before_read(rows)

    def __init__(self, config, num_local: int, class_start: int, seed: int, rank: int, device=None):
        self.config, self.num_local, self.class_start = config, num_local, class_start
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        # a distinct, reproducible stream per rank and seed
        self.fill = FillStream(seed, rank, self.device)
        self._stats = None  # active.Stats of the last step (device tensors until read)

    @property
    def last_stats(self) -> dict:
        """The counts of the last step's active set (active, positives, retrieved, kept, cut, fill
        and, for index-based samplers, staleness) as Python ints: reading them syncs with the
        device, so read them when a log line is due, not every step."""
        return {} if self._stats is None else dict(self._stats.read(), **self._extra_stats())

    def _extra_stats(self) -> dict:
        return {}

    # ------------------------------------------------------------------ captured steps (ds_xc/head/graphs.py)
    graphed = False  # set by HeadStepGraph: the step may be captured and replayed

    def host_work_due(self) -> bool:
        """Whether the next training step does host work a replayed graph cannot (an index or graph
        build, a background rebuild to adopt, a metrics pass): the runner then runs it eagerly."""
        return False

    def after_replay(self) -> None:
        """The host side of a replayed training step: the counters an eager step advances."""

    def sample(self, labels: torch.Tensor, embeddings: Optional[torch.Tensor],
               weight: torch.Tensor) -> ActiveSet:
        raise NotImplementedError

    def to(self, device) -> "Sampler":
        """Serve ``device`` from now on: device-bound state moves there (:meth:`_move_state`), the
        fill stream draws there. Leaving the meta device drops what meta tensors stood for (they
        hold no values): an index or graph is rebuilt at the next forward."""
        device = torch.device(device)
        if device != self.device:
            from_meta = self.device.type == "meta"
            self.device = device
            self.fill.to(device)
            self._stats = None
            self._move_state(device, from_meta)
        return self

    def _move_state(self, device: torch.device, from_meta: bool) -> None:
        """Move device-bound state (subclasses with an index or graph override this)."""

    def state_dict(self) -> dict:
        return {"fill": self.fill.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.fill.load_state_dict(state.get("fill", state))

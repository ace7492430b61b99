"""The sampler interface: which classes of this shard are active in a step.

Legend: N rows of the global batch, K active classes of this shard, L = num_local.

A sampler returns an :class:`ActiveSet`: ``index`` (K,), sorted local class ids (``None``
means every class of the shard, with no gather), and ``targets`` (N,), each row's column
in the active set, or -1 when its class belongs to another shard. Every positive class
of the batch that lives on this shard is always active (DESIGN.md: exactness contract).
With sample groups, ``bounds`` (G+1 row offsets) splits the global batch into G blocks of
rows, ``index`` is a list of G sorted id tensors (one active set per group) and each
row's target is its column in its own group's set.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

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
    """Base class. Subclasses implement :meth:`sample`; state (RNG, indexes) round-trips
    through :meth:`state_dict` / :meth:`load_state_dict`."""

    needs_embeddings = False  # True when the sampler looks at the gathered embeddings

    def __init__(self, config, num_local: int, class_start: int, seed: int, rank: int, device=None):
        self.config, self.num_local, self.class_start = config, num_local, class_start
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.generator = torch.Generator(device=self.device)
        # distinct, reproducible stream per rank and seed
        self.generator.manual_seed((int(seed) * 1_000_003 + 7919 * (rank + 1)) % (2**63))

    def sample(self, labels: torch.Tensor, embeddings: Optional[torch.Tensor],
               weight: torch.Tensor) -> ActiveSet:
        raise NotImplementedError

    def to(self, device) -> "Sampler":
        device = torch.device(device)
        if device != self.device:
            state = self.generator.get_state()
            self.device = device
            self.generator = torch.Generator(device=device)
            self.generator.set_state(state)
        return self

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])

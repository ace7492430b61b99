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

import hashlib
import logging
import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

log = logging.getLogger(__name__)

__all__ = ["ActiveSet", "Sampler", "local_targets", "budget", "restore_generator"]


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
    through :meth:`state_dict` / :meth:`load_state_dict`.

    Devices: ``self.generator`` is always a CPU generator, whatever ``device`` the sampler
    serves. Random draws are made on the CPU and the drawn ids moved to the device
    (see active._uniform_fill), so the sampling decisions are the same on every device and
    dtype, and the saved generator state (a CPU mt19937 state) restores on any machine.
    (A CUDA generator's state is a different object, a seed and an offset, and cannot be
    transplanted into a CPU generator or back.) Device-bound state (a kNN graph, an ANN
    index) follows :meth:`to`, which the head calls from ``head.to(...)``.
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
        self.generator = torch.Generator(device="cpu")  # always CPU: see the class docstring
        # distinct, reproducible stream per rank and seed
        self.generator.manual_seed((int(seed) * 1_000_003 + 7919 * (rank + 1)) % (2**63))

    def sample(self, labels: torch.Tensor, embeddings: Optional[torch.Tensor],
               weight: torch.Tensor) -> ActiveSet:
        raise NotImplementedError

    def to(self, device) -> "Sampler":
        """Serve ``device`` from now on: device-bound state moves there (:meth:`_move_state`);
        the generator stays on the CPU. Leaving the meta device drops what meta tensors
        stood for (they hold no values): an index or graph is rebuilt at the next forward."""
        device = torch.device(device)
        if device != self.device:
            from_meta = self.device.type == "meta"
            self.device = device
            self._move_state(device, from_meta)
        return self

    def _move_state(self, device: torch.device, from_meta: bool) -> None:
        """Move device-bound state (subclasses with an index or graph override this)."""

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        restore_generator(self.generator, state["generator"])


def restore_generator(gen: torch.Generator, state: torch.Tensor) -> None:
    """Load a saved generator state into the CPU generator ``gen``.

    The state is a CPU ByteTensor wherever it was saved from (it is copied to the CPU if a
    loader mapped it elsewhere). A state of another size is the state of a CUDA generator,
    which samplers kept before their generators moved to the CPU: it cannot be loaded into
    a CPU generator, so ``gen`` is reseeded from a hash of its bytes (deterministic: the
    same checkpoint resumes with the same stream every time) and a warning says so.
    """
    state = state.detach().to("cpu", torch.uint8)
    if state.numel() == gen.get_state().numel():
        gen.set_state(state)
        return
    digest = hashlib.blake2b(state.numpy().tobytes(), digest_size=8).digest()
    seed = int.from_bytes(digest, "little") % (2**63)
    gen.manual_seed(seed)
    log.warning("sampler generator state of %d bytes is not a CPU generator state (%d bytes): a CUDA "
                "generator's, from an older checkpoint; the sampler's stream is reseeded from it (seed %d)",
                state.numel(), gen.get_state().numel(), seed)

"""The data set interface shared by the built-in data sets, and the sample addressing
that makes them resumable.

Every training sample has a *global sample index*: at step ``t`` with ``P`` ranks of
``B`` samples each, rank ``r`` owns indices ``t*B*P + r*B + [0, B)``. A data set turns a
sample index into a sample with a pure function (a counter-based hash, not a stateful
generator), so

* resuming at step ``t`` needs no data state beyond ``t`` (data position == step) at the same
  world size and batch; ``sample_offset`` starts the addressing at a global sample count instead,
  so a run resumed on another world size or micro batch (launch/train.py saves the samples
  consumed in its checkpoints) continues the stream where it stopped, neither replaying nor
  skipping samples;
* different ranks at one step get different samples, which together form the
  global batch, and the global batch at a step does not depend on how it is split
  over ranks (same ``B*P`` => same samples);
* nothing has to be stored per sample or per class.

The hash is splitmix64's finaliser applied to (salt, index, counter), vectorised over a
batch; it is platform independent and needs no state.
"""

from __future__ import annotations

import abc
import hashlib
import math
from typing import Iterator

import numpy as np
import torch
from torch import Tensor


class XCDataset(abc.ABC):
    """An extreme-classification data set: ``(inputs, labels)`` batches addressed by step.

    Attributes:
        name: registry name, for logging.
        num_classes: labels lie in ``[0, num_classes)``.
        input_kind: ``"dense"`` (float32 inputs of shape (B, input_dim)) or
            ``"tokens"`` (int64 ids of shape (B, context)).
        input_dim: feature dim for dense inputs; size of the input vocabulary
            (including any padding id) for tokens.
        context: number of input tokens (0 for dense).
    """

    name: str
    num_classes: int
    input_kind: str
    input_dim: int
    context: int

    @abc.abstractmethod
    def train_batch(
        self, step: int, batch_size: int, rank: int = 0, world_size: int = 1, sample_offset: int = 0
    ) -> tuple[Tensor, Tensor]:
        """(inputs, labels) for this rank's share of global step ``step`` (counted from ``sample_offset``).

        A pure function of (seed, step, rank, world_size, batch_size, sample_offset): this is what
        makes resume exact (data position == step, or the samples consumed).
        """

    @abc.abstractmethod
    def eval_batches(
        self,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        max_samples: int | None = None,
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """The fixed held-out set, split across ranks.

        Every rank yields the same number of batches, all of size ``batch_size``, so
        class-parallel evaluation (every rank takes part in every batch) never
        deadlocks; the shares of different ranks are disjoint. The remainder that
        does not fill a batch on every rank is dropped. Same result for any call.
        """

    @abc.abstractmethod
    def describe(self) -> dict:
        """Name, sizes and sample counts, for logging."""


class PositionDataset(XCDataset):
    """A data set whose samples are positions in a token stream (text, corpus).

    Subclasses set ``_train_pos`` / ``_eval_pos`` (int64 positions of the labels, the
    held-out ones in a fixed pseudo-random order) and ``_salt``, and implement ``_gather``;
    sampling and the held-out split are then the same for every such data set.
    """

    _train_pos: Tensor
    _eval_pos: Tensor
    _salt: int

    @abc.abstractmethod
    def _gather(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        """(N,) label positions -> inputs (N, context) int64, labels (N,) int64."""

    def train_batch(
        self, step: int, batch_size: int, rank: int = 0, world_size: int = 1, sample_offset: int = 0
    ) -> tuple[Tensor, Tensor]:
        """Training positions drawn uniformly (with replacement) by hashing the sample index."""
        keys = train_sample_indices(step, batch_size, rank, world_size, sample_offset)
        u = hash_uniform(keys, self._salt, 1)[:, 0]
        idx = (u * len(self._train_pos)).to(torch.int64).clamp_(max=len(self._train_pos) - 1)
        return self._gather(self._train_pos[idx])

    def eval_batches(
        self,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        max_samples: int | None = None,
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """This rank's share of the held-out samples (fixed pseudo-random order)."""
        num = len(self._eval_pos) if max_samples is None else min(len(self._eval_pos), max_samples)
        for start, stop in eval_batch_ranges(num, batch_size, rank, world_size):
            yield self._gather(self._eval_pos[start:stop])


# ---------------------------------------------------------------------------- checks
def check_batch_args(batch_size: int, rank: int, world_size: int, step: int = 0) -> None:
    """Raise ValueError naming the bad argument of a batch request."""
    if step < 0:
        raise ValueError(f"step={step} is invalid: must be >= 0")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} is invalid: must be >= 1")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} is invalid: must be >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is invalid: must be in [0, world_size={world_size})")


# ------------------------------------------------------------------ sample addressing
def train_sample_indices(step: int, batch_size: int, rank: int, world_size: int, sample_offset: int = 0) -> Tensor:
    """Global sample indices (batch_size,) int64 owned by ``rank`` at ``step``: ``sample_offset +
    (step * world_size + rank) * batch_size + [0, batch_size)``."""
    check_batch_args(batch_size, rank, world_size, step)
    if sample_offset < 0:
        raise ValueError(f"sample_offset={sample_offset} is invalid: must be >= 0")
    start = sample_offset + (step * world_size + rank) * batch_size
    return torch.arange(start, start + batch_size, dtype=torch.int64)


def eval_batch_ranges(
    num_samples: int, batch_size: int, rank: int, world_size: int
) -> list[tuple[int, int]]:
    """Half-open ranges of held-out sample positions for each of this rank's batches.

    Batch ``k`` of all ranks together covers the contiguous block
    ``[k*B*P, (k+1)*B*P)``; rank ``r`` takes the ``r``-th slice of ``B``. So the
    evaluated set is the first ``(num_samples // (B*P)) * B*P`` held-out samples.
    """
    check_batch_args(batch_size, rank, world_size)
    global_batch = batch_size * world_size
    num_batches = num_samples // global_batch
    if num_batches == 0:
        raise ValueError(
            f"batch_size={batch_size} is too large: the held-out set has {num_samples} "
            f"samples, fewer than batch_size * world_size = {global_batch}; "
            f"use batch_size <= {num_samples // world_size}"
        )
    return [
        (k * global_batch + rank * batch_size, k * global_batch + (rank + 1) * batch_size)
        for k in range(num_batches)
    ]


# ----------------------------------------------------------------------- hashing
# splitmix64's finaliser on numpy uint64 arrays: wrap-around multiplication and logical
# shifts come for free there (no masking), and numpy's per-op overhead is a fraction of
# torch's on the small arrays of one batch; about 3x faster than int64 torch tensors.
_U64 = np.uint64
_MIX1, _MIX2 = _U64(0xBF58476D1CE4E5B9), _U64(0x94D049BB133111EB)
_GOLDEN64 = _U64(0x9E3779B97F4A7C15)


def derive_salt(*parts: object) -> int:
    """A 64-bit salt from any printable values (seed, stream name, ...)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def mix64(z: np.ndarray) -> np.ndarray:
    """Bijective 64-bit mixer (splitmix64 finaliser) on a uint64 array; returns a new array."""
    z = z ^ (z >> _U64(30))
    z *= _MIX1
    z ^= z >> _U64(27)
    z *= _MIX2
    z ^= z >> _U64(31)
    return z


def hash_words(keys: Tensor, salt: int, num_words: int) -> np.ndarray:
    """(N,) non-negative int64 keys -> (N, num_words) uint64 pseudo-random words.

    Word ``j`` of key ``k`` depends only on (salt, k, j): a counter-based generator.
    """
    with np.errstate(over="ignore"):
        h = mix64(keys.numpy().astype(_U64) ^ _U64(salt))  # (N,)
        counters = np.arange(1, num_words + 1, dtype=_U64) * _GOLDEN64  # (W,)
        return mix64(h[:, None] + counters[None, :])  # (N, W)


def hash_uniform(keys: Tensor, salt: int, num: int) -> Tensor:
    """(N,) keys -> (N, num) float64 uniforms strictly inside (0, 1), 52-bit resolution.

    52 bits resolve the ranks of a power law over 10^8 classes; with 52 (not 53) bits
    ``word + 0.5`` is exact in float64, so 1.0 is never reached.
    """
    words = hash_words(keys, salt, num) >> _U64(12)
    return torch.from_numpy((words.astype(np.float64) + 0.5) * 2.0**-52)


def hash_normal(keys: Tensor, salt: int, dim: int) -> Tensor:
    """(N,) keys -> (N, dim) float32 standard normals.

    Box-Muller on the two 32-bit halves of each word (one word per pair of normals);
    float32 suffices (|z| <= 6.7) and is faster.
    """
    half = (dim + 1) // 2
    words = hash_words(keys, salt, half)  # (N, half)
    u_radius = ((words >> _U64(32)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-32)
    angle = (words & _U64(0xFFFFFFFF)).astype(np.float32) * np.float32(2.0 * math.pi * 2.0**-32)
    radius = np.sqrt(np.float32(-2.0) * np.log(u_radius))
    z = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)], axis=1)
    return torch.from_numpy(np.ascontiguousarray(z[:, :dim]))

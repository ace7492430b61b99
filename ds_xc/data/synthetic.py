"""Synthetic extreme-classification data, generated on the fly for 10^6 to 10^8 classes.

Generative model (every random quantity is a hash of (seed, stream, id), see base.py,
so nothing of size num_classes is ever stored):

* classes come in groups of ``group_size`` consecutive ids; group ``g`` has a random
  Gaussian center, class ``c`` a random Gaussian offset, and its prototype is
  ``normalize(center(c // group_size) + group_spread * offset(c))``: classes of one
  group are confusable, which makes the task (and ANN / kNN samplers) non-trivial;
* labels follow a power law over *ranks* (``P(rank k) ~ k^-zipf_exponent``, sampled by
  the continuous inverse CDF), and ranks map to class ids by the bijection
  ``c = (a*k + b) mod C`` with ``gcd(a, C) = 1`` and ``a ~ 0.618 C``, so the frequent
  classes are spread over all contiguous class shards;
* inputs are ``x = tanh((prototype(y) + noise * eps) @ A)`` with eps ~ N(0, I/latent_dim)
  and a fixed Gaussian map ``A`` (latent_dim, input_dim): a backbone has to learn to
  undo ``A`` and the tanh.

Training samples and the held-out set use different hash streams, so they are
disjoint draws from the same distribution.
"""

from __future__ import annotations

import logging
import math
from typing import Iterator

import torch
from torch import Tensor

from ds_xc.data.base import (
    XCDataset,
    derive_salt,
    eval_batch_ranges,
    hash_normal,
    hash_uniform,
    train_sample_indices,
)

logger = logging.getLogger(__name__)

_GOLDEN_FRACTION = 0.6180339887498949


def _coprime_multiplier(num_classes: int) -> int:
    """Smallest a >= 0.618 C with gcd(a, C) = 1: consecutive ranks land far apart."""
    a = max(1, int(num_classes * _GOLDEN_FRACTION))
    while math.gcd(a, num_classes) != 1:
        a += 1
    return a


class SyntheticDataset(XCDataset):
    """Clustered class prototypes, Zipfian labels, inputs through a fixed nonlinear map.

    Args:
        num_classes: number of classes C (any size; memory is O(input_dim * latent_dim)).
        input_dim: dimension of the float32 inputs.
        latent_dim: dimension of the class prototypes.
        group_size: number of mutually confusable classes per group.
        group_spread: size of a class's offset relative to its group center
            (smaller = harder to tell group members apart).
        noise: input noise relative to the unit-norm prototype.
        zipf_exponent: power-law exponent of label frequencies (0 = uniform).
        seed: selects prototypes, map, label bijection and sample streams.
        num_eval: size of the fixed held-out set.
    """

    name = "synthetic"
    input_kind = "dense"
    context = 0

    def __init__(
        self,
        num_classes: int,
        input_dim: int = 64,
        latent_dim: int = 32,
        group_size: int = 8,
        group_spread: float = 0.5,
        noise: float = 1.0,
        zipf_exponent: float = 1.0,
        seed: int = 0,
        num_eval: int = 8192,
    ) -> None:
        for arg, value in [("num_classes", num_classes), ("input_dim", input_dim),
                           ("latent_dim", latent_dim), ("group_size", group_size),
                           ("num_eval", num_eval)]:
            if int(value) != value or value < 1:
                raise ValueError(f"{arg}={value!r} is invalid: must be an integer >= 1")
        for arg, value in [("group_spread", group_spread), ("noise", noise),
                           ("zipf_exponent", zipf_exponent)]:
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{arg}={value!r} is invalid: must be a finite float >= 0")
        self.num_classes = int(num_classes)
        self.input_dim = int(input_dim)
        self.latent_dim = int(latent_dim)
        self.group_size = int(group_size)
        self.group_spread = float(group_spread)
        self.noise = float(noise)
        self.zipf_exponent = float(zipf_exponent)
        self.seed = int(seed)
        self.num_eval = int(num_eval)
        self._salt = {s: derive_salt("ds_xc.synthetic", self.seed, s) for s in (
            "center", "offset", "map", "shift", "train_label", "train_noise",
            "eval_label", "eval_noise")}
        # Fixed map A: (latent_dim, input_dim), N(0, 1) entries so that (z @ A) has
        # unit-scale entries for unit-norm z and the tanh is mildly nonlinear.
        rows = torch.arange(self.latent_dim, dtype=torch.int64)
        self._map_LI = hash_normal(rows, self._salt["map"], self.input_dim)
        self._mult = _coprime_multiplier(self.num_classes)
        self._shift = self._salt["shift"] % self.num_classes
        self._mult_inv = pow(self._mult, -1, self.num_classes) if self.num_classes > 1 else 0

    # ------------------------------------------------------------- class structure
    def group_of(self, class_ids: Tensor) -> Tensor:
        """Group id of each class (int64, same shape)."""
        return class_ids.to(torch.int64) // self.group_size

    def prototypes(self, class_ids: Tensor) -> Tensor:
        """(N,) class ids -> (N, latent_dim) float32 unit-norm prototypes."""
        class_ids = class_ids.to(torch.int64).reshape(-1)
        center_NL = hash_normal(self.group_of(class_ids), self._salt["center"], self.latent_dim)
        offset_NL = hash_normal(class_ids, self._salt["offset"], self.latent_dim)
        proto_NL = center_NL + self.group_spread * offset_NL
        return torch.nn.functional.normalize(proto_NL, dim=1)

    def class_of_rank(self, ranks: Tensor) -> Tensor:
        """Frequency rank (0 = most frequent) -> class id, via (a*k + b) mod C."""
        return (ranks.to(torch.int64) * self._mult + self._shift) % self.num_classes

    def rank_of_class(self, class_ids: Tensor) -> Tensor:
        """Inverse of class_of_rank."""
        return ((class_ids.to(torch.int64) - self._shift) * self._mult_inv) % self.num_classes

    def _rank_cdf(self, x: Tensor) -> Tensor:
        """CDF of the continuous power law on [0, C) at x (float64), in [0, 1]."""
        s, c = self.zipf_exponent, self.num_classes
        if s == 1.0:
            return torch.log1p(x) / math.log1p(c)
        e = 1.0 - s
        return ((1.0 + x) ** e - 1.0) / ((1.0 + c) ** e - 1.0)

    def class_probabilities(self, class_ids: Tensor) -> Tensor:
        """Exact label probability of each class (float64): the prior of the sampler."""
        k = self.rank_of_class(class_ids).double()
        return self._rank_cdf(k + 1.0) - self._rank_cdf(k)

    def _sample_ranks(self, u: Tensor) -> Tensor:
        """Uniforms in (0, 1) -> ranks in [0, C) by the inverse CDF of the power law."""
        s, c = self.zipf_exponent, self.num_classes
        if s == 1.0:
            x = torch.expm1(u * math.log1p(c))
        else:
            e = 1.0 - s
            x = (1.0 + u * ((1.0 + c) ** e - 1.0)) ** (1.0 / e) - 1.0
        return x.floor().to(torch.int64).clamp_(0, c - 1)

    # ------------------------------------------------------------------- samples
    def _samples(self, keys: Tensor, stream: str) -> tuple[Tensor, Tensor]:
        """(N,) sample indices of one stream -> inputs (N, input_dim) f32, labels (N,) i64."""
        u = hash_uniform(keys, self._salt[f"{stream}_label"], 1)[:, 0]
        labels = self.class_of_rank(self._sample_ranks(u))
        eps_NL = hash_normal(keys, self._salt[f"{stream}_noise"], self.latent_dim)
        z_NL = self.prototypes(labels) + (self.noise / math.sqrt(self.latent_dim)) * eps_NL
        return torch.tanh(z_NL @ self._map_LI), labels

    def train_batch(
        self, step: int, batch_size: int, rank: int = 0, world_size: int = 1, sample_offset: int = 0
    ) -> tuple[Tensor, Tensor]:
        """(inputs (B, input_dim) float32, labels (B,) int64) for this rank at ``step`` (after ``sample_offset``)."""
        return self._samples(train_sample_indices(step, batch_size, rank, world_size, sample_offset), "train")

    def eval_batches(
        self,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        max_samples: int | None = None,
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """This rank's share of the first min(num_eval, max_samples) held-out samples."""
        num = self.num_eval if max_samples is None else min(self.num_eval, max_samples)
        for start, stop in eval_batch_ranges(num, batch_size, rank, world_size):
            yield self._samples(torch.arange(start, stop, dtype=torch.int64), "eval")

    def describe(self) -> dict:
        """Sizes and knobs, plus the label skew (probability of the top class)."""
        top = self.class_probabilities(self.class_of_rank(torch.zeros(1, dtype=torch.int64)))
        return {
            "name": self.name,
            "num_classes": self.num_classes,
            "input_kind": self.input_kind,
            "input_dim": self.input_dim,
            "latent_dim": self.latent_dim,
            "group_size": self.group_size,
            "group_spread": self.group_spread,
            "noise": self.noise,
            "zipf_exponent": self.zipf_exponent,
            "seed": self.seed,
            "num_train": None,  # unbounded: every step draws fresh samples
            "num_eval": self.num_eval,
            "top_class_probability": float(top[0]),
        }

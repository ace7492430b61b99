"""Seeds of the compressed reduction's random draws, the same on every rank and platform.

Every random draw of ds_xc.compression (random-k indices, bayes_prior sampling and
histograms, PowerSGD's starting matrices) is seeded from a tuple such as (seed, step,
tensor, rank), so a resumed run draws what an uninterrupted one would, and a draw meant
to agree on every rank (rank left out of the tuple) does.
"""
from __future__ import annotations

import torch

__all__ = ["mix_seed", "seeded_generator"]

_MASK64 = (1 << 64) - 1


def mix_seed(*values: int) -> int:
    """A 63-bit seed from a tuple of ints (splitmix64 rounds), the same on every platform."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        z = (h ^ (v & _MASK64)) + 0x9E3779B97F4A7C15 & _MASK64
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK64
        h = z ^ (z >> 31)
    return h >> 1


def seeded_generator(seed: int, device: torch.device) -> torch.Generator:
    """A torch generator on ``device`` seeded with ``seed`` (a :func:`mix_seed` value)."""
    return torch.Generator(device=device).manual_seed(seed)

"""Sampler registry: ``sampler.type`` in the config -> the class that implements it.

A new sampler adds its config model to ``ds_xc.config.SamplerConfig`` and its class here.
"""
from __future__ import annotations

from ds_xc import config as cfg
from ds_xc.sampling.base import Sampler
from ds_xc.sampling.full import FullSampler
from ds_xc.sampling.ann import AnnSampler
from ds_xc.sampling.knn import KnnSampler
from ds_xc.sampling.uniform import UniformSampler

SAMPLERS: dict[str, type[Sampler]] = {
    "full": FullSampler,
    "uniform": UniformSampler,
    "ann": AnnSampler,
    "knn": KnnSampler,
}


def build_sampler(config, num_local: int, class_start: int, seed: int, rank: int, device=None) -> Sampler:
    """A sampler from its config (model, dict or bare type name)."""
    config = cfg.parse_sampler(config)
    return SAMPLERS[config.type](config, num_local, class_start, seed, rank, device)

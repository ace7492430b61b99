"""Active-class samplers (full, uniform; ANN and kNN join through the registry)."""
from ds_xc.sampling.base import ActiveSet, Sampler
from ds_xc.sampling.registry import SAMPLERS, build_sampler

__all__ = ["ActiveSet", "Sampler", "SAMPLERS", "build_sampler"]

"""ANN softmax: binary codes + inverted file over each shard's class weights."""
from ds_xc.sampling.ann.index import AnnIndex, exact_cosine_rerank
from ds_xc.sampling.ann.sampler import AnnSampler, group_bounds

__all__ = ["AnnIndex", "AnnSampler", "exact_cosine_rerank", "group_bounds"]

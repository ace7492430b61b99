"""Uniform sampler (Partial FC): this shard's positives plus uniform random negatives.

Active set size K = max(ceil(sample_rate * num_local), min(N, num_local)) for N rows (active.py):
fixed by the shapes, and every positive fits. sample_rate 1.0 makes every class active, in order,
which is exactly the full softmax.
"""
from __future__ import annotations

import torch

from ds_xc.sampling.active import active_size, assemble
from ds_xc.sampling.base import ActiveSet, Sampler, budget, local_targets

__all__ = ["UniformSampler"]


class UniformSampler(Sampler):
    def sample(self, labels, embeddings, weight) -> ActiveSet:
        local, mine = local_targets(labels, self.class_start, self.num_local)
        k = active_size(budget(self.config.sample_rate, self.num_local), labels.numel(), self.num_local)
        if k >= self.num_local:
            return ActiveSet(index=torch.arange(self.num_local, device=labels.device),
                             targets=torch.where(mine, local, torch.full_like(local, -1)))
        out = assemble(local, mine, self.num_local, k, self.fill)
        self._stats = out.stats
        return ActiveSet(index=out.index, targets=out.targets)

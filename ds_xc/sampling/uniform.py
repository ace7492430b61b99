"""Uniform sampler (Partial FC): this shard's positives plus uniform random negatives.

Active set size K = max(ceil(sample_rate * num_local), number of positives on this
shard): positives are never dropped, so with many positives K grows past the budget.
sample_rate 1.0 makes every class active, in order, which is exactly the full softmax.
"""
from __future__ import annotations

import torch

from ds_xc.sampling.active import assemble, remap_targets
from ds_xc.sampling.base import ActiveSet, Sampler, budget, local_targets

__all__ = ["UniformSampler", "remap_targets"]


class UniformSampler(Sampler):
    def sample(self, labels, embeddings, weight) -> ActiveSet:
        local, mine = local_targets(labels, self.class_start, self.num_local)
        k = budget(self.config.sample_rate, self.num_local)
        if k >= self.num_local:
            return ActiveSet(index=torch.arange(self.num_local, device=labels.device),
                             targets=torch.where(mine, local, torch.full_like(local, -1)))
        positives = torch.unique(local[mine])  # sorted; a host sync (dynamic size)
        index, self.last_stats, _ = assemble(positives, None, k, self.num_local, self.generator)
        return ActiveSet(index=index, targets=remap_targets(index, local, mine))

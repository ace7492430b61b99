"""Uniform sampler (Partial FC): this shard's positives plus uniform random negatives.

Active set size K = max(ceil(sample_rate * num_local), number of positives on this
shard): positives are never dropped, so with many positives K grows past the budget.
sample_rate 1.0 makes every class active, in order, which is exactly the full softmax.
"""
from __future__ import annotations

import torch

from ds_xc.sampling.base import ActiveSet, Sampler, budget, local_targets


def remap_targets(index: torch.Tensor, local: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
    """Each row's column in the sorted active ``index`` (K,), or -1 (off shard)."""
    pos = torch.searchsorted(index, local.clamp(0, None))
    pos = pos.clamp(max=index.numel() - 1)
    found = mine & (index[pos] == local)
    return torch.where(found, pos, torch.full_like(pos, -1))


class UniformSampler(Sampler):
    def sample(self, labels, embeddings, weight) -> ActiveSet:
        local, mine = local_targets(labels, self.class_start, self.num_local)
        k = budget(self.config.sample_rate, self.num_local)
        if k >= self.num_local:
            return ActiveSet(index=torch.arange(self.num_local, device=labels.device),
                             targets=torch.where(mine, local, torch.full_like(local, -1)))
        positives = torch.unique(local[mine])  # sorted; a host sync (dynamic size)
        k = max(k, int(positives.numel()))
        score = torch.rand(self.num_local, generator=self.generator, device=self.device)  # (L,)
        score[positives.to(self.device)] = 2.0  # positives first
        index = torch.topk(score, k, sorted=False).indices.sort().values.to(labels.device)  # (K,)
        return ActiveSet(index=index, targets=remap_targets(index, local, mine))

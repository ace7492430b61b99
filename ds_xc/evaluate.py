"""Class-parallel held-out evaluation: top-k accuracy over ALL classes.

Every rank runs the backbone on its own share of each held-out batch, the head merges
the per-shard top-k (ClassParallelHead.topk), and hit counts are summed over the group.
Every rank must iterate the same number of batches (the built-in data sets guarantee it).
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from ds_xc.parallel.groups import is_distributed

__all__ = ["evaluate_topk"]


@torch.no_grad()
def evaluate_topk(embed: Callable[[torch.Tensor], torch.Tensor], head, batches: Iterable,
                  ks: Sequence[int] = (1, 5), device=None) -> dict:
    """{"top1": .., "top5": .., "samples": N} over the whole held-out set (all ranks).

    ``embed`` maps inputs to embeddings (the backbone, already in eval mode).
    """
    kmax = max(ks)
    hits = torch.zeros(len(ks) + 1, dtype=torch.float64, device=head.weight.device)  # NCCL needs device tensors
    for inputs, labels in batches:
        if device is not None:
            inputs, labels = inputs.to(device), labels.to(device)
        top = head.topk(embed(inputs), k=kmax)  # (B, kmax) global class ids
        match = top == labels.to(top.device)[:, None]
        for i, k in enumerate(ks):
            hits[i] += match[:, :k].any(dim=1).sum()
        hits[-1] += labels.shape[0]
    if is_distributed(head.group):
        dist.all_reduce(hits, group=head.group)
    n = max(hits[-1].item(), 1.0)
    out = {f"top{k}": hits[i].item() / n for i, k in enumerate(ks)}
    out["samples"] = int(hits[-1].item())
    return out

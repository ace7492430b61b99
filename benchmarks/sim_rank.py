"""One rank of a P-rank head job, run in one process without communication (the simulation).

The simulated rank is rank 0 of a P-rank job: a one-process ClassParallelHead over its shard
[0, L) of the C classes (L = ceil(C / P), shard_range's first block), whose ``num_classes`` (and
its ANN sampler's) is then set to C. Everything a real rank computes happens as in the job:

* the global batch of N = P x micro rows (x (N, d), labels in [0, C)) goes through the input
  check (off) and the sampler: labels of other shards get target -1, exactly as on rank 0;
* the ANN budgets ``scan_rows`` / ``rerank`` are head-wide and the shard takes its share
  ceil(budget x L / C) (AnnSampler.budgets reads ``sampler.num_classes``);
* the fused loss computes the gradients of all N rows and of the K active weight rows, and
  the head optimizer steps on the shard.

What is left out is the communication (group None: no gather, no reduce-scatter, the softmax
statistics are this shard's alone; the loss value is therefore not the job's, its cost is),
which the cost model (ds_xc/cost/comm.py) adds. Used by benchmarks/simulate_scale.py and the
compute-only side of benchmarks/netns_comm.py.
"""
from __future__ import annotations

import time

import torch

import ds_xc
from ds_xc.head.partition import shard_range


def build_rank(section: dict, world_size: int):
    """(head, optimizer) of rank 0 of a ``world_size``-rank job from an extreme_classification section."""
    num_classes = int(section["num_classes"])
    _, local = shard_range(num_classes, world_size, 0)
    head = ds_xc.ClassParallelHead.from_config(dict(section, num_classes=local), group=None)
    head.num_classes = num_classes  # labels of the other shards are in range, and target -1 here
    head.sampler.num_classes = num_classes  # head-wide ANN budgets: this shard takes its share
    opt = ds_xc.build_head_optimizer(head, section.get("optimizer", {}))
    return head, opt


def make_batch(num_rows: int, dim: int, num_classes: int, seed: int):
    """A fresh global batch: embeddings (N, d) as a leaf with gradients, labels (N,) uniform in [0, C)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((num_rows, dim), generator=gen).requires_grad_(True)
    y = torch.randint(0, num_classes, (num_rows,), generator=gen)
    return x, y


def rank_step(head, opt, x: torch.Tensor, y: torch.Tensor) -> float:
    """One step of the simulated rank (forward incl. sampler, backward, optimizer step); wall s."""
    t = time.perf_counter()
    loss = head(x, y, batch_sizes=[x.shape[0]])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t

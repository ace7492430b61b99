"""The recall screen: every candidate's sampler recall on the same trained weights, cheaply.

A sampler's recall depends on the weights it indexes, and the weights of a few measured steps
from the initialisation are not those of training. So the tuner first trains one head for
``pretrain_steps`` steps (the user's loss and head optimizer, a uniform sampler at rate 0.1 with
lazy updates: the cheapest sampled step) on the same embeddings the measurements use, then scores
every candidate's sampler on those weights against the exact top-10 of held-out batches
(measure.sampler_recall). The index depends only on the sampler's structural keys (type,
code_bits, nlist, ...), not on sample_rate, scan_rows or rerank, so one index is built per
structure and the cheap knobs are swept on it (as benchmarks/ann_recall.py does): at 10^6
classes two builds instead of one per candidate.
"""
from __future__ import annotations

import copy
import json
import logging
from typing import Callable, Iterable, Optional

import torch

from ds_xc.config import parse_sampler
from ds_xc.head import ClassParallelHead, build_head_optimizer
import torch.distributed as dist

from ds_xc.parallel.groups import comm_device, is_distributed
from ds_xc.cost.timing import timed
from ds_xc.tune.measure import batch_device, one_step, release_free_memory

log = logging.getLogger(__name__)

__all__ = ["pretrain_weight", "screen_recall", "structure_key", "SWEPT_KEYS"]

SWEPT_KEYS = ("sample_rate", "scan_rows", "rerank")  # changed on a built index without a rebuild


def pretrain_weight(section: dict, train_batch: Callable[[int], tuple], steps: int, group=None) -> torch.Tensor:
    """This rank's shard of the head weights after ``steps`` steps of a uniform-0.1, lazy head."""
    cheap = copy.deepcopy(section)
    cheap["sampler"] = {"type": "uniform", "sample_rate": 0.1}
    cheap["optimizer"] = dict(cheap.get("optimizer", {}), update="lazy")
    head = ClassParallelHead.from_config(cheap, group=group, device=batch_device(train_batch))
    opt = build_head_optimizer(head, cheap["optimizer"])
    for i in range(steps):
        x, y = train_batch(i)
        one_step(head, opt, x.detach().requires_grad_(True), y)
    weight = head.weight.detach().clone()
    del head, opt
    release_free_memory()
    return weight


@torch.no_grad()
def exact_top(head: ClassParallelHead, batches: Iterable, k: int = 10) -> list:
    """[(gathered embeddings (N, d), labels (N,), exact top-k global ids (N, k))] per held-out batch,
    by the head's own metric (head.topk: cosine for margin losses, x.w for plain softmax)."""
    out = []
    for x, y in batches:
        verdict = head.check_batch(x, y, None)
        xg, yg = head.gather(x, y, verdict.sizes)  # (N, d), (N,)
        top = head.topk(x, k=k, batch_sizes=verdict.sizes)  # (B, k) global ids of this rank's rows
        _, top = head.gather(x, top, verdict.sizes)  # (N, k): every rank's rows, as the batch
        out.append((xg, yg, top))
    return out


@torch.no_grad()
def active_recall(head: ClassParallelHead, exact: list) -> float:
    """Share of the exact top-k ids present in their row's active set (on the shard owning them)."""
    hits = torch.zeros(2, dtype=torch.float64, device=comm_device(head.group))
    for xg, yg, top in exact:
        active = head.sampler.sample(yg, xg if head.sampler.needs_embeddings else None, head.weight)
        local = top - head.class_start
        mine = (local >= 0) & (local < head.num_local)
        lc = local.clamp(0, head.num_local - 1)
        for rows, idx in active.groups():
            mask = torch.ones(head.num_local, dtype=torch.bool, device=head.weight.device)
            if idx is not None:
                mask.zero_()
                mask[idx] = True
            hits[0] += (mine[rows] & mask[lc[rows]]).sum().to(hits.device)
        hits[1] += top.numel()
    if is_distributed(head.group):
        dist.all_reduce(hits[:1], group=head.group)  # every rank counted its own classes' hits
    return float(hits[0] / max(hits[1].item(), 1.0))


def structure_key(sampler: dict) -> str:
    """The key under which screen_recall files the index of a sampler section."""
    return _structure(sampler)


def _structure(sampler: dict) -> str:
    """The sampler's keys that shape its index (everything but the swept ones), as a key."""
    return json.dumps({k: v for k, v in sampler.items() if k not in SWEPT_KEYS}, sort_keys=True)


def screen_recall(sections: list, weight: torch.Tensor, eval_batches: Callable[[], Iterable], group=None,
                  indexes: Optional[dict] = None) -> list:
    """recall_active@10 of each extreme_classification section's sampler on ``weight`` (this
    rank's shard), in the order given; every rank of the group calls it with the same sections.
    ``indexes``, when given, receives {structure key: (sampler state, build seconds)} of every
    index built, so that the measurements start from it instead of building it again."""
    out = [None] * len(sections)
    by_structure: dict = {}
    for i, sec in enumerate(sections):
        by_structure.setdefault(_structure(sec.get("sampler", {"type": "full"})), []).append(i)
    exact = None
    for members in by_structure.values():
        first = sections[members[0]]
        if first.get("sampler", {}).get("type", "full") == "full":
            for i in members:
                out[i] = 1.0
            continue
        head = ClassParallelHead.from_config(first, group=group, device=weight.device)
        with torch.no_grad():
            head.weight.copy_(weight)
        build_s = timed(head.rebuild_index, weight.device)
        if indexes is not None and hasattr(head.sampler, "index"):
            indexes[_structure(first["sampler"])] = (head.sampler.state_dict(), build_s)
        if exact is None:  # the exact top-10 depends on the weights only: once for every candidate
            exact = exact_top(head, eval_batches())
        seen: dict = {}
        for i in members:
            key = json.dumps(sections[i]["sampler"], sort_keys=True)
            if key not in seen:  # candidates differing only in the update mode share a sampler
                cfg = parse_sampler(sections[i]["sampler"])
                head.sampler.config = head.sampler.config.model_copy(
                    update={k: getattr(cfg, k) for k in SWEPT_KEYS if hasattr(cfg, k)})
                seen[key] = active_recall(head, exact)
            out[i] = seen[key]
        del head
        release_free_memory()
    return out

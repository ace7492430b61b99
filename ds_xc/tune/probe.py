"""The accuracy probe: does a faster candidate learn as well as the library defaults?

Recall@10 and memory say nothing about what a smaller active set costs in accuracy: at 10^6
classes the tuner's choice of ANN at rate 0.02 (recall@10 0.94) trained 2.3x faster per step
than the defaults but ended 0.8-0.9 point of held-out top-1 lower after 100 steps, on two seeds
(benchmarks/results/tune_synthetic_1e6_train.md): fewer sampled negatives push fewer of the
never-seen classes' rows down. A probe trains the head of a candidate for ``steps`` steps from
the same seeded initial weights, on the same frozen embeddings of the user's data and in the
same order as every other candidate, then scores held-out top-1 over all classes
(:func:`ds_xc.evaluate.evaluate_topk`). The comparison with the defaults' probe is paired (same
initial weights, batches and held-out samples), so a difference in the sampler shows through
less noise than two training runs would give: on that 10^6-class task a 40-step probe put the
rate-0.02 and rate-0.05 candidates 0.7-1.0 point below the defaults on both seeds, as the full
runs did.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Iterable

import torch

from ds_xc.evaluate import evaluate_topk
from ds_xc.head import ClassParallelHead, build_head_optimizer
from ds_xc.tune.measure import one_step, release_free_memory

log = logging.getLogger(__name__)

__all__ = ["probe_accuracy"]


def probe_accuracy(section: dict, train_batch: Callable[[int], tuple], eval_batches: Callable[[], Iterable],
                   steps: int, group=None) -> dict:
    """Train the head of ``section`` (an extreme_classification dict) from its seeded initial
    weights for ``steps`` steps on ``train_batch(i) -> (x (B, d), y (B,))`` of this rank, then its
    held-out {"top1", "top5", "samples"} over all classes on ``eval_batches()`` ((x, y) of this
    rank), and "probe_s", the wall time. Collective over ``group``: every rank calls it with the
    same section and steps."""
    t0 = time.perf_counter()
    release_free_memory()
    head = ClassParallelHead.from_config(section, group=group)
    opt = build_head_optimizer(head, section.get("optimizer", {}))
    for i in range(steps):
        x, y = train_batch(i)
        one_step(head, opt, x.detach().requires_grad_(True), y)
    with torch.no_grad():
        out = evaluate_topk(lambda x: x, head, eval_batches(), ks=(1, 5))
    del head, opt
    release_free_memory()
    out["probe_s"] = time.perf_counter() - t0
    out["steps"] = int(steps)
    log.info("accuracy probe of %s: %d steps, held-out top-1 %.4f over %d samples (%.1f s)",
             section.get("sampler", {}), steps, out["top1"], out["samples"], out["probe_s"])
    return out

"""The accuracy probe: does a faster candidate learn as well as the library defaults?

Recall@10 and memory say nothing about what a smaller active set costs in accuracy: at 10^6
classes a tuner choice of ANN at rate 0.02 (recall@10 0.94) once trained 2.3x faster per step
than the defaults but ended 0.8-0.9 point of held-out top-1 lower after 100 steps, on two seeds:
fewer sampled negatives push fewer of the never-seen classes' rows down. A probe trains the head
of a candidate for ``steps`` steps from the same seeded initial weights, on the same frozen
embeddings of the user's data and in the same order as every other candidate, then scores
held-out top-1 over all classes (:func:`ds_xc.evaluate.evaluate_topk`).

Paired and sequential. The defaults and a candidate are scored on the same held-out samples, so
only the samples one head gets right and the other wrong carry their difference (b: only the
defaults right, c: only the candidate): drop = (b - c) / n, with the paired-proportion standard
error sqrt(b + c - (b - c)^2 / n) / n. Comparing two unpaired top-1 values wastes that: at the
10^6-class corpus task's top-1 of 1% after 40 steps, 1,024 samples held 11 and 7 hits, a
difference whose error (0.28 point) exceeded the allowed drop (0.25 point), and the tuner
rejected three candidates on it that trained as well as the defaults over 200 steps. The defaults
are scored on every probe sample; a candidate block by block (``BLOCK`` batches), until the drop
is clearly within the allowance (drop + Z se <= allowed), clearly beyond it (drop - Z se >
allowed), or every sample is scored. The early verdicts use the Agresti-Min estimate (half a
sample added to each of the four cells), so a block without any disagreement does not read as an
error of zero. The tuner compares the point estimate with the allowance (tuner.Target.failures),
which agrees with either early verdict.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Callable, Iterable, Optional

import numpy as np
import torch
import torch.distributed as dist

from ds_xc.evaluate import evaluate_topk
from ds_xc.head import ClassParallelHead, build_head_optimizer
from ds_xc.parallel.agree import all_or_none
from ds_xc.parallel.groups import comm_device, is_distributed
from ds_xc.tune.measure import batch_device, one_step, release_free_memory

log = logging.getLogger(__name__)

__all__ = ["probe_accuracy", "paired_drop", "BLOCK", "Z"]

BLOCK = 4  # held-out batches a candidate is scored on between two looks at its drop
Z = 2.0  # standard errors between the drop and the allowance that end a candidate's scoring early


def paired_drop(b: float, c: float, n: float, adjusted: bool = False) -> tuple:
    """(drop, standard error) of top-1 from b samples only the defaults got right and c only the
    candidate got right, of n scored by both. ``adjusted``: the Agresti-Min estimate (0.5 added to
    each of the four cells), never an error of zero."""
    if adjusted:
        b, c, n = b + 0.5, c + 0.5, n + 2.0
    if n <= 0:
        return 0.0, math.inf
    return (b - c) / n, math.sqrt(max(b + c - (b - c) ** 2 / n, 0.0)) / n


def probe_accuracy(section: dict, train_batch: Callable[[int], tuple], eval_batches: Callable[[], Iterable],
                   steps: int, group=None, reference: Optional[dict] = None,
                   max_drop: Optional[float] = None) -> dict:
    """Train the head of ``section`` (an extreme_classification dict) from its seeded initial
    weights for ``steps`` steps on ``train_batch(i) -> (x (B, d), y (B,))`` of this rank, then
    score it on the held-out ``eval_batches()`` ((x, y) of this rank) over all classes.

    Without ``reference`` (the defaults): {"top1", "top5", "samples"} over every batch and "hits",
    each rank's per-sample top-1 hits (packed), the reference of the candidates' probes. With the
    defaults' result as ``reference``: the paired comparison on the same samples, scored until the
    verdict on ``max_drop`` is clear (module docstring): {"top1", "top5", "samples" (scored),
    "base_top1" (the defaults' on those samples), "drop", "se", "discordant": [b, c], "verdict"}.
    Both with "probe_s" (wall time) and "steps". Collective over ``group``: every rank calls it with
    the same section, steps and reference, and the same number of held-out batches."""
    t0 = time.perf_counter()
    release_free_memory()
    head = ClassParallelHead.from_config(section, group=group, device=batch_device(train_batch))
    opt = build_head_optimizer(head, section.get("optimizer", {}))
    for i in range(steps):
        x, y = train_batch(i)
        one_step(head, opt, x.detach().requires_grad_(True), y)
    del opt
    batches = list(eval_batches())
    with torch.no_grad():
        if reference is None:
            hits = []
            out = evaluate_topk(lambda x: x, head, batches, ks=(1, 5), per_sample=hits)
            out["hits"] = _gather_packed(torch.cat(hits) if hits else torch.zeros(0, dtype=torch.bool), group)
        else:
            out = _score_paired(head, batches, reference, max_drop, group)
    del head
    release_free_memory()
    out["probe_s"] = time.perf_counter() - t0
    out["steps"] = int(steps)
    log.info("accuracy probe of %s: %d steps, held-out top-1 %.4f over %d samples%s (%.1f s)",
             section.get("sampler", {}), steps, out["top1"], out["samples"],
             "" if reference is None else f", {100 * out['drop']:+.2f} +- {100 * out['se']:.2f} point below the "
             f"defaults ({out['verdict']})", out["probe_s"])
    return out


def _score_paired(head, batches: list, reference: dict, max_drop: Optional[float], group) -> dict:
    """The candidate's side of the paired comparison (probe_accuracy), block by block."""
    rank = dist.get_rank(group) if is_distributed(group) else 0
    ref = _unpack(reference["hits"][rank])  # (this rank's probe samples,) bool: the defaults' hits
    mine = torch.zeros(4, dtype=torch.float64)  # this rank's b, c, top-1 hits, samples
    total, top5, verdict, pos = mine, 0.0, "all samples", 0
    for s in range(0, len(batches), BLOCK):
        got = []
        part = evaluate_topk(lambda x: x, head, batches[s: s + BLOCK], ks=(1, 5), per_sample=got)
        top5 += part["top5"] * part["samples"]  # already summed over the group
        hit = torch.cat(got) if got else torch.zeros(0, dtype=torch.bool)  # (this block's rows,)
        base = ref[pos: pos + hit.numel()]
        with all_or_none("accuracy probe: the candidate's held-out samples", group):
            if base.numel() != hit.numel():
                raise ValueError(f"accuracy probe: the defaults' probe scored {ref.numel()} held-out samples on "
                                 f"rank {rank}, this candidate more ({pos + hit.numel()}); both must score the "
                                 "same batches")
        pos += hit.numel()
        mine += torch.tensor([(base & ~hit).sum(), (~base & hit).sum(), hit.sum(), hit.numel()],
                             dtype=torch.float64)
        total = _summed(mine, group)
        drop, se = paired_drop(total[0].item(), total[1].item(), total[3].item(), adjusted=True)
        if max_drop is not None and drop + Z * se <= max_drop:
            verdict = "within"
            break
        if max_drop is not None and drop - Z * se > max_drop:
            verdict = "beyond"
            break
    b, c, hits, n = total.tolist()
    n1 = max(n, 1.0)
    drop, se = paired_drop(b, c, n1)
    return {"top1": hits / n1, "top5": top5 / n1, "samples": int(n), "base_top1": (hits + b - c) / n1,
            "drop": drop, "se": se, "discordant": [int(b), int(c)], "verdict": verdict}


def _summed(mine: torch.Tensor, group) -> torch.Tensor:
    """This rank's running counts summed over the group (a copy, on the CPU)."""
    t = mine.clone().to(comm_device(group))
    if is_distributed(group):
        dist.all_reduce(t, group=group)
    return t.cpu()


def _gather_packed(hits: torch.Tensor, group) -> list:
    """Every rank's per-sample hits, packed (``_unpack`` reverses it), in group-rank order."""
    packed = {"n": int(hits.numel()), "bits": np.packbits(hits.numpy().astype(np.uint8)).tobytes().hex()}
    if not is_distributed(group):
        return [packed]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, packed, group=group)
    return out


def _unpack(packed: dict) -> torch.Tensor:
    """(n,) bool from ``_gather_packed``'s entry for one rank."""
    bits = np.unpackbits(np.frombuffer(bytes.fromhex(packed["bits"]), dtype=np.uint8))[: packed["n"]]
    return torch.from_numpy(bits.astype(bool))

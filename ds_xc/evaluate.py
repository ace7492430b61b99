"""Held-out evaluation: class-parallel top-k accuracy over ALL classes, and verification.

Verification (:func:`verification`) is how face recognition is scored and how the glyphs
task is: embed images of designs never trained on, then TAR (true accept rate) at a
fixed FAR (false accept rate) over genuine pairs (same class, different designs) and
impostor pairs (different classes), cosine similarity.

Every rank runs the backbone on its own share of each held-out batch, the head merges
the per-shard top-k (ClassParallelHead.topk), and hit counts are summed over the group.
Every rank must iterate the same number of batches (the built-in data sets guarantee it);
the ranks check it before each batch (ds_xc.parallel.agree), so a mismatch is an error
on every rank, not a hang.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ds_xc.parallel.agree import agree, agree_outcome, all_or_none
from ds_xc.parallel.groups import is_distributed

__all__ = ["evaluate_topk", "tar_at_far", "verification"]


@torch.no_grad()
def evaluate_topk(embed: Callable[[torch.Tensor], torch.Tensor], head, batches: Iterable,
                  ks: Sequence[int] = (1, 5), device=None, split: Optional[int] = None,
                  per_sample: Optional[list] = None) -> dict:
    """{"top1": .., "top5": .., "samples": N} over the whole held-out set (all ranks).

    ``split`` (a class id): also the top-1 of the samples of classes below it and of those at or
    above it, over all classes ({"top1_old", "top1_new", "samples_old", "samples_new"}): a grown
    class set's old and new classes (launch/grow.py, ``xc_train.eval_class_split``).

    ``per_sample`` (a list): each batch's per-sample top-1 hits of this rank's rows, (B,) bool,
    appended in order: a paired comparison of two heads on the same samples (the tuner's
    accuracy probe) needs them, not only the counts.

    ``embed`` maps inputs to embeddings (the backbone, already in eval mode). A collective
    over ``head.group``: the ranks first agree on ``ks``, then, before each batch's top-k,
    on whether a batch follows. Another ``ks`` on one rank, a rank with more or fewer
    batches, or a rank whose data or ``embed`` raised, is an error on every rank (naming the
    ranks and values) instead of a hang in the head's gathers.
    """
    group = head.group
    with all_or_none("evaluate_topk(ks=...)", group):
        if not ks or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in ks):
            raise ValueError(f"evaluate_topk: ks={tuple(ks)!r}; expected a non-empty list of integers >= 1")
    ks = tuple(agree(tuple(int(k) for k in ks), "evaluate_topk ks", group))
    kmax = max(ks)
    hits = torch.zeros(len(ks) + 5, dtype=torch.float64, device=head.weight.device)  # NCCL needs device tensors
    # hits[-5:]: samples; old-class top-1 hits, old samples; new-class top-1 hits, new samples
    it, done = iter(batches), 0
    while True:
        status, emb, labels = _next_embedded(it, embed, device, done)
        agree_outcome(emb if status == "error" else None, f"evaluate_topk: reading and embedding held-out "
                      f"batch {done}", group)
        agree(status, "the held-out batches (every rank must iterate the same number in evaluate_topk)", group)
        if status.startswith("end"):
            break
        top = head.topk(emb, k=kmax)  # (B, kmax) global class ids
        match = top == labels.to(top.device)[:, None]
        for i, k in enumerate(ks):
            hits[i] += match[:, :k].any(dim=1).sum()
        hits[-5] += labels.shape[0]
        if per_sample is not None:
            per_sample.append(match[:, 0].cpu())
        if split is not None:
            _count_split(hits, match[:, 0], labels.to(top.device) < split)
        done += 1
    if is_distributed(group):
        dist.all_reduce(hits, group=group)
    n = max(hits[-5].item(), 1.0)
    out = {f"top{k}": hits[i].item() / n for i, k in enumerate(ks)}
    out["samples"] = int(hits[-5].item())
    if split is not None:
        for name, (hit, count) in (("old", hits[-4:-2].tolist()), ("new", hits[-2:].tolist())):
            out[f"top1_{name}"], out[f"samples_{name}"] = hit / max(count, 1.0), int(count)
    return out


def _count_split(hits: torch.Tensor, top1: torch.Tensor, old: torch.Tensor) -> None:
    """Add the top-1 hits and sample counts of old (B,) True / new classes to hits[-4:]."""
    hits[-4] += (top1 & old).sum()
    hits[-3] += old.sum()
    hits[-2] += (top1 & ~old).sum()
    hits[-1] += (~old).sum()


def _next_embedded(it, embed, device, done: int):
    """("batch N" | "end after N batches" | "error", embeddings or the exception, labels) for the next batch."""
    try:
        inputs, labels = next(it)
    except StopIteration:
        return f"end after {done} batches", None, None
    except Exception as exc:
        return "error", exc, None
    try:
        if device is not None:
            inputs, labels = inputs.to(device), labels.to(device)
        return f"batch {done}", embed(inputs), labels
    except Exception as exc:
        return "error", exc, None


def tar_at_far(genuine: torch.Tensor, impostor: torch.Tensor, fars: Sequence[float] = (1e-3, 1e-4)) -> dict:
    """{"tar@far=F": TAR, "thr@far=F": threshold} per F: the threshold is the ceil(F * n)-th
    highest of the n impostor scores (so at most that many impostors are accepted), TAR the
    share of genuine scores strictly above it. FARs below 1/n are refused (not resolvable)."""
    n = impostor.numel()
    if n == 0 or genuine.numel() == 0:
        raise ValueError(f"need genuine and impostor scores, got {genuine.numel()} and {n}")
    top = torch.sort(impostor.flatten().double(), descending=True).values
    out = {}
    for far in fars:
        if not 0.0 < far < 1.0 or far * n < 1.0:
            raise ValueError(f"far={far} is invalid: must be in [1/{n}, 1) for {n} impostor pairs")
        k = math.ceil(far * n)
        thr = top[k - 1].item()
        out[f"tar@far={far:g}"] = (genuine.double() > thr).double().mean().item()
        out[f"thr@far={far:g}"] = thr
    return out


@torch.no_grad()
def verification(embed: Callable[[torch.Tensor], torch.Tensor], images: torch.Tensor, labels: torch.Tensor,
                 designs: torch.Tensor, fars: Sequence[float] = (1e-3, 1e-4), num_impostor: int = 1_000_000,
                 batch_size: int = 512, seed: int = 0, device=None) -> dict:
    """TAR at each FAR over cosine similarities of ``embed(images)`` (one process, no collectives).

    Genuine pairs: every pair of images with the same label and different designs.
    Impostor pairs: ``num_impostor`` random pairs with different labels (fixed ``seed``).
    Returns tar_at_far's dict plus pair counts.
    """
    emb = torch.cat([F.normalize(embed(images[a: a + batch_size].to(device) if device else
                                       images[a: a + batch_size]).float(), dim=1).cpu()
                     for a in range(0, images.shape[0], batch_size)])  # (M, d)
    order = torch.argsort(labels * (int(designs.max()) + 1) + designs, stable=True)
    gi, gj = [], []
    lab = labels[order]
    bounds = torch.nonzero(torch.diff(lab, prepend=lab[:1] - 1)).squeeze(1).tolist() + [lab.numel()]
    for a, b in zip(bounds[:-1], bounds[1:]):
        idx = order[a:b]
        ii, jj = torch.triu_indices(idx.numel(), idx.numel(), offset=1)
        keep = designs[idx[ii]] != designs[idx[jj]]
        gi.append(idx[ii[keep]])
        gj.append(idx[jj[keep]])
    gi, gj = torch.cat(gi), torch.cat(gj)
    gen = torch.Generator().manual_seed(seed)
    m = labels.numel()
    ii = torch.randint(m, (num_impostor,), generator=gen)
    jj = torch.randint(m, (num_impostor,), generator=gen)
    keep = labels[ii] != labels[jj]
    ii, jj = ii[keep], jj[keep]
    genuine = (emb[gi] * emb[gj]).sum(1)
    impostor = torch.cat([(emb[ii[a: a + 65536]] * emb[jj[a: a + 65536]]).sum(1)
                          for a in range(0, ii.numel(), 65536)])
    out = tar_at_far(genuine, impostor, fars)
    out.update(genuine_pairs=int(genuine.numel()), impostor_pairs=int(impostor.numel()))
    return out

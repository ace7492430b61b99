"""A Partial-FC-equivalent head: the peer that benchmarks/peer_compare.py measures ds_xc against.

What it reproduces: the class-parallel margin softmax with sampled negative classes of
InsightFace's ``PartialFC_V2`` (recognition/arcface_torch/partial_fc_v2.py), the method of
An et al., "Killing Two Birds with One Stone: Efficient and Robust Training of Face
Recognition CNNs by Partial FC" (CVPR 2022, arXiv 2203.15565). Written here from the paper
and from reading that module (no code copied), in plain PyTorch autograd, as its users run
it. It depends on torch only, not on ds_xc, so that it is an independent second
implementation (tests/test_pfc_reference.py checks it against ds_xc's exact head and a
float64 reference).

One step on rank r of a group of P ranks (B rows per rank, equal on every rank as in
Partial FC; N = P B; L = C // P + (r < C % P) classes of the shard, contiguous, the same
split as ds_xc):

1. all-gather the embeddings (differentiable: backward sums each rank's block of the
   gradient onto its owner, one ``reduce`` per rank, and multiplies it by P, so a rank gets
   P times the gradient of the global mean loss, the same contract as ds_xc) and the labels;
2. sampling (``sample_rate`` < 1): the distinct positive classes of the gathered batch on
   this shard, plus uniformly random negatives up to ``num_sample`` classes: random scores
   for all L classes, the positives' scores forced above every random one, top-``num_sample``,
   sorted. With more positives than ``num_sample``, exactly the positives;
3. the sub-weight ``W[index]`` (K, d) by ``index_select`` of the dense (L, d) Parameter, so
   its backward writes a dense (L, d) gradient, zero outside the sampled rows;
4. normalise the embeddings and the sub-weight, materialise the (N, K) cosine logits
   (``x_hat @ w_hat^T``), clamp them to [-1, 1];
5. margin on the target logits (ArcFace ``s cos(theta + m)``, or ``s (c - m sin m)`` where
   theta + m > pi; CosFace ``s (c - m)``; autograd through the formula), scale by s;
6. distributed softmax cross-entropy: all-reduce MAX of the row maxima, all-reduce SUM of the
   row sums of exp, all-reduce SUM of the (shifted) target logits (each row's target lives on
   one shard); mean over the N rows, the same value on every rank; backward
   ``(softmax - onehot) / N`` on this shard's columns (Partial FC's DistCrossEntropy);
7. the optimizer (the caller's; Partial FC's users run ``torch.optim.SGD`` with momentum
   and weight decay on the whole Parameter) steps the full dense shard: O(L d) per step.

Deliberate differences from InsightFace's module, none of which changes the cost:
``num_sample = ceil(sample_rate * L)`` (ds_xc's budget; Partial FC takes ``int()``, at most
one class fewer); the loss is ``log(sum exp) - shifted target`` instead of ``-log`` of the
gathered probability clamped at 1e-30 (the same all-reduces, no underflow at s = 64 and
10^6 classes); CPU tensors and any process group (Partial FC: CUDA and the world); no fp16
autocast; the random scores come from a per-rank ``torch.Generator`` (reproducible).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["PartialFCReference", "num_sample"]


def num_sample(sample_rate: float, num_local: int) -> int:
    """Classes of a shard per step: ceil(sample_rate * L), at least 1 (ds_xc's budget rule)."""
    return max(1, min(num_local, math.ceil(sample_rate * num_local * (1.0 - 1e-12))))


def _distributed(group) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


class _GatherRows(torch.autograd.Function):
    """All-gather of equal (B, d) blocks -> (P B, d). Backward: block i of the gradient is
    reduced (summed) onto rank i, then multiplied by P (Partial FC's AllGather)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)  # (P B, d)

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        blocks = list(grad.detach().clone().chunk(world))  # P x (B, d), reduced in place
        works = [dist.reduce(b, dst=i if group is None else dist.get_global_rank(group, i), op=dist.ReduceOp.SUM,
                             group=group, async_op=True) for i, b in enumerate(blocks)]
        for w in works:
            w.wait()
        return blocks[rank].mul_(world), None  # (B, d)


class _DistSoftmaxCE(torch.autograd.Function):
    """Mean softmax cross-entropy over classes sharded across the group.

    logits (N, K): this shard's columns (margin and scale applied); targets (N,): the column of
    each row's class on this shard, -1 on other shards. Works in place on ``logits`` (they
    become the softmax, then the gradient), as Partial FC does: nothing else holds them.
    """

    @staticmethod
    def forward(ctx, logits, targets, group):
        n = logits.shape[0]
        many = _distributed(group)
        row_max = logits.max(dim=1, keepdim=True).values  # (N, 1)
        if many:
            dist.all_reduce(row_max, dist.ReduceOp.MAX, group=group)
        logits.sub_(row_max)  # in place
        rows = torch.nonzero(targets >= 0).squeeze(1)
        shifted_t = torch.zeros((n, 1), dtype=logits.dtype, device=logits.device)
        shifted_t[rows, 0] = logits[rows, targets[rows]]  # z_t - max (N, 1): 0 on rows of other shards
        probs = logits.exp_()  # (N, K), in place
        sum_exp = probs.sum(dim=1, keepdim=True)  # (N, 1)
        if many:
            dist.all_reduce(sum_exp, dist.ReduceOp.SUM, group=group)
            dist.all_reduce(shifted_t, dist.ReduceOp.SUM, group=group)
        probs.div_(sum_exp)
        ctx.save_for_backward(probs, targets, rows)
        return (sum_exp.log() - shifted_t).mean()

    @staticmethod
    def backward(ctx, grad_out):
        probs, targets, rows = ctx.saved_tensors
        grad = probs  # in place: the graph is used once (no retain_graph)
        grad[rows, targets[rows]] -= 1.0
        grad.mul_(grad_out / probs.shape[0])
        return grad, None, None


def _margin(cos: torch.Tensor, targets: torch.Tensor, loss: dict) -> torch.Tensor:
    """(N, K) clamped cosines -> scaled logits with the margin on the target entries (autograd)."""
    rows = torch.nonzero(targets >= 0).squeeze(1)
    cols = targets[rows]
    c = cos[rows, cols]  # (n,) target cosines of the rows whose class is on this shard
    m = float(loss["margin"])
    if loss["type"] == "arcface":
        sin = torch.sqrt(1.0 - c * c)
        z = torch.where(c > math.cos(math.pi - m), c * math.cos(m) - sin * math.sin(m), c - m * math.sin(m))
    else:  # cosface
        z = c - m
    cos[rows, cols] = z  # in place on the clamped logits (clamp's backward needs its input only)
    return cos * float(loss["scale"])


class PartialFCReference(nn.Module):
    """Partial FC's head (see the module docstring) on this rank's shard of ``group``.

    Args:
        embedding_dim: d.
        num_classes: C, split as C // P + (rank < C % P) contiguous classes per rank.
        loss: ``{"type": "arcface" | "cosface", "scale": s, "margin": m}`` (ds_xc's loss dicts).
        sample_rate: share of the shard's classes per step; 1.0 is the full softmax (no sampling,
            the whole Parameter is used; Partial FC's model parallelism).
        group: the process group the classes are sharded over (None: the world, or one process).
        weight: the initial (L, d) shard (None: N(0, 0.01^2) from ``seed``).
        seed: seed of the initial weights (when ``weight`` is None) and of the sampling.
        device: where the shard and the sampling generator live (None: the CPU). On a GPU the
            random scores are drawn there, as Partial FC does (``torch.rand`` on the device), so a
            step moves nothing between host and device; the sampled classes then differ from a
            CPU run with the same seed (another generator).
    """

    def __init__(self, embedding_dim: int, num_classes: int, loss: dict, sample_rate: float = 1.0,
                 group=None, weight: Optional[torch.Tensor] = None, seed: int = 0, device=None):
        super().__init__()
        if loss.get("type") not in ("arcface", "cosface"):
            raise ValueError(f"loss.type: got {loss.get('type')!r}; allowed: 'arcface', 'cosface'")
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate: got {sample_rate}; must be in (0, 1]")
        self.group, self.loss, self.sample_rate = group, dict(loss), float(sample_rate)
        many = _distributed(group)
        self.rank = dist.get_rank(group) if many else 0
        self.world_size = dist.get_world_size(group) if many else 1
        base, extra = divmod(int(num_classes), self.world_size)
        self.num_local = base + int(self.rank < extra)
        self.class_start = base * self.rank + min(self.rank, extra)
        self.num_sample = num_sample(self.sample_rate, self.num_local)
        self.generator = torch.Generator().manual_seed(int(seed) * 1_000_003 + self.rank)
        if weight is None:
            weight = torch.randn((self.num_local, embedding_dim), generator=self.generator) * 0.01
        if tuple(weight.shape) != (self.num_local, embedding_dim):
            raise ValueError(f"weight: got shape {tuple(weight.shape)}; rank {self.rank} holds "
                             f"({self.num_local}, {embedding_dim})")
        self.weight = nn.Parameter(weight.detach().to(device).clone())
        if self.weight.device.type != "cpu":  # the scores are drawn where the shard lives
            self.generator = torch.Generator(device=self.weight.device).manual_seed(int(seed) * 1_000_003 + self.rank)
        self.last_index: Optional[torch.Tensor] = None  # (K,) local ids sampled by the last step

    def sample(self, local: torch.Tensor, mine: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(index (K,) sorted local ids, targets (N,) column in index or -1) of one step."""
        with torch.no_grad():
            positives = torch.unique(local[mine])  # sorted distinct positives of this shard
            if positives.numel() <= self.num_sample:
                scores = torch.rand(self.num_local, generator=self.generator,
                                    device=self.generator.device)  # (L,) in [0, 1)
                scores[positives] = 2.0  # above every random score: always kept
                index = torch.topk(scores, self.num_sample).indices.sort().values  # (K,)
            else:
                index = positives
            targets = torch.where(mine, torch.searchsorted(index, local), torch.full_like(local, -1))
        return index, targets

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Global-batch mean loss: embeddings (B, d), labels (B,), B equal on every rank."""
        labels = labels.reshape(-1).to(torch.int64)
        if _distributed(self.group):
            x = _GatherRows.apply(embeddings, self.group)  # (B, d) -> (N, d)
            parts = [torch.empty_like(labels) for _ in range(self.world_size)]
            dist.all_gather(parts, labels, group=self.group)
            y = torch.cat(parts)  # (N,)
        else:
            x, y = embeddings, labels
        local = y - self.class_start
        mine = (local >= 0) & (local < self.num_local)
        if self.sample_rate < 1.0:
            index, targets = self.sample(local, mine)
            w = self.weight.index_select(0, index)  # (L, d) -> (K, d); dense (L, d) gradient
            self.last_index = index
        else:
            targets = torch.where(mine, local, torch.full_like(local, -1))
            w, self.last_index = self.weight, None
        cos = F.linear(F.normalize(x), F.normalize(w)).clamp(-1.0, 1.0)  # (N, K) materialised
        logits = _margin(cos, targets, self.loss)
        return _DistSoftmaxCE.apply(logits, targets, self.group)

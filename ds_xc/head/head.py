"""ClassParallelHead: a classifier layer whose classes are sharded over a process group.

Legend: B local batch rows, N = sum of B over ranks (global batch), d embedding dim,
L = num_local classes of this rank, K active classes of this rank in a step.

One step (docs/design.md): embeddings (B, d) and labels (B,) are all-gathered to (N, d) and
(N,); the sampler picks this shard's active classes (K of L); the fused sharded loss
scores the global batch against them in row chunks and returns the global-batch mean,
identical on every rank. Backward reduce-scatters the embedding gradient, scaled so
that each rank gets the gradient of its *local* mean loss (data-parallel convention),
while this rank's weight shard gets the gradient of the global mean. The shard is never
averaged across ranks: keep it out of data-parallel wrappers (see ds_xc.engine).
"""
from __future__ import annotations

import logging
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ds_xc import config as cfg
from ds_xc.head.margins import TargetLoss, build_loss
from ds_xc.head.partition import shard_range
from ds_xc.head.softmax import sharded_margin_loss
from ds_xc.parallel.collectives import all_gather_no_grad, all_gather_rows, gather_flat
from ds_xc.parallel.groups import group_rank, group_size, is_distributed
from ds_xc.sampling import ActiveSet, build_sampler
from ops.softmax_backend import SOFTMAX_BACKENDS

log = logging.getLogger(__name__)

__all__ = ["ClassParallelHead", "init_shard"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
_BAD_INPUT, _NONFINITE = 2, 1  # per-rank input verdicts of _check (larger = worse)
_INIT_BLOCK = 1 << 16  # rows per init block: the init of a class does not depend on the world size


def init_shard(num_classes: int, dim: int, start: int, count: int, std: float, seed: int,
               dtype=torch.float32, device=None) -> torch.Tensor:
    """Rows [start, start+count) of a N(0, std^2) matrix that is a pure function of (seed, row).

    Generated in fixed blocks of global rows, so every world size (and a resharded
    checkpoint) sees the same initial weights for the same class.
    """
    out = torch.empty((count, dim), dtype=dtype, device=device)
    first, last = start // _INIT_BLOCK, (start + count - 1) // _INIT_BLOCK if count else -1
    gen = torch.Generator(device="cpu")
    for b in range(first, last + 1):
        b0 = b * _INIT_BLOCK
        rows = min(_INIT_BLOCK, num_classes - b0)
        gen.manual_seed((int(seed) * 1_000_003 + b) % (2**63))
        block = torch.randn((rows, dim), generator=gen, dtype=torch.float32).mul_(std)
        lo, hi = max(start, b0), min(start + count, b0 + rows)
        out[lo - start: hi - start] = block[lo - b0: hi - b0].to(dtype)
    return out


class ClassParallelHead(nn.Module):
    """Class-sharded classifier with exact softmax / margin losses and sampled softmax.

    Args:
        embedding_dim: d.
        num_classes: C, split over ``group`` as ``C // P + (rank < C % P)`` contiguous rows.
        loss: a loss config (dict, model or name: softmax | cosface | arcface | combined | dsoftmax).
        sampler: a sampler config (dict, model or name: full | uniform).
        group: the process group the classes are sharded over (None: world, or one process).
        chunk_size: rows of the global batch per logits chunk (0: one chunk).
        dtype, init_std, seed: weight dtype and init; init is per class, independent of P.
        update: "dense" (dense weight gradients) or "lazy" (sparse gradient rows, for the
            lazy head optimizers; sampled heads then cost O(K*d) per step).
        check_inputs: validate label range, shapes and finiteness on every rank before the
            collectives (one small all-reduce, and a host sync on GPU).
        nonfinite: "raise" (the default of a head used on its own) or "skip" (NaN/Inf embeddings:
            forward returns a NaN loss without a graph on every rank, touching neither the
            weights nor the sampler; XCEngine, whose config default is "skip", then skips the step).
        softmax_backend: "torch" | "triton" | "auto", the implementation of the exact fused
            softmax (ops/softmax_backend.py; extreme_classification.softmax_backend).
    """

    def __init__(self, embedding_dim: int, num_classes: int, loss="softmax", sampler="full",
                 group=None, chunk_size: int = 0, dtype: Union[str, torch.dtype] = torch.float32,
                 init_std: float = 0.01, seed: int = 0, update: str = "dense",
                 check_inputs: bool = True, nonfinite: str = "raise", device=None,
                 softmax_backend: str = "torch"):
        super().__init__()
        if isinstance(dtype, str):
            if dtype not in _DTYPES:
                raise cfg.ConfigError(f"{cfg.HEAD_SECTION}.dtype: got {dtype!r}; allowed: {sorted(_DTYPES)}")
            dtype = _DTYPES[dtype]
        if update not in ("dense", "lazy"):
            raise cfg.ConfigError(f"{cfg.HEAD_SECTION}.optimizer.update: got {update!r}; allowed: 'dense', 'lazy'")
        if chunk_size < 0:
            raise cfg.ConfigError(f"{cfg.HEAD_SECTION}.chunk_size: got {chunk_size}; must be >= 0")
        self.group = group
        self.rank, self.world_size = group_rank(group), group_size(group)
        self.embedding_dim, self.num_classes = int(embedding_dim), int(num_classes)
        self.class_start, self.num_local = shard_range(self.num_classes, self.world_size, self.rank)
        self.loss_fn: TargetLoss = build_loss(loss)
        self.sampler_config = cfg.parse_sampler(sampler)
        if nonfinite not in ("skip", "raise"):
            raise cfg.ConfigError(f"{cfg.HEAD_SECTION}.nonfinite: got {nonfinite!r}; allowed: 'skip', 'raise'")
        self.chunk_size, self.update, self.check_inputs = int(chunk_size), update, bool(check_inputs)
        if softmax_backend not in SOFTMAX_BACKENDS:
            raise cfg.ConfigError(f"{cfg.HEAD_SECTION}.softmax_backend: got {softmax_backend!r}; "
                                  f"allowed: {', '.join(map(repr, SOFTMAX_BACKENDS))}")
        self.softmax_backend = softmax_backend
        self.nonfinite, self.nonfinite_inputs = nonfinite, 0  # policy; steps whose input was non-finite
        self.seed = int(seed)
        self.weight = nn.Parameter(init_shard(self.num_classes, self.embedding_dim, self.class_start,
                                              self.num_local, init_std, seed, dtype, device))
        self.sampler = build_sampler(self.sampler_config, self.num_local, self.class_start, seed,
                                     self.rank, self.weight.device)
        self.sampler.dense_updates = update == "dense"  # every row changes each step: re-encode all
        self.sampler.metric = "cosine" if self.loss_fn.normalised else "dot"  # what the logits rank by
        self.last_active: Optional[ActiveSet] = None
        self.last_metrics: dict = {}
        log.info("ClassParallelHead rank %d/%d: classes [%d, %d) of %d, d=%d, loss=%s, sampler=%s",
                 self.rank, self.world_size, self.class_start, self.class_start + self.num_local,
                 self.num_classes, self.embedding_dim, self.loss_fn.describe(), self.sampler_config.type)

    @classmethod
    def from_config(cls, section, group=None, device=None) -> "ClassParallelHead":
        """Build from the ``extreme_classification`` section (a plain dict or a HeadConfig)."""
        c = cfg.validate_section(cfg.HeadConfig, section, cfg.HEAD_SECTION)
        return cls(c.embedding_dim, c.num_classes, loss=c.loss, sampler=c.sampler, group=group,
                   chunk_size=c.chunk_size, dtype=c.dtype, init_std=c.init_std, seed=c.seed,
                   update=c.optimizer.update, check_inputs=c.check_inputs, nonfinite=c.nonfinite, device=device,
                   softmax_backend=c.softmax_backend)

    def extra_repr(self) -> str:
        return (f"embedding_dim={self.embedding_dim}, num_classes={self.num_classes}, "
                f"shard=[{self.class_start}, {self.class_start + self.num_local}), rank={self.rank}/"
                f"{self.world_size}, sampler={self.sampler_config.type}, update={self.update}")

    # ------------------------------------------------------------------ checks
    def _local_problem(self, embeddings: torch.Tensor, labels: torch.Tensor) -> Optional[tuple[int, Exception]]:
        """None when this rank's input is fine, else (code, the error to raise): code _BAD_INPUT for a
        shape, dtype or label problem, _NONFINITE for NaN/Inf embeddings."""
        if embeddings.dim() != 2 or embeddings.shape[1] != self.embedding_dim:
            return _BAD_INPUT, ValueError(f"embeddings must have shape (batch, {self.embedding_dim}), got "
                                          f"{tuple(embeddings.shape)} on rank {self.rank}")
        if not embeddings.is_floating_point():
            return _BAD_INPUT, TypeError(f"embeddings must be floating point, got {embeddings.dtype} on rank "
                                         f"{self.rank}")
        if labels.shape != (embeddings.shape[0],):
            return _BAD_INPUT, ValueError(f"labels must have shape ({embeddings.shape[0]},) to match the "
                                          f"embeddings, got {tuple(labels.shape)} on rank {self.rank}")
        if labels.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            return _BAD_INPUT, TypeError(f"labels must be an integer tensor, got {labels.dtype} on rank {self.rank}")
        if not self.check_inputs:
            return None
        bad_label = (labels < 0) | (labels >= self.num_classes)
        if bool(bad_label.any()):
            pos = int(bad_label.nonzero()[0, 0])
            return _BAD_INPUT, ValueError(f"label {int(labels[pos])} at position {pos} on rank {self.rank} is "
                                          f"outside [0, {self.num_classes})")
        finite_rows = torch.isfinite(embeddings).all(dim=1)
        if not bool(finite_rows.all()):
            pos = int((~finite_rows).nonzero()[0, 0])
            return _NONFINITE, FloatingPointError(f"embeddings row {pos} on rank {self.rank} contains NaN or Inf")
        return None

    def _check(self, embeddings: torch.Tensor, labels: torch.Tensor) -> bool:
        """Validate this step's input on every rank; True when the step can run.

        Every rank's verdict is all-reduced first (one (P,) int32 all-reduce), so all ranks
        take the same decision and nobody is left waiting in a collective: invalid labels,
        shapes or dtypes raise on every rank (the rank at fault names the label, position or
        shape; the others name that rank). Non-finite embeddings raise FloatingPointError
        under ``nonfinite="raise"``; under ``"skip"`` every rank returns False and the caller
        skips the step. With ``check_inputs=False`` only the local shape checks run.
        """
        problem = self._local_problem(embeddings, labels)
        code, error = problem if problem is not None else (0, None)
        if not self.check_inputs:
            if error is not None:
                raise error
            return True
        codes = torch.zeros(self.world_size, dtype=torch.int32, device=embeddings.device)
        codes[self.rank] = code
        if is_distributed(self.group):  # every rank learns of bad input: nobody hangs in a collective
            dist.all_reduce(codes, op=dist.ReduceOp.SUM, group=self.group)
        codes = codes.tolist()
        if not any(codes):
            return True
        if code == _BAD_INPUT:
            raise error
        bad = [r for r, c in enumerate(codes) if c == _BAD_INPUT]
        if bad:
            raise ValueError(f"another rank reported invalid labels, embedding shape or dtype: rank(s) {bad} "
                             f"(this is rank {self.rank}, whose input is {'fine' if not code else 'non-finite'}); "
                             "see that rank's error")
        if self.nonfinite == "raise":
            if code:
                raise FloatingPointError(f"{error} ({cfg.HEAD_SECTION}.nonfinite='raise')")
            raise FloatingPointError(f"another rank reported NaN or Inf embeddings: rank(s) "
                                     f"{[r for r, c in enumerate(codes) if c]} (this is rank {self.rank}; "
                                     f"{cfg.HEAD_SECTION}.nonfinite='raise')")
        self.nonfinite_inputs += 1
        log.warning("rank %d: %s; the step is skipped on every rank (%s.nonfinite='skip')", self.rank,
                    error if code else f"rank(s) {[r for r, c in enumerate(codes) if c]} reported NaN or Inf "
                    "embeddings", cfg.HEAD_SECTION)
        return False

    # ------------------------------------------------------------------ forward
    def gather(self, embeddings: torch.Tensor, labels: torch.Tensor,
               batch_sizes: Optional[Sequence[int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """All-gather embeddings (differentiable) and labels: (B, d), (B,) -> (N, d), (N,)."""
        total = sum(batch_sizes) if batch_sizes is not None else embeddings.shape[0] * self.world_size
        scale = total / max(embeddings.shape[0], 1)  # local-mean gradient convention
        x = all_gather_rows(embeddings, self.group, batch_sizes, grad_scale=scale)
        y = all_gather_no_grad(labels.to(torch.int64), self.group, batch_sizes)
        return x, y

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor,
                batch_sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
        """Global-batch mean loss (the same on every rank).

        embeddings (B, d) and labels (B,) are this rank's share of the global batch.
        ``batch_sizes`` lists every rank's B when they differ (None: all equal).
        """
        if not self._check(embeddings, labels):  # non-finite input, nonfinite="skip": agreed by every rank
            return torch.full((), float("nan"), device=embeddings.device)
        x, y = self.gather(embeddings, labels, batch_sizes)  # (N, d), (N,)
        active = self.sampler.sample(y, x.detach() if self.sampler.needs_embeddings else None, self.weight)
        self.last_active = active
        self._maybe_measure(x, active)
        n = x.shape[0]
        total = None
        for rows, index in active.groups():  # one group unless the sampler splits the batch
            if index is None:
                w = self.weight  # (L, d)
            else:  # (K, d); a row-sparse gradient for lazy updates
                w = F.embedding(index, self.weight, sparse=self.update == "lazy")
            part = sharded_margin_loss(x[rows], w, active.targets[rows], self.loss_fn, self.group, self.chunk_size,
                                       self.softmax_backend)
            if active.bounds is not None:
                part = part * ((rows.stop - rows.start) / max(n, 1))
            total = part if total is None else total + part
        return total

    # ------------------------------------------------------------------ sampler upkeep and metrics
    def rebuild_index(self) -> None:
        """Rebuild the sampler's index (ANN) or graph (kNN) from the current weights now."""
        if hasattr(self.sampler, "rebuild"):
            self.sampler.rebuild(self.weight)

    def sampler_stats(self) -> dict:
        """Active-set counts of the last step (active, positives, retrieved, kept, cut, fill,
        staleness) and the last quality metrics, for logging."""
        return dict(getattr(self.sampler, "last_stats", {}), **self.last_metrics)

    def _maybe_measure(self, x: torch.Tensor, active: ActiveSet) -> None:
        every = getattr(self.sampler_config, "metrics_interval", 0)
        steps = getattr(self.sampler, "steps", 0)
        if not every or not torch.is_grad_enabled() or steps % every:
            return
        from ds_xc.sampling.metrics import active_set_quality
        self.last_metrics = active_set_quality(
            x, self.weight, self.class_start, active, self.loss_fn.normalised, self.loss_fn.scale,
            getattr(self.sampler, "last_retrieved", None), group=self.group)
        log.info("sampler quality at step %d: %s", steps, self.last_metrics)

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def topk(self, embeddings: torch.Tensor, k: int = 5, batch_sizes: Optional[Sequence[int]] = None,
             chunk_size: Optional[int] = None) -> torch.Tensor:
        """Global class ids of the k best classes over ALL classes for this rank's rows: (B, k).

        Class-parallel: every rank scores the gathered batch against its shard (cosine for
        margin losses, x.w for softmax), in row chunks, and the per-shard top-k are merged.
        Every rank of the group must call it with its own batch.
        """
        k = min(k, self.num_classes)
        x = all_gather_no_grad(embeddings, self.group, batch_sizes).to(self.weight.dtype)  # (N, d)
        w = self.weight
        if self.loss_fn.normalised:
            w = F.normalize(w.float(), dim=1).to(w.dtype)
            x = F.normalize(x.float(), dim=1).to(w.dtype)
        n = x.shape[0]
        step = chunk_size or self.chunk_size or n
        kl = min(k, self.num_local)
        vals = torch.empty((n, kl), dtype=torch.float32, device=x.device)
        ids = torch.empty((n, kl), dtype=torch.int64, device=x.device)
        for a in range(0, n, max(step, 1)):
            v, i = torch.topk((x[a: a + step] @ w.t()).float(), kl, dim=1)  # (n, kl)
            vals[a: a + step], ids[a: a + step] = v, i + self.class_start
        if is_distributed(self.group):
            vals = _gather_stack(vals, self.group)  # (P, N, kl)
            ids = _gather_stack(ids, self.group)
            vals = vals.permute(1, 0, 2).reshape(n, -1)  # (N, P*kl)
            ids = ids.permute(1, 0, 2).reshape(n, -1)
        best = torch.topk(vals, k, dim=1).indices
        ids = ids.gather(1, best)  # (N, k)
        if batch_sizes is None:
            b = embeddings.shape[0]
            return ids[self.rank * b: (self.rank + 1) * b]
        start = sum(batch_sizes[: self.rank])
        return ids[start: start + batch_sizes[self.rank]]

    # ------------------------------------------------------------------ state
    def get_extra_state(self) -> dict:
        return {"num_classes": self.num_classes, "class_start": self.class_start,
                "num_local": self.num_local, "world_size": self.world_size, "rank": self.rank,
                "embedding_dim": self.embedding_dim, "sampler": self.sampler.state_dict(),
                "weight_checksum": _checksum(self.weight)}

    def set_extra_state(self, state: dict) -> None:
        mine = (self.num_classes, self.class_start, self.num_local, self.embedding_dim)
        theirs = (state["num_classes"], state["class_start"], state["num_local"], state["embedding_dim"])
        if mine != theirs:
            raise RuntimeError(
                f"head shard mismatch on rank {self.rank}: the checkpoint holds classes "
                f"[{theirs[1]}, {theirs[1] + theirs[2]}) of {theirs[0]} (d={theirs[3]}, world size "
                f"{state['world_size']}), this head expects [{mine[1]}, {mine[1] + mine[2]}) of {mine[0]} "
                f"(d={mine[3]}, world size {self.world_size}); reshard the checkpoint to this world size")
        self.sampler.load_state_dict(state["sampler"])

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # check the shard's identity before torch reports a bare size mismatch of the weight
        extra = state_dict.get(prefix + "_extra_state")
        if isinstance(extra, dict):
            self.set_extra_state(extra)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        # an index saved with other weights than the ones now loaded is never used silently
        if isinstance(extra, dict) and hasattr(self.sampler, "invalidate"):
            if extra.get("weight_checksum") != _checksum(self.weight):
                log.info("rank %d: loaded weights differ from the ones the saved index describes; "
                         "the index is rebuilt at the next forward", self.rank)
                self.sampler.invalidate()

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        self.sampler.to(self.weight.device)
        return out


def _checksum(weight: torch.Tensor) -> tuple:
    """A cheap fingerprint of a weight shard: (sum, sum of squares) in float64."""
    w = weight.detach().double()
    return (float(w.sum()), float((w * w).sum()))


def _gather_stack(t: torch.Tensor, group) -> torch.Tensor:
    """(N, k) on each rank -> (P, N, k)."""
    world = group_size(group)
    out = t.new_empty((world * t.shape[0],) + tuple(t.shape[1:]))  # gloo wants a flat (P*N, k)
    gather_flat(out, t.contiguous(), group=group)
    return out.view((world,) + tuple(t.shape))

"""ANN softmax sampler: the classes of highest logit, retrieved per sample from the index.

Legend: N rows of the global batch, d dim, L classes of the shard, K budget per group,
G groups, r = classes retrieved per row on this shard (its share of top_k: retrieval_budgets).

Per step and rank: the normalised gathered embeddings query this shard's index (binary
codes + inverted file, optional exact re-rank); the global batch is split into G groups
of rows, and each group's active set is its positives, then what its rows retrieved (in
rank order), then uniform fill, K = max(ceil(sample_rate * L), min(rows, L)) classes (see
active.py: fixed by the shapes, so a step between index upkeep is static and sync-free). With
G = 1 that is the plain ANN sampler; with more groups every row's retrieval budget grows
from K/N to K*G/N classes while the FLOPs stay N*K*d (the cost: G gathers of K rows).

Index upkeep (counted in training forwards, i.e. calls with gradients enabled): the
index is built at the first forward, after a load whose weights it does not describe,
and every ``rebuild_interval`` steps (early in training at doubling gaps from
``rebuild_warmup`` steps: see base.rebuild_due); in between, the rows that the optimizer changed
are re-encoded every ``encode_interval`` steps, right before they are queried: with lazy
updates the positives and retrieved classes of the last steps (``encode_rows: retrieved``,
the rows with large updates: the first C winners of each step's ranking, C a static bound
that covers them, active.core_size) or their whole active sets (``active``); with dense
updates every row (on a CPU only those whose code may have changed: AnnIndex.refresh). Every read
of the weights goes through ``read_rows`` first, which catches stale rows up under
``update: lazy_exact`` (the default of sampled heads).
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import torch
import torch.nn.functional as F

from ds_xc.sampling.active import Stats, active_size, assemble, core_size
from ds_xc.sampling.ann.index import AnnIndex, exact_cosine_rerank
from ds_xc.sampling.base import ActiveSet, Sampler, budget, local_targets, rebuild_due

log = logging.getLogger(__name__)

__all__ = ["AnnSampler", "group_bounds", "retrieval_budgets", "shard_share"]


def shard_share(total: int, num_local: int, num_classes: int) -> int:
    """This shard's share of a head-wide per-query budget: ceil(total * L / C) (0 stays 0).

    Summed over the shards of a head the shares cover the total (at most P - 1 more), so a
    1-rank and a P-rank head scan and re-rank the same number of rows per query.
    """
    if total <= 0 or num_classes <= 0:
        return 0
    return -(-int(total) * int(num_local) // int(num_classes))


def retrieval_budgets(config, num_local: int, num_classes: int) -> tuple[int, int, int]:
    """(scan_rows, rerank, top_k) per query on a shard of ``num_local`` of ``num_classes`` classes.

    ``scan_budget: head``: the three counts are budgets of the whole head and each shard takes its
    share of its classes (``shard_share``): the top_k share at least ``min(top_k, top_k_min)``, the
    re-rank share at least the shard's top_k. So the scan, the re-rank, the retrieved rows (and the
    rows re-encoded and gathered after them) shrink with more ranks while the union over the
    shards covers what one rank would do. ``shard``: the configured counts on every shard.
    Every count is capped at the shard (the scan is not: a shard within it is scanned flat).
    """
    c = config
    k, scan, rerank = c.top_k, c.scan_rows, c.rerank
    if c.scan_budget == "head":
        scan = shard_share(scan, num_local, num_classes)
        k = max(min(c.top_k, c.top_k_min), shard_share(c.top_k, num_local, num_classes))
        rerank = max(min(k, num_local), shard_share(rerank, num_local, num_classes)) if rerank else 0
    k = min(k, num_local)
    return scan, min(rerank, num_local), k


def group_bounds(num_rows: int, groups: int) -> list:
    """G+1 row offsets splitting N rows into G contiguous, nearly equal groups."""
    groups = max(1, min(groups, num_rows))
    return [round(g * num_rows / groups) for g in range(groups + 1)]


class AnnSampler(Sampler):
    needs_embeddings = True

    def __init__(self, config, num_local, class_start, seed, rank, device=None):
        super().__init__(config, num_local, class_start, seed, rank, device)
        self.index: Optional[AnnIndex] = None
        self.index_seed = int(seed) * 7919 + 101 * (rank + 1)
        self.steps = 0  # training forwards seen
        self.built_at: Optional[int] = None
        self.dirty: list = []  # (R,) local ids of rows to re-encode (may repeat), one tensor per step since the last
        self.dense_updates = False  # set by the head: with dense updates every row changes each step
        self.metric = "cosine"  # set by the head: "dot" for plain softmax (logits x.w)
        self.num_classes = num_local  # set by the head: classes of the whole head (the budgets' shares)
        self.build_seconds: list = []  # wall time of each rebuild (catch-up of stale rows included)
        self.last_retrieved: Optional[torch.Tensor] = None  # (N, r) local ids of the last step
        self._executor = self._pending = self._pending_index = None  # background rebuild
        self._snapshot_step, self._changed_since = 0, []
        self._core = None  # captured steps: the last step's rows to re-encode, kept at one address

    # ------------------------------------------------------------------ upkeep
    def _new_index(self, dim: int) -> AnnIndex:
        c = self.config
        return AnnIndex(dim, c.code_bits, c.rotation, c.nlist, c.kmeans_iterations, self.index_seed, c.backend,
                        metric=self.metric, code_precision=c.code_precision)

    def rebuild(self, weight: torch.Tensor) -> None:
        """Rebuild the index from ``weight`` now (k-means, lists, every code)."""
        start = time.perf_counter()
        if self.index is None:
            self.index = self._new_index(weight.shape[1])
        self.read_rows(None)
        self.index.build(weight)
        self.built_at, self.dirty = self.steps, []
        self.build_seconds.append(time.perf_counter() - start)
        log.info("ANN index of classes [%d, %d) rebuilt at step %d (%d lists) in %.2f s", self.class_start,
                 self.class_start + self.num_local, self.steps, self.index.centroids.shape[0],
                 self.build_seconds[-1])

    def invalidate(self) -> None:
        """Forget the index: the next forward rebuilds it."""
        self.built_at = None

    @property
    def staleness(self) -> int:
        """Steps since the last k-means rebuild (-1 before the first)."""
        return -1 if self.built_at is None else self.steps - self.built_at

    def _extra_stats(self) -> dict:
        return {"staleness": self.staleness}

    def host_work_due(self) -> bool:
        c = self.config
        return (self.index is None or not self.index.built or self.built_at is None
                or rebuild_due(self.steps, self.built_at, c.rebuild_interval, c.rebuild_warmup)
                or (self._pending is not None and self._pending.done()))

    def after_replay(self) -> None:
        self.steps += 1

    def _upkeep(self, weight: torch.Tensor) -> None:
        c = self.config
        self._swap_background(weight)
        if self.index is None or not self.index.built or self.built_at is None:
            self.rebuild(weight)
            return
        if rebuild_due(self.steps, self.built_at, c.rebuild_interval, c.rebuild_warmup):
            if not c.background_rebuild:
                self.rebuild(weight)
                return
            if self._pending is None:
                self._start_background(weight)  # meanwhile the current index is kept up to date
        if c.encode_interval and self.steps % c.encode_interval == 0:
            if self.dense_updates:
                self.read_rows(None)
                self.index.refresh(weight)
            elif self.dirty:
                rows = self.dirty[0] if len(self.dirty) == 1 else torch.cat(self.dirty)  # (R,), may repeat
                if c.encode_interval > 1:  # rows of older steps may have been skipped since: catch them up
                    self.read_rows(rows)   # (the last step's rows were active there: current already)
                self.index.refresh(weight, rows)
            self.dirty = []

    def _start_background(self, weight: torch.Tensor) -> None:
        """Build a new index from a snapshot of the weights in a worker thread."""
        from concurrent.futures import ThreadPoolExecutor
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ds_xc-ann-rebuild")
        fresh = self._new_index(weight.shape[1])
        fresh.projection, fresh.builds = self.index.projection, self.index.builds
        self.read_rows(None)
        snapshot = weight.detach().clone()
        self._pending, self._snapshot_step, self._changed_since = (
            self._executor.submit(fresh.build, snapshot), self.steps, [])
        self._pending_index = fresh
        log.info("ANN index of classes [%d, %d): background rebuild started at step %d", self.class_start,
                 self.class_start + self.num_local, self.steps)

    def _swap_background(self, weight: torch.Tensor) -> None:
        """Adopt a finished background build; re-encode the rows changed since its snapshot."""
        if self._pending is None or not self._pending.done():
            return
        self._pending.result()  # re-raises a failure of the worker
        self.index, self.built_at = self._pending_index, self._snapshot_step
        changed = self._changed_since + self.dirty
        if self.dense_updates:
            self.read_rows(None)
            self.index.refresh(weight)
        elif changed:
            changed = torch.unique(torch.cat(changed))  # at an adoption only: its host sync is allowed
            self.read_rows(changed)
            self.index.refresh(weight, changed)
        self._pending = self._pending_index = None
        self.dirty = []
        log.info("ANN index of classes [%d, %d): background rebuild adopted at step %d", self.class_start,
                 self.class_start + self.num_local, self.steps)

    # ------------------------------------------------------------------ sampling
    def budgets(self) -> tuple[int, int, int]:
        """(scan_rows, rerank, top_k) per query on this shard (``retrieval_budgets``)."""
        return retrieval_budgets(self.config, self.num_local, self.num_classes)

    def retrieve(self, queries: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Local ids (N, top_k) of each unit query's best classes (-1 where fewer exist)."""
        scan, rerank, k = self.budgets()
        if rerank:
            cand = self.index.search(queries, self.config.nprobe, rerank, scan)  # (N, rerank)
            if self.before_read is not None:  # lazy_exact: the re-ranked rows, current (repeats are harmless;
                self.read_rows(cand.clamp_min(0).reshape(-1).sort().values)  # in row order: 40 -> 24 ms on a CPU)
            return exact_cosine_rerank(queries, weight, cand, k, metric=self.metric)
        return self.index.search(queries, self.config.nprobe, k, scan)

    def sample(self, labels, embeddings, weight) -> ActiveSet:
        local, mine = local_targets(labels, self.class_start, self.num_local)
        k = budget(self.config.sample_rate, self.num_local)
        if k >= self.num_local:  # every class: exactly the full softmax
            return ActiveSet(index=torch.arange(self.num_local, device=labels.device),
                             targets=torch.where(mine, local, torch.full_like(local, -1)))
        training = torch.is_grad_enabled()
        self._upkeep(weight)
        queries = F.normalize(embeddings.float(), dim=1)  # (N, d)
        retrieved = self.retrieve(queries, weight)  # (N, r)
        self.last_retrieved = retrieved
        bounds = group_bounds(labels.numel(), self.config.groups)
        c = self.config
        parts, changed = [], []
        for a, b in zip(bounds[:-1], bounds[1:]):
            size = active_size(k, b - a, self.num_local)
            core = core_size(size, b - a, self.num_local, c.retrieved_share) if c.encode_rows == "retrieved" else 0
            part = assemble(local[a:b], mine[a:b], self.num_local, size, self.fill,
                            retrieved[a:b].t().reshape(-1), c.retrieved_share, core=core)  # rank-major candidates
            parts.append(part)
            changed.append(part.core if core else part.index)  # (C,) or (K,): the rows this step moves most
        self._stats = Stats.total([p.stats for p in parts])
        if training:
            self.steps += 1
            if self.graphed:  # captured steps: the rows to re-encode at a fixed address (one group, interval 1)
                if self._core is None or self._core.shape != changed[0].shape:
                    self._core = torch.empty_like(changed[0])
                changed = [self._core.copy_(changed[0])]
            if c.encode_interval:
                self.dirty.extend(changed)
            if self._pending is not None:
                self._changed_since.extend(changed)
        if len(parts) == 1:
            return ActiveSet(index=parts[0].index, targets=parts[0].targets)
        return ActiveSet(index=[p.index for p in parts], targets=torch.cat([p.targets for p in parts]),
                         bounds=bounds)

    # ------------------------------------------------------------------ state
    def _move_state(self, device: torch.device, from_meta: bool) -> None:
        """Index tensors, pending dirty rows and the last retrieval follow the head. A background
        build in flight (of the weights on the old device) is dropped: the due rebuild restarts."""
        if self._pending is not None:
            self._pending = self._pending_index = None
            self._changed_since = []
        if from_meta:  # meta tensors hold no values: forget the index, rebuild at the next forward
            self.index, self.built_at, self.dirty, self.last_retrieved = None, None, [], None
            return
        self.dirty = [t.to(device) for t in self.dirty]
        if self.last_retrieved is not None:
            self.last_retrieved = self.last_retrieved.to(device)
        if self.index is not None:
            self.index.to(device)

    def state_dict(self) -> dict:
        dirty = torch.unique(torch.cat(self.dirty)) if self.dirty else None  # (R,) distinct rows to re-encode
        return dict(super().state_dict(), steps=self.steps, built_at=self.built_at, dirty=dirty,
                    index=None if self.index is None else self.index.state_dict())

    def load_state_dict(self, state: dict) -> None:
        missing = [k for k in ("steps", "built_at", "dirty") if k not in state]
        if missing:  # checked first: nothing of this sampler changes
            raise ValueError(f"ANN sampler state without {missing} (its keys: {sorted(state)}): it was saved by "
                             "another sampler type (uniform/full save a fill stream only, knn a graph); nothing "
                             "was loaded. Resume with the sampler type it was saved with")
        self._pending = self._pending_index = None  # a background build of other weights is dropped
        super().load_state_dict(state)
        self.steps, self.built_at = int(state["steps"]), state["built_at"]
        self.dirty = [] if state["dirty"] is None else [state["dirty"].to(self.device)]
        if state.get("index") is None:
            self.index, self.built_at = None, None
            return
        self.metric = state["index"].get("metric", self.metric)
        dim = state["index"]["projection"].shape[0] - (1 if self.metric == "dot" else 0)
        self.index = self._new_index(dim)
        self.index.load_state_dict(state["index"], self.device)

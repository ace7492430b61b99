"""KNN softmax sampler: active set = positives, their nearest classes, then uniform fill.

Legend: L classes of the shard, d dim, k neighbours per class.

A k-nearest-neighbour graph over the shard's unit class weights, (L, k) local ids by
decreasing cosine, is built at the first training forward, after loading, and every
``rebuild_interval`` steps (at doubling gaps from ``rebuild_warmup`` early on): ``exact`` by matmul + top-k
over row tiles of bounded size (O(L^2 d): for shards up to ~10^5 classes on a CPU), ``ann`` through an ANN
index (binary codes + inverted file, re-ranked exactly) for large shards. Neighbours of the batch's
positives are taken in rank order (every positive's nearest, then every positive's second nearest, ...;
within a rank by class id). A step between rebuilds is static and sync-free (active.py): the rows'
neighbour lists (N, k) are read whole, rows of other shards masked out.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F

from ds_xc.sampling.active import active_size, assemble
from ds_xc.sampling.ann.index import AnnIndex, exact_cosine_rerank
from ds_xc.sampling.base import ActiveSet, Sampler, budget, local_targets, rebuild_due

log = logging.getLogger(__name__)

__all__ = ["KnnSampler", "knn_graph_exact", "knn_graph_ann", "TILE_BYTES"]

TILE_BYTES = 256 << 20  # largest (rows x L) float32 similarity tile of an exact graph build


@torch.no_grad()
def knn_graph_exact(weight: torch.Tensor, k: int, chunk: int = 4096, tile_bytes: int = TILE_BYTES) -> torch.Tensor:
    """(L, k) ids of each row's k most similar other rows by cosine, best first.

    Rows are scored in tiles of at most ``chunk`` rows and ``tile_bytes`` of (rows, L) float32
    similarities (256 MiB: 64 rows at L = 10^6 instead of a 16 GB tile of 4,096 rows)."""
    wn = F.normalize(weight.detach().float(), dim=1)
    n = wn.shape[0]
    k = min(k, n - 1)
    chunk = max(1, min(chunk, tile_bytes // (4 * max(n, 1))))
    out = torch.empty((n, k), dtype=torch.int64, device=wn.device)
    for a in range(0, n, chunk):
        sims = wn[a: a + chunk] @ wn.t()  # (c, L)
        rows = torch.arange(a, min(a + chunk, n), device=wn.device)
        sims[rows - a, rows] = float("-inf")  # not its own neighbour
        out[a: a + chunk] = torch.topk(sims, k, dim=1).indices
    return out


@torch.no_grad()
def knn_graph_ann(weight: torch.Tensor, k: int, seed: int, code_bits: int = 256, nprobe: int = 16,
                  chunk: int = 8192) -> torch.Tensor:
    """(L, k) approximate neighbour ids (-1 where fewer found) through an ANN index."""
    wn = F.normalize(weight.detach().float(), dim=1)
    index = AnnIndex(wn.shape[1], code_bits, seed=seed)
    index.build(wn)
    n = wn.shape[0]
    k = min(k, n - 1)
    out = torch.empty((n, k), dtype=torch.int64, device=wn.device)
    for a in range(0, n, chunk):
        q = wn[a: a + chunk]
        cand = index.search(q, nprobe, min(n, 4 * (k + 1)))
        rows = torch.arange(a, a + q.shape[0], device=wn.device)[:, None]
        cand = torch.where(cand == rows, torch.full_like(cand, -1), cand)  # drop self
        out[a: a + chunk] = exact_cosine_rerank(q, wn, cand, k)
    return out


class KnnSampler(Sampler):
    def __init__(self, config, num_local, class_start, seed, rank, device=None):
        super().__init__(config, num_local, class_start, seed, rank, device)
        self.graph: Optional[torch.Tensor] = None  # (L, k)
        self.steps, self.built_at = 0, None
        self.graph_seed = int(seed) * 7919 + 131 * (rank + 1)

    def rebuild(self, weight: torch.Tensor) -> None:
        """Rebuild the neighbour graph from ``weight`` now."""
        self.read_rows(None)
        c = self.config
        if c.graph == "ann":
            self.graph = knn_graph_ann(weight, c.neighbors, self.graph_seed)
        else:
            self.graph = knn_graph_exact(weight, c.neighbors)
        self.built_at = self.steps
        log.info("kNN graph of classes [%d, %d) rebuilt at step %d", self.class_start,
                 self.class_start + self.num_local, self.steps)

    def invalidate(self) -> None:
        self.built_at = None

    @property
    def staleness(self) -> int:
        return -1 if self.built_at is None else self.steps - self.built_at

    def _extra_stats(self) -> dict:
        return {"staleness": self.staleness}

    def host_work_due(self) -> bool:
        c = self.config
        return self.graph is None or self.built_at is None or rebuild_due(self.steps, self.built_at,
                                                                           c.rebuild_interval, c.rebuild_warmup)

    def after_replay(self) -> None:
        self.steps += 1

    def candidates(self, local: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
        """(N k,) the positives' neighbours in priority order: rank-major, within a rank by class id
        (rows sorted by their class; rows of other shards give -1)."""
        slots = torch.where(mine, local, self.num_local)  # (N,) other shards sort last
        order = torch.sort(slots, stable=True)  # (N,)
        rows = order.values.clamp(max=self.num_local - 1)
        cand = self.graph.index_select(0, rows)  # (N, k)
        cand = torch.where((order.values < self.num_local)[:, None], cand, -1)
        return cand.t().reshape(-1)  # (k N,) every row's nearest, then every row's second nearest, ...

    def sample(self, labels, embeddings, weight) -> ActiveSet:
        local, mine = local_targets(labels, self.class_start, self.num_local)
        k = active_size(budget(self.config.sample_rate, self.num_local), labels.numel(), self.num_local)
        if k >= self.num_local:
            return ActiveSet(index=torch.arange(self.num_local, device=labels.device),
                             targets=torch.where(mine, local, torch.full_like(local, -1)))
        c = self.config
        if self.graph is None or self.built_at is None or rebuild_due(
                self.steps, self.built_at, c.rebuild_interval, c.rebuild_warmup):
            self.rebuild(weight)
        out = assemble(local, mine, self.num_local, k, self.fill, self.candidates(local, mine), c.retrieved_share)
        self._stats = out.stats
        if torch.is_grad_enabled():
            self.steps += 1
        return ActiveSet(index=out.index, targets=out.targets)

    def _move_state(self, device: torch.device, from_meta: bool) -> None:
        if self.graph is None:
            return
        if from_meta:  # a meta graph holds no neighbours: rebuild at the next forward
            self.graph, self.built_at = None, None
        else:
            self.graph = self.graph.to(device)  # (L, k) int64

    def state_dict(self) -> dict:
        return dict(super().state_dict(), steps=self.steps, built_at=self.built_at, graph=self.graph)

    def load_state_dict(self, state: dict) -> None:
        missing = [k for k in ("steps", "built_at", "graph") if k not in state]
        if missing:  # checked first: nothing of this sampler changes
            raise ValueError(f"kNN sampler state without {missing} (its keys: {sorted(state)}): it was saved by "
                             "another sampler type (uniform/full save a fill stream only, ann an index); nothing "
                             "was loaded. Resume with the sampler type it was saved with")
        super().load_state_dict(state)
        self.steps, self.built_at = int(state["steps"]), state["built_at"]
        self.graph = None if state["graph"] is None else state["graph"].to(self.device)
        if self.graph is None:
            self.built_at = None

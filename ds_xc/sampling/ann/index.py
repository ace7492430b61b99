"""The ANN index of one class shard: binary codes in an inverted file over unit weights.

Legend: L rows (classes of the shard), d dim, b code bits, c lists, N queries.

``build(weight)`` learns the projection (once; ITQ on a sample), runs spherical k-means,
assigns every row to a list and stores the rows' codes in list order (CSR, the layout of
ops/hamming.py). ``refresh(weight, rows)`` re-encodes rows whose weights changed, in
place: list membership stays until the next ``build`` (a row's list is a coarse cell,
its code is what ranks it). Once ``refresh`` has been asked for every row (the sampler
does with dense updates), only rows whose code may have changed are encoded: each row
keeps the unit vector it was encoded from (float32, L x d x 4 bytes) and a safe radius
around it inside which no bit can flip (``refresh`` derives it), so a refresh costs
O(L*d) to check plus the projection of the rows that moved far enough, with exactly the
codes of encoding all. ``search(queries, nprobe, k, scan_rows)`` returns, per query, the
k rows of smallest Hamming distance in its nprobe nearest lists (more lists, nearest first,
until at least scan_rows rows are scanned), and ``rerank`` re-orders a
longer candidate list by the exact cosine.

Metrics: ``cosine`` (margin losses) indexes the unit weights. ``dot`` (plain softmax,
whose logits are x.w) uses the classic reduction of maximum inner product search to
cosine search: every weight becomes the unit vector [w / M, sqrt(1 - |w|^2 / M^2)] with M
the largest row norm at build time, and a query becomes [x / |x|, 0], so the cosine of
the two is x.w / (M |x|): the same order as the logits, for every query.
"""
from __future__ import annotations

import logging
import math
import os
from typing import Optional

import torch
import torch.nn.functional as F

from ds_xc.sampling.ann.codes import (encode, encode_with_margins, itq_projection, random_projection,
                                      resolve_precision)
from ds_xc.sampling.ann.ivf import assign, build_lists, kmeans_sample, spherical_kmeans
from ds_xc_ops import rows as native_rows
from ds_xc_ops.hamming import hamming_topk_ivf
from ds_xc_ops.matmul import LOW_PRECISION, bmm_f32

log = logging.getLogger(__name__)

__all__ = ["AnnIndex", "exact_cosine_rerank"]

_ITQ_SAMPLE = 20000  # rows used to learn the ITQ rotation
_BUILD_CHUNK = 1 << 15  # rows assigned and encoded at a time by build()
_REFRESH_CHUNK = 1 << 13  # rows checked (and re-encoded) at a time by refresh()
_STATIC_REFRESH_BYTES = 256 << 20  # float temporaries of one block of an untracked refresh (every row asked)
_U = 2.0 ** -24  # float32 unit roundoff
_RERANK_BYTES = 256 << 20  # largest (queries, candidates, d) block of gathered rows in a re-rank
TRACKING_ENV = "DS_XC_ANN_TRACKING"  # "0": no safe-radius tracking (see AnnIndex.refresh)


def tracking_allowed(device: torch.device) -> bool:
    """The safe-radius tracking of ``refresh`` skips the rows whose codes cannot have changed: work
    saved on a CPU, at the price of data-dependent sizes (a host sync per refresh). On other devices,
    and with ``DS_XC_ANN_TRACKING=0``, every row asked for is re-encoded: static, sync-free."""
    return device.type == "cpu" and os.environ.get(TRACKING_ENV, "1") != "0"


def _matmul_roundoff(device: torch.device) -> float:
    """The unit roundoff of a float32 matmul here: 2^-24, or 2^-8 (covering TF32's 2^-11 and bf16
    passes) when torch may use reduced precision (``set_float32_matmul_precision`` other than
    "highest", or TF32 on CUDA); the safe radii are then mostly negative and tracking pauses."""
    reduced = torch.get_float32_matmul_precision() != "highest"
    reduced = reduced or (device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32)
    return 2.0 ** -8 if reduced else _U


class AnnIndex:
    """Binary codes + inverted file over the rows of one weight shard."""

    # refresh(): when a refresh of every row re-encodes more than this share of them, the safe-radius
    # check costs more than it saves (measured: benchmarks/results/ann_reencode.md), so tracking stops
    # (its memory is freed) and restarts after ``retry_every`` further refreshes of every row
    track_max_share, retry_every = 0.5, 64

    def __init__(self, dim: int, code_bits: int, rotation: str = "random", nlist: int = 0,
                 kmeans_iterations: int = 10, seed: int = 0, backend: str = "auto", metric: str = "cosine",
                 code_precision: str = "float32"):
        if metric not in ("cosine", "dot"):
            raise ValueError(f"metric={metric!r}: allowed 'cosine', 'dot'")
        resolve_precision(code_precision, torch.device("cpu"))  # checks the name
        self.code_precision = code_precision  # of the untracked encodes (see encode); tracking: float32
        self.metric, self.max_norm = metric, None
        dim = dim + 1 if metric == "dot" else dim  # the extra coordinate of the MIPS reduction
        self.dim, self.code_bits, self.rotation = dim, code_bits, rotation
        self.nlist_config, self.kmeans_iterations = nlist, kmeans_iterations
        self.seed, self.backend = int(seed), backend
        self.projection: Optional[torch.Tensor] = None  # (d, b)
        self.centroids: Optional[torch.Tensor] = None  # (c, d)
        self.list_offsets = self.list_ids = self.list_codes = self.position = None
        self.encoded_from = self.radius = None  # (L, d) float32 unit rows, (L,) float32: see refresh
        self.col_norm = 1.0  # the largest column norm of the projection
        self.builds = 0
        self.last_refresh = (0, 0)  # (rows checked, rows re-encoded) by the last refresh
        self._full_refreshes, self._retry_at = 0, 0  # refreshes of every row; when tracking may restart
        self._plan = None  # (key, (flat, width)) of probe(): see _probe_plan

    @property
    def built(self) -> bool:
        return self.list_codes is not None

    @property
    def list_sizes(self) -> torch.Tensor:
        """(c,) rows per list."""
        return self.list_offsets[1:] - self.list_offsets[:-1]

    def num_lists(self, rows: int) -> int:
        return min(rows, self.nlist_config or max(1, round(math.sqrt(rows))))

    def unit_rows(self, weight: torch.Tensor, normalise: bool = True) -> torch.Tensor:
        """The vectors indexed for weight rows (R, d): (R, d), or (R, d+1) for ``dot``; unit
        length unless ``normalise`` is False (enough for codes: signs ignore the norm)."""
        w = weight.detach().float()
        if self.metric == "cosine":
            return F.normalize(w, dim=1) if normalise else w
        w = w / self.max_norm
        extra = (1.0 - (w * w).sum(dim=1, keepdim=True)).clamp_min(0.0).sqrt()
        aug = torch.cat([w, extra], dim=1)
        return F.normalize(aug, dim=1) if normalise else aug  # renormalise rows grown past M

    def unit_queries(self, queries: torch.Tensor) -> torch.Tensor:
        q = F.normalize(queries.float(), dim=1)
        return q if self.metric == "cosine" else torch.cat([q, q.new_zeros((q.shape[0], 1))], dim=1)

    @torch.no_grad()
    def build(self, weight: torch.Tensor) -> None:
        """(Re)build everything from the current weights (L, d)."""
        if self.metric == "dot":
            self.max_norm = float(weight.detach().float().norm(dim=1).max().clamp_min(1e-12))
        rows, dev = weight.shape[0], weight.device
        if self.projection is None:
            if self.rotation == "itq":
                gen = torch.Generator().manual_seed(self.seed + 17)
                sample = self.unit_rows(weight[torch.randperm(rows, generator=gen)[:_ITQ_SAMPLE].to(dev)])
                self.projection = itq_projection(sample.cpu(), self.code_bits, 20, self.seed)
            else:
                self.projection = random_projection(self.dim, self.code_bits, self.seed)
        self.projection = self.projection.to(dev)
        self.col_norm = float(torch.linalg.vector_norm(self.projection.double(), dim=0).max())
        c = self.num_lists(rows)
        gen = torch.Generator().manual_seed((self.seed + self.builds) % (2**63))
        train = self.unit_rows(weight[kmeans_sample(rows, c, gen).to(dev)])  # (<= 64 c, d) unit rows
        self.centroids = spherical_kmeans(train, c, self.kmeans_iterations, self.seed + self.builds)
        # Assignment and codes in row chunks: no normalised copy of the whole shard (an
        # argmax of cosines and the signs of projections ignore the row norms).
        lists = torch.empty(rows, dtype=torch.int64, device=dev)
        codes = torch.empty((rows, self.code_bits // 8), dtype=torch.uint8, device=dev)
        if self.encoded_from is not None:  # tracking (see refresh): for every row of the new build
            self.encoded_from = torch.empty((rows, self.dim), dtype=torch.float32, device=dev)
            self.radius = torch.empty(rows, dtype=torch.float32, device=dev)
        for a in range(0, rows, _BUILD_CHUNK):
            u = self.unit_rows(weight[a: a + _BUILD_CHUNK], normalise=False)  # (chunk, d)
            lists[a: a + _BUILD_CHUNK] = assign(u, self.centroids)
            for b in range(0, u.shape[0], _REFRESH_CHUNK):  # (chunk, b) float projections at a time
                part = u[b: b + _REFRESH_CHUNK]
                codes[a + b: a + b + part.shape[0]] = self._encode(part, slice(a + b, a + b + part.shape[0]))
        offsets, ids = build_lists(lists, c)
        self.list_offsets, self.list_ids = offsets, ids
        self.list_codes = codes[ids]  # (L, b/8) in list order
        self.position = torch.empty_like(ids)
        self.position[ids] = torch.arange(rows, device=ids.device)  # row -> slot in list order
        self.builds += 1
        log.debug("ANN index built: %d rows, %d lists, %d bits", rows, c, self.code_bits)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Codes (n, b/8) of the rows x (n, d) as this index encodes untracked rows and queries
        (``code_precision``; tracked rows are encoded in float32, see :meth:`refresh`)."""
        return encode(x, self.projection, precision=resolve_precision(self.code_precision, x.device))

    def _encode(self, u: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Codes (R, b/8) of the projected vectors u (R, d) of local rows ``rows`` (ids (R,) or a slice),
        recording what they were encoded from and their safe radius (see :meth:`refresh`)."""
        if self.encoded_from is None:  # not tracking: the codes only
            return self.encode(u)
        codes, margins = encode_with_margins(u, self.projection)
        unit = _matmul_roundoff(u.device)
        self.encoded_from[rows] = F.normalize(u.float(), dim=1)  # (R, d)
        self.radius[rows] = margins / self.col_norm * (1.0 - (self.dim + 4) * unit) - (6 * self.dim + 16) * unit
        return codes

    @torch.no_grad()
    def refresh(self, weight: torch.Tensor, rows: Optional[torch.Tensor] = None) -> None:
        """Re-encode ``rows`` (all when None) from the current weights; lists are kept.

        Only rows whose code may differ from the stored one are encoded, so the codes are exactly
        those of encoding every row (tests/test_ann_refresh.py). The criterion: a row was encoded from
        the vector u (what ``unit_rows`` projects: the raw row for ``cosine``, the augmented row for
        ``dot``), bit j = [z_j > 0] with z = fl(u P). Signs ignore positive scaling, so compare unit
        vectors: with û = u/|u| and û' the new one, exactly |û'.p_j - û.p_j| <= |û' - û| |p_j|, and a
        float32 dot product of length d is within g_d |u| |p_j| of the exact one (g_d ~ d 2^-24). So
        bit j cannot flip while

            |û' - û| < min_j |z_j| / (|u| max_j |p_j|) - 2 g_d - (normalisation and norm errors),

        the right side is the row's ``radius`` (computed at encoding, with a slack of (6d + 16) 2^-24
        for the rounding terms: the two dot products, the two normalisations, the norm and the
        distance), and |û' - û| is checked as |n' - n|, n and n' the float32 unit rows (n stored).
        Weight decay alone (a rescaling) never re-encodes a row; a row with a projection within the
        slack of zero is re-encoded whenever it is refreshed. Tracking (the stored rows and radii)
        starts at the first refresh of every row, which encodes every row; until then, and after
        loading a state dict (they are not saved), the rows asked for are simply encoded. When a
        refresh of every row re-encodes more than ``track_max_share`` of them (rows still moving under
        momentum), tracking pauses for ``retry_every`` such refreshes. P's columns are unit vectors (an
        orthogonal rotation or ITQ's PCA times a rotation), so max_j |p_j| is 1 up to rounding; it is
        measured anyway. Cost: O(R*d) to check, plus O(R'*d*b) for the R' rows re-encoded.

        Tracking runs on the CPU only (:func:`tracking_allowed`): its R' is data-dependent, a host sync
        on a GPU, where encoding all R rows costs less than the wait. ``rows`` may repeat (the sampler
        passes fixed-size lists): a repeated row gets the same code twice.
        """
        if rows is not None and rows.numel() == 0:
            self.last_refresh = (0, 0)
            return
        if not tracking_allowed(weight.device):  # static: every row asked for, re-encoded
            self.encoded_from = self.radius = None
            total = weight.shape[0] if rows is None else rows.numel()
            chunk = max(_REFRESH_CHUNK, _STATIC_REFRESH_BYTES // (4 * (self.code_bits + self.dim)))  # fewer launches
            for a in range(0, total, chunk):
                sel = slice(a, min(a + chunk, total)) if rows is None else rows[a: a + chunk]
                ids = torch.arange(sel.start, sel.stop, device=weight.device) if rows is None else sel  # (R,)
                self.list_codes[self.position[ids]] = self.encode(self.unit_rows(weight[sel], normalise=False))
            self.last_refresh = (total, total)
            return
        tracked = self.encoded_from is not None
        if rows is None:
            self._full_refreshes += 1
            if not tracked and self._full_refreshes >= self._retry_at:  # (re)start tracking: encode all
                n = self.list_ids.numel()
                self.encoded_from = torch.zeros((n, self.dim), dtype=torch.float32, device=self.list_ids.device)
                self.radius = torch.full((n,), -1.0, dtype=torch.float32, device=self.list_ids.device)
        total = weight.shape[0] if rows is None else rows.numel()
        encoded = 0
        for a in range(0, total, _REFRESH_CHUNK):
            sel = slice(a, min(a + _REFRESH_CHUNK, total)) if rows is None else rows[a: a + _REFRESH_CHUNK]
            u = self.unit_rows(weight[sel], normalise=False)  # (R, d)
            ids = torch.arange(sel.start, sel.stop, device=u.device) if rows is None else sel  # (R,)
            if self.encoded_from is not None:
                t = F.normalize(u, dim=1).sub_(self.encoded_from[sel])
                redo = (torch.linalg.vector_norm(t, dim=1) >= self.radius[sel]).nonzero().squeeze(1)  # (R',)
                if redo.numel() < ids.numel():  # only the rows that may have changed code
                    u, ids, sel = u[redo], ids[redo], ids[redo]
            encoded += ids.numel()
            if ids.numel():
                self.list_codes[self.position[ids]] = self._encode(u, sel)
        self.last_refresh = (total, encoded)
        if rows is None and tracked and encoded > self.track_max_share * total:
            # most rows moved: the check costs more than it saves; plain re-encodes for a while
            self.encoded_from = self.radius = None
            self._retry_at = self._full_refreshes + self.retry_every
            log.debug("ANN refresh re-encoded %d of %d rows: tracking paused for %d refreshes", encoded, total,
                      self.retry_every)

    def _probe_plan(self, nprobe: int, scan_rows: int) -> tuple[bool, int]:
        """(scan every list, lists ranked per query) for ``probe``: host ints from the list sizes,
        computed once per build (one host sync then) and kept until the next build or load."""
        key = (self.builds, self.list_offsets.data_ptr(), nprobe, scan_rows)
        if self._plan is None or self._plan[0] != key:
            sizes = (self.list_offsets[1:] - self.list_offsets[:-1]).tolist()  # (c,) at build time only
            c = len(sizes)
            if sum(sizes) <= scan_rows:  # the whole shard is within budget: every list
                plan = (True, c)
            else:
                # No query keeps more lists than nprobe or than the smallest lists whose sizes stay under the
                # budget (rows before a list are at least the sum of that many smallest lists).
                before, count = 0, 0
                for size in sorted(sizes):
                    if before >= scan_rows:
                        break
                    before, count = before + size, count + 1
                plan = (False, min(c, max(nprobe, count)))
            self._plan = (key, plan)
        return self._plan[1]

    @torch.no_grad()
    def probe(self, unit_queries: torch.Tensor, nprobe: int, scan_rows: int = 0) -> torch.Tensor:
        """Lists to scan per query (N, W), best centroid first, -1 = none.

        The nprobe lists of largest centroid score, then further lists in score order while
        the query has fewer than ``scan_rows`` rows to scan: a budget in rows rather than
        lists, so a small shard (<= scan_rows rows) is scanned flat and a large one keeps
        its cost bounded. W is fixed per build (``_probe_plan``), so a step has static shapes
        and no host sync: queries that keep fewer lists are padded with -1.
        """
        scores = unit_queries @ self.centroids.t()  # (N, c)
        c = scores.shape[1]
        nprobe = min(nprobe, c)
        if scan_rows <= 0 or nprobe == c:
            return torch.topk(scores, nprobe, dim=1).indices
        flat, width = self._probe_plan(nprobe, scan_rows)
        if flat:
            return torch.arange(c, device=scores.device).expand(scores.shape[0], c).contiguous()
        if width < c:  # a partial sort: at 10^6 rows, ~100 of 1,000 lists
            order = torch.topk(scores, width, dim=1).indices  # (N, W), best first
        else:
            order = torch.argsort(scores, dim=1, descending=True)  # (N, c)
        sizes = self.list_sizes.index_select(0, order.reshape(-1)).view(order.shape)  # (N, W)
        before = torch.cumsum(sizes, dim=1) - sizes  # rows scanned before each list
        keep = before < scan_rows
        keep[:, :nprobe].fill_(True)
        return torch.where(keep, order, -1)

    @torch.no_grad()
    def search(self, queries: torch.Tensor, nprobe: int, k: int, scan_rows: int = 0) -> torch.Tensor:
        """Local row ids (N, k) of smallest Hamming distance in each query's probed lists
        (``probe``; -1: none). queries (N, d) need not be normalised.
        """
        q = self.unit_queries(queries)
        probes = self.probe(q, nprobe, scan_rows)
        codes = self.encode(q)  # (N, b/8)
        _, ids = hamming_topk_ivf(codes, self.list_codes, self.list_ids, self.list_offsets, probes, k,
                                  backend=self.backend, check=False)
        return ids

    _TENSORS = ("projection", "centroids", "list_offsets", "list_ids", "list_codes", "position", "encoded_from",
                "radius")

    def to(self, device) -> AnnIndex:
        """Move every index tensor to ``device`` (in place; dtypes kept: float32 projection and
        centroids, int64 lists, uint8 codes, whatever the weight dtype)."""
        for name in self._TENSORS:
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device))
        return self

    def state_dict(self) -> dict:
        return {"projection": self.projection, "centroids": self.centroids, "list_offsets": self.list_offsets,
                "list_ids": self.list_ids, "list_codes": self.list_codes, "builds": self.builds,
                "code_bits": self.code_bits, "rotation": self.rotation, "metric": self.metric,
                "max_norm": self.max_norm}

    def load_state_dict(self, state: dict, device=None) -> None:
        mine = (self.code_bits, self.rotation, self.metric)
        theirs = (state["code_bits"], state["rotation"], state.get("metric", "cosine"))
        if mine != theirs:
            raise ValueError(f"saved ANN index has (code_bits, rotation, metric)={theirs}, this sampler has {mine}")
        self.max_norm = state.get("max_norm")
        move = (lambda t: None if t is None else t.to(device)) if device is not None else (lambda t: t)
        self.projection, self.centroids = move(state["projection"]), move(state["centroids"])
        self.list_offsets, self.list_ids = move(state["list_offsets"]), move(state["list_ids"])
        self.list_codes, self.builds = move(state["list_codes"]), int(state["builds"])
        self.encoded_from = self.radius = None  # not saved: tracking restarts at the next refresh of every row
        if self.projection is not None:
            self.col_norm = float(torch.linalg.vector_norm(self.projection.double(), dim=0).max())
        if self.list_ids is not None:
            self.position = torch.empty_like(self.list_ids)
            self.position[self.list_ids] = torch.arange(self.list_ids.numel(), device=self.list_ids.device)


@torch.no_grad()
def exact_cosine_rerank(queries: torch.Tensor, weight: torch.Tensor, candidates: torch.Tensor, k: int,
                        metric: str = "cosine", block_bytes: int = _RERANK_BYTES) -> torch.Tensor:
    """Re-order candidates (N, R) (-1 = none) by the exact cosine (or dot product) with
    queries (N, d); keep k: (N, k) local ids, -1 where fewer than k candidates exist.

    float32 rows on CPU: one kernel scores every candidate (``ds_xc_ops.rows.rerank_scores``: each
    row read once, prefetched ahead). Otherwise the candidate rows of as many queries as fit in
    ``block_bytes`` (every query at once at the defaults) are gathered and scored by one batched
    matmul: 16-bit weights on tensor cores with float32 results (ds_xc_ops.matmul), float32 weights
    at the user's matmul precision. Static shapes, no host sync.
    """
    n_rows, r = candidates.shape
    w_all = weight.detach()
    scores = native_rows.rerank_scores(queries.float().contiguous(), w_all, candidates.contiguous(),
                                       metric == "cosine")  # (N, R), one pass over the rows (float32, CPU)
    if scores is None:
        d = w_all.shape[1]
        block = max(1, min(n_rows, block_bytes // max(1, r * d * w_all.element_size())))
        scores = torch.empty((n_rows, r), dtype=torch.float32, device=candidates.device)
        for a in range(0, n_rows, block):
            cand = candidates[a: a + block]  # (n, R)
            w = native_rows.gather_rows(w_all, cand.clamp_min(0).reshape(-1)).view(cand.shape[0], r, d)  # (n, R, d)
            w = w if w.dtype in LOW_PRECISION else w.float()  # 16-bit rows stay 16-bit: tensor cores
            q = queries[a: a + block].to(w.dtype).unsqueeze(2)  # (n, d, 1)
            score = bmm_f32(w, q).squeeze(2)  # (n, R) float32
            if metric == "cosine":  # divide by the row norms rather than write a normalised copy of w
                score = score / torch.linalg.vector_norm(w, dim=2, dtype=torch.float32).clamp_min(1e-12)
            scores[a: a + block] = score
        scores.masked_fill_(candidates < 0, float("-inf"))
    top = torch.topk(scores, min(k, r), dim=1)
    picked = torch.where(torch.isfinite(top.values), candidates.gather(1, top.indices), -1)  # (N, min(k, R))
    if picked.shape[1] == k:
        return picked
    return torch.cat([picked, picked.new_full((n_rows, k - picked.shape[1]), -1)], dim=1)

"""Per-rank memory model of a ds_xc job: what each component allocates, from the config.

Legend (per rank r of P): C classes, L = C // P + (r < C % P) classes of this shard (uneven
shards: the first C % P ranks hold one more), d embedding dim, e bytes per head element
(4 float32, 8 float64, 2 bfloat16), s = 8 for float64 heads else 4 (the softmax statistics'
dtype), N rows of the gathered batch (micro batch x P), G sample groups (ann), K active
classes per group = ceil(sample_rate * L) (K = L for the full sampler), n = min(chunk_size, N)
rows per logits chunk (chunk_size 0: n = N), b code bits, c = nlist or round(sqrt(L)) lists,
d' = d + 1 for the plain softmax (the ann index's inner-product augmentation) else d,
p backbone parameters.

Persistent bytes (held between steps, after the first optimizer step: the head optimizer
creates its state lazily at its first step):

=====================  ===================================================================
head_weight            L d e
head_optimizer         sgd, momentum > 0: L d e (bf16: master_fp32 L d 8, plain and
                       stochastic_rounding L d 2); sgd without momentum: 0;
                       adamw: 2 L d e + 4 (the step counter; bf16: stochastic_rounding
                       L d (2 + 4), master_fp32 L d 12, plain L d 4)
lazy_exact             8 L (int64 "last current at" per row) + 2 x 32 (W + 1) (float64 suffix
                       products of the last W = 1,024 steps, and the buffer they are updated into)
ann_index              4 d' b (projection) + 4 c d' (centroids) + 8 (c + 1) (list offsets)
                       + 8 L (list ids) + L b / 8 (codes) + 8 L (row -> slot); dense updates
                       also track 4 L d' + 4 L (encoded unit rows and safe radii)
sampler_buffers        ann: 8 N top_k (last retrieval) + 8 C G (the last step's rows to re-encode:
                       C = active.core_size with encode_rows retrieved, K with active)
knn_graph              8 L min(neighbors, L - 1)
backbone               ZeRO 0, fp32: 4 p params + 4 p grads + optimizer state (Adam/AdamW
                       and Lamb 8 p, SGD with momentum and LARS 4 p); bf16: 2 p params +
                       2 p grads + 4 p fp32 master + 4 p fp32 grads + state; ZeRO 1/2: the
                       fp32 master and the state divided by P (and the grads at stage 2)
head_workspace         the scratch the head keeps between steps (ds_xc/head/workspace.py), each
                       buffer only if at most 256 MiB: the logits n K s; the active rows K d e
                       (sampled heads); cosine losses with float32/float64 weights: the rows with
                       their factors s/|w| folded in, K d s (K = L for the full sampler)
compression            4 p (error-feedback residual) + 4 p (the velocity, momentum_correction
                       null or > 0) + 4 p under ZeRO stage 1 with select_by auto/update and
                       topk or bayes_prior (the snapshot of Adam's second moment the update
                       score reads, ds_xc/compression/zero_score.py): an upper bound, tensors
                       below min_numel are not compressed, null has no velocity with an
                       optimizer without momentum, and auto has no snapshot without an Adam
baseline               the process itself (torch + deepspeed imported), measured and passed in
=====================  ===================================================================

Transient bytes, per phase (what exists on top of the persistent bytes at the phase's peak):

* train forward end: gathered embeddings 4 N d + 8 N, their gradient s N d, the gathered
  active rows G K d e (none for the full sampler), the stored weight gradients G K d s (L d s
  for the full sampler) and one logits buffer n K s (n rows of the largest group); the active
  rows and the logits buffer count here only where the workspace does not keep them;
* optimizer step: the weight gradient (G K (d e + 8) sparse rows; dense updates L d e) and
  3 blocks of min(32768, rows) x d x 4 (4 for adamw);
* ann search (before the loss): (N, c) centroid scores and their sort 29 N c, query codes
  N b / 8, candidates 8 N R and the re-rank buffer 4 * 32 R d' (R rows re-ranked per query);
* index rebuild: 8 L (list of each row) + 2 L b / 8 (codes, then in list order) + 4 * 64 c d'
  (the k-means sample) (+ the tracking arrays for dense updates);
* catch-up of every row (lazy_exact, before a rebuild, an evaluation or a save, and every 1,024
  steps): 8 L (the row ids) + 4 blocks of B = min(L, 2^28 / (4 d e)) rows x d x e (6 for adamw: the
  gathered rows, states and the combination's temporaries) + 56 per row of a block (its skipped
  count, the 2x2 coefficients in float64 and in the weight's dtype);
* evaluation (head.topk): 4 N d (gathered) + 4 n L (scores of one chunk over the shard) +
  12 N k (candidates) + 4 L d for margin losses (a normalised copy of the shard).

``MemoryEstimate.peak_bytes`` = persistent + the largest phase. The formulas follow the
allocations of ds_xc/head (head.py, optim.py, lazy_exact.py, softmax.py), ds_xc/sampling
(ann/index.py, ann/sampler.py, knn.py) and ds_xc/compression (optimizer.py);
tests/test_cost_memory.py checks the persistent ones against the tensors' nbytes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from ds_xc import config as cfg
from ds_xc.head.partition import shard_range
from ds_xc.head.workspace import KEEP_BYTES
from ds_xc.head.lazy_exact import BLOCK_BYTES as _CATCH_UP_BYTES, WINDOW
from ds_xc.sampling.active import active_size, core_size
from ds_xc.sampling.ann.sampler import retrieval_budgets
from ds_xc.sampling.base import budget

__all__ = ["MemoryEstimate", "estimate_memory", "process_memory"]

_ELEMENT = {"float32": 4, "float64": 8, "bfloat16": 2}
_OPT_BLOCK = 1 << 15  # rows per block of the head optimizers' steps and catch-ups (ds_xc/head/optim.py)
_KMEANS_POINTS = 64  # k-means sample per centroid (ds_xc/sampling/ann/ivf.py)
_RERANK_CHUNK = 32  # queries per re-rank buffer (ann/index.exact_cosine_rerank)
_STATE_PER_PARAM = {"adam": 8, "adamw": 8, "lamb": 8, "sgd": 4, "lars": 4, "adagrad": 4}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank: ``persistent`` components (held between steps) and ``step`` components (the
    transient allocations of the phase with the largest total, named by ``phase``; ``phases`` holds
    every phase's transient total)."""
    persistent: dict
    step: dict
    phase: str = "train"
    phases: dict = field(default_factory=dict)

    @property
    def persistent_bytes(self) -> int:
        return int(sum(self.persistent.values()))

    @property
    def peak_bytes(self) -> int:
        """Persistent bytes plus the transient bytes of the largest phase."""
        return self.persistent_bytes + int(sum(self.step.values()))


def _check_int(name: str, value, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"estimate_memory: {name}={value!r} must be an integer >= {least}")
    return value


@dataclass(frozen=True)
class _Shape:
    """The sizes the formulas use (module docstring's legend)."""
    L: int
    d: int
    e: int
    s: int
    N: int
    G: int
    K: int
    n: int


def _shape(head: cfg.HeadConfig, world_size: int, rank: int, global_batch: int) -> _Shape:
    _, L = shard_range(head.num_classes, world_size, rank)
    e = _ELEMENT[head.dtype]
    sampler = head.sampler
    K = L if sampler.type == "full" else budget(sampler.sample_rate, L)
    groups = getattr(sampler, "groups", 1) if K < L else 1
    G = max(1, min(groups, global_batch)) if global_batch else 1
    rows = -(-global_batch // G) if global_batch else 0  # the largest group
    if K < L:
        K = active_size(K, rows, L)  # room for every positive of a group (sampling/active.py)
    n = min(head.chunk_size, rows) if head.chunk_size else rows
    return _Shape(L=L, d=head.embedding_dim, e=e, s=8 if head.dtype == "float64" else 4, N=global_batch, G=G,
                  K=K, n=n)


def _head_optimizer(head: cfg.HeadConfig, sh: _Shape) -> int:
    """Bytes of the head optimizer's state (module docstring, head_optimizer)."""
    o, rows = head.optimizer, sh.L * sh.d
    bf16 = head.dtype == "bfloat16"
    if o.type == "sgd":
        if o.momentum == 0.0:
            return 0
        if not bf16:
            return rows * sh.e
        return rows * 8 if o.bf16_update == "master_fp32" else rows * 2
    if not bf16:
        return 2 * rows * sh.e + 4
    per = {"stochastic_rounding": 6, "master_fp32": 12, "plain": 4}[o.bf16_update]
    return rows * per + 4


def _ann_dims(head: cfg.HeadConfig, sh: _Shape) -> tuple:
    """(d', c): the indexed vectors' dim and the number of lists."""
    dim = sh.d + (1 if head.loss.type == "softmax" else 0)
    s = head.sampler
    c = min(sh.L, s.nlist or max(1, round(math.sqrt(sh.L))))
    return dim, c


def _sampler_persistent(head: cfg.HeadConfig, sh: _Shape, update: str) -> dict:
    s, out = head.sampler, {}
    if s.type == "ann" and sh.K < sh.L:
        dim, c = _ann_dims(head, sh)
        index = 4 * dim * s.code_bits + 4 * c * dim + 8 * (c + 1) + 16 * sh.L + sh.L * s.code_bits // 8
        if update == "dense" and s.encode_interval:
            index += 4 * sh.L * dim + 4 * sh.L  # refresh tracking (AnnIndex.encoded_from, radius)
        out["ann_index"] = index
        top_k = retrieval_budgets(s, sh.L, head.num_classes)[2]
        rows = -(-sh.N // sh.G) if sh.N else 0
        dirty = core_size(sh.K, rows, sh.L, s.retrieved_share) if s.encode_rows == "retrieved" else sh.K
        out["sampler_buffers"] = 8 * sh.N * top_k + (8 * dirty * sh.G if s.encode_interval else 0)
    elif s.type == "knn" and sh.K < sh.L:
        out["knn_graph"] = 8 * sh.L * min(s.neighbors, sh.L - 1)
    return out


def _backbone(raw: dict, params: int, world_size: int) -> dict:
    """The backbone as DeepSpeed holds it (module docstring, backbone)."""
    if not params:
        return {}
    bf16 = bool((raw.get("bf16") or {}).get("enabled", False))
    stage = int((raw.get("zero_optimization") or {}).get("stage", 0))
    opt = raw.get("optimizer") or {}
    kind = str(opt.get("type", "adamw")).lower()
    per = _STATE_PER_PARAM.get(kind, 8)
    if kind in ("sgd", "lars") and not (opt.get("params") or {}).get("momentum", 0.0 if kind == "sgd" else 0.9):
        per = 0
    shard = world_size if stage >= 1 else 1
    out = {"backbone_params": params * (2 if bf16 else 4), "backbone_grads": params * (2 if bf16 else 4)}
    if stage == 2 and not bf16:
        out["backbone_grads"] = params * 4 // world_size
    if bf16 or stage >= 1:
        out["backbone_master"] = params * 4 // shard + (params * 4 // shard if bf16 else 0)
    out["backbone_optimizer"] = params * per // shard
    return out


def _compression(raw: dict, params: int) -> dict:
    section = raw.get(cfg.COMPRESSION_SECTION)
    if section is None or not params:
        return {}
    c = cfg.parse_compression(section)
    if not c.enabled:
        return {}
    m = c.momentum_correction
    velocity = c.error_feedback and c.method != "powersgd" and (m is None or m > 0)
    snapshot = ((raw.get("zero_optimization") or {}).get("stage", 0) == 1 and c.select_by != "magnitude"
                and c.method in ("topk", "bayes_prior"))
    return {"compression": 4 * params * (int(c.error_feedback) + int(velocity) + int(snapshot))}


def _dense_rows(head: cfg.HeadConfig, sh: _Shape) -> bool:
    """Whether the head uses its whole shard as the active rows (the full sampler): no gathered copy."""
    return sh.K >= sh.L and head.sampler.type == "full"


def _workspace(head: cfg.HeadConfig, sh: _Shape) -> dict:
    """The head's kept scratch (module docstring, head_workspace): {buffer: bytes}, kept ones only."""
    sizes = {"logits": sh.n * sh.K * sh.s, "active_rows": 0 if _dense_rows(head, sh) else sh.K * sh.d * sh.e,
             "folded": sh.K * sh.d * sh.s if head.loss.type != "softmax" and sh.e == sh.s else 0}
    return {k: v for k, v in sizes.items() if 0 < v <= KEEP_BYTES}


def _train_phases(head: cfg.HeadConfig, sh: _Shape, update: str) -> dict:
    """{phase: {component: bytes}} of a training step (module docstring)."""
    dense_rows = _dense_rows(head, sh)
    kept = _workspace(head, sh)
    forward = {"gathered_embeddings": 4 * sh.N * sh.d + 8 * sh.N, "embedding_grad": sh.s * sh.N * sh.d,
               "active_weights": 0 if dense_rows or "active_rows" in kept else sh.G * sh.K * sh.d * sh.e,
               "weight_grad": (sh.L if dense_rows else sh.G * sh.K) * sh.d * sh.s,
               "logits": 0 if "logits" in kept else sh.n * sh.K * sh.s}
    per_block = 4 if head.optimizer.type == "adamw" else 3
    if update == "dense":
        grad, rows = sh.L * sh.d * sh.e, sh.L
    else:
        grad, rows = sh.G * sh.K * (sh.d * sh.e + 8), sh.G * sh.K
    step = {"weight_grad": grad, "optimizer_blocks": per_block * min(_OPT_BLOCK, rows) * sh.d * 4}
    phases = {"train_forward": forward, "optimizer_step": step}
    s = head.sampler
    if s.type == "ann" and sh.K < sh.L:
        dim, c = _ann_dims(head, sh)
        rerank = retrieval_budgets(s, sh.L, head.num_classes)[1]
        phases["ann_search"] = {"probe_scores": 29 * sh.N * c, "query_codes": sh.N * s.code_bits // 8,
                                "rerank": 8 * sh.N * rerank + 4 * min(_RERANK_CHUNK, sh.N) * rerank * dim}
    return phases


def _upkeep_phases(head: cfg.HeadConfig, sh: _Shape, update: str, eval_k: int) -> dict:
    """Index rebuild, full catch-up and evaluation phases (module docstring)."""
    phases = {}
    s = head.sampler
    if s.type == "ann" and sh.K < sh.L:
        dim, c = _ann_dims(head, sh)
        build = {"build_lists": 8 * sh.L, "build_codes": 2 * sh.L * s.code_bits // 8,
                 "kmeans_sample": 4 * min(sh.L, _KMEANS_POINTS * c) * dim}
        if update == "dense" and s.encode_interval:
            build["build_tracking"] = 4 * sh.L * dim + 4 * sh.L
        phases["index_rebuild"] = build
    if update == "lazy_exact":  # SGD: w, buf, buf * q and the new w; AdamW: w, m, v, sqrt(v), m / sqrt(v), ratio
        block = min(sh.L, max(1, _CATCH_UP_BYTES // (4 * sh.d * sh.e)))
        per = 6 if head.optimizer.type == "adamw" else 4
        phases["catch_up"] = {"row_ids": 8 * sh.L, "catch_up_blocks": per * block * sh.d * sh.e + 56 * block}
    k = min(eval_k, head.num_classes)
    phases["evaluation"] = {"gathered_embeddings": 4 * sh.N * sh.d, "scores": 4 * sh.n * sh.L,
                            "candidates": 12 * sh.N * k,
                            "normalised_shard": 4 * sh.L * sh.d if head.loss.type != "softmax" else 0}
    return phases


def estimate_memory(ds_config: dict, *, world_size: int, rank: int = 0, num_classes: Optional[int] = None,
                    global_batch: Optional[int] = None, backbone_params: int = 0, baseline_bytes: int = 0,
                    steps: int = 1, eval_k: int = 5) -> MemoryEstimate:
    """The memory of rank ``rank`` of ``world_size`` for the DeepSpeed config ``ds_config`` (a dict
    with an ``extreme_classification`` section; parsed by ds_xc.config.parse_config).

    ``num_classes`` overrides the section's; ``global_batch`` is N, the rows gathered per micro-step
    (default: train_micro_batch_size_per_gpu x world_size); ``backbone_params`` the backbone's
    parameter count; ``baseline_bytes`` the process's own memory (RSS after importing torch and
    deepspeed: :func:`process_memory`); ``steps`` sizes the lazy_exact history; ``eval_k`` the
    evaluation's top-k. Bad arguments raise ValueError naming the argument; a bad config raises
    ds_xc.config.ConfigError (a ValueError) naming the key.
    """
    if not isinstance(ds_config, dict):
        raise ValueError(f"estimate_memory: ds_config must be a dict, got {type(ds_config).__name__}")
    world_size = _check_int("world_size", world_size, 1)
    rank = _check_int("rank", rank, 0)
    if rank >= world_size:
        raise ValueError(f"estimate_memory: rank={rank} must be in [0, world_size={world_size})")
    for name, value in (("backbone_params", backbone_params), ("baseline_bytes", baseline_bytes),
                        ("steps", steps), ("eval_k", eval_k)):
        _check_int(name, value, 0 if name in ("backbone_params", "baseline_bytes") else 1)
    raw = dict(ds_config)
    if num_classes is not None:
        _check_int("num_classes", num_classes, 2)
        raw[cfg.HEAD_SECTION] = dict(raw.get(cfg.HEAD_SECTION) or {}, num_classes=num_classes)
    if cfg.HEAD_SECTION not in raw:
        raise ValueError(f"estimate_memory: ds_config has no '{cfg.HEAD_SECTION}' section")
    head = cfg.parse_config(raw).extreme_classification
    if head.num_classes < world_size:
        raise ValueError(f"estimate_memory: num_classes={head.num_classes} must be >= world_size={world_size}")
    if global_batch is None:  # DeepSpeed's micro batch, or train_batch_size / (accumulation x ranks)
        micro = raw.get("train_micro_batch_size_per_gpu")
        if micro is None:
            gas = _check_int("gradient_accumulation_steps", raw.get("gradient_accumulation_steps", 1), 1)
            micro = max(1, _check_int("train_batch_size", raw.get("train_batch_size", world_size), 1)
                        // (gas * world_size))
        global_batch = _check_int("train_micro_batch_size_per_gpu", micro, 1) * world_size
    global_batch = _check_int("global_batch", global_batch, 0)
    update, _ = cfg.resolve_update(head.optimizer.update, head.sampler.type, head.dtype)
    sh = _shape(head, world_size, rank, global_batch)
    persistent = {"baseline": int(baseline_bytes), "head_weight": sh.L * sh.d * sh.e,
                  "head_optimizer": _head_optimizer(head, sh)}
    if update == "lazy_exact":
        persistent["lazy_exact"] = 8 * sh.L + 2 * 32 * (WINDOW + 1)
    persistent.update(_sampler_persistent(head, sh, update))
    persistent["head_workspace"] = sum(_workspace(head, sh).values())
    persistent.update(_backbone(raw, backbone_params, world_size))
    persistent.update(_compression(raw, backbone_params))
    phases = _train_phases(head, sh, update)
    phases.update(_upkeep_phases(head, sh, update, eval_k))
    totals = {name: int(sum(parts.values())) for name, parts in phases.items()}
    worst = max(totals, key=totals.get)
    return MemoryEstimate(persistent={k: int(v) for k, v in persistent.items()},
                          step={k: int(v) for k, v in phases[worst].items()}, phase=worst, phases=totals)


def process_memory(pid: str = "self") -> dict:
    """{"rss": resident bytes now, "peak": the high-water mark (VmHWM)} of a process (Linux /proc)."""
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out["rss" if key == "VmRSS" else "peak"] = int(value.split()[0]) * 1024
    return out

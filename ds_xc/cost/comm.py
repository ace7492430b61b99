"""Communication of one training step: which collectives run, how many bytes each moves, how long.

Legend: P ranks of the head's group (the world in a 1-D job), B_r rows of rank r, B = max_r B_r
(gloo pads every gather to the longest block), N = sum_r B_r, d embedding dim, n rows of one
softmax chunk, G ANN sample groups, e bytes of an embedding element.

:func:`step_collectives` lists the collectives of one step of the class-parallel head
(ds_xc/head/head.py with data-parallel input, 1-D layout), read off the code paths:

==================  ==============  =======================  =====================================
name                kind            nbytes (whole buffer)    code
==================  ==============  =======================  =====================================
input_check         all_reduce      72 P  ((P, 9) int64)     ClassParallelHead.check_batch
gather_embeddings   all_gather      P B d e  (output)        collectives.all_gather_rows (forward)
gather_labels       all_gather      8 P B                    collectives.all_gather_no_grad
softmax_stats       all_gather      12 P n, per chunk        softmax._chunk_step, red.gather (n, 3)
scatter_grad        reduce_scatter  P B d e  (input)         collectives.all_gather_rows (backward)
metrics_*           (several)       per 64-row chunk         sampling.metrics, every metrics_interval
backbone_grads      all_reduce      4 x backbone params      the engine's dense data-parallel mean
==================  ==============  =======================  =====================================

The softmax statistics run in float32 (float64 for a float64 head): one all-gather of
[row max, sum-exp, target term] per chunk,
chunks of ``chunk_size`` rows taken within each of the G sample groups. The input check's
all-reduce runs when the sizes are not passed in (``sizes_known=False``) or a full check is due
(``check_inputs``, every ``check_interval``-th call; ``count`` is then 1 / check_interval). The
samplers themselves communicate nothing (the ANN index is per shard).

:func:`predict_time` is an alpha-beta model: a collective is a sequence of ring steps, each
costing the link's latency plus the step's bytes over its bandwidth,

    all_gather      (P - 1) (alpha + S / (P beta))
    all_reduce    2 (P - 1) (alpha + S / (P beta))
    reduce_scatter  (P - 1) (alpha + S / (P beta))   nccl; gloo runs it as an all_reduce of S

with S = nbytes and beta the bandwidth in bytes/s (gloo's reduce_scatter_tensor all-reduces the
whole input and keeps its block: measured, every host sends 2 (P-1)/P S, see
benchmarks/results/netns_comm.md). Ranks sit on nodes of ``ranks_per_node`` consecutive ranks; a
ring over several nodes crosses every node's NIC once per step, so a step costs the inter-node
link's alpha and beta (the steps are lock-step: the slowest edge sets the pace), and a group
inside one node uses the ``intra`` link.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from ds_xc import config as cfg

__all__ = ["Collective", "Link", "step_collectives", "predict_time", "collective_time", "ring_steps",
           "wire_bytes", "LOOPBACK", "KINDS"]

KINDS = ("all_gather", "all_reduce", "reduce_scatter")
BACKENDS = ("gloo", "nccl")
_ELEMENT_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}
_METRICS_CHUNK, _METRICS_K = 64, 10  # sampling.metrics.active_set_quality: rows per chunk, recall@k


@dataclass(frozen=True)
class Collective:
    """One collective of a step: ``count`` times per step (fractional: amortised over steps).

    ``nbytes``: the whole buffer, the same on every rank (all_gather: its output; reduce_scatter:
    its input; all_reduce: the tensor). ``group``: which process group it runs on."""
    name: str
    kind: str
    group_size: int
    nbytes: int
    count: float = 1.0
    group: str = "head"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Collective.kind: got {self.kind!r}; allowed: {', '.join(map(repr, KINDS))}")
        if self.group_size < 1 or self.nbytes < 0 or self.count < 0:
            raise ValueError(f"Collective {self.name!r}: group_size {self.group_size} must be >= 1, nbytes "
                             f"{self.nbytes} and count {self.count} >= 0")


@dataclass(frozen=True)
class Link:
    """A network link: bandwidth in bits per second and latency per message (ring step) in seconds."""
    bandwidth_bps: float
    latency_s: float

    def __post_init__(self):
        if not self.bandwidth_bps > 0:
            raise ValueError(f"Link.bandwidth_bps: got {self.bandwidth_bps}; must be > 0")
        if not self.latency_s >= 0:
            raise ValueError(f"Link.latency_s: got {self.latency_s}; must be >= 0")

    @classmethod
    def gbit(cls, gbit_per_s: float, latency_s: float) -> "Link":
        return cls(gbit_per_s * 1e9, latency_s)


LOOPBACK = Link(40e9, 20e-6)  # ranks of one node: shared memory / loopback (a default; calibrate it)


def _micro_sizes(world_size: int, global_batch: Optional[int], batch_sizes: Optional[Sequence[int]],
                 ds_config: dict) -> list:
    """Every rank's row count: ``batch_sizes``, else the global batch split as evenly as the
    data loader splits it, else the config's train_micro_batch_size_per_gpu on every rank."""
    if batch_sizes is not None:
        sizes = [int(b) for b in batch_sizes]
        if len(sizes) != world_size or min(sizes) < 0:
            raise ValueError(f"batch_sizes: got {list(batch_sizes)}; need {world_size} counts >= 0 (world_size)")
        return sizes
    if global_batch is None:
        micro = ds_config.get("train_micro_batch_size_per_gpu")
        if not isinstance(micro, int) or micro < 1:
            raise ValueError(f"train_micro_batch_size_per_gpu: got {micro!r}; pass global_batch or batch_sizes, "
                             "or set it to an int >= 1")
        return [micro] * world_size
    if int(global_batch) < 0:
        raise ValueError(f"global_batch: got {global_batch}; must be >= 0")
    q, r = divmod(int(global_batch), world_size)
    return [q + (i < r) for i in range(world_size)]


def _softmax_chunks(head, sizes: list, world_size: int) -> list:
    """Rows of every softmax chunk of the step: chunks of chunk_size rows within each sample group."""
    from ds_xc.sampling.ann.sampler import group_bounds
    from ds_xc.sampling.base import budget
    n_rows = sum(sizes)
    bounds = [0, n_rows]
    s = head.sampler
    num_local = -(-head.num_classes // world_size)  # rank 0's shard, the largest
    if s.type == "ann" and budget(s.sample_rate, num_local) < num_local:
        bounds = group_bounds(n_rows, s.groups)
    chunks = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        step = head.chunk_size if head.chunk_size > 0 else max(b - a, 1)
        chunks += [min(step, b - c) for c in range(a, b, step)]
    return chunks


def _metrics_collectives(n_rows: int, p: int, num_classes: int, count: float) -> list:
    """sampling.metrics.active_set_quality: the k agreement, per 64-row chunk a top-k merge (two
    gathers) and the softmax-mass all-reduces, and the final hit counts."""
    k = min(_METRICS_K, num_classes)
    out = [Collective("metrics_k", "all_reduce", p, 8, count)]
    for a in range(0, n_rows, _METRICS_CHUNK):
        n = min(_METRICS_CHUNK, n_rows - a)
        out += [Collective("metrics_topk_vals", "all_gather", p, p * n * k * 4, count),
                Collective("metrics_topk_ids", "all_gather", p, p * n * k * 8, count),
                Collective("metrics_max", "all_reduce", p, 4 * n, count),
                Collective("metrics_sums", "all_reduce", p, 16 * n, count)]
    out.append(Collective("metrics_hits", "all_reduce", p, 16, count))
    return out


def step_collectives(ds_config: dict, *, world_size: int, global_batch: Optional[int] = None,
                     batch_sizes: Optional[Sequence[int]] = None, sizes_known: bool = False,
                     embedding_dtype: str = "float32", backbone_params: int = 0,
                     backbone_grad_dtype: str = "float32", include_metrics: bool = True) -> list:
    """The collectives of one training step (see the module docstring), as :class:`Collective` s.

    ``ds_config``: a DeepSpeed config dict with an ``extreme_classification`` section (or the
    section itself). ``world_size``: P, the head's group (1-D layout: also the data-parallel
    world). The rows: ``batch_sizes`` (every rank's), else ``global_batch`` split evenly, else
    train_micro_batch_size_per_gpu. ``sizes_known``: the caller passes batch_sizes to the head
    (no size exchange outside the checked steps). ``backbone_params``: parameters of the dense
    backbone whose gradients are all-reduced over the world each step (0: the head alone).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: got {world_size!r}; must be an int >= 1")
    for field, value in (("embedding_dtype", embedding_dtype), ("backbone_grad_dtype", backbone_grad_dtype)):
        if value not in _ELEMENT_BYTES:
            raise ValueError(f"{field}: got {value!r}; allowed: {', '.join(map(repr, _ELEMENT_BYTES))}")
    section = ds_config.get(cfg.HEAD_SECTION, ds_config)
    head = cfg.validate_section(cfg.HeadConfig, section, cfg.HEAD_SECTION)
    if head.input_parallel != "data":
        raise ValueError(f"{cfg.HEAD_SECTION}.input_parallel: got {head.input_parallel!r}; the cost model covers "
                         "'data' only")
    p = world_size
    sizes = _micro_sizes(p, global_batch, batch_sizes, ds_config)
    rows, n_rows, e = max(sizes), sum(sizes), _ELEMENT_BYTES[embedding_dtype]
    out = []
    if p > 1:
        check = 1.0 if not sizes_known else (1.0 / head.check_interval if head.check_inputs else 0.0)
        if check:
            out.append(Collective("input_check", "all_reduce", p, 72 * p, check))  # (P, 9) int64: checks.TABLE_COLS
        out += [Collective("gather_embeddings", "all_gather", p, p * rows * head.embedding_dim * e),
                Collective("gather_labels", "all_gather", p, p * rows * 8)]
        stat = 8 if head.dtype == "float64" else 4
        for n in _softmax_chunks(head, sizes, p):
            out.append(Collective("softmax_stats", "all_gather", p, 3 * stat * n * p))
        out.append(Collective("scatter_grad", "reduce_scatter", p, p * rows * head.embedding_dim * e))
        every = getattr(head.sampler, "metrics_interval", 0)
        if include_metrics and every:
            out += _metrics_collectives(n_rows, p, head.num_classes, 1.0 / every)
    if backbone_params and p > 1:
        out.append(Collective("backbone_grads", "all_reduce", p, int(backbone_params) * _ELEMENT_BYTES[
            backbone_grad_dtype], group="data"))
    return out


def ring_steps(kind: str, group_size: int, backend: str = "gloo") -> tuple:
    """(ring steps, fraction of nbytes each step moves) of one collective's ring algorithm."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: got {backend!r}; allowed: {', '.join(map(repr, BACKENDS))}")
    p = group_size
    if p <= 1:
        return 0, 0.0
    if kind == "all_gather" or (kind == "reduce_scatter" and backend == "nccl"):
        return p - 1, 1.0 / p
    if kind in ("all_reduce", "reduce_scatter"):  # gloo: reduce_scatter_tensor = all_reduce + keep a block
        return 2 * (p - 1), 1.0 / p
    raise ValueError(f"kind: got {kind!r}; allowed: {', '.join(map(repr, KINDS))}")


def collective_time(c: Collective, link: Link, ranks_per_node: int = 1, intra: Link = LOOPBACK,
                    backend: str = "gloo") -> float:
    """Seconds of one call of ``c`` (not times ``count``): steps x (alpha + step bytes / beta)."""
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node: got {ranks_per_node}; must be >= 1")
    steps, share = ring_steps(c.kind, c.group_size, backend)
    lk = link if math.ceil(c.group_size / ranks_per_node) > 1 else intra
    return steps * (lk.latency_s + share * c.nbytes * 8.0 / lk.bandwidth_bps)


def predict_time(collectives: Sequence[Collective], link: Link, ranks_per_node: int = 1,
                 intra: Link = LOOPBACK, backend: str = "gloo") -> float:
    """Seconds of communication per step: the sum of count x :func:`collective_time` (the head's
    collectives run one after the other, each waiting for the previous; nothing overlaps)."""
    return sum(c.count * collective_time(c, link, ranks_per_node, intra, backend) for c in collectives)


def wire_bytes(c: Collective, ranks_per_node: int = 1, backend: str = "gloo") -> float:
    """Bytes each node's NIC sends for one call of ``c`` (0 inside one node): one ring edge per node."""
    if math.ceil(c.group_size / ranks_per_node) <= 1:
        return 0.0
    steps, share = ring_steps(c.kind, c.group_size, backend)
    return steps * share * c.nbytes

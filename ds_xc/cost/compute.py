"""The time model of the head's step: work counts (FLOPs, rows, bytes) times calibrated constants.

Legend (per rank of the head's group): N rows of the global batch, d embedding dim, C classes,
P ranks, L = ceil(C / P) classes of the largest shard, K = ceil(sample_rate * L) active classes
per sample group, G groups, A the classes each row is scored against (L for the full sampler,
K for sampled ones), U = min(L, K G) rows with a gradient, b code bits, d' the coded dim (d + 1
for plain softmax: the MIPS-to-cosine reduction, else d), c = nlist (0 = round(sqrt(L))),
S the rows scanned per query on this shard, R the re-rank candidates, k = top_k.

Work per step (``head_work``), every formula in docs/tuning.md:

* loss matmuls: forward logits 2 N A d, backward (dx and dw) 4 N A d -> 6 N A d FLOPs at the
  fused loss's own rate; the softmax/margin element-wise work on N A logits (``loss_elems``);
* gathers: the G active blocks (U d floats, sorted rows) in the forward and their row-sparse
  gradient;
* ANN retrieval: query encoding 2 N d' b, probe 2 N c d' FLOPs, the Hamming scan of N S
  row-queries (scaled by b / 512), the exact re-rank: a gather of N R rows in random order and
  2 N R d FLOPs;
* optimizer: dense L d elements, lazy U d; lazy_exact also catches up U d plus the re-ranked
  candidates D(L, N R) d, D(L, n) = L (1 - exp(-n / L)) the distinct rows among n uniform draws;
  re-encoding the changed rows per ``encode_interval`` steps at 2 d' b FLOPs each: every active
  row with ``encode_rows: active``, else (``retrieved``) each group's positives D(L, N/G) and the
  retrieved rows it kept, min(D(L, N k / G), ceil(retrieved_share (K - D(L, N/G)))), at most U
  in all; the k-means rebuild amortised over ``rebuild_interval``: iterations x 2 min(L, 64 c)
  c d' (training) + 2 L c d' (assignment) + 2 L d' b (codes);
* communication (P > 1): the collectives of ds_xc/cost/comm.py's ``step_collectives`` (input
  check, embedding and label gathers, one all-gather of row statistics per logits chunk, the gradient's
  reduce-scatter), each a ring of steps costing alpha + step bytes x s/byte.

Time = sum of work x seconds-per-unit (``Constants``), plus a fixed per-step overhead of the
sampler type (Python, dispatch) measured on a tiny real head. ds_xc/cost/calibrate.py measures the
constants on this machine.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

from ds_xc.config import parse_config, resolve_update
from ds_xc.cost.comm import Link, predict_time, step_collectives
from ds_xc.sampling.ann.sampler import retrieval_budgets


__all__ = ["distinct_rows", "Shape", "Constants", "StepTime", "shape_of", "head_work", "predict_step_time",
           "global_batch_of", "CONSTANTS_VERSION"]

CONSTANTS_VERSION = 6


# --------------------------------------------------------------------------- the shape of one step
@dataclass
class Shape:
    """What the time model needs of a config, resolved for one rank (see the module legend)."""
    N: int
    d: int
    C: int
    P: int
    L: int
    sampler: str
    A: int  # classes per row in the loss (L full; K sampled)
    K: int
    G: int
    update: str
    optimizer: str  # sgd | adamw
    bits: int = 0
    d_code: int = 0
    nlist: int = 0
    S: int = 0  # rows scanned per query on this shard
    R: int = 0  # re-rank candidates per query on this shard
    k: int = 0
    encode_interval: int = 1
    rebuild_interval: int = 0
    kmeans_iterations: int = 10
    encode_rows: str = "retrieved"
    retrieved_share: float = 1.0
    collectives: list = field(default_factory=list)  # ds_xc.cost.comm.Collective s of one step (P > 1)

    @property
    def U(self) -> int:
        """Rows of the shard with a gradient this step."""
        return self.L if self.sampler == "full" else min(self.L, self.K * self.G)


def global_batch_of(raw: dict, world_size: int) -> int:
    """train_micro_batch_size_per_gpu x gradient_accumulation_steps x world_size (DeepSpeed's rule),
    or ``train_batch_size`` when only that is given."""
    micro = raw.get("train_micro_batch_size_per_gpu")
    if micro is None:
        if "train_batch_size" not in raw:
            raise ValueError("the DeepSpeed config names neither train_micro_batch_size_per_gpu nor "
                             "train_batch_size; pass global_batch")
        return int(raw["train_batch_size"])
    return int(micro) * int(raw.get("gradient_accumulation_steps", 1)) * world_size


def _ann_budgets(s, L: int, C: int) -> tuple[int, int, int, int]:
    """(S, R, k, nlist) of an ann sampler section on a shard of L of C classes (the sampler's
    retrieval_budgets, and AnnIndex's list count: the nprobe lists' rows at least)."""
    scan, rerank, k = retrieval_budgets(s, L, C)
    nlist = min(L, s.nlist or max(1, round(math.sqrt(L))))
    lists_rows = math.ceil(min(s.nprobe, nlist) * L / nlist)
    return min(L, max(scan, lists_rows)), rerank, k, nlist


def shape_of(raw: dict, *, world_size: int, num_classes: Optional[int] = None,
             global_batch: Optional[int] = None) -> Shape:
    """The Shape of one step of ``raw`` (a DeepSpeed JSON dict) on ``world_size`` ranks."""
    if num_classes is not None:
        raw = dict(raw, extreme_classification=dict(raw["extreme_classification"], num_classes=num_classes))
    h = parse_config(raw).extreme_classification
    if h is None:
        raise ValueError("the config has no extreme_classification section")
    C, P, d = h.num_classes, world_size, h.embedding_dim
    N = global_batch if global_batch is not None else global_batch_of(raw, world_size)
    L = math.ceil(C / P)
    s = h.sampler
    update, _ = resolve_update(h.optimizer.update, s.type, h.dtype)
    K = L if s.type == "full" else min(L, math.ceil(s.sample_rate * L))
    G = getattr(s, "groups", 1) if s.type == "ann" else 1
    shape = Shape(N=N, d=d, C=C, P=P, L=L, sampler=s.type, A=K, K=K, G=G, update=update,
                  optimizer=h.optimizer.type)
    if s.type == "ann" and K < L:
        shape.bits = s.code_bits
        shape.d_code = d + 1 if h.loss.type == "softmax" else d
        shape.S, shape.R, shape.k, shape.nlist = _ann_budgets(s, L, C)
        shape.encode_interval, shape.rebuild_interval = s.encode_interval, s.rebuild_interval
        shape.kmeans_iterations = s.kmeans_iterations
        shape.encode_rows, shape.retrieved_share = s.encode_rows, s.retrieved_share
    if P > 1:
        shape.collectives = step_collectives(raw, world_size=P, global_batch=N)
    return shape


# --------------------------------------------------------------------------- work counts
def distinct_rows(rows: int, draws: float) -> float:
    """Expected distinct rows among ``draws`` uniform draws from ``rows``: rows (1 - exp(-draws/rows));
    the re-ranked candidates of a batch (N R draws) that lazy_exact catches up."""
    return rows * -math.expm1(-draws / rows) if rows else 0.0


def head_work(shape: Shape) -> dict:
    """Work per step and rank, by part (FLOPs, elements, bytes, row-queries; module docstring)."""
    t = shape
    w = {"loss_flops": 6.0 * t.N * t.A * t.d, "loss_elems": float(t.N * t.A),
         "gather_bytes": 0.0 if t.sampler == "full" else 2.0 * t.U * t.d * 4,
         "update_elems": float((t.L if t.update == "dense" else t.U) * t.d),
         "catchup_elems": 0.0, "encode_flops": 0.0, "probe_flops": 0.0, "scan_rowq": 0.0,
         "rerank_bytes": 0.0, "rerank_flops": 0.0, "reencode_flops": 0.0, "rebuild_flops": 0.0,
         "comm_bytes": 0.0, "collectives": 0.0}
    if t.update == "lazy_exact":
        w["catchup_elems"] = float(t.U * t.d)
    if t.bits:
        dc, b = t.d_code, t.bits
        w["encode_flops"] = 2.0 * t.N * dc * b
        w["probe_flops"] = 2.0 * t.N * t.nlist * dc
        w["scan_rowq"] = float(t.N * t.S) * b / 512
        w["rerank_bytes"] = float(t.N * t.R * t.d * 4)
        w["rerank_flops"] = 2.0 * t.N * t.R * t.d
        if t.update == "lazy_exact":
            w["catchup_elems"] += distinct_rows(t.L, t.N * t.R) * t.d
        changed = reencoded_rows(t)
        if t.encode_interval:
            w["reencode_flops"] = 2.0 * changed * dc * b / t.encode_interval
        if t.rebuild_interval:
            train = min(t.L, 64 * t.nlist)
            per_build = (t.kmeans_iterations * 2.0 * train * t.nlist * dc + 2.0 * t.L * t.nlist * dc
                         + 2.0 * t.L * dc * b)
            w["rebuild_flops"] = per_build / t.rebuild_interval
    w["collectives"] = float(sum(c.count for c in t.collectives))
    w["comm_bytes"] = float(sum(c.count * c.nbytes for c in t.collectives))
    return w


def reencoded_rows(t: Shape) -> float:
    """Rows re-encoded per step under lazy updates (module legend): the active rows, or each
    group's positives and the retrieved rows the active set kept (sampling/active.py's assemble)."""
    if t.encode_rows == "active":
        return float(t.U)
    n = t.N / t.G
    positives = distinct_rows(t.L, n)
    kept = min(distinct_rows(t.L, n * t.k), math.ceil(t.retrieved_share * max(t.K - positives, 0)))
    return min(float(t.U), t.G * (positives + kept))


# --------------------------------------------------------------------------- constants
@dataclass
class Constants:
    """Seconds per unit of work on this machine (``calibrate``); per-sampler fixed overheads."""
    matmul_s_per_flop: float = 1.0 / 40e9  # retrieval, re-encoding, k-means
    loss_s_per_flop: float = 1.0 / 40e9  # the fused loss's matmuls (its chunks of logits stay in cache)
    elem_s: float = 4e-9  # per logit: softmax, margin, their backward (in the fused loss)
    gather_s_per_byte: float = 1.0 / 8e9  # sorted rows: the active blocks
    rerank_s_per_byte: float = 1.0 / 2e9  # rows in random order: the re-rank's candidates
    scan_s_per_rowq: float = 3e-9  # Hamming distance of one row and one query at 512 bits
    dense_update_s: dict = field(default_factory=lambda: {"sgd": 2e-9, "adamw": 5e-9})
    sparse_update_s: dict = field(default_factory=lambda: {"sgd": 6e-9, "adamw": 10e-9})
    catchup_s: dict = field(default_factory=lambda: {"sgd": 20e-9, "adamw": 40e-9})  # lazy_exact, per element
    overhead_s: dict = field(default_factory=lambda: {"full": 2e-3, "uniform": 3e-3, "ann": 6e-3, "knn": 3e-3})
    comm_alpha_s: float = 1e-4  # per ring step of a collective (calibrate.measure_link on the group)
    comm_s_per_byte: float = 1.0 / 1e9  # per byte of a ring step
    threads: int = 1
    machine: str = ""
    device: str = "cpu"  # what the kernels were timed on: "cpu" or the GPU's name (calibrate.device_kind)
    version: int = CONSTANTS_VERSION

    @property
    def link(self) -> Link:
        """The comm constants as the link of ds_xc/cost/comm.py (latency and bandwidth of a ring step)."""
        return Link(bandwidth_bps=8.0 / self.comm_s_per_byte, latency_s=self.comm_alpha_s)

    def set_link(self, link: Link) -> None:
        """Take the comm constants from ``link`` (calibrate.measure_link on the head's group)."""
        self.comm_alpha_s, self.comm_s_per_byte = link.latency_s, 8.0 / link.bandwidth_bps

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Constants":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class StepTime:
    """Predicted seconds per step and rank, by part; ``work`` holds the counts behind them."""
    parts: dict
    work: dict
    shape: Shape

    @property
    def total_s(self) -> float:
        return sum(self.parts.values())


def predict_step_time(raw: dict, *, world_size: int, num_classes: Optional[int] = None,
                      global_batch: Optional[int] = None, constants: Optional[Constants] = None) -> StepTime:
    """Seconds of one head step (forward with the sampler, backward, optimizer step) per rank."""
    c = constants or Constants()
    shape = shape_of(raw, world_size=world_size, num_classes=num_classes, global_batch=global_batch)
    w = head_work(shape)
    mm = c.matmul_s_per_flop
    opt = shape.optimizer
    per_update = c.dense_update_s[opt] if shape.update == "dense" else c.sparse_update_s[opt]
    parts = {
        "loss": w["loss_flops"] * c.loss_s_per_flop + w["loss_elems"] * c.elem_s,
        "gather": w["gather_bytes"] * c.gather_s_per_byte,
        "optimizer": w["update_elems"] * per_update + w["catchup_elems"] * c.catchup_s[opt],
        "retrieve": ((w["encode_flops"] + w["probe_flops"] + w["rerank_flops"]) * mm
                     + w["scan_rowq"] * c.scan_s_per_rowq + w["rerank_bytes"] * c.rerank_s_per_byte),
        "upkeep": (w["reencode_flops"] + w["rebuild_flops"]) * mm,
        "comm": predict_time(shape.collectives, c.link),
        "overhead": c.overhead_s.get(shape.sampler, 0.0),
    }
    return StepTime(parts=parts, work=w, shape=shape)

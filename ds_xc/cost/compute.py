"""The time model of the head's step: work counts (FLOPs, rows, bytes) times calibrated constants.

Legend (per rank of the head's group): N rows of the global batch, d embedding dim, C classes,
P ranks, L = ceil(C / P) classes of the largest shard, K = ceil(sample_rate * L) active classes
per sample group, G groups, A the classes each row is scored against (L for the full sampler,
K for sampled ones), U = min(L, K G) rows with a gradient, b code bits, d' the coded dim (d + 1
for plain softmax: the MIPS-to-cosine reduction, else d), c = nlist (0 = round(sqrt(L))),
S the rows scanned per query on this shard, R the re-rank candidates, k = top_k.

Work per step (``head_work``), every formula in docs/tuning.md:

* loss matmuls: forward logits 2 N A d, backward (dx and dw) 4 N A d -> 6 N A d FLOPs; the
  softmax/margin element-wise work on N A logits (``loss_elems``);
* gathers: the G active blocks (U d floats) in the forward and their row-sparse gradient;
* ANN retrieval: query encoding 2 N d' b, probe 2 N c d' FLOPs, the Hamming scan of N S
  row-queries (scaled by b / 512), the exact re-rank: a gather of N R rows and 2 N R d FLOPs;
* optimizer: dense L d elements, lazy U d; lazy_exact also catches up U d plus the re-ranked
  candidates D(L, N R) d, D(L, n) = L (1 - exp(-n / L)) the distinct rows among n uniform draws;
  re-encoding the changed rows (min(U, N k + N)) at 2 d' b FLOPs each
  per ``encode_interval`` steps; the k-means rebuild amortised over ``rebuild_interval``:
  iterations x 2 min(L, 64 c) c d' (training) + 2 L c d' (assignment) + 2 L d' b (codes);
* communication (P > 1): the embeddings all-gathered and their gradient reduce-scattered
  (2 (N - N/P) d 4 bytes in), plus the label gather, the input check and two all-reduces
  per logits chunk of N floats: alpha per collective + bytes / beta.

Time = sum of work x seconds-per-unit (``Constants``), plus a fixed per-step overhead of the
sampler type (Python, dispatch) measured on a tiny real head. ``calibrate`` times a few
repetitions of each kernel on this machine, and real heads of 2^16 classes for the optimizer
constants (10-20 s on 2 cores), keeping each one's fastest run; ``load_or_calibrate`` caches the
constants as JSON per machine and thread count.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from ds_xc.config import parse_config, resolve_update
from ds_xc.sampling.ann.sampler import retrieval_budgets

log = logging.getLogger(__name__)

__all__ = ["distinct_rows", "Shape", "Constants", "StepTime", "shape_of", "head_work", "predict_step_time", "calibrate",
           "load_or_calibrate", "global_batch_of"]

CONSTANTS_VERSION = 5


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
    chunks: int  # logits chunks of the loss
    bits: int = 0
    d_code: int = 0
    nlist: int = 0
    S: int = 0  # rows scanned per query on this shard
    R: int = 0  # re-rank candidates per query on this shard
    k: int = 0
    encode_interval: int = 1
    rebuild_interval: int = 0
    kmeans_iterations: int = 10

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
    chunks = max(1, math.ceil(N / h.chunk_size)) if h.chunk_size else 1
    shape = Shape(N=N, d=d, C=C, P=P, L=L, sampler=s.type, A=K, K=K, G=G, update=update,
                  optimizer=h.optimizer.type, chunks=chunks)
    if s.type == "ann" and K < L:
        shape.bits = s.code_bits
        shape.d_code = d + 1 if h.loss.type == "softmax" else d
        shape.S, shape.R, shape.k, shape.nlist = _ann_budgets(s, L, C)
        shape.encode_interval, shape.rebuild_interval = s.encode_interval, s.rebuild_interval
        shape.kmeans_iterations = s.kmeans_iterations
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
        changed = min(t.U, t.N * t.k + t.N)
        if t.encode_interval:
            w["reencode_flops"] = 2.0 * changed * dc * b / t.encode_interval
        if t.rebuild_interval:
            train = min(t.L, 64 * t.nlist)
            per_build = (t.kmeans_iterations * 2.0 * train * t.nlist * dc + 2.0 * t.L * t.nlist * dc
                         + 2.0 * t.L * dc * b)
            w["rebuild_flops"] = per_build / t.rebuild_interval
    if t.P > 1:
        n_in = t.N - t.N / t.P
        w["comm_bytes"] = 2.0 * n_in * t.d * 4 + n_in * 8 + t.chunks * 2 * t.N * 4 * 2
        w["collectives"] = 4.0 + 2 * t.chunks
    return w


# --------------------------------------------------------------------------- constants
@dataclass
class Constants:
    """Seconds per unit of work on this machine (``calibrate``); per-sampler fixed overheads."""
    matmul_s_per_flop: float = 1.0 / 40e9
    elem_s: float = 4e-9  # per logit: softmax, margin, their backward (in the fused loss)
    gather_s_per_byte: float = 1.0 / 4e9
    scan_s_per_rowq: float = 3e-9  # Hamming distance of one row and one query at 512 bits
    dense_update_s: dict = field(default_factory=lambda: {"sgd": 2e-9, "adamw": 5e-9})
    sparse_update_s: dict = field(default_factory=lambda: {"sgd": 6e-9, "adamw": 10e-9})
    catchup_s: dict = field(default_factory=lambda: {"sgd": 20e-9, "adamw": 40e-9})  # lazy_exact, per element
    overhead_s: dict = field(default_factory=lambda: {"full": 2e-3, "uniform": 3e-3, "ann": 6e-3, "knn": 3e-3})
    comm_alpha_s: float = 1e-4
    comm_s_per_byte: float = 1.0 / 1e9
    threads: int = 1
    machine: str = ""
    version: int = CONSTANTS_VERSION

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
        "loss": w["loss_flops"] * mm + w["loss_elems"] * c.elem_s,
        "gather": w["gather_bytes"] * c.gather_s_per_byte,
        "optimizer": w["update_elems"] * per_update + w["catchup_elems"] * c.catchup_s[opt],
        "retrieve": ((w["encode_flops"] + w["probe_flops"] + w["rerank_flops"]) * mm
                     + w["scan_rowq"] * c.scan_s_per_rowq + w["rerank_bytes"] * c.gather_s_per_byte),
        "upkeep": (w["reencode_flops"] + w["rebuild_flops"]) * mm,
        "comm": w["collectives"] * c.comm_alpha_s + w["comm_bytes"] * c.comm_s_per_byte,
        "overhead": c.overhead_s.get(shape.sampler, 0.0),
    }
    return StepTime(parts=parts, work=w, shape=shape)


# --------------------------------------------------------------------------- calibration
def _best_time(fn, repeats: int = 4) -> float:
    """The fastest of ``repeats`` timed runs after a warm-up: on a shared machine the minimum is the
    estimate least disturbed by other processes (the tuner compares it with the fastest step)."""
    fn()  # warm-up: allocator, thread pool, code pages
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _calibrate_kernels(c: Constants, gen: torch.Generator) -> None:
    """Matmul, element-wise, gather and Hamming-scan rates from a few timed runs each."""
    n, d, m = 512, 128, 16384
    x, w = torch.randn(n, d, generator=gen), torch.randn(m, d, generator=gen)
    c.matmul_s_per_flop = _best_time(lambda: x @ w.t()) / (2.0 * n * m * d)
    # The element-wise share of the loss, from the head's own fused loss (ds_xc/head/softmax.py: the
    # logits computed, turned into their gradient in place and multiplied out, chunk by chunk) at
    # the head's usual chunk of rows: its time minus its 6 n m d matmul FLOPs at the rate above. A
    # stand-alone autograd softmax costs several times more per element than the fused loop does.
    from ds_xc.head.margins import build_loss
    from ds_xc.head.softmax import fused_loss_and_grads
    targets = torch.randint(0, m, (n,), generator=gen)
    margin = build_loss({"type": "cosface"})
    fused = _best_time(lambda: fused_loss_and_grads(x, w, targets, margin, None, 128))
    c.elem_s = max(fused - 6.0 * n * m * d * c.matmul_s_per_flop, 0.1 * fused) / (n * m)
    table = torch.randn(1 << 18, d, generator=gen)
    idx = torch.randint(0, table.shape[0], (1 << 16,), generator=gen)
    c.gather_s_per_byte = _best_time(lambda: table.index_select(0, idx)) / (idx.numel() * d * 4)
    from ds_xc_ops.hamming import hamming_topk_flat
    q = torch.randint(0, 256, (256, 64), dtype=torch.uint8, generator=gen)
    db = torch.randint(0, 256, (1 << 16, 64), dtype=torch.uint8, generator=gen)
    c.scan_s_per_rowq = _best_time(lambda: hamming_topk_flat(q, db, 256)) / (q.shape[0] * db.shape[0])


def _timed_head(section: dict, batch: int, steps: int = 4, group=None) -> tuple[float, float]:
    """(fastest forward, fastest optimizer step) seconds of a real head built from ``section`` on
    ``group`` (a one-rank group when torch.distributed runs several: calibration is local)."""
    from ds_xc.head import ClassParallelHead, build_head_optimizer
    head = ClassParallelHead.from_config(section, group=group)
    opt = build_head_optimizer(head, section["optimizer"])
    gen = torch.Generator().manual_seed(2)
    fwd, upd = [], []
    for i in range(steps + 1):
        x = torch.randn(batch, section["embedding_dim"], generator=gen).requires_grad_(True)
        y = torch.randint(0, section["num_classes"], (batch,), generator=gen)
        t0 = time.perf_counter()
        loss = head(x, y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:  # the first step warms up
            fwd.append(t1 - t0)
            upd.append(time.perf_counter() - t2)
    return min(fwd), min(upd)


def _catchup_per_element(section: dict, batch: int, group=None) -> float:
    """Seconds per element of lazy_exact's catch-up: after 4 steps of a uniform head, disjoint
    blocks of L/8 rows (stale for 1 to 4 steps) are caught up through the optimizer's catch_up,
    the fastest block kept."""
    from ds_xc.head import ClassParallelHead, build_head_optimizer
    head = ClassParallelHead.from_config(section, group=group)
    opt = build_head_optimizer(head, section["optimizer"])
    gen = torch.Generator().manual_seed(3)
    L, d = section["num_classes"], section["embedding_dim"]
    for _ in range(4):
        x = torch.randn(batch, d, generator=gen).requires_grad_(True)
        head(x, torch.randint(0, L, (batch,), generator=gen)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    rows = torch.randperm(L, generator=gen).view(8, -1)
    times = []
    for block in rows[:4]:
        t0 = time.perf_counter()
        opt.catch_up(block)
        times.append(time.perf_counter() - t0)
    return min(times) / (rows.shape[1] * d)


def _calibrate_updates(c: Constants, group=None) -> None:
    """Per-element cost of the head optimizer's step, dense (every row) and row-sparse (the active
    rows), and of lazy_exact's catch-up of stale rows, from real heads of 2^16 classes."""
    L, d, rate, batch = 1 << 16, 128, 0.05, 256
    U = math.ceil(rate * L)
    for kind in ("sgd", "adamw"):
        def section(sampler, update):
            return {"num_classes": L, "embedding_dim": d, "sampler": sampler, "chunk_size": 128,
                    "optimizer": {"type": kind, "lr": 0.01, "update": update}}
        uniform = {"type": "uniform", "sample_rate": rate}
        _, dense = _timed_head(section(uniform, "dense"), batch, group=group)
        _, lazy = _timed_head(section(uniform, "lazy"), batch, group=group)
        c.dense_update_s[kind] = dense / (L * d)
        c.sparse_update_s[kind] = lazy / (U * d)
        c.catchup_s[kind] = _catchup_per_element(section(uniform, "lazy_exact"), batch, group)


def _tiny_head_overhead(c: Constants, sampler: dict, group=None) -> float:
    """Seconds of a real head step at 4,096 classes and 64 rows less the modelled work: the fixed
    per-step cost (Python, dispatch, small tensors) of this sampler type."""
    from ds_xc.head import ClassParallelHead, build_head_optimizer
    section = {"num_classes": 4096, "embedding_dim": 64, "sampler": sampler,
               "optimizer": {"type": "sgd", "lr": 0.1}}
    head = ClassParallelHead.from_config(section, group=group)
    opt = build_head_optimizer(head, section["optimizer"])
    gen = torch.Generator().manual_seed(1)

    def step():
        x = torch.randn(64, 64, generator=gen).requires_grad_(True)
        head(x, torch.randint(0, 4096, (64,), generator=gen)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for _ in range(3):
        step()
    measured = _best_time(step, repeats=5)
    c.overhead_s = dict(c.overhead_s, **{sampler["type"]: 0.0})
    raw = {"train_micro_batch_size_per_gpu": 64, "extreme_classification": section}
    predicted = predict_step_time(raw, world_size=1, constants=c).total_s
    return max(0.0, measured - predicted)


def calibrate(group=None) -> Constants:
    """Time each kernel on this machine (a few repetitions; seconds) at the current thread count.
    The communication constants keep their loopback defaults (on one host the tuner measures the
    multi-rank step directly; ds_xc/cost/comm.py models real links). ``group``: a group holding only
    this rank, for the real heads, when torch.distributed runs several ranks."""
    c = Constants(threads=torch.get_num_threads(), machine=os.uname().nodename)
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    _calibrate_kernels(c, gen)
    _calibrate_updates(c, group)
    for sampler in ({"type": "full"}, {"type": "uniform", "sample_rate": 0.1},
                    {"type": "ann", "sample_rate": 0.1, "rebuild_interval": 0}):
        c.overhead_s[sampler["type"]] = _tiny_head_overhead(c, sampler, group)
    log.info("calibrated the time model in %.1f s: %s", time.perf_counter() - t0, c.to_json())
    return c


def load_or_calibrate(path: Optional[str], recalibrate: bool = False, group=None) -> Constants:
    """The constants cached at ``path`` for this machine and thread count, else calibrate and save."""
    threads, machine = torch.get_num_threads(), os.uname().nodename
    if path and os.path.exists(path) and not recalibrate:
        with open(path) as fh:
            data = json.load(fh)
        if data.get("version") == CONSTANTS_VERSION and data.get("threads") == threads and \
                data.get("machine") == machine:
            return Constants.from_json(data)
    c = calibrate(group)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as fh:
            json.dump(c.to_json(), fh, indent=1)
        os.replace(tmp, path)
    return c

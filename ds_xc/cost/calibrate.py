"""Calibrating the time model (ds_xc/cost/compute.py) on this machine: seconds per unit of work.

``calibrate`` times a few repetitions of each kernel at the current thread count and keeps each
one's fastest run (on a shared machine the least disturbed estimate; the tuner compares the
predictions with the fastest measured step):

* the fused loss (ds_xc/head/softmax.py, chunks of 128 rows) at two embedding widths, 64 and 256:
  its time is a 6 n m d FLOP term plus an n m element-wise term, and the two widths give both
  rates (the loss's matmuls run faster per FLOP than a stand-alone matmul that writes a large
  output, and a stand-alone autograd softmax costs several times more per logit than the fused
  loop);
* a 512 x 128 x 16k matmul (the retrieval, re-encoding and k-means FLOPs);
* a gather of sorted rows (the active blocks) and of rows in random order (the re-rank);
* the C++ Hamming scan of 256 queries over 64k codes;
* real heads of 2^16 classes for the optimizer constants (dense and row-sparse steps, lazy_exact's
  catch-up), and a real 4,096-class head step per sampler type for its fixed overhead.

About 20 s on 2 cores. With ``device`` a GPU, every kernel and head runs there and is timed to the
end of its work (ds_xc/cost/timing.py: the device is synchronised before the clock stops), so the
constants are the GPU's, not its launch latencies. ``load_or_calibrate`` caches the constants as
JSON per machine, thread count and device kind. The communication constants are a property of the
group, not of the machine:
``measure_link`` times a few collectives on the head's group (every rank calls it; under a
second), and the tuner measures them at every start rather than caching them.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Optional

import torch
import torch.distributed as dist

from ds_xc.cost.comm import Link, ring_steps
from ds_xc.cost.compute import CONSTANTS_VERSION, Constants, predict_step_time
from ds_xc.cost.timing import best_time, synchronize, timed
from ds_xc.parallel.collectives import gather_flat
from ds_xc.parallel.groups import comm_device, is_distributed

log = logging.getLogger(__name__)

__all__ = ["calibrate", "load_or_calibrate", "measure_link", "all_gather_seconds", "device_kind"]


def _calibrate_kernels(c: Constants, gen: torch.Generator, device=None) -> None:
    """The fused loss's two rates, the matmul, gather and Hamming-scan rates (module docstring), on
    ``device`` (None: the CPU), each timed to the end of its work (ds_xc/cost/timing.py)."""
    n, d, m = 512, 128, 16384
    x, w = torch.randn(n, d, generator=gen).to(device), torch.randn(m, d, generator=gen).to(device)
    c.matmul_s_per_flop = best_time(lambda: x @ w.t(), device) / (2.0 * n * m * d)
    c.loss_s_per_flop, c.elem_s = _calibrate_loss(gen, device=device)
    table = torch.randn(1 << 18, d, generator=gen).to(device)
    rows = torch.randperm(table.shape[0], generator=gen)[: 1 << 15].to(device)
    srt = rows.sort().values
    c.gather_s_per_byte = best_time(lambda: table.index_select(0, srt), device) / (srt.numel() * d * 4)
    c.rerank_s_per_byte = best_time(lambda: table.index_select(0, rows), device) / (rows.numel() * d * 4)
    from ds_xc_ops.hamming import hamming_topk_flat
    q = torch.randint(0, 256, (256, 64), dtype=torch.uint8, generator=gen).to(device)
    db = torch.randint(0, 256, (1 << 16, 64), dtype=torch.uint8, generator=gen).to(device)
    c.scan_s_per_rowq = best_time(lambda: hamming_topk_flat(q, db, 256), device) / (q.shape[0] * db.shape[0])


def _calibrate_loss(gen: torch.Generator, n: int = 512, m: int = 8192, dims=(64, 256),
                    device=None) -> tuple[float, float]:
    """(seconds per matmul FLOP, seconds per logit) of the head's fused loss: t(d) = a 6 n m d + b n m
    solved from its fastest time at two widths (a cosface margin, chunks of 128 rows)."""
    from ds_xc.head.margins import build_loss
    from ds_xc.head.softmax import fused_loss_and_grads
    targets = torch.randint(0, m, (n,), generator=gen).to(device)
    margin = build_loss({"type": "cosface"})
    times = []
    for d in dims:
        x, w = torch.randn(n, d, generator=gen).to(device), torch.randn(m, d, generator=gen).to(device)
        times.append(best_time(lambda: fused_loss_and_grads(x, w, targets, margin, None, 128), device))
    (d1, d2), (t1, t2) = dims, times
    a = (t2 - t1) / (6.0 * n * m * (d2 - d1))
    if not a > 0:  # noise larger than the width's effect: all of it matmul at the wide width
        a = t2 / (6.0 * n * m * d2)
    b = max(t1 - a * 6.0 * n * m * d1, 0.0) / (n * m)
    return a, b


def _step_times(section: dict, rows: int, group, steps: int, warmup: int, seed: int, device=None) -> list:
    """Seconds of each of ``steps`` training steps (forward, backward, optimizer; the random batch of
    ``rows`` rows drawn outside the timing) of a real head built from ``section`` on ``group`` and
    ``device`` (None: the CPU), after ``warmup`` untimed ones; each timed to the end of its work."""
    from ds_xc.head import ClassParallelHead, build_head_optimizer
    head = ClassParallelHead.from_config(section, group=group, device=device)
    opt = build_head_optimizer(head, section["optimizer"])
    gen = torch.Generator().manual_seed(seed)
    times = []
    for _ in range(warmup + steps):
        x = torch.randn(rows, section["embedding_dim"], generator=gen).to(device).requires_grad_(True)
        y = torch.randint(0, section["num_classes"], (rows,), generator=gen).to(device)

        def step():
            head(x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        times.append(timed(step, device))
    return times[warmup:]


def _timed_head(section: dict, batch: int, steps: int = 4, group=None, device=None) -> tuple[float, float]:
    """(fastest forward, fastest optimizer step) seconds of a real head built from ``section`` on
    ``group`` (a one-rank group when torch.distributed runs several: calibration is local) and ``device``."""
    from ds_xc.head import ClassParallelHead, build_head_optimizer
    head = ClassParallelHead.from_config(section, group=group, device=device)
    opt = build_head_optimizer(head, section["optimizer"])
    gen = torch.Generator().manual_seed(2)
    fwd, upd = [], []
    for i in range(steps + 1):
        x = torch.randn(batch, section["embedding_dim"], generator=gen).to(device).requires_grad_(True)
        y = torch.randint(0, section["num_classes"], (batch,), generator=gen).to(device)
        out = []
        forward = timed(lambda: out.append(head(x, y)), device)
        out[0].backward()

        def update():
            opt.step()
            opt.zero_grad(set_to_none=True)
        step = timed(update, device)
        if i:  # the first step warms up
            fwd.append(forward)
            upd.append(step)
    return min(fwd), min(upd)


def _catchup_per_element(section: dict, batch: int, group=None, device=None) -> float:
    """Seconds per element of lazy_exact's catch-up: after 4 steps of a uniform head, disjoint
    blocks of L/8 rows (stale for 1 to 4 steps) are caught up through the optimizer's catch_up,
    the fastest block kept."""
    from ds_xc.head import ClassParallelHead, build_head_optimizer
    head = ClassParallelHead.from_config(section, group=group, device=device)
    opt = build_head_optimizer(head, section["optimizer"])
    gen = torch.Generator().manual_seed(3)
    L, d = section["num_classes"], section["embedding_dim"]
    for _ in range(4):
        x = torch.randn(batch, d, generator=gen).to(device).requires_grad_(True)
        head(x, torch.randint(0, L, (batch,), generator=gen).to(device)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    rows = torch.randperm(L, generator=gen).view(8, -1).to(device)
    times = [timed(lambda: opt.catch_up(block), device) for block in rows[:4]]
    return min(times) / (rows.shape[1] * d)


def _calibrate_updates(c: Constants, group=None, device=None) -> None:
    """Per-element cost of the head optimizer's step, dense (every row) and row-sparse (the active
    rows), and of lazy_exact's catch-up of stale rows, from real heads of 2^16 classes."""
    L, d, rate, batch = 1 << 16, 128, 0.05, 256
    U = math.ceil(rate * L)
    for kind in ("sgd", "adamw"):
        def section(sampler, update):
            return {"num_classes": L, "embedding_dim": d, "sampler": sampler, "chunk_size": 128,
                    "optimizer": {"type": kind, "lr": 0.01, "update": update}}
        uniform = {"type": "uniform", "sample_rate": rate}
        _, dense = _timed_head(section(uniform, "dense"), batch, group=group, device=device)
        _, lazy = _timed_head(section(uniform, "lazy"), batch, group=group, device=device)
        c.dense_update_s[kind] = dense / (L * d)
        c.sparse_update_s[kind] = lazy / (U * d)
        c.catchup_s[kind] = _catchup_per_element(section(uniform, "lazy_exact"), batch, group, device)


def _tiny_head_overhead(c: Constants, sampler: dict, group=None, device=None) -> float:
    """Seconds of a real head step at 4,096 classes and 64 rows less the modelled work: the fixed
    per-step cost (Python, dispatch, small tensors) of this sampler type."""
    section = {"num_classes": 4096, "embedding_dim": 64, "sampler": sampler,
               "optimizer": {"type": "sgd", "lr": 0.1}}
    measured = min(_step_times(section, 64, group, steps=5, warmup=4, seed=1, device=device))
    c.overhead_s = dict(c.overhead_s, **{sampler["type"]: 0.0})
    raw = {"train_micro_batch_size_per_gpu": 64, "extreme_classification": section}
    predicted = predict_step_time(raw, world_size=1, constants=c).total_s
    return max(0.0, measured - predicted)


def calibrate(group=None, device=None) -> Constants:
    """Time each kernel on this machine (a few repetitions; seconds) at the current thread count, on
    ``device`` (None: the CPU; a GPU: the rank's, where the job's head runs).
    The communication constants keep their defaults (``measure_link`` measures them on a group).
    ``group``: a group holding only this rank, for the real heads, when torch.distributed runs
    several ranks."""
    c = Constants(threads=torch.get_num_threads(), machine=os.uname().nodename, device=device_kind(device))
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    _calibrate_kernels(c, gen, device)
    _calibrate_updates(c, group, device)
    for sampler in ({"type": "full"}, {"type": "uniform", "sample_rate": 0.1},
                    {"type": "ann", "sample_rate": 0.1, "rebuild_interval": 0}):
        c.overhead_s[sampler["type"]] = _tiny_head_overhead(c, sampler, group, device)
    log.info("calibrated the time model in %.1f s: %s", time.perf_counter() - t0, c.to_json())
    return c


def all_gather_seconds(out: torch.Tensor, block: torch.Tensor, group, repeats: int = 5, device=None) -> list:
    """Seconds of each of ``repeats`` all-gathers of ``block`` into ``out`` on ``group`` (after one
    warm-up: connections, buffers), each started together (a barrier) and timed to the end of the
    transfer: NCCL returns as soon as the collective is queued on the device, so the device
    (``device``, default ``out``'s) is synchronised before the clock stops (a host clock alone
    measured the launch latency)."""
    device = out.device if device is None else device
    gather_flat(out, block, group=group)  # warm-up
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        synchronize(device)
        times.append(timed(lambda: gather_flat(out, block, group=group), device))
    return times


def measure_link(group, solo, large_bytes: int = 1 << 24, rows: int = 128, chunk: int = 32,
                 local: int = 1 << 16, device=None) -> Link:
    """The link of ``group``'s collectives as ds_xc/cost/comm.py models them (latency and bandwidth of
    one ring step), measured as a training step sees it. Collective: every rank of ``group`` calls it,
    each with ``solo``, a group holding only itself; the slowest rank's times are used.

    Bandwidth: the median of a few all-gathers of ``large_bytes`` (P - 1 steps of large_bytes / P) on
    the group's communication device, timed to the end of the transfer (:func:`all_gather_seconds`).
    Latency: the fastest step of a real uniform head on ``group`` (``rows`` rows per rank in logits
    chunks of ``chunk`` rows, ``local`` classes per rank: one all-gather per chunk between the
    chunks' matmuls, each chunk a few milliseconds of work as in a real head) less the fastest
    step of the same per-rank work on ``solo`` (no collectives) and less the bytes' time, over the
    step's ring steps (``step_collectives``). The heads run on ``device`` (None: the group's
    communication device, the rank's GPU for NCCL), their steps timed to the end of their work.
    A loop of bare all-reduces is no estimate: on a shared
    virtual machine its median moved 10x between runs (0.2-1.7 ms per step of two loopback ranks),
    while the collectives between compute cost 0.5-0.9 ms per ring step in every run (more with
    more work per chunk: 0.5 ms at 8,192 classes and chunks of 16 rows, 0.8-0.9 ms at the defaults)."""
    from ds_xc.config import HEAD_SECTION
    from ds_xc.cost.comm import predict_time, step_collectives
    if not is_distributed(group):
        raise ValueError("measure_link needs a group of 2 or more ranks (torch.distributed initialised)")
    p = dist.get_world_size(group)
    comm = comm_device(group)
    device = comm if device is None else torch.device(device)
    block = torch.zeros(max(large_bytes // (4 * p), 1), device=comm)
    out = torch.empty(block.numel() * p, device=comm)
    times = all_gather_seconds(out, block, group)

    def section(classes):
        return {"num_classes": classes, "embedding_dim": 64, "chunk_size": chunk,
                "sampler": {"type": "uniform", "sample_rate": 0.25}, "optimizer": {"type": "sgd", "lr": 0.1}}
    solo_s = min(_step_times(section(local), rows * p, solo, steps=8, warmup=2, seed=5, device=device))
    dist.barrier(group=group)
    group_s = min(_step_times(section(local * p), rows, group, steps=8, warmup=2, seed=5, device=device))
    worst = torch.tensor([sorted(times)[2], solo_s, group_s], dtype=torch.float64, device=comm)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    t_large, solo_s, group_s = worst.tolist()
    steps, share = ring_steps("all_gather", p)
    bandwidth = 8.0 * share * out.numel() * 4 * steps / t_large  # the latency is < 1% of it
    colls = step_collectives({"train_micro_batch_size_per_gpu": rows, HEAD_SECTION: section(local * p)},
                             world_size=p)
    ring = sum(c.count * ring_steps(c.kind, p)[0] for c in colls)
    transfer = predict_time(colls, Link(bandwidth, 0.0))
    latency = max(group_s - solo_s - transfer, 0.0) / ring
    log.info("link of the head's %d-rank group: %.0f us per ring step (a %.1f ms step less %.1f ms of its "
             "work alone, over %d ring steps), %.2f Gbit/s", p, latency * 1e6, group_s * 1e3, solo_s * 1e3,
             ring, bandwidth / 1e9)
    return Link(bandwidth_bps=bandwidth, latency_s=latency)


def device_kind(device) -> str:
    """What the constants of ``device`` are cached under: "cpu", or the GPU's name."""
    if device is None or torch.device(device).type != "cuda":
        return "cpu"
    return torch.cuda.get_device_name(torch.device(device))


def load_or_calibrate(path: Optional[str], recalibrate: bool = False, group=None, device=None) -> Constants:
    """The constants cached at ``path`` for this machine, thread count and device kind (the CPU, or the
    GPU's name), else calibrate on ``device`` and save."""
    threads, machine, kind = torch.get_num_threads(), os.uname().nodename, device_kind(device)
    if path and os.path.exists(path) and not recalibrate:
        with open(path) as fh:
            data = json.load(fh)
        if data.get("version") == CONSTANTS_VERSION and data.get("threads") == threads and \
                data.get("machine") == machine and data.get("device", "cpu") == kind:
            return Constants.from_json(data)
    c = calibrate(group, device)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as fh:
            json.dump(c.to_json(), fh, indent=1)
        os.replace(tmp, path)
    return c

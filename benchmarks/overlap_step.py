"""One rank of the overlap benchmark: serial vs overlapped training steps, interleaved.

Started per rank with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and GLOO_SOCKET_IFNAME)
set, by benchmarks/netns.sh (shaped link) or by benchmarks/overlap_netns.py on loopback.
One backbone (an MLP, rows independent) and one ClassParallelHead; each round runs every
mode once, in turn, so that the machine's noise hits all modes alike:

* ``serial``: the plain path: ``loss = head(backbone(x), y)``, ``loss.backward()``, then
  one bucketed all-reduce of the backbone's gradients after the backward (what DeepSpeed
  ZeRO-0 does), all collectives blocking;
* ``serial_timed``: the same serial order through ChunkedHeadSchedule(overlap=False, 1
  chunk) and BucketedGradReducer(overlap=False), which records how long each blocking
  collective took: its exposed communication is all of its communication;
* ``overlap``: ChunkedHeadSchedule(num_chunks) + BucketedGradReducer from hooks.

A step is timed from a barrier to the end of the optimizer steps (SGD on the backbone,
SGD with momentum on the head, which steps first, as in XCEngine.step). Rank 0 writes JSON: per mode, median step time and mean compute / exposed times.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import finish_worker  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--modes", default="serial,serial_timed,overlap,overlap_cb",
                   help="overlap: one backbone graph; overlap_cb: the backbone runs per chunk (chunk_backbone)")
    p.add_argument("--steps", type=int, default=12, help="timed rounds (each runs every mode once)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=256, help="rows per rank")
    p.add_argument("--in_dim", type=int, default=512)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--classes", type=int, default=20000)
    p.add_argument("--loss", default="arcface")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--head_chunk", type=int, default=0, help="head chunk_size (0: global batch / chunks, so that "
                   "serial and overlapped paths run the same matrix products)")
    p.add_argument("--bucket_mb", type=float, default=2.0)
    p.add_argument("--out", default="-")
    args = p.parse_args(argv)
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from ds_xc import ClassParallelHead
    from ds_xc.overlap import BucketedGradReducer, ChunkedHeadSchedule, Timeline

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", timeout=timedelta(seconds=900))
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    layers, width = [], args.in_dim
    for _ in range(args.layers - 1):
        layers += [torch.nn.Linear(width, args.hidden), torch.nn.GELU()]
        width = args.hidden
    backbone = torch.nn.Sequential(*layers, torch.nn.Linear(width, args.dim))
    loss = {"type": args.loss, "scale": 30.0, "margin": 0.3} if args.loss != "softmax" else "softmax"
    head_chunk = args.head_chunk or max(args.batch * world // args.chunks, 1)
    head = ClassParallelHead(args.dim, args.classes, loss=loss, sampler="full", chunk_size=head_chunk, seed=1)
    params = list(backbone.parameters())
    body_opt = torch.optim.SGD(params, lr=1e-3)
    head_opt = torch.optim.SGD([head.weight], lr=1e-3, momentum=0.9)
    timeline = Timeline()
    serial_red = BucketedGradReducer(params, bucket_bytes=int(args.bucket_mb * 2**20), timeline=timeline,
                                     overlap=False)
    overlap_red = BucketedGradReducer(params, bucket_bytes=int(args.bucket_mb * 2**20), timeline=timeline)
    serial_sched = ChunkedHeadSchedule(head, 1, overlap=False, timeline=timeline)
    overlap_sched = ChunkedHeadSchedule(head, args.chunks, overlap=True, timeline=timeline,
                                        comm_group=serial_sched.comm_group)
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(args.batch, args.in_dim, generator=gen)
    y = torch.randint(0, args.classes, (args.batch,), generator=gen)

    def backward_for(reducer):
        def backward(i, emb, grad, last):
            if last:
                reducer.arm()
            emb.backward(grad)
        return backward

    def run(mode: str) -> None:
        """Forward, backward, gradient reduction, optimizer steps (the head's first, as XCEngine.step)."""
        if mode == "serial":
            out = head(backbone(x), y)
            out.backward()
            serial_red.finish()  # armed here: all buckets launched after the backward, then waited
            head_opt.step()
        elif mode == "serial_timed":
            serial_sched.run(backbone(x), y, backward=backward_for(serial_red))
            serial_red.finish()
            head_opt.step()
        else:
            if mode == "overlap_cb":
                overlap_sched.run_backbone(backbone, x, y, backward=backward_for(overlap_red))
            else:
                overlap_sched.run(backbone(x), y, backward=backward_for(overlap_red))
            head_opt.step()  # while the backbone's buckets are still on the wire
            overlap_red.finish()
        body_opt.step()

    modes = args.modes.split(",")
    times = {m: [] for m in modes}
    recs = {m: [] for m in modes}
    for step in range(args.warmup + args.steps):
        for mode in modes:
            dist.barrier()
            t0 = time.perf_counter()
            timeline.begin_step()
            run(mode)
            body_opt.zero_grad(set_to_none=True)
            head_opt.zero_grad(set_to_none=True)
            rec = timeline.end_step()
            dt = time.perf_counter() - t0
            if step >= args.warmup:
                times[mode].append(dt)
                recs[mode].append(rec)
    result = {"args": vars(args), "world": world, "modes": {}}
    for mode in modes:
        mean = {k: statistics.fmean(r.get(k, 0.0) for r in recs[mode])
                for k in ("exposed_s", "issued_mb", "issued", "exposed_gather_s", "exposed_reduce_scatter_s",
                          "exposed_grad_reduce_s", "exposed_labels_s")}
        result["modes"][mode] = {"median_s": statistics.median(times[mode]), "times": times[mode], **mean}
    result["backbone_params"] = sum(p.numel() for p in params)
    return finish_worker(result, args.out, indent=1)


if __name__ == "__main__":
    main()

"""One rank of a reduction-only run: a fake n-element gradient reduced by CompressedOptimizer.

Started per rank with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and GLOO_SOCKET_IFNAME)
set, e.g. by netns.sh. Each step draws a fresh gradient (Gaussian with per-element
scales, different on every rank) and times ``reduce_gradients()`` alone, between two
barriers. ``--method none`` is the dense all-reduce path. Rank 0 writes JSON: the median
reduction time and the bytes the wrapper counted, to compare with the kernel's counters.
"""
from __future__ import annotations

import argparse
import json
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
    p.add_argument("--n", type=int, default=10**7)
    p.add_argument("--method", default="bayes_prior")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--compression", default="{}", help="JSON of extra gradient_compression keys")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--skip_steps", type=int, default=2)
    p.add_argument("--out", default="-")
    args = p.parse_args(argv)
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from ds_xc.compression import CompressedOptimizer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank = dist.get_rank()
    param = torch.nn.Parameter(torch.zeros(args.n))
    section = dict({"method": args.method, "density": args.density}, **json.loads(args.compression))
    opt = CompressedOptimizer(torch.optim.SGD([param], lr=0.0), section)
    gen = torch.Generator().manual_seed(rank)
    scale = torch.rand(args.n, generator=gen) * 2
    times = []
    for _ in range(args.steps):
        param.grad = torch.randn(args.n, generator=gen).mul_(scale)
        dist.barrier()
        t0 = time.perf_counter()
        opt.reduce_gradients()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    stats = opt.stats()
    stats.pop("last", None)
    result = {"method": args.method, "density": args.density, "n": args.n, "steps": args.steps,
              "reduce_s": statistics.median(times[args.skip_steps:] or times), "stats": stats}
    return finish_worker(result, args.out, indent=None)


if __name__ == "__main__":
    main()

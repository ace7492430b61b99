"""Benchmark: head-optimizer step time of update dense / lazy / lazy_exact, and catch_up_all.

One process, float32 weights (L, d), K random active rows per step (a sorted row-sparse
gradient, or its dense zero-filled copy for ``dense``), SGD (momentum 0.9, wd 5e-4) and AdamW
(wd 0.01). Reports the mean step time (gradient construction included, the same for all)
and the time of one ``catch_up_all`` at the end (lazy_exact: the stale rows of the whole run).

    python benchmarks/lazy_exact.py                       # L=200000 d=64 K=2000, 40 steps
    python benchmarks/lazy_exact.py --rows 1000000 --dim 128 --active 10000 --steps 20
"""
from __future__ import annotations

import argparse
import time

import torch

from ds_xc.head.optim import HeadAdamW, HeadSGD


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--active", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args()
    torch.manual_seed(0)
    print(f"L={a.rows} d={a.dim} K={a.active} steps={a.steps} torch {torch.__version__}")
    print("| update | optimizer | ms/step | catch_up_all ms |\n|---|---|---|---|")
    for name, kw in [("lazy", dict(lazy=True)), ("lazy_exact", dict(exact=True)), ("dense", {})]:
        for cls, extra in [(HeadSGD, dict(momentum=0.9, weight_decay=5e-4)), (HeadAdamW, dict(weight_decay=0.01))]:
            p = torch.nn.Parameter(torch.randn(a.rows, a.dim))
            opt = cls([p], lr=0.01, **extra, **kw)
            t0 = time.perf_counter()
            for _ in range(a.steps):
                rows = torch.randperm(a.rows)[: a.active].sort().values  # (K,)
                vals = torch.randn(a.active, a.dim)  # (K, d)
                if name == "dense":
                    p.grad = torch.zeros(a.rows, a.dim).index_copy_(0, rows, vals)
                else:
                    p.grad = torch.sparse_coo_tensor(rows[None], vals, (a.rows, a.dim), check_invariants=False)
                opt.step()
            step = (time.perf_counter() - t0) / a.steps
            t1 = time.perf_counter()
            opt.catch_up_all()
            print(f"| {name} | {cls.__name__} | {step * 1e3:.2f} | {(time.perf_counter() - t1) * 1e3:.1f} |")


if __name__ == "__main__":
    main()

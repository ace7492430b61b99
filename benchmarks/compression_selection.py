"""Benchmark: selection time per step on one 10^7-element gradient, side by side.

What is timed is the choice of the elements to send from v = g + e (no communication):

* ``torch.topk``: ``torch.topk(v.abs(), k, sorted=False)``, the baseline of the issue;
* ``topk``: the TopK compressor (the same plus sorting the k indices for the wire format);
* ``randomk``: k shared-seed draws, deduplicated;
* ``bayes_prior``: threshold sampling (thinned coins), with and without the periodic
  statistics (max + histogram of ``stats_samples`` draws) amortised over
  ``stats_sync_interval`` steps; for exploit_power 1 (docs/papers.md) and 8.

v is an error-feedback steady state: ``--warm`` steps of e += g with heterogeneous
Gaussian g (per-element scales uniform in [0, 2]), top-1% (bayes) sent each step. Median
of ``--reps`` timings after one warm-up call, per thread count, on CPU (and CUDA when
available, synchronised).

    python benchmarks/compression_selection.py               # writes benchmarks/results/compression_selection.md
    python benchmarks/compression_selection.py --n 1000000 --out -
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import shlex
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/harness.py
from harness import git_rev  # noqa: E402
DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "compression_selection.md")

import torch  # noqa: E402

from ds_xc.compression.compressors import build_compressor  # noqa: E402
from ds_xc.compression.config import parse_compression  # noqa: E402


def steady_state(n: int, density: float, warm: int, device) -> tuple[torch.Tensor, dict]:
    """An error-feedback residual after ``warm`` steps of bayes_prior, and its tensor state."""
    gen = torch.Generator(device=device).manual_seed(0)
    scale = torch.rand(n, generator=gen, device=device) * 2
    comp = build_compressor(parse_compression({"method": "bayes_prior", "density": density}))
    e, st = torch.zeros(n, device=device), {}
    for step in range(warm):
        e.add_(torch.randn(n, generator=gen, device=device) * scale)
        if step % 5 == 0:
            _sync(comp, e, st, gen)
        idx = comp.select(e, st, gen, None)
        e[idx] = 0
    return e, st


def _sync(comp, v, st, gen):
    top = math.ceil(math.log2(comp.local_max(v)))
    comp.update(st, comp.local_histogram(v, top, gen), top)


def timed(fn, reps: int, device) -> float:
    def once():
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t
    once()
    return statistics.median(once() for _ in range(reps))


def measure(n: int, density: float, reps: int, warm: int, interval: int, device) -> list[dict]:
    v, _ = steady_state(n, density, warm, device)
    k = max(1, round(density * n))
    gen = torch.Generator(device=device).manual_seed(1)
    rows = [{"method": "torch.topk(abs(v), k)", "ms": timed(lambda: torch.topk(v.abs(), k, sorted=False), reps, device),
             "kept": k}]
    for name, extra in [("topk", {}), ("randomk", {}), ("bayes_prior k=1", {}),
                        ("bayes_prior k=8 a=0", {"exploit_power": 8.0, "prior": {"strength": 0.0}})]:
        cfg = parse_compression(dict({"method": name.split()[0], "density": density,
                                      "stats_sync_interval": interval}, **extra))
        comp, st = build_compressor(cfg), {}
        if comp.uses_stats:
            _sync(comp, v, st, gen)
        kept = comp.select(v, st, gen, gen).numel()
        ms = timed(lambda: comp.select(v, st, gen, gen), reps, device)
        rows.append({"method": name, "ms": ms, "kept": kept})
        if comp.uses_stats:
            sync_ms = timed(lambda: _sync(comp, v, dict(st), gen), reps, device)
            rows.append({"method": f"{name} + stats every {interval}", "ms": ms + sync_ms / interval, "kept": kept,
                         "note": f"stats sync {sync_ms * 1e3:.1f} ms"})
    base = rows[0]["ms"]
    for r in rows:
        r["speedup"] = base / r["ms"]
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=10**7)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--warm", type=int, default=30)
    p.add_argument("--interval", type=int, default=10, help="stats_sync_interval for the amortised row")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--out", default=DEFAULT_OUT)
    args = p.parse_args(argv)
    command = "python benchmarks/compression_selection.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    started = datetime.datetime.now().isoformat(timespec="seconds")
    sections = []
    runs = [("cpu", int(t)) for t in args.threads.split(",")]
    if torch.cuda.is_available():
        runs.append(("cuda", 0))
    for dev, threads in runs:
        if threads:
            torch.set_num_threads(threads)
        device = torch.device(dev)
        rows = measure(args.n, args.density, args.reps, args.warm, args.interval, device)
        title = f"{dev}, {threads} thread(s)" if dev == "cpu" else torch.cuda.get_device_name()
        table = [f"\n## {title}\n", "| selection | median ms | speed-up vs torch.topk | kept | note |", "|---|---|---|---|---|"]
        table += [f"| {r['method']} | {r['ms'] * 1e3:.1f} | {r['speedup']:.2f}x | {r['kept']:,} | {r.get('note', '')} |"
                  for r in rows]
        sections.append("\n".join(table))
        print(sections[-1], flush=True)
    load = os.getloadavg()
    report = "\n".join([f"# Selection time per step: {args.n:,}-element gradient, density {args.density}\n",
                        f"- command: `{command}`", f"- date: {started}; torch {torch.__version__}; "
                        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; load average "
                        f"{load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} (the machine is shared: compare rows, not runs)",
                        f"- ds_xc at git {git_rev(('ds_xc', 'benchmarks'))}",
                        f"- v: error-feedback steady state after {args.warm} steps; median of {args.reps} timings\n",
                        *sections, ""])
    if args.out != "-":
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as fh:
            fh.write(report)
    return report


if __name__ == "__main__":
    main()

"""Benchmark: the fused row kernels (ds_xc_ops.rows) vs the PyTorch path of the head optimizers.

What a lazy step of a sampled head costs in its optimizer: the step on R active rows of a
(L, d) shard (SGD with momentum and weight decay, AdamW) and the exact lazy catch-up of R stale
rows (``update: lazy_exact``), timed through the optimizers themselves (HeadSGD / HeadAdamW)
with the kernels on and off (``DS_XC_NATIVE_ROWS``), same inputs, calls interleaved (round
robin), one thread, median of the timed calls. The two paths' results are compared (SGD must be
bitwise equal).

    python benchmarks/row_kernels.py                  # L = 10^6, d = 128, R = 10^5
    python benchmarks/row_kernels.py --rows 1000000,20000 --out -
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import cpu_model, git_rev, load_average, write_report  # noqa: E402

from ds_xc.head.optim import HeadAdamW, HeadSGD  # noqa: E402
from ds_xc_ops import builders  # noqa: E402
from ds_xc_ops import rows as native_rows  # noqa: E402

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "row_kernels.md")


def _setup(kind: str, num: int, dim: int, active: int, seed: int):
    """A lazy_exact optimizer over a (num, dim) shard whose rows are all stale by 10 steps, and the
    sparse gradient of ``active`` random rows."""
    g = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(num, dim, generator=g))
    opt = (HeadSGD([w], lr=0.1, momentum=0.9, weight_decay=5e-4, exact=True) if kind == "sgd"
           else HeadAdamW([w], lr=1e-3, weight_decay=0.01, exact=True))
    everything = torch.arange(num)
    w.grad = torch.sparse_coo_tensor(everything[None], torch.randn(num, dim, generator=g) * 1e-2, (num, dim))
    opt.step()  # every row has state
    for _ in range(10):  # ten steps in which one row is active: the others fall 10 steps behind
        w.grad = torch.sparse_coo_tensor(torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, dim), (num, dim))
        opt.step()
    rows = torch.randperm(num, generator=g)[:active].sort().values
    grad = torch.sparse_coo_tensor(rows[None], torch.randn(active, dim, generator=g), (num, dim))
    return w, opt, rows, grad


def _prepared(kind: str, part: str, num: int, dim: int, active: int):
    """(weight, active rows, the call to time) on fresh state: the step on their sparse gradient
    ("step") or their catch-up ("catch_up")."""
    w, opt, rows, grad = _setup(kind, num, dim, active, 0)
    if part == "step":
        w.grad = grad
        return w, rows, opt.step
    return w, rows, lambda: opt.catch_up(rows)


def _time(fn, native: bool) -> float:
    os.environ[native_rows.ENV] = "1" if native else "0"
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(kind: str, part: str, num: int, dim: int, active: int, repeats: int) -> dict:
    """Median seconds of ``part`` ("step" or "catch_up") with and without the kernels, and whether the
    two paths agree."""
    results, out = {}, {True: [], False: []}
    for native in (True, False):  # warm-up, and the result the two paths must agree on
        w, rows, fn = _prepared(kind, part, num, dim, active)
        _time(fn, native)
        results[native] = w.detach()[rows[:1000]].clone()
    for _ in range(repeats):  # interleaved: each timed call on fresh state of its own
        for native in (True, False):
            out[native].append(_time(_prepared(kind, part, num, dim, active)[2], native))
    same = torch.equal(results[True], results[False])
    close = torch.allclose(results[True], results[False], rtol=1e-6, atol=1e-7)
    return {"native": statistics.median(out[True]), "torch": statistics.median(out[False]),
            "agree": "bitwise" if same else ("within 1e-6" if close else "NO")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num", type=int, default=1_000_000, help="rows L of the shard")
    ap.add_argument("--dim", type=int, default=128, help="embedding dim d")
    ap.add_argument("--rows", type=str, default="100000", help="comma-separated active row counts R")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per path")
    ap.add_argument("--out", type=str, default=DEFAULT_OUT, help="markdown results file ('-': none)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if builders.load_op("rows") is None:
        print("the rows op did not build; nothing to compare", file=sys.stderr)
        return 1
    start = time.perf_counter()
    load0 = load_average()
    lines = []
    for active in (int(r) for r in args.rows.split(",")):
        for kind in ("sgd", "adamw"):
            for part in ("step", "catch_up"):
                r = measure(kind, part, args.num, args.dim, active, args.repeats)
                lines.append(f"| {kind} | {part} | {active:,} | {1000 * r['torch']:.1f} | {1000 * r['native']:.1f} | "
                             f"{r['torch'] / r['native']:.1f}x | {r['agree']} |")
                print(lines[-1], flush=True)
    text = "\n".join([
        "# Fused row kernels vs the PyTorch path of the head optimizers", "",
        f"- command: `python benchmarks/row_kernels.py{' ' + ' '.join(argv) if argv else ''}`",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M:%S} UTC "
        f"(wall time {time.perf_counter() - start:.0f} s); load average at the start {load0}, "
        f"at the end {load_average()}",
        f"- torch {torch.__version__}, CPU: {cpu_model()}, one torch thread, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}",
        f"- ds_xc at git {git_rev(('ds_xc', 'ops', 'benchmarks'))}",
        f"- shard: {args.num:,} rows x d = {args.dim}, float32; `update: lazy_exact` optimizers (HeadSGD lr 0.1, "
        "momentum 0.9, weight decay 5e-4; HeadAdamW lr 1e-3, weight decay 0.01); every row 10 steps stale",
        f"- `step` = optimizer.step() on a sparse gradient of R rows (the catch-up of those rows included, as "
        f"in training); `catch_up` = optimizer.catch_up(rows) of R stale rows; median of {args.repeats} calls "
        "per path, interleaved, each on fresh state",
        "", "## Results", "",
        "| optimizer | part | R | torch ms | fused ms | speed-up | results |",
        "|---|---|---:|---:|---:|---:|---|", *lines, "",
        "`results`: the two paths' rows compared (SGD: the kernels fuse a multiply-add exactly where "
        "PyTorch's vectorised kernels do; AdamW differs by an ulp where PyTorch's vectorised sqrt is "
        "not correctly rounded).", ""])
    print(text)
    write_report(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

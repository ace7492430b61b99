"""Hamming top-k scan: torch vs C++ (cpu) vs faiss, side by side in one run.

The ANN sampler's per-rank scan at 10^6 classes: 512 queries, 10^6 rows, code_bits
64/128/256, nlist 1000, nprobe 8/32/128, k 100; and the brute-force scan
(hamming_topk_flat) at 10^5 rows. Every backend gets the same inputs and the same
thread count; after one warm-up call each, the backends' timed calls are interleaved
(round robin) and the median is reported; the outputs must agree exactly (checked).
faiss is timed on a prebuilt index (its build is reported apart), with the exact tie
fix-up (the backend) and without it (faiss's own search only).

Data: clustered codes, so distances look like an IVF's: each list has a random center
code and its rows differ from it in each bit with probability 1/4; a query is a random
row with each bit flipped with probability 1/8, probing its nprobe nearest centers (by
Hamming distance). Rows are spread over the lists uniformly at random (about rows/nlist
per list).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time

import faiss
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ds_xc_ops import builders, hamming as H  # noqa: E402
from ds_xc_ops.hamming_faiss import FaissBinaryIVF, faiss_topk_flat  # noqa: E402


def _noise(g, shape, ands: int) -> torch.Tensor:
    """Random bytes whose bits are 1 with probability 2**-ands (AND of random bytes)."""
    out = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    for _ in range(ands - 1):
        out &= torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    return out


def make_data(rows, nlist, bits, queries, nprobe_max, seed=0):
    """Clustered codes in CSR lists, queries and their nearest-center probes."""
    g = torch.Generator().manual_seed(seed)
    nbytes = bits // 8
    centers = torch.randint(0, 256, (nlist, nbytes), dtype=torch.uint8, generator=g)
    assign = torch.sort(torch.randint(0, nlist, (rows,), generator=g)).values  # grouped
    codes = centers[assign] ^ _noise(g, (rows, nbytes), 2)
    ids = torch.randperm(rows, generator=g)  # local ids, in list order
    offsets = torch.zeros(nlist + 1, dtype=torch.int64)
    offsets[1:] = torch.bincount(assign, minlength=nlist).cumsum(0)
    pick = torch.randint(0, rows, (queries,), generator=g)
    q = codes[pick] ^ _noise(g, (queries, nbytes), 3)
    probes = H.hamming_topk_flat(q, centers, nprobe_max, backend="torch")[1]  # (Q, nprobe_max)
    return q, codes, ids, offsets, probes


def time_all(fns: dict, repeats: dict) -> tuple:
    """Median seconds per name and each name's last output.

    One warm-up call each, then the timed calls round-robin (cpu, faiss, ..., cpu, ...),
    so that a change of load on a shared machine hits every backend alike.
    """
    outs = {name: fn() for name, fn in fns.items()}
    times = {name: [] for name in fns}
    for r in range(max(repeats.values())):
        for name, fn in fns.items():
            if r < repeats[name]:
                t0 = time.perf_counter()
                outs[name] = fn()
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}, outs


def measure(row, fns, args):
    """Times fns into row and records whether the exact backends agree."""
    reps = {name: args.torch_repeats if name == "torch" else args.repeats for name in fns}
    secs, outs = time_all(fns, reps)
    row.update(secs)
    exact = [o for name, o in outs.items() if name != "faiss_knn"]
    row["agree"] = all(torch.equal(o[0], exact[0][0]) and torch.equal(o[1], exact[0][1])
                       for o in exact)


def run_ivf(args, bits, rows_out):
    q, codes, ids, off, probes_all = make_data(args.rows, args.nlist, bits, args.queries,
                                               max(args.nprobe))
    t0 = time.perf_counter()
    fx = FaissBinaryIVF(codes, ids, off)
    build_s = time.perf_counter() - t0
    for nprobe in args.nprobe:
        probes = probes_all[:, :nprobe].contiguous()
        sizes = (off[1:] - off[:-1])[probes]
        row = dict(kind="ivf", bits=bits, nprobe=nprobe, cand=float(sizes.sum(1).float().mean()),
                   faiss_build_s=build_s)
        fns = {}
        for be in args.backends:
            if be == "faiss":
                fns["faiss"] = lambda: fx.search(q, probes, args.k)
                fns["faiss_knn"] = lambda: fx.search(q, probes, args.k, exact_ties=False)
            else:
                fns[be] = lambda be=be: H.hamming_topk_ivf(q, codes, ids, off, probes, args.k,
                                                           backend=be, check=False)
        measure(row, fns, args)
        rows_out.append(row)
        print(_fmt_row(row, args), flush=True)


def run_flat(args, bits, rows_out):
    g = torch.Generator().manual_seed(1)
    nbytes = bits // 8
    db = torch.randint(0, 256, (args.flat_rows, nbytes), dtype=torch.uint8, generator=g)
    q = db[torch.randint(0, args.flat_rows, (args.queries,), generator=g)] ^ _noise(
        g, (args.queries, nbytes), 3)
    row = dict(kind="flat", bits=bits, nprobe="-", cand=float(args.flat_rows), faiss_build_s=0.0)
    fns = {}
    for be in args.backends:
        if be == "faiss":
            fns["faiss"] = lambda: faiss_topk_flat(q, db, args.k)
            fns["faiss_knn"] = lambda: faiss_topk_flat(q, db, args.k, exact_ties=False)
        else:
            fns[be] = lambda be=be: H.hamming_topk_flat(q, db, args.k, backend=be)
    measure(row, fns, args)
    rows_out.append(row)
    print(_fmt_row(row, args), flush=True)


def _cols(args):
    return [b for be in args.backends for b in ((be, "faiss_knn") if be == "faiss" else (be,))]


def _fmt_row(row, args):
    cells = [row["kind"], str(row["bits"]), str(row["nprobe"]), f"{row['cand']:,.0f}"]
    cells += [f"{row[c] * 1e3:,.1f}" for c in _cols(args)]
    base = row.get("torch")
    cells += [f"{base / row[c]:.1f}x" if base else "-" for c in _cols(args) if c != "torch"]
    cells.append("yes" if row.get("agree") else "**no**")
    return "| " + " | ".join(cells) + " |"


def report(args, rows, wall):
    cols = _cols(args)
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    faiss_build = {r["bits"]: r["faiss_build_s"] for r in rows if r["kind"] == "ivf"}
    lines = [
        "# Hamming top-k scan: torch vs cpu (C++) vs faiss",
        "",
        f"- command: `{' '.join(['python benchmarks/hamming_scan.py'] + args.argv)}`",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M:%S} UTC (wall time {wall:.0f} s)",
        f"- torch {torch.__version__}, faiss {faiss.__version__}, python {platform.python_version()}, "
        f"CPU: {cpu}, {args.threads} threads (torch, C++ op and faiss), os.cpu_count() = {os.cpu_count()}",
        f"- ivf: {args.queries} queries, {args.rows:,} rows, nlist {args.nlist}, k {args.k}; "
        f"flat: {args.queries} queries x {args.flat_rows:,} rows, k {args.k}",
        f"- median of {args.repeats} timed calls ({args.torch_repeats} for torch) after 1 warm-up, "
        "the backends' calls interleaved; "
        f"faiss on a prebuilt index (build s: {', '.join(f'{b} bits {s:.2f}' for b, s in faiss_build.items())})",
        f"- load average (1 min) at start / end: {args.load_start:.1f} / {os.getloadavg()[0]:.1f} "
        f"(the machine is shared: above {os.cpu_count()} other work competes for the cores)",
        f"- ds_xc at git {git}",
        "",
        "ms per batch of queries; `cand` = mean candidates scanned per query; speedups are "
        "torch time / backend time; `faiss` is the exact backend (knn + range search to "
        "resolve ties at the k-th distance), `faiss_knn` faiss's own search alone (ties "
        "unresolved, not exact); `agree` = exact equality of distances and ids of "
        "all exact backends.",
        "",
        "| scan | bits | nprobe | cand | " + " | ".join(f"{c} ms" for c in cols) + " | "
        + " | ".join(f"{c} speedup" for c in cols if c != "torch") + " | agree |",
        "|" + "---|" * 4 + "---:|" * (2 * len(cols) - ("torch" in cols)) + ":---:|",
    ]
    lines += [_fmt_row(r, args) for r in rows]
    return "\n".join(lines) + "\n"


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--queries", type=int, default=512)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--bits", type=ints, default=[64, 128, 256])
    p.add_argument("--nlist", type=int, default=1000)
    p.add_argument("--nprobe", type=ints, default=[8, 32, 128])
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--flat_rows", type=int, default=100_000, help="0: skip the flat scan")
    p.add_argument("--backends", default="torch,cpu,faiss")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--torch_repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 "results", "hamming_scan.md"),
                   help="'-': print only")
    p.add_argument("--smoke", action="store_true",
                   help="10^4 rows, nlist 50, 64 queries, 1 repeat; writes nothing")
    args = p.parse_args(argv)
    args.argv = list(argv)
    args.backends = args.backends.split(",")
    if args.smoke:
        args.rows, args.nlist, args.queries, args.flat_rows = 10_000, 50, 64, 5_000
        args.repeats, args.out = 1, "-"
    return args


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    if "cpu" in args.backends and builders.load_op("cpu") is None:
        raise SystemExit("the C++ op did not build; see the warning above")
    start, rows = time.perf_counter(), []
    args.load_start = os.getloadavg()[0]
    for bits in args.bits:
        run_ivf(args, bits, rows)
    if args.flat_rows:
        for bits in args.bits:
            run_flat(args, bits, rows)
    text = report(args, rows, time.perf_counter() - start)
    if args.out != "-":
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return rows


if __name__ == "__main__":
    main()

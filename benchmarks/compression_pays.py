"""When does gradient compression pay? The cost model's table, its check against measurements, its calibration.

    python benchmarks/compression_pays.py               # writes benchmarks/results/compression_pays.md, prints it
    python benchmarks/compression_pays.py --calibrate   # + measures the compute constants (2 loopback ranks,
                                                        #   about 3 min on 2 cores): compression_pays_calibration.md

The table: speedup t_dense / t_compressed of :func:`ds_xc.compression.pays.verdict` over model
sizes (compressed elements), link speeds and ranks, for each method at ``--density``. The check:
the model against the reductions measured over tc-shaped veth links
(benchmarks/results/compression_netns*.md, section A, 2 ranks). The calibration: 2 gloo ranks on
127.0.0.1 reduce a fake gradient (benchmarks/compression_wire.py) with each method; per element,
c_method = (t_method - t_link) / N - c_dense, t_link the loopback transfer of the model
(ds_xc.cost.comm.LOOPBACK), c_dense from the 1 Gbit/s dense measurement (:func:`netns_dense_ns`).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/harness.py
from harness import git_rev  # noqa: E402
RESULTS = os.path.join(ROOT, "benchmarks", "results")
SIZES = (10**6, 10**7, 10**8)
LINKS = (0.1, 1.0, 10.0, 100.0)  # Gbit/s
RANKS = (2, 4, 16)
METHODS = ("bayes_prior", "topk", "randomk")


def _link(g: float) -> str:
    return f"{g * 1000:g} Mbit/s" if g < 1 else f"{g:g} Gbit/s"


def pays_table(method: str = "bayes_prior", density: float = 0.01, zero_stage: int = 0, backend: str = "gloo") -> str:
    """Markdown table of the model's speedup and verdict: rows (elements, link), columns ranks (``zero_stage``
    1: under DeepSpeed's ZeRO-1, whose parameter all-gather both sides pay; ``backend`` prices its
    reduce-scatter)."""
    from ds_xc.compression.pays import verdict
    lines = ["| elements | link | " + " | ".join(f"{p} ranks" for p in RANKS) + " |",
             "|---|---|" + "---|" * len(RANKS)]
    for n in SIZES:
        for g in LINKS:
            cells = []
            for p in RANKS:
                v = verdict(n, p, g, method, density, zero_stage=zero_stage, backend=backend)
                cells.append(f"{v.speedup:.3g}x {v.verdict}")
            lines.append(f"| 10^{len(str(n)) - 1} | {_link(g)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def measured_rows(path: str) -> tuple:
    """(link Gbit/s, {variant: reduce ms}, n) from section A of a compression_netns result file."""
    with open(path) as fh:
        text = fh.read()
    rate = re.search(r"emulated (\d+)(m|g)bit link", text)
    n = re.search(r"## A\. Reduction only: ([\d,]+)-element", text)
    if rate is None or n is None:
        return None
    gbit = float(rate.group(1)) * (1e-3 if rate.group(2) == "m" else 1.0)
    section = text.split("## A.", 1)[1].split("## B.", 1)[0]
    ms = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\| (\w+) \| ([\d.]+) \|", section, re.MULTILINE)}
    return gbit, ms, int(n.group(1).replace(",", ""))


def model_vs_measured(density: float = 0.01) -> str:
    """The model's reduction time against every compression_netns*.md measurement (2 ranks)."""
    from ds_xc.compression.pays import verdict
    lines = ["| file | link | variant | measured ms | model ms | error |", "|---|---|---|---|---|---|"]
    for name in sorted(os.listdir(RESULTS)):
        if not re.fullmatch(r"compression_netns.*\.md", name):
            continue
        got = measured_rows(os.path.join(RESULTS, name))
        if got is None:
            continue
        gbit, ms, n = got
        for variant, measured in ms.items():
            method = "bayes_prior" if variant == "dense" else variant
            v = verdict(n, 2, gbit, method, density)
            model = v.dense_ms if variant == "dense" else v.compressed_ms
            lines.append(f"| {name} | {_link(gbit)} | {variant} | {measured:.1f} | {model:.1f} | "
                         f"{100 * (model - measured) / measured:+.0f}% |")
    return "\n".join(lines)


def _wire(method: str, n: int, port: int, steps: int) -> float:
    """Median reduce_gradients() seconds of 2 gloo ranks on 127.0.0.1 (benchmarks/compression_wire.py)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        procs = []
        for rank in range(2):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
            procs.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "benchmarks", "compression_wire.py"),
                                           "--n", str(n), "--method", method, "--steps", str(steps), "--out", out],
                                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        for p in procs:
            _, err = p.communicate(timeout=900)
            if p.returncode:
                raise RuntimeError(f"compression_wire.py --method {method} --n {n} failed:\n{err[-3000:]}")
        with open(out) as fh:
            return json.load(fh)["reduce_s"]


def fit_from_netns(density: float = 0.01) -> tuple:
    """The compute constants implied by the shaped-link runs: per row, (t_measured - the model's
    transfer) / N. dense_ns from the 1 Gbit/s dense row only (at 100 Mbit/s the 3.2 s transfer's
    few percent of TCP and tbf slack outweigh the compute), each method's constant beyond dense_ns
    the mean over the links (its transfer there is small next to its compute).
    Returns ({constant: ns}, [markdown rows])."""
    from ds_xc.cost.comm import Link, collective_time
    from ds_xc.cost.compression import DEFAULT_LATENCY_S, reduction_collectives
    measured = []
    for name in sorted(os.listdir(RESULTS)):
        got = measured_rows(os.path.join(RESULTS, name)) if re.fullmatch(r"compression_netns.*\.md", name) else None
        if got is not None:
            measured.append((name, *got))
    total = {}
    for name, gbit, ms, n in measured:
        link = Link.gbit(gbit, DEFAULT_LATENCY_S)
        for variant, t in ms.items():
            method = "none" if variant == "dense" else variant
            wire = sum(collective_time(c, link) for c in reduction_collectives(n, 2, method, density))
            total[name, gbit, variant] = (1e-3 * t - wire) / n * 1e9, 1e-3 * t, wire
    dense = [v[0] for (name, gbit, variant), v in total.items() if variant == "dense" and gbit == 1.0]
    fit = {"dense_ns": statistics.mean(dense)}
    rows = []
    for (name, gbit, variant), (ns, t, wire) in total.items():
        beyond = ns if variant == "dense" else ns - fit["dense_ns"]
        rows.append(f"| {name} | {_link(gbit)} | {variant} | {1e3 * t:.1f} | {1e3 * wire:.1f} | {ns:.2f} "
                    f"| {beyond:.2f} |")
        if variant != "dense":
            fit.setdefault(f"{variant}_ns", []).append(beyond)
    return {k: (v if k == "dense_ns" else statistics.mean(v)) for k, v in fit.items()}, rows


def calibrate(density: float, steps: int, repeats: int = 2, sizes=(10**6, 10**7), port: int = 29711) -> str:
    """The compute constants: fitted to the shaped-link runs, and measured again on loopback as a
    cross-check (module docstring); returns the markdown report."""
    from ds_xc.compression import parse_compression
    from ds_xc.cost.comm import LOOPBACK, collective_time
    from ds_xc.cost.compression import DEFAULT_CALIBRATION, reduction_collectives
    fit, fit_rows = fit_from_netns(density)
    sync = parse_compression({}).stats_sync_interval
    dense_ns = fit["dense_ns"]
    rows, loop = [], {m: [] for m in METHODS}
    for n in sizes:
        for method in METHODS:
            times = []
            for _ in range(repeats):
                port += 1
                times.append(_wire(method, n, port, steps))
            t = min(times)
            link_s = sum(collective_time(c, LOOPBACK) for c in reduction_collectives(n, 2, method, density))
            ns = (t - link_s) / n * 1e9
            loop[method].append(ns - dense_ns)
            rows.append(f"| {n:,} | {method} | {', '.join(f'{1e3 * x:.1f}' for x in times)} | {1e3 * link_s:.2f} | "
                        f"{ns:.2f} | {ns - dense_ns:.2f} |")
    summary = [f"| dense_ns | {dense_ns:.2f} | - | {DEFAULT_CALIBRATION.dense_ns:g} |"]
    summary += [f"| {m}_ns | {fit[m + '_ns']:.2f} | {', '.join(f'{x:.2f}' for x in loop[m])} | "
                f"{getattr(DEFAULT_CALIBRATION, m + '_ns'):g} |" for m in METHODS]
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    return "\n".join([
        "# Calibration of the compression cost model (ds_xc/cost/compression.py)", "",
        f"- command: `python benchmarks/compression_pays.py --calibrate --steps {steps} --repeats {repeats}`",
        (f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}; {platform.machine()}, "
         f"{os.cpu_count()} cores, load average {load} (shared machine: other jobs only add time)"),
        f"- ds_xc at git {git_rev(('ds_xc', 'benchmarks'))}", "",
        "## A. Fitted to the reductions over tc-shaped veth links (2 ranks, 10^7 elements, 12 steps)", "",
        "compute ns/element = (measured - the model's transfer) / N; 'beyond dense_ns' = minus dense_ns "
        "(the 1 Gbit/s dense row's value).", "",
        "| file | link | variant | measured ms | model transfer ms | compute ns/element | beyond dense_ns |",
        "|---|---|---|---|---|---|---|", *fit_rows, "",
        "## B. Measured again: 2 gloo ranks on 127.0.0.1", "",
        (f"1 thread each, density {density}; per run the median of {steps} steps (the first 2 skipped) of "
         f"`reduce_gradients()` between barriers; {repeats} runs, the fastest kept. bayes_prior at its "
         f"defaults syncs its statistics every {sync} compressed steps (stats_sync_interval), a cost that "
         "weighs most at 10^6 elements."), "",
        "| elements | method | measured ms (runs) | loopback transfer ms (model) | compute ns/element | "
        "beyond dense_ns |", "|---|---|---|---|---|---|", *rows, "",
        "## Constants (ns per element)", "",
        "| constant | fit A | loopback B (10^6, 10^7) | default in Calibration |", "|---|---|---|---|", *summary, ""])


def render(density: float) -> str:
    parts = ["# When gradient compression pays: the cost model's verdicts", "",
             "- command: `python benchmarks/compression_pays.py`"
             + (f" --density {density}" if density != 0.01 else ""),
             f"- ds_xc at git {git_rev(('ds_xc', 'benchmarks'))}",
             "- model: ds_xc/cost/compression.py with its default Calibration, latency "
             "50 us per ring step; speedup = t_dense / t_compressed of one step's reduction; "
             "pays >= 1.25x, does not pay < 1.0x", ""]
    for method in METHODS:
        parts += [f"## {method}, density {density}", "", pays_table(method, density), ""]
    zero = {"gloo": "gloo runs it as an all-reduce of the gradient",
            "nccl": ("NCCL's moves half an all-reduce's bytes; the compute constants are still this CPU machine's "
                     "(a GPU selects faster: pass your own Calibration)")}
    for backend, scatter in zero.items():
        parts += [f"## bayes_prior, density {density}, under ZeRO-1 ({backend})", "",
                  ("DeepSpeed's ZeRO-1 step all-gathers the updated fp32 parameters (4 bytes per element) whether "
                   f"the gradients were compressed or not, and its dense reduction is a reduce-scatter ({scatter}): "
                   "both sides pay the all-gather (ds_xc/cost/compression.py)."), "",
                  pays_table("bayes_prior", density, zero_stage=1, backend=backend), ""]
    parts += ["## The model against measured reductions (2 ranks, tc-shaped veth)", "",
              ("The compute constants were fitted to these rows (compression_pays_calibration.md, A): the "
               "errors are in-sample. The dense row at 1 Gbit/s is 0% by construction."), "",
              model_vs_measured(density), ""]
    return "\n".join(parts)


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--out", default=os.path.join(RESULTS, "compression_pays.md"), help="'-': print only")
    p.add_argument("--calibrate", action="store_true")
    p.add_argument("--steps", type=int, default=8, help="--calibrate: reductions timed per run")
    p.add_argument("--repeats", type=int, default=2, help="--calibrate: runs per method and size (fastest kept)")
    args = p.parse_args(argv)
    text = render(args.density)
    if args.out != "-":
        with open(args.out, "w") as fh:
            fh.write(text)
    print(text)
    if args.calibrate:
        report = calibrate(args.density, args.steps, args.repeats)
        if args.out != "-":
            with open(os.path.join(os.path.dirname(args.out), "compression_pays_calibration.md"), "w") as fh:
                fh.write(report)
        print(report)
    return text


if __name__ == "__main__":
    main()

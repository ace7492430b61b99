"""10^8 classes by simulation: one rank's measured work plus the modelled communication.

For C = 10^8 and P in {64, 128, 256}, one process runs exactly the work of rank 0 of a P-rank
job (benchmarks/sim_rank.py): its shard of L = C / P classes (weights, head optimizer state,
ANN index built from the shard), and per step the forward (sampler: index upkeep, search,
re-rank, active set; fused sampled softmax), backward and optimizer step on the global batch
of N = P x micro rows. Measured: compute seconds per step (median), the index build (amortised
over ``rebuild_interval``), peak RSS and the tensors the rank holds. Added: the communication
of the same step from ds_xc/cost/comm.py (step_collectives of the same section, ring model,
8 ranks per node, one NIC per node) for 25, 100 and 400 Gbit/s links.

Recipe (the library defaults unless named): softmax loss, d = 128, ANN sample_rate 0.01
(head-wide scan_rows 65536 and rerank 256, each shard taking its share), chunk_size 1024,
SGD momentum 0.9 with update lazy_exact (the head optimizer of Partial FC; AdamW would add a
second shard-sized state), micro-batch 32 rows per rank, float32 weights; no dense backbone
(the head's communication only; a backbone's all-reduce adds 2 (P-1)/P x 4 bytes x params / B).

    python benchmarks/simulate_scale.py                  # P = 64, 128, 256 (about 3 GiB per rank)
    python benchmarks/simulate_scale.py --ranks 256 --steps 3 --out -
    python benchmarks/simulate_scale.py --num_classes 1000000 --ranks 8,16 --out -   # quick
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from harness import git_rev, hwm_bytes, load_average, rss_bytes, write_report  # noqa: E402

DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "simulate_1e8.md")
LINKS_GBIT = (25, 100, 400)
RANKS_PER_NODE = 8


def section(num_classes: int) -> dict:
    return {"num_classes": num_classes, "embedding_dim": 128, "loss": {"type": "softmax"}, "chunk_size": 1024,
            "check_inputs": False, "sampler": {"type": "ann", "sample_rate": 0.01},
            "optimizer": {"type": "sgd", "lr": 0.1, "momentum": 0.9, "update": "lazy_exact"}}


def tensor_bytes(head, opt) -> dict:
    """Bytes of the tensors the rank holds: weights, optimizer state, ANN index."""
    import torch
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    index = head.sampler.index
    idx = sum(t.numel() * t.element_size() for t in vars(index).values() if isinstance(t, torch.Tensor))
    return {"weights": head.weight.numel() * head.weight.element_size(), "optimizer": state, "index": idx}


def one_rank(args) -> dict:
    """Measure rank 0 of a P-rank job in this process."""
    import torch
    from sim_rank import build_rank, make_batch, rank_step
    torch.set_num_threads(1)
    base = rss_bytes()
    sec = section(args.num_classes)
    head, opt = build_rank(sec, args.world)
    n_rows = args.world * args.micro
    t, c = time.perf_counter(), time.process_time()
    head.rebuild_index()
    build_s, build_cpu = time.perf_counter() - t, time.process_time() - c
    times, cpu, budgets = [], [], head.sampler.budgets()
    for it in range(args.steps + 2):
        x, y = make_batch(n_rows, sec["embedding_dim"], args.num_classes, it)
        c = time.process_time()
        took = rank_step(head, opt, x, y)
        if it >= 2:
            times.append(took)
            cpu.append(time.process_time() - c)
    interval = head.sampler_config.rebuild_interval
    # compute = CPU seconds of the one-threaded rank (what it takes on a core of its own; the wall
    # time on 2 shared cores at load ~10 is several times that and varies by 3x), build amortised
    return {"world": args.world, "shard": head.num_local, "rows": n_rows, "step_s": statistics.median(times),
            "times": times, "cpu": cpu, "build_s": build_s, "build_cpu_s": build_cpu, "rebuild_interval": interval,
            "compute_s": statistics.median(cpu) + build_cpu / max(interval, 1),
            "active": head.sampler.last_stats.get("active"), "budgets": budgets,
            "peak_rss": hwm_bytes() - base, "tensors": tensor_bytes(head, opt), "load": load_average()}


def comm_rows(res: dict, num_classes: int, micro: int, latency_s: float) -> dict:
    """Predicted communication seconds per step of rank ``res`` for each link speed (gloo's algorithms)."""
    from ds_xc.cost.comm import Link, predict_time, step_collectives
    colls = step_collectives({"extreme_classification": section(num_classes)}, world_size=res["world"],
                             batch_sizes=[micro] * res["world"], sizes_known=True)
    out = {g: predict_time(colls, Link.gbit(g, latency_s), ranks_per_node=RANKS_PER_NODE) for g in LINKS_GBIT}
    out["collectives"], out["bytes"] = len(colls), sum(c.count * c.nbytes for c in colls)
    return out


def render(args, results: list, rev: str) -> str:
    cmd = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT)] + sys.argv[1:])
    mib = 2 ** 20
    lines = [f"# {args.num_classes:,} classes by simulation\n", f"Command: `{cmd}`  ", f"Revision: {rev}  ",
             f"Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; load (1/5/15 min) before: "
             f"{args.load_before}, after: {load_average()}  ",
             "Machine: 2 shared cores (other jobs running), one thread per simulated rank, float32 CPU kernels.\n",
             f"Recipe: {json.dumps(section(args.num_classes))}, micro-batch {args.micro} rows per rank, "
             f"{RANKS_PER_NODE} ranks per node (one NIC each node), ring latency alpha = {args.latency_us:g} us per "
             "step. Compute: median CPU seconds of the timed steps (after 2 warm-ups; the rank is one thread, so this is its "
             "time on a core of its own) plus the index build's CPU seconds / rebuild_interval; the wall seconds on "
             "the shared cores are shown beside it. Predicted step = compute + comm (no overlap).\n",
             "| P | shard L | global batch N | active K | scan / rerank per query | index build CPU s | wall s/step (shared) | compute s/step | "
             + " | ".join(f"comm s @{g}G" for g in LINKS_GBIT) + " | " + " | ".join(f"step s @{g}G" for g in LINKS_GBIT)
             + " | tensors MiB (w + opt + index) | peak RSS MiB | efficiency @" + "/".join(map(str, LINKS_GBIT)) + " |",
             "|" + "---|" * (11 + 2 * len(LINKS_GBIT))]
    first = None
    for res in results:
        comm = comm_rows(res, args.num_classes, args.micro, args.latency_us * 1e-6)
        steps = {g: res["compute_s"] + comm[g] for g in LINKS_GBIT}
        first = first or (res["world"], steps)
        eff = [first[1][g] / steps[g] for g in LINKS_GBIT]  # N grows with P: per-rank work is constant
        t = res["tensors"]
        lines.append(f"| {res['world']} | {res['shard']:,} | {res['rows']:,} | {res['active']:,} | "
                     f"{res['budgets'][0]} / {res['budgets'][1]} | {res['build_cpu_s']:.1f} | {res['step_s']:.2f} | "
                     f"{res['compute_s']:.3f} | "
                     + " | ".join(f"{comm[g]:.4f}" for g in LINKS_GBIT) + " | "
                     + " | ".join(f"{steps[g]:.3f}" for g in LINKS_GBIT)
                     + f" | {t['weights'] / mib:.0f} + {t['optimizer'] / mib:.0f} + {t['index'] / mib:.0f} | "
                     f"{res['peak_rss'] / mib:.0f} | " + " / ".join(f"{e:.2f}" for e in eff) + " |")
    lines += ["", "Timed steps, wall (CPU) s: " + "; ".join(f"P={r['world']}: " + ", ".join(
        f"{x:.2f} ({c:.2f})" for x, c in zip(r["times"], r["cpu"]))
                                                  + f" (load {r['load']})" for r in results), ""]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num_classes", type=int, default=10**8)
    p.add_argument("--ranks", default="64,128,256")
    p.add_argument("--micro", type=int, default=32)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--latency_us", type=float, default=10.0)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)  # internal: run one rank, print JSON
    p.add_argument("--out", default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.world:
        print("RESULT " + json.dumps(one_rank(args)), flush=True)
        return 0
    args.load_before, rev = load_average(), git_rev(("ds_xc", "benchmarks"))  # the revision measured
    results = []
    for world in [int(r) for r in args.ranks.split(",")]:
        cmd = [sys.executable, os.path.abspath(__file__), "--world", str(world), "--num_classes", str(args.num_classes),
               "--micro", str(args.micro), "--steps", str(args.steps)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode != 0 or not line:
            raise RuntimeError(f"P={world} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
        results.append(json.loads(line[0][7:]))
        print(f"P={world}: {results[-1]}", flush=True)
    text = render(args, results, rev)
    print(text)
    write_report(args.out, text)
    if args.out != "-":
        with open(os.path.splitext(args.out)[0] + ".json", "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

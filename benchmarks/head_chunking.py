"""Benchmark: the exact class-parallel head, chunked vs unchunked logits, side by side.

One step = head forward + backward + head optimizer step (dense SGD, momentum 0.9) +
zero_grad(set_to_none=True), with fresh random embeddings (a leaf tensor) and labels.
Every configuration (world size x chunk size) runs in its own freshly spawned gloo
process group, so peak memory starts clean. Per rank we measure the median step time
and memory from /proc/self/status (VmRSS, and VmHWM reset through /proc/self/clear_refs),
then take the max over ranks. Ratios chunked/unchunked are measured in the same run.

    python benchmarks/head_chunking.py                  # the default run (~9 min on 2 cores)
    python benchmarks/head_chunking.py --smoke          # 10^4 classes, 2 steps, < 30 s, writes nothing

See benchmarks/README.md for how to read the table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shlex
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/harness.py
from harness import (cpu_model, git_rev, hwm_bytes, init_rank, close_rank, mib as _mib,  # noqa: E402
                     peak_reset_works, reset_peak, rss_bytes, spawn_ranks, usable_cores)

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "head_chunking.md")
LOSSES = {"arcface": {"type": "arcface", "scale": 64.0, "margin": 0.5}, "softmax": {"type": "softmax"}}
OPTIMIZER = {"type": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4, "update": "dense"}


# ---------------------------------------------------------------------------- one rank
def _run_rank(rank: int, world: int, port: int, spec: dict) -> dict:
    torch = init_rank(rank, world, port, spec)
    import torch.distributed as dist

    import ds_xc

    try:
        local_batch = spec["batch"] // world
        dim, classes = spec["dim"], spec["num_classes"]
        _prewarm(ds_xc, torch, spec, local_batch)
        baseline = rss_bytes()
        head = ds_xc.ClassParallelHead(dim, classes, loss=LOSSES[spec["loss"]], sampler="full",
                                       group=None, chunk_size=spec["chunk"], update="dense",
                                       check_inputs=False)
        opt = ds_xc.build_head_optimizer(head, OPTIMIZER)
        gen = torch.Generator().manual_seed(1000 + rank)  # same data for every chunk size

        def batch():
            x = torch.randn((local_batch, dim), generator=gen).requires_grad_(True)
            y = torch.randint(0, classes, (local_batch,), generator=gen)
            return x, y

        phase_peak = {"forward": 0, "backward": 0, "step": 0}
        losses = []

        def step(probe: bool) -> dict:
            """One training step; with ``probe`` the peak of each phase above ``baseline``."""
            x, y = batch()
            dist.barrier()
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            if probe:
                reset_peak()
            loss = head(x, y)
            t1 = time.perf_counter()
            if probe:
                phase_peak["forward"] = max(phase_peak["forward"], hwm_bytes() - baseline)
                reset_peak()
            loss.backward()
            t2 = time.perf_counter()
            if probe:
                phase_peak["backward"] = max(phase_peak["backward"], hwm_bytes() - baseline)
                reset_peak()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            if probe:
                phase_peak["step"] = max(phase_peak["step"], hwm_bytes() - baseline)
            losses.append(float(loss.detach()))
            return {"total": t3 - t0, "forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2,
                    "user": r1.ru_utime - r0.ru_utime, "sys": r1.ru_stime - r0.ru_stime,
                    "faults": r1.ru_minflt - r0.ru_minflt}

        for i in range(spec["warmup"]):  # the last warm-up step also records the peak of each phase
            step(probe=i == spec["warmup"] - 1)
        persistent = rss_bytes() - baseline
        reset_peak()
        timed = [step(probe=False) for _ in range(spec["steps"])]
        peak = hwm_bytes() - baseline
        med = {k: statistics.median(t[k] for t in timed) for k in timed[0]}
        totals = [t["total"] for t in timed]
        return {"rank": rank, "torch": torch.__version__, "num_local": head.num_local, "step_s": med["total"],
                "step_range": (min(totals), max(totals)), "phase_s": med,
                "persistent": persistent, "peak": peak, "phase_peak": phase_peak, "losses": losses,
                "baseline": baseline}
    finally:
        close_rank()


def _prewarm(ds_xc, torch, spec: dict, local_batch: int) -> None:
    """One step of a tiny head through the same code path, so that lazily loaded code pages,
    thread pools and allocator arenas (~100 MiB) are in the baseline, not in ``persistent``."""
    import gc

    head = ds_xc.ClassParallelHead(spec["dim"], 1024, loss=LOSSES[spec["loss"]], sampler="full",
                                   chunk_size=spec["chunk"], update="dense", check_inputs=False)
    opt = ds_xc.build_head_optimizer(head, OPTIMIZER)
    x = torch.randn((local_batch, spec["dim"])).requires_grad_(True)
    head(x, torch.randint(0, 1024, (local_batch,))).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    del head, opt, x
    gc.collect()


def run_config(spec: dict) -> list[dict]:
    """Spawn ``spec['world']`` fresh ranks in a new gloo group, run, return per-rank results."""
    return spawn_ranks(spec, _run_rank)


# ---------------------------------------------------------------------------- report
def budget_bytes(num_local: int, dim: int, chunk: int, batch: int) -> int:
    """Weights + optimizer state (momentum) + 2 chunks of logits, float32."""
    rows = min(chunk, batch) if chunk > 0 else batch
    return num_local * dim * 4 * 2 + 2 * rows * num_local * 4


def summarise(spec: dict, ranks: list[dict], args) -> dict:
    num_local = max(r["num_local"] for r in ranks)  # rank 0 has the largest shard
    return {
        "world": spec["world"], "chunk": spec["chunk"], "num_local": num_local,
        "step_s": max(r["step_s"] for r in ranks),
        "step_range": max((r["step_range"] for r in ranks), key=lambda mm: mm[1]),
        "phase_s": {k: max(r["phase_s"][k] for r in ranks) for k in ranks[0]["phase_s"]},
        "persistent": max(r["persistent"] for r in ranks),
        "peak": max(r["peak"] for r in ranks),
        "phase_peak": {k: max(r["phase_peak"][k] for r in ranks) for k in ranks[0]["phase_peak"]},
        "budget": budget_bytes(num_local, args.dim, spec["chunk"], args.batch),
        "weights": num_local * args.dim * 4,
        "full_logits": args.batch * num_local * 4,
        "losses": ranks[0]["losses"], "torch": ranks[0]["torch"],
    }


def render(rows: list[dict], args, command: str, started: str, wall_s: float, hwm_ok: bool) -> str:
    cpu = cpu_model()
    cores = usable_cores()
    base = {(r["world"]): r for r in rows if r["chunk"] == 0}
    lines = [
        "# Exact head: chunked vs unchunked logits",
        "",
        f"- command: `{command}`",
        f"- date: {started} (wall time {wall_s:.0f} s)",
        f"- torch {rows[0]['torch']}, python {platform.python_version()}, CPU: {cpu}, "
        f"{cores} cores usable (os.cpu_count() = {os.cpu_count()})",
        f"- head: {args.num_classes:,} classes, d={args.dim}, global batch {args.batch}, float32, "
        f"loss {json.dumps(LOSSES[args.loss])}, sampler full, check_inputs off, optimizer {json.dumps(OPTIMIZER)}",
        f"- per configuration: fresh gloo group of spawned processes; threads = {args.threads_1} at 1 rank, "
        f"1 per rank otherwise; {args.warmup} warm-up + {args.steps} timed steps; "
        f"max over ranks of each rank's median",
        f"- ds_xc at git {git_rev()}",
        f"- VmHWM reset via /proc/self/clear_refs works here: {'yes' if hwm_ok else 'NO (peak is since process start)'}",
        "",
        "Memory in MiB above the rank's RSS before the head was built. budget = weights + momentum "
        "+ 2 chunks of logits (chunk 0: the whole global batch); full logits = N x C_local x 4 B. "
        "Targets: chunked peak < budget, chunked step time <= 1.3 x unchunked.",
        "",
        "| ranks | chunk | C_local | step s (min-max) | time ratio | persistent | peak | peak ratio | budget | peak < budget | full logits | time <= 1.3x |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|---:|:---:|",
    ]
    for r in rows:
        b = base.get(r["world"])
        if r["chunk"] and b:
            tr, pr = r["step_s"] / b["step_s"], r["peak"] / b["peak"]
            tr_s, pr_s, ok_t = f"{tr:.2f}", f"{pr:.2f}", ("yes" if tr <= 1.3 else "**no**")
        else:
            tr_s, pr_s, ok_t = "1.00" if not r["chunk"] else "-", "1.00" if not r["chunk"] else "-", "-"
        ok_m = "yes" if r["peak"] < r["budget"] else "**no**"
        lines.append(f"| {r['world']} | {r['chunk'] or 'off'} | {r['num_local']:,} | {r['step_s']:.2f} ({r['step_range'][0]:.2f}-{r['step_range'][1]:.2f}) | {tr_s} | "
                     f"{_mib(r['persistent'])} | {_mib(r['peak'])} | {pr_s} | {_mib(r['budget'])} | {ok_m} | "
                     f"{_mib(r['full_logits'])} | {ok_t} |")
    lines += [
        "",
        "Where time and memory go (max over ranks): median seconds per phase over the timed steps, and "
        "median CPU seconds (all threads of the rank) and minor page faults per step; "
        "peak MiB per phase from the last warm-up step (the first step creates the momentum buffer, so "
        "with --warmup 1 these peaks lack it). The fused loss computes all gradients in the "
        "forward, so `forward` holds the logits; `step` is optimizer step + zero_grad. "
        "W = weights of the shard in MiB.",
        "",
        "| ranks | chunk | W | forward s | backward s | step s | cpu user s | cpu sys s | page faults | peak forward | peak backward | peak step | loss step 1 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        p, t = r["phase_peak"], r["phase_s"]
        lines.append(f"| {r['world']} | {r['chunk'] or 'off'} | {_mib(r['weights'])} | {t['forward']:.2f} | "
                     f"{t['backward']:.3f} | {t['step']:.2f} | {t['user']:.2f} | {t['sys']:.2f} | {t['faults'] / 1e3:,.0f}k | {_mib(p['forward'])} | {_mib(p['backward'])} | "
                     f"{_mib(p['step'])} | {r['losses'][0]:.6f} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--num_classes", type=int, default=None, help="classes C (default 10^6; --smoke: 10^4)")
    p.add_argument("--dim", type=int, default=128, help="embedding dim d")
    p.add_argument("--batch", type=int, default=512, help="global batch N (split evenly over the ranks)")
    p.add_argument("--chunks", type=str, default=None,
                   help="comma-separated chunk sizes compared with the unchunked head (chunk_size 0); "
                        "default 64,128,256 (--smoke: 64)")
    p.add_argument("--worlds", type=str, default="1,2", help="comma-separated world sizes")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 5; --smoke: 2)")
    p.add_argument("--warmup", type=int, default=None, choices=(1, 2),
                   help="warm-up steps before timing; the last one also measures the peak of each phase "
                        "(default 2, so that it is a steady-state step with the momentum buffer; --smoke: 1)")
    p.add_argument("--loss", choices=sorted(LOSSES), default="arcface", help="arcface (s=64, m=0.5) or softmax")
    p.add_argument("--out", type=str, default=None,
                   help=f"markdown results file (default {os.path.relpath(DEFAULT_OUT)}; --smoke writes "
                        f"none unless given; '-' for none)")
    p.add_argument("--threads_1", type=int, default=2, help="torch/OMP threads of the 1-rank run")
    p.add_argument("--timeout", type=int, default=900, help="seconds allowed per configuration")
    p.add_argument("--smoke", action="store_true", help="tiny run: 10^4 classes, 2 steps, chunk 64 only, nothing written")
    args = p.parse_args(argv)
    if args.num_classes is None:
        args.num_classes = 10_000 if args.smoke else 1_000_000
    if args.warmup is None:
        args.warmup = 1 if args.smoke else 2
    if args.steps is None:
        args.steps = 2 if args.smoke else 5
    if args.out is None:
        args.out = "-" if args.smoke else DEFAULT_OUT
    if args.chunks is None:
        args.chunks = "64" if args.smoke else "64,128,256"
    args.chunk_list = [int(c) for c in args.chunks.split(",") if c.strip()]
    args.world_list = [int(w) for w in args.worlds.split(",") if w.strip()]
    if any(c <= 0 for c in args.chunk_list) or any(w <= 0 for w in args.world_list):
        p.error("--chunks and --worlds take positive integers (chunk 0, the baseline, is always run)")
    if any(args.batch % w for w in args.world_list):
        p.error(f"--batch {args.batch} must split evenly over every world size in {args.world_list}")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return args


def main(argv=None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    command = " ".join(shlex.quote(a) for a in ["python", "benchmarks/head_chunking.py", *argv])
    started = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    hwm_ok = peak_reset_works()
    if not hwm_ok:
        print("warning: /proc/self/clear_refs does not reset VmHWM here; peaks include the warm-up", flush=True)
    t_start = time.perf_counter()
    rows = []
    for world in args.world_list:
        for chunk in [0, *args.chunk_list]:
            spec = {"world": world, "chunk": chunk, "num_classes": args.num_classes, "dim": args.dim,
                    "batch": args.batch, "loss": args.loss, "steps": args.steps, "warmup": args.warmup,
                    "threads": args.threads_1 if world == 1 else 1, "timeout": args.timeout}
            t0 = time.perf_counter()
            row = summarise(spec, run_config(spec), args)
            rows.append(row)
            print(f"ranks={world} chunk={chunk or 'off':>4}: step {row['step_s']:.2f} s, peak "
                  f"{_mib(row['peak'])} MiB, budget {_mib(row['budget'])} MiB ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    report = render(rows, args, command, started, time.perf_counter() - t_start, hwm_ok)
    print(report)
    if args.out != "-":
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(report)
        print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()

"""Benchmark: the ANN-sampled head vs the exact chunked head, side by side (speed + memory).

One step = head forward (including the sampler: index upkeep, search, re-rank, active set)
+ backward + head optimizer step + zero_grad(set_to_none=True), with fresh random
embeddings (a leaf tensor) and labels. Variants, each in its own freshly spawned gloo
group (benchmarks/harness.py), for every world size:

* ``exact``: sampler full, dense SGD (momentum 0.9, wd 5e-4): the exact chunked head;
* ``ann``: sampler ann at ``--sample_rate`` (library defaults otherwise), ``update: lazy``
  and lazy SGD (the same hyper-parameters);
* ``uniform``: sampler uniform at the same rate, lazy: the cost of a sampled step without
  retrieval (a reference, not a target).

The ANN index is built once explicitly before the warm-up (timed and its memory peak
probed); the periodic rebuild is amortised as build_s / rebuild_interval and added to the
median step. Re-encoding the rows the optimizer changed happens inside every timed forward.
Memory from /proc/self/status (VmRSS, VmHWM reset through /proc/self/clear_refs), above the
rank's RSS before the head was built; max over ranks.

    python benchmarks/ann_head.py                # 10^6 classes, d=128, batch 512, 1 and 2 ranks
    python benchmarks/ann_head.py --smoke        # 2*10^4 classes, 1+1 steps, writes nothing

See benchmarks/README.md ("ANN head") for how to read the table.
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
from harness import (close_rank, cpu_model, git_rev, hwm_bytes, init_rank, load_average, mib,  # noqa: E402
                     parse_key_json, peak_reset_works, reset_peak, rss_bytes, spawn_ranks, usable_cores,
                     write_report)

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "ann_head.md")
LOSSES = {"arcface": {"type": "arcface", "scale": 64.0, "margin": 0.5}, "softmax": {"type": "softmax"}}
SGD = {"type": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4}
TARGET_SPEEDUP, TARGET_MEMORY = 5.0, 0.2


def variant_spec(name: str, rate: float, ann_overrides: dict) -> dict:
    """sampler config and update mode of a variant."""
    if name == "exact":
        return {"sampler": {"type": "full"}, "update": "dense"}
    if name == "uniform":
        return {"sampler": {"type": "uniform", "sample_rate": rate}, "update": "lazy"}
    if name == "ann":
        return {"sampler": dict({"type": "ann", "sample_rate": rate}, **ann_overrides), "update": "lazy"}
    raise ValueError(f"unknown variant {name!r}")


# ---------------------------------------------------------------------------- one rank
class _Timer:
    """Accumulates wall seconds of wrapped calls (benchmark-only instrumentation)."""

    def __init__(self):
        self.acc = {}

    def wrap(self, obj, attr: str, key: str) -> None:
        inner = getattr(obj, attr)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.acc[key] = self.acc.get(key, 0.0) + time.perf_counter() - t

        setattr(obj, attr, timed)

    def take(self) -> dict:
        out, self.acc = self.acc, {}
        return out


def _index_bytes(sampler) -> int:
    index = getattr(sampler, "index", None)
    if index is None:
        return 0
    names = ("projection", "centroids", "list_offsets", "list_ids", "list_codes", "position")
    return sum(t.numel() * t.element_size() for t in (getattr(index, n, None) for n in names) if t is not None)


def run_rank(rank: int, world: int, port: int, spec: dict) -> dict:
    torch = init_rank(rank, world, port, spec)
    import torch.distributed as dist

    import ds_xc

    try:
        local_batch, dim, classes = spec["batch"] // world, spec["dim"], spec["num_classes"]
        opt_cfg = dict(SGD, update=spec["update"])
        _prewarm(ds_xc, torch, spec, local_batch, opt_cfg)
        baseline = rss_bytes()
        head = ds_xc.ClassParallelHead(dim, classes, loss=LOSSES[spec["loss"]], sampler=spec["sampler"],
                                       chunk_size=spec["chunk"], update=spec["update"], check_inputs=False)
        opt = ds_xc.build_head_optimizer(head, opt_cfg)
        timer = _Timer()
        s = head.sampler
        for attr in ("_upkeep", "retrieve"):
            if hasattr(s, attr):
                timer.wrap(s, attr, attr.strip("_"))
        timer.wrap(s, "sample", "sample")
        build_s, build_cpu, build_extra = 0.0, 0.0, 0
        if hasattr(s, "rebuild"):  # the first build, timed and probed (before the momentum exists)
            dist.barrier()
            before = rss_bytes()
            reset_peak()
            c = resource.getrusage(resource.RUSAGE_SELF)
            t = time.perf_counter()
            head.rebuild_index()
            build_s = time.perf_counter() - t
            c1 = resource.getrusage(resource.RUSAGE_SELF)
            build_cpu = c1.ru_utime - c.ru_utime + c1.ru_stime - c.ru_stime
            build_extra = hwm_bytes() - before
        gen = torch.Generator().manual_seed(1000 + rank)  # same data for every variant

        def batch():
            x = torch.randn((local_batch, dim), generator=gen).requires_grad_(True)
            y = torch.randint(0, classes, (local_batch,), generator=gen)
            return x, y

        phase_peak = {"forward": 0, "backward": 0, "step": 0}
        losses, stats = [], []

        def step(probe: bool) -> dict:
            x, y = batch()
            dist.barrier()
            timer.take()
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
            if probe:
                phase_peak["step"] = max(phase_peak["step"], hwm_bytes() - baseline)
            losses.append(float(loss.detach()))
            stats.append(head.sampler_stats())
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            parts = timer.take()
            return {"total": t3 - t0, "forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2,
                    "cpu": r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime,
                    "sample": parts.get("sample", 0.0), "upkeep": parts.get("upkeep", 0.0),
                    "retrieve": parts.get("retrieve", 0.0)}

        for i in range(spec["warmup"]):  # the last warm-up step also records the peak of each phase
            step(probe=i == spec["warmup"] - 1)
        persistent = rss_bytes() - baseline
        reset_peak()
        timed = [step(probe=False) for _ in range(spec["steps"])]
        peak = hwm_bytes() - baseline
        med = {k: statistics.median(t[k] for t in timed) for k in timed[0]}
        totals = [t["total"] for t in timed]
        last = stats[-1] if stats else {}
        return {"rank": rank, "torch": torch.__version__, "num_local": head.num_local, "step_s": med["total"],
                "step_range": (min(totals), max(totals)), "phase_s": med, "persistent": persistent,
                "peak": peak, "phase_peak": phase_peak, "losses": losses, "build_s": build_s, "build_cpu": build_cpu,
                "build_extra": build_extra, "index_bytes": _index_bytes(s), "stats": last,
                "rebuild_interval": getattr(head.sampler_config, "rebuild_interval", 0),
                "weights": head.num_local * dim * 4}
    finally:
        close_rank()


def _prewarm(ds_xc, torch, spec: dict, local_batch: int, opt_cfg: dict) -> None:
    """One step of a tiny head through the same code path (same sampler type, so the Hamming
    op is loaded), so that code pages, thread pools and arenas are in the baseline."""
    import gc

    head = ds_xc.ClassParallelHead(spec["dim"], 4096, loss=LOSSES[spec["loss"]], sampler=spec["sampler"],
                                   chunk_size=spec["chunk"], update=spec["update"], check_inputs=False)
    opt = ds_xc.build_head_optimizer(head, opt_cfg)
    x = torch.randn((local_batch, spec["dim"])).requires_grad_(True)
    head(x, torch.randint(0, 4096, (local_batch,))).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    del head, opt, x
    gc.collect()


def summarise(spec: dict, ranks: list) -> dict:
    def mx(key):
        return max(r[key] for r in ranks)

    row = {k: spec[k] for k in ("world", "variant", "sampler", "update", "chunk")}
    row.update(num_local=mx("num_local"), step_s=mx("step_s"),
               step_range=max((r["step_range"] for r in ranks), key=lambda mm: mm[1]),
               phase_s={k: max(r["phase_s"][k] for r in ranks) for k in ranks[0]["phase_s"]},
               persistent=mx("persistent"), peak=mx("peak"),
               phase_peak={k: max(r["phase_peak"][k] for r in ranks) for k in ranks[0]["phase_peak"]},
               build_s=mx("build_s"), build_cpu=mx("build_cpu"), build_extra=mx("build_extra"), index_bytes=mx("index_bytes"),
               weights=mx("weights"), rebuild_interval=ranks[0]["rebuild_interval"],
               losses=ranks[0]["losses"], torch=ranks[0]["torch"], stats=ranks[0]["stats"])
    every = row["rebuild_interval"]
    row["amortised_s"] = row["step_s"] + (row["build_s"] / every if every else 0.0)
    row["amortised_cpu"] = row["phase_s"]["cpu"] + (row["build_cpu"] / every if every else 0.0)
    row["extra"] = row["peak"] - row["persistent"]  # peak above the persistent state
    row["peak_with_build"] = row["persistent"] + max(row["extra"], row["build_extra"])
    return row


def run_variant(args, world: int, name: str, sampler_overrides: dict | None = None, label: str | None = None) -> dict:
    """Spawn one configuration and summarise it (used by ann_groups.py too)."""
    v = variant_spec(name, args.sample_rate, dict(args.ann_overrides, **(sampler_overrides or {})))
    spec = dict(v, world=world, variant=label or name, num_classes=args.num_classes, dim=args.dim,
                batch=args.batch, loss=args.loss, chunk=args.chunk, steps=args.steps, warmup=args.warmup,
                threads=args.threads_1 if world == 1 else 1, timeout=args.timeout)
    load0 = load_average()
    t0 = time.perf_counter()
    row = summarise(spec, spawn_ranks(spec, run_rank))
    row["wall_s"], row["load"] = time.perf_counter() - t0, f"{load0} / {load_average()}"
    print(f"ranks={world} {row['variant']:>8}: step {row['step_s']:.2f} s (amortised {row['amortised_s']:.2f}), "
          f"build {row['build_s']:.1f} s, peak {mib(row['peak'])} MiB, above persistent {mib(row['extra'])} MiB, "
          f"load {row['load']} ({row['wall_s']:.0f} s)", flush=True)
    return row


def combine(runs: list) -> list:
    """One row per (world, variant) from its rounds: the round of smallest median step (the least
    disturbed by other jobs) represents it; every round's median is kept in ``rounds_s``."""
    out = []
    for key in dict.fromkeys((r["world"], r["variant"]) for r in runs):
        mine = [r for r in runs if (r["world"], r["variant"]) == key]
        best = dict(min(mine, key=lambda r: r["step_s"]))
        best["rounds_s"] = [r["step_s"] for r in mine]
        best["rounds_cpu"] = [r["phase_s"]["cpu"] for r in mine]
        best["load"] = "; ".join(r["load"] for r in mine)
        out.append(best)
    return out


# ---------------------------------------------------------------------------- report
def header(title: str, args, command: str, started: str, wall_s: float, hwm_ok: bool, torch_version: str) -> list:
    return [
        f"# {title}",
        "",
        f"- command: `{command}`",
        f"- date: {started} (wall time {wall_s:.0f} s)",
        f"- torch {torch_version}, python {platform.python_version()}, CPU: {cpu_model()}, "
        f"{usable_cores()} cores usable (os.cpu_count() = {os.cpu_count()}); load average (1/5/15 min) "
        f"at start / end of each configuration in the `load` column (other jobs share these cores)",
        f"- head: {args.num_classes:,} classes, d={args.dim}, global batch {args.batch}, float32, chunk_size "
        f"{args.chunk}, loss {json.dumps(LOSSES[args.loss])}, check_inputs off, SGD {json.dumps(SGD)} "
        f"(dense for exact, lazy for sampled)",
        f"- ANN sampler: {json.dumps(dict({'type': 'ann', 'sample_rate': args.sample_rate}, **args.ann_overrides))} "
        f"(other keys at their defaults in ds_xc/config.py)",
        f"- per configuration: fresh gloo group of spawned processes; threads = {args.threads_1} at 1 rank, "
        f"1 per rank otherwise; {args.warmup} warm-up + {args.steps} timed steps per round, {args.rounds} round(s); "
        "max over ranks of each rank's median",
        f"- ds_xc at git {git_rev()}",
        f"- VmHWM reset via /proc/self/clear_refs works here: {'yes' if hwm_ok else 'NO (peak is since process start)'}",
        "",
    ]


def speedups(r: dict, base: dict) -> dict:
    """Ratios of variant ``r`` against the exact row ``base`` of the same world size."""
    return {"wall": base["amortised_s"] / r["amortised_s"],
            "cpu": base["amortised_cpu"] / max(r["amortised_cpu"], 1e-9),
            "peak": r["peak"] / base["peak"], "extra": r["extra"] / max(base["extra"], 1),
            "with_build": r["peak_with_build"] / base["peak"]}


def render(rows: list, args, command: str, started: str, wall_s: float, hwm_ok: bool) -> str:
    lines = header("ANN-sampled head vs exact chunked head", args, command, started, wall_s, hwm_ok,
                   rows[0]["torch"])
    lines += [
        "Step = forward (sampler included) + backward + optimizer step + zero_grad; `amortised` adds "
        "index build / rebuild_interval (wall and CPU). `step s` is the median over the timed steps of the round "
        f"with the smallest median ({args.rounds} rounds, all variants once per round; every round's median in "
        "`rounds`); `cpu s` = user + sys CPU seconds of the rank per step (max over ranks), which other jobs "
        "disturb less than wall time. Memory in MiB above the rank's RSS before the head was built: "
        "`persistent` = after warm-up (weights + momentum + ANN index), `peak` = VmHWM over the timed steps, "
        "`above pers.` = peak - persistent (per-step memory). Ratios are variant / exact of the same world "
        f"size. Targets: speed-up >= {TARGET_SPEEDUP:g}, peak ratio <= {TARGET_MEMORY:g}.",
        "",
        "| ranks | variant | C_local | step s (min-max) | rounds | amortised s | speed-up | cpu s | speed-up (cpu) "
        "| >= 5x | persistent | peak | peak ratio | above pers. | ratio above pers. | <= 0.2x (above pers.) | load |",
        "|---:|---|---:|---:|---|---:|---:|---:|---:|:---:|---:|---:|---:|---:|---:|:---:|---|",
    ]
    for r in rows:
        base = next((b for b in rows if b["world"] == r["world"] and b["variant"] == "exact"), None)
        if base is not None and r is not base:
            x = speedups(r, base)
            ok = "yes" if min(x["wall"], x["cpu"]) >= TARGET_SPEEDUP else (
                "wall only" if x["wall"] >= TARGET_SPEEDUP else "cpu only" if x["cpu"] >= TARGET_SPEEDUP else "**no**")
            okm = "yes" if x["extra"] <= TARGET_MEMORY else "**no**"
            cells = [f"{x['wall']:.2f}", f"{x['cpu']:.2f}", ok, f"{x['peak']:.2f}", f"{x['extra']:.2f}", okm]
        else:
            cells = ["1.00", "1.00", "-", "1.00", "1.00", "-"]
        rounds = "/".join(f"{v:.2f}" for v in r["rounds_s"])
        lines.append(
            f"| {r['world']} | {r['variant']} | {r['num_local']:,} | {r['step_s']:.2f} ({r['step_range'][0]:.2f}-"
            f"{r['step_range'][1]:.2f}) | {rounds} | {r['amortised_s']:.2f} | {cells[0]} | {r['amortised_cpu']:.2f} | "
            f"{cells[1]} | {cells[2]} | {mib(r['persistent'])} | {mib(r['peak'])} | {cells[3]} | {mib(r['extra'])} | "
            f"{cells[4]} | {cells[5]} | {r['load']} |")
    lines += [
        "",
        "Index upkeep and memory of the sampled variants: `build s` / `build cpu s` = one full index build "
        "(k-means + lists + every code; amortised over rebuild_interval steps above); `build above pers.` = "
        "its peak above the RSS before it; `peak incl. build` = persistent + max(per-step extra, build extra), "
        "the total peak of a step that also rebuilds, and its ratio to the exact peak; `index` = the index's "
        "tensors (codes, ids, positions, centroids, projection).",
        "",
        "| ranks | variant | build s | build cpu s | rebuild_interval | build above pers. | ratio build / exact above pers. "
        "| peak incl. build | ratio incl. build | index MiB |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        base = next((b for b in rows if b["world"] == r["world"] and b["variant"] == "exact"), None)
        if r["variant"] == "exact" or base is None or not r["build_s"]:
            continue
        lines.append(
            f"| {r['world']} | {r['variant']} | {r['build_s']:.1f} | {r['build_cpu']:.1f} | {r['rebuild_interval']} | "
            f"{mib(r['build_extra'])} | {r['build_extra'] / max(base['extra'], 1):.2f} | {mib(r['peak_with_build'])} | "
            f"{r['peak_with_build'] / base['peak']:.2f} | {mib(r['index_bytes'])} |")
    lines += [
        "",
        "Where the time goes (median seconds of the representative round, max over ranks): `sample` is the "
        "whole sampler call inside the forward (`upkeep`: re-encoding the rows changed by the last step; "
        "`retrieve`: probe + Hamming scan + exact re-rank; the rest is active-set assembly); `loss` = forward - "
        "sample (gather of the active rows + fused chunked loss). Peaks per phase (MiB above baseline) from the "
        "last warm-up step. Counts of the last step on rank 0. W = weights of the shard in MiB.",
        "",
        "| ranks | variant | W | forward s | sample s | upkeep s | retrieve s | loss s | backward s | step s | "
        "peak forward | peak backward | peak step | active | retrieved | kept | cut | fill | loss step 1 |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        t, p, st = r["phase_s"], r["phase_peak"], r["stats"]
        cnt = [str(st.get(k, "-")) for k in ("active", "retrieved", "kept", "cut", "fill")]
        lines.append(
            f"| {r['world']} | {r['variant']} | {mib(r['weights'])} | {t['forward']:.2f} | {t['sample']:.2f} | "
            f"{t['upkeep']:.2f} | {t['retrieve']:.2f} | {t['forward'] - t['sample']:.2f} | {t['backward']:.3f} | "
            f"{t['step']:.2f} | {mib(p['forward'])} | {mib(p['backward'])} | {mib(p['step'])} | "
            + " | ".join(cnt) + f" | {r['losses'][0]:.4f} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- main
def add_common_args(p, smoke_classes: int = 20_000) -> None:
    p.add_argument("--num_classes", type=int, default=None, help=f"classes C (default 10^6; --smoke: {smoke_classes})")
    p.add_argument("--dim", type=int, default=128, help="embedding dim d")
    p.add_argument("--batch", type=int, default=512, help="global batch N (split evenly over the ranks)")
    p.add_argument("--sample_rate", type=float, default=0.1, help="sample rate of the sampled heads")
    p.add_argument("--ann", action="append", default=[], metavar="KEY=JSON",
                   help="override an ann sampler key, e.g. --ann nprobe=16 (repeatable)")
    p.add_argument("--chunk", type=int, default=128, help="chunk_size of every variant (configs/text_exact_20k.json: 128)")
    p.add_argument("--worlds", type=str, default="1,2", help="comma-separated world sizes")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 4; --smoke: 1)")
    p.add_argument("--warmup", type=int, default=None, choices=(1, 2),
                   help="warm-up steps; the last one probes the peak of each phase (default 2; --smoke: 1)")
    p.add_argument("--loss", choices=sorted(LOSSES), default="arcface",
                   help="arcface (s=64, m=0.5; ANN metric cosine) or softmax (ANN metric dot)")
    p.add_argument("--threads_1", type=int, default=1,
                   help="torch/OMP threads of the 1-rank run (2-rank runs: 1 per rank); 1 by default because on "
                        "a shared 2-core machine 2-thread processes were erratic (see the README)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of all variants (default 2; --smoke: 1)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds allowed per configuration")
    p.add_argument("--smoke", action="store_true", help="tiny run, nothing written")


def finish_args(p, args, default_out: str, smoke_classes: int = 20_000):
    if args.num_classes is None:
        args.num_classes = smoke_classes if args.smoke else 1_000_000
    if args.warmup is None:
        args.warmup = 1 if args.smoke else 2
    if args.steps is None:
        args.steps = 1 if args.smoke else 4
    if getattr(args, "rounds", None) is None:
        args.rounds = 1 if args.smoke else 2
    if args.out is None:
        args.out = "-" if args.smoke else default_out
    args.world_list = [int(w) for w in args.worlds.split(",") if w.strip()]
    if any(args.batch % w for w in args.world_list):
        p.error(f"--batch {args.batch} must split evenly over every world size in {args.world_list}")
    args.ann_overrides = parse_key_json(args.ann, "--ann", p.error)
    return args


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_common_args(p)
    p.add_argument("--variants", type=str, default="exact,ann,uniform",
                   help="comma-separated variants (exact is the baseline of the ratios)")
    p.add_argument("--out", type=str, default=None,
                   help=f"markdown results file (default {os.path.relpath(DEFAULT_OUT)}; '-' for none)")
    args = finish_args(p, p.parse_args(argv), DEFAULT_OUT)
    args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()]
    return args


def main(argv=None) -> list:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    command = " ".join(shlex.quote(a) for a in ["python", "benchmarks/ann_head.py", *argv])
    started = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    hwm_ok = peak_reset_works()
    t_start = time.perf_counter()
    runs = [run_variant(args, world, name) for _ in range(args.rounds)
            for world in args.world_list for name in args.variant_list]
    rows = combine(runs)
    report = render(rows, args, command, started, time.perf_counter() - t_start, hwm_ok)
    print(report)
    write_report(args.out, report)
    return rows


if __name__ == "__main__":
    main()

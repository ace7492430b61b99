"""Benchmark: ds_xc's exact, uniform and ANN heads against a Partial-FC-equivalent head, side by side.

The peer is benchmarks/pfc_reference.py (InsightFace's PartialFC_V2 written from its
algorithm, arXiv 2203.15565): a dense (C_local, d) shard, sampled sub-weight (positives +
uniform negatives) at ``--sample_rate``, materialised (N, K) logits, distributed softmax
cross-entropy, ``torch.optim.SGD`` (lr 0.1, momentum 0.9, weight decay 5e-4) stepping the
whole shard densely, as its users run it. Variants:

* ``pfc``: that head at ``--sample_rate``; ``pfc_full``: at 1.0 (its full softmax);
* ``exact``, ``uniform``, ``ann``: ``ds_xc.ClassParallelHead`` from an ``extreme_classification``
  section at library defaults: the sampler names only ``type`` (and ``sample_rate``), the
  optimizer names SGD's hyper-parameters (the same as pfc's) but not ``update``, unless
  ``--update`` forces one for the sampled heads; ``chunk_size`` is ``--chunk``.

Per world size one group of spawned gloo ranks (benchmarks/harness.py), one torch thread per
rank; inside those processes every variant runs in turn, once per round: built (every variant
from the same initial weights, ds_xc's ``init_shard``), its ANN index built once and timed,
warm-up steps, timed steps, freed. The same batches for every variant (fresh random
embeddings as a leaf tensor, uniform labels). Step = forward (sampler included) + backward +
optimizer step + ``zero_grad(set_to_none=True)``. Per variant: the median of the rank's timed
steps over all rounds, max over ranks; CPU seconds (user + sys) per step likewise; the ANN
index build amortised as build_s / rebuild_interval. Ratios: ds_xc variant / its peer
(exact / pfc_full, uniform and ann / pfc). Target (issue 16): ann <= 0.35 x pfc at 1 and 2 ranks.

    python benchmarks/peer_compare.py                           # 10^6 classes, d=128, N=512, 1 and 2 ranks
    python benchmarks/peer_compare.py --num_classes 200000 --out /tmp/peer.md   # a trial size
    python benchmarks/peer_compare.py --smoke                   # tiny, seconds, writes nothing
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/harness.py
from ann_head import LOSSES as ANN_LOSSES, SGD  # noqa: E402
from harness import (close_rank, cpu_model, cpu_seconds, git_rev, hwm_bytes, init_rank, load_average, mib,  # noqa: E402
                     release_free_memory, reset_peak, rss_bytes, spawn_ranks, timed_index_build, usable_cores,
                     write_report)

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "peer_compare.md")
LOSSES = {"arcface": ANN_LOSSES["arcface"], "cosface": {"type": "cosface", "scale": 64.0, "margin": 0.4}}
VARIANTS = ("pfc", "pfc_full", "exact", "uniform", "ann")
PEER = {"exact": "pfc_full", "uniform": "pfc", "ann": "pfc"}  # the ratio's denominator
SAMPLED = ("uniform", "ann")
TARGET_ANN = 0.35  # issue 16: ann@0.1 step <= 0.35 x pfc@0.1
ISSUE_SIZES = {"num_classes": 1_000_000, "dim": 128, "batch": 512, "sample_rate": 0.1}
REV_PATHS = ("ds_xc", "ops", "benchmarks", ":(exclude)benchmarks/results")  # what the measurement runs


def head_section(spec: dict, name: str) -> dict:
    """The ``extreme_classification`` section of a ds_xc variant."""
    sampler = {"type": "full"} if name == "exact" else {"type": name, "sample_rate": spec["sample_rate"]}
    optimizer = dict(SGD)
    if spec["update"] and name in SAMPLED:
        optimizer["update"] = spec["update"]
    chunk = spec["chunk"] if name == "exact" else spec["sampled_chunk"]
    return {"num_classes": spec["num_classes"], "embedding_dim": spec["dim"], "loss": LOSSES[spec["loss"]],
            "sampler": sampler, **({"chunk_size": chunk} if chunk else {}), "optimizer": optimizer}


# ---------------------------------------------------------------------------- one rank
def build(spec: dict, name: str, rank: int, world: int):
    """(module, optimizer, facts) of one variant on this rank."""
    import torch

    import ds_xc
    from ds_xc.head import init_shard, shard_range
    from pfc_reference import PartialFCReference

    if name in PEER:  # a ds_xc head
        c = ds_xc.parse_config({"extreme_classification": head_section(spec, name)}).extreme_classification
        head = ds_xc.ClassParallelHead.from_config(c)
        return head, ds_xc.build_head_optimizer(head, c.optimizer), {"update": head.update}
    defaults = ds_xc.parse_config({"extreme_classification": head_section(spec, "exact")}).extreme_classification
    start, count = shard_range(spec["num_classes"], world, rank)
    w0 = init_shard(spec["num_classes"], spec["dim"], start, count, defaults.init_std, defaults.seed)
    rate = 1.0 if name == "pfc_full" else spec["sample_rate"]
    pfc = PartialFCReference(spec["dim"], spec["num_classes"], LOSSES[spec["loss"]], sample_rate=rate, weight=w0,
                             seed=defaults.seed)
    opt = torch.optim.SGD(pfc.parameters(), lr=SGD["lr"], momentum=SGD["momentum"], weight_decay=SGD["weight_decay"])
    return pfc, opt, {"update": "dense (torch.optim.SGD)"}


def _active(module) -> int:
    """Active classes of this shard in the last step."""
    if hasattr(module, "last_index"):  # the PFC reference
        return module.num_local if module.last_index is None else int(module.last_index.numel())
    index = module.last_active.union() if module.last_active is not None else None
    return module.num_local if index is None else int(index.numel())


def run_one(spec: dict, name: str, rank: int, world: int, steps: int, warmup: int) -> dict:
    """Build one variant, warm it up, time its steps, free it."""
    import torch
    import torch.distributed as dist

    release_free_memory()  # what earlier variants freed is not reused below the baseline
    baseline = rss_bytes()
    reset_peak()
    load0 = load_average()
    module, opt, facts = build(spec, name, rank, world)
    build_s, build_cpu, _ = timed_index_build(module) if name in PEER else (0.0, 0.0, 0)  # ann: the index
    local_batch = spec["batch"] // world
    gen = torch.Generator().manual_seed(1000 + rank)  # the same batches for every variant
    losses, walls, cpus = [], [], []
    for i in range(warmup + steps):
        x = torch.randn((local_batch, spec["dim"]), generator=gen).requires_grad_(True)
        y = torch.randint(0, spec["num_classes"], (local_batch,), generator=gen)
        dist.barrier()
        c0, t0 = cpu_seconds(), time.perf_counter()
        loss = module(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t1, c1 = time.perf_counter(), cpu_seconds()
        losses.append(float(loss.detach()))
        if i >= warmup:
            walls.append(t1 - t0)
            cpus.append(c1 - c0)
    out = dict(facts, walls=walls, cpus=cpus, losses=losses, build_s=build_s, build_cpu=build_cpu,
               rebuild_interval=getattr(getattr(module, "sampler_config", None), "rebuild_interval", 0),
               num_local=module.num_local, active=_active(module), peak=hwm_bytes() - baseline,
               load=f"{load0} / {load_average()}")
    del module, opt, x, loss
    release_free_memory()
    return out


def run_rank(rank: int, world: int, port: int, spec: dict) -> dict:
    """Every variant in turn, ``rounds`` times, in this rank's process; after one tiny step of each
    (code, thread pools and the Hamming op loaded before anything is timed)."""
    torch = init_rank(rank, world, port, spec)
    try:
        tiny = dict(spec, num_classes=min(4096, spec["num_classes"]))
        for name in spec["variants"]:
            run_one(tiny, name, rank, world, steps=1, warmup=0)
        runs = {name: [] for name in spec["variants"]}
        for _ in range(spec["rounds"]):
            for name in spec["variants"]:
                runs[name].append(run_one(spec, name, rank, world, spec["steps"], spec["warmup"]))
        return {"rank": rank, "torch": torch.__version__, "runs": runs}
    finally:
        close_rank()


# ---------------------------------------------------------------------------- summary
def summarise(world: int, ranks: list, variants: list) -> list:
    """One row per variant: medians per rank over every timed step of every round, max over ranks."""
    rows = []
    for name in variants:
        per_rank = [r["runs"][name] for r in ranks]  # ranks x rounds
        walls = [[w for run in runs for w in run["walls"]] for runs in per_rank]
        cpus = [[c for run in runs for c in run["cpus"]] for runs in per_rank]
        first = per_rank[0][0]
        row = {"world": world, "variant": name, "update": first["update"], "torch": ranks[0]["torch"],
               "num_local": max(runs[0]["num_local"] for runs in per_rank),
               "active": max(runs[-1]["active"] for runs in per_rank),
               "step_s": max(statistics.median(w) for w in walls),
               "step_range": (min(min(w) for w in walls), max(max(w) for w in walls)),
               "cpu_s": max(statistics.median(c) for c in cpus),
               "rounds_s": [max(statistics.median(runs[i]["walls"]) for runs in per_rank)
                            for i in range(len(per_rank[0]))],
               "build_s": max(statistics.median(run["build_s"] for run in runs) for runs in per_rank),
               "build_cpu": max(statistics.median(run["build_cpu"] for run in runs) for runs in per_rank),
               "rebuild_interval": first["rebuild_interval"], "losses": first["losses"],
               "peak": max(run["peak"] for runs in per_rank for run in runs),
               "load": "; ".join(run["load"] for run in per_rank[0])}
        every = row["rebuild_interval"]
        row["amortised_s"] = row["step_s"] + (row["build_s"] / every if every else 0.0)
        row["amortised_cpu"] = row["cpu_s"] + (row["build_cpu"] / every if every else 0.0)
        rows.append(row)
    return rows


def ratios(rows: list) -> None:
    """Add each ds_xc row's ratio to its peer row of the same world size (wall and CPU)."""
    for r in rows:
        peer = next((p for p in rows if p["world"] == r["world"] and p["variant"] == PEER.get(r["variant"])), None)
        r["peer"] = peer["variant"] if peer else None
        r["ratio"] = r["amortised_s"] / peer["amortised_s"] if peer else None
        r["ratio_cpu"] = r["amortised_cpu"] / max(peer["amortised_cpu"], 1e-9) if peer else None
        r["loss_gap"] = None
        if peer and r["variant"] == "exact":  # the same weights, data and optimizer: the same losses
            r["loss_gap"] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["losses"], peer["losses"]))


def verdict(r: dict) -> str:
    """The issue's target for an ann row: 'yes' when wall and CPU ratios both meet it."""
    if r["variant"] != "ann" or r["ratio"] is None:
        return "-"
    wall, cpu = r["ratio"] <= TARGET_ANN, r["ratio_cpu"] <= TARGET_ANN
    return "yes" if wall and cpu else "wall only" if wall else "cpu only" if cpu else "**no**"


# ---------------------------------------------------------------------------- report
def header(args, command: str, started: str, wall_s: float, load0: str, torch_version: str) -> list:
    sizes = {"num_classes": args.num_classes, "dim": args.dim, "batch": args.batch, "sample_rate": args.sample_rate}
    trial = sizes != ISSUE_SIZES or args.smoke
    sampled = {"type": "ann", "sample_rate": args.sample_rate}
    rev = git_rev(REV_PATHS)  # lists the uncommitted files under those paths, if any
    return [
        "# Peer comparison: ds_xc heads vs a Partial-FC-equivalent head",
        "",
        *([f"**Trial run at other sizes than the issue's ({json.dumps(ISSUE_SIZES)}): not the recorded result.**",
           ""] if trial else []),
        f"- command: `{command}`",
        f"- date: {started} (wall time {wall_s:.0f} s); load average (1/5/15 min) at the start {load0}, "
        f"at the end {load_average()}; per variant and round (rank 0, start / end) in the `load` column",
        f"- torch {torch_version}, python {platform.python_version()}, CPU: {cpu_model()}, {usable_cores()} cores "
        f"usable (os.cpu_count() = {os.cpu_count()}); one torch thread per rank",
        f"- git {rev}" + ("" if "uncommitted" in rev else " (no uncommitted files under ds_xc/, ops/, benchmarks/)"),
        f"- head: {args.num_classes:,} classes, d={args.dim}, global batch {args.batch} (split evenly), float32, "
        f"loss {json.dumps(LOSSES[args.loss])} for every variant",
        f"- ds_xc variants: `ClassParallelHead.from_config` of {{num_classes, embedding_dim, loss, sampler, "
        f"chunk_size: {args.chunk} (exact; uniform and ann: "
        + (f"{args.sampled_chunk}" if args.sampled_chunk else "not named, the library default: one chunk")
        + f"), optimizer: {json.dumps(SGD)}"
        + (f" + update {args.update!r} for uniform and ann" if args.update else " (update not named: the library "
           "default, in the `update` column)")
        + f"}}; sampler {{\"type\": \"full\"}}, or {json.dumps(sampled)} (uniform likewise): other keys at "
        "their defaults in ds_xc/config.py; check_inputs at its default (on)",
        f"- Partial-FC-equivalent (benchmarks/pfc_reference.py): sample_rate {args.sample_rate} (`pfc`) and 1.0 "
        f"(`pfc_full`), dense Parameter shard, torch.optim.SGD(lr {SGD['lr']}, momentum {SGD['momentum']}, "
        f"weight_decay {SGD['weight_decay']}) on the whole shard; the same initial weights as ds_xc's heads",
        f"- per world size: one group of spawned gloo ranks; every variant in turn in the same processes, "
        f"{args.rounds} round(s) of all variants, each {args.warmup} warm-up + {args.steps} timed steps (same "
        "batches for every variant); `step s` = median of a rank's timed steps over all rounds, max over ranks",
        "",
    ]


def render(rows: list, args, command: str, started: str, wall_s: float, load0: str) -> str:
    lines = header(args, command, started, wall_s, load0, rows[0]["torch"])
    lines += [
        "Step = forward (sampler included) + backward + optimizer step + zero_grad. `amortised` adds the ANN "
        "index build / rebuild_interval (wall and CPU; the early rebuilds of rebuild_warmup are not counted). "
        "`cpu s` = user + sys CPU seconds of a rank per step (median, max over ranks), which other jobs disturb "
        "less than wall time. `ratio` = amortised step of the ds_xc variant / its peer of the same world size "
        f"(`vs`). Target (issue 16): ann / pfc <= {TARGET_ANN:g} at every world size (wall and CPU: `yes`). "
        "`K` = active classes of the shard in the last step; `peak` = VmHWM above the RSS before the variant "
        "was built, MiB (max over ranks and rounds); `loss 1` = first step's loss (rank 0).",
        "",
        "| ranks | variant | update | C_local | K | step s (min-max) | rounds | amortised s | cpu s | vs | ratio "
        f"| ratio (cpu) | <= {TARGET_ANN:g}x pfc | peak | loss 1 | load |",
        "|---:|---|---|---:|---:|---:|---|---:|---:|---|---:|---:|:---:|---:|---:|---|",
    ]
    for r in rows:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        ratio_cpu = f"{r['ratio_cpu']:.2f}" if r["ratio_cpu"] is not None else "-"
        rounds = "/".join(f"{v:.2f}" for v in r["rounds_s"])
        lines.append(
            f"| {r['world']} | {r['variant']} | {r['update']} | {r['num_local']:,} | {r['active']:,} | "
            f"{r['step_s']:.3f} ({r['step_range'][0]:.3f}-{r['step_range'][1]:.3f}) | {rounds} | "
            f"{r['amortised_s']:.3f} | {r['amortised_cpu']:.3f} | {r['peer'] or '-'} | {ratio} | {ratio_cpu} | "
            f"{verdict(r)} | {mib(r['peak'])} | {r['losses'][0]:.4f} | {r['load']} |")
    worlds = sorted({r["world"] for r in rows})
    lines += ["", "Targets and ratios per world size (wall; CPU in brackets):", "",
              "| ratio | target | " + " | ".join(f"ranks={w}" for w in worlds) + " |",
              "|---|---|" + "---|" * len(worlds)]
    for variant, target in (("ann", f"<= {TARGET_ANN:g}"), ("uniform", "(shown)"), ("exact", "(shown)")):
        cells = []
        for w in worlds:
            r = next((x for x in rows if x["world"] == w and x["variant"] == variant and x["ratio"] is not None), None)
            ok = f" {verdict(r)}" if r is not None and variant == "ann" else ""
            cells.append(f"{r['ratio']:.2f} ({r['ratio_cpu']:.2f}){ok}" if r is not None else "-")
        lines.append(f"| {variant} / {PEER[variant]} | {target} | " + " | ".join(cells) + " |")
    gaps = [f"ranks={r['world']}: {r['loss_gap']:.1e}" for r in rows if r["loss_gap"] is not None]
    builds = [f"ranks={r['world']}: {r['build_s']:.2f} s ({r['build_cpu']:.2f} CPU s), rebuild_interval "
              f"{r['rebuild_interval']}" for r in rows if r["build_s"]]
    lines += ["", "Checks: largest relative difference of the per-step losses of `exact` and `pfc_full` (the same "
              "weights, batches and SGD; float32 and chunking apart, the same computation): "
              + ("; ".join(gaps) or "-") + ". ANN index build (median over rounds, max over ranks): "
              + ("; ".join(builds) or "-") + "."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--num_classes", type=int, default=None, help="classes C (default 10^6; --smoke: 8,192)")
    p.add_argument("--dim", type=int, default=128, help="embedding dim d")
    p.add_argument("--batch", type=int, default=512, help="global batch N (split evenly over the ranks)")
    p.add_argument("--sample_rate", type=float, default=0.1, help="sample rate of pfc, uniform and ann")
    p.add_argument("--loss", choices=sorted(LOSSES), default="arcface", help="margin of every variant (s=64)")
    p.add_argument("--chunk", type=int, default=128, help="chunk_size of the exact ds_xc head (configs/default.json)")
    p.add_argument("--sampled_chunk", type=int, default=0, help="chunk_size of the uniform and ann heads (0: not "
                   "named, the library default: the global batch in one chunk)")
    p.add_argument("--update", choices=("dense", "lazy", "frozen", "lazy_exact"), default=None,
                   help="force optimizer.update of the uniform and ann heads (default: not named, the library's)")
    p.add_argument("--variants", type=str, default=",".join(VARIANTS),
                   help="comma-separated, from " + ", ".join(VARIANTS))
    p.add_argument("--worlds", type=str, default="1,2", help="comma-separated world sizes")
    p.add_argument("--steps", type=int, default=None, help="timed steps per variant and round (default 4; --smoke: 1)")
    p.add_argument("--warmup", type=int, default=None,
                   help="warm-up steps per variant and round (default 2; --smoke: 1)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of all variants (default 2; --smoke: 1)")
    p.add_argument("--timeout", type=int, default=3600, help="seconds allowed per world size")
    p.add_argument("--out", type=str, default=None,
                   help=f"markdown results file (default {os.path.relpath(DEFAULT_OUT)}; '-': print only)")
    p.add_argument("--smoke", action="store_true", help="tiny run, nothing written")
    args = p.parse_args(argv)
    smoke = args.smoke
    args.num_classes = args.num_classes or (8192 if smoke else 1_000_000)
    args.steps = args.steps or (1 if smoke else 4)
    args.warmup = args.warmup if args.warmup is not None else (1 if smoke else 2)
    args.rounds = args.rounds or (1 if smoke else 2)
    args.out = args.out or ("-" if smoke else DEFAULT_OUT)
    args.world_list = [int(w) for w in args.worlds.split(",") if w.strip()]
    args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(args.variant_list) - set(VARIANTS))
    if unknown:
        p.error(f"--variants: unknown {unknown}; allowed: {', '.join(VARIANTS)}")
    if any(w < 1 or args.batch % w for w in args.world_list):
        p.error(f"--worlds {args.worlds}: every world size must be >= 1 and divide --batch {args.batch}")
    if min(args.steps, args.rounds) < 1 or args.warmup < 0:
        p.error(f"--steps {args.steps} and --rounds {args.rounds} must be >= 1, --warmup {args.warmup} >= 0")
    return args


def main(argv=None) -> list:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    command = " ".join(shlex.quote(a) for a in ["python", "benchmarks/peer_compare.py", *argv])
    started = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    load0, t_start, rows = load_average(), time.perf_counter(), []
    for world in args.world_list:
        spec = {"world": world, "threads": 1, "timeout": args.timeout, "variants": args.variant_list,
                "num_classes": args.num_classes, "dim": args.dim, "batch": args.batch, "loss": args.loss,
                "sample_rate": args.sample_rate, "chunk": args.chunk, "sampled_chunk": args.sampled_chunk,
                "update": args.update,
                "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds}
        t = time.perf_counter()
        mine = summarise(world, spawn_ranks(spec, run_rank), args.variant_list)
        print(f"ranks={world}: " + ", ".join(f"{r['variant']} {r['amortised_s']:.3f} s" for r in mine)
              + f" ({time.perf_counter() - t:.0f} s)", flush=True)
        rows += mine
    ratios(rows)
    report = render(rows, args, command, started, time.perf_counter() - t_start, load0)
    print(report)
    write_report(args.out, report)
    return rows


if __name__ == "__main__":
    main()

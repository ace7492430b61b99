"""Benchmark: compressed vs dense reduction over an emulated slow network (needs root).

Two ranks run in two network namespaces joined by a veth pair shaped with tc tbf
(benchmarks/netns.sh; default 1 Gbit/s), side by side for each variant:

A. reduction only (benchmarks/compression_wire.py): one fake ``--wire_n``-element fp32
   gradient per step, ``reduce_gradients()`` timed alone; the bytes the wrapper counted vs
   the bytes the kernel counted on the veth (TCP/IP headers, rendezvous and barriers
   included), which checks the byte model of ds_xc/compression/transport.py;
B. end to end (benchmarks/compression_train.py): launch/train.py's job on
   ``--config`` (backbone + class-parallel head), median step time. The head's own
   traffic (feature all-gather, gradient reduce-scatter) crosses the same link.

    sudo python benchmarks/compression_netns.py                  # writes benchmarks/results/compression_netns.md
    sudo python benchmarks/compression_netns.py --rate 100mbit --steps 20 --out -
    sudo python benchmarks/compression_netns.py --rate 100mbit --skip wire --variants dense,bayes_prior \
        --zero_stages 0,1 --out benchmarks/results/compression_netns_zero1.md   # B under ZeRO-0 and ZeRO-1

With ``--zero_stages 0,1`` part B runs every variant at each DeepSpeed ZeRO stage and adds a table of
what ZeRO-1 adds to each step (its parameter all-gather, paid compressed or not) next to the cost
model's all-gather time (ds_xc/cost/compression.py).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/harness.py
from harness import git_rev  # noqa: E402
NETNS = os.path.join(ROOT, "benchmarks", "netns.sh")
NETNS_HOSTS = os.path.join(ROOT, "benchmarks", "netns_hosts.sh")
DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "compression_netns.md")
# name -> (method for the wire run, method for the train run, extra keys)
VARIANTS = {"dense": ("none", "dense", {}), "bayes_prior": ("bayes_prior", "bayes_prior", {}),
            "topk": ("topk", "topk", {}), "randomk": ("randomk", "randomk", {})}


def in_namespaces(script: str, argv: list[str], rate: str, port: int, timeout: float,
                  ranks: int = 2) -> tuple[dict, dict]:
    """Run ``script`` as ``ranks`` ranks, one per network namespace, 1 thread each; return (rank 0's JSON,
    veth counters: ``tx_bytes`` per rank). 2 ranks: netns.sh's veth pair; more: netns_hosts.sh's hosts of
    one rank each on a switch, every host's link shaped at ``rate`` in both directions."""
    with tempfile.TemporaryDirectory() as tmp:
        out, counters = os.path.join(tmp, "out.json"), os.path.join(tmp, "counters.json")
        if ranks == 2:  # netns.sh sets the launcher variables
            netns, rank_env = [NETNS, "-p", str(port)], []
        else:  # rank = host; netns_hosts.sh exports MASTER_ADDR and GLOO_SOCKET_IFNAME
            netns = [NETNS_HOSTS, "-H", str(ranks)]
            rank_env = ["RANK={node}", "LOCAL_RANK=0", "WORLD_SIZE={nnodes}", "LOCAL_WORLD_SIZE=1",
                        f"MASTER_PORT={port}"]
        cmd = [*netns, "-r", rate, "-c", counters, "--", "env", "OMP_NUM_THREADS=1", *rank_env,
               sys.executable, os.path.join(ROOT, "benchmarks", script), *argv, "--out", out]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if proc.returncode and not (os.path.exists(out) and os.path.exists(counters)):
            raise RuntimeError(f"{shlex.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
                               f"{proc.stderr[-4000:]}")
        if proc.returncode:  # rank 0 writes its result after the last collective: only the exit failed
            print(f"warning: {script} {' '.join(argv[:4])} ... exited {proc.returncode} after writing its "
                  f"result (kept):\n{proc.stderr[-600:]}", file=sys.stderr, flush=True)
        with open(out) as fh, open(counters) as fc:
            return json.load(fh), json.load(fc)


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", default="1gbit", help="tc tbf rate of both veth ends ('none': unshaped)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--wire_n", type=int, default=10**7)
    p.add_argument("--wire_steps", type=int, default=12)
    p.add_argument("--config", default="configs/text_exact_20k.json")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--skip", default="", help="'wire' or 'train' to leave a part out")
    p.add_argument("--zero_stages", default="0", help="B: zero_optimization.stage values, comma-separated (0, 1)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default=DEFAULT_OUT)
    args = p.parse_args(argv)
    command = "sudo python benchmarks/compression_netns.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    started, t0, port = datetime.datetime.now().isoformat(timespec="seconds"), time.time(), 29555
    wire, train = [], []
    for name in args.variants.split(","):
        wire_method, train_method, extra = VARIANTS[name]
        if "wire" not in args.skip:
            port += 1
            res, ctr = in_namespaces("compression_wire.py", [
                "--n", str(args.wire_n), "--method", wire_method, "--density", str(args.density),
                "--steps", str(args.wire_steps), "--compression", json.dumps(extra)], args.rate, port, args.timeout)
            wire.append((name, res, ctr))
            print(f"wire {name}: {res['reduce_s'] * 1e3:.1f} ms, counted {res['stats']['bytes_sent']:,} B, "
                  f"veth {ctr['tx_bytes'][0]:,} B", flush=True)
        for stage in ([] if "train" in args.skip else [int(z) for z in args.zero_stages.split(",")]):
            port += 1
            res, ctr = in_namespaces("compression_train.py", [
                "--config", os.path.join(ROOT, args.config), "--method", train_method, "--density",
                str(args.density), "--steps", str(args.steps), "--compression", json.dumps(extra),
                "--zero_stage", str(stage)], args.rate, port, args.timeout)
            res["zero_stage"] = stage
            train.append((name, res, ctr))
            print(f"train {name} ZeRO {stage}: {res['step_s']:.3f} s/step, veth {ctr['tx_bytes'][0]:,} B", flush=True)
    report = render(args, command, started, time.time() - t0, wire, train)
    print(report)
    if args.out != "-":
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as fh:
            fh.write(report + "\n")
    return report


def render(args, command, started, wall, wire, train) -> str:
    load = os.getloadavg()
    lines = [f"# Compressed vs dense reduction over an emulated {args.rate} link (2 ranks, 2 namespaces)\n",
             f"- command: `{command}`", f"- date: {started}, wall time {wall / 60:.1f} min; "
             f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average "
             f"{load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} (shared machine: compare rows of one run)",
             f"- ds_xc at git {git_rev(('ds_xc', 'benchmarks'))}",
             f"- link: veth pair, `tc qdisc replace dev VETH root tbf rate {args.rate} burst 128kb latency 50ms` "
             "on both ends (benchmarks/netns.sh); 1 thread per rank; density "
             f"{args.density}, error feedback on\n"]
    if wire:
        base = next((r for n, r, _ in wire if n == "dense"), None)
        lines += [f"## A. Reduction only: {args.wire_n:,}-element fp32 gradient, {args.wire_steps} steps\n",
                  "| variant | reduce ms/step | speed-up vs dense | counted B/step (rank 0) | veth B/step (rank 0 tx, "
                  "all traffic) | veth / counted |", "|---|---|---|---|---|---|"]
        for name, r, c in wire:
            counted = r["stats"]["bytes_sent"] / r["steps"]
            veth = c["tx_bytes"][0] / r["steps"]
            speed = f"{base['reduce_s'] / r['reduce_s']:.1f}x" if base else "n/a"
            lines.append(f"| {name} | {r['reduce_s'] * 1e3:.1f} | {speed} | {counted:,.0f} | {veth:,.0f} | "
                         f"{veth / counted:.3f} |")
        lines.append("")
    if train:
        first = train[0][1]
        lines += [f"## B. End to end: {first['config']} ({first['data']}, {first['num_classes']} classes, backbone "
                  f"{first['backbone_numel'] / 1e6:.2f} M parameters), {first['steps']} steps\n",
                  "| variant | ZeRO stage | s/step (median) | speed-up vs dense | veth B/step (rank 0 tx, incl. head "
                  "traffic) | backbone B/step counted | loss (last 10) |", "|---|---|---|---|---|---|---|"]
        for name, r, c in train:
            base = next((b for n, b, _ in train if n == "dense" and b["zero_stage"] == r["zero_stage"]), None)
            comp = r.get("compression")
            counted = (comp["bytes_sent"] / r["steps"]) if comp else \
                2 * (r["world"] - 1) * r["backbone_numel"] * 4 / r["world"]
            speed = f"{base['step_s'] / r['step_s']:.2f}x" if base else "n/a"
            lines.append(f"| {name} | {r['zero_stage']} | {r['step_s']:.3f} | {speed} | "
                         f"{c['tx_bytes'][0] / r['steps']:,.0f} | {counted:,.0f}{'' if comp else ' (ring model)'} | "
                         f"{r['loss_last10']:.3f} |")
        lines += [""] + zero1_table(args, train)
    return "\n".join(lines)


def zero1_table(args, train) -> list:
    """What ZeRO-1 adds to each variant's step, measured (its step and veth bytes minus the ZeRO-0 run's),
    next to the model's all-gather of the backbone's fp32 parameters (empty without both stages)."""
    from ds_xc.cost.comm import Collective, Link, collective_time, wire_bytes
    by = {(n, r["zero_stage"]): (r, c) for n, r, c in train}
    pairs = [(n, by[(n, 0)], by[(n, 1)]) for n in dict.fromkeys(n for n, _, _ in train)
             if (n, 0) in by and (n, 1) in by]
    if not pairs:
        return []
    r0 = pairs[0][1][0]
    gather = Collective("params", "all_gather", r0["world"], 4 * r0["backbone_numel"])
    if args.rate == "none":
        model_s = None
    else:
        gbit = float(args.rate.replace("gbit", "e9").replace("mbit", "e6")) / 1e9
        model_s = collective_time(gather, Link.gbit(gbit, 50e-6))
    at = f"{1e3 * model_s:.0f} ms" if model_s is not None else "n/a (unshaped)"
    out = ["## What ZeRO-1 adds to a step\n",
           f"ZeRO-1's step all-gathers the updated fp32 parameters, compressed or not; the cost model puts that "
           f"all-gather on both sides (ds_xc/cost/compression.py): {wire_bytes(gather):,.0f} B sent per rank and "
           f"{at} for {r0['backbone_numel']:,} elements over {r0['world']} ranks at {args.rate}.\n",
           "| variant | ZeRO-0 s/step | ZeRO-1 s/step | time added | model's all-gather | veth B/step added (rank 0 "
           "tx) | model's bytes |", "|---|---|---|---|---|---|---|"]
    for name, (z0, c0), (z1, c1) in pairs:
        added = c1["tx_bytes"][0] / z1["steps"] - c0["tx_bytes"][0] / z0["steps"]
        out.append(f"| {name} | {z0['step_s']:.3f} | {z1['step_s']:.3f} | {1e3 * (z1['step_s'] - z0['step_s']):.0f} "
                   f"ms | {at} | {added:,.0f} | {wire_bytes(gather):,.0f} |")
    return out + [""]


if __name__ == "__main__":
    main()

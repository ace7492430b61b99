"""Benchmark: overlapped vs serial training steps, over a shaped link and on loopback.

Two ranks run benchmarks/overlap_step.py (a backbone MLP + a class-parallel head, the
serial path, the serial path timed collective by collective, and the overlap pipeline
with one backbone graph and with the backbone per chunk, interleaved round by round):

A. in two network namespaces joined by a veth pair shaped with tc tbf
   (benchmarks/netns.sh, which removes everything on exit), at ``--rate``, chosen so
   that the communication of a serial step is about its computation;
B. on loopback without shaping (127.0.0.1, no root needed): the schedule's overhead
   when communication is cheap.

    sudo python benchmarks/overlap_netns.py            # writes benchmarks/results/overlap_netns.md
    python benchmarks/overlap_netns.py --skip shaped --out -
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.harness import cpu_model, free_port, git_rev, load_average, usable_cores, write_report  # noqa: E402

NETNS = os.path.join(ROOT, "benchmarks", "netns.sh")
STEP = os.path.join(ROOT, "benchmarks", "overlap_step.py")
DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "overlap_netns.md")
LABELS = {"serial": "serial (plain: head forward, backward, then all-reduce)",
          "serial_timed": "serial, collectives timed one by one",
          "overlap": "overlapped (one backbone graph)",
          "overlap_cb": "overlapped (backbone per chunk)"}


def shaped(step_args: list, rate: str, mtu: int, timeout: float) -> dict:
    """Run the two ranks under netns.sh at ``rate`` and ``mtu``; rank 0's JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        cmd = [NETNS, "-r", rate, "-m", str(mtu), "-p", str(29700 + os.getpid() % 200), "--", "env", "OMP_NUM_THREADS=1",
               sys.executable, STEP, *step_args, "--out", out]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if proc.returncode:
            raise RuntimeError(f"{shlex.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        with open(out) as fh:
            return json.load(fh)


def loopback(step_args: list, timeout: float) -> dict:
    """Run the two ranks on 127.0.0.1; rank 0's JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out, port = os.path.join(tmp, "out.json"), free_port()
        procs = []
        for rank in range(2):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="1",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen([sys.executable, STEP, *step_args, "--out", out], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        errors = []
        for rank, proc in enumerate(procs):
            _, err = proc.communicate(timeout=timeout)
            if proc.returncode:
                errors.append(f"rank {rank} ({proc.returncode}):\n{err[-3000:]}")
        if errors:
            raise RuntimeError("\n".join(errors))
        with open(out) as fh:
            return json.load(fh)


def table(res: dict) -> list[str]:
    modes = res["modes"]
    base = modes["serial"]["median_s"]
    lines = ["| schedule | s/step (median) | vs serial | exposed comm s/step | of which: gather / reduce-scatter / "
             "grad all-reduce / labels | collectives issued | MiB issued/step |", "|---|---|---|---|---|---|---|"]
    for mode, m in modes.items():
        if mode == "serial":  # blocking collectives inside autograd: not instrumented
            exposed, parts = "all of it (see next row)", "-"
        else:
            exposed = f"{m['exposed_s']:.3f}"
            parts = " / ".join(f"{m.get(k, 0.0):.3f}" for k in ("exposed_gather_s", "exposed_reduce_scatter_s",
                                                                "exposed_grad_reduce_s", "exposed_labels_s"))
        lines.append(f"| {LABELS.get(mode, mode)} | {m['median_s']:.3f} | {m['median_s'] / base:.2f}x | {exposed} | "
                     f"{parts} | {m['issued']:.0f} | {m['issued_mb']:.1f} |")
    return lines


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", default="800mbit,1gbit", help="tc tbf rates of both veth ends, comma-separated: "
                   "one shaped run each")
    p.add_argument("--mtu", type=int, default=9000, help="MTU of the veth pair (9000: jumbo frames, as data "
                   "centre links use; 1500 costs the 2-core machine a CPU-bound network stack)")
    p.add_argument("--steps", type=int, default=10, help="timed rounds (each runs every schedule once)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--step_args", default="--in_dim 256 --hidden 768 --layers 24 --batch 256 --dim 256 "
                   "--classes 4000 --chunks 4", help="workload flags for overlap_step.py")
    p.add_argument("--skip", default="", help="'shaped' or 'loopback' to leave a part out")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default=DEFAULT_OUT)
    args = p.parse_args(argv)
    command = "python benchmarks/overlap_netns.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    started, t0 = datetime.datetime.now().isoformat(timespec="seconds"), time.time()
    step_args = shlex.split(args.step_args) + ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    parts = {}
    if "shaped" not in args.skip:
        if os.geteuid() != 0:
            raise SystemExit("the shaped part needs root (ip netns, tc); run with sudo or --skip shaped")
        for rate in args.rate.split(","):
            parts[rate] = shaped(step_args, rate, args.mtu, args.timeout)
            print("\n".join(table(parts[rate])), flush=True)
    if "loopback" not in args.skip:
        parts["loopback"] = loopback(step_args, args.timeout)
        print("\n".join(table(parts["loopback"])), flush=True)
    if not parts:
        raise SystemExit("nothing ran: both parts skipped")
    first = next(iter(parts.values()))
    a = first["args"]
    lines = ["# Overlap pipeline: overlapped vs serial step (2 ranks)\n",
             f"- command: `{command}`",
             f"- date: {started}, wall time {(time.time() - t0) / 60:.1f} min, git {git_rev()}",
             f"- machine: {cpu_model()}, {usable_cores()} usable cores, load average {load_average()} at the end; "
             "1 torch thread per rank; rounds interleave the schedules, so noise hits all alike",
             f"- workload per rank: backbone MLP {a['in_dim']} -> {a['hidden']} x{a['layers'] - 1} -> {a['dim']} "
             f"({first['backbone_params'] / 1e6:.1f} M parameters, fp32 gradients all-reduced), {a['batch']} rows; "
             f"head {a['classes']} classes ({a['loss']}, full softmax), global batch {a['batch'] * first['world']}, "
             f"{a['chunks']} micro-chunks, head chunk_size = global batch / chunks (both paths run the same "
             f"matrix products), buckets of {a['bucket_mb']} MiB; median over {a['steps']} rounds after "
             f"{a['warmup']} warm-up rounds; a step ends after the optimizer step (SGD)",
             "- exposed comm: time spent waiting for a collective (work.wait()); compute = step - exposed\n"]
    for i, (name, res) in enumerate(parts.items()):
        if name == "loopback":
            continue
        serial = res["modes"]["serial_timed"]
        comm, compute = serial["exposed_s"], serial["median_s"] - serial["exposed_s"]
        lines += [f"## A{i + 1}. Shaped link at {name}: veth pair (MTU {args.mtu}), `tc tbf rate {name} burst 128kb "
                  f"latency 50ms` on both ends\n",
                  f"Serial step: communication {comm:.3f} s, computation {compute:.3f} s (ratio "
                  f"{comm / max(compute, 1e-9):.2f}).\n"]
        lines += table(res) + [""]
    if "loopback" in parts:
        lines += ["## B. Loopback, no shaping (127.0.0.1)\n"] + table(parts["loopback"]) + [""]
    report = "\n".join(lines)
    print(report)
    write_report(args.out, report + "\n")
    return report


if __name__ == "__main__":
    main()

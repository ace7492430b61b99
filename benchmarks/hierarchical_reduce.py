"""Hierarchical vs flat dense all-reduce across "hosts": 2 network namespaces x 2 ranks each.

    sudo python benchmarks/hierarchical_reduce.py [--numel 10000000] [--repeats 5] [--steps 6]
        [--rate 1gbit] [--out benchmarks/results/hierarchical_reduce.md]

Three measurements, each under benchmarks/netns_hosts.sh (2 hosts behind a switch; ranks of one
host talk over its loopback, unshaped) with the inter-host links shaped by tc tbf at --rate and
unshaped ("none"), plus 4 ranks on the plain loopback of one host with the 2x2 layout simulated
(topology.ranks_per_node=2):

1. reduce: the mean of a --numel float32 gradient over the 4 ranks, one flat gloo all-reduce vs
   ds_xc.parallel.hierarchical.HierarchicalAllReduce (layout from the launcher's variables),
   median of --repeats after one warm-up, each timed from a barrier to the slowest rank's end;
   the results are checked equal (float tolerance) against each other.
2. step: launch/train.py with configs/default.json for --steps steps under the DeepSpeed launcher
   (--no_ssh, one launcher per host), extreme_classification.topology.reduction=flat vs
   hierarchical, --step_repeats runs per mode, alternating (the machine's load drifts), median.
   The time per step is a run's training seconds over its steps (the first step's ANN index
   build included in both modes); 1024 held-out samples are evaluated at the end.

Writes a table with the command line and the git revision in its header.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.harness import free_port, git_rev, load_average, write_report  # noqa: E402

HOSTS_SH = os.path.join(ROOT, "benchmarks", "netns_hosts.sh")
BIN = os.path.dirname(sys.executable)


def worker(args) -> None:
    """One rank of the reduce measurement (started by torchrun)."""
    import torch
    import torch.distributed as dist

    from ds_xc.parallel.hierarchical import HierarchicalAllReduce
    from ds_xc.parallel.topology import detect_layout
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.group.WORLD  # the benchmark's whole job
    layout = detect_layout(world, args.ranks_per_node)
    hier = HierarchicalAllReduce(layout, chunk_numel=args.chunk_numel)
    rank, size = dist.get_rank(world), dist.get_world_size(world)
    grad = torch.randn(args.numel, generator=torch.Generator().manual_seed(rank))  # (n,) float32
    times: dict = {"flat": [], "hierarchical": []}
    results = {}
    for it in range(args.repeats + 1):
        for mode in ("flat", "hierarchical"):
            buf = grad.clone()
            dist.barrier(group=world)
            t = time.perf_counter()
            if mode == "flat":
                dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=world)
                buf.div_(size)
            else:
                hier.mean_(buf)
            took = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX, group=world)  # the slowest rank's time
            if it > 0:
                times[mode].append(float(took))
            results[mode] = buf
    diff = float((results["flat"] - results["hierarchical"]).abs().max())
    if rank == 0:
        with open(args.json, "w") as fh:
            json.dump({"layout": layout.describe(), "times": times, "max_abs_diff": diff}, fh)
    dist.barrier(group=world)
    dist.destroy_process_group()


def _run(cmd, timeout):
    paths = [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(paths))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(f"{' '.join(cmd[:8])} ... failed ({proc.returncode}):\n{tail}")
    return proc.stdout + proc.stderr


def _hosts(rate):
    return [HOSTS_SH, "-H", "2", "-r", rate, "--"]


def measure_reduce(args, where: str, tmp: str) -> dict:
    out = os.path.join(tmp, f"reduce_{where}.json")
    script = [os.path.abspath(__file__), "--worker", "--numel", str(args.numel), "--repeats", str(args.repeats),
              "--json", out, "--chunk_numel", str(args.chunk_numel)]
    if where == "loopback":
        cmd = [os.path.join(BIN, "torchrun"), "--nproc_per_node", "4", "--master_port", str(free_port())] + script + \
            ["--ranks_per_node", "2"]
    else:
        cmd = _hosts(where) + [os.path.join(BIN, "torchrun"), "--nnodes", "2", "--nproc_per_node", "2", "--node_rank",
                               "{node}", "--master_addr", "{master}", "--master_port", str(free_port())] + script
    _run(cmd, 900)
    with open(out) as fh:
        return json.load(fh)


def measure_step(args, where: str, mode: str, tmp: str) -> dict:
    out = os.path.join(tmp, f"step_{where}_{mode}.json")
    config = os.path.join(ROOT, "configs", "default.json")
    train = [os.path.join(ROOT, "launch", "train.py"), "--deepspeed_config", config,
             "--max_steps", str(args.steps), "--eval_every", "0", "--summary_json", out,
             "--set", f"extreme_classification.topology.reduction={mode}", "--set", "xc_train.eval_samples=1024"]
    hostfile = os.path.join(tmp, "hostfile")
    with open(hostfile, "w") as fh:
        fh.write("host0 slots=2\nhost1 slots=2\n")
    cmd = _hosts(where) + [os.path.join(BIN, "deepspeed"), "--hostfile", hostfile, "--no_ssh", "--node_rank", "{node}",
                           "--master_addr", "{master}", "--master_port", str(free_port())] + train
    _run(cmd, 1800)
    with open(out) as fh:
        s = json.load(fh)
    return {"step_s": s["seconds"] / s["steps"], "final_loss": s["final_loss"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=10**7)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--step_repeats", type=int, default=2, help="runs per mode and link of the step measurement")
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--chunk_numel", type=int, default=1 << 18, help="pipelining chunk of the hierarchical reduce")
    p.add_argument("--where", default=None, help="comma-separated links (default: RATE,none,loopback)")
    p.add_argument("--skip_steps", action="store_true", help="only the reduce measurement")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "hierarchical_reduce.md"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--ranks_per_node", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    args.where = args.where or f"{args.rate},none,loopback"
    command = "python " + " ".join([os.path.relpath(__file__, ROOT)] + (argv if argv is not None else sys.argv[1:]))
    rev, load0 = git_rev(("ds_xc", "benchmarks", "launch", "configs")), load_average()
    rows, steps = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for where in args.where.split(","):
            r = measure_reduce(args, where, tmp)
            f, h = statistics.median(r["times"]["flat"]), statistics.median(r["times"]["hierarchical"])
            rows.append((where, r["layout"], f, h, r["max_abs_diff"]))
            print(rows[-1], flush=True)
        if not args.skip_steps:
            for where in (args.rate, "none"):
                runs: dict = {"flat": [], "hierarchical": []}
                for _ in range(args.step_repeats):  # alternating: the machine's load drifts
                    for m in runs:
                        runs[m].append(measure_step(args, where, m, tmp))
                        print(where, m, runs[m][-1], flush=True)
                steps.append((where, runs["flat"], runs["hierarchical"]))
    link = {args.rate: f"2 hosts x 2, inter-host tbf {args.rate}", "none": "2 hosts x 2, unshaped veth",
            "loopback": "1 host, 4 ranks, 2x2 simulated"}
    lines = ["# Hierarchical vs flat dense reduction (2 nodes x 2 ranks)", "",
             f"Command: `sudo {command}`  ", f"Revision: {rev}  ",
             f"Machine: {os.cpu_count()} cores shared with other jobs, load average {load0} at the start "
             f"and {load_average()} at the end; one thread per rank.", "",
             f"## Mean of a {args.numel:,}-element float32 gradient over 4 ranks "
             f"(median of {args.repeats}, slowest rank)", "",
             "| links | layout | flat (s) | hierarchical (s) | speed-up | max abs diff |", "|---|---|---|---|---|---|"]
    lines += [f"| {link[w]} | {lay} | {f:.3f} | {h:.3f} | {f / h:.2f}x | {d:.1e} |" for w, lay, f, h, d in rows]
    if steps:
        lines += ["", f"## End-to-end step of configs/default.json ({args.steps} steps, 2 hosts x 2 ranks, "
                  "DeepSpeed launcher --no_ssh)", "",
                  f"Median of {args.step_repeats} runs per mode, alternating.", "",
                  "| links | flat (s/step) | hierarchical (s/step) | speed-up | each run, flat / hierarchical | "
                  "final loss flat / hierarchical |", "|---|---|---|---|---|---|"]
        for w, fs, hs in steps:
            f, h = (statistics.median(r["step_s"] for r in rs) for rs in (fs, hs))
            each = " / ".join(", ".join(f"{r['step_s']:.2f}" for r in rs) for rs in (fs, hs))
            lines.append(f"| {link[w]} | {f:.3f} | {h:.3f} | {f / h:.2f}x | {each} | "
                         f"{fs[0]['final_loss']:.4f} / {hs[0]['final_loss']:.4f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    write_report(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Hierarchical vs flat dense all-reduce across "hosts": 2 network namespaces x 2 ranks each.

    sudo python benchmarks/hierarchical_reduce.py [--numel 10000000] [--repeats 5] [--steps 6]
        [--rate 1gbit] [--where 1gbit,1gbit/nic,none,none/nic,loopback] [--out ...]

Measurements under benchmarks/netns_hosts.sh (2 hosts behind a switch) on links named by
--where: RATE (tc tbf on the inter-host links) or "none" (unshaped veth), either with one NIC
per host (its ranks talk over the host's loopback and share its link) or, with the suffix
"/nic", one NIC per rank (netns_hosts.sh -n 2: each rank its own shaped link into the switch,
the host's ranks joined by an unshaped bridge; EFLOPS' multi-NIC hosts), plus "loopback": 4
ranks on the plain loopback of one host with the 2x2 layout simulated (topology.ranks_per_node=2):

1. reduce: the mean of a --numel float32 gradient over the 4 ranks, one flat gloo all-reduce vs
   ds_xc.parallel.hierarchical.HierarchicalAllReduce (layout from the launcher's variables) with
   its node stages by all_to_all (the default) and by all-reduce (the previous scheme), modes
   alternating, median of --repeats after one warm-up, each timed from a barrier to the slowest
   rank's end; the results are checked equal (float tolerance) against each other. Then auto's
   probe (ds_xc.parallel.reduction_probe, a 16 MB bucket as in configs/default.json) is run and
   its choice reported. Then the head's row exchange (--head_rows rows of --head_dim float32 per
   rank): forward all-gather + backward reduce-scatter, flat vs the rank-aligned two stages
   (ds_xc.parallel.node_gather), alternating, median of 3 x --repeats; the forwards compared bitwise.
2. step: launch/train.py with configs/default.json for --steps steps under the DeepSpeed launcher
   (--no_ssh, one launcher per host; with "/nic" each rank is moved into its namespace by
   benchmarks/rank_netns.sh through --no_python), extreme_classification.topology.reduction =
   each of --step_modes (topology.head_collectives stays auto: its own probe picks the head's row exchange),
   --step_repeats runs per mode, alternating (the machine's load drifts),
   median, after one untimed 1-step run per link (the first launch of a revision JIT-builds the C++
   ops). The time per step is the steady step: each rank's median step time (launch/train.py's
   per-step wall clock, `ranks[*].step_s_median` of --summary_json), the slowest rank's; the run's
   training seconds over its steps (which adds the first step's one-time costs, the ANN index build
   and first-touch allocations, divided by --steps) is shown beside it. auto's probe runs at
   initialize, outside both; 1024 held-out samples are evaluated at the end. auto's choice is read
   from the run's log.

Writes a table with the command line and the git revision in its header.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.harness import free_port, git_rev, load_average, write_report  # noqa: E402

HOSTS_SH = os.path.join(ROOT, "benchmarks", "netns_hosts.sh")
RANK_SH = os.path.join(ROOT, "benchmarks", "rank_netns.sh")
BIN = os.path.dirname(sys.executable)


def worker(args) -> None:
    """One rank of the reduce measurement (started by torchrun)."""
    import torch
    import torch.distributed as dist

    from ds_xc.parallel.hierarchical import HierarchicalAllReduce
    from ds_xc.parallel.topology import detect_layout
    from ds_xc.parallel.reduction_probe import probe_reduction
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.group.WORLD  # the benchmark's whole job
    layout = detect_layout(world, args.ranks_per_node)
    hiers = {"hierarchical": HierarchicalAllReduce(layout, chunk_numel=args.chunk_numel),
             "hier_allreduce": HierarchicalAllReduce(layout, chunk_numel=args.chunk_numel, intra_mode="allreduce")}
    rank, size = dist.get_rank(world), dist.get_world_size(world)
    grad = torch.randn(args.numel, generator=torch.Generator().manual_seed(rank))  # (n,) float32
    modes = ("flat", "hierarchical", "hier_allreduce")
    times: dict = {m: [] for m in modes}
    results = {}
    for it in range(args.repeats + 1):
        for mode in (modes if it % 2 == 0 else modes[::-1]):  # alternating: the load drifts
            buf = grad.clone()
            dist.barrier(group=world)
            t = time.perf_counter()
            if mode == "flat":
                dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=world)
                buf.div_(size)
            else:
                hiers[mode].mean_(buf)
            took = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX, group=world)  # the slowest rank's time
            if it > 0:
                times[mode].append(float(took))
            results[mode] = buf
    diff = max(float((results["flat"] - results[m]).abs().max()) for m in modes[1:])
    auto, probe = probe_reduction(hiers["hierarchical"], world, args.probe_numel, 3)
    head = measure_head_exchange(args, layout, world) if args.head_rows else {}
    if rank == 0:
        with open(args.json, "w") as fh:
            json.dump({"layout": layout.describe(), "times": times, "max_abs_diff": diff, "auto": auto,
                       "probe": probe, "head": head}, fh)
    dist.barrier(group=world)
    dist.destroy_process_group()


def measure_head_exchange(args, layout, world) -> dict:
    """The head's row exchange, forward all-gather + backward reduce-scatter of (rows, head_dim) float32 per
    rank: flat (collectives.all_gather_rows) vs the two rank-aligned stages (node_gather.node_gather_rows);
    {rows: {"flat": [s...], "hierarchical": [s...], "forward_equal": bool}}, the slowest rank per repeat."""
    import torch
    import torch.distributed as dist

    from ds_xc.parallel.collectives import all_gather_rows
    from ds_xc.parallel.node_gather import NodeGather, node_gather_rows
    plan, out = NodeGather(layout, world), {}
    for rows in (int(r) for r in args.head_rows.split(",")):
        x = torch.randn(rows, args.head_dim, generator=torch.Generator().manual_seed(dist.get_rank(world)))
        up = torch.randn(rows * dist.get_world_size(world), args.head_dim)  # (N, d) upstream gradient
        times, gathered = {"flat": [], "hierarchical": []}, {}
        for it in range(3 * args.repeats + 1):
            for mode in (("flat", "hierarchical") if it % 2 == 0 else ("hierarchical", "flat")):
                xi = x.clone().requires_grad_(True)
                dist.barrier(group=world)
                t = time.perf_counter()
                y = all_gather_rows(xi, world) if mode == "flat" else node_gather_rows(xi, plan)
                y.backward(up)
                took = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX, group=world)
                if it > 0:
                    times[mode].append(float(took))
                gathered[mode] = y.detach()
        out[rows] = dict(times, forward_equal=bool(torch.equal(gathered["flat"], gathered["hierarchical"])))
    return out


def _run(cmd, timeout):
    paths = [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(paths))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(f"{' '.join(cmd[:8])} ... failed ({proc.returncode}):\n{tail}")
    return proc.stdout + proc.stderr


def _hosts(where):
    """netns_hosts.sh for a --where entry (RATE or RATE/nic) and the per-rank wrapper ([] with one NIC per host)."""
    rate, _, nic = where.partition("/")
    if nic:
        return [HOSTS_SH, "-H", "2", "-n", "2", "-r", rate, "--"], [RANK_SH, sys.executable]
    return [HOSTS_SH, "-H", "2", "-r", rate, "--"], []


def measure_reduce(args, where: str, tmp: str) -> dict:
    out = os.path.join(tmp, f"reduce_{where}.json".replace("/", "_"))
    script = [os.path.abspath(__file__), "--worker", "--numel", str(args.numel), "--repeats", str(args.repeats),
              "--json", out, "--chunk_numel", str(args.chunk_numel), "--probe_numel", str(args.probe_numel),
              "--head_rows", args.head_rows, "--head_dim", str(args.head_dim)]
    if where == "loopback":
        cmd = [os.path.join(BIN, "torchrun"), "--nproc_per_node", "4", "--master_port", str(free_port())] + script + \
            ["--ranks_per_node", "2"]
    else:
        hosts, wrap = _hosts(where)
        cmd = hosts + [os.path.join(BIN, "torchrun")] + (["--no-python"] if wrap else []) + \
            ["--nnodes", "2", "--nproc_per_node", "2", "--node_rank", "{node}", "--master_addr", "{master}",
             "--master_port", str(free_port())] + wrap + script
    _run(cmd, 900)
    with open(out) as fh:
        return json.load(fh)


def measure_step(args, where: str, mode: str, tmp: str) -> dict:
    out = os.path.join(tmp, f"step_{where}_{mode}.json".replace("/", "_"))
    config = os.path.join(ROOT, "configs", "default.json")
    train = [os.path.join(ROOT, "launch", "train.py"), "--deepspeed_config", config,
             "--max_steps", str(args.steps), "--eval_every", "0", "--summary_json", out,
             "--set", f"extreme_classification.topology.reduction={mode}", "--set", "xc_train.eval_samples=1024",
             "--verbose"]
    hostfile = os.path.join(tmp, "hostfile")
    with open(hostfile, "w") as fh:
        fh.write("host0 slots=2\nhost1 slots=2\n")
    hosts, wrap = _hosts(where)
    cmd = hosts + [os.path.join(BIN, "deepspeed"), "--hostfile", hostfile, "--no_ssh", "--node_rank", "{node}",
                   "--master_addr", "{master}", "--master_port", str(free_port())] + \
        (["--no_python", "--no_local_rank"] if wrap else []) + wrap + train
    log = _run(cmd, 1800)
    with open(out) as fh:
        s = json.load(fh)
    chosen = re.findall(r"topology: auto probe of the reduction.*?flat ([0-9.]+) s, hierarchical ([0-9.]+) s -> (\w+)",
                        log)
    head = re.findall(r"topology: auto probe of the head's row exchange.*? -> (\w+)", log)
    steady = max(r["step_s_median"] for r in s["ranks"])  # the slowest rank's median step
    return {"step_s": steady, "run_s_per_step": s["seconds"] / s["steps"], "final_loss": s["final_loss"],
            "auto": chosen[0][2] if chosen else None, "head": head[0] if head else None}


def _link(where: str, rate: str) -> str:
    if where == "loopback":
        return "1 host, 4 ranks, 2x2 simulated"
    r, _, nic = where.partition("/")
    shaped = f"tbf {r}" if r != "none" else "unshaped veth"
    return f"2 hosts x 2, {'one NIC per rank' if nic else 'one NIC per host'}, {shaped}"


def _reduce_table(args, rows) -> list:
    lines = [f"## Mean of a {args.numel:,}-element float32 gradient over 4 ranks "
             f"(median of {args.repeats}, slowest rank, modes alternating)", "",
             "hierarchical: node stages by all_to_all + local sum and all_gather (the default); hier. (all-reduce "
             "node stages): the previous scheme. auto: the choice of the probe (a 16 MB bucket, median of 3, "
             "probe times flat / hierarchical).", "",
             "| links | flat (s) | hierarchical (s) | speed-up | hier. (all-reduce node stages) (s) | speed-up | "
             "auto picks (probe s) | auto vs flat | max abs diff |", "|---|---|---|---|---|---|---|---|---|"]
    for where, r in rows:
        t = {m: statistics.median(v) for m, v in r["times"].items()}
        f, h, a = t["flat"], t["hierarchical"], t["hier_allreduce"]
        pick = t[r["auto"]]
        lines.append(f"| {_link(where, args.rate)} | {f:.3f} | {h:.3f} | {f / h:.2f}x | {a:.3f} | {f / a:.2f}x | "
                     f"{r['auto']} ({r['probe']['flat']:.3f} / {r['probe']['hierarchical']:.3f}) | {f / pick:.2f}x | "
                     f"{r['max_abs_diff']:.1e} |")
    return lines


def _head_table(args, rows) -> list:
    lines = ["", f"## The head's row exchange: all-gather of (rows, {args.head_dim}) float32 per rank + the "
             f"reduce-scatter of its gradient (median of {3 * args.repeats}, slowest rank, alternating)", "",
             "flat: one all-gather / reduce-scatter over the 4 ranks (collectives.all_gather_rows); hierarchical: "
             "the rank-aligned two stages (node_gather.node_gather_rows, `topology.head_collectives`).", "",
             "| links | rows per rank | flat (ms) | hierarchical (ms) | speed-up | forward bitwise equal |",
             "|---|---|---|---|---|---|"]
    for where, r in rows:
        for n, t in r.get("head", {}).items():
            f, h = statistics.median(t["flat"]), statistics.median(t["hierarchical"])
            lines.append(f"| {_link(where, args.rate)} | {int(n):,} | {1e3 * f:.2f} | {1e3 * h:.2f} | {f / h:.2f}x | "
                         f"{'yes' if t['forward_equal'] else 'NO'} |")
    return lines


def _step_table(args, steps, modes) -> list:
    lines = ["", f"## End-to-end step of configs/default.json ({args.steps} steps, 2 hosts x 2 ranks, "
             "DeepSpeed launcher --no_ssh)", "",
             f"Steady step: the slowest rank's median step time in a run; median of {args.step_repeats} runs per "
             "mode, alternating. 'Run s/step' is a run's training seconds over its steps, the first step's "
             "one-time costs (ANN index build, first-touch allocations) included.", "",
             "The head's row exchange (topology.head_collectives auto) is probed in every mode's run on its own; "
             "'head picks' lists its choice per mode.", "",
             "| links | " + " | ".join(f"{m} (s/step)" for m in modes) + " | hierarchical speed-up | auto picks | "
             "head picks | auto vs flat | each run (s/step), " + " / ".join(modes) + " | run s/step, " +
             " / ".join(modes) + " (speed-up) | final loss, " + " / ".join(modes) + " |", "|---" * (len(modes) + 8) + "|"]
    for where, runs in steps:
        med = {m: statistics.median(r["step_s"] for r in runs[m]) for m in modes}
        picks = sorted({r["auto"] for r in runs.get("auto", []) if r["auto"]})
        heads = sorted({f"{m}: {r['head']}" for m in modes for r in runs[m] if r.get("head")})
        each = " / ".join(", ".join(f"{r['step_s']:.3f}" for r in runs[m]) for m in modes)
        speed = f"{med['flat'] / med['hierarchical']:.2f}x" if {"flat", "hierarchical"} <= set(modes) else "-"
        whole = {m: statistics.median(r["run_s_per_step"] for r in runs[m]) for m in modes}
        whole_txt = " / ".join(f"{whole[m]:.3f}" for m in modes) + (
            f" ({whole['flat'] / whole['hierarchical']:.2f}x)" if {"flat", "hierarchical"} <= set(modes) else "")
        auto = f"{med['flat'] / med['auto']:.2f}x" if {"flat", "auto"} <= set(modes) else "-"
        lines.append(f"| {_link(where, args.rate)} | " + " | ".join(f"{med[m]:.3f}" for m in modes) +
                     f" | {speed} | {', '.join(picks) or '-'} | {'; '.join(heads) or '-'} | {auto} | {each} | "
                     f"{whole_txt} | " +
                     " / ".join(f"{runs[m][0]['final_loss']:.4f}" for m in modes) + " |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=10**7)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--step_repeats", type=int, default=2, help="runs per mode and link of the step measurement")
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--chunk_numel", type=int, default=1 << 20, help="pipelining chunk of the hierarchical reduce")
    p.add_argument("--probe_numel", type=int, default=(16 << 20) // 4, help="auto's probe (topology.bucket_size_mb)")
    p.add_argument("--head_rows", default="128,2048", help="rows per rank of the head's row exchange ('' to skip)")
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--where", default=None,
                   help="comma-separated links of the reduce (default: RATE,RATE/nic,none,none/nic,loopback)")
    p.add_argument("--step_where", default=None, help="links of the step (default: RATE,RATE/nic,none)")
    p.add_argument("--step_modes", default="flat,hierarchical,auto")
    p.add_argument("--skip_steps", action="store_true", help="only the reduce measurement")
    p.add_argument("--skip_reduce", action="store_true", help="only the step measurement")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "hierarchical_reduce.md"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--ranks_per_node", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    args.where = args.where or f"{args.rate},{args.rate}/nic,none,none/nic,loopback"
    args.step_where = args.step_where or f"{args.rate},{args.rate}/nic,none"
    modes = args.step_modes.split(",")
    command = "python " + " ".join([os.path.relpath(__file__, ROOT)] + (argv if argv is not None else sys.argv[1:]))
    rev, load0 = git_rev(("ds_xc", "benchmarks", "launch", "configs")), load_average()
    raw = {"revision": rev, "reduce": [], "step": [], "load": [load0]}
    raw_path = "-" if args.out == "-" else os.path.splitext(args.out)[0] + ".json"
    with tempfile.TemporaryDirectory() as tmp:
        for where in ([] if args.skip_reduce else args.where.split(",")):
            raw["reduce"].append((where, measure_reduce(args, where, tmp)))
            print(raw["reduce"][-1], load_average(), flush=True)
            write_report(raw_path, json.dumps(raw, indent=1))
        for where in ([] if args.skip_steps else args.step_where.split(",")):
            # untimed warm-up run: the first launch of a revision JIT-builds the C++ ops (tens of seconds) inside
            # its first step, which would land on whichever mode runs first
            measure_step(argparse.Namespace(**dict(vars(args), steps=1)), where, modes[0], tmp)
            runs: dict = {m: [] for m in modes}
            for _ in range(args.step_repeats):  # alternating: the machine's load drifts
                for m in runs:
                    runs[m].append(measure_step(args, where, m, tmp))
                    print(where, m, runs[m][-1], load_average(), flush=True)
            raw["step"].append((where, runs))
            raw["load"].append(load_average())
            write_report(raw_path, json.dumps(raw, indent=1))
    lines = ["# Hierarchical vs flat dense reduction (2 nodes x 2 ranks)", "",
             f"Command: `sudo {command}`  ", f"Revision: {rev}  ",
             f"Machine: {os.cpu_count()} cores shared with other jobs, load average {load0} at the start "
             f"and {load_average()} at the end; one thread per rank.", ""]
    if raw["reduce"]:
        lines += _reduce_table(args, raw["reduce"])
    if any(r.get("head") for _, r in raw["reduce"]):
        lines += _head_table(args, raw["reduce"])
    if raw["step"]:
        lines += _step_table(args, raw["step"], modes)
    text = "\n".join(lines) + "\n"
    print(text)
    write_report(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

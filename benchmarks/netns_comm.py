"""Calibrate the communication model (ds_xc/cost/comm.py) on namespace "hosts" and check it on the
head step: measured 2x2 and 3x2 steps against measured compute + predicted communication.

Under benchmarks/netns_hosts.sh (H hosts behind a switch, tbf-shaped links, 2 ranks per host
started by torchrun, one thread per rank pinned to core rank % cores):

1. ``calib``: all_reduce and all_gather of a few sizes over all ranks; per size the median of the
   slowest rank's time. Per link rate, (alpha, beta) are fitted by least squares to t = steps (alpha + share S / beta) over both host counts and both kinds (the ring
   model of comm.py; gloo's reduce_scatter runs as an all_reduce, so it needs no own fit).
2. ``step``: the real class-parallel head step (ANN sampler, lazy_exact AdamW), followed by the
   dense mean all-reduce of a flat 2 x 10^6-parameter buffer standing for the backbone's gradients,
   over all ranks; median of the slowest rank. The hosts' eth0 byte counters are compared with
   the bytes the model says cross each NIC.
3. ``compute``: the same rank's work without communication (benchmarks/sim_rank.py), P processes
   at once on one host (the same CPU sharing as the P ranks of the step run), median per rank,
   measured right before each step run (the load of the shared machine drifts).

Prediction = compute (max over ranks of the per-rank medians) + comm.predict_time(
step_collectives(...), fitted link, ranks_per_node=2). Writes benchmarks/results/netns_comm.md.

    python benchmarks/netns_comm.py                     # 2 and 3 hosts, 1gbit and 100mbit (root)
    python benchmarks/netns_comm.py --rates 1gbit --hosts 2 --out -
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
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.harness import free_port, git_rev, load_average, write_report  # noqa: E402

HOSTS_SH = os.path.join(ROOT, "benchmarks", "netns_hosts.sh")
BIN = os.path.dirname(sys.executable)
DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "netns_comm.md")
RANKS_PER_HOST = 2
SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 21)  # bytes of the calibration messages
BACKBONE_PARAMS = 2 * 10**6
SECTION = {"num_classes": 20000, "embedding_dim": 128, "loss": {"type": "softmax"}, "chunk_size": 512,
           "check_inputs": False,
           "sampler": {"type": "ann", "sample_rate": 0.05, "scan_rows": 16384, "rebuild_interval": 0},
           "optimizer": {"type": "adamw", "lr": 0.002, "update": "lazy_exact"}}
MICRO = 256  # rows per rank (configs/default.json's train_micro_batch_size_per_gpu)


def _pin(local_rank: int) -> None:
    import torch
    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[local_rank % len(cores)]})


def _slowest(dist, seconds: float) -> float:
    import torch
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def worker_calib(args) -> dict:
    import torch
    import torch.distributed as dist
    p = dist.get_world_size()
    out = {}
    for kind in ("all_reduce", "all_gather"):
        for size in SIZES:
            numel = max(size // 4 // p * p, p)
            buf = torch.ones(numel)
            part = torch.ones(numel // p)
            times = []
            for it in range(args.repeats + 1):
                dist.barrier()
                t = time.perf_counter()
                if kind == "all_reduce":
                    dist.all_reduce(buf)
                else:
                    dist.all_gather_into_tensor(buf, part)
                took = _slowest(dist, time.perf_counter() - t)
                if it:
                    times.append(took)
            out[f"{kind}:{numel * 4}"] = statistics.median(times)
    return out


def worker_step(args) -> dict:
    import torch
    import torch.distributed as dist
    import ds_xc
    from ds_xc.parallel.collectives import all_reduce_mean_
    rank, world = dist.get_rank(), dist.group.WORLD
    head = ds_xc.ClassParallelHead.from_config(SECTION, group=world)
    opt = ds_xc.build_head_optimizer(head, SECTION["optimizer"])
    grads = torch.ones(BACKBONE_PARAMS)  # (params,) the backbone's flat gradient
    gen = torch.Generator().manual_seed(1000 + rank)
    times, cpu, head_s = [], [], []
    for it in range(args.repeats + 2):
        x = torch.randn((MICRO, SECTION["embedding_dim"]), generator=gen).requires_grad_(True)
        y = torch.randint(0, SECTION["num_classes"], (MICRO,), generator=gen)
        dist.barrier()
        t, c = time.perf_counter(), time.process_time()
        loss = head(x, y, batch_sizes=[MICRO] * dist.get_world_size())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t_head = time.perf_counter() - t
        all_reduce_mean_(grads, world)
        c = time.process_time() - c
        took = _slowest(dist, time.perf_counter() - t)
        if it >= 2:
            times.append(took)
            cpu.append(_slowest(dist, c))
            head_s.append(_slowest(dist, t_head))
    return {"step_s": statistics.median(times), "steps": len(times) + 2, "times": times,
            "cpu_s": statistics.median(cpu), "head_s": statistics.median(head_s)}


def worker_compute(args) -> dict:
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from sim_rank import build_rank, make_batch, rank_step
    head, opt = build_rank(SECTION, args.world)
    times, cpu = [], []
    for it in range(args.repeats + 2):
        x, y = make_batch(args.world * MICRO, SECTION["embedding_dim"], SECTION["num_classes"], it)
        c = time.process_time()
        took = rank_step(head, opt, x, y)
        if it >= 2:
            times.append(took)
            cpu.append(time.process_time() - c)
    return {"compute_s": statistics.median(times), "times": times, "cpu_s": statistics.median(cpu)}


def worker(args) -> None:
    local = int(os.environ.get("LOCAL_RANK", "0"))
    _pin(local)
    if args.worker == "compute":
        res = worker_compute(args)
        with open(f"{args.json}.{local}", "w") as fh:
            json.dump(res, fh)
        return
    import torch.distributed as dist
    dist.init_process_group("gloo")
    res = worker_calib(args) if args.worker == "calib" else worker_step(args)
    if dist.get_rank() == 0:
        with open(args.json, "w") as fh:
            json.dump(dict(res, load=load_average()), fh)
    dist.barrier()
    dist.destroy_process_group()


def _run(cmd, timeout):
    paths = [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(paths))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:8])} ... failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")


def run_hosts(mode: str, hosts: int, rate: str, repeats: int, tmp: str) -> dict:
    out = os.path.join(tmp, f"{mode}_{hosts}_{rate}.json")
    counters = out + ".tx"
    script = [os.path.abspath(__file__), "--worker", mode, "--repeats", str(repeats), "--json", out]
    cmd = [HOSTS_SH, "-H", str(hosts), "-r", rate, "-c", counters, "--", os.path.join(BIN, "torchrun"),
           "--nnodes", str(hosts), "--nproc_per_node", str(RANKS_PER_HOST), "--node_rank", "{node}",
           "--master_addr", "{master}", "--master_port", str(free_port())] + script
    _run(cmd, 1200)
    with open(out) as fh, open(counters) as fc:
        return dict(json.load(fh), tx_bytes=json.load(fc)["tx_bytes"])


def run_compute(world: int, repeats: int, tmp: str) -> dict:
    out = os.path.join(tmp, f"compute_{world}.json")
    script = [os.path.abspath(__file__), "--worker", "compute", "--world", str(world), "--repeats", str(repeats),
              "--json", out]
    _run([os.path.join(BIN, "torchrun"), "--nproc_per_node", str(world), "--master_port", str(free_port())]
         + script, 1200)
    ranks = []
    for r in range(world):
        with open(f"{out}.{r}") as fh:
            ranks.append(json.load(fh)["compute_s"])
    return {"compute_s": max(ranks), "per_rank": ranks, "load": load_average()}


def fit_link(samples: list):
    """(alpha s, bandwidth bit/s) from [(kind, group_size, nbytes, seconds)], least squares on seconds
    (the large messages set the bandwidth; a fit on relative error let the small ones, which pass in
    tbf's 128 KB burst at line rate, pull the bandwidth of a 100mbit link to 148 Mbit/s)."""
    import numpy as np
    from ds_xc.cost.comm import ring_steps
    rows, rhs = [], []
    for kind, p, nbytes, secs in samples:
        steps, share = ring_steps(kind, p)
        rows.append([steps, steps * share * nbytes * 8.0])
        rhs.append(secs)
    (alpha, inv_bw), *_ = np.linalg.lstsq(np.array(rows), np.array(rhs), rcond=None)
    return float(max(alpha, 0.0)), float(1.0 / inv_bw)


def predict(hosts: int, link, compute_s: float) -> dict:
    from ds_xc.cost.comm import predict_time, step_collectives, wire_bytes
    p = hosts * RANKS_PER_HOST
    colls = step_collectives({"extreme_classification": SECTION}, world_size=p, batch_sizes=[MICRO] * p,
                             sizes_known=True, backbone_params=BACKBONE_PARAMS)
    comm = predict_time(colls, link, ranks_per_node=RANKS_PER_HOST)
    backbone = predict_time([c for c in colls if c.group == "data"], link, ranks_per_node=RANKS_PER_HOST)
    wire = sum(c.count * wire_bytes(c, RANKS_PER_HOST) for c in colls)
    return {"comm_s": comm, "step_s": compute_s + comm, "wire_bytes": wire, "collectives": len(colls),
            "head_s": compute_s + comm - backbone, "backbone_s": backbone}


def render(args, calib: dict, links: dict, steps: dict, compute: dict, rev: str) -> str:
    cmd = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT)] + sys.argv[1:])
    lines = [f"# Communication model vs namespace runs\n",
             f"Command: `{cmd}`  ", f"Revision: {rev}  ",
             f"Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; load before/after: "
             f"{args.load_before} / {load_average()}  ",
             f"Hosts: network namespaces (benchmarks/netns_hosts.sh, tbf on both veth ends), {RANKS_PER_HOST} ranks "
             "per host, one thread per rank pinned to core local_rank % 2, on a shared 2-core machine.\n",
             "## Calibration (median of the slowest rank, ring model fit per rate)\n",
             "| rate | fitted alpha (us) | fitted bandwidth (Mbit/s) | kind | hosts x ranks | bytes | measured ms | "
             "model ms | model / measured |", "|---|---|---|---|---|---|---|---|---|"]
    from ds_xc.cost.comm import Collective, collective_time
    for (rate, hosts), res in sorted(calib.items()):
        link = links[rate]
        for key, secs in sorted(res.items()):
            if ":" not in key:
                continue
            kind, nbytes = key.split(":")
            c = Collective(kind, kind, hosts * RANKS_PER_HOST, int(nbytes))
            model = collective_time(c, link, RANKS_PER_HOST)
            lines.append(f"| {rate} | {link.latency_s * 1e6:.0f} | {link.bandwidth_bps / 1e6:.1f} | {kind} | "
                         f"{hosts}x{RANKS_PER_HOST} | {int(nbytes)} | {secs * 1e3:.2f} | {model * 1e3:.2f} | "
                         f"{model / secs:.2f} |")
    lines += ["", "## Head step: measured vs compute + predicted communication\n",
              f"Step: ClassParallelHead {json.dumps(SECTION)}, {MICRO} rows per rank, then the mean all-reduce of a "
              f"{BACKBONE_PARAMS:,}-parameter float32 buffer (the backbone's dense reduction). Compute: the same rank's "
              "work without communication (benchmarks/sim_rank.py), P processes at once on one host, the slowest "
              "rank's median. NIC bytes: eth0 tx per host over the whole run (setup, barriers and timing included) "
              "against the model's bytes per step x steps.\n",
              "| hosts x ranks | rate | compute s | predicted comm s | predicted step s | measured step s | "
              "error | head part: measured / predicted s | backbone reduce: measured / predicted s | tx MB/host measured | "
              "tx MB/host model | load |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (rate, hosts), res in sorted(steps.items()):
        comp = compute[(rate, hosts)]["compute_s"]
        pr = predict(hosts, links[rate], comp)
        err = pr["step_s"] / res["step_s"] - 1.0
        tx = statistics.mean(res["tx_bytes"]) / 1e6
        lines.append(f"| {hosts}x{RANKS_PER_HOST} | {rate} | {comp:.3f} | {pr['comm_s']:.3f} | {pr['step_s']:.3f} | "
                     f"{res['step_s']:.3f} | {err * 100:+.1f}% | {res['head_s']:.3f} / {pr['head_s']:.3f} | "
                     f"{res['step_s'] - res['head_s']:.3f} / {pr['backbone_s']:.3f} | {tx:.1f} | {pr['wire_bytes'] * res['steps'] / 1e6:.1f} "
                     f"| {res['load']} |")
    lines += ["", "Per-step times of the step runs (s): " + "; ".join(
        f"{h}x{RANKS_PER_HOST} {r}: " + ", ".join(f"{t:.3f}" for t in res["times"]) for (r, h), res in sorted(steps.items())),
        "", "Compute per rank (s), measured right before each step run: " + "; ".join(
            f"{h}x{RANKS_PER_HOST} {r}: " + ", ".join(f"{t:.3f}" for t in c["per_rank"]) + f" (load {c['load']})"
            for (r, h), c in sorted(compute.items()))]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", choices=("calib", "step", "compute"))
    p.add_argument("--json")
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--hosts", default="2,3")
    p.add_argument("--rates", default="1gbit,100mbit")
    p.add_argument("--out", default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    from ds_xc.cost.comm import Link
    args.load_before, rev = load_average(), git_rev(("ds_xc", "benchmarks"))  # the revision measured
    hosts = [int(h) for h in args.hosts.split(",")]
    rates = args.rates.split(",")
    calib, steps, compute, links = {}, {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="netns_comm") as tmp:
        for h in hosts:
            for rate in rates:  # compute right before its step run: the same load on the shared cores
                compute[(rate, h)] = run_compute(h * RANKS_PER_HOST, args.repeats, tmp)
                print(f"compute P={h * RANKS_PER_HOST}: {compute[(rate, h)]}", flush=True)
                steps[(rate, h)] = run_hosts("step", h, rate, args.repeats, tmp)
                calib[(rate, h)] = run_hosts("calib", h, rate, args.repeats, tmp)
                print(f"{h} hosts {rate}: step {steps[(rate, h)]['step_s']:.3f} s", flush=True)
    for rate in rates:
        samples = [(k.split(":")[0], h * RANKS_PER_HOST, int(k.split(":")[1]), v)
                   for (r, h), res in calib.items() if r == rate for k, v in res.items() if ":" in k]
        alpha, bw = fit_link(samples)
        links[rate] = Link(bw, alpha)
    text = render(args, calib, links, steps, compute, rev)
    print(text)
    write_report(args.out, text)
    if args.out != "-":
        with open(os.path.splitext(args.out)[0] + ".json", "w") as fh:
            json.dump({"links": {r: [lk.bandwidth_bps, lk.latency_s] for r, lk in links.items()},
                       "calib": {f"{r}/{h}": v for (r, h), v in calib.items()},
                       "steps": {f"{r}/{h}": v for (r, h), v in steps.items()},
                       "compute": {f"{r}/{h}": v for (r, h), v in compute.items()}}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

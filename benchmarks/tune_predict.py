"""Benchmark: the cost models' predictions against measurements (issue 21).

For each class count, world size and head config: the time model's step (ds_xc/cost/compute.py,
constants calibrated at the start of this run) against the fastest measured head step
(``step_min_s`` of ds_xc.tune.measure.measure_candidate: forward with the sampler, backward,
optimizer step, index build excluded on both sides), and the memory model's persistent bytes
(ds_xc/cost/memory.py, head and sampler only) against the measured RSS growth after the steps
(freed heap pages handed back first, measure.py) and the bytes of the tensors the head holds.
Random embeddings; every rank its own gloo process.

    python benchmarks/tune_predict.py                          # 1e5 and 1e6 classes, 1 and 2 ranks
    python benchmarks/tune_predict.py --classes 100000 --ranks 1 --out -
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import close_rank, git_rev, init_rank, load_average, spawn_ranks, write_report  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
CONFIGS = {
    "ann defaults": {"sampler": {"type": "ann"}, "optimizer": {"type": "sgd", "lr": 0.1, "momentum": 0.9}},
    "ann 0.05 scan16k lazy": {"sampler": {"type": "ann", "sample_rate": 0.05, "scan_rows": 16384, "rerank": 128},
                              "optimizer": {"type": "sgd", "lr": 0.1, "momentum": 0.9, "update": "lazy"}},
    "uniform 0.1": {"sampler": {"type": "uniform", "sample_rate": 0.1},
                    "optimizer": {"type": "sgd", "lr": 0.1, "momentum": 0.9}},
}


def section(name: str, classes: int) -> dict:
    return dict({"num_classes": classes, "embedding_dim": 128, "loss": {"type": "cosface"}, "chunk_size": 128},
                **CONFIGS[name])


def run_rank(rank: int, world: int, port: int, spec: dict) -> dict:
    torch = init_rank(rank, world, port, spec)
    from ds_xc.cost.calibrate import measure_link
    from ds_xc.tune.measure import measure_candidate
    try:
        link = None
        if world > 1:  # the tuner measures it on its group at every start
            from ds_xc.parallel.groups import new_groups
            link = measure_link(None, new_groups([[r] for r in range(world)]))
        _prewarm(torch, spec)
        gen = torch.Generator().manual_seed(100 + rank)
        local, classes = spec["micro"], spec["classes"]
        batches = [(torch.randn(local, 128, generator=gen), torch.randint(0, classes, (local,), generator=gen))
                   for _ in range(spec["warmup"] + spec["steps"])]
        out = measure_candidate(section(spec["config"], classes), lambda i: batches[i], lambda: iter(batches[:1]),
                                steps=spec["steps"], warmup=spec["warmup"], recall=False)
        return dict(out, link=None if link is None else [link.latency_s, link.bandwidth_bps])
    finally:
        close_rank()


def _prewarm(torch, spec: dict) -> None:
    """One step of a 4,096-class head of the same config, so that code pages, the Hamming op and the
    allocator's arenas are in the RSS baseline rather than counted as the head's memory."""
    from ds_xc.tune.measure import measure_candidate
    x, y = torch.randn(spec["micro"], 128), torch.randint(0, 4096, (spec["micro"],))
    measure_candidate(section(spec["config"], 4096), lambda i: (x, y), lambda: iter([]), steps=1, warmup=1,
                      recall=False)


def predict(name: str, classes: int, world: int, micro: int, constants) -> tuple:
    from ds_xc.cost.compute import predict_step_time
    from ds_xc.cost.memory import estimate_memory
    raw = {"train_micro_batch_size_per_gpu": micro, "extreme_classification": section(name, classes)}
    st = predict_step_time(raw, world_size=world, constants=constants)
    mem = estimate_memory(raw, world_size=world)
    persistent = sum(v for k, v in mem.persistent.items() if k not in ("backbone", "compression", "baseline"))
    return st, persistent


def _run_case(spec: dict, constants, micro: int) -> tuple:
    """One run of a case in fresh rank processes: (time error, rank 0's measurement, the predicted
    step, the predicted persistent bytes), the prediction with the link these ranks measured."""
    from ds_xc.cost.comm import Link
    m = spawn_ranks(spec, run_rank)[0]
    if m["link"] is not None:  # the link the ranks measured before their steps
        constants.set_link(Link(latency_s=m["link"][0], bandwidth_bps=m["link"][1]))
    st, pers = predict(spec["config"], spec["classes"], spec["world"], micro, constants)
    return st.total_s / m["step_min_s"] - 1, m, st, pers


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--classes", default="100000,1000000")
    p.add_argument("--ranks", default="1,2")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--micro", type=int, default=256, help="rows per rank")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each case (fresh processes, the link measured again): the table shows the run "
                        "with the median time error and every run's error (loopback latency is noisy)")
    p.add_argument("--out", default=os.path.join(RESULTS, "tune_predict.md"))
    args = p.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    from ds_xc.cost.calibrate import calibrate
    head = [f"# Cost model: predicted vs measured", "",
            f"Command: `python benchmarks/{os.path.basename(__file__)} {shlex.join(argv or sys.argv[1:])}`  ",
            f"Revision: {git_rev()}; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
            f"one thread per rank; load at start: {load_average()}", ""]
    rows = ["| classes | ranks | config | pred step s | meas step s (min / median) | time error | pred persistent MiB "
            "| meas RSS MiB | meas tensors MiB | memory error (tensors / RSS) | link (us/step, Gbit/s) "
            "| time errors of the repeats | load |",
            "|" + "---|" * 13]
    for classes in [int(c) for c in args.classes.split(",")]:
        for world in [int(r) for r in args.ranks.split(",")]:
            constants = calibrate()  # at this size's start: the load of the moment
            for name in args.configs.split(","):
                spec = {"world": world, "threads": 1, "timeout": 900, "classes": classes, "config": name,
                        "micro": args.micro, "steps": args.steps, "warmup": args.warmup}
                runs = sorted((_run_case(spec, constants, args.micro) for _ in range(max(args.repeats, 1))),
                              key=lambda r: r[0])
                err, m, st, pers = runs[len(runs) // 2]  # the median run (the upper one of an even count)
                errors = ", ".join(f"{r[0]:+.0%}" for r in runs)
                link = "-" if m["link"] is None else f"{m['link'][0] * 1e6:.0f}, {m['link'][1] / 1e9:.2f}"
                mem_t, mem_r = pers / m["tensor_bytes"] - 1, pers / max(m["persistent_bytes"], 1) - 1
                line = (f"| {classes:,} | {world} | {name} | {st.total_s:.3f} | {m['step_min_s']:.3f} / "
                        f"{m['step_s']:.3f} | {err:+.0%} | {pers / 2**20:.1f} | {m['persistent_bytes'] / 2**20:.1f} | "
                        f"{m['tensor_bytes'] / 2**20:.1f} | {mem_t:+.0%} / {mem_r:+.0%} | {link} | {errors} | "
                        f"{load_average()} |")
                rows.append(line)
                print(line, flush=True)
                print("  parts:", json.dumps({k: round(v, 4) for k, v in st.parts.items()}), flush=True)
    text = "\n".join(head + rows) + "\n"
    print(text)
    write_report(args.out, text)


if __name__ == "__main__":
    main()

"""Benchmark: a bfloat16 head vs the float32 head, held-out accuracy at equal steps and memory.

Every run is ``launch/train.py`` through benchmarks/sampler_accuracy.py's harness (same
seeds, the exact head ``sampler: full``, dense optimizer updates, that file's tasks
``text``, ``synthetic`` and ``synthetic_sgd``, their default steps); only
``extreme_classification.dtype`` and ``extreme_classification.optimizer.bf16_update`` differ:

* ``fp32``: float32 weights and states (the reference);
* ``bf16 stochastic_rounding`` / ``bf16 master_fp32`` / ``bf16 plain``: bfloat16 weights, the
  optimizer's update written back by stochastic rounding, from a float32 master copy, or by
  round-to-nearest (ds_xc/head/bf16.py).

Persistent memory (weights + head-optimizer state) is measured from the tensors of a head
and optimizer built in this process with each run's configuration and stepped once on
random data (:func:`ds_xc.head.bf16.persistent_bytes`); one process, so world size 1.

    python benchmarks/bf16_head.py                          # writes benchmarks/results/bf16_head.md
    python benchmarks/bf16_head.py --tasks text --steps 200 --out -
    python benchmarks/bf16_head.py --smoke                  # text 2,000 classes, 20 steps, writes nothing
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sampler_accuracy as sa  # noqa: E402
from harness import ROOT, cpu_model, git_rev, usable_cores, write_report  # noqa: E402

CONFIGS = (("fp32", "float32", None), ("bf16 stochastic_rounding", "bfloat16", "stochastic_rounding"),
           ("bf16 master_fp32", "bfloat16", "master_fp32"), ("bf16 plain", "bfloat16", "plain"))
TARGET_TOP1 = 0.003  # bf16 (chosen mode) within 0.3 point of fp32
TARGET_MEMORY = (0.5, 0.75)  # of fp32's persistent bytes


def config_sets(dtype: str, mode: str | None) -> dict:
    sets = {"extreme_classification.dtype": dtype}
    if mode is not None:
        sets["extreme_classification.optimizer.bf16_update"] = mode
    return sets


def head_section(task: dict, num_classes: int, sets: dict, seed: int) -> dict:
    """The run's extreme_classification section: sampler_accuracy's base config + the task's and our sets."""
    with open(sa.BASE_CONFIG) as fh:
        section = json.load(fh)["extreme_classification"]
    section.update(num_classes=num_classes, seed=seed)
    for key, value in {**task["set"], **sets}.items():
        path = key.split(".")[1:]  # below extreme_classification
        node = section
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return section


def measure_memory(section: dict) -> dict:
    """Persistent bytes of the head of ``section`` and its optimizer after one step (world 1)."""
    import torch

    import ds_xc
    from ds_xc.head.bf16 import persistent_bytes

    head = ds_xc.ClassParallelHead.from_config(section)
    opt = ds_xc.build_head_optimizer(head, section["optimizer"])
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, head.embedding_dim, generator=gen)
    y = torch.randint(0, head.num_classes, (64,), generator=gen)
    head(x, y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    out = persistent_bytes(opt)
    out["elements"] = head.weight.numel()
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tasks", default="text,synthetic,synthetic_sgd", help="comma-separated tasks")
    p.add_argument("--configs", default=",".join(c[0] for c in CONFIGS), help="comma-separated configs")
    p.add_argument("--steps", default=None, help="steps, one value or task=value,... (default: the task's)")
    p.add_argument("--eval_every", default=None, help="evaluation interval, one value or task=value,...")
    p.add_argument("--num_classes", default=None, help="classes, one value or task=value,...")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (each config runs once per seed)")
    p.add_argument("--work_dir", default=os.path.join(os.path.dirname(sa.DEFAULT_WORK), "bf16_head"),
                   help="run summaries and logs (reused unless --rerun)")
    p.add_argument("--rerun", action="store_true")
    p.add_argument("--only_cached", action="store_true", help="report the cached runs only; list the others")
    p.add_argument("--out", default=os.path.join(sa.RESULTS, "bf16_head.md"), help="markdown ('-': none)")
    p.add_argument("--smoke", action="store_true", help="text 2,000 classes, 20 steps, writes nothing")
    args = p.parse_args(argv)
    if args.smoke:
        args.tasks, args.steps, args.eval_every, args.num_classes = "text", "20", "10", "2000"
        args.work_dir, args.out = os.path.join(args.work_dir, "smoke"), "-"
    args.task_list = [t for t in args.tasks.split(",") if t]
    for t in args.task_list:
        if t not in sa.TASKS:
            p.error(f"--tasks: unknown task {t!r}; allowed {sorted(sa.TASKS)}")
    names = {c[0]: c for c in CONFIGS}
    args.config_list = [names[c] if c in names else p.error(f"--configs: unknown {c!r}; allowed {list(names)}")
                        for c in args.configs.split(",") if c]
    args.seed_list = [int(s) for s in args.seeds.split(",") if s]
    args.skipped = []
    return args


def _cached(ns, task: str) -> bool:
    """Whether sampler_accuracy's run cache holds this run's summary."""
    spec = sa.TASKS[task]
    key = sa.run_key(task, {"type": "full"}, ns.steps.get(task, spec["steps"]),
                     ns.num_classes.get(task, spec["num_classes"]), ns.seed, ns.sets)
    return os.path.exists(os.path.join(ns.work_dir, key + ".json"))


def run_all(args) -> list:
    results = []
    for task in args.task_list:
        for label, dtype, mode in args.config_list:
            sets = config_sets(dtype, mode)
            for seed in args.seed_list:
                ns = SimpleNamespace(num_classes=sa._per_task(args.num_classes, int), steps=sa._per_task(args.steps, int),
                                     eval_every=sa._per_task(args.eval_every, int), seed=seed, sets=sets,
                                     work_dir=args.work_dir, rerun=args.rerun)
                if args.only_cached and not _cached(ns, task):
                    args.skipped.append(f"{task} {label} seed {seed}")
                    continue
                res = sa.run_one(ns, task, {"type": "full"}, label)
                res["memory"] = measure_memory(head_section(sa.TASKS[task], res["num_classes"], sets, seed))
                res.update(config=label, seed=seed)
                results.append(res)
    return results


def _mean(values: list) -> float:
    return sum(values) / len(values)


def _summary_rows(rows: list, fp32_total: int | None, fp32_top1: float | None) -> list:
    """One line per config: mean top-1 over seeds, memory and the ratios to fp32."""
    out = []
    for label in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == label]
        mem = mine[0]["memory"]
        top1 = _mean([r["top1"] for r in mine])
        gap = f"{100 * (top1 - fp32_top1):+.2f}" if fp32_top1 is not None else "-"
        ratio = f"{mem['total'] / fp32_total:.2f}" if fp32_total else "-"
        keys = ", ".join(f"{k} {v}" for k, v in sorted(mem["state_keys"].items()))
        per_seed = " / ".join(f"{100 * r['top1']:.2f}" for r in mine)
        out.append(f"| {label} | {per_seed} | {100 * top1:.2f} | {gap} | "
                   f"{_mean([r['top5'] for r in mine]) * 100:.2f} | {mem['weights'] / 2**20:.1f} | "
                   f"{mem['state'] / 2**20:.1f} | {mem['total'] / 2**20:.1f} | {ratio} | "
                   f"{mem['total'] / mem['elements']:.0f} | {keys} | "
                   f"{_mean([r['bench']['wall_s'] for r in mine]):.0f} |")
    return out


def render(results: list, args, command: str, started: str, wall_s: float) -> str:
    lines = ["# bf16 head vs fp32 head: held-out accuracy at equal steps and persistent memory", "",
             f"- command: `{command}`",
             f"- date: {started} (wall time {wall_s:.0f} s, including reused runs)",
             f"- ds_xc at git {git_rev()}",
             f"- CPU: {cpu_model()}, {usable_cores()} cores usable, shared with other jobs (`s` is not comparable)",
             f"- every run: launch/train.py via benchmarks/sampler_accuracy.py's tasks, exact head (`sampler: full`, "
             f"dense updates), seeds {args.seed_list} (xc_train.seed = extreme_classification.seed); "
             "configs/text_exact_20k.json otherwise (global batch 256, AdamW lr 2e-3 with weight decay 0 on the head "
             "unless the task says otherwise)",
             "- memory: weights + head-optimizer state, bytes of the tensors after one step of the same "
             "head and optimizer (world size 1); `B/elt`: bytes per weight element",
             f"- targets: bf16 stochastic_rounding within {100 * TARGET_TOP1:.1f} point top-1 of fp32 at "
             f"{TARGET_MEMORY[0]}-{TARGET_MEMORY[1]}x of its persistent memory",
             *([f"- not run (time; `--only_cached`): {', '.join(args.skipped)}"] if args.skipped else []), ""]
    for task in [t for t in sa.TASKS if any(r["task"] == t for r in results)]:
        rows = [r for r in results if r["task"] == task]
        fp32 = [r for r in rows if r["config"] == "fp32"]
        fp32_top1 = _mean([r["top1"] for r in fp32]) if fp32 else None
        fp32_total = fp32[0]["memory"]["total"] if fp32 else None
        lines += [f"## {task}: {sa.TASKS[task]['describe']}, {rows[0]['num_classes']:,} classes, "
                  f"{rows[0]['steps']} steps", "",
                  "| config | top-1 per seed | mean top-1 | top-1 - fp32 | top-5 | weights MiB | state MiB | "
                  "total MiB | / fp32 | B/elt | state dtypes | s |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
        lines += _summary_rows(rows, fp32_total, fp32_top1)
        steps = [e["step"] for e in rows[0]["evals"]]
        lines += ["", "Top-1 (%) at each evaluation, seed by seed:", "",
                  "| config | seed | " + " | ".join(f"@{s}" for s in steps) + " |",
                  "|---|---:|" + "---:|" * len(steps)]
        for r in rows:
            accs = {e["step"]: e["top1"] for e in r["evals"]}
            lines.append(f"| {r['config']} | {r['seed']} | "
                         + " | ".join(f"{100 * accs[s]:.2f}" if s in accs else "-" for s in steps) + " |")
        sr = [r for r in rows if r["config"] == "bf16 stochastic_rounding"]
        if sr and fp32:
            gap = _mean([r["top1"] for r in sr]) - fp32_top1
            ratio = sr[0]["memory"]["total"] / fp32_total
            ok = gap >= -TARGET_TOP1 and TARGET_MEMORY[0] <= ratio <= TARGET_MEMORY[1]
            lines += ["", f"- target: stochastic_rounding - fp32 = {100 * gap:+.2f} points top-1 (>= "
                      f"{-100 * TARGET_TOP1:.1f}), memory {ratio:.2f}x fp32: **{'met' if ok else 'NOT met'}**"]
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv=None) -> list:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    command = " ".join(shlex.quote(a) for a in ["python", "benchmarks/bf16_head.py", *argv])
    started = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    t0 = time.perf_counter()
    results = run_all(args)
    report = render(results, args, command, started, time.perf_counter() - t0)
    print(report, flush=True)
    write_report(args.out, report)
    return results


if __name__ == "__main__":
    main()

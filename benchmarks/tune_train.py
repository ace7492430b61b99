"""Tuned vs library defaults, trained: run ``launch/tune.py`` on a DeepSpeed JSON, then train the
input and the tuned output with ``launch/train.py`` for the same steps and seed, one process and one
thread each, and compare step time and held-out accuracy (issue 21's "1.5x faster at equal or
better top-1").

    python benchmarks/tune_train.py                                  # synthetic, 10^5 classes, 150 steps
    python benchmarks/tune_train.py --num_classes 1000000 --steps 100 --time_budget_s 420
    python benchmarks/tune_train.py --steps 5 --time_budget_s 20 --out -   # a smoke run, print only

The tuner gets its own fresh cache in a temporary folder, so every run measures its candidates anew.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import ROOT, cpu_model, git_rev, load_average, usable_cores, write_report  # noqa: E402
from ds_xc.tune import changed_keys  # noqa: E402

DEFAULT_CONFIG = os.path.join("benchmarks", "configs", "tune_synthetic_1e6.json")
DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "tune_synthetic_1e5_train.md")


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p))


def _run(cmd: list, timeout: float) -> float:
    """Run ``cmd`` from the repo root; its wall seconds. A failure raises with the tail of stderr."""
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return time.time() - t0


def tuned_changes(before: dict, after: dict) -> list:
    """(dotted key, before, after) for every key the tuner changed (ds_xc.tune.changed_keys finds
    them; an absent key reads as None)."""
    def get(tree, key):
        for part in key.split("."):
            tree = tree.get(part) if isinstance(tree, dict) else None
        return tree
    return [(key, get(before, key), get(after, key)) for key in changed_keys(before, after)]


def train(config: str, args, tmp: str, name: str, seed: int) -> dict:
    """One launch/train.py run of ``config``; its summary JSON plus the command."""
    out = os.path.join(tmp, f"{name}_{seed}_summary.json")
    cmd = [sys.executable, os.path.join("launch", "train.py"), "--deepspeed_config", config,
           "--max_steps", str(args.steps), "--eval_every", "0", "--summary_json", out,
           "--set", f"xc_train.seed={seed}", "--set", f"extreme_classification.seed={seed}"]
    print(f"training {name}, seed {seed}: {args.steps} steps", flush=True)
    _run(cmd, args.timeout)
    with open(out) as fh:
        res = json.load(fh)
    res["command"] = shlex.join(["python"] + cmd[1:])
    res["seed"] = seed
    return res


def render(args, command: str, started: str, tune_s: float, tune_cmd: str, changes: list, rows: list,
           report: str) -> str:
    """rows: [(name, summary)] in seed order, the defaults first for each seed."""
    seeds = sorted({r["seed"] for _, r in rows})
    lines = [f"# Tuned vs library defaults, trained ({args.num_classes:,} classes)\n",
             f"- command: `{command}`", f"- git revision: {git_rev(('ds_xc', 'launch', 'benchmarks'))}",
             (f"- date: {started}; machine: {cpu_model()}, {usable_cores()} usable cores, load {load_average()} "
              f"at the end; every process one thread (OMP_NUM_THREADS=1), run one after the other"),
             (f"- DEFAULTS.json = {args.config} with extreme_classification.num_classes {args.num_classes}; "
              f"TUNED.json = the output of `{tune_cmd}` ({tune_s:.0f} s wall, a fresh cache)"),
             f"- training: {args.steps} steps each, seeds {', '.join(map(str, seeds))}, held-out top-1/top-5 over "
             "all classes\n", "Keys the tuner changed:\n"]
    lines += [f"- `{key}`: `{json.dumps(old)}` -> `{json.dumps(new)}`" for key, old, new in changes] or ["- none"]
    lines += ["", "| config | seed | steps | train s | s/step | speed-up per step | held-out top-1 | top-5 | final loss |",
              "|---|---|---|---|---|---|---|---|---|"]
    per = {}
    for name, r in rows:
        per[(name, r["seed"])] = r["seconds"] / max(r["steps"], 1)
    for name, r in rows:
        speed = per[("library defaults", r["seed"])] / per[(name, r["seed"])]
        lines.append(f"| {name} | {r['seed']} | {r['steps']} | {r['seconds']:.1f} | {per[(name, r['seed'])]:.3f} | "
                     f"{speed:.2f}x | {r['top1']:.4f} | {r['top5']:.4f} | {r['final_loss']:.4f} |")

    def mean(name, key):
        vals = [r[key] for n, r in rows if n == name]
        return sum(vals) / len(vals)
    d_top1, t_top1 = mean("library defaults", "top1"), mean("tuned", "top1")
    speed = (sum(per[("library defaults", s)] for s in seeds) / sum(per[("tuned", s)] for s in seeds))
    verdict = "equal or better" if t_top1 >= d_top1 else "lower"
    lines.append(f"\nMean over {len(seeds)} seed(s): tuned {speed:.2f}x faster per step; top-1 {t_top1:.4f} against "
                 f"{d_top1:.4f}: {verdict} ({t_top1 - d_top1:+.4f}). One run per seed and config: the step-time ratio "
                 "carries the machine's load changes between the runs.")
    lines += ["", "Training commands:", ""] + [f"    {r['command']}" for _, r in rows]
    kept = [line for line in report.replace("# Tuner report", "").strip().splitlines()
            if not line.startswith("|") or not ("| pruned" in line or "| skipped" in line)]
    lines += ["", "## The tuner's report (its table without the pruned and skipped rows)", ""] + kept
    return "\n".join(lines) + "\n"


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=DEFAULT_CONFIG, help="the DeepSpeed JSON the user starts from")
    p.add_argument("--num_classes", type=int, default=100000)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seeds", default="0", help="comma-separated seeds; each trains both configs")
    p.add_argument("--min_recall", type=float, default=0.9)
    p.add_argument("--max_memory_gib", type=float, default=4.0)
    p.add_argument("--time_budget_s", type=float, default=90.0)
    p.add_argument("--tune_args", default="", help="more flags for launch/tune.py, one string")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per subprocess")
    p.add_argument("--out", default=DEFAULT_OUT, help="markdown file ('-': print only)")
    args = p.parse_args(argv)
    command = shlex.join(["python", "benchmarks/tune_train.py"] + (sys.argv[1:] if argv is None else list(argv)))
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    with open(os.path.join(ROOT, args.config)) as fh:
        cfg = json.load(fh)
    cfg["extreme_classification"]["num_classes"] = args.num_classes
    target = ["--min_recall", str(args.min_recall), "--max_memory_gib", str(args.max_memory_gib),
              "--time_budget_s", str(args.time_budget_s), *shlex.split(args.tune_args)]
    with tempfile.TemporaryDirectory() as tmp:
        defaults, tuned = os.path.join(tmp, "DEFAULTS.json"), os.path.join(tmp, "TUNED.json")
        with open(defaults, "w") as fh:
            json.dump(cfg, fh, indent=2)
        tune = [sys.executable, os.path.join("launch", "tune.py"), "--deepspeed_config", defaults, "--out", tuned,
                *target, "--cache", os.path.join(tmp, "cache.json")]
        print(f"tuning {args.config} at {args.num_classes} classes", flush=True)
        tune_s = _run(tune, args.timeout)
        with open(tuned) as fh:
            changes = tuned_changes(cfg, json.load(fh))
        with open(os.path.join(tmp, "TUNED.report.md")) as fh:
            report = fh.read()
        rows = []
        for seed in (int(x) for x in args.seeds.split(",")):
            rows += [("library defaults", train(defaults, args, tmp, "defaults", seed)),
                     ("tuned", train(tuned, args, tmp, "tuned", seed))]
    tune_cmd = shlex.join(["python", "launch/tune.py", "--deepspeed_config", "DEFAULTS.json", *target])
    text = render(args, command, started, tune_s, tune_cmd, changes, rows, report)
    print(text, flush=True)
    write_report(args.out, text)
    return rows


if __name__ == "__main__":
    main()

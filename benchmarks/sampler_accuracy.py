"""Benchmark: held-out accuracy at equal steps for the full, uniform, knn and ann samplers.

Every run is ``launch/train.py`` (DeepSpeed engine, one CPU process) with the same seeds
(data order, backbone and head init), the same steps and evaluations; only the sampler
differs (and ``optimizer.update: lazy`` for the sampled heads, so that a step touches only
the active rows). Three tasks:

* ``synthetic``: the built-in synthetic data, whose classes come in groups of 8 confusable
  classes (cosine ~0.8): the hard-negative task; CosFace (s=64, m=0.35);
* ``synthetic_sgd``: the same task with the head on SGD with momentum (Partial FC's recipe);
  with AdamW on the head, Adam's per-row normalisation turns the tiny gradients of easy
  negatives into full-size steps, which changes what the choice of negatives does;
* ``text``: next-word prediction over the Python standard library, plain softmax
  (configs/text_exact_20k.json as it is: launch/train.py's default job before issue 16).

Each run's ``--summary_json`` (final top-1/top-5, the evaluation history, sampler stats)
is kept under ``--work_dir`` and reused unless ``--rerun``; the report is a markdown
table and a PNG of top-1 against steps.

    python benchmarks/sampler_accuracy.py                 # all three tasks, 7 runs each
    python benchmarks/sampler_accuracy.py --tasks text --rates 0.1 --samplers full,ann
    python benchmarks/sampler_accuracy.py --smoke         # tiny: 2 runs x 20 steps, writes nothing

See benchmarks/README.md ("Sampler accuracy").
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import shlex
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/harness.py
from harness import (ROOT, cpu_model, git_rev, load_average, parse_key_json, usable_cores,  # noqa: E402
                     write_report)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DEFAULT_WORK = os.path.join(os.environ.get("TMPDIR", "/tmp"), "ds_xc_bench", "sampler_accuracy")
TRAIN = os.path.join(ROOT, "launch", "train.py")
# Every task's base config: the 20,000-class exact text job (configs/default.json until issue 16;
# the default job is now a sampled head over word pairs, which would change every task's meaning).
BASE_CONFIG = os.path.join(ROOT, "configs", "text_exact_20k.json")

# Task recipes: train.py flags and --set overrides on top of BASE_CONFIG.
TASKS = {
    "synthetic": {
        "data": "synthetic", "num_classes": 50_000, "steps": 600, "eval_every": 100,
        "set": {"extreme_classification.loss": {"type": "cosface", "scale": 64.0, "margin": 0.35}},
        "describe": "synthetic (groups of 8 confusable classes, Zipf labels), CosFace s=64 m=0.35",
        "short": "CosFace s=64 m=0.35",
    },
    "synthetic_sgd": {
        "data": "synthetic", "num_classes": 50_000, "steps": 600, "eval_every": 100,
        "set": {"extreme_classification.loss": {"type": "cosface", "scale": 64.0, "margin": 0.35},
                "extreme_classification.optimizer": {"type": "sgd", "lr": 0.1, "momentum": 0.9,
                                                     "weight_decay": 5e-4, "update": "dense"}},
        "describe": "the same synthetic task with the head on SGD (lr 0.1, momentum 0.9, weight decay 5e-4: "
                    "the recipe of InsightFace's Partial FC); the backbone stays on AdamW",
        "short": "CosFace, head on SGD",
    },
    "text": {
        "data": "text", "num_classes": 20_000, "steps": 600, "eval_every": 100, "set": {},
        "describe": "text (stdlib next word), softmax",
        "short": "softmax",
    },
}
SAMPLERS = ("full", "uniform", "knn", "ann")
TARGET_GAP = 0.005  # ann at 0.1 within 0.5 point top-1 of full


def sampler_config(name: str, rate: float | None, extra: dict) -> dict:
    if name == "full":
        return {"type": "full"}
    cfg = {"type": name, "sample_rate": rate}
    if name == "ann":
        cfg.update(extra)
    return cfg


def run_key(task: str, sampler: dict, steps: int, num_classes: int, seed: int, sets: dict | None = None) -> str:
    parts = [task, str(num_classes), str(steps), f"seed{seed}", sampler["type"]]
    parts += [f"{k}{v}" for k, v in sorted(sampler.items()) if k != "type"]
    if sets:  # --set overrides: a short digest keeps the file name readable
        digest = hashlib.sha1(json.dumps(sets, sort_keys=True).encode()).hexdigest()[:10]
        parts.append(f"set{digest}")
    return "-".join(str(p).replace("/", "_").replace(" ", "") for p in parts)


def checkpoint_dir(work_dir: str, key: str) -> str:
    return os.path.join(work_dir, key + ".ckpt")


def train_command(task: dict, sampler: dict, steps: int, eval_every: int, num_classes: int, seed: int,
                  summary: str, save_dir: str | None = None, extra_sets: dict | None = None) -> list:
    sets = dict(task["set"], **(extra_sets or {}))  # the sampler's own keys below win
    sets["extreme_classification.sampler"] = sampler
    sets["xc_train.seed"] = seed
    sets["extreme_classification.seed"] = seed
    if sampler["type"] != "full" and "extreme_classification.optimizer.update" not in (extra_sets or {}):
        sets["extreme_classification.optimizer.update"] = "lazy"  # unless --set gives it explicitly
    cmd = [sys.executable, TRAIN, "--deepspeed_config", BASE_CONFIG, "--data", task["data"],
           "--num_classes", str(num_classes), "--max_steps", str(steps), "--eval_every", str(eval_every),
           "--summary_json", summary]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={json.dumps(value, separators=(',', ':'))}"]
    if save_dir:
        cmd += ["--save_dir", save_dir]
    return cmd


def run_one(args, task_name: str, sampler: dict, label: str) -> dict:
    task = TASKS[task_name]
    classes = args.num_classes.get(task_name, task["num_classes"])
    steps, every = args.steps.get(task_name, task["steps"]), args.eval_every.get(task_name, task["eval_every"])
    key = run_key(task_name, sampler, steps, classes, args.seed, args.sets)
    summary = os.path.join(args.work_dir, key + ".json")
    save_dir = checkpoint_dir(args.work_dir, key) if sampler["type"] == "full" else None  # for ann_recall.py
    cmd = train_command(task, sampler, steps, every, classes, args.seed, summary, save_dir, args.sets)
    if args.rerun or not os.path.exists(summary):
        os.makedirs(args.work_dir, exist_ok=True)
        log = os.path.join(args.work_dir, key + ".log")
        load0 = load_average()
        t0 = time.perf_counter()
        print(f"[{task_name}] {label}: {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
        with open(log, "w") as fh:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT).returncode
        if rc != 0:
            raise RuntimeError(f"train.py failed (exit {rc}); see {log}")
        with open(summary) as fh:
            res = json.load(fh)
        res["bench"] = {"wall_s": time.perf_counter() - t0, "load": f"{load0} / {load_average()}",
                        "command": cmd}
        with open(summary, "w") as fh:
            json.dump(res, fh, indent=1)
    with open(summary) as fh:
        res = json.load(fh)
    res.update(task=task_name, label=label, sampler=sampler, key=key, num_classes=classes)
    print(f"[{task_name}] {label}: top-1 {res['top1']:.4f} top-5 {res['top5']:.4f} "
          f"({res['bench']['wall_s']:.0f} s, load {res['bench']['load']})", flush=True)
    return res


# ---------------------------------------------------------------------------- report
def _label(sampler: str, rate) -> str:
    return "full" if sampler == "full" else f"{sampler} {rate:g}"


def render(results: list, args, command: str, started: str, wall_s: float) -> str:
    lines = [
        "# Accuracy at equal steps: full vs uniform vs knn vs ann",
        "",
        f"- command: `{command}`",
        f"- date: {started} (wall time {wall_s:.0f} s, including reused runs' original time: "
        f"{sum(r['bench']['wall_s'] for r in results):.0f} s of training)",
        f"- CPU: {cpu_model()}, {usable_cores()} cores usable; each run is one process "
        f"(launch/train.py, 2 torch threads); the load average (1/5/15 min) at start / end of each run is "
        f"in the `load` column (other jobs share these cores, so `s` is not comparable across runs)",
        f"- ds_xc at git {git_rev()}",
        "- same seeds everywhere (xc_train.seed = extreme_classification.seed = "
        f"{args.seed}: data order, backbone and head init); configs/text_exact_20k.json otherwise (global batch 256, "
        "AdamW lr 2e-3 for backbone and head unless the task says otherwise, chunk_size 128); sampled heads "
        f"use `optimizer.update: {args.sets.get('extreme_classification.optimizer.update', 'lazy')}`",
        *([f"- overrides for every run (`--set`): `{json.dumps(args.sets)}`"] if args.sets else []),
        f"- ANN sampler: library defaults {('plus ' + json.dumps(args.ann_overrides)) if args.ann_overrides else ''}"
        "(see docs/ann.md); knn: library defaults (exact graph, 32 neighbours, rebuilt every 1000 steps)",
        "- accuracy: held-out top-1 / top-5 over all classes (eval_samples 8192 of the held-out set); one "
        "seed, so a difference below about 0.5-1 point is within run-to-run noise (see the README)",
        "",
    ]
    for task_name in [t for t in TASKS if any(r["task"] == t for r in results)]:
        rows = [r for r in results if r["task"] == task_name]
        task = TASKS[task_name]
        full = next((r for r in rows if r["sampler"]["type"] == "full"), None)
        steps = [e["step"] for e in rows[0]["evals"]]
        lines += [f"## {task_name}: {task['describe']}, {rows[0]['num_classes']:,} classes, "
                  f"{rows[0]['steps']} steps", ""]
        lines.append("| sampler | rate | " + " | ".join(f"top-1 @{s}" for s in steps)
                     + " | final top-5 | top-1 - full | active | kept | cut | fill | recall_active@10 | "
                       "softmax mass | s | samples/s | load |")
        lines.append("|---|---:|" + "---:|" * len(steps) + "---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for r in rows:
            st = r.get("sampler_stats", {})
            accs = {e["step"]: e["top1"] for e in r["evals"]}
            gap = f"{100 * (r['top1'] - full['top1']):+.2f}" if full is not None else "-"
            rate = r["sampler"].get("sample_rate", 1.0)
            rec = st.get("recall_active@10")
            mass = st.get("softmax_mass")
            lines.append(
                f"| {r['sampler']['type']} | {rate:g} | "
                + " | ".join(f"{100 * accs[s]:.2f}" if s in accs else "-" for s in steps)
                + f" | {100 * r['top5']:.2f} | {gap} | {st.get('active', '-')} | {st.get('kept', '-')} | "
                  f"{st.get('cut', '-')} | {st.get('fill', '-')} | {'-' if rec is None else f'{rec:.3f}'} | "
                  f"{'-' if mass is None else f'{mass:.3f}'} | {r['bench']['wall_s']:.0f} | "
                  f"{r['samples_per_s']:.0f} | {r['bench']['load']} |")
        lines.append("")
        lines += _targets(rows, full)
        lines.append("")
    lines += ["Top-1 in percent at each evaluation step. `active`, `kept`, `cut`, `fill`: the last step's "
              "active-set counts (kept = retrieved candidates that fit the budget, cut = those that did not, "
              "fill = uniform filler); `recall_active@10` and `softmax mass`: the ANN sampler's own quality "
              "metric on the last measured training batch (metrics_interval), against the exact logits.", ""]
    return "\n".join(lines) + "\n"


def _targets(rows: list, full) -> list:
    out = []

    def find(kind, rate):
        return next((r for r in rows if r["sampler"]["type"] == kind and r["sampler"].get("sample_rate") == rate), None)

    ann1, ann01, uni01 = find("ann", 0.1), find("ann", 0.01), find("uniform", 0.01)
    if full is not None and ann1 is not None:
        gap = full["top1"] - ann1["top1"]
        ok = gap <= TARGET_GAP
        out.append(f"- target: ann 0.1 within 0.5 point top-1 of full: full {100 * full['top1']:.2f}, ann "
                   f"{100 * ann1['top1']:.2f} (ann - full = {-100 * gap:+.2f} points): **{'met' if ok else 'NOT met'}**")
    if ann01 is not None and uni01 is not None:
        ok = ann01["top1"] > uni01["top1"]
        out.append(f"- target: ann 0.01 better than uniform 0.01: ann {100 * ann01['top1']:.2f}, uniform "
                   f"{100 * uni01['top1']:.2f}: **{'met' if ok else 'NOT met'}**")
    return out


def plot(results: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t in TASKS if any(r["task"] == t for r in results)]
    fig, axes = plt.subplots(1, len(tasks), figsize=(6.5 * len(tasks), 4.6), squeeze=False)
    colors = {"full": "black", "uniform": "tab:blue", "knn": "tab:green", "ann": "tab:red"}
    styles = {0.1: "-", 0.01: "--"}
    for ax, task_name in zip(axes[0], tasks):
        for r in [r for r in results if r["task"] == task_name]:
            kind, rate = r["sampler"]["type"], r["sampler"].get("sample_rate")
            xs = [0] + [e["step"] for e in r["evals"]]
            ys = [0.0] + [100 * e["top1"] for e in r["evals"]]
            ax.plot(xs, ys, color=colors.get(kind, "grey"), linestyle=styles.get(rate, ":") if rate else "-",
                    linewidth=2.2 if kind == "full" else 1.5, marker="o", markersize=3, label=_label(kind, rate))
        classes = next(r["num_classes"] for r in results if r["task"] == task_name)
        ax.set_title(f"{task_name}: {classes:,} classes, {TASKS[task_name]['short']}")
        ax.set_xlabel("training step")
        ax.set_ylabel("held-out top-1 (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Top-1 vs steps (same seeds; solid: sample rate 0.1, dashed: 0.01)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", flush=True)


# ---------------------------------------------------------------------------- main
def _per_task(value: str | None, cast) -> dict:
    """'600' (every task) or 'synthetic=600,text=400' -> {task: value}."""
    if not value:
        return {}
    if "=" not in value:
        return {t: cast(value) for t in TASKS}
    out = {}
    for item in value.split(","):
        k, _, v = item.partition("=")
        out[k.strip()] = cast(v)
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tasks", default="synthetic,synthetic_sgd,text", help="comma-separated tasks")
    p.add_argument("--samplers", default=",".join(SAMPLERS), help="comma-separated samplers")
    p.add_argument("--rates", default="0.1,0.01", help="sample rates of the sampled heads")
    p.add_argument("--num_classes", default=None, help="classes, one value or task=value,... "
                   "(default " + ", ".join(f"{k}={v['num_classes']}" for k, v in TASKS.items()) + ")")
    p.add_argument("--steps", default=None, help="steps, one value or task=value,... (default "
                   + ", ".join(f"{k}={v['steps']}" for k, v in TASKS.items()) + ")")
    p.add_argument("--eval_every", default=None, help="evaluation interval, one value or task=value,...")
    p.add_argument("--seed", type=int, default=0, help="xc_train.seed and extreme_classification.seed")
    p.add_argument("--ann", action="append", default=[], metavar="KEY=JSON",
                   help="override an ann sampler key (repeatable), e.g. --ann groups=4")
    p.add_argument("--set", dest="set_items", action="append", default=[], metavar="KEY=JSON",
                   help="config override for every run (as train.py --set), e.g. "
                        "'extreme_classification.optimizer={\"type\":\"sgd\",\"lr\":0.1,\"momentum\":0.9}'")
    p.add_argument("--work_dir", default=DEFAULT_WORK, help="where run summaries and logs are kept")
    p.add_argument("--rerun", action="store_true", help="retrain even when a run's summary exists")
    p.add_argument("--out", default=None, help="markdown file (default benchmarks/results/sampler_accuracy.md; '-': none)")
    p.add_argument("--plot", default=None, help="PNG (default benchmarks/results/sampler_accuracy.png; '-': none)")
    p.add_argument("--smoke", action="store_true", help="text 2,000 classes, full and ann 0.1, 20 steps, "
                   "writes nothing")
    args = p.parse_args(argv)
    args.num_classes, args.steps = _per_task(args.num_classes, int), _per_task(args.steps, int)
    args.eval_every = _per_task(args.eval_every, int)
    args.sets = parse_key_json(args.set_items, "--set", p.error)
    args.ann_overrides = parse_key_json(args.ann, "--ann", p.error)
    if args.smoke:
        args.tasks, args.samplers, args.rates = "text", "full,ann", "0.1"
        args.num_classes, args.steps, args.eval_every = {"text": 2000}, {"text": 20}, {"text": 10}
        args.work_dir = os.path.join(args.work_dir, "smoke")
        args.out = args.out or "-"
        args.plot = args.plot or "-"
    args.out = args.out or os.path.join(RESULTS, "sampler_accuracy.md")
    args.plot = args.plot or os.path.join(RESULTS, "sampler_accuracy.png")
    args.task_list = [t.strip() for t in args.tasks.split(",") if t.strip()]
    for t in args.task_list:
        if t not in TASKS:
            p.error(f"--tasks: unknown task {t!r}; allowed {sorted(TASKS)}")
    args.sampler_list = [s.strip() for s in args.samplers.split(",") if s.strip()]
    args.rate_list = [float(r) for r in args.rates.split(",") if r.strip()]
    return args


def runs(args) -> list:
    """(task, sampler config, label) in run order: full first, then each rate's sampled heads."""
    out = []
    extra = dict({"metrics_interval": 100}, **args.ann_overrides)
    for task in args.task_list:
        if "full" in args.sampler_list:
            out.append((task, sampler_config("full", None, {}), "full"))
        for rate in args.rate_list:
            for s in args.sampler_list:
                if s != "full":
                    out.append((task, sampler_config(s, rate, extra), _label(s, rate)))
    return out


def main(argv=None) -> list:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    command = " ".join(shlex.quote(a) for a in ["python", "benchmarks/sampler_accuracy.py", *argv])
    started = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    t0 = time.perf_counter()
    results = [run_one(args, task, sampler, label) for task, sampler, label in runs(args)]
    report = render(results, args, command, started, time.perf_counter() - t0)
    print(report)
    write_report(args.out, report)
    if args.plot != "-":
        plot(results, args.plot)
    return results


if __name__ == "__main__":
    main()

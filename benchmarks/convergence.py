"""Iterations to accuracy: the default recipe against the adaptive-lr recipe (issue 18).

For each task and seed, both recipes train with launch/train.py and the same held-out
evaluation (top-1 over all classes, every ``--eval_every`` steps, the task's eval_samples);
the target is the top-1 the default recipe reaches at its last step, and the result is the
first evaluated step at which the adaptive recipe reaches it (``iterations``), against the
default's last step: ``fewer = 1 - iterations / default_steps`` (the issue asks >= 40%).

    python benchmarks/convergence.py                     # text and glyphs, seeds 0 and 1, 2 runs at a time
    python benchmarks/convergence.py --tasks text --seeds 0

Each run's summary (train.py --summary_json, plus the command, wall time, load and the git
revision it ran at) is kept in ``--work_dir``; a run whose summary exists is reused (``--rerun``
to redo it), so an interrupted grid finishes where it stopped. The table goes to
benchmarks/results/convergence.md, the plot (top-1 against steps, both tasks) to convergence.png.
One thread per process (OMP_NUM_THREADS=1), ``--jobs`` processes at a time, under ``nice``.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import ROOT, cpu_model, git_rev, load_average, usable_cores, write_report  # noqa: E402

TRAIN = os.path.join(ROOT, "launch", "train.py")
RESULTS = os.path.join(ROOT, "benchmarks", "results")
TASKS = {  # task -> the default recipe, the adaptive recipe, steps
    "text": {"default": "configs/default.json", "adaptive": "configs/text_adaptive.json", "steps": 1200,
             "what": "text, word pairs: ANN head over 100,000 classes (configs/default.json)"},
    "glyphs": {"default": "configs/glyphs_cosface.json", "adaptive": "configs/glyphs_adaptive.json", "steps": 1000,
               "what": "glyphs: CosFace, exact head over 20,000 classes (configs/glyphs_cosface.json)"},
}
RECIPES = ("default", "adaptive")


def run_command(task: str, recipe: str, seed: int, steps: int, every: int, summary: str) -> list:
    cmd = ["nice", "-n", "5", sys.executable, TRAIN, "--deepspeed_config", os.path.join(ROOT, TASKS[task][recipe]),
           "--max_steps", str(steps), "--eval_every", str(every), "--summary_json", summary,
           "--set", f"xc_train.seed={seed}", "--set", f"extreme_classification.seed={seed}"]
    return cmd


def run_steps(args, task: str, recipe: str) -> int:
    """The default runs its task's steps; the adaptive recipe as many, or --adaptive_steps (enough to
    see whether it reaches the target 40% earlier, at less CPU)."""
    if recipe == "adaptive" and args.adaptive_steps.get(task):
        return args.adaptive_steps[task]
    return TASKS[task]["steps"]


def _summary_path(args, task: str, recipe: str, seed: int) -> str:
    steps = run_steps(args, task, recipe)
    return os.path.join(args.work_dir, f"{task}_{recipe}_s{seed}_{steps}steps_every{args.eval_every}.json")


def run_one(args, task: str, recipe: str, seed: int) -> dict:
    """One train.py run (or its kept summary): the summary with 'bench' (command, wall, load, revision)."""
    steps = run_steps(args, task, recipe)
    summary = _summary_path(args, task, recipe, seed)
    key = os.path.basename(summary)[:-5]
    if args.rerun or not os.path.exists(summary):
        os.makedirs(args.work_dir, exist_ok=True)
        cmd = run_command(task, recipe, seed, steps, args.eval_every, summary)
        rev, load0, t0 = git_rev(("ds_xc", "launch", "configs")), load_average(), time.perf_counter()
        print(f"[{key}] {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        with open(os.path.join(args.work_dir, key + ".log"), "w") as fh:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=env).returncode
        if rc != 0:
            raise RuntimeError(f"{key}: train.py failed (exit {rc}); see {args.work_dir}/{key}.log")
        with open(summary) as fh:
            res = json.load(fh)
        res["samples_per_step"] = _global_batch(task, recipe)
        res["bench"] = {"wall_s": time.perf_counter() - t0, "load": f"{load0} / {load_average()}",
                        "command": cmd, "revision": rev, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        with open(summary, "w") as fh:
            json.dump(res, fh, indent=1)
        print(f"[{key}] done in {res['bench']['wall_s']:.0f} s: top-1 {res['top1']:.4f}", flush=True)
    with open(summary) as fh:
        return json.load(fh)


def _global_batch(task: str, recipe: str) -> int:
    """Samples per optimizer step of a recipe (one process: micro batch x accumulation)."""
    with open(os.path.join(ROOT, TASKS[task][recipe])) as fh:
        raw = json.load(fh)
    return raw["train_micro_batch_size_per_gpu"] * raw.get("gradient_accumulation_steps", 1)


def curve(res: dict) -> list:
    """[(step, top-1)] of a run's evaluations."""
    return [(e["step"], e["top1"]) for e in res["evals"]]


def iterations_to(res: dict, target: float):
    """The first evaluated step with top-1 >= target (None: not reached)."""
    return next((s for s, t in curve(res) if t >= target), None)


def compare(runs: dict, task: str, seed: int) -> dict:
    base, adap = runs[task, "default", seed], runs[task, "adaptive", seed]
    steps = curve(base)[-1][0]
    target = base["top1"]
    its = iterations_to(adap, target)
    batch = {r: runs[task, r, seed]["samples_per_step"] for r in RECIPES}
    return {"task": task, "seed": seed, "target": target, "default_steps": steps,
            "default_first": iterations_to(base, target), "adaptive_steps": its, "adaptive_ran": curve(adap)[-1][0],
            "fewer": None if its is None else 1.0 - its / steps, "adaptive_final": adap["top1"],
            "adaptive_best": max(t for _, t in curve(adap)),
            "fewer_samples": None if its is None else 1.0 - its * batch["adaptive"] / (steps * batch["default"]),
            "batch": batch}


def table(rows: list) -> list:
    out = ["| task | seed | default top-1 at its last step (target) | default steps | default first reaches it at "
           "| adaptive reaches it at | fewer iterations | global batch default / adaptive | fewer samples "
           "| adaptive ran | adaptive top-1 at its last step | adaptive best top-1 |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        its = f"not reached in {r['adaptive_ran']}" if r["adaptive_steps"] is None else str(r["adaptive_steps"])
        fewer = "-" if r["fewer"] is None else f"{100 * r['fewer']:.0f}%"
        fewer_s = "-" if r["fewer_samples"] is None else f"{100 * r['fewer_samples']:.0f}%"
        out.append(f"| {r['task']} | {r['seed']} | {r['target']:.4f} | {r['default_steps']} | {r['default_first']} "
                   f"| {its} | {fewer} | {r['batch']['default']} / {r['batch']['adaptive']} | {fewer_s} "
                   f"| {r['adaptive_ran']} | {r['adaptive_final']:.4f} | {r['adaptive_best']:.4f} |")
    return out


def curves_table(runs: dict, task: str, seeds: list) -> list:
    steps = [s for s, _ in curve(runs[task, "default", seeds[0]])]
    out = ["| recipe | seed | " + " | ".join(f"@{s}" for s in steps) + " | final lr |",
           "|---|---:|" + "---:|" * len(steps) + "---:|"]
    for recipe in RECIPES:
        for seed in seeds:
            res = runs[task, recipe, seed]
            top = dict(curve(res))
            out.append(f"| {recipe} | {seed} | " + " | ".join(f"{top[s]:.4f}" if s in top else "-" for s in steps)
                       + f" | {res.get('final_lr', float('nan')):.3g} |")
    return out


def plot(runs: dict, tasks: list, done: list, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4.2), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        seeds = [s for t, s in done if t == task]
        for recipe, color in zip(RECIPES, ("tab:blue", "tab:red")):
            for seed, style in zip(seeds, ("-", "--", ":")):
                xs, ys = zip(*curve(runs[task, recipe, seed]))
                ax.plot(xs, ys, style, color=color, marker=".", label=f"{recipe}, seed {seed}")
        for seed in seeds:
            ax.axhline(runs[task, "default", seed]["top1"], color="gray", lw=0.6, ls=":")
        ax.set_title(f"{task}: held-out top-1 (dotted: the default's final)")
        ax.set_xlabel("optimizer steps")
        ax.set_ylabel("top-1")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}", flush=True)


def report(args, runs: dict, rows: list, wall: float) -> str:
    revs = sorted({r["bench"]["revision"] for r in runs.values()})
    lines = ["# Iterations to accuracy: default recipe vs adaptive learning rate (issue 18)", "",
             f"- command: `{' '.join(shlex.quote(a) for a in sys.argv)}`",
             f"- date: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} (this invocation {wall:.0f} s; "
             "kept runs were reused)",
             f"- CPU: {cpu_model()}, {usable_cores()} cores usable, shared with other jobs; each run is one "
             "process of launch/train.py with OMP_NUM_THREADS=1 under nice, at most "
             f"{args.jobs} at a time (load at start / end of each run in the per-run list below)",
             f"- ds_xc at git {', '.join(revs)} (the revision each run ran at; this report written at "
             f"{git_rev(('ds_xc', 'launch', 'configs'))})",
             f"- held-out top-1 over all classes every {args.eval_every} steps, the same evaluation for both "
             "recipes; target = the default recipe's top-1 at its last step; 'adaptive reaches it at' = "
             "the first evaluated step at or above it (so a multiple of the evaluation interval)",
             "- seeds: xc_train.seed = extreme_classification.seed (data order, backbone and head init)",
             "- the adaptive recipes were tuned on these two tasks (docs/convergence.md), so this is not a held-out "
             "test of them; they train with twice the default's global batch, so 'fewer samples' is the share of "
             "training samples saved (0% = as many samples as the default's whole run)",
             f"- the adaptive runs stop after {', '.join(f'{t} {run_steps(args, t, RECIPES[1])}' for t in args.tasks)} "
             "steps (--adaptive_steps): enough to see whether they reach the target with at least 40% fewer "
             "iterations", ""]
    lines += ["## Iterations to the default's final top-1", ""] + table(rows) + [""]
    for task in args.tasks:
        seeds = sorted({s for t, _, s in runs if t == task})
        if seeds:
            lines += [f"## {task}: {TASKS[task]['what']}, {TASKS[task]['steps']} steps; adaptive: "
                      f"{TASKS[task]['adaptive']}", ""] + curves_table(runs, task, seeds) + [""]
    if args.missing:
        lines += ["## Not measured", "", "These runs of the grid did not run (no summary in the work folder), so "
                  "their task and seed are not in the tables above:", ""]
        lines += [f"- {t} {r} seed {s}" for t, r, s in args.missing] + [""]
    lines += ["## Runs", ""]
    for (task, recipe, seed), res in sorted(runs.items()):
        b = res["bench"]
        lines.append(f"- {task} {recipe} seed {seed}: {b['wall_s']:.0f} s wall, load {b['load']}, git "
                     f"{b['revision']}, {b['date']}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default="text,glyphs", help="comma-separated, of " + ", ".join(TASKS))
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--eval_every", type=int, default=100)
    p.add_argument("--jobs", type=int, default=2, help="train.py processes at a time")
    p.add_argument("--recipes", default=",".join(RECIPES), help="run only these now (the report needs both: "
                   "the others must be kept runs)")
    p.add_argument("--adaptive_steps", action="append", default=[], metavar="TASK=STEPS",
                   help="train the adaptive recipe this many steps on TASK (default: the task's steps)")
    p.add_argument("--work_dir", default=os.path.join(RESULTS, "convergence_runs"))
    p.add_argument("--rerun", action="store_true", help="run again even where a kept summary exists")
    p.add_argument("--out", default=os.path.join(RESULTS, "convergence.md"))
    p.add_argument("--plot", default=os.path.join(RESULTS, "convergence.png"))
    args = p.parse_args(argv)
    args.tasks = [t for t in args.tasks.split(",") if t]
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    args.adaptive_steps = {k: int(v) for k, _, v in (a.partition("=") for a in args.adaptive_steps)}
    now = [r for r in args.recipes.split(",") if r]
    t0 = time.perf_counter()
    grid = [(t, r, s) for t in args.tasks for s in args.seeds for r in RECIPES]
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        list(pool.map(lambda k: run_one(args, *k), [k for k in grid if k[1] in now]))
    args.missing = [k for k in grid if not os.path.exists(_summary_path(args, *k))]
    if args.missing:  # report the (task, seed) pairs whose two runs exist, and name the rest
        print(f"runs missing (not reported): {args.missing}", flush=True)
    done = [(t, s) for t in args.tasks for s in args.seeds
            if all((t, r, s) not in args.missing for r in RECIPES)]
    runs = {(t, r, s): run_one(args, t, r, s) for t, s in done for r in RECIPES}
    rows = [compare(runs, t, s) for t, s in done]
    print("\n".join(table(rows)))
    write_report(args.out, report(args, runs, rows, time.perf_counter() - t0))
    if args.plot != "-" and runs:
        plot(runs, sorted({t for t, _ in done}, key=args.tasks.index), done, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())

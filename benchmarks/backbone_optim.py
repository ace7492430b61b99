"""Backbone optimizers on a launch/train.py task at a large batch: AdamW (the recipes' default)
against LAMB and LARS (ds_xc/optim/, docs/optimizers.md), each at a few learning rates.

Every variant is one ``python launch/train.py`` process (1 rank, 1 thread) on the same config,
seed and steps, changing only the DeepSpeed ``optimizer`` section and the micro-batch; the
head keeps its optimizer. The table gives held-out top-1/top-5 at the end and the loss.

    python benchmarks/backbone_optim.py                            # text, 20k classes, batch 1024, 150 steps
    python benchmarks/backbone_optim.py --steps 20 --out -         # a smoke run, print only
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

DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "backbone_optim.md")
VARIANTS = {  # name: the DeepSpeed optimizer section
    "adamw 0.002": {"type": "AdamW", "params": {"lr": 0.002, "weight_decay": 0.0, "torch_adam": True}},
    "adamw 0.006": {"type": "AdamW", "params": {"lr": 0.006, "weight_decay": 0.0, "torch_adam": True}},
    "adamw 0.01": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0, "torch_adam": True}},
    "lamb 0.002": {"type": "Lamb", "params": {"lr": 0.002, "eps": 1e-6, "exclude_bias_and_norm": True}},
    "lamb 0.01": {"type": "Lamb", "params": {"lr": 0.01, "eps": 1e-6, "exclude_bias_and_norm": True}},
    "lamb 0.02": {"type": "Lamb", "params": {"lr": 0.02, "eps": 1e-6, "exclude_bias_and_norm": True}},
    "lars 0.5": {"type": "LARS", "params": {"lr": 0.5, "momentum": 0.9, "trust_coefficient": 0.01,
                                            "exclude_bias_and_norm": True}},
    "lars 2.0": {"type": "LARS", "params": {"lr": 2.0, "momentum": 0.9, "trust_coefficient": 0.01,
                                            "exclude_bias_and_norm": True}},
}


def run_variant(config: str, section: dict, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "summary.json")
        cmd = [sys.executable, os.path.join(ROOT, "launch", "train.py"), "--deepspeed_config", config,
               "--max_steps", str(args.steps), "--eval_every", "0", "--summary_json", out,
               "--set", f"optimizer={json.dumps(section)}",
               "--set", f"train_micro_batch_size_per_gpu={args.batch}",
               "--set", f"xc_train.seed={args.seed}", "--set", f"extreme_classification.seed={args.seed}",
               "--set", f"xc_train.eval_samples={args.eval_samples}"]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
            p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p))
        t0 = time.time()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout,
                              check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        with open(out) as fh:
            res = json.load(fh)
    res["wall"] = time.time() - t0
    return res


def render(rows: list, args, command: str, started: str, wall: float) -> str:
    lines = ["# Backbone optimizers at a large batch: AdamW vs LAMB vs LARS (launch/train.py)\n",
             f"- command: `{command}`", f"- git revision: {git_rev(('ds_xc', 'launch', 'benchmarks'))}",
             (f"- date: {started}, wall time {wall / 60:.1f} min; machine: {cpu_model()}, {usable_cores()} usable "
              f"cores, load {load_average()} at the end (shared with other jobs)"),
             (f"- config {args.config}, 1 rank, 1 thread, micro-batch {args.batch}, {args.steps} steps, seed "
              f"{args.seed}; the head keeps the config's optimizer; held-out top-1/top-5 over all classes on "
              f"{args.eval_samples} samples; one seed: differences under about 1 point are noise\n"),
             "| variant | optimizer section | top-1 | top-5 | final loss | s/step |", "|---|---|---|---|---|---|"]
    for name, r in rows:
        lines.append(f"| {name} | `{json.dumps(VARIANTS[name])}` | {r['top1']:.4f} | {r['top5']:.4f} | "
                     f"{r['final_loss']:.3f} | {r['seconds'] / max(r['steps'], 1):.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/text_exact_20k.json")
    p.add_argument("--variants", default="adamw 0.002;adamw 0.006;lamb 0.002;lamb 0.01;lars 0.5;lars 2.0", help=f"';'-separated, from: {', '.join(VARIANTS)}")
    p.add_argument("--batch", type=int, default=1024, help="train_micro_batch_size_per_gpu (1 rank)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval_samples", type=int, default=16384)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--out", default=DEFAULT_OUT, help="markdown file ('-': print only)")
    args = p.parse_args(argv)
    command = "python benchmarks/backbone_optim.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    started, t0 = datetime.datetime.now().isoformat(timespec="seconds"), time.time()
    config = os.path.join(ROOT, args.config)
    rows = []
    for name in args.variants.split(";"):
        res = run_variant(config, VARIANTS[name], args)
        rows.append((name, res))
        print(f"{name}: top-1 {res['top1']:.4f} top-5 {res['top5']:.4f} loss {res['final_loss']:.3f} "
              f"({res['wall']:.0f} s)", flush=True)
    report = render(rows, args, command, started, time.time() - t0)
    print(report)
    write_report(args.out, report)
    return rows


if __name__ == "__main__":
    main()

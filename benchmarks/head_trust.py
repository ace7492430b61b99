"""Experiment: a per-row trust ratio for the head optimizer (issue 18, item 2) against the head's
SGD with momentum, on the synthetic task of launch/train.py. Not shipped in ds_xc unless it helps.

The per-row optimizer is LARS applied to every class row c of the head shard W (C, d):

    local_c = eta ||W_c|| / (||G_c|| + weight_decay ||W_c||)    (1 where a norm is 0)
    V_c = momentum V_c + lr local_c (G_c + weight_decay W_c),   W_c = W_c - V_c

Each variant is one ``launch/train.py`` process (1 rank, 1 thread), the same config, seed and
steps; the per-row variants replace the engine's head optimizer right after ``ds_xc.initialize``
(dense updates with the full sampler, so every row gets its gradient every step).

    python benchmarks/head_trust.py                 # writes benchmarks/results/head_trust.md
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

import torch  # noqa: E402

from benchmarks.harness import ROOT, cpu_model, git_rev, load_average, usable_cores, write_report  # noqa: E402

DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "head_trust.md")
HEAD = {"num_classes": 20000, "loss": {"type": "cosface", "scale": 64.0, "margin": 0.35}, "sampler": {"type": "full"},
        "optimizer": {"type": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.0005, "update": "dense",
                      "lr_schedule": "constant"}}  # constant: the per-row variants keep their own lr
VARIANTS = {"sgd (ds_xc's head SGD)": None,  # name: (lr, eta) of the per-row optimizer, None = the config's
            "row-lars lr 1 eta 0.01": (1.0, 0.01), "row-lars lr 5 eta 0.01": (5.0, 0.01),
            "row-lars lr 20 eta 0.01": (20.0, 0.01), "row-lars lr 0.25 eta 0.01": (0.25, 0.01),
            "row-lars lr 0.05 eta 0.01": (0.05, 0.01)}


class RowLars(torch.optim.Optimizer):
    """LARS with one trust ratio per row of each 2-D parameter (the head shard: a row is a class)."""

    def __init__(self, params, lr, momentum=0.9, weight_decay=0.0, eta=0.01):
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "eta": eta})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.to_dense() if p.grad.is_sparse else p.grad
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                wd = group["weight_decay"]
                wn = torch.linalg.vector_norm(p, dim=1, keepdim=True)  # (C, 1)
                gn = torch.linalg.vector_norm(g, dim=1, keepdim=True)
                ok = (wn > 0) & (gn > 0)
                local = torch.where(ok, group["eta"] * wn / torch.where(ok, gn + wd * wn, 1.0), 1.0)
                buf.mul_(group["momentum"]).add_(group["lr"] * local * (g + wd * p))
                p.sub_(buf)


def worker(args) -> None:
    """One variant in this process: launch/train.py's main with the head optimizer swapped."""
    import ds_xc
    sys.path.insert(0, os.path.join(ROOT, "launch"))
    import train
    setting = VARIANTS[args.worker]
    original = ds_xc.initialize

    def initialize(*a, **kw):
        xc = original(*a, **kw)
        if setting is not None:
            opt = HEAD["optimizer"]
            xc.head_optimizer = RowLars(xc.head.parameters(), lr=setting[0], momentum=opt["momentum"],
                                        weight_decay=opt["weight_decay"], eta=setting[1])
        return xc
    train.ds_xc.initialize = initialize
    train.main(args.train_argv)


def run_variant(name: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "summary.json")
        train_argv = ["--deepspeed_config", os.path.join(ROOT, "configs", "text_exact_20k.json"), "--data", "synthetic",
                      "--max_steps", str(args.steps), "--eval_every", "0", "--summary_json", out,
                      "--set", f"xc_train.seed={args.seed}", "--set", f"extreme_classification.seed={args.seed}",
                      "--set", f"xc_train.eval_samples={args.eval_samples}"]
        train_argv += [a for k, v in HEAD.items() for a in ("--set", f"extreme_classification.{k}={json.dumps(v)}")]
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--"] + train_argv
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
        with open(out) as fh:
            return json.load(fh)


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval_samples", type=int, default=8192)
    p.add_argument("--variants", default=";".join(list(VARIANTS)[:4]))
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("train_argv", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return []
    command = "python benchmarks/head_trust.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    started, t0 = datetime.datetime.now().isoformat(timespec="seconds"), time.time()
    rows = []
    for name in args.variants.split(";"):
        res = run_variant(name, args)
        rows.append((name, res))
        print(f"{name}: top-1 {res['top1']:.4f} top-5 {res['top5']:.4f} loss {res['final_loss']:.3f}", flush=True)
    lines = ["# Head optimizer: a per-row trust ratio (LARS per class row) vs the head's SGD\n",
             f"- command: `{command}`", f"- git revision: {git_rev(('ds_xc', 'launch', 'benchmarks'))}",
             (f"- date: {started}, wall time {(time.time() - t0) / 60:.1f} min; machine: {cpu_model()}, "
              f"{usable_cores()} usable cores, load {load_average()} at the end (shared with other jobs)"),
             (f"- synthetic data, head {json.dumps(HEAD)}, backbone AdamW (configs/text_exact_20k.json), 1 rank, "
              f"{args.steps} steps of 256, seed {args.seed}; held-out top-1/top-5 on {args.eval_samples} samples\n"),
             "| head optimizer | top-1 | top-5 | final loss |", "|---|---|---|---|"]
    lines += [f"| {n} | {r['top1']:.4f} | {r['top5']:.4f} | {r['final_loss']:.3f} |" for n, r in rows]
    report = "\n".join(lines) + "\n"
    print(report)
    write_report(args.out, report)
    return rows


if __name__ == "__main__":
    main()

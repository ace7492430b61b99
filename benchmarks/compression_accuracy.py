"""Benchmark: compressed vs dense backbone reduction on launch/train.py's tasks, 2 ranks.

For each task (a DeepSpeed JSON of configs/) and each variant, two ranks of
benchmarks/compression_train.py run on 127.0.0.1 (gloo, 1 thread each) for the same
number of steps, then evaluate held-out top-1/top-5 over all classes. Variants: ``dense``
(DeepSpeed's own all-reduce), and top-k, random-k and bayes_prior at the same density
with error feedback (plus any ``--extra`` variants; ``powersgd``: rank 4, about density
0.01's bytes on the text task, see VARIANTS). Bytes are per rank and per step as
the ring algorithms move them (what the wrapper counts; dense: 2 (P-1)/P x the fp32
gradient bytes, which is what DeepSpeed's all-reduce moves).

    python benchmarks/compression_accuracy.py                     # text_exact_20k.json, 300 steps (~20 min)
    python benchmarks/compression_accuracy.py --configs configs/text_exact_20k.json,configs/arcface_partial_fc.json
    python benchmarks/compression_accuracy.py --variants 'dense;k4=bayes_prior:{"exploit_power": 4}'
    python benchmarks/compression_accuracy.py --smoke             # 10 steps, prints only
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/harness.py
from harness import free_port, git_rev  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "benchmarks", "compression_train.py")
DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "compression_accuracy.md")
# name -> (method, extra gradient_compression keys)
VARIANTS = {
    "dense": ("dense", {}),
    "topk": ("topk", {}),
    "randomk": ("randomk", {}),
    "bayes_prior": ("bayes_prior", {}),
    "bayes_prior k=8 a=0": ("bayes_prior", {"exploit_power": 8.0, "prior": {"strength": 0.0}}),
    "topk bucket": ("topk", {"granularity": "bucket"}),
    "randomk bucket": ("randomk", {"granularity": "bucket"}),
    "bayes_prior bucket": ("bayes_prior", {"granularity": "bucket"}),
    "bayes_prior bucket k=8 a=0": ("bayes_prior", {"granularity": "bucket", "exploit_power": 8.0,
                                                   "prior": {"strength": 0.0}}),
    # PowerSGD sends 4 r (n + m) bytes per (n, m) matrix, top-k 6 bytes per kept element (16-bit offset,
    # fp32 value); on 2 ranks the all-reduce and the all-gather move the same multiple of those, so the
    # rank that spends density d's bytes is r = 1.5 d sum(n m) / sum(n + m): 3.66 -> 4 for the text task
    # (embedding 20001 x 256, MLP 256 x 1024, 256 x 256, 128 x 256) at d = 0.01 (--density does not apply)
    "powersgd": ("powersgd", {"powersgd": {"rank": 4}}),
}


def parse_variant(text: str) -> tuple[str, dict]:
    """A registered variant name, or ``NAME=METHOD:{json of gradient_compression keys}``."""
    if text in VARIANTS or "=" not in text:  # registered names may contain '=' themselves
        return VARIANTS[text]
    _, spec = text.split("=", 1)
    method, _, extra = spec.partition(":")
    return method, json.loads(extra or "{}")


def run_ranks(world: int, argv: list[str], timeout: float, env_extra: dict | None = None, threads: int = 1) -> dict:
    """Start ``world`` ranks of compression_train.py on 127.0.0.1, ``threads`` intra-op threads each;
    return rank 0's JSON."""
    port = free_port()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        out = fh.name
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads), **(env_extra or {}))
        procs.append(subprocess.Popen([sys.executable, TRAIN, *argv, "--out", out], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs):
        raise RuntimeError("a rank failed:\n" + "\n".join(log[-3000:] for log in logs))
    with open(out) as fh:
        result = json.load(fh)
    os.unlink(out)
    return result


def dense_bytes_per_step(result: dict) -> float:
    world, numel = result["world"], result["backbone_numel"]
    elem = 2 if result["backbone_dtype"] == "bfloat16" else 4
    return 2 * (world - 1) * numel * elem / world


def tar_cells(r: dict, base: dict | None) -> str:
    """The verification columns of one row: TAR at FAR 1e-3 (with its delta vs dense) and 1e-4."""
    v, b = r.get("verification"), (base or {}).get("verification")
    if v is None:
        return " n/a | n/a | n/a |"
    delta = f"{100 * (v['tar@far=0.001'] - b['tar@far=0.001']):+.2f}" if b else "n/a"
    return f" {v['tar@far=0.001']:.4f} | {delta} | {v['tar@far=0.0001']:.4f} |"


def render(rows: list[dict], args, command: str, started: str, wall: float) -> str:
    lines = ["# Compressed backbone reduction: accuracy and bytes on launch/train.py tasks\n",
             f"- command: `{command}`", f"- date: {started}, wall time {wall / 60:.1f} min",
             f"- ds_xc at git {git_rev(('ds_xc', 'launch', 'benchmarks', 'configs'))}",
             f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
             f"torch {rows[0].get('torch', '?') if rows else '?'}",
             f"- {args.world} ranks on 127.0.0.1 (gloo, {args.threads} thread(s) each), {args.steps} steps per "
             f"variant, density {args.density}, error feedback on, seed {args.seed}; ZeRO stage {args.zero_stage} for "
             f"every variant; held-out top-1/top-5 over all classes on up to {args.eval_samples} samples",
             "- bytes: per rank and step, ring volumes (dense = 2(P-1)/P x gradient bytes); "
             "`1/x` = dense bytes / sent bytes; top-1 delta in points vs dense\n"]
    for task in dict.fromkeys(r["config"] for r in rows):
        group = [r for r in rows if r["config"] == task]
        base = next((r for r in group if r["variant"] == "dense"), None)
        first = group[0]
        lines.append(f"## {task} ({first['data']}, {first['num_classes']} classes, backbone "
                     f"{first['backbone_numel'] / 1e6:.2f} M parameters)\n")
        verified = any("verification" in r for r in group)
        tar_head = " TAR@FAR 1e-3 | delta TAR (points) | TAR@FAR 1e-4 |" if verified else ""
        lines.append("| variant | achieved density | sent B/step | dense B/step | 1/x | top-1 | delta top-1 "
                     "(points) | top-5 | loss (last 10) | s/step |" + tar_head)
        lines.append("|---|---|---|---|---|---|---|---|---|---|" + "---|---|---|" * verified)
        for r in group:
            dense_b = dense_bytes_per_step(r)
            comp = r.get("compression")
            sent = comp["bytes_sent"] / r["steps"] if comp else dense_b
            dens = f"{comp['global_density']:.4f}" if comp else "1"
            delta = f"{100 * (r['top1'] - base['top1']):+.2f}" if base else "n/a"
            lines.append(f"| {r['variant']} | {dens} | {sent:,.0f} | {dense_b:,.0f} | {dense_b / sent:.1f} | "
                         f"{r['top1']:.4f} | {delta} | {r['top5']:.4f} | {r['loss_last10']:.3f} | {r['step_s']:.3f} |"
                         + (tar_cells(r, base) if verified else ""))
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="configs/text_exact_20k.json")
    p.add_argument("--variants", default="dense;topk;randomk;bayes_prior",
                   help=f"';'-separated names from: {', '.join(VARIANTS)}; or NAME=METHOD:JSON for a new one")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--eval_samples", type=int, default=50000,
                   help="held-out samples (the text task has about 55k; 8192 would leave +-0.4 points of noise)")
    p.add_argument("--seed", type=int, default=0, help="xc_train.seed and extreme_classification.seed")
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads per rank; another count changes the rounding of some kernels (CPU "
                   "convolutions): a dense run at 2 is the same training perturbed at the last bit")
    p.add_argument("--verify", action="store_true",
                   help="also TAR at FAR 1e-3 / 1e-4 on held-out designs where the data set has them (glyphs)")
    p.add_argument("--eval_every", type=int, default=0,
                   help="also held-out top-1 every N steps (the .json's `curve`; evaluating does not change the "
                   "training); the table reports the last step")
    p.add_argument("--zero_stage", type=int, default=0, choices=(0, 1), help="zero_optimization.stage of every run")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--out", default=DEFAULT_OUT, help="markdown file ('-': print only)")
    p.add_argument("--smoke", action="store_true", help="10 steps, print only")
    p.add_argument("--json", default=None, help="also write every run's record (loss curve included) here")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.out = 10, "-"
    command = "python benchmarks/compression_accuracy.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    started, t0 = datetime.datetime.now().isoformat(timespec="seconds"), time.time()
    rows = []
    for config in args.configs.split(","):
        for name in args.variants.split(";"):
            method, extra = parse_variant(name)
            argv_rank = ["--config", os.path.join(ROOT, config), "--method", method, "--density", str(args.density),
                         "--steps", str(args.steps), "--eval", "--eval_samples", str(args.eval_samples),
                         "--compression", json.dumps(extra), "--seed", str(args.seed),
                         "--eval_every", str(args.eval_every), "--zero_stage", str(args.zero_stage)] + \
                ["--verify"] * args.verify
            res = run_ranks(args.world, argv_rank, args.timeout, threads=args.threads)
            res["variant"] = name.split("=", 1)[0]
            rows.append(res)
            print(f"{config} {name}: top1 {res['top1']:.4f} loss {res['loss_last10']:.3f} "
                  f"step {res['step_s']:.3f}s", flush=True)
    report = render(rows, args, command, started, time.time() - t0)
    print(report)
    if args.out != "-":
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as fh:
            fh.write(report + "\n")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh)
    return rows


if __name__ == "__main__":
    main()

"""Growing the class set: train on 80% of the classes, grow to 100%, continue (issue 18).

    python benchmarks/grow.py --task glyphs --classes 1000 --stage1_steps 300 --more_steps 100
    python benchmarks/grow.py --task synthetic --classes 2000 --stage1_steps 300 --more_steps 100

Per task: (1) launch/train.py on the first C = frac * C' classes for S1 steps; (2) launch/grow.py to
C' classes, new rows imprinted and random; (3) held-out top-1 over all C' classes of the old
classes' and the new classes' samples (the C'-class held-out set) right after growing (0 steps),
next to the stage-1 model's top-1 of the same old-class samples over its C classes; (4) S1 + N
steps in all: the grown models go on N steps (launch/train.py --resume), a model trained on all C'
classes from the start runs S1 + N steps. Every run is one process, one thread, nice 5, at most two
at a time. Writes benchmarks/results/grow_<task>.md (command, revision, machine in the header).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from harness import cpu_model, git_rev, load_average, usable_cores, write_report

import ds_xc
from ds_xc.checkpoint import load_file, load_head_state, read_meta, resolve_tag
from ds_xc.data import build_dataset, dataset_kwargs
from ds_xc.engine import load_raw_config
from ds_xc.evaluate import evaluate_topk
from ds_xc.head import ClassParallelHead
from ds_xc.models import build_backbone

SYNTHETIC = {  # the synthetic task: a dense backbone, CosFace over the exact softmax
    "train_micro_batch_size_per_gpu": 256, "gradient_clipping": 0.0, "steps_per_print": 10**9,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.002, "weight_decay": 0.0005, "torch_adam": True}},
    "zero_optimization": {"stage": 0},
    "extreme_classification": {"num_classes": 2000, "embedding_dim": 64, "sampler": {"type": "full"},
                               "loss": {"type": "cosface", "scale": 32.0, "margin": 0.2}, "init_std": 0.01,
                               "optimizer": {"type": "adamw", "lr": 0.002, "weight_decay": 0.0, "update": "dense"}},
    "xc_train": {"data": "synthetic", "max_steps": 300, "eval_every": 0, "eval_samples": 8192, "hidden_dim": 256},
}


def job_config(task: str, num_classes: int, steps: int, path: str, micro: int = 0) -> str:
    """The task's DeepSpeed JSON with ``num_classes`` classes and ``steps`` steps (and ``micro`` samples
    per step when given), written to ``path``."""
    raw = load_raw_config(os.path.join(ROOT, "configs", "glyphs_cosface.json")) if task == "glyphs" else \
        json.loads(json.dumps(SYNTHETIC))
    raw["extreme_classification"]["num_classes"] = num_classes
    raw["xc_train"].update(max_steps=steps, eval_every=0)
    if micro:
        raw["train_micro_batch_size_per_gpu"] = micro
    with open(path, "w") as fh:
        json.dump(raw, fh, indent=1)
    return path


def run_all(commands: list, log_dir: str) -> float:
    """Run the commands two at a time (nice 5, one thread); returns the wall seconds."""
    t0, env = time.perf_counter(), dict(os.environ, OMP_NUM_THREADS="1")
    for i in range(0, len(commands), 2):
        procs = []
        for name, cmd in commands[i: i + 2]:
            log = open(os.path.join(log_dir, f"{name}.log"), "w")  # noqa: SIM115 (closed after the wait)
            procs.append((name, subprocess.Popen(["nice", "-n", "5", sys.executable, *cmd], cwd=ROOT, env=env,
                                                 stdout=log, stderr=subprocess.STDOUT), log))
        for name, proc, log in procs:
            if proc.wait() != 0:
                raise SystemExit(f"{name} failed: see {log.name}")
            log.close()
    return time.perf_counter() - t0


@torch.no_grad()
def evaluate(ckpt: str, config: str, split: int, samples: int) -> dict:
    """Held-out top-1 of the checkpoint over its classes, on the held-out set of ``config``'s data
    (all C' classes), split at class ``split`` (one process)."""
    raw = load_raw_config(config)
    xcfg = ds_xc.parse_config(raw)
    tcfg, hcfg = xcfg.xc_train, xcfg.extreme_classification
    data = build_dataset(tcfg.data, hcfg.num_classes, seed=tcfg.seed, **dataset_kwargs(tcfg))
    tag = os.path.join(ckpt, resolve_tag(ckpt))
    section = dict(raw["extreme_classification"], num_classes=read_meta(tag)["num_classes"])
    head = ClassParallelHead.from_config(section)
    load_head_state(tag, head)
    body = build_backbone(data, hcfg.embedding_dim, hidden_dim=tcfg.hidden_dim)
    body.load_state_dict(load_file(os.path.join(tag, "mp_rank_00_model_states.pt"))["module"])
    body.eval()
    return evaluate_topk(body, head, data.eval_batches(256, 0, 1, samples), split=split)


def pipeline(args, work: str) -> dict:
    """Stage 1 and the from-scratch model, grow twice, continue twice; every evaluation."""
    big, small = args.classes, round(args.frac * args.classes)
    total = args.stage1_steps + args.more_steps
    cfg = {name: job_config(args.task, n, s, os.path.join(work, f"{name}.json"), args.micro) for name, n, s in
           (("stage1", small, args.stage1_steps), ("stage2", big, total), ("scratch", big, total))}
    train = os.path.join("launch", "train.py")
    times = {"stage1 + scratch": run_all([
        ("stage1", [train, "--deepspeed_config", cfg["stage1"], "--save_dir", os.path.join(work, "s1")]),
        ("scratch", [train, "--deepspeed_config", cfg["scratch"], "--save_dir", os.path.join(work, "scratch")])],
        work)}
    grow = os.path.join("launch", "grow.py")
    variants = {"imprint": ["--init", "imprint"], "random": ["--init", "random"],
                "imprint_plain": ["--init", "imprint", "--imprint_calibration", "none"]}
    times["grow (3 variants)"] = run_all([
        (f"grow_{name}", [grow, "--load_dir", os.path.join(work, "s1"), "--out_dir", os.path.join(work, name),
                          "--deepspeed_config", cfg["stage2"], *flags]) for name, flags in variants.items()], work)
    ev = {"stage 1 (C classes)": evaluate(os.path.join(work, "s1"), cfg["stage2"], small, args.eval_samples)}
    ev["grown, imprint without calibration, 0 steps"] = evaluate(os.path.join(work, "imprint_plain"), cfg["stage2"],
                                                                  small, args.eval_samples)
    for init in ("imprint", "random"):
        ev[f"grown, {init}, 0 steps"] = evaluate(os.path.join(work, init), cfg["stage2"], small, args.eval_samples)
    times["continue (imprint, random)"] = run_all([
        (f"more_{init}", [train, "--deepspeed_config", cfg["stage2"], "--save_dir", os.path.join(work, init),
                          "--resume"]) for init in ("imprint", "random")], work)
    for init in ("imprint", "random"):
        ev[f"grown, {init}, +{args.more_steps} steps"] = evaluate(os.path.join(work, init), cfg["stage2"], small,
                                                                  args.eval_samples)
    ev[f"all classes from the start, {total} steps"] = evaluate(os.path.join(work, "scratch"), cfg["stage2"], small,
                                                                args.eval_samples)
    return {"evals": ev, "times": times, "small": small, "big": big, "total": total}


def report(args, res: dict, wall: float) -> str:
    ev, small, big = res["evals"], res["small"], res["big"]
    lines = [f"# Growing the class set: {args.task}, {small} -> {big} classes", "",
             f"- command: `python benchmarks/grow.py {' '.join(sys.argv[1:])}`",
             f"- date: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} (wall time {wall:.0f} s)",
             (f"- CPU: {cpu_model()}, {usable_cores()} cores usable, 1 torch thread per process, at most 2 "
             f"processes, nice 5; load average (1/5/15 min) at the end {load_average()} (other jobs share the cores)"),
             f"- ds_xc at git {res['rev']} (taken at the start)",
             f"- stage 1: the first {small} classes ({args.frac:.0%}), {args.stage1_steps} steps; grown to {big} "
             f"classes (launch/grow.py: rows imprinted over 16 x {big} training samples, calibrated "
             f"(the default) or not, or random rows); then "
             f"{args.more_steps} more steps; the reference trains {big} classes for {res['total']} steps from the "
             "start. Config: " + ("configs/glyphs_cosface.json" if args.task == "glyphs" else
                                  "benchmarks/grow.py SYNTHETIC") + " with num_classes and max_steps set"
             + (f", {args.micro} samples per step" if args.micro else ""),
             (f"- held-out top-1 over all classes of the model (stage 1: its {small}; the others: {big}), on the "
             f"same {args.eval_samples} held-out samples of the {big}-class set, split into old classes "
             f"(< {small}) and new ones; chance on the new classes is 1/{big} = {1 / big:.4f}"), "",
             "| model | top-1 all | top-1 old classes | top-1 new classes | old samples | new samples |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, e in ev.items():
        lines.append(f"| {name} | {e['top1']:.4f} | {e['top1_old']:.4f} | {e['top1_new']:.4f} | "
                     f"{e['samples_old']} | {e['samples_new']} |")
    base, imp = ev["stage 1 (C classes)"], ev["grown, imprint, 0 steps"]
    rnd, plain = ev["grown, random, 0 steps"], ev["grown, imprint without calibration, 0 steps"]
    scratch = ev[f"all classes from the start, {res['total']} steps"]
    cont = ev[f"grown, imprint, +{args.more_steps} steps"]
    lines += ["", "Targets (issue 18):", "",
              (f"- imprinted new classes at 0 steps: top-1 {imp['top1_new']:.4f}, old classes {imp['top1_old']:.4f}: "
              f"ratio {imp['top1_new'] / max(imp['top1_old'], 1e-9):.2f} (target >= 0.5); random rows "
              f"{rnd['top1_new']:.4f} (chance {1 / big:.4f})"),
              (f"- old classes at the moment of growing: {base['top1_old']:.4f} -> {imp['top1_old']:.4f} imprinted "
              f"({100 * (imp['top1_old'] - base['top1_old']):+.2f} points), {rnd['top1_old']:.4f} random "
              f"({100 * (rnd['top1_old'] - base['top1_old']):+.2f}) (target: at most -0.5)"),
              (f"- after {args.more_steps} more steps: grown (imprinted) {cont['top1']:.4f} vs all classes from the "
              f"start {scratch['top1']:.4f} ({100 * (cont['top1'] - scratch['top1']):+.2f} points; target within 1)"),
              (f"- imprinting without the calibration (plain normalised class means): new classes "
               f"{plain['top1_new']:.4f}, old classes {plain['top1_old']:.4f} "
               f"({100 * (plain['top1_old'] - base['top1_old']):+.2f} points at the moment of growing)"),
              "", "Wall times: " + ", ".join(f"{k} {v:.0f} s" for k, v in res["times"].items()), ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=["glyphs", "synthetic"], default="glyphs")
    p.add_argument("--classes", type=int, default=1000, help="C', all classes")
    p.add_argument("--frac", type=float, default=0.8, help="share of the classes in stage 1")
    p.add_argument("--stage1_steps", type=int, default=300)
    p.add_argument("--more_steps", type=int, default=100)
    p.add_argument("--eval_samples", type=int, default=8192)
    p.add_argument("--micro", type=int, default=0, help="samples per step (default: the config's, 256)")
    p.add_argument("--work", default="/tmp/ds_xc_grow_bench", help="checkpoints and logs (a new folder per task)")
    p.add_argument("--out", help="results file (default benchmarks/results/grow_<task>.md)")
    args = p.parse_args(argv)
    work = os.path.join(args.work, args.task)
    if os.path.exists(work):
        raise SystemExit(f"--work: {work!r} exists; remove it or give another folder")
    os.makedirs(work)
    t0, rev = time.perf_counter(), git_rev(("ds_xc", "launch", "benchmarks", "configs"))
    res = dict(pipeline(args, work), rev=rev)
    text = report(args, res, time.perf_counter() - t0)
    print(text)
    write_report(args.out or os.path.join(HERE, "results", f"grow_{args.task}.md"), text)


if __name__ == "__main__":
    main()

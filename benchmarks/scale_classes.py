"""Benchmark: launch/train.py at 10^7 classes on P CPU ranks, measured against ds_xc.cost.estimate_memory.

    python benchmarks/scale_classes.py                                  # 10^7 classes, 4 ranks, configs/synthetic_1e7.json
    python benchmarks/scale_classes.py --num_classes 10000 --world 2 --max_steps 20 --out -   # a quick check

Two runs of ``deepspeed --num_gpus P launch/train.py --data synthetic --deepspeed_config <recipe>``:

1. calibration, the same recipe at ``--calibration_classes`` (10^4) classes for a few steps: the
   process baseline of each rank, i.e. the RSS after setup (torch, deepspeed, the process group, the
   engine, the data set, the built-in backbone) less what the model counts of it (the head shard and
   the backbone's parameters); passed to the model as ``baseline_bytes``;
2. the measured run at ``--num_classes``, with ``--summary_json``: per rank (launch/train.py's
   ``ranks`` field) the RSS after setup, after the last training step (the persistent memory: every
   optimizer state and the index exist by then) and the VmHWM before and after the final
   evaluation, the median step time and the ANN index build times. A thread samples the summed RSS
   of the whole process tree (launcher included) every 0.5 s: the machine's share of the job.

The table puts each rank's measurement beside the model's prediction (ratio measured / model), and
the held-out top-1 / top-5 beside chance (1/C, 5/C) and the majority-class baseline (the share of
the held-out labels that the 1 or 5 most frequent held-out labels cover). Writes the report under
benchmarks/results/ with the command, the revision, the load and the machine in the header.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import cpu_model, free_port, git_rev, load_average, usable_cores, write_report  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEEPSPEED = os.path.join(os.path.dirname(sys.executable), "deepspeed")
GIB = 2.0 ** 30


class TreeRss:
    """Samples the summed RSS of a process and its descendants every ``interval`` s; ``peak`` the largest."""

    def __init__(self, pid: int, interval: float = 0.5):
        import psutil
        self.root, self.interval, self.peak, self._stop = psutil.Process(pid), interval, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil
        while not self._stop.is_set():
            try:
                procs = [self.root] + self.root.children(recursive=True)
                total = 0
                for p in procs:
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
                self.peak = max(self.peak, total)
            except psutil.Error:
                return
            self._stop.wait(self.interval)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.peak


def launch(config: str, world: int, num_classes: int, max_steps: int, extra: list, timeout: int) -> tuple:
    """Run launch/train.py; (summary dict, wall s, peak RSS of the process tree, the command line)."""
    fd, summary = tempfile.mkstemp(suffix=".json", prefix="scale_")
    os.close(fd)
    cmd = [DEEPSPEED, "--master_port", str(free_port()), "--num_gpus", str(world), "launch/train.py", "--data",
           "synthetic", "--num_classes", str(num_classes), "--deepspeed_config", config, "--max_steps",
           str(max_steps), "--summary_json", summary] + [a for s in extra for a in ("--set", s)]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tree = TreeRss(proc.pid)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
        peak = tree.stop()
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"launch/train.py failed ({proc.returncode}):\n{out[-4000:]}")
    with open(summary) as fh:
        res = json.load(fh)
    os.unlink(summary)
    return res, wall, peak, " ".join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd[:1] + cmd[3:])


def raw_config(config: str, extra: list) -> dict:
    """The recipe as launch/train.py reads it, with the same --set overrides."""
    sys.path.insert(0, os.path.join(ROOT, "launch"))
    from ds_xc.engine import load_raw_config
    raw = load_raw_config(os.path.join(ROOT, config))
    from train import apply_override  # launch/train.py's own parser of --set
    for item in extra:
        apply_override(raw, item)
    return raw


def baselines(raw: dict, calibration: dict) -> list:
    """Per rank: the calibration run's RSS after setup less the head shard and backbone parameters it held."""
    from ds_xc.cost import estimate_memory
    out = []
    for r in calibration["ranks"]:
        est = estimate_memory(raw, world_size=calibration["world_size"], rank=r["rank"],
                              num_classes=calibration["num_classes"], backbone_params=r["backbone_params"])
        out.append(r["memory"]["after_setup"] - est.persistent["head_weight"] - est.persistent["backbone_params"])
    return out


def majority_baseline(raw: dict, num_classes: int, world: int) -> tuple:
    """(top-1, top-5) of always predicting the most frequent held-out labels, over the evaluated samples."""
    import ds_xc
    from ds_xc.data import build_dataset, dataset_kwargs
    tcfg = ds_xc.parse_config(raw).xc_train
    data = build_dataset("synthetic", num_classes, seed=tcfg.seed, **dataset_kwargs(tcfg))
    micro = raw.get("train_micro_batch_size_per_gpu", 1)
    counts = collections.Counter()
    for rank in range(world):
        for _, y in data.eval_batches(micro, rank, world, tcfg.eval_samples):
            counts.update(y.tolist())
    n = max(sum(counts.values()), 1)
    top = [c for _, c in counts.most_common(5)]
    return top[0] / n, sum(top) / n


def rows(raw: dict, res: dict, base: list) -> list:
    """Per rank: measured and modelled bytes and the timings."""
    from ds_xc.cost import estimate_memory
    out = []
    for r, b in zip(res["ranks"], base):
        est = estimate_memory(raw, world_size=res["world_size"], rank=r["rank"], num_classes=res["num_classes"],
                              backbone_params=r["backbone_params"], baseline_bytes=int(b), steps=res["steps"])
        setup_model = b + est.persistent["head_weight"] + est.persistent.get("backbone_params", 0)
        out.append({"rank": r["rank"], "L": r["num_local"], "mem": r["memory"], "est": est, "setup_model": setup_model,
                    "step_s": r["step_s_median"], "build_s": r["index_build_s"]})
    return out


def report(args, raw, res, wall, tree_peak, cal_wall, base, table, chance, cmd) -> str:
    g = lambda b: f"{b / GIB:.3f}"  # noqa: E731
    lines = [f"# launch/train.py at {res['num_classes']:,} classes on {res['world_size']} CPU ranks vs the memory model",
             "", f"- command: `python benchmarks/scale_classes.py {' '.join(sys.argv[1:])}`",
             f"- measured run: `{cmd}`", f"- revision: {git_rev(('ds_xc', 'launch', 'benchmarks', 'configs'))}",
             f"- load average before / after: {args.load_before} / {load_average()}",
             f"- machine: {cpu_model()}, {usable_cores()} usable cores, OMP_NUM_THREADS="
             f"{os.environ.get('OMP_NUM_THREADS', '1')}; torch {__import__('torch').__version__}",
             f"- calibration run ({args.calibration_classes:,} classes, {args.calibration_steps} steps, {cal_wall:.0f} s): "
             f"process baseline per rank {', '.join(g(b) for b in base)} GiB (RSS after setup less its head shard "
             "and backbone parameters)",
             f"- measured run: {res['steps']} steps, wall {wall:.0f} s (launcher, setup, index build, training, final "
             f"evaluation of {res['eval_samples']} samples); whole process tree peak RSS {g(tree_peak)} GiB", "",
             "Memory per rank in GiB (model: ds_xc.cost.estimate_memory; ratio = measured / model):", "",
             "| rank | classes | after setup | model | ratio | persistent (after training) | model | ratio | "
             "peak (VmHWM, incl. evaluation) | model peak | ratio | model peak phase | step s (median) | "
             "index build s |", "|" + "---|" * 14]
    for t in table:
        m, est = t["mem"], t["est"]
        lines.append(f"| {t['rank']} | {t['L']:,} | {g(m['after_setup'])} | {g(t['setup_model'])} | "
                     f"{m['after_setup'] / t['setup_model']:.3f} | {g(m['after_training'])} | {g(est.persistent_bytes)} | "
                     f"{m['after_training'] / est.persistent_bytes:.3f} | {g(m['peak'])} | {g(est.peak_bytes)} | "
                     f"{m['peak'] / est.peak_bytes:.3f} | {est.phase} | {t['step_s']:.3f} | "
                     f"{', '.join(f'{s:.1f}' for s in t['build_s'])} |")
    total_peak = sum(t["mem"]["peak"] for t in table)
    total_model = sum(t["est"].peak_bytes for t in table)
    lines += ["", f"Sum over ranks: peak {g(total_peak)} GiB measured, {g(total_model)} GiB modelled "
              f"(ratio {total_peak / total_model:.3f}); the whole tree's sampled peak {g(tree_peak)} GiB.", "",
              "Model components of rank 0 (GiB):", "", "| component | bytes | GiB |", "|---|---|---|"]
    est = table[0]["est"]
    for k, v in est.persistent.items():
        lines.append(f"| persistent: {k} | {v:,} | {g(v)} |")
    for k, v in est.step.items():
        lines.append(f"| {est.phase}: {k} | {v:,} | {g(v)} |")
    for k, v in est.phases.items():
        lines.append(f"| phase total: {k} | {v:,} | {g(v)} |")
    c = res["num_classes"]
    lines += ["", "Held-out accuracy over all classes:", "", "| metric | run | chance (uniform) | majority-class baseline |",
              "|---|---|---|---|", f"| top-1 | {res['top1']:.4f} | {1 / c:.1e} | {chance[0]:.4f} |",
              f"| top-5 | {res['top5']:.4f} | {5 / c:.1e} | {chance[1]:.4f} |", "",
              f"Final loss {res['final_loss']:.4f}; {res['samples_per_s']:.1f} samples/s; active classes per step "
              f"{res['active']['active_classes']:,.0f} (share {res['active']['share']:.4f}).", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/synthetic_1e7.json")
    ap.add_argument("--num_classes", type=int, default=10_000_000)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--max_steps", type=int, default=None, help="default: the recipe's xc_train.max_steps")
    ap.add_argument("--calibration_classes", type=int, default=10_000)
    ap.add_argument("--calibration_steps", type=int, default=5)
    ap.add_argument("--set", action="append", default=[], help="KEY.PATH=VALUE for both runs (launch/train.py --set)")
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--out", default="benchmarks/results/scale_1e7.md", help="report path ('-': print only)")
    args = ap.parse_args()
    args.load_before = load_average()
    raw = raw_config(args.config, args.set)
    steps = args.max_steps or raw.get("xc_train", {}).get("max_steps", 300)
    cal, cal_wall, _, _ = launch(args.config, args.world, args.calibration_classes, args.calibration_steps,
                                 args.set, args.timeout)
    base = baselines(raw, cal)
    print(f"calibration: {cal_wall:.0f} s, baselines {[f'{b / GIB:.3f}' for b in base]} GiB", flush=True)
    res, wall, tree_peak, cmd = launch(args.config, args.world, args.num_classes, steps, args.set, args.timeout)
    table = rows(raw, res, base)
    chance = majority_baseline(raw, args.num_classes, args.world)
    text = report(args, raw, res, wall, tree_peak, cal_wall, base, table, chance, cmd)
    print(text, flush=True)
    write_report(args.out, text)


if __name__ == "__main__":
    main()

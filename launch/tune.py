"""Tune the head's sampler and update mode for a memory, speed and recall target.

    python launch/tune.py --deepspeed_config configs/X.json --max_memory_gib 4 --min_recall 0.9
    deepspeed --num_gpus 2 launch/tune.py --deepspeed_config configs/X.json --min_speedup 1.5
    torchrun --nproc_per_node 2 launch/tune.py ... --num_classes 1000000 --data synthetic

Reads the DeepSpeed JSON (and its data set and backbone through the registries launch/train.py
uses), predicts every candidate with the cost models (ds_xc/cost), measures the short list for a
few head steps each on embeddings of the data set (speed, memory per rank, recall@10 of the
sampler against the exact top-10 on held-out batches), prints the frontier table, draws the
frontier (PNG) and writes the chosen DeepSpeed JSON (the input with the tuned keys changed, every
other key untouched; never over the input) and a short report. Measurements are cached
(--cache): a run interrupted and started again resumes. docs/tuning.md explains the method.
Only rank 0 prints and writes.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import ds_xc  # noqa: E402
from ds_xc.data import build_task_data  # noqa: E402
from ds_xc.engine import init_distributed, load_raw_config  # noqa: E402
from ds_xc.models import build_backbone  # noqa: E402
from ds_xc.tune import (Target, TargetUnreachable, changed_keys, default_cache_dir, default_output_path,  # noqa: E402
                        plot, report_text, table, tune, write_config)

EXIT_UNREACHABLE = 2


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed_config", required=True, help="the DeepSpeed JSON to tune (never overwritten)")
    p.add_argument("--out", help="the tuned JSON (default: <config>.tuned.json next to the input)")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    p.add_argument("--max_memory_gib", type=float, help="peak memory per rank, GiB")
    p.add_argument("--min_recall", type=float, help="recall@10 of the sampler against the exact top-10")
    p.add_argument("--min_speedup", type=float, help="step speed-up over the library defaults")
    p.add_argument("--max_step_s", type=float, help="seconds per head step (index build amortised)")
    p.add_argument("--time_budget_s", type=float, default=420.0,
                   help="wall-clock budget of the measurements (the tuner stops starting new ones after it)")
    p.add_argument("--steps", type=int, default=4, help="timed head steps per candidate")
    p.add_argument("--warmup", type=int, default=2, help="untimed head steps before them")
    p.add_argument("--eval_batches", type=int, default=1, help="held-out batches for the recall")
    p.add_argument("--pretrain_steps", type=int, default=200,
                   help="steps of the shared head whose weights the recall screen indexes")
    p.add_argument("--max_accuracy_drop", type=float, default=0.0025,
                   help="how far (a fraction: 0.0025 = a quarter point) the accuracy probe's held-out top-1 of the "
                        "chosen configuration may lie below the library defaults'")
    p.add_argument("--probe_steps", type=int, default=40,
                   help="head steps of the accuracy probe per probed candidate (0: no probe, accuracy unchecked)")
    p.add_argument("--probe_eval_batches", type=int, default=16,
                   help="held-out batches (of train_micro_batch_size_per_gpu rows per rank) the probe scores the "
                        "defaults on; a candidate is scored on the same ones, block by block, until its paired "
                        "drop against the defaults is clearly within or beyond --max_accuracy_drop")
    p.add_argument("--max_probes", type=int, default=3, help="candidates probed besides the defaults, fastest first")
    p.add_argument("--samplers", default="ann,uniform,full", help="sampler types to consider")
    p.add_argument("--num_classes", type=int, help="override extreme_classification.num_classes")
    p.add_argument("--data", choices=["text", "synthetic", "corpus"], help="override xc_train.data")
    p.add_argument("--cache", help="measurement cache (default: $DS_XC_CACHE or ~/.cache/ds_xc, tune_cache.json)")
    p.add_argument("--recalibrate", action="store_true", help="re-time the cost model's kernels")
    p.add_argument("--verbose", action="store_true")
    return p.parse_args(argv)


def say(*msg) -> None:
    if dist.get_rank() == 0:
        print(*msg, flush=True)


def load_config(args) -> dict:
    raw = load_raw_config(args.deepspeed_config)
    if args.num_classes is not None:
        raw.setdefault("extreme_classification", {})["num_classes"] = args.num_classes
    if args.data is not None:
        raw.setdefault("xc_train", {})["data"] = args.data
    ds_xc.parse_config(raw)  # a bad input config is an error naming the key before anything runs
    return raw


def build_inputs(raw: dict, rank: int, world: int, total: int, eval_count: int, probe_count: int = 0,
                 device=None):
    """Embeddings of the data set through its backbone at initialisation (frozen), on ``device`` (the
    rank's, bound by init_distributed; None: the CPU): the train batches of the measured steps (the
    same for every candidate), the held-out batches of the recall and those of the accuracy probe (the
    first ``probe_count``). The tuner builds its heads where the embeddings are."""
    xcfg = ds_xc.parse_config(raw)
    tcfg, hcfg = xcfg.xc_train, xcfg.extreme_classification
    data = build_task_data(tcfg, hcfg.num_classes, rank=rank, group=dist.group.WORLD)
    torch.manual_seed(tcfg.seed)
    backbone = build_backbone(data, hcfg.embedding_dim, hidden_dim=tcfg.hidden_dim).eval().to(device)
    micro = int(raw.get("train_micro_batch_size_per_gpu", 256)) * int(raw.get("gradient_accumulation_steps", 1))

    def embedded(x, y):
        return backbone(x.to(device)).float(), y.to(device)
    with torch.no_grad():
        train = [embedded(*data.train_batch(i, micro, rank, world)) for i in range(total)]
        count = max(eval_count, probe_count)
        held = [embedded(x, y) for x, y in data.eval_batches(micro, rank, world, count * micro * world)]
    return ((lambda i: train[i % len(train)]), (lambda: iter(held[:eval_count])), (lambda: iter(held[:probe_count])),
            data.describe()["name"])


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    raw = load_config(args)
    out = args.out or default_output_path(args.deepspeed_config)
    if os.path.exists(out) and os.path.samefile(out, args.deepspeed_config):
        raise SystemExit(f"--out {out!r} is the input config; the tuner never overwrites its input")
    device = init_distributed()  # binds cuda:LOCAL_RANK before any collective
    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.perf_counter()
    cache_dir = default_cache_dir()
    probing = args.probe_steps > 0
    target = Target(args.max_memory_gib, args.min_recall, args.min_speedup, args.max_step_s,
                    args.max_accuracy_drop if probing else None)
    total = max(args.warmup + args.steps, args.pretrain_steps, args.probe_steps)
    train_batch, eval_batches, probe_batches, data_name = build_inputs(
        raw, rank, world, total, args.eval_batches, args.probe_eval_batches if probing else 0, device)
    say(f"ds_xc tune: {raw['extreme_classification']['num_classes']:,} classes, {data_name} data, {world} rank(s) "
        f"(rank 0 on {device}, each rank's device bound from its local rank before the first collective); "
        f"target {target}; budget {args.time_budget_s:.0f} s")
    bar = None
    if rank == 0:
        from tqdm import tqdm
        bar = tqdm(unit="cand", desc="measuring", dynamic_ncols=True, file=sys.stdout)

    def progress(row):  # after each measurement, then after each accuracy probe
        if bar is not None:
            bar.update(1)
            p = row.probe
            what = (f"{row.measured['amortised_s']:.3f} s, recall {row.measured['recall']:.3f}" if p is None else
                    f"probe top-1 {p['top1']:.4f}" + (f", {100 * p['drop']:+.2f} +- {100 * p['se']:.2f} point below "
                                                      "the defaults" if "drop" in p else ""))
            bar.set_postfix_str(f"{row.cand.label()[:40]}: {what}")
    try:
        res = tune(raw, target, train_batch, eval_batches, world=world, cache_path=args.cache or os.path.join(
            cache_dir, "tune_cache.json"), constants_path=os.path.join(cache_dir, "tune_constants.json"),
            time_budget_s=args.time_budget_s, steps=args.steps, warmup=args.warmup, pretrain_steps=args.pretrain_steps,
            types=tuple(args.samplers.split(",")), data=data_name, progress=progress, is_writer=rank == 0,
            probe_steps=args.probe_steps, probe_batches=probe_batches, max_probes=args.max_probes)
    except TargetUnreachable as exc:
        if bar is not None:
            bar.close()
        say(table(exc.rows, None, [], markdown=False))
        say(f"ds_xc tune: {exc}")
        dist.destroy_process_group()
        return EXIT_UNREACHABLE
    if bar is not None:
        bar.close()
    base_s = res.base.measured["amortised_s"] if res.base else None
    say(table(res.rows, base_s, res.front, markdown=False))
    if rank == 0:
        write_config(res.chosen.config, out, args.deepspeed_config)
        stem = os.path.splitext(out)[0]
        png = plot(res.rows, res.front, res.chosen, target, stem + ".frontier.png")
        keys = changed_keys(raw, res.chosen.config)
        with open(stem + ".report.md", "w") as fh:
            fh.write(report_text(res.chosen, res.base, target, res.rows, {k: v for k, v in res.context.items()
                                                                          if k != "config"}, keys))
            fh.write("\n" + table(res.rows, base_s, res.front) + "\n")
        say(f"chosen: {res.chosen.cand.label()}; wrote {out}, {stem}.report.md" + (f", {png}" if png else ""))
        say(f"tuner wall time {time.perf_counter() - t0:.1f} s")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: the sample-grouping trade-off of the ANN sampler, G = 1, 2, 4, 8.

With G groups the global batch of N rows is split into G blocks, each with its own active
set of K = ceil(sample_rate * L) classes: positives of the block, then what its rows
retrieved (rank-major), then uniform fill. FLOPs stay N*K*d, while the retrieval budget
per row grows from K/N to K*G/N; the cost is G gathers of K weight rows (and up to G*K
rows with a gradient, re-encoded and stepped by the lazy optimizer).

Part A (quality, on trained weights: the exact-softmax runs of sampler_accuracy.py, as in
ann_recall.py): for each task, sample rate and G, the sampler's active sets for
``--batches`` training batches of the task's global batch, measured against the exact
logits by ds_xc.sampling.metrics.active_set_quality: ``recall_active@10`` (share of each
row's exact top-10 in its group's active set) and ``softmax mass`` covered; plus the
active-set counts and the time of one training step of the head (sampler + G gathers +
G fused losses + backward + lazy AdamW) at that G.

Part B (cost at scale): 10^6 classes, d=128, N=512, random weights, one process, the index
built once; per (rate, G) the median step time (forward + backward + lazy SGD step) and
the peak memory above the RSS before those steps.

    python benchmarks/ann_groups.py
    python benchmarks/ann_groups.py --skip_scale          # part A only
    python benchmarks/ann_groups.py --smoke               # text 2,000 classes, tiny part B; writes nothing
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ann_recall  # noqa: E402
import sampler_accuracy as sa  # noqa: E402
from harness import (cpu_model, git_rev, hwm_bytes, load_average, mib, reset_peak, rss_bytes,  # noqa: E402
                     usable_cores, write_report)

RESULTS = sa.RESULTS


# ---------------------------------------------------------------------------- part A
def quality(args, task_name: str) -> dict:
    import torch

    import ds_xc
    from ds_xc.engine import load_raw_config
    from ds_xc.sampling.base import budget
    from ds_xc.sampling.metrics import active_set_quality

    torch.set_num_threads(args.threads)
    data, backbone, weight, loss, res = ann_recall.trained_model(args, task_name)
    raw = load_raw_config(sa.BASE_CONFIG)
    batch = raw["train_micro_batch_size_per_gpu"]
    head_opt = dict(raw["extreme_classification"]["optimizer"], update="lazy")
    batches = []
    with torch.no_grad():
        for i in range(args.batches):
            x, y = data.train_batch(10_000 + i, batch, 0, 1)  # steps the training run never reached
            batches.append((backbone(x), y))
    rows = []
    for rate in args.rate_list:
        for g in args.group_list:
            head = ds_xc.ClassParallelHead(weight.shape[1], weight.shape[0], loss=loss,
                                           sampler={"type": "ann", "sample_rate": rate, "groups": g},
                                           chunk_size=raw["extreme_classification"].get("chunk_size", 0),
                                           update="lazy", check_inputs=False)
            with torch.no_grad():
                head.weight.copy_(weight)
            head.rebuild_index()
            s = head.sampler
            acc = {"recall": [], "mass": [], "sample_ms": []}
            counts = []
            for emb, y in batches:
                with torch.no_grad():
                    t = time.perf_counter()
                    active = s.sample(y, emb, head.weight)
                    acc["sample_ms"].append(1e3 * (time.perf_counter() - t))
                    q = active_set_quality(emb, head.weight, 0, active, head.loss_fn.normalised,
                                           head.loss_fn.scale, s.last_retrieved)
                acc["recall"].append(q["recall_active@10"])
                acc["mass"].append(q["softmax_mass"])
                union = active.union()
                counts.append(dict(s.last_stats, rows=sum(i.numel() for i in (active.index if isinstance(
                    active.index, list) else [active.index])), distinct=int(union.numel())))
            # training-step time at this G (state of the weights does not matter for the cost)
            opt = ds_xc.build_head_optimizer(head, head_opt)
            step_ms = []
            for i, (emb, y) in enumerate(batches[: args.timed + 1]):
                e = emb.clone().requires_grad_(True)
                t = time.perf_counter()
                head(e, y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if i:  # the first step is a warm-up (optimizer state)
                    step_ms.append(1e3 * (time.perf_counter() - t))
            k = budget(rate, weight.shape[0])
            row = {"task": task_name, "rate": rate, "groups": g, "N": batch, "K": int(k),
                   "budget_per_row": k * g / batch, "recall": statistics.mean(acc["recall"]),
                   "mass": statistics.mean(acc["mass"]), "sample_ms": statistics.median(acc["sample_ms"]),
                   "step_ms": statistics.median(step_ms) if step_ms else float("nan"),
                   "gathered": statistics.mean(c["rows"] for c in counts),
                   "distinct": statistics.mean(c["distinct"] for c in counts),
                   **{key: statistics.mean(c[key] for c in counts) for key in ("positives", "kept", "cut", "fill")},
                   "load": load_average()}
            rows.append(row)
            print(f"[{task_name}] rate {rate} G={g}: K={k} budget/row {row['budget_per_row']:.1f}, recall_active@10 "
                  f"{row['recall']:.3f}, mass {row['mass']:.3f}, kept {row['kept']:.0f} cut {row['cut']:.0f}, "
                  f"gathered {row['gathered']:.0f} (distinct {row['distinct']:.0f}), step {row['step_ms']:.0f} ms",
                  flush=True)
    return {"task": task_name, "num_classes": weight.shape[0], "loss": loss, "rows": rows,
            "train_top1": res["top1"]}


# ---------------------------------------------------------------------------- part B
def scale(args) -> list:
    import torch

    import ds_xc
    from ds_xc.sampling.base import budget

    torch.set_num_threads(args.threads)
    c, d, n = args.scale_classes, 128, args.scale_batch
    loss = {"type": "arcface", "scale": 64.0, "margin": 0.5}
    sgd = {"type": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4, "update": "lazy"}
    head = ds_xc.ClassParallelHead(d, c, loss=loss, sampler={"type": "ann", "sample_rate": args.rate_list[0]},
                                   chunk_size=128, update="lazy", check_inputs=False)
    opt = ds_xc.build_head_optimizer(head, sgd)
    t = time.perf_counter()
    head.rebuild_index()
    build_s = time.perf_counter() - t
    gen = torch.Generator().manual_seed(5)
    rows = []
    for rate in args.rate_list:
        for g in args.group_list:
            head.sampler.config = head.sampler.config.model_copy(update={"sample_rate": rate, "groups": g})
            times, stats = [], None
            base = None
            for i in range(args.scale_steps + 1):
                x = torch.randn((n, d), generator=gen).requires_grad_(True)
                y = torch.randint(0, c, (n,), generator=gen)
                if i == 1:  # after one warm-up step at this setting
                    base = rss_bytes()
                    reset_peak()
                t = time.perf_counter()
                head(x, y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if i:
                    times.append(time.perf_counter() - t)
                stats = head.sampler_stats()
            extra = hwm_bytes() - base
            row = {"rate": rate, "groups": g, "K": budget(rate, c), "step_s": statistics.median(times),
                   "extra": extra, "active_rows": stats.get("active"), "kept": stats.get("kept"),
                   "cut": stats.get("cut"), "fill": stats.get("fill"), "load": load_average()}
            rows.append(row)
            print(f"[scale] rate {rate} G={g}: step {row['step_s']:.2f} s, extra {mib(extra)} MiB, "
                  f"gathered {row['active_rows']}, kept {row['kept']}, cut {row['cut']}", flush=True)
    for r in rows:
        r["build_s"] = build_s
    return rows


# ---------------------------------------------------------------------------- report
def render(tasks: list, scale_rows: list, args, command: str, started: str, wall_s: float) -> str:
    lines = [
        "# ANN sample groups: per-row recall budget K*G/N vs G gathers of K rows",
        "",
        f"- command: `{command}`",
        f"- date: {started} (wall time {wall_s:.0f} s)",
        f"- CPU: {cpu_model()}, {usable_cores()} cores usable, {args.threads} torch thread(s); load average "
        "(1/5/15 min) per row (other jobs share these cores)",
        f"- ds_xc at git {git_rev()}",
        "- ANN sampler at the library defaults except sample_rate and groups",
        "",
    ]
    if tasks:
        lines += [
            "## Quality on trained weights (part A)",
            "",
            f"Trained weights: the exact-softmax runs of sampler_accuracy.py; {args.batches} training batches "
            "(global batch N of configs/text_exact_20k.json) embedded by the trained backbone; averages over the batches. "
            "`budget/row` = K*G/N; `gathered` = rows gathered over the G groups (G*K), `distinct` = distinct "
            "classes among them; `kept`/`cut`/`fill`: retrieved candidates that fit / did not fit the budgets, "
            "uniform filler (summed over groups); `step ms`: one training step of the head (sampler + gathers + "
            "fused losses + backward + lazy AdamW), median.",
            "",
        ]
        for t in tasks:
            lines += [f"### {t['task']}: {t['num_classes']:,} classes, loss {json.dumps(t['loss'])}", "",
                      "| rate | G | K | budget/row | recall_active@10 | softmax mass | positives | kept | cut | fill | "
                      "gathered | distinct | sample ms | step ms | load |",
                      "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
            for r in t["rows"]:
                lines.append(f"| {r['rate']:g} | {r['groups']} | {r['K']:,} | {r['budget_per_row']:.1f} | "
                             f"{r['recall']:.3f} | {r['mass']:.3f} | {r['positives']:.0f} | {r['kept']:.0f} | "
                             f"{r['cut']:.0f} | {r['fill']:.0f} | {r['gathered']:,.0f} | {r['distinct']:,.0f} | "
                             f"{r['sample_ms']:.0f} | {r['step_ms']:.0f} | {r['load']} |")
            lines.append("")
    if scale_rows:
        lines += [
            f"## Cost at {args.scale_classes:,} classes (part B)",
            "",
            f"One process, {args.threads} thread(s), d=128, N={args.scale_batch}, ArcFace, lazy SGD, random weights "
            f"(the cost does not depend on them), index built once ({scale_rows[0]['build_s']:.0f} s). Per setting "
            f"1 warm-up + {args.scale_steps} timed steps: median step (forward + backward + optimizer), and the "
            "peak RSS above the RSS before the timed steps. `gathered` = G*K active rows of the last step.",
            "",
            "| rate | G | K per group | step s | step / G=1 | extra MiB | gathered | kept | cut | fill | load |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in scale_rows:
            g1 = next(x for x in scale_rows if x["rate"] == r["rate"] and x["groups"] == scale_rows[0]["groups"])
            lines.append(f"| {r['rate']:g} | {r['groups']} | {r['K']:,} | {r['step_s']:.2f} | "
                         f"{r['step_s'] / g1['step_s']:.2f} | {mib(r['extra'])} | {r['active_rows']:,} | {r['kept']} | "
                         f"{r['cut']} | {r['fill']} | {r['load']} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def plot(tasks: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4.2), squeeze=False)
    for ax, t in zip(axes[0], tasks):
        for rate, style in zip(sorted({r["rate"] for r in t["rows"]}, reverse=True), ["-", "--", ":"]):
            pts = [r for r in t["rows"] if r["rate"] == rate]
            ax.plot([r["groups"] for r in pts], [r["recall"] for r in pts], style, marker="o", color="tab:red",
                    label=f"recall_active@10, rate {rate:g}")
            ax.plot([r["groups"] for r in pts], [r["mass"] for r in pts], style, marker="s", color="tab:blue",
                    label=f"softmax mass, rate {rate:g}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sample groups G")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{t['task']}: {t['num_classes']:,} classes")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tasks", default="synthetic,text")
    p.add_argument("--groups", default="1,2,4,8")
    p.add_argument("--rates", default="0.1,0.01")
    p.add_argument("--batches", type=int, default=8, help="training batches per setting (part A)")
    p.add_argument("--timed", type=int, default=3, help="timed head steps per setting (part A)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--skip_quality", action="store_true", help="skip part A")
    p.add_argument("--skip_scale", action="store_true", help="skip part B")
    p.add_argument("--scale_classes", type=int, default=1_000_000)
    p.add_argument("--scale_batch", type=int, default=512)
    p.add_argument("--scale_steps", type=int, default=3)
    p.add_argument("--num_classes", default=None, help="as in sampler_accuracy.py")
    p.add_argument("--steps", default=None, help="as in sampler_accuracy.py")
    p.add_argument("--eval_every", default=None, help="as in sampler_accuracy.py")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work_dir", default=sa.DEFAULT_WORK)
    p.add_argument("--out", default=None, help="markdown (default benchmarks/results/ann_groups.md; '-': none)")
    p.add_argument("--plot", default=None, help="PNG (default benchmarks/results/ann_groups.png; '-': none)")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    args.num_classes, args.steps = sa._per_task(args.num_classes, int), sa._per_task(args.steps, int)
    args.eval_every = sa._per_task(args.eval_every, int)
    if args.smoke:
        args.tasks, args.groups, args.batches, args.timed = "text", "1,4", 2, 1
        args.num_classes, args.steps, args.eval_every = {"text": 2000}, {"text": 20}, {"text": 10}
        args.work_dir = os.path.join(args.work_dir, "smoke")
        args.scale_classes, args.scale_steps = 20_000, 1
        args.out, args.plot = args.out or "-", args.plot or "-"
    args.out = args.out or os.path.join(RESULTS, "ann_groups.md")
    args.plot = args.plot or os.path.join(RESULTS, "ann_groups.png")
    args.task_list = [t.strip() for t in args.tasks.split(",") if t.strip()]
    args.group_list = [int(v) for v in args.groups.split(",") if v.strip()]
    args.rate_list = [float(v) for v in args.rates.split(",") if v.strip()]
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    command = " ".join(shlex.quote(a) for a in ["python", "benchmarks/ann_groups.py", *argv])
    started = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    t0 = time.perf_counter()
    tasks = [] if args.skip_quality else [quality(args, t) for t in args.task_list]
    scale_rows = [] if args.skip_scale else scale(args)
    report = render(tasks, scale_rows, args, command, started, time.perf_counter() - t0)
    print(report)
    write_report(args.out, report)
    if tasks and args.plot != "-":
        plot(tasks, args.plot)
    return tasks, scale_rows


if __name__ == "__main__":
    main()

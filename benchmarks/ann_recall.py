"""Benchmark: recall@10 of the ANN sampler's retrieval on trained weights, against exact top-10.

For each task (see sampler_accuracy.py) a head is trained with the exact softmax through
launch/train.py (the ``full`` run of sampler_accuracy.py, reused from its --work_dir when
present, else trained here with the same command), and its backbone embeds held-out
samples that training never saw. The exact top-10 per query is by the loss's metric:
cosine for margin losses (synthetic: CosFace), the dot product x.w for plain softmax
(text), which the index answers through its MIPS-to-cosine reduction. The index is the
sampler's own (``AnnSampler.rebuild`` / ``retrieve``: probe, Hamming scan, exact re-rank,
keep top_k), one shard holding every class (one rank).

Measured per setting, on ``--queries`` held-out queries in batches of ``--batch``:

* ``recall@10 in top_k``: the share of each query's exact top-10 present in its retrieved
  list of top_k classes (what the sampler puts into the active set; the library metric
  ``recall_retrieved@10``);
* ``10@10``: the share present in the first 10 retrieved (strict nearest-neighbour recall);
* ``lists``: the share of the exact top-10 whose inverted list is among the probed ones
  (the ceiling that the inverted file puts on the recall); ``rows scanned`` per query;
* ``ms/batch``: median wall time of ``retrieve`` for one batch (encode, probe, scan,
  re-rank), and the index build time.

Sweeps: nprobe x code_bits with scan_rows 0 (the inverted file alone; rerank and top_k at
the defaults), then scan_rows (the per-query row budget) and rerank at the other defaults,
then the defaults with the classes split over ``--shards`` P shards (each taking its share
of the head-wide scan_rows and rerank, as the ranks of a P-rank head do).
Plots recall against time per batch (PNG).

    python benchmarks/ann_recall.py
    python benchmarks/ann_recall.py --tasks text --nprobe 8,32 --bits 128,256
    python benchmarks/ann_recall.py --smoke     # text 2,000 classes, 20 training steps, writes nothing
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
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sampler_accuracy as sa  # noqa: E402
from harness import cpu_model, git_rev, load_average, usable_cores, write_report  # noqa: E402

RESULTS = sa.RESULTS
TARGET = 0.95  # issue 16: recall@10 at the defaults on the synthetic and text tasks


# ---------------------------------------------------------------------------- trained model
def trained_model(args, task_name: str):
    """(data, backbone, head weight, loss config) of the task's exact-softmax run."""
    import torch

    from ds_xc.checkpoint import shard_file
    from ds_xc.data import build_dataset
    from ds_xc.engine import load_raw_config
    from ds_xc.models import build_backbone

    run_args = SimpleNamespace(num_classes=args.num_classes, steps=args.steps, eval_every=args.eval_every,
                               seed=args.seed, work_dir=args.work_dir, rerun=False, sets={})
    res = sa.run_one(run_args, task_name, {"type": "full"}, "full")
    ckpt = sa.checkpoint_dir(args.work_dir, res["key"])
    with open(os.path.join(ckpt, "latest")) as fh:
        tag = fh.read().strip()
    task = sa.TASKS[task_name]
    raw = load_raw_config(sa.BASE_CONFIG)
    head_cfg, train_cfg = raw["extreme_classification"], raw["xc_train"]
    loss = task["set"].get("extreme_classification.loss", head_cfg.get("loss", {"type": "softmax"}))
    kwargs = {"context": train_cfg.get("context", 4)} if task["data"] == "text" else {}
    data = build_dataset(task["data"], res["num_classes"], seed=args.seed, **kwargs)
    backbone = build_backbone(data, head_cfg["embedding_dim"], hidden_dim=train_cfg.get("hidden_dim", 256))
    states = torch.load(os.path.join(ckpt, tag, "mp_rank_00_model_states.pt"), map_location="cpu",
                        weights_only=False)
    backbone.load_state_dict(states["module"])
    backbone.eval()
    shard = torch.load(shard_file(os.path.join(ckpt, tag), 0, 1), map_location="cpu", weights_only=False)
    weight = shard["head"]["weight"].float()
    return data, backbone, weight, loss, res


def held_out_queries(data, backbone, count: int):
    import torch

    xs = []
    with torch.no_grad():
        for x, _ in data.eval_batches(256, 0, 1, count):
            xs.append(backbone(x))
    return torch.cat(xs)[:count]


def exact_topk(q, weight, metric: str, k: int = 10, chunk: int = 512):
    import torch
    import torch.nn.functional as F

    w = F.normalize(weight, dim=1) if metric == "cosine" else weight
    qq = F.normalize(q, dim=1)  # the row scale does not change a row's order
    out = []
    for a in range(0, q.shape[0], chunk):
        out.append(torch.topk(qq[a: a + chunk] @ w.t(), k, dim=1).indices)
    return torch.cat(out)


# ---------------------------------------------------------------------------- one setting
def measure(sampler, queries, weight, exact10, batch: int, repeats: int) -> dict:
    """Recall and time of sampler.retrieve over the queries, in batches."""
    import torch
    import torch.nn.functional as F

    q = F.normalize(queries.float(), dim=1)
    hits_k = hits_10 = hits_list = scanned = 0
    times = []
    index = sampler.index
    list_of_row = torch.empty(weight.shape[0], dtype=torch.int64)
    sizes = index.list_offsets[1:] - index.list_offsets[:-1]
    list_of_row[index.list_ids] = torch.repeat_interleave(torch.arange(sizes.numel()), sizes)
    nprobe = min(sampler.config.nprobe, index.centroids.shape[0])
    for a in range(0, q.shape[0], batch):
        qb = q[a: a + batch]
        for r in range(repeats if a == 0 else 1):  # the first batch is timed `repeats` times
            t = time.perf_counter()
            got = sampler.retrieve(qb, weight)  # (n, top_k)
            times.append(time.perf_counter() - t)
        ex = exact10[a: a + batch]  # (n, 10)
        hits_k += int((ex[:, :, None] == got[:, None, :]).any(dim=2).sum())
        hits_10 += int((ex[:, :, None] == got[:, None, :10]).any(dim=2).sum())
        probes = index.probe(index.unit_queries(qb), nprobe, sampler.config.scan_rows)  # as search()
        hits_list += int((list_of_row[ex][:, :, None] == probes[:, None, :]).any(dim=2).sum())
        scanned += int(torch.where(probes >= 0, sizes[probes.clamp_min(0)], 0).sum())
    n = q.shape[0] * exact10.shape[1]
    return {"recall_k": hits_k / n, "recall_10": hits_10 / n, "lists": hits_list / n,
            "scanned": scanned / q.shape[0], "ms": 1e3 * statistics.median(times)}


def sweep(args, task_name: str) -> dict:
    import torch

    from ds_xc.config import parse_sampler
    from ds_xc.sampling import build_sampler

    torch.set_num_threads(args.threads)
    data, backbone, weight, loss, res = trained_model(args, task_name)
    metric = "dot" if loss.get("type", "softmax") == "softmax" else "cosine"
    queries = held_out_queries(data, backbone, args.queries)
    exact10 = exact_topk(queries, weight, metric)
    num = weight.shape[0]
    rows = []
    defaults = parse_sampler({"type": "ann"})

    def run(bits: int, nprobe_list: list, rerank: int, top_k: int, tag: str, scan_list=(0,)):
        cfg = {"type": "ann", "code_bits": bits, "rerank": rerank, "top_k": top_k}
        sampler = build_sampler(cfg, num, 0, args.seed, 0)
        sampler.metric = metric
        t = time.perf_counter()
        sampler.rebuild(weight)
        build_s = time.perf_counter() - t
        for nprobe in nprobe_list:
            for scan in scan_list:
                sampler.config = sampler.config.model_copy(update={"nprobe": nprobe, "scan_rows": scan})
                m = measure(sampler, queries, weight, exact10, args.batch, args.repeats)
                m.update(task=task_name, bits=bits, nprobe=nprobe, rerank=rerank, top_k=top_k, scan_rows=scan,
                         build_s=build_s, nlist=sampler.index.centroids.shape[0], sweep=tag, load=load_average())
                rows.append(m)
                print(f"[{task_name}] {tag}: bits {bits} nprobe {nprobe} scan_rows {scan} rerank {rerank} top_k "
                      f"{top_k}: recall@10 in top_k {m['recall_k']:.3f}, 10@10 {m['recall_10']:.3f}, lists "
                      f"{m['lists']:.3f}, {m['scanned']:.0f} rows scanned, {m['ms']:.1f} ms/batch", flush=True)

    d = defaults
    for bits in args.bits_list:  # the inverted file alone: nprobe lists, no row budget
        run(bits, args.nprobe_list, d.rerank, d.top_k, "nprobe x bits")
    run(d.code_bits, [d.nprobe], d.rerank, d.top_k, "scan_rows", sorted(set(args.scan_list) - {0}))
    for rerank in args.rerank_list:
        if rerank != d.rerank:
            run(d.code_bits, [d.nprobe], rerank, d.top_k, "rerank", [d.scan_rows])
    for shards in args.shard_list:  # the defaults over P shards: head-wide budgets, each its share
        m = measure_shards(args, weight, queries, exact10, metric, shards)
        m.update(task=task_name, bits=d.code_bits, nprobe=d.nprobe, rerank=d.rerank, top_k=d.top_k,
                 scan_rows=d.scan_rows, nlist=0, sweep=f"{shards} shards", shards=shards, load=load_average())
        rows.append(m)
        print(f"[{task_name}] {shards} shards at the defaults: recall@10 in the union of top_k {m['recall_k']:.3f}, "
              f"10@10 {m['recall_10']:.3f}, {m['scanned']:.0f} rows scanned in all, {m['ms']:.1f} ms/batch per shard",
              flush=True)
    return {"task": task_name, "rows": rows, "num_classes": num, "metric": metric, "loss": loss,
            "train": {"top1": res["top1"], "steps": res["steps"]}, "queries": queries.shape[0],
            "defaults": {k: getattr(d, k) for k in ("code_bits", "nprobe", "scan_rows", "rerank", "top_k", "nlist")}}


def measure_shards(args, weight, queries, exact10, metric: str, shards: int) -> dict:
    """Recall at the defaults with the classes split over ``shards`` ranks' shards (in one
    process): each shard's sampler takes its share of the head-wide budgets (scan_budget
    head), and recall@10 counts the exact top-10 in the union of the shards' top_k lists
    (what the ranks' active sets draw from); ``10@10`` in the best 10 of that union by exact
    score. ``rows scanned`` sums the shards' rows per query; ``ms/batch`` is the slowest
    shard's median per batch (the ranks run side by side)."""
    import torch
    import torch.nn.functional as F

    from ds_xc.head import shard_range
    from ds_xc.sampling import build_sampler

    q = F.normalize(queries.float(), dim=1)
    num = weight.shape[0]
    wn = F.normalize(weight, dim=1) if metric == "cosine" else weight
    cands, scanned, ms, build_s = [], 0.0, 0.0, 0.0
    for r in range(shards):
        start, rows = shard_range(num, shards, r)
        s = build_sampler({"type": "ann"}, rows, start, args.seed, r)
        s.metric, s.num_classes = metric, num
        w = weight[start: start + rows]
        t = time.perf_counter()
        s.rebuild(w)
        build_s = max(build_s, time.perf_counter() - t)
        got, times = [], []
        for a in range(0, q.shape[0], args.batch):
            t = time.perf_counter()
            got.append(s.retrieve(q[a: a + args.batch], w))  # (n, top_k) local ids
            times.append(time.perf_counter() - t)
        got = torch.cat(got)
        cands.append(torch.where(got >= 0, got + start, -1))
        ms = max(ms, 1e3 * statistics.median(times))
        probes = s.index.probe(s.index.unit_queries(q), s.config.nprobe, s.budgets()[0])
        sizes = s.index.list_offsets[1:] - s.index.list_offsets[:-1]
        scanned += float(torch.where(probes >= 0, sizes[probes.clamp_min(0)], 0).sum()) / q.shape[0]
    union = torch.cat(cands, dim=1)  # (Q, shards * top_k) global ids
    score = torch.einsum("qd,qrd->qr", q, wn[union.clamp_min(0)]).masked_fill(union < 0, float("-inf"))
    best10 = union.gather(1, score.topk(min(10, union.shape[1]), dim=1).indices)
    n = exact10.numel()
    return {"recall_k": int((exact10[:, :, None] == union[:, None, :]).any(dim=2).sum()) / n,
            "recall_10": int((exact10[:, :, None] == best10[:, None, :]).any(dim=2).sum()) / n,
            "lists": float("nan"), "scanned": scanned, "ms": ms, "build_s": build_s}


# ---------------------------------------------------------------------------- report
def _is_default(r: dict, d: dict) -> bool:
    keys = ("code_bits", "nprobe", "scan_rows", "rerank", "top_k")
    same = (r["bits"], r["nprobe"], r["scan_rows"], r["rerank"], r["top_k"]) == tuple(d[k] for k in keys)
    return same and r.get("shards", 1) == 1


def render(tasks: list, args, command: str, started: str, wall_s: float) -> str:
    lines = [
        "# ANN retrieval: recall@10 against the exact top-10 on trained weights",
        "",
        f"- command: `{command}`",
        f"- date: {started} (wall time {wall_s:.0f} s, not counting reused training runs)",
        f"- CPU: {cpu_model()}, {usable_cores()} cores usable, {args.threads} torch threads; load average "
        f"(1/5/15 min) per row in `load` (other jobs share these cores)",
        f"- ds_xc at git {git_rev()}",
        f"- queries: {args.queries} held-out samples per task, in batches of {args.batch} (the time is the median "
        f"over {args.repeats} calls on the first batch and one call on each other batch)",
        "- weights: the exact-softmax (`full`) run of benchmarks/sampler_accuracy.py with the same task, "
        "classes, steps and seed (reused from its work dir or trained here)",
        "",
    ]
    for t in tasks:
        d = t["defaults"]
        lines += [f"## {t['task']}: {t['num_classes']:,} classes, loss {json.dumps(t['loss'])}, metric `{t['metric']}`, "
                  f"trained {t['train']['steps']} steps (held-out top-1 {100 * t['train']['top1']:.2f}%)", ""]
        default = next((r for r in t["rows"] if _is_default(r, d)), None)
        if default is not None:
            ok = default["recall_k"] >= TARGET
            lines += [f"At the defaults (code_bits {d['code_bits']}, nprobe {d['nprobe']}, scan_rows {d['scan_rows']}, "
                      f"rerank {d['rerank']}, "
                      f"top_k {d['top_k']}, nlist {default['nlist']} = round(sqrt(C))): recall@10 in top_k "
                      f"**{default['recall_k']:.3f}** (target >= {TARGET}: **{'met' if ok else 'NOT met'}**), "
                      f"10@10 {default['recall_10']:.3f}, lists {default['lists']:.3f}, "
                      f"{default['scanned']:,.0f} rows scanned per query, "
                      f"{default['ms']:.1f} ms per batch of {args.batch}.", ""]
        lines += ["| sweep | code_bits | nprobe | scan_rows | rerank | top_k | recall@10 in top_k | 10@10 | lists | "
                  "rows scanned | ms/batch | build s | load |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in t["rows"]:
            mark = " (default)" if _is_default(r, d) else ""
            lines.append(f"| {r['sweep']}{mark} | {r['bits']} | {r['nprobe']} | {r['scan_rows']} | {r['rerank']} | "
                         f"{r['top_k']} | {r['recall_k']:.3f} | {r['recall_10']:.3f} | {r['lists']:.3f} | "
                         f"{r['scanned']:,.0f} | {r['ms']:.1f} | {r['build_s']:.1f} | {r['load']} |")
        lines.append("")
    lines += ["`lists` bounds what any code length can reach with those probes; the gap between `lists` and "
              "`recall@10 in top_k` is what the Hamming ranking (code_bits) and the re-rank depth lose. The "
              "`nprobe x bits` grid runs with scan_rows 0 (the inverted file alone); `scan_rows` adds lists "
              "in centroid order until that many rows are scanned per query (a shard of at most scan_rows rows is "
              "scanned flat). `P shards`: the defaults with the classes split over P shards, each scanning and "
              "re-ranking its share of scan_rows and rerank (scan_budget head; recall in the union of the "
              "shards' top_k lists, 10@10 in its best 10 by exact score, rows scanned summed over the shards, "
              "ms per batch of the slowest shard).", ""]
    return "\n".join(lines) + "\n"


def plot(tasks: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tasks), figsize=(6.5 * len(tasks), 4.6), squeeze=False)
    for ax, t in zip(axes[0], tasks):
        d = t["defaults"]
        grid = [r for r in t["rows"] if r["sweep"] == "nprobe x bits"]
        for bits in sorted({r["bits"] for r in grid}):
            pts = sorted((r for r in grid if r["bits"] == bits), key=lambda r: r["nprobe"])
            ax.plot([r["ms"] for r in pts], [r["recall_k"] for r in pts], marker="o", label=f"{bits} bits")
            for r in pts:
                ax.annotate(str(r["nprobe"]), (r["ms"], r["recall_k"]), fontsize=6, xytext=(2, -8),
                            textcoords="offset points")
        scan = sorted((r for r in t["rows"] if r["sweep"] == "scan_rows"), key=lambda r: r["scan_rows"])
        if scan:
            ax.plot([r["ms"] for r in scan], [r["recall_k"] for r in scan], color="black", linestyle="--",
                    marker="^", label=f"scan_rows {'/'.join(str(r['scan_rows']) for r in scan)} "
                    f"({d['code_bits']} bits)")
        rer = sorted((r for r in t["rows"] if r["sweep"] == "rerank" or (r["sweep"] == "scan_rows"
                      and r["scan_rows"] == d["scan_rows"])), key=lambda r: r["rerank"])
        if len(rer) > 1:
            ax.plot([r["ms"] for r in rer], [r["recall_k"] for r in rer], color="grey", linestyle=":", marker="s",
                    label=f"rerank {'/'.join(str(r['rerank']) for r in rer)} (defaults otherwise)")
        default = next((r for r in t["rows"] if _is_default(r, d)), None)
        if default is not None:
            ax.plot([default["ms"]], [default["recall_k"]], marker="*", markersize=16, color="black",
                    linestyle="none", label="defaults")
        ax.axhline(TARGET, color="red", linewidth=0.8, linestyle="--")
        ax.set_xscale("log")
        ax.set_xlabel("ms per batch of queries (retrieve: probe + scan + re-rank)")
        ax.set_ylabel("recall@10 in the retrieved top_k")
        ax.set_title(f"{t['task']}: {t['num_classes']:,} classes, metric {t['metric']} (labels: nprobe)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", flush=True)


# ---------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tasks", default="synthetic,text")
    p.add_argument("--nprobe", default="1,2,4,8,16,32,64,128", help="nprobe values")
    p.add_argument("--bits", default="64,128,256,512", help="code_bits values")
    p.add_argument("--rerank", default="0,64,192,1024", help="rerank depths at the other defaults")
    p.add_argument("--scan_rows", default="4096,16384,32768,65536",
                   help="scan_rows values at the default bits, nprobe and rerank")
    p.add_argument("--shards", default="2,4", help="shard counts at the defaults (head-wide budgets; '' for none)")
    p.add_argument("--queries", type=int, default=4096, help="held-out queries per task")
    p.add_argument("--batch", type=int, default=512, help="queries per retrieve call (the global batch)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls on the first batch")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--num_classes", default=None, help="as in sampler_accuracy.py")
    p.add_argument("--steps", default=None, help="as in sampler_accuracy.py")
    p.add_argument("--eval_every", default=None, help="as in sampler_accuracy.py")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work_dir", default=sa.DEFAULT_WORK, help="sampler_accuracy.py's work dir (trained runs)")
    p.add_argument("--out", default=None, help="markdown (default benchmarks/results/ann_recall.md; '-': none)")
    p.add_argument("--plot", default=None, help="PNG (default benchmarks/results/ann_recall.png; '-': none)")
    p.add_argument("--json", default=None, help="also dump the rows as JSON here")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    args.num_classes, args.steps = sa._per_task(args.num_classes, int), sa._per_task(args.steps, int)
    args.eval_every = sa._per_task(args.eval_every, int)
    if args.smoke:
        args.tasks, args.nprobe, args.bits, args.rerank = "text", "4,32", "64,256", "0"
        args.scan_rows = "4096,65536"
        args.num_classes, args.steps, args.eval_every = {"text": 2000}, {"text": 20}, {"text": 10}
        args.work_dir = os.path.join(args.work_dir, "smoke")
        args.queries, args.out, args.plot = 1024, args.out or "-", args.plot or "-"
    args.out = args.out or os.path.join(RESULTS, "ann_recall.md")
    args.plot = args.plot or os.path.join(RESULTS, "ann_recall.png")
    args.task_list = [t.strip() for t in args.tasks.split(",") if t.strip()]
    args.nprobe_list = [int(v) for v in args.nprobe.split(",") if v.strip()]
    args.bits_list = [int(v) for v in args.bits.split(",") if v.strip()]
    args.rerank_list = [int(v) for v in args.rerank.split(",") if v.strip()]
    args.scan_list = [int(v) for v in args.scan_rows.split(",") if v.strip()]
    args.shard_list = [int(v) for v in args.shards.split(",") if v.strip()]
    return args


def main(argv=None) -> list:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    command = " ".join(shlex.quote(a) for a in ["python", "benchmarks/ann_recall.py", *argv])
    started = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    t0 = time.perf_counter()
    tasks = [sweep(args, t) for t in args.task_list]
    report = render(tasks, args, command, started, time.perf_counter() - t0)
    print(report)
    write_report(args.out, report)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(tasks, fh, indent=1)
    if args.plot != "-":
        plot(tasks, args.plot)
    return tasks


if __name__ == "__main__":
    main()

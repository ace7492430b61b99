"""One command for the evaluation report: samplers, sample rates, compression, head scaling, recall.

    python launch/bench.py report                      # ~16 min on 2 CPU cores -> docs/report/
    python launch/bench.py report --scale 4 --out /data/report   # bigger tasks (GPU machines)
    python launch/bench.py report --parts samplers,rates --smoke # a minute, to check the plumbing

Every part runs side by side with the same seeds and writes its own markdown and PNG
under ``--out``; ``report.md`` there collects them with the command, the machine and
the time each part took. Parts (``--parts``, default all):

* ``samplers``: held-out top-1 against steps for exact softmax, uniform, knn and ann at
  sample rates 0.1 and 0.01, on the synthetic hard-negative task and on the text task
  (benchmarks/sampler_accuracy.py);
* ``rates``: top-1 against the sample rate (uniform and ann at 0.01, 0.03, 0.1, 0.3 on the
  text task, exact softmax as the line to reach);
* ``compression``: compressed (top-k, random-k, bayes_prior at density 0.01, error
  feedback) vs dense backbone reduction on 2 ranks: bytes and top-1
  (benchmarks/compression_accuracy.py);
* ``head``: head step time and peak memory against the number of classes, exact chunked
  vs ANN-sampled lazy head, one process (measured here);
* ``recall``: ANN recall@10 against nprobe and code bits on the trained synthetic and text heads
  (benchmarks/ann_recall.py, reusing the ``samplers`` part's exact run).

Runs are cached in ``--work_dir`` (a rerun of the report reuses finished training runs;
``--rerun`` retrains). Sizes scale with ``--scale`` (steps and classes). ``report.md``
collects every part recorded in ``--out/parts.json``, so parts can be run in separate
invocations (e.g. the timing part ``head`` alone on an idle machine).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

PARTS = ("samplers", "rates", "compression", "head", "recall")
RATES = (0.01, 0.03, 0.1, 0.3)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["report"], help="what to run")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "report"), help="report folder")
    p.add_argument("--work_dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "ds_xc_bench", "report"),
                   help="training runs and their summaries (reused when present)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from {', '.join(PARTS)}")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies steps and classes (4 on a GPU machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rerun", action="store_true", help="retrain runs whose summaries exist")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks that every part runs")
    args = p.parse_args(argv)
    args.part_list = [x.strip() for x in args.parts.split(",") if x.strip()]
    bad = [x for x in args.part_list if x not in PARTS]
    if bad:
        p.error(f"--parts: unknown {bad}; allowed {list(PARTS)}")
    if args.scale <= 0:
        p.error(f"--scale={args.scale} is invalid: must be > 0")
    return args


def sizes(args) -> dict:
    """Steps and classes of each part at this scale (``--smoke``: the smallest that still runs)."""
    s = args.scale
    if args.smoke:
        return {"steps": 20, "eval_every": 10, "synthetic_classes": 2000, "text_classes": 2000,
                "compression_steps": 10, "head_classes": [2000, 8000], "queries": 512}
    return {"steps": max(20, int(150 * s)), "eval_every": max(10, int(50 * s)),
            "synthetic_classes": int(50_000 * s), "text_classes": min(int(20_000 * s), 20_000),
            "compression_steps": max(10, int(150 * s)),
            "head_classes": [int(c * s) for c in (10_000, 30_000, 100_000, 300_000)], "queries": 2048}


# ---------------------------------------------------------------------------- parts
def part_samplers(args, sz, out) -> dict:
    import sampler_accuracy as sa
    argv = ["--tasks", "synthetic,text", "--rates", "0.1,0.01", "--seed", str(args.seed),
            "--steps", str(sz["steps"]), "--eval_every", str(sz["eval_every"]),
            "--num_classes", f"synthetic={sz['synthetic_classes']},text={sz['text_classes']}",
            "--work_dir", args.work_dir, "--out", os.path.join(out, "sampler_accuracy.md"),
            "--plot", os.path.join(out, "sampler_accuracy.png")] + (["--rerun"] if args.rerun else [])
    sa.main(argv)
    return {"md": "sampler_accuracy.md", "png": "sampler_accuracy.png",
            "title": "Accuracy against steps: exact, uniform, knn, ann"}


def part_rates(args, sz, out) -> dict:
    import sampler_accuracy as sa
    argv = ["--tasks", "text", "--samplers", "full,uniform,ann", "--rates", ",".join(map(str, RATES)),
            "--seed", str(args.seed), "--steps", str(sz["steps"]), "--eval_every", str(sz["eval_every"]),
            "--num_classes", f"text={sz['text_classes']}", "--work_dir", args.work_dir,
            "--out", os.path.join(out, "sample_rate.md"), "--plot", "-"] + (["--rerun"] if args.rerun else [])
    results = sa.main(argv)
    plot_rates(results, os.path.join(out, "sample_rate.png"))
    return {"md": "sample_rate.md", "png": "sample_rate.png", "title": "Accuracy against the sample rate (text)"}


def plot_rates(results: list, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    full = next((r for r in results if r["sampler"]["type"] == "full"), None)
    for kind, color in (("uniform", "tab:blue"), ("ann", "tab:red")):
        rows = sorted((r for r in results if r["sampler"]["type"] == kind), key=lambda r: r["sampler"]["sample_rate"])
        ax.plot([r["sampler"]["sample_rate"] for r in rows], [100 * r["top1"] for r in rows], marker="o",
                color=color, label=kind)
    if full is not None:
        ax.axhline(100 * full["top1"], color="black", linestyle="--", label="exact softmax")
    ax.set_xscale("log")
    ax.set_xlabel("sample rate (share of the classes scored per step)")
    ax.set_ylabel("held-out top-1 (%)")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("Top-1 at equal steps against the sample rate")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def part_compression(args, sz, out) -> dict:
    import compression_accuracy as ca
    ca.main(["--steps", str(sz["compression_steps"]), "--variants", "dense;topk;randomk;bayes_prior",
             "--out", os.path.join(out, "compression.md")])
    return {"md": "compression.md", "png": None, "title": "Compressed vs dense backbone gradients (2 ranks)"}


HEAD_VARIANTS = {"exact chunked": ({"type": "full"}, "dense"),
                 "ann 0.1 (lazy)": ({"type": "ann", "sample_rate": 0.1}, "lazy")}
HEAD_BATCH, HEAD_DIM = 512, 128


def head_case(classes: int, variant: str, seed: int, batch: int = HEAD_BATCH, dim: int = HEAD_DIM) -> dict:
    """One head configuration, measured in the calling process (a fresh one: see part_head)."""
    from benchmarks.harness import hwm_bytes, reset_peak, rss_bytes
    import torch
    from ds_xc import ClassParallelHead, build_head_optimizer
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    sampler, update = HEAD_VARIANTS[variant]
    head = ClassParallelHead(dim, classes, loss={"type": "arcface", "scale": 64.0, "margin": 0.5},
                             sampler=sampler, chunk_size=128, update=update, seed=seed)
    opt = build_head_optimizer(head, {"type": "sgd", "lr": 0.1, "momentum": 0.9, "update": update})
    gen = torch.Generator().manual_seed(seed)
    times = []
    for step in range(5):
        x = torch.randn(batch, dim, generator=gen, requires_grad=True)
        y = torch.randint(0, classes, (batch,), generator=gen)
        if step == 2:
            before = rss_bytes()  # the step's start: weights, momentum, index and the runtime
            reset_peak()
        t = time.perf_counter()
        head(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
    tensors = [head.weight] + [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
    index = getattr(head.sampler, "index", None)
    if index is not None:
        tensors += [t for t in index.state_dict().values() if torch.is_tensor(t)]
    return {"classes": classes, "variant": variant, "step_s": min(times[2:]), "threads": torch.get_num_threads(),
            "persistent_mib": sum(t.numel() * t.element_size() for t in tensors) / 2**20,
            "peak_mib": (hwm_bytes() - before) / 2**20}


def part_head(args, sz, out) -> dict:
    """Step time and memory of the exact chunked head and the ANN lazy head against C.

    Each configuration runs in a fresh process with a fixed malloc mmap threshold, so
    that large temporaries are mapped and unmapped (visible in VmHWM) rather than reused
    from a heap that earlier configurations grew."""
    import subprocess
    from benchmarks.harness import peak_reset_works
    if not peak_reset_works():
        raise RuntimeError("part head: /proc/self/clear_refs does not reset VmHWM on this machine")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    rows = []
    for classes in sz["head_classes"]:
        for name in HEAD_VARIANTS:
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "_head_case",
                                   json.dumps([classes, name, args.seed])], env=env, capture_output=True,
                                  text=True, check=True)
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"head {name} C={classes}: {rows[-1]['step_s']:.3f} s, step +{rows[-1]['peak_mib']:.0f} MiB, "
                  f"persistent {rows[-1]['persistent_mib']:.0f} MiB", flush=True)
    lines = ["# Head step against the number of classes", "",
             f"One process per configuration (fresh, {rows[0]['threads']} threads, malloc mmap threshold fixed at "
             f"64 KiB), global batch {HEAD_BATCH}, d={HEAD_DIM}, ArcFace; the exact head with fused chunked logits (chunk 128, "
             "dense SGD momentum), the ANN head at sample rate 0.1 with lazy SGD momentum (index build at the first "
             "step, not timed). Step = forward + backward + optimizer step, best of steps 3-5. `persistent` = "
             "the tensors kept between steps (weights, momentum, index); `step memory` = peak resident memory over "
             "steps 3-5 (VmHWM) above the resident memory before step 3, what a step adds.", "",
             "| classes | variant | step s | persistent MiB | step memory MiB |", "|---:|---|---:|---:|---:|"]
    lines += [f"| {r['classes']:,} | {r['variant']} | {r['step_s']:.3f} | {r['persistent_mib']:.0f} | "
              f"{r['peak_mib']:.0f} |" for r in rows]
    with open(os.path.join(out, "head_scaling.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, color in zip(HEAD_VARIANTS, ("black", "tab:red")):
        rs = [r for r in rows if r["variant"] == name]
        axes[0].plot([r["classes"] for r in rs], [r["step_s"] for r in rs], marker="o", color=color, label=name)
        axes[1].plot([r["classes"] for r in rs], [max(r["peak_mib"], 1.0) for r in rs], marker="o", color=color,
                     label=f"{name}: step")
        axes[1].plot([r["classes"] for r in rs], [max(r["persistent_mib"], 1.0) for r in rs], marker="s",
                     color=color, linestyle="--", label=f"{name}: persistent")
    for ax, label in zip(axes, ("step time (s)", "memory (MiB, log; floor 1)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("classes")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "head_scaling.png"), dpi=110)
    plt.close(fig)
    return {"md": "head_scaling.md", "png": "head_scaling.png", "title": "Head step time and memory against classes"}


def part_recall(args, sz, out) -> dict:
    import ann_recall as ar
    tasks = "text" if args.smoke else "synthetic,text"
    ar.main(["--tasks", tasks, "--nprobe", "1,4,16,64", "--bits", "256,512", "--rerank", "0,192",
             "--scan_rows", "4096,16384,65536",
             "--queries", str(sz["queries"]),
             "--num_classes", f"synthetic={sz['synthetic_classes']},text={sz['text_classes']}",
             "--steps", str(sz["steps"]), "--eval_every", str(sz["eval_every"]), "--seed", str(args.seed),
             "--work_dir", args.work_dir, "--out", os.path.join(out, "recall.md"),
             "--plot", os.path.join(out, "recall.png")])
    return {"md": "recall.md", "png": "recall.png", "title": "ANN recall@10 against nprobe and code bits"}


RUNNERS = {"samplers": part_samplers, "rates": part_rates, "compression": part_compression, "head": part_head,
           "recall": part_recall}


# ---------------------------------------------------------------------------- report
def machine() -> str:
    import torch
    from benchmarks.harness import cpu_model, git_rev, usable_cores
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{cpu_model()}, {usable_cores()} usable cores, {gpu}; Python {platform.python_version()}, "
            f"torch {torch.__version__}; git {git_rev()}")


def main(argv=None) -> str:
    argv = sys.argv[1:] if argv is None else list(argv)
    from benchmarks.harness import git_rev
    args = parse_args(argv)
    sz = sizes(args)
    out = os.path.abspath(args.out if not args.smoke else os.path.join(args.work_dir, "smoke_report"))
    if args.smoke:
        args.work_dir = os.path.join(args.work_dir, "smoke")
    os.makedirs(out, exist_ok=True)
    os.makedirs(args.work_dir, exist_ok=True)
    started = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    record_path = os.path.join(out, "parts.json")  # parts run so far into this folder (a report can be built
    record = {}                                    # in several invocations, e.g. timing parts on an idle machine)
    if os.path.isfile(record_path):
        with open(record_path) as fh:
            record = json.load(fh)
    for name in args.part_list:
        t0 = time.perf_counter()
        print(f"== {name} ==", flush=True)
        info = RUNNERS[name](args, sz, out)
        record[name] = dict(info, minutes=(time.perf_counter() - t0) / 60, date=started, sizes=sz, git=git_rev(),
                            command=f"python launch/bench.py {' '.join(shlex.quote(a) for a in argv)}")
        with open(record_path, "w") as fh:
            json.dump(record, fh, indent=1)
    path = write_report(out, record)
    print(f"wrote {path}", flush=True)
    return path


def write_report(out: str, record: dict) -> str:
    """report.md from every part recorded in ``out`` (in PARTS order)."""
    lines = ["# ds_xc evaluation report", "", f"- machine: {machine()} (when this file was written)",
             "- parts (command, date, minutes, git revision it ran at):"]
    lines += [f"  - {n}: `{record[n]['command']}`, {record[n]['date']}, {record[n]['minutes']:.1f} min, "
              f"git {record[n].get('git', '?')}" for n in PARTS if n in record]
    lines.append("")
    for name in [n for n in PARTS if n in record]:
        info = record[name]
        lines += [f"## {info['title']}", ""]
        if info.get("png"):
            lines += [f"![{name}]({info['png']})", ""]
        with open(os.path.join(out, info["md"])) as fh:
            body = fh.read().split("\n")
        if body and body[0].startswith("# "):  # the part's own title: ours replaces it
            body = body[1:]
        lines += ["\n".join("##" + l if l.startswith("#") else l for l in body), ""]
    path = os.path.join(out, "report.md")
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return path


if __name__ == "__main__":
    if sys.argv[1:2] == ["_head_case"]:  # one configuration of part_head, in its own process
        print(json.dumps(head_case(*json.loads(sys.argv[2]))), flush=True)
    else:
        main()

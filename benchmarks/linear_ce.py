"""Benchmark: ds_xc's exact head against torch's ``linear_cross_entropy`` and plain matmul + ``cross_entropy``.

The job of a language model's output layer: N tokens' hidden states x (N, d) against a
vocabulary of V classes W (V, d), the mean softmax cross entropy over the N rows, forward and
backward (the gradients of x and W). Variants, all float32 (``--dtype bfloat16`` for 16-bit
weights and inputs), one torch thread, the same x, W and labels:

* ``matmul+cross_entropy``: ``F.cross_entropy(x @ W.T, y)``: the (N, V) logits, their log-softmax
  and their gradient all exist at once;
* ``linear_cross_entropy``: ``F.linear_cross_entropy(x, W, y)`` at its default options
  (``options=None``: torch 2.13's reference path, the same matmul + cross_entropy);
* ``linear_cross_entropy auto``: ``options=LinearCrossEntropyOptions()``: torch's chunked op with
  its own pick of rows per chunk (``chunking_method="auto"``; float32 on a CPU resolves to
  ``aspect_ratio:2`` and ``acc_policy="compact"``);
* ``linear_cross_entropy chunk=n``: the chunked op at ``batch_chunk_size=n`` for each n of
  ``--lce_chunks``: its best chunking is the fastest of these;
* ``ds_xc chunk=n``: a one-rank ``ds_xc.ClassParallelHead`` (loss softmax, sampler full: exact;
  no process group) at ``chunk_size=n`` for each n of ``--xc_chunks``, ``check_inputs`` off.

Every variant runs in a fresh subprocess (``--worker``), so its memory peak starts clean:
the process runs one tiny call of the same code first (code loaded, native ops built), builds
x, W and the labels (seed 0), then runs ``--warmup`` (default 0) + ``--reps`` (default 1) calls
of forward + backward (the gradients set to None between calls: every call allocates its
buffers afresh, as in training) and reports the median wall and CPU time of the timed calls
and the peak RSS above the RSS after the inputs were built (VmHWM reset
through /proc/self/clear_refs; includes W's gradient, (V, d), which every variant produces).
A variant that runs past ``--timeout`` or is killed (out of memory) is reported as such; one
whose estimated peak exceeds ``--max_mem_frac`` of MemAvailable is not started (the machine is
shared: no OOM kill of someone else's job).

    python benchmarks/linear_ce.py            # V = 128k and 256k, d = 1024, N = 4096 (~8 CPU minutes)
    python benchmarks/linear_ce.py --smoke    # V = 4096, d = 64, N = 256: seconds, writes nothing
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/harness.py
from harness import (cpu_model, cpu_seconds, git_rev, hwm_bytes, load_average, mib, peak_reset_works,  # noqa: E402
                     release_free_memory, reset_peak, rss_bytes, usable_cores, write_report)

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "linear_ce", "linear_ce.md")
REV_PATHS = ("ds_xc", "ops", "benchmarks", ":(exclude)benchmarks/results")  # what the measurement runs
PLAIN, LCE, LCE_AUTO = "matmul+cross_entropy", "linear_cross_entropy", "linear_cross_entropy auto"


# ---------------------------------------------------------------------------- one variant (worker)
def _inputs(torch, spec: dict):
    """x (N, d) leaf, W (V, d), y (N,), the same for every variant (seed 0)."""
    dtype = getattr(torch, spec["dtype"])
    g = torch.Generator().manual_seed(0)
    x = torch.randn((spec["tokens"], spec["dim"]), generator=g).to(dtype).requires_grad_(True)
    w = (0.02 * torch.randn((spec["vocab"], spec["dim"]), generator=g)).to(dtype)
    y = torch.randint(0, spec["vocab"], (spec["tokens"],), generator=g)
    return x, w, y


def _variant(torch, spec: dict, w):
    """(loss_fn(x, y), the weight Parameter) of the variant ``spec['variant']``."""
    import torch.nn.functional as F

    kind, chunk = spec["variant"], spec["chunk"]
    if kind == "ds_xc":
        import ds_xc

        head = ds_xc.ClassParallelHead(spec["dim"], spec["vocab"], loss="softmax", sampler="full", group=None,
                                       chunk_size=chunk, dtype=w.dtype, check_inputs=False)
        with torch.no_grad():
            head.weight.copy_(w)
        return head, head.weight
    weight = torch.nn.Parameter(w)
    if kind == PLAIN:
        return (lambda x, y: F.cross_entropy(x @ weight.t(), y)), weight
    if kind == LCE:
        return (lambda x, y: F.linear_cross_entropy(x, weight, y)), weight
    opts = torch.nn.LinearCrossEntropyOptions() if kind == LCE_AUTO else \
        torch.nn.LinearCrossEntropyOptions(batch_chunk_size=chunk, chunking_method=None)
    return (lambda x, y: F.linear_cross_entropy(x, weight, y, options=opts)), weight


def run_worker(spec: dict) -> dict:
    """Time and peak memory of one variant in this (fresh) process."""
    import torch

    torch.set_num_threads(1)
    tiny = dict(spec, vocab=min(spec["vocab"], 512), tokens=min(spec["tokens"], 64), dim=min(spec["dim"], 32))
    x, w, y = _inputs(torch, tiny)  # one tiny call first: code loaded, native ops built, pools started
    fn, weight = _variant(torch, tiny, w)
    fn(x, y).backward()
    del x, w, y, fn, weight
    x, w, y = _inputs(torch, spec)
    fn, weight = _variant(torch, spec, w)
    del w
    release_free_memory()
    baseline = rss_bytes()
    reset_peak()
    times, cpu, losses = [], [], []
    for _ in range(spec["warmup"] + spec["reps"]):
        x.grad = weight.grad = None
        c0, t0 = cpu_seconds(), time.perf_counter()
        loss = fn(x, y)
        loss.backward()
        times.append(time.perf_counter() - t0)
        cpu.append(cpu_seconds() - c0)
        losses.append(float(loss.detach()))
    peak = hwm_bytes() - baseline
    timed = times[spec["warmup"]:]
    return {"time_s": statistics.median(timed), "times": times, "cpu_s": statistics.median(cpu[spec["warmup"]:]),
            "peak": peak, "loss": losses[0],
            "grad_w_norm": float(weight.grad.float().norm()), "torch": torch.__version__}


# ---------------------------------------------------------------------------- driver
def run_variant(spec: dict, timeout: float) -> dict:
    """Run one variant in a fresh process with one thread; {"error": why} if it fails or times out."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"over the {timeout:.0f} s timeout"}
    if proc.returncode != 0:
        killed = proc.returncode in (-9, 137)
        tail = proc.stderr.strip().splitlines()[-1:] if proc.stderr.strip() else []
        return {"error": "killed (out of memory?)" if killed else f"exit {proc.returncode}: {' '.join(tail)[:200]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def mem_available() -> int:
    """MemAvailable of /proc/meminfo in bytes (0 where it cannot be read)."""
    try:
        with open("/proc/meminfo") as fh:
            return next(int(l.split()[1]) * 1024 for l in fh if l.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 0


def estimated_peak(kind: str, spec: dict) -> int:
    """A rough peak in bytes: the full-logits variants hold about four (N, V) float32 tensors (logits,
    log-softmax and their gradients) besides W and its gradient; the chunked ones a few chunks."""
    width = 4 if spec["dtype"] == "float32" else 2
    weights = 2 * spec["vocab"] * spec["dim"] * width
    rows = spec["tokens"] if kind in (PLAIN, LCE) else min(max(spec["chunk"], 64), spec["tokens"])
    return weights + 4 * rows * spec["vocab"] * 4


def variants(args) -> list[tuple[str, int]]:
    """(kind, chunk) of every variant to run, in order."""
    out = [(PLAIN, 0), (LCE, 0), (LCE_AUTO, 0)]
    out += [("lce", c) for c in args.lce_chunk_list]
    out += [("ds_xc", c) for c in args.xc_chunk_list]
    return out


def label(kind: str, chunk: int) -> str:
    if kind == "lce":
        return f"linear_cross_entropy chunk={chunk}"
    if kind == "ds_xc":
        return f"ds_xc chunk={chunk}"
    return kind


def render(rows: list[dict], args, command: str, started: str, wall_s: float, hwm_ok: bool, facts: dict) -> str:
    lines = [
        "# Exact softmax head: ds_xc vs torch's linear_cross_entropy vs matmul + cross_entropy",
        "",
        f"- command: `{command}`",
        f"- date: {started} (wall time {wall_s:.0f} s); load average at the end {load_average()}",
        f"- torch {facts.get('torch', '?')}, python {platform.python_version()}, CPU: {cpu_model()}, "
        f"{usable_cores()} cores usable; 1 torch thread per variant (torch.set_num_threads(1), OMP_NUM_THREADS=1)",
        f"- git {git_rev(REV_PATHS)}",
        f"- N = {args.tokens:,} tokens, d = {args.dim}, {args.dtype}; every variant in a fresh process: "
        f"{args.warmup} warm-up + {args.reps} timed forward+backward calls, median",
        f"- VmHWM reset via /proc/self/clear_refs works here: {'yes' if hwm_ok else 'NO (peak is since process start)'}",
        "",
        "time: median wall seconds of forward + backward (the mean loss over N rows; the gradients of x and W), "
        "every call's in brackets; cpu: median CPU seconds (user + sys) of the same calls, the steadier measure "
        "on a shared machine (one thread: cpu <= time, the gap is time spent waiting for a core). "
        "peak: MiB of RSS above the process's RSS once x, W and the labels exist (W's gradient, "
        f"V x d x {4 if args.dtype == 'float32' else 2} B, is part of every variant's peak). "
        "Ratios (time and cpu) against the best linear_cross_entropy (the fastest of its rows by cpu) and "
        "matmul+cross_entropy. loss: the first call's value (the same inputs everywhere).",
        "",
    ]
    for vocab in args.vocab_list:
        lines += _table(rows, vocab, args)
    return "\n".join(lines)


def _table(rows: list[dict], vocab: int, args) -> list[str]:
    """The section of one vocabulary size."""
    sub = [r for r in rows if r["vocab"] == vocab]
    ok = [r for r in sub if "error" not in r]
    best = lambda rs: min(rs, key=lambda r: r["cpu_s"]) if rs else None  # noqa: E731
    best_lce = best([r for r in ok if r["kind"] in (LCE, LCE_AUTO, "lce")])
    best_xc = best([r for r in ok if r["kind"] == "ds_xc"])
    plain = next((r for r in ok if r["kind"] == PLAIN), None)
    ratio = lambda r, b, key: f"{r[key] / b[key]:.2f}" if b else "-"  # noqa: E731
    width = 4 if args.dtype == "float32" else 2
    lines = [f"## V = {vocab:,} (W: {mib(vocab * args.dim * width)} MiB, float32 logits N x V: "
             f"{mib(args.tokens * vocab * 4)} MiB)", "",
             "| variant | time s (calls) | cpu s | peak MiB | time / best lce | cpu / best lce | cpu / matmul+CE "
             "| peak / best lce | loss |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sub:
        name = label(r["kind"], r["chunk"]) + (" (best lce)" if r is best_lce else "") + \
            (" (best ds_xc)" if r is best_xc else "")
        if "error" in r:
            lines.append(f"| {name} | {r['error']} | - | - | - | - | - | - | - |")
            continue
        lines.append(f"| {name} | {r['time_s']:.3g} ({', '.join(f'{t:.3g}' for t in r['times'])}) | {r['cpu_s']:.3g} | "
                     f"{mib(r['peak'])} | {ratio(r, best_lce, 'time_s')} | {ratio(r, best_lce, 'cpu_s')} | "
                     f"{ratio(r, plain, 'cpu_s')} | {ratio(r, best_lce, 'peak')} | {r['loss']:.6f} |")
    if best_xc and best_lce:
        others = [best_lce] + ([plain] if plain else [])
        faster = {k: all(best_xc[k] < o[k] for o in others) for k in ("cpu_s", "time_s")}
        yes = lambda v: "yes" if v else "**no**"  # noqa: E731
        lines += ["", f"Best ds_xc ({label('ds_xc', best_xc['chunk'])}) faster than the best linear_cross_entropy "
                  f"({label(best_lce['kind'], best_lce['chunk'])}) and matmul+cross_entropy: by cpu {yes(faster['cpu_s'])}, "
                  f"by wall time {yes(faster['time_s'])}; peak no higher than that linear_cross_entropy's: "
                  f"{yes(best_xc['peak'] <= best_lce['peak'])}."]
    return lines + [""]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--vocab", default=None, help="comma-separated V (default 131072,262144; --smoke 4096)")
    p.add_argument("--dim", type=int, default=None, help="d (default 1024; --smoke 64)")
    p.add_argument("--tokens", type=int, default=None, help="N (default 4096; --smoke 256)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--lce_chunks", default=None,
                   help="batch_chunk_size values of linear_cross_entropy (default 1024; --smoke 64)")
    p.add_argument("--xc_chunks", default=None, help="ds_xc chunk_size values (default 1024; --smoke 64)")
    p.add_argument("--skip", default="", help="comma-separated variant kinds not to run "
                   f"({PLAIN!r}, {LCE!r}, {LCE_AUTO!r}, 'lce', 'ds_xc')")
    p.add_argument("--warmup", type=int, default=0,
                   help="untimed full-size calls first (a tiny call always runs first: code loaded, ops built)")
    p.add_argument("--reps", type=int, default=None, help="timed calls (default 1; --smoke 2)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per variant")
    p.add_argument("--max_mem_frac", type=float, default=0.75,
                   help="a variant whose estimated peak exceeds this share of MemAvailable is not run")
    p.add_argument("--out", default=None, help=f"markdown file (default {os.path.relpath(DEFAULT_OUT)}; "
                                               "--smoke: none; '-': none)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, writes nothing")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    smoke = args.smoke
    args.vocab = args.vocab or ("4096" if smoke else "131072,262144")
    args.dim = args.dim or (64 if smoke else 1024)
    args.tokens = args.tokens or (256 if smoke else 4096)
    args.out = args.out or ("-" if smoke else DEFAULT_OUT)
    args.reps = args.reps or (2 if smoke else 1)
    args.lce_chunks = args.lce_chunks or ("64" if smoke else "1024")
    args.xc_chunks = args.xc_chunks or ("64" if smoke else "1024")
    ints = lambda s: [int(v) for v in s.split(",") if v.strip()]  # noqa: E731
    args.vocab_list, args.lce_chunk_list, args.xc_chunk_list = ints(args.vocab), ints(args.lce_chunks), ints(args.xc_chunks)
    args.skip_set = {s.strip() for s in args.skip.split(",") if s.strip()}
    if min(args.vocab_list + args.lce_chunk_list + args.xc_chunk_list + [args.dim, args.tokens, args.reps]) < 1 \
            or args.warmup < 0:
        p.error("--vocab, --dim, --tokens, --reps and the chunk sizes take positive integers, --warmup >= 0")
    return args


def main(argv=None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.worker is not None:
        print(json.dumps(run_worker(json.loads(args.worker))), flush=True)
        return []
    command = " ".join(shlex.quote(a) for a in ["python", "benchmarks/linear_ce.py", *argv])
    started = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    hwm_ok = peak_reset_works()
    t_start, rows, facts = time.perf_counter(), [], {}
    for vocab in args.vocab_list:
        for kind, chunk in variants(args):
            if kind in args.skip_set:
                continue
            spec = {"variant": kind, "chunk": chunk, "vocab": vocab, "dim": args.dim, "tokens": args.tokens,
                    "dtype": args.dtype, "warmup": args.warmup, "reps": args.reps}
            t0 = time.perf_counter()
            need, have = estimated_peak(kind, spec), mem_available()
            if have and need > args.max_mem_frac * have:  # the machine is shared: no OOM kill of anyone's job
                res = {"error": f"not run: needs about {need / 2**30:.1f} GiB, {args.max_mem_frac:g} x MemAvailable "
                                f"is {args.max_mem_frac * have / 2**30:.1f} GiB"}
            else:
                res = run_variant(spec, args.timeout)
            facts.setdefault("torch", res.get("torch"))
            rows.append(dict(spec, kind=kind, **res))
            what = res["error"] if "error" in res else f"{res['time_s']:.2f} s, peak {mib(res['peak'])} MiB, " \
                                                        f"loss {res['loss']:.6f}"
            print(f"V={vocab} {label(kind, chunk)}: {what} ({time.perf_counter() - t0:.0f} s)", flush=True)
    report = render(rows, args, command, started, time.perf_counter() - t_start, hwm_ok, facts)
    print(report)
    write_report(args.out, report)
    return rows


if __name__ == "__main__":
    main()

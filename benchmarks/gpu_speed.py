"""The GPU check's speed measurements (benchmarks/gpu_check.py runs them as checks): the head step
side by side (``timing``), the fused Triton softmax over tile configurations (``triton_tiles``) and
torch.profiler over a few steps (``profile``), each with the part of the results file it writes.

Every function takes the check's ``ctx`` (``dry_run``: tiny sizes on the CPU) and returns
(status, detail) or Markdown lines.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/pfc_reference.py
TOLERANCE = {"float32": 2e-4, "bfloat16": 3e-2}  # relative error of loss and gradients vs float64
# the fused Triton softmax in bf16 against the PyTorch path in fp32: 2.3e-3 measured on an H200
# (benchmarks/results/gpu_check_run3.md); about twice that is allowed, so a real regression fails
TILES_TOLERANCE = 5e-3
# budget_s: no new timed configuration starts past it; train_s: the main job's limit (whole check < 8 min: DEADLINE_S)
FULL_SIZES = {"batch": 1024, "steps": 5, "warmup": 2, "budget_s": 60.0, "train_s": 200, "tests_s": 150}
DRY_SIZES = {"batch": 64, "steps": 2, "warmup": 1, "budget_s": 180.0}


def rel_error(a, b) -> float:
    """Relative L2 difference of two tensors, in float64 on the CPU."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------- timing
VARIANTS = {  # name -> (sampler, head update mode, softmax backend); "auto" update and "torch": the defaults
    "exact (chunked torch)": ({"type": "full"}, "auto", "torch"),
    "exact (fused triton)": ({"type": "full"}, "auto", "triton"),
    "uniform@0.1": ({"type": "uniform", "sample_rate": 0.1}, "auto", "torch"),
    "ann@0.1": ({"type": "ann", "sample_rate": 0.1}, "auto", "torch"),
    "uniform@0.1 (cuda graphs)": ({"type": "uniform", "sample_rate": 0.1}, "auto", "graphs"),
    "ann@0.1 (cuda graphs)": ({"type": "ann", "sample_rate": 0.1}, "auto", "graphs"),
    "pfc-equivalent@0.1": (None, "dense (torch.optim.SGD)", "autograd"),  # benchmarks/pfc_reference.py
}
GRAPH_CHECK_INTERVAL = 1000  # the captured variants: a full input check every 1,000 steps (checked steps run eagerly)
# the device check's targets (issue 55), at 10^6 classes, d = 128, bf16, global batch 1024, one GPU
TARGETS = {"busy_eager": 0.80, "busy_graphs": 0.90, "uniform_vs_pfc": 0.35, "ann_vs_pfc": 0.50}
TARGET_CASE = (10**6, 128, "bfloat16")
LOSS = {"type": "arcface", "scale": 64.0, "margin": 0.5}
SGD = {"lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4}
# (classes, d, head dtype): bf16 at 10^6 and 10^7 classes, d 128 and 512; fp32 at 10^6, d 128 (the sampled
# heads' default update is lazy for bf16 rows and lazy_exact for fp32 rows)
FULL_CASES = [(10**6, 128, "bfloat16"), (10**6, 512, "bfloat16"), (10**6, 128, "float32"),
              (10**7, 128, "bfloat16"), (10**7, 512, "bfloat16")]
DRY_CASES = [(20_000, 32, "bfloat16"), (20_000, 32, "float32")]


def _sync(dev: str) -> None:
    import torch
    if dev == "cuda":
        torch.cuda.synchronize()


def _build_variant(name: str, classes: int, dim: int, dev: str, dtype: str, batch: int):
    """(step(x, y) -> loss, the head or module, its update mode) of one timed variant: forward, backward,
    optimizer step and zero_grad, or for the captured variants the replayed graph of all of them."""
    import torch
    import ds_xc
    sampler, update, backend = VARIANTS[name]
    if sampler is None:  # Partial FC as its users run it: fp32 Parameter, the matmul under autocast
        from pfc_reference import PartialFCReference
        pfc = PartialFCReference(dim, classes, LOSS, sample_rate=0.1, seed=0, device=dev)
        opt = torch.optim.SGD(pfc.parameters(), **SGD)
        return _eager_step(pfc, opt, torch.bfloat16 if dtype == "bfloat16" and dev == "cuda" else None), pfc, update
    graphs = backend == "graphs"
    head = ds_xc.ClassParallelHead(dim, classes, loss=LOSS, sampler=sampler, chunk_size=256, dtype=dtype,
                                   update=update, softmax_backend="torch" if graphs else backend, device=dev,
                                   check_interval=GRAPH_CHECK_INTERVAL if graphs else 1)
    opt = ds_xc.build_head_optimizer(head, dict(SGD, type="sgd", update=head.update))
    if not graphs:
        return _eager_step(head, opt, None), head, head.update
    from ds_xc.head.graphs import HeadStepGraph
    graph = HeadStepGraph(head, opt, rows=batch)
    return (lambda x, y: graph.step(x.detach(), y)[0]), head, head.update


def _eager_step(module, opt, autocast):
    import torch

    def step(x, y):
        with torch.autocast("cuda", dtype=autocast, enabled=autocast is not None):
            loss = module(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def _time_variant(name: str, classes: int, dim: int, sizes: dict, dev: str, dtype: str) -> dict:
    import torch
    if dev == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    step, module, update = _build_variant(name, classes, dim, dev, dtype, sizes["batch"])
    build_s = None
    if hasattr(getattr(module, "sampler", None), "rebuild"):
        _sync(dev)
        start = time.perf_counter()
        module.rebuild_index()
        _sync(dev)
        build_s = time.perf_counter() - start
    gen = torch.Generator().manual_seed(3)
    times, losses = [], []
    warmup = sizes["warmup"] + (4 if "graphs" in name else 0)  # the graph's own warm-up and capture
    for i in range(warmup + sizes["steps"]):
        x = torch.randn(sizes["batch"], dim, generator=gen).to(dev, torch.float32).requires_grad_()
        y = torch.randint(0, classes, (sizes["batch"],), generator=gen).to(dev)
        _sync(dev)
        start = time.perf_counter()
        loss = step(x, y)
        _sync(dev)
        losses.append(float(loss.detach()))
        if i >= warmup:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**20 if dev == "cuda" else float("nan")
    del module, step, loss
    if not all(map(lambda v: v == v and abs(v) < float("inf"), losses)):
        raise FloatingPointError(f"{name} C={classes} d={dim} {dtype}: non-finite loss {losses}")
    return {"step_ms": 1e3 * statistics.median(times), "build_s": build_s, "peak_mib": peak, "update": update,
            "loss": losses[-1]}


def check_timing(ctx: dict):
    dev = "cpu" if ctx["dry_run"] else "cuda"
    sizes = DRY_SIZES if ctx["dry_run"] else FULL_SIZES
    cases = DRY_CASES if ctx["dry_run"] else FULL_CASES
    cases = [c for c in cases if not ctx.get("max_classes") or c[0] <= ctx["max_classes"]]
    names = [n for n in VARIANTS if not (ctx["dry_run"] and ("triton" in n or "graphs" in n))]
    rows, skipped, start = [], [], time.perf_counter()
    for classes, dim, dtype in cases:
        for name in names:
            if time.perf_counter() - start > sizes["budget_s"]:
                skipped.append(f"{name} C={classes} d={dim} {dtype}")
                continue
            rec = _time_variant(name, classes, dim, sizes, dev, dtype)
            rows.append((classes, dim, dtype, name, rec))
            print(f"  timing C={classes:,} d={dim} {dtype} {name} ({rec['update']}): {rec['step_ms']:.2f} ms"
                  + (f", index build {rec['build_s']:.2f} s" if rec["build_s"] is not None else ""), flush=True)
    ctx["timing"], ctx["timing_skipped"] = rows, skipped
    detail = f"{len(rows)} configurations timed"
    if skipped:
        detail += f", {len(skipped)} skipped past the {sizes['budget_s']:.0f} s budget"
    if ctx["dry_run"]:
        detail += " (dry run: tiny sizes on the CPU, the Triton and CUDA-graph variants skipped)"
    return "PASS", detail


def check_targets(ctx: dict):
    """The GPU step's targets (TARGETS, issue 55) from the profile and the timing table measured in this run,
    at TARGET_CASE: the device busy at least 80% of an eager uniform / ann step and 90% of a captured one;
    uniform@0.1 at most 0.35x and ann@0.1 at most 0.5x the Partial-FC-equivalent step. FAIL names each miss."""
    if ctx["dry_run"]:
        return "SKIP", "dry run: the targets are GPU times"
    prof = (ctx.get("profile") or {}).get("rows", {})
    timed = {n: r["step_ms"] for c, d, t, n, r in ctx.get("timing", []) if (c, d, t) == TARGET_CASE}
    results, misses = [], []

    def judge(label, value, ok, bound):
        results.append(f"{label} {value:.2f} ({'<=' if ok == 'max' else '>='} {bound})")
        if not (value <= bound if ok == "max" else value >= bound):
            misses.append(results[-1])

    for name in ("uniform@0.1", "ann@0.1", "uniform@0.1 (cuda graphs)", "ann@0.1 (cuda graphs)"):
        r = prof.get(name)
        if r is None:
            misses.append(f"{name}: not profiled")
            continue
        bound = TARGETS["busy_graphs" if "graphs" in name else "busy_eager"]
        judge(f"{name} busy share", r["device_ms"] / r["wall_ms"], "min", bound)
    pfc = timed.get("pfc-equivalent@0.1")
    for name, key in (("uniform@0.1", "uniform_vs_pfc"), ("ann@0.1", "ann_vs_pfc"),
                      ("uniform@0.1 (cuda graphs)", "uniform_vs_pfc"), ("ann@0.1 (cuda graphs)", "ann_vs_pfc")):
        if pfc is None or name not in timed:
            misses.append(f"{name} / pfc: not timed at {TARGET_CASE}")
            continue
        judge(f"{name} / pfc step", timed[name] / pfc, "max", TARGETS[key])
    detail = "; ".join(results)
    return ("FAIL", "missed: " + "; ".join(misses) + " | " + detail) if misses else ("PASS", detail)


# ----------------------------------------------------------------------------- triton tiles
def _tile_configs(dry: bool) -> list:
    """(label, TileConfig) of the sweep: today's GPU default first, then 16-bit tensor-core variants."""
    import torch
    from ds_xc.head.triton_softmax import TileConfig, default_tiles, gpu_tiles
    if dry:
        return [("interpreter default", default_tiles(torch.device("cpu")))]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = [("default (gpu_tiles: native 128x128x64 w8 s3)", gpu_tiles(torch.bfloat16, sms)),
            ("fp32 upcast 64x64x32 tf32 w4", TileConfig(block_m=64, block_n=64, block_d=32, splits=2 * sms,
                                                        precision="tf32", num_warps=4, native_dot=False))]
    for bm, bn, bd, warps, stages in ((64, 128, 64, 4, 3), (128, 128, 32, 8, 4)):  # the runners-up of run 3
        rows.append((f"native {bm}x{bn}x{bd} w{warps} s{stages or '-'}",
                     TileConfig(block_m=bm, block_n=bn, block_d=bd, splits=2 * sms, precision="tf32",
                                num_warps=warps, native_dot=True, num_stages=stages)))
    return rows


def check_triton_tiles(ctx: dict):
    """The fused Triton softmax (forward + backward, ArcFace s=64 m=0.5, bf16 x and w) against the
    chunked PyTorch path on the same inputs, over a few tile configurations, at K = 10^5 (a sampled
    head's active set) and 10^6 classes (an exact shard), N = 1024, d = 128: median ms of 3 calls after
    one warm-up, and the relative error of loss, dx, dw against the PyTorch path in fp32."""
    import torch
    from ds_xc.head.margins import build_loss
    from ds_xc.head.softmax import fused_loss_and_grads
    from ds_xc.head.triton_softmax import triton_fused_loss_and_grads
    dev = "cpu" if ctx["dry_run"] else "cuda"
    sizes = [(32, 200, 16)] if ctx["dry_run"] else [(1024, 100_000, 128), (1024, 1_000_000, 128)]
    loss = build_loss(LOSS)
    rows = []

    def timed(fn):
        fn()
        _sync(dev)
        out = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            _sync(dev)
            out.append(1e3 * (time.perf_counter() - start))
        return statistics.median(out)

    for n, k, d in sizes:
        gen = torch.Generator().manual_seed(5)
        x = torch.randn(n, d, generator=gen).to(dev, torch.bfloat16)
        w = (0.05 * torch.randn(k, d, generator=gen)).to(dev, torch.bfloat16)
        t = torch.randint(0, k, (n,), generator=gen).to(dev)
        ref = fused_loss_and_grads(x.float(), w.float(), t, loss, chunk_size=256)  # fp32 PyTorch path
        for label, fn in [("torch chunked (256 rows)", lambda: fused_loss_and_grads(x, w, t, loss, chunk_size=256)),
                          ("torch one chunk", lambda: fused_loss_and_grads(x, w, t, loss, chunk_size=0))] + \
                         [(f"triton {lab}", (lambda cfg: lambda: triton_fused_loss_and_grads(x, w, t, loss, tiles=cfg))(cfg))
                          for lab, cfg in _tile_configs(ctx["dry_run"])]:
            try:
                ms = timed(fn)
                got = fn()
                err = max(rel_error(got[0], ref[0]), rel_error(got[1], ref[1]), rel_error(got[2], ref[2]))
                rows.append((n, k, d, label, ms, err, ""))
            except Exception as exc:  # a configuration that does not launch (shared memory): noted, not fatal
                rows.append((n, k, d, label, float("nan"), float("nan"), f"{type(exc).__name__}: {exc}"[:160]))
            print(f"  tiles N={n} K={k:,} d={d} {label}: {rows[-1][4]:.2f} ms, rel. err {rows[-1][5]:.1e} {rows[-1][6]}",
                  flush=True)
        del x, w, ref
    ctx["tiles"] = rows
    bad = [r for r in rows if not r[5] <= TILES_TOLERANCE and not (r[6] and "triton" in r[3] and "default" not in r[3])]
    if bad:  # a non-default tile configuration that does not launch is noted; any other failure fails
        return "FAIL", "; ".join(f"{r[3]} K={r[1]}: rel. err {r[5]:.1e} {r[6]}" for r in bad)
    return "PASS", f"{len(rows)} runs; every error within {TILES_TOLERANCE:.0e} of the fp32 PyTorch path"


def tiles_report(ctx: dict) -> list:
    rows = ctx.get("tiles")
    if not rows:
        return []
    lines = ["", "## Fused Triton softmax: tile configurations vs the chunked PyTorch path", "",
             "ArcFace s=64 m=0.5, bf16 x and w, forward + backward (loss, dx, dw), one device; median of 3 calls after "
             "a warm-up; `rel. err`: the largest relative error of loss, dx, dw against the PyTorch path in fp32; "
             "`native`: 16-bit tiles into tl.dot (TileConfig.native_dot).", "",
             "| N | K | d | implementation | ms | vs torch chunked | rel. err | note |", "|---|---|---|---|---|---|---|---|"]
    base = {(n, k): ms for n, k, d, lab, ms, e, note in rows if lab.startswith("torch chunked")}
    for n, k, d, lab, ms, e, note in rows:
        lines.append(f"| {n} | {k:,} | {d} | {lab} | {ms:.2f} | {base.get((n, k), float('nan')) / ms:.2f}x | "
                     f"{e:.1e} | {note.replace('|', '/')} |")
    return lines


# ----------------------------------------------------------------------------- profile
PROFILE_CASE = {"full": (10**6, 128, "bfloat16"), "dry": (20_000, 32, "bfloat16")}
PROFILE_STEPS = 3


def _event_time(e, kind: str) -> float:
    """Self time (us) of a profiler average on the device or the CPU, across torch versions."""
    if kind == "device":
        return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)))
    return float(e.self_cpu_time_total)


def _profile_variant(name: str, dev: str, case: tuple) -> dict:
    """Where one variant's step goes: wall, device busy time, kernels launched, host syncs, top ops."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    classes, dim, dtype = case
    batch = FULL_SIZES["batch"] if dev == "cuda" else DRY_SIZES["batch"]
    step, module, update = _build_variant(name, classes, dim, dev, dtype, batch)
    gen = torch.Generator().manual_seed(4)
    warm = 2 + (4 if "graphs" in name else 0)  # the graph's own warm-up and capture
    batches = [(torch.randn(batch, dim, generator=gen).to(dev).requires_grad_(),
                torch.randint(0, classes, (batch,), generator=gen).to(dev)) for _ in range(warm + PROFILE_STEPS)]
    for x, y in batches[:warm]:  # warm-up: compiles, allocator, index, capture
        step(x, y)
    _sync(dev)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for x, y in batches[warm:]:
            step(x, y)
        _sync(dev)
    wall = (time.perf_counter() - start) / PROFILE_STEPS
    averages = prof.key_averages()
    api = {e.key: e.count for e in averages if e.key.startswith(("cuda", "cu"))}
    launches = sum(c for k, c in api.items() if "LaunchKernel" in k or "LaunchCooperativeKernel" in k
                   or "GraphLaunch" in k)
    syncs = sum(c for k, c in api.items() if "Synchronize" in k)
    copies = sum(c for k, c in api.items() if "Memcpy" in k)
    reads = sum(e.count for e in averages if e.key == "aten::_local_scalar_dense")  # .item(), .tolist(), float()
    device_total = sum(_event_time(e, "device") for e in averages if e.device_type.name == "CUDA") / 1e3
    top_dev = sorted((e for e in averages if _event_time(e, "device") > 0), key=lambda e: -_event_time(e, "device"))
    top_cpu = sorted(averages, key=lambda e: -_event_time(e, "cpu"))
    del module, step
    return {"wall_ms": 1e3 * wall, "device_ms": device_total / PROFILE_STEPS, "launches": launches / PROFILE_STEPS,
            "syncs": syncs / PROFILE_STEPS, "copies": copies / PROFILE_STEPS, "reads": reads / PROFILE_STEPS,
            "update": update,
            "top_device": [(e.key, e.count / PROFILE_STEPS, _event_time(e, "device") / 1e3 / PROFILE_STEPS)
                           for e in top_dev[:12]],
            "top_cpu": [(e.key, e.count / PROFILE_STEPS, _event_time(e, "cpu") / 1e3 / PROFILE_STEPS)
                        for e in top_cpu[:12]]}


def check_profile(ctx: dict):
    """torch.profiler over PROFILE_STEPS steps of each timed variant at 10^6 classes, d=128, bf16:
    how much of the wall time the device is busy, kernels launched and host syncs per step, and the
    ops that take the device's and the host's time (a table per variant in the results file)."""
    dev = "cpu" if ctx["dry_run"] else "cuda"
    case = PROFILE_CASE["dry" if ctx["dry_run"] else "full"]
    names = [n for n in VARIANTS if not (ctx["dry_run"] and ("triton" in n or "graphs" in n))]
    ctx["profile"] = {"case": case, "rows": {}}
    for name in names:
        rec = _profile_variant(name, dev, case)
        ctx["profile"]["rows"][name] = rec
        print(f"  profile {name}: wall {rec['wall_ms']:.2f} ms/step, device busy {rec['device_ms']:.2f} ms, "
              f"{rec['launches']:.0f} kernel launches, {rec['syncs']:.0f} syncs, {rec['copies']:.0f} copies, "
              f"{rec['reads']:.0f} scalar reads",
              flush=True)
    return "PASS", f"{len(names)} variants profiled at C={case[0]:,} d={case[1]} {case[2]}"


def profile_report(ctx: dict) -> list:
    """The profile's lines for the results file."""
    prof = ctx.get("profile")
    if not prof or not prof["rows"]:
        return []
    c, d, t = prof["case"]
    lines = ["", f"## Profile: C={c:,}, d={d}, {t}, {PROFILE_STEPS} steps under torch.profiler (per step)", "",
             "Device busy = the sum of the device's kernel and copy times; where it is far below the wall time, the "
             "step waits on the host (Python, launches, syncs), not on the GPU.", "",
             "| variant | update | wall ms | device busy ms | busy share | kernel launches | syncs | memcpy | "
             "scalar reads |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in prof["rows"].items():
        lines.append(f"| {name} | {r['update']} | {r['wall_ms']:.2f} | {r['device_ms']:.2f} | "
                     f"{r['device_ms'] / r['wall_ms']:.0%} | {r['launches']:.0f} | {r['syncs']:.0f} | {r['copies']:.0f} | "
                     f"{r['reads']:.0f} |")
    for name, r in prof["rows"].items():
        for label, key in (("device", "top_device"), ("host", "top_cpu")):
            if not r[key]:
                continue
            lines += ["", f"{name}: top ops by self {label} time (ms per step)", "", "| op | calls | ms |",
                      "|---|---|---|"]
            lines += [f"| `{k[:90].replace('|', '/')}` | {n:.0f} | {ms:.3f} |" for k, n, ms in r[key]]
    return lines


def timing_report(ctx: dict) -> list:
    """The timing table's lines for the results file."""
    lines = []
    rows = ctx.get("timing", [])
    if rows:
        lines += ["", "Head step (forward + backward + optimizer step + zero_grad): ArcFace s=64 m=0.5, SGD "
                  f"{json.dumps(SGD)}, global batch {(DRY_SIZES if ctx['dry_run'] else FULL_SIZES)['batch']}, one "
                  "device (one rank); median of the timed steps. ds_xc heads at the library defaults for their "
                  "sampler and dtype (`update` column; softmax_backend torch but in the fused triton row; chunk_size "
                  "256); `pfc-equivalent@0.1` is "
                  "benchmarks/pfc_reference.py (Partial FC's algorithm: uniform negatives, logits materialised, "
                  "torch.optim.SGD over the dense fp32 shard; its matmul under bf16 autocast in the bf16 rows, as "
                  "Partial FC users run fp16). `vs exact` = the chunked exact head's step / this step (a speed-up); "
                  "`/ pfc` = this step / the PFC-equivalent step (issue 16's target for ann@0.1: at most 0.35x).", "",
                  "| classes | d | dtype | variant | update | step ms | vs exact (chunked) | / pfc@0.1 | "
                  "index build s | peak MiB |", "|---|---|---|---|---|---|---|---|---|---|"]
        base = {(c, d, t): r["step_ms"] for c, d, t, n, r in rows if n.startswith("exact (chunked")}
        pfc = {(c, d, t): r["step_ms"] for c, d, t, n, r in rows if n.startswith("pfc")}
        for c, d, t, n, r in rows:
            ratio = base.get((c, d, t), float("nan")) / r["step_ms"]
            vs_pfc = r["step_ms"] / pfc.get((c, d, t), float("nan"))
            build = f"{r['build_s']:.2f}" if r["build_s"] is not None else "-"
            lines.append(f"| {c:,} | {d} | {t} | {n} | {r['update']} | {r['step_ms']:.2f} | {ratio:.2f}x | "
                         f"{vs_pfc:.2f}x | {build} | {r['peak_mib']:.0f} |")
    if ctx.get("timing_skipped"):
        lines += ["", "Not timed (time budget): " + "; ".join(ctx["timing_skipped"])]
    return lines

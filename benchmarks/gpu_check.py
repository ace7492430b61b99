"""The device check: build, prove against the CPU reference, and time the GPU path on one CUDA GPU.

One script, run once whenever a GPU is lent (benchmarks/README.md, "GPU check"):

    bash benchmarks/gpu_check.sh                  # on a machine with one CUDA GPU (< 7 min on an H200)
    python benchmarks/gpu_check.py --dry-run      # anywhere: the same steps, CUDA parts skipped and said so

Steps, each printed as one line ``CHECK <name>: PASS | FAIL | SKIP (<why>)``:

1. ``env``: torch, CUDA, device, triton, nvcc versions.
2. ``build_cuda_hamming``: JIT-compiles the CUDA Hamming scan (ops/csrc/hamming_cuda.cu).
3. ``build_triton``: compiles and runs the Triton kernels once (fused margin softmax, Hamming scan,
   compression selection); under ``--dry-run`` they run on CPU tensors through ``TRITON_INTERPRET=1``.
4. ``head_step``: one forward + backward of the class-parallel head for every loss, on the GPU, with
   the chunked PyTorch path and the fused Triton kernel, fp32 and bf16, against the CPU float64
   reference (tests/reference.py); and the ANN head at sample rate 1.0 against the exact head.
5. ``timing``: side by side, one step (forward, backward, optimizer) of the exact head (fused Triton vs
   chunked PyTorch), uniform@0.1, ANN@0.1 and the Partial-FC-equivalent head at 10^6 and 10^7 classes,
   d = 128 and 512, global batch 1024, bf16 weights (and fp32 at 10^6, d = 128); median step, ANN
   index build, peak GPU memory.
6. ``train_job``: the README's main job (``deepspeed launch/train.py`` on configs/default.json) on the
   GPU through the DeepSpeed launcher, and the same job on the machine's CPU beside it (the same data:
   the text task reads the interpreter's stdlib); the held-out top-1 of the two within 0.01.
7. ``parity_tests``: the GPU parity tests (CUDA Hamming and Triton kernels against the PyTorch
   reference, on CUDA tensors; the bf16 head's CUDA test) through pytest.
8. ``profile``: torch.profiler over three steps of each timed variant at 10^6 classes, d = 128,
   bf16: wall vs device-busy time, kernel launches and host syncs per step, the top ops.

The results go to one Markdown file (``--out``, default benchmarks/results/gpu_check.md; with
``--dry-run`` benchmarks/results/gpu_check_dry_run.md), rewritten after every check so that a run cut
short keeps what it measured; ``--only a,b`` runs some checks. Exit status 1 if any check failed.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RESULTS = os.path.join(ROOT, "benchmarks", "results")

LOSSES = ("softmax", "cosface", "arcface", "combined", "dsoftmax")
TOLERANCE = {"float32": 2e-4, "bfloat16": 3e-2}  # relative error of loss and gradients vs float64
# budget_s: no new timed configuration starts past it; train_s: the main job's limit (whole check < 7 min)
FULL_SIZES = {"batch": 1024, "steps": 5, "warmup": 2, "budget_s": 150.0, "train_s": 230, "tests_s": 180}
DRY_SIZES = {"batch": 64, "steps": 2, "warmup": 1, "budget_s": 180.0}


class Checks:
    """Collects one line per check and prints it as it happens."""

    def __init__(self):
        self.rows: list = []  # (name, status, detail, seconds)

    def run(self, name: str, fn, *args):
        start = time.perf_counter()
        try:
            status, detail = fn(*args)
        except Exception as exc:  # a failed check is reported, the others still run
            status, detail = "FAIL", f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        seconds = time.perf_counter() - start
        self.rows.append((name, status, detail, seconds))
        print(f"CHECK {name}: {status} ({detail}) [{seconds:.1f} s]", flush=True)
        return status

    @property
    def failed(self) -> bool:
        return any(status == "FAIL" for _, status, _, _ in self.rows)


# ----------------------------------------------------------------------------- steps
def check_env(ctx: dict):
    import torch
    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    if torch.cuda.is_available():
        parts.append(f"CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}, "
                     f"TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST')!r}")
    else:
        parts.append("no CUDA device")
    try:
        import triton
        parts.append(f"triton {triton.__version__}")
    except ImportError:
        parts.append("no triton")
    nvcc = shutil.which("nvcc")
    if nvcc:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
        parts.append(out[-1] if out else "nvcc")
    ctx["env"] = ", ".join(parts)
    if not ctx["dry_run"] and not torch.cuda.is_available():
        return "FAIL", ctx["env"] + " (run with --dry-run on a machine without a GPU)"
    return "PASS", ctx["env"]


def check_build_cuda(ctx: dict):
    if ctx["dry_run"]:
        return "SKIP", "dry run: no CUDA device; CI compiles the .cu with nvcc (tests/test_ops_hamming.py)"
    from ds_xc_ops import builders
    start = time.perf_counter()
    op = builders.load_op("cuda", verbose=False)
    if op is None:
        return "FAIL", "the CUDA Hamming op did not build (see the warning above)"
    return "PASS", f"built or loaded in {time.perf_counter() - start:.1f} s"


def _triton_kernels():
    """The Triton entry points as (name, callable that runs it once on small inputs)."""
    import torch
    from tests.reference import LOSSES as LOSS_CFG
    from ds_xc.head.margins import build_loss
    from ds_xc_ops.hamming import hamming_topk_ivf
    from ds_xc_ops.triton_select import select_above
    from ds_xc.head.triton_softmax import triton_fused_loss_and_grads
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(48, 32, generator=gen).to(dev)
    w = torch.randn(70, 32, generator=gen).to(dev)
    t = torch.randint(-1, 70, (48,), generator=gen).to(dev)

    def softmax():
        triton_fused_loss_and_grads(x, w, t, build_loss(LOSS_CFG["arcface"]))

    def hamming():
        q = torch.randint(0, 256, (8, 32), dtype=torch.uint8, generator=gen).to(dev)
        codes = torch.randint(0, 256, (100, 32), dtype=torch.uint8, generator=gen).to(dev)
        ids = torch.arange(100, device=dev)
        off = torch.tensor([0, 40, 100], device=dev)
        probes = torch.tensor([[0, 1]] * 8, device=dev)
        hamming_topk_ivf(q, codes, ids, off, probes, 10, backend="triton")

    def select():
        v = torch.randn(5000, generator=gen).to(dev)
        select_above(v, 1.5, backend="triton")

    return [("fused softmax", softmax), ("hamming scan", hamming), ("selection", select)]


def check_build_triton(ctx: dict):
    try:
        import triton  # noqa: F401
    except ImportError:
        return ("SKIP" if ctx["dry_run"] else "FAIL"), "triton is not installed"
    done = []
    for name, fn in _triton_kernels():
        start = time.perf_counter()
        fn()
        done.append(f"{name} {time.perf_counter() - start:.1f} s")
    where = "interpreter, CPU tensors" if ctx["dry_run"] else "compiled for the GPU"
    return "PASS", f"{where}: " + ", ".join(done)


def check_parity_tests(ctx: dict):
    if ctx["dry_run"]:
        return "SKIP", "dry run: CI runs the same tests on CPU tensors under TRITON_INTERPRET=1"
    # compiled kernels on CUDA tensors; the fused softmax's GPU parity is the head_step check (its
    # test file runs the interpreter on CPU tensors, which CI already does)
    files = ["tests/test_ops_hamming.py", "tests/test_triton_hamming.py", "tests/test_triton_select.py",
             "tests/test_device.py", "tests/test_bf16_head.py"]
    files = [f for f in files if os.path.exists(os.path.join(ROOT, f))]
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    workers = ["-n", str(min(8, os.cpu_count() or 1))] if _has_module("xdist") else []  # Triton compiles in parallel
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *workers, *files],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=FULL_SIZES["tests_s"])
    tail = proc.stdout.strip().splitlines()[-1:] or ["no output"]
    print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n", flush=True)
    return ("PASS" if proc.returncode == 0 else "FAIL"), tail[0]


def _has_module(name: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(name) is not None


def _rel(a, b) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _one_head_step(loss: str, dtype: str, backend: str, dev: str, small: bool = False):
    """(loss rel. err, dx rel. err, dw rel. err) of one head forward+backward vs float64 on the CPU."""
    import torch
    import ds_xc
    from tests.reference import LOSSES as LOSS_CFG, reference
    gen = torch.Generator().manual_seed(1)
    num_classes, dim, rows = (101, 16, 24) if small else (3001, 64, 256)  # small: for the interpreter
    head = ds_xc.ClassParallelHead(dim, num_classes, loss=LOSS_CFG[loss], chunk_size=96, dtype=dtype,
                                   init_std=0.05, softmax_backend=backend, device=dev)
    x = torch.randn(rows, dim, generator=gen)
    y = torch.randint(0, num_classes, (rows,), generator=gen)
    xd = x.to(dev).requires_grad_()
    out = head(xd, y.to(dev))
    out.backward()
    ref_loss, ref_gx, ref_gw = reference(x, head.weight.detach().cpu(), y, LOSS_CFG[loss])
    return _rel(out, ref_loss), _rel(xd.grad, ref_gx), _rel(head.weight.grad, ref_gw)


def check_head_step(ctx: dict):
    dev = "cpu" if ctx["dry_run"] else "cuda"
    worst, notes = {}, []
    for backend in ("torch", "triton"):
        for dtype in ("float32", "bfloat16"):
            for loss in LOSSES:
                errs = _one_head_step(loss, dtype, backend, dev, small=ctx["dry_run"] and backend == "triton")
                key = (backend, dtype)
                worst[key] = max(worst.get(key, 0.0), *errs)
                if max(errs) > TOLERANCE[dtype]:
                    notes.append(f"{backend}/{dtype}/{loss}: rel. errors {', '.join(f'{e:.1e}' for e in errs)}")
    ann = _ann_full_rate(dev)
    summary = "; ".join(f"{b}/{d} worst {e:.1e}" for (b, d), e in worst.items()) + f"; ann@1.0 vs exact {ann:.1e}"
    if ctx["dry_run"]:
        summary += " (dry run: on the CPU, the Triton backend under the interpreter at 101 classes)"
    ctx["head_step"] = summary
    if notes or ann > 1e-5:
        return "FAIL", "; ".join(notes) + f" | {summary}"
    return "PASS", summary


def _ann_full_rate(dev: str) -> float:
    """Relative difference of the ANN head at sample rate 1.0 and the exact head (should be ~0)."""
    import torch
    import ds_xc
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(128, 64, generator=gen).to(dev), torch.randint(0, 5000, (128,), generator=gen).to(dev)
    loss = {"type": "cosface", "scale": 30.0, "margin": 0.35}
    exact = ds_xc.ClassParallelHead(64, 5000, loss=loss, device=dev)
    ann = ds_xc.ClassParallelHead(64, 5000, loss=loss, sampler={"type": "ann", "sample_rate": 1.0}, device=dev)
    return _rel(ann(x, y), exact(x, y))


# ----------------------------------------------------------------------------- timing
VARIANTS = {  # name -> (sampler, head update mode, softmax backend); "auto" update and "torch": the defaults
    "exact (chunked torch)": ({"type": "full"}, "auto", "torch"),
    "exact (fused triton)": ({"type": "full"}, "auto", "triton"),
    "uniform@0.1": ({"type": "uniform", "sample_rate": 0.1}, "auto", "torch"),
    "ann@0.1": ({"type": "ann", "sample_rate": 0.1}, "auto", "torch"),
    "pfc-equivalent@0.1": (None, "dense (torch.optim.SGD)", "autograd"),  # benchmarks/pfc_reference.py
}
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


def _build_variant(name: str, classes: int, dim: int, dev: str, dtype: str):
    """(module, optimizer, update, autocast dtype or None) of one timed variant."""
    import torch
    import ds_xc
    sampler, update, backend = VARIANTS[name]
    if sampler is None:  # Partial FC as its users run it: fp32 Parameter, the matmul under autocast
        sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
        from pfc_reference import PartialFCReference
        pfc = PartialFCReference(dim, classes, LOSS, sample_rate=0.1, seed=0, device=dev)
        opt = torch.optim.SGD(pfc.parameters(), **SGD)
        return pfc, opt, update, (torch.bfloat16 if dtype == "bfloat16" and dev == "cuda" else None)
    head = ds_xc.ClassParallelHead(dim, classes, loss=LOSS, sampler=sampler, chunk_size=256, dtype=dtype,
                                   update=update, softmax_backend=backend, device=dev)
    opt = ds_xc.build_head_optimizer(head, dict(SGD, type="sgd", update=head.update))
    return head, opt, head.update, None


def _time_variant(name: str, classes: int, dim: int, sizes: dict, dev: str, dtype: str) -> dict:
    import torch
    if dev == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    module, opt, update, autocast = _build_variant(name, classes, dim, dev, dtype)
    build_s = None
    if hasattr(getattr(module, "sampler", None), "rebuild"):
        _sync(dev)
        start = time.perf_counter()
        module.rebuild_index()
        _sync(dev)
        build_s = time.perf_counter() - start
    gen = torch.Generator().manual_seed(3)
    times, losses = [], []
    for i in range(sizes["warmup"] + sizes["steps"]):
        x = torch.randn(sizes["batch"], dim, generator=gen).to(dev, torch.float32).requires_grad_()
        y = torch.randint(0, classes, (sizes["batch"],), generator=gen).to(dev)
        _sync(dev)
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=autocast, enabled=autocast is not None):
            loss = module(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(dev)
        losses.append(float(loss.detach()))
        if i >= sizes["warmup"]:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**20 if dev == "cuda" else float("nan")
    del module, opt, loss
    if not all(map(lambda v: v == v and abs(v) < float("inf"), losses)):
        raise FloatingPointError(f"{name} C={classes} d={dim} {dtype}: non-finite loss {losses}")
    return {"step_ms": 1e3 * statistics.median(times), "build_s": build_s, "peak_mib": peak, "update": update,
            "loss": losses[-1]}


def check_timing(ctx: dict):
    dev = "cpu" if ctx["dry_run"] else "cuda"
    sizes = DRY_SIZES if ctx["dry_run"] else FULL_SIZES
    cases = DRY_CASES if ctx["dry_run"] else FULL_CASES
    cases = [c for c in cases if not ctx.get("max_classes") or c[0] <= ctx["max_classes"]]
    names = [n for n in VARIANTS if not (ctx["dry_run"] and "triton" in n)]
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
        detail += " (dry run: tiny sizes on the CPU, the Triton variant skipped)"
    return "PASS", detail


# ----------------------------------------------------------------------------- triton tiles
def _tile_configs(dry: bool) -> list:
    """(label, TileConfig) of the sweep: today's GPU default first, then 16-bit tensor-core variants."""
    import torch
    from ds_xc.head.triton_softmax import TileConfig, default_tiles, gpu_tiles
    if dry:
        return [("interpreter default", default_tiles(torch.device("cpu")))]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    base = gpu_tiles(torch.bfloat16, sms)
    rows = [("default (fp32 upcast, tf32)", base)]
    for bm, bn, bd, warps, stages in ((64, 64, 32, 4, None), (64, 128, 64, 4, 3), (128, 64, 64, 4, 3),
                                      (128, 128, 64, 8, 3), (128, 128, 32, 8, 4), (64, 64, 128, 4, 2)):
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
                err = max(_rel(got[0], ref[0]), _rel(got[1], ref[1]), _rel(got[2], ref[2]))
                rows.append((n, k, d, label, ms, err, ""))
            except Exception as exc:  # a configuration that does not launch (shared memory): noted, not fatal
                rows.append((n, k, d, label, float("nan"), float("nan"), f"{type(exc).__name__}: {exc}"[:160]))
            print(f"  tiles N={n} K={k:,} d={d} {label}: {rows[-1][4]:.2f} ms, rel. err {rows[-1][5]:.1e} {rows[-1][6]}",
                  flush=True)
        del x, w, ref
    ctx["tiles"] = rows
    bad = [r for r in rows if r[5] == r[5] and r[5] > TOLERANCE["bfloat16"]]
    if bad:
        return "FAIL", "; ".join(f"{r[3]} K={r[1]}: rel. err {r[5]:.1e}" for r in bad)
    return "PASS", f"{len(rows)} runs; every error within {TOLERANCE['bfloat16']:.0e} of the fp32 PyTorch path"


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
    module, opt, update, autocast = _build_variant(name, classes, dim, dev, dtype)
    gen = torch.Generator().manual_seed(4)
    batches = [(torch.randn(FULL_SIZES["batch"] if dev == "cuda" else DRY_SIZES["batch"], dim, generator=gen),)
               for _ in range(2 + PROFILE_STEPS)]
    batches = [(x.to(dev).requires_grad_(), torch.randint(0, classes, (x.shape[0],), generator=gen).to(dev))
               for (x,) in batches]

    def step(x, y):
        with torch.autocast("cuda", dtype=autocast, enabled=autocast is not None):
            loss = module(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for x, y in batches[:2]:  # warm-up: compiles, allocator, index
        step(x, y)
    _sync(dev)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for x, y in batches[2:]:
            step(x, y)
        _sync(dev)
    wall = (time.perf_counter() - start) / PROFILE_STEPS
    averages = prof.key_averages()
    api = {e.key: e.count for e in averages if e.key.startswith(("cuda", "cu"))}
    launches = sum(c for k, c in api.items() if "LaunchKernel" in k or "LaunchCooperativeKernel" in k)
    syncs = sum(c for k, c in api.items() if "Synchronize" in k)
    copies = sum(c for k, c in api.items() if "Memcpy" in k)
    reads = sum(e.count for e in averages if e.key == "aten::_local_scalar_dense")  # .item(), .tolist(), float()
    device_total = sum(_event_time(e, "device") for e in averages if e.device_type.name == "CUDA") / 1e3
    top_dev = sorted((e for e in averages if _event_time(e, "device") > 0), key=lambda e: -_event_time(e, "device"))
    top_cpu = sorted(averages, key=lambda e: -_event_time(e, "cpu"))
    del module, opt
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
    names = [n for n in VARIANTS if not (ctx["dry_run"] and "triton" in n)]
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


# ----------------------------------------------------------------------------- the main job
MAIN_JOB_TOLERANCE = 0.01  # held-out top-1, absolute: other kernels, other rounding, another trajectory
CPU_THREADS = 8  # the CPU reference run beside the GPU one (the H200 machine has 16 cores)


def _launch_job(summary_path: str, extra: list, env: dict, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--master_port", str(port), "launch/train.py",
           "--summary_json", summary_path, *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish_job(proc: subprocess.Popen, summary_path: str, deadline: float, label: str):
    """(summary dict or None, why not) of a launched job, waited for until ``deadline``."""
    import json
    try:
        out, err = proc.communicate(timeout=max(1.0, deadline - time.perf_counter()))
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        print(f"--- {label} (cut at the time limit)", out[-2000:], err[-2000:], sep="\n", flush=True)
        return None, "did not finish within the time limit"
    print(f"--- {label}", out[-2500:], err[-2500:], sep="\n", flush=True)
    if proc.returncode != 0 or not os.path.exists(summary_path):
        return None, f"exit {proc.returncode}: {(err.strip().splitlines() or ['no output'])[-1]}"
    with open(summary_path) as fh:
        return json.load(fh), ""


def _describe(s: dict, wall: float) -> str:
    return (f"{s['steps']} steps in {s['seconds']:.1f} s of training ({wall:.0f} s with data and launch) on "
            f"{s.get('device')} (head on {s.get('head_device')}), {s['samples_per_s']:.0f} samples/s, final loss "
            f"{s['final_loss']:.4f}, held-out top-1 {s['top1']:.4f} top-5 {s['top5']:.4f}")


def check_train_job(ctx: dict):
    """The README's main job (``deepspeed launch/train.py``, configs/default.json, 1,200 steps) on the
    GPU through the DeepSpeed launcher, and beside it the same job on this machine's CPU
    (``DS_ACCELERATOR=cpu``, CPU_THREADS threads): the same data (the text task reads the running
    interpreter's stdlib, so a CPU number from another machine is another data set) and seeds; the
    GPU run's held-out top-1 must be within MAIN_JOB_TOLERANCE of the CPU run's. The dry run trains
    5 steps on the CPU (the plumbing only)."""
    import tempfile
    folder = tempfile.mkdtemp(prefix="gpu_check_")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    start = time.perf_counter()
    deadline = start + FULL_SIZES["train_s"]
    if ctx["dry_run"]:
        path = os.path.join(folder, "cpu.json")
        s, why = _finish_job(_launch_job(path, ["--max_steps", "5", "--eval_every", "0", "--set",
                                                "xc_train.eval_samples=512"], env, 29531), path, deadline, "dry run")
        if s is None:
            return "FAIL", why
        return "PASS", _describe(s, time.perf_counter() - start) + " (dry run: 5 steps on the CPU)"
    cpu_env = dict(env, DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS=str(CPU_THREADS))
    gpu_path, cpu_path = os.path.join(folder, "gpu.json"), os.path.join(folder, "cpu.json")
    gpu_proc = _launch_job(gpu_path, [], env, 29531)
    cpu_proc = _launch_job(cpu_path, [], cpu_env, 29532)
    g, why = _finish_job(gpu_proc, gpu_path, deadline, "GPU job")
    gpu_wall = time.perf_counter() - start
    c, cpu_why = _finish_job(cpu_proc, cpu_path, deadline, "CPU job")
    cpu_wall = time.perf_counter() - start
    if g is None:
        return "FAIL", f"GPU job: {why}"
    ctx["train_job"] = {"gpu": g, "cpu": c}
    detail = "GPU: " + _describe(g, gpu_wall)
    if not str(g.get("head_device", "")).startswith("cuda"):
        return "FAIL", detail + " | the head did not run on the GPU"
    if c is None:
        return "FAIL", detail + f" | the CPU reference run ({CPU_THREADS} threads): {cpu_why}"
    detail += f"; CPU ({CPU_THREADS} threads, the same data and seeds): " + _describe(c, cpu_wall)
    if abs(g["top1"] - c["top1"]) > MAIN_JOB_TOLERANCE:
        return "FAIL", detail + f" | top-1 differs from the CPU run's by more than {MAIN_JOB_TOLERANCE}"
    return "PASS", detail + f" | top-1 within {MAIN_JOB_TOLERANCE} of the CPU run's"


# ----------------------------------------------------------------------------- report
def _rev() -> str:
    env_rev = os.environ.get("GPU_CHECK_REV")
    if env_rev:
        return env_rev
    try:
        sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
        from harness import git_rev
        return git_rev()
    except Exception:  # no git in a copied working tree
        return "unknown"


def report(ctx: dict, checks: Checks) -> str:
    lines = [f"# GPU check{' (dry run: CUDA parts skipped)' if ctx['dry_run'] else ''}", "",
             f"- command: `{ctx['command']}`", f"- revision: {_rev()}",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
             f"- environment: {ctx.get('env', 'unknown')}", "", "| check | status | detail | s |", "|---|---|---|---|"]
    lines += [f"| {n} | {s} | {d.replace('|', '/')} | {t:.1f} |" for n, s, d, t in checks.rows]
    rows = ctx.get("timing", [])
    if rows:
        lines += ["", "Head step (forward + backward + optimizer step + zero_grad): ArcFace s=64 m=0.5, SGD "
                  f"{json_dumps(SGD)}, global batch {(DRY_SIZES if ctx['dry_run'] else FULL_SIZES)['batch']}, one "
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
    lines += tiles_report(ctx)
    lines += profile_report(ctx)
    return "\n".join(lines) + "\n"


def json_dumps(value) -> str:
    import json
    return json.dumps(value)


CHECK_STEPS = (("env", check_env), ("build_cuda_hamming", check_build_cuda), ("build_triton", check_build_triton),
               ("head_step", check_head_step), ("timing", check_timing), ("parity_tests", check_parity_tests),
               ("triton_tiles", check_triton_tiles), ("profile", check_profile), ("train_job", check_train_job))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="no GPU: the same steps, CUDA parts skipped and said so")
    p.add_argument("--out", default=None, help="results file (default under benchmarks/results/)")
    p.add_argument("--max_classes", type=int, default=0, help="time only the cases up to this many classes "
                   "(0: all)")
    p.add_argument("--only", default="", help="comma-separated checks to run (env always runs); default: all of "
                   + ", ".join(n for n, _ in CHECK_STEPS))
    args = p.parse_args(argv)
    only = {n for n in args.only.split(",") if n}
    unknown = only - {n for n, _ in CHECK_STEPS}
    if unknown:
        p.error(f"--only: unknown checks {sorted(unknown)}; allowed: {', '.join(n for n, _ in CHECK_STEPS)}")
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated: before they are imported
    out = args.out or os.path.join(RESULTS, "gpu_check_dry_run.md" if args.dry_run else "gpu_check.md")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    ctx = {"dry_run": args.dry_run, "max_classes": args.max_classes, "command": " ".join(["python", "benchmarks/gpu_check.py", *(argv or sys.argv[1:])])}
    checks = Checks()
    for name, fn in CHECK_STEPS:
        if only and name != "env" and name not in only:
            continue
        status = checks.run(name, fn, ctx)
        with open(out, "w") as f:  # after every check: a run cut short still leaves what it measured
            f.write(report(ctx, checks))
        if name == "env" and status == "FAIL":
            break
    print(f"wrote {out}", flush=True)
    print(f"gpu_check: {'FAILED' if checks.failed else 'all checks passed or skipped with a reason'}", flush=True)
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())

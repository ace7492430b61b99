"""The device check: build, prove against the CPU reference, and time the GPU path on one CUDA GPU.

One script, run once whenever a GPU is lent (benchmarks/README.md, "GPU check"):

    bash benchmarks/gpu_check.sh                  # on a machine with one CUDA GPU (< 8 min on an H200)
    python benchmarks/gpu_check.py --dry-run      # anywhere: the same steps, CUDA parts skipped and said so

Steps, each printed as one line ``CHECK <name>: PASS | FAIL | SKIP (<why>)``:

1. ``env``: torch, CUDA, device, triton, nvcc versions.
2. ``build_cuda_hamming``: JIT-compiles the CUDA Hamming scan (ops/csrc/hamming_cuda.cu).
3. ``build_triton``: compiles and runs the Triton kernels once (fused margin softmax, Hamming scan,
   compression selection); under ``--dry-run`` they run on CPU tensors through ``TRITON_INTERPRET=1``.
4. ``parity_tests``: the GPU parity tests (CUDA Hamming and Triton kernels against the PyTorch
   reference, on CUDA tensors) through pytest.
5. ``head_step``: one forward + backward of the class-parallel head for every loss, on the GPU, with
   the chunked PyTorch path and the fused Triton kernel, fp32 and bf16, against the CPU float64
   reference (tests/reference.py); and the ANN head at sample rate 1.0 against the exact head.
6. ``timing``: side by side, one step (forward, backward, head optimizer) of the exact head (fused
   Triton vs chunked PyTorch), uniform@0.1 and ANN@0.1 at 10^6 and 10^7 classes, d = 128 and 512,
   global batch 1024, bf16 weights; median step, ANN index build, peak GPU memory.

The results go to one Markdown file (``--out``, default benchmarks/results/gpu_check.md; with
``--dry-run`` benchmarks/results/gpu_check_dry_run.md). Exit status 1 if any check failed.
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
FULL_SIZES = {"classes": (10**6, 10**7), "dims": (128, 512), "batch": 1024, "steps": 5, "warmup": 2}
DRY_SIZES = {"classes": (20_000,), "dims": (32,), "batch": 64, "steps": 2, "warmup": 1}
TIME_BUDGET_S = 420.0  # stop timing new configurations past this (the whole check must stay < 8 min)


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
        parts.append(f"CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
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
             "tests/test_device.py"]
    files = [f for f in files if os.path.exists(os.path.join(ROOT, f))]
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *files],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    tail = proc.stdout.strip().splitlines()[-1:] or ["no output"]
    print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n", flush=True)
    return ("PASS" if proc.returncode == 0 else "FAIL"), tail[0]


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
VARIANTS = {  # name -> (sampler, head update mode, softmax backend)
    "exact (chunked torch)": ({"type": "full"}, "dense", "torch"),
    "exact (fused triton)": ({"type": "full"}, "dense", "triton"),
    "uniform@0.1": ({"type": "uniform", "sample_rate": 0.1}, "lazy", "auto"),
    "ann@0.1": ({"type": "ann", "sample_rate": 0.1}, "lazy", "auto"),
}


def _sync(dev: str) -> None:
    import torch
    if dev == "cuda":
        torch.cuda.synchronize()


def _time_variant(name: str, classes: int, dim: int, sizes: dict, dev: str, dtype: str) -> dict:
    import torch
    import ds_xc
    sampler, update, backend = VARIANTS[name]
    if dev == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    head = ds_xc.ClassParallelHead(dim, classes, loss={"type": "arcface", "scale": 64.0, "margin": 0.5},
                                   sampler=sampler, chunk_size=256, dtype=dtype, update=update,
                                   softmax_backend=backend, device=dev)
    opt = ds_xc.build_head_optimizer(head, {"type": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4,
                                            "update": update})
    build_s = None
    if hasattr(head.sampler, "rebuild"):
        _sync(dev)
        start = time.perf_counter()
        head.rebuild_index()
        _sync(dev)
        build_s = time.perf_counter() - start
    gen = torch.Generator().manual_seed(3)
    times = []
    for i in range(sizes["warmup"] + sizes["steps"]):
        x = torch.randn(sizes["batch"], dim, generator=gen).to(dev, torch.float32).requires_grad_()
        y = torch.randint(0, classes, (sizes["batch"],), generator=gen).to(dev)
        _sync(dev)
        start = time.perf_counter()
        head(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(dev)
        if i >= sizes["warmup"]:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**20 if dev == "cuda" else float("nan")
    del head, opt
    return {"step_ms": 1e3 * statistics.median(times), "build_s": build_s, "peak_mib": peak}


def check_timing(ctx: dict):
    dev = "cpu" if ctx["dry_run"] else "cuda"
    sizes = DRY_SIZES if ctx["dry_run"] else FULL_SIZES
    names = [n for n in VARIANTS if not (ctx["dry_run"] and "triton" in n)]
    rows, skipped, start = [], [], time.perf_counter()
    for classes in sizes["classes"]:
        for dim in sizes["dims"]:
            for name in names:
                if time.perf_counter() - start > TIME_BUDGET_S:
                    skipped.append(f"{name} C={classes} d={dim}")
                    continue
                rec = _time_variant(name, classes, dim, sizes, dev, "bfloat16")
                rows.append((classes, dim, name, rec))
                print(f"  timing C={classes:,} d={dim} {name}: {rec['step_ms']:.2f} ms"
                      + (f", index build {rec['build_s']:.2f} s" if rec["build_s"] is not None else ""), flush=True)
    ctx["timing"], ctx["timing_skipped"] = rows, skipped
    detail = f"{len(rows)} configurations timed"
    if skipped:
        detail += f", {len(skipped)} skipped past the {TIME_BUDGET_S:.0f} s budget"
    if ctx["dry_run"]:
        detail += " (dry run: tiny sizes on the CPU, the Triton variant skipped)"
    return "PASS", detail


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
        lines += ["", "Head step (forward + backward + SGD momentum step), bf16 weights, ArcFace s=64 m=0.5, "
                  f"global batch {(DRY_SIZES if ctx['dry_run'] else FULL_SIZES)['batch']}, one GPU (one rank); "
                  "median of the timed steps.", "",
                  "| classes | d | variant | step ms | vs exact (chunked) | index build s | peak MiB |",
                  "|---|---|---|---|---|---|---|"]
        base = {(c, d): r["step_ms"] for c, d, n, r in rows if n.startswith("exact (chunked")}
        for c, d, n, r in rows:
            ratio = base.get((c, d), float("nan")) / r["step_ms"]
            build = f"{r['build_s']:.2f}" if r["build_s"] is not None else "-"
            lines.append(f"| {c:,} | {d} | {n} | {r['step_ms']:.2f} | {ratio:.2f}x | {build} | {r['peak_mib']:.0f} |")
    if ctx.get("timing_skipped"):
        lines += ["", "Not timed (time budget): " + "; ".join(ctx["timing_skipped"])]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="no GPU: the same steps, CUDA parts skipped and said so")
    p.add_argument("--out", default=None, help="results file (default under benchmarks/results/)")
    args = p.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated: before they are imported
    out = args.out or os.path.join(RESULTS, "gpu_check_dry_run.md" if args.dry_run else "gpu_check.md")
    ctx = {"dry_run": args.dry_run, "command": " ".join(["python", "benchmarks/gpu_check.py", *(argv or sys.argv[1:])])}
    checks = Checks()
    for name, fn in (("env", check_env), ("build_cuda_hamming", check_build_cuda), ("build_triton", check_build_triton),
                     ("parity_tests", check_parity_tests), ("head_step", check_head_step), ("timing", check_timing)):
        status = checks.run(name, fn, ctx)
        if name == "env" and status == "FAIL":
            break
    text = report(ctx, checks)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write(text)
    print(f"wrote {out}", flush=True)
    print(f"gpu_check: {'FAILED' if checks.failed else 'all checks passed or skipped with a reason'}", flush=True)
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""The device check: build, prove against the CPU reference, and time the GPU path on one CUDA GPU.

One script, run once whenever a GPU is lent (benchmarks/README.md, "GPU check"):

    bash benchmarks/gpu_check.sh                  # on a machine with one CUDA GPU (< 7 min on an H200)
    python benchmarks/gpu_check.py --dry-run      # anywhere: the same steps, CUDA parts skipped and said so

Steps, each printed as one line ``CHECK <name>: PASS | FAIL | SKIP (<why>)``:

1. ``env``: torch, CUDA, device, triton, nvcc versions.
2. ``build_cuda_hamming``: JIT-compiles the CUDA Hamming scan (ops/csrc/hamming_cuda.cu).
3. ``build_triton``: compiles and runs the Triton kernels once (fused margin softmax, Hamming scan,
   compression selection) and compares each with its PyTorch reference (the softmax within the fp32
   tolerance, the scan and the selection exactly); under ``--dry-run`` on CPU tensors through
   ``TRITON_INTERPRET=1``.
4. ``head_step``: one forward + backward of the class-parallel head for every loss, on the GPU, with
   the chunked PyTorch path and the fused Triton kernel, fp32 and bf16, against the CPU float64
   reference (tests/reference.py); and the ANN head at sample rate 0.1, its index built and searched on
   the GPU, against the float64 reference over the active set it chose, with the recall@10 of that set.
5. ``timing``: side by side, one step (forward, backward, optimizer) of the exact head (fused Triton vs
   chunked PyTorch), uniform@0.1 and ANN@0.1 eager and as captured CUDA graphs (ds_xc/head/graphs.py),
   and the Partial-FC-equivalent head at 10^6 and 10^7 classes, d = 128 and 512, global batch 1024,
   bf16 weights (and fp32 at 10^6, d = 128); median step, ANN index build, peak GPU memory.
6. ``train_job``: the README's main job (``deepspeed launch/train.py`` on configs/default.json) on the
   GPU through the DeepSpeed launcher, and the same job on the machine's CPU beside it (the same data:
   the text task reads the interpreter's stdlib); the held-out top-1 of the two within 0.01.
7. ``parity_tests``: the GPU parity tests (CUDA Hamming and Triton kernels against the PyTorch
   reference, on CUDA tensors; the bf16 head's CUDA test; momentum correction and the update score
   with DeepSpeed's FusedAdam) through pytest.
8. ``profile``: torch.profiler over three steps of each timed variant at 10^6 classes, d = 128,
   bf16: wall vs device-busy time, kernel launches and host syncs per step, the top ops.
9. ``targets``: FAIL unless, at 10^6 classes, d = 128, bf16, batch 1024, the device is busy at least
   80% of an eager uniform / ann step and 90% of a captured one, and uniform@0.1 takes at most 0.35x and
   ann@0.1 at most 0.5x of the Partial-FC-equivalent step measured in the same run (issue 55).

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
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/: gpu_speed, harness
from gpu_speed import (FULL_SIZES, ROOT, TOLERANCE, check_profile, check_targets, check_timing,  # noqa: E402
                       check_triton_tiles, profile_report, rel_error, tiles_report, timing_report)
from gpu_check_multi import MULTI_CHECKS  # noqa: E402  issue 56: 2 ranks on one GPU, FusedAdam's arch list, 10^7 memory

sys.path.insert(0, ROOT)
RESULTS = os.path.join(ROOT, "benchmarks", "results")

LOSSES = ("softmax", "cosface", "arcface", "combined", "dsoftmax")


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
    """The Triton entry points as (name, callable that runs it once on small inputs and returns its error
    against the PyTorch reference: 0 where the backends must agree exactly)."""
    import torch
    from tests.reference import LOSSES as LOSS_CFG
    from ds_xc.head.margins import build_loss
    from ds_xc.head.softmax import fused_loss_and_grads
    from ds_xc_ops.hamming import hamming_topk_ivf
    from ds_xc_ops.triton_select import select_above, select_above_torch
    from ds_xc.head.triton_softmax import triton_fused_loss_and_grads
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(48, 32, generator=gen).to(dev)
    w = torch.randn(70, 32, generator=gen).to(dev)
    t = torch.randint(-1, 70, (48,), generator=gen).to(dev)

    def softmax():
        loss = build_loss(LOSS_CFG["arcface"])
        got, ref = triton_fused_loss_and_grads(x, w, t, loss), fused_loss_and_grads(x, w, t, loss)
        return max(rel_error(a, b) for a, b in zip(got, ref))

    def hamming():
        q = torch.randint(0, 256, (8, 32), dtype=torch.uint8, generator=gen).to(dev)
        codes = torch.randint(0, 256, (100, 32), dtype=torch.uint8, generator=gen).to(dev)
        ids = torch.arange(100, device=dev)
        off = torch.tensor([0, 40, 100], device=dev)
        probes = torch.tensor([[0, 1]] * 8, device=dev)
        got = hamming_topk_ivf(q, codes, ids, off, probes, 10, backend="triton")
        ref = hamming_topk_ivf(q, codes, ids, off, probes, 10, backend="torch")
        return float(not all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(got, ref)))

    def select():
        v = torch.randn(5000, generator=gen).to(dev)
        got, ref = select_above(v, 1.5, backend="triton"), select_above_torch(v, 1.5)
        return float(not all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(got, ref)))

    return [("fused softmax", softmax, TOLERANCE["float32"]), ("hamming scan", hamming, 0.0),
            ("selection", select, 0.0)]


def check_build_triton(ctx: dict):
    """Compile (or interpret) each Triton kernel once and compare its output with the PyTorch reference."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return ("SKIP" if ctx["dry_run"] else "FAIL"), "triton is not installed"
    done, bad = [], []
    for name, fn, tol in _triton_kernels():
        start = time.perf_counter()
        err = fn()
        done.append(f"{name} {time.perf_counter() - start:.1f} s (error {err:.1e}, allowed {tol:.0e})")
        if not err <= tol:
            bad.append(name)
    where = "interpreter, CPU tensors" if ctx["dry_run"] else "compiled for the GPU"
    detail = f"{where}: " + ", ".join(done)
    return ("FAIL", f"{', '.join(bad)} differ from the PyTorch reference | {detail}") if bad else ("PASS", detail)


def check_parity_tests(ctx: dict):
    if ctx["dry_run"]:
        return "SKIP", "dry run: CI runs the same tests on CPU tensors under TRITON_INTERPRET=1"
    # compiled kernels on CUDA tensors; the fused softmax's GPU parity is the head_step check (its
    # test file runs the interpreter on CPU tensors, which CI already does)
    files = ["tests/test_ops_hamming.py", "tests/test_triton_hamming.py", "tests/test_triton_select.py",
             "tests/test_device.py", "tests/test_bf16_head.py",
             "tests/test_compression_momentum.py::test_fused_adam_takes_the_default_on_a_gpu",
             "tests/test_graphs.py::test_captured_and_replayed_on_a_gpu_equals_eager",
             "tests/test_compression_score.py::test_fused_adam_is_ranked_by_its_state_on_a_gpu"]
    files = [f for f in files if os.path.exists(os.path.join(ROOT, f.split("::")[0]))]
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
    return rel_error(out, ref_loss), rel_error(xd.grad, ref_gx), rel_error(head.weight.grad, ref_gw)


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
    ann_err, recall = _ann_sampled_step(dev)
    summary = "; ".join(f"{b}/{d} worst {e:.1e}" for (b, d), e in worst.items())
    summary += f"; ann@0.1 vs float64 on its active set {ann_err:.1e}, recall@10 of the active set {recall:.3f}"
    if ctx["dry_run"]:
        summary += " (dry run: on the CPU, the Triton backend under the interpreter at 101 classes)"
    ctx["head_step"] = summary
    if notes or not ann_err <= TOLERANCE["float32"] or not recall >= ANN_RECALL:
        return "FAIL", "; ".join(notes) + f" | {summary}"
    return "PASS", summary


ANN_RECALL = 0.95  # recall@10 of the ANN head's active set at its defaults (issue 55)


def _ann_sampled_step(dev: str) -> tuple[float, float]:
    """The ANN head at sample rate 0.1 on the device, its index built and searched there: (largest
    relative error of its loss and gradients against the float64 reference over the active set it chose,
    recall@10 of that active set against the exact top-10 classes by cosine)."""
    import torch
    import ds_xc
    from tests.reference import reference
    gen = torch.Generator().manual_seed(2)
    classes, dim, rows, members = 20_000, 64, 64, 10  # 64 rows: ~15 retrieved classes of each fit the budget
    loss = {"type": "cosface", "scale": 30.0, "margin": 0.35}
    head = ds_xc.ClassParallelHead(dim, classes, loss=loss, sampler={"type": "ann", "sample_rate": 0.1},
                                   init_std=0.05, device=dev)
    # classes in tight groups of 10 around random centres, each query near its label's centre: its 10 nearest
    # classes are its group (a well-posed top-10, as trained weights give; random weights have none)
    centres = torch.nn.functional.normalize(torch.randn(classes // members, dim, generator=gen), dim=1)
    spread = torch.randn(classes, dim, generator=gen) * (0.1 / dim ** 0.5)
    with torch.no_grad():
        head.weight.copy_((0.05 * (centres.repeat_interleave(members, 0) + spread)).to(dev))
    y = torch.randint(0, classes, (rows,), generator=gen)
    x = centres[y // members] + torch.randn(rows, dim, generator=gen) * (0.1 / dim ** 0.5)
    xd = x.to(dev).requires_grad_()
    out = head(xd, y.to(dev))
    out.backward()
    index, targets = head.last_active.index.cpu(), head.last_active.targets.cpu()
    w = head.weight.detach().cpu().double()
    ref_loss, ref_gx, ref_gw = reference(x, w[index], targets, loss)
    gw = head.weight.grad.to_dense().cpu()[index] if head.weight.grad.is_sparse else head.weight.grad.cpu()[index]
    err = max(rel_error(out, ref_loss), rel_error(xd.grad, ref_gx), rel_error(gw, ref_gw))
    cos = torch.nn.functional.normalize(x.double(), dim=1) @ torch.nn.functional.normalize(w, dim=1).t()
    top = torch.topk(cos, 10, dim=1).indices  # (rows, 10)
    active = torch.zeros(classes, dtype=torch.bool)
    active[index] = True
    return err, float(active[top].float().mean())


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
    deadline = min(start + FULL_SIZES["train_s"], ctx.get("deadline", float("inf")) + 30.0)
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
    lines += timing_report(ctx)
    lines += tiles_report(ctx)
    lines += profile_report(ctx)
    return "\n".join(lines) + "\n"


# in order of what a short device lease must not miss: the builds and the maths, the GPU step and its targets,
# the parity tests, then the rest
CHECK_STEPS = (("env", check_env), ("build_cuda_hamming", check_build_cuda), ("build_triton", check_build_triton),
               ("head_step", check_head_step), ("timing", check_timing), ("profile", check_profile),
               ("targets", check_targets), ("parity_tests", check_parity_tests),
               ("triton_tiles", check_triton_tiles), ("train_job", check_train_job)) + MULTI_CHECKS
DEADLINE_S = 470.0  # the whole check within 8 minutes: a check that would start past this is not run, and FAILs


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
    start = time.perf_counter()
    for name, fn in CHECK_STEPS:
        if only and name != "env" and name not in only:
            continue
        if time.perf_counter() - start > DEADLINE_S and not args.dry_run:
            checks.rows.append((name, "FAIL", f"not run: the check's {DEADLINE_S:.0f} s budget was spent", 0.0))
            print(f"CHECK {name}: FAIL (not run: the check's {DEADLINE_S:.0f} s budget was spent) [0.0 s]", flush=True)
            continue
        ctx["deadline"] = start + DEADLINE_S
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

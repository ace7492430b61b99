"""Issue 56's device checks, registered in benchmarks/gpu_check.py (``MULTI_CHECKS``): what a GPU can
prove about several ranks per host when the GPUs lent to us come one per machine.

``two_process_gloo``
    Two processes on the one GPU through gloo with CUDA tensors (both ranks on cuda:0: LOCAL_RANK 0
    each, as two hosts of one GPU would be), under the device audit's strict mode
    (ds_xc/parallel/device_audit.py: every collective ds_xc issues must run on the bound device with
    its tensors on the group's device, else it raises before the collective): ``ds_xc.initialize``
    with an ANN head, three steps, a checkpoint saved and loaded, and launch/grow.py's ``grow`` with
    imprinting. The two ranks' losses must be equal and finite, the resume step 3, the grown head 26
    classes. tests/test_gpu_check_multi.py runs the same job on the CPU.
``fused_adam_arch``
    DeepSpeed's FusedAdam JIT-built and stepped in a fresh process under an architecture-specific
    ``TORCH_CUDA_ARCH_LIST`` (the image's, or "<major>.<minor>a" of the GPU): DeepSpeed 0.19's parser
    failed on "9.0a" before ds_xc wrapped it (ops/builders.py).
``memory_1e7_bf16``
    A 10^7 x 512 bfloat16 head on the GPU: its initialisation (threaded CPU draws copied block by
    block), one exact training step of 1,024 rows in chunks of 256 (cosface, dense SGD), and
    ``state_dict()`` (the fingerprint in float64 blocks); the peak allocated memory must fit 75 GiB.

Each returns (status, detail) like gpu_check's checks and skips without CUDA (and in a dry run);
:func:`run_multi_checks` runs them through a ``Checks`` object. Each takes tens of seconds on an H200.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEMORY_LIMIT_GIB = 75.0
TWO_PROCESS_S = 240.0
FUSED_ADAM_S = 300.0


def _no_cuda(ctx: dict):
    """("SKIP", why) when there is no GPU to check on (or a dry run), else None."""
    import torch
    if ctx.get("dry_run") or not torch.cuda.is_available():
        return "SKIP", "no CUDA device (dry run): the CPU tests cover what can be run without one"
    return None


# ----------------------------------------------------------------------------- two processes, one GPU
def _config(num_classes: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10**9, "gradient_clipping": 0.0,
            "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
            "extreme_classification": {
                "num_classes": num_classes, "embedding_dim": 16, "loss": {"type": "cosface"},
                "sampler": {"type": "ann", "sample_rate": 0.5, "code_bits": 32, "nlist": 3, "nprobe": 2,
                            "rebuild_interval": 2, "metrics_interval": 1},
                "optimizer": {"type": "sgd", "lr": 0.05, "momentum": 0.9}},
            "xc_train": {"data": "synthetic", "hidden_dim": 16, "max_steps": 3, "eval_every": 0}}


def _worker(folder: str) -> None:
    """One rank of the two-process job (environment: RANK, WORLD_SIZE=2, LOCAL_RANK=0, MASTER_*)."""
    import datetime
    import importlib.util

    import torch
    import torch.distributed as dist

    sys.path.insert(0, ROOT)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank(dist.group.WORLD)
    import ds_xc
    from ds_xc.checkpoint import ShardRows
    from ds_xc.data import build_dataset, dataset_kwargs
    from ds_xc.models import build_backbone
    from ds_xc.parallel.device_audit import DeviceAudit
    spec = importlib.util.spec_from_file_location("gpu_check_grow", os.path.join(ROOT, "launch", "grow.py"))
    grow = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(grow)
    paths = {}
    for name, classes in (("small", 20), ("big", 26)):
        paths[name] = os.path.join(folder, f"{name}{rank}.json")
        with open(paths[name], "w") as fh:
            json.dump(_config(classes), fh)
    raw = _config(20)
    xcfg = ds_xc.parse_config(raw)
    with DeviceAudit(strict=True) as audit:
        data = build_dataset("synthetic", 20, seed=xcfg.xc_train.seed, **dataset_kwargs(xcfg.xc_train))
        torch.manual_seed(0)
        xc = ds_xc.initialize(model=build_backbone(data, 16, hidden_dim=16), config=raw)
        dev = xc.engine.device
        losses = []
        for step in range(3):
            x, y = data.train_batch(step, 8, rank, 2)
            loss = xc(x.to(dev), y.to(dev))
            xc.backward(loss)
            xc.step()
            losses.append(loss.item())
        ckpt, grown = os.path.join(folder, "c1"), os.path.join(folder, "c2")
        xc.save_checkpoint(ckpt, tag="step3", client_state={"step": 3})
        state = xc.load_checkpoint(ckpt, tag="step3")
        grow.grow(grow.parse_args(["--load_dir", ckpt, "--out_dir", grown, "--deepspeed_config", paths["big"],
                                   "--imprint_samples", "128", "--imprint_old_samples", "32"]))
    result = {"losses": losses, "device": str(dev), "head_device": str(xc.head.weight.device),
              "resumed": state["step"], "grown": ShardRows(os.path.join(grown, "step3")).num_classes,
              "audit": audit.report()}
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    dist.destroy_process_group()


def run_two_process(timeout: float = TWO_PROCESS_S, env: dict | None = None) -> tuple:
    """(ok, detail) of the two-process job on this machine (CUDA tensors where DeepSpeed's accelerator
    is CUDA, else the CPU); the ranks' logs are printed when it fails."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from harness import free_port
    folder = tempfile.mkdtemp(prefix="gpu_check_multi_")
    base = dict(os.environ, **(env or {}), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), PYTHONUNBUFFERED="1",
                PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    base.setdefault("OMP_NUM_THREADS", "2")
    logs = [open(os.path.join(folder, f"rank{r}.log"), "w+") for r in range(2)]
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", folder], cwd=ROOT,
                              env=dict(base, RANK=str(r)), stdout=logs[r], stderr=subprocess.STDOUT)
             for r in range(2)]
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
    codes = [p.wait() for p in procs]
    texts = []
    for fh in logs:
        fh.seek(0)
        texts.append(fh.read())
        fh.close()
    if any(codes):
        for r, text in enumerate(texts):
            print(f"--- two_process_gloo rank {r} (exit {codes[r]})\n{text[-3000:]}", flush=True)
        last = next((ln for t in texts for ln in reversed(t.strip().splitlines()) if "Error" in ln), "no error line")
        return False, f"exit codes {codes}: {last[-400:]}"
    results = [json.load(open(os.path.join(folder, f"rank{r}.json"))) for r in range(2)]
    return _judge(results)


def _judge(results: list) -> tuple:
    a, b = results
    audited = [r["audit"]["audited"] for r in results]
    losses = [round(v, 4) for v in a["losses"]]
    detail = (f"2 ranks on {a['device']} (head on {a['head_device']}), gloo: losses {losses}, "
              f"resumed at step {a['resumed']}, grown to {a['grown']} classes; strict device audit: "
              f"{audited} collectives of ds_xc, {sum(r['audit']['findings'] for r in results)} findings")
    problems = []
    if a["losses"] != b["losses"] or not all(math.isfinite(v) for v in a["losses"]):
        problems.append(f"rank losses differ or are not finite: {a['losses']} vs {b['losses']}")
    if any(r["resumed"] != 3 or r["grown"] != 26 for r in results):
        problems.append("the checkpoint did not resume at step 3 or the grown head has not 26 classes")
    if any(r["audit"]["findings"] for r in results) or min(audited) == 0:
        problems.append(f"device audit: {[r['audit']['distinct'] for r in results]}")
    return (not problems), detail + ("" if not problems else " | " + "; ".join(problems))


def two_process_gloo(ctx: dict):
    skip = _no_cuda(ctx)
    if skip:
        return skip
    ok, detail = run_two_process()
    if ok and "cuda" not in detail.split(" (head")[0]:
        return "FAIL", detail + " | the ranks did not run on the GPU"
    return ("PASS" if ok else "FAIL"), detail


# ----------------------------------------------------------------------------- FusedAdam's arch list
_FUSED_ADAM = """
import os, time
import torch, ds_xc
from deepspeed.ops.adam import FusedAdam
t0 = time.perf_counter()
p = torch.nn.Parameter(torch.ones(1024, device="cuda"))
opt = FusedAdam([p], lr=0.1)
p.grad = torch.ones_like(p)
opt.step()
torch.cuda.synchronize()
print("FUSED_ADAM", time.perf_counter() - t0, float(p.sum()), os.environ.get("TORCH_CUDA_ARCH_LIST"))
"""


def arch_list_with_suffix() -> str:
    """The image's TORCH_CUDA_ARCH_LIST when it names an architecture-specific target, else the GPU's
    "<major>.<minor>a" (Hopper and later; the plain one before)."""
    import torch
    image = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    if any(c.isalpha() for c in image.replace("+PTX", "")):
        return image
    major, minor = torch.cuda.get_device_capability(0)
    return f"{major}.{minor}{'a' if major >= 9 else ''}"


def fused_adam_arch(ctx: dict):
    skip = _no_cuda(ctx)
    if skip:
        return skip
    arch = arch_list_with_suffix()
    env = dict(os.environ, TORCH_CUDA_ARCH_LIST=arch, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", _FUSED_ADAM], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=FUSED_ADAM_S)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("FUSED_ADAM")), None)
    if proc.returncode or line is None:
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n", flush=True)
        return "FAIL", f"TORCH_CUDA_ARCH_LIST={arch!r}: exit {proc.returncode}: " + \
            (proc.stderr.strip().splitlines() or ["no output"])[-1][-400:]
    _, seconds, total, after = line.split(" ", 3)
    want = 1024 * (1.0 - 0.1)  # Adam's first step moves every element by lr
    if abs(float(total) - want) > 1e-2 * want:
        return "FAIL", f"FusedAdam stepped to a sum of {total}, expected {want}"
    return "PASS", (f"FusedAdam built and stepped in {float(seconds):.1f} s under TORCH_CUDA_ARCH_LIST={arch!r} "
                    f"(still {after!r} afterwards)")


# ----------------------------------------------------------------------------- memory at 10^7 x 512
def head_memory_1e7(ctx: dict, num_classes: int = 10**7, dim: int = 512, rows: int = 1024, chunk: int = 256):
    skip = _no_cuda(ctx)
    if skip:
        return skip
    import torch

    import ds_xc
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    t0 = time.perf_counter()
    head = ds_xc.ClassParallelHead(dim, num_classes, loss={"type": "cosface"}, dtype="bfloat16", chunk_size=chunk,
                                   init_std=0.01, device=dev)
    torch.cuda.synchronize(dev)
    init_s = time.perf_counter() - t0
    opt = ds_xc.build_head_optimizer(head, {"type": "sgd", "lr": 0.1, "update": "dense"})
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(rows, dim, device=dev, generator=gen, dtype=torch.bfloat16).requires_grad_(True)
    y = torch.randint(0, num_classes, (rows,), device=dev, generator=gen)
    t0 = time.perf_counter()
    loss = head(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize(dev)
    step_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    head.state_dict()
    torch.cuda.synchronize(dev)
    save_s = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated(dev) - base) / 2**30
    shard = head.weight.numel() * head.weight.element_size() / 2**30
    detail = (f"{num_classes:.0e} x {dim} bf16 head ({shard:.1f} GiB): init {init_s:.1f} s on "
              f"{torch.get_num_threads()} CPU threads, one exact step of {rows} rows in chunks of {chunk} "
              f"{step_s:.2f} s (loss {loss.item():.3f}), state_dict {save_s:.2f} s; peak {peak:.1f} GiB "
              f"(limit {MEMORY_LIMIT_GIB:.0f} GiB)")
    del head, opt, x, y, loss
    torch.cuda.empty_cache()
    if not peak <= MEMORY_LIMIT_GIB:
        return "FAIL", detail
    return "PASS", detail


MULTI_CHECKS = (("two_process_gloo", two_process_gloo), ("fused_adam_arch", fused_adam_arch),
                ("memory_1e7_bf16", head_memory_1e7))


def run_multi_checks(checks, ctx: dict, only=()) -> list:
    """Run MULTI_CHECKS through gpu_check's ``Checks`` object (``checks.run(name, fn, ctx)``: one
    ``CHECK <name>: PASS | FAIL | SKIP (why)`` line each); ``only``: their names to run (empty: all)."""
    return [checks.run(name, fn, ctx) for name, fn in MULTI_CHECKS if not only or name in only]


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        _worker(sys.argv[2])
    else:
        sys.exit("usage: python benchmarks/gpu_check_multi.py --worker FOLDER (gpu_check.py runs the checks)")

"""benchmarks/gpu_check.py --dry-run: the device check's steps run without a GPU, every check
says PASS or SKIP with its reason, and the results file holds the check table and the timing
table (the GPU run itself needs a lent device: benchmarks/README.md, "GPU check")."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKS = ("env", "build_cuda_hamming", "build_triton", "parity_tests", "head_step", "timing", "train_job", "profile",
          "triton_tiles", "targets", "two_process_gloo", "fused_adam_arch", "memory_1e7_bf16")


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "gpu_check.md"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = {m.group(1): (m.group(2), m.group(3))
             for m in re.finditer(r"^CHECK (\w+): (PASS|FAIL|SKIP) \((.*)\) \[", proc.stdout, re.M)}
    assert set(lines) == set(CHECKS), proc.stdout[-3000:]
    assert lines["build_cuda_hamming"][0] == "SKIP" and "no CUDA" in lines["build_cuda_hamming"][1]
    assert lines["parity_tests"][0] == "SKIP" and lines["targets"][0] == "SKIP"
    # every Triton kernel was compared with its PyTorch reference
    assert len(re.findall(r"error ([0-9.e+-]+), allowed", lines["build_triton"][1])) == 3
    for name in ("two_process_gloo", "fused_adam_arch", "memory_1e7_bf16"):  # benchmarks/gpu_check_multi.py
        assert lines[name][0] == "SKIP" and "no CUDA device" in lines[name][1], (name, lines[name])
    for name in ("env", "build_triton", "head_step", "timing", "train_job", "profile",
          "triton_tiles"):
        assert lines[name][0] == "PASS", (name, lines[name])
    # the head step was compared with the float64 reference: errors are printed and small
    errors = [float(e) for e in re.findall(r"worst ([0-9.e+-]+)", lines["head_step"][1])]
    assert len(errors) == 4 and max(errors) < 3e-2
    ann = re.search(r"ann@0.1 vs float64 on its active set ([0-9.e+-]+), recall@10 of the active set ([0-9.]+)",
                    lines["head_step"][1])
    assert ann and float(ann.group(1)) < 2e-4 and float(ann.group(2)) >= 0.95, lines["head_step"]
    text = out.read_text()
    assert "| head_step | PASS |" in text and "| build_cuda_hamming | SKIP |" in text
    for dtype, update in (("bfloat16", "lazy"), ("float32", "lazy_exact")):  # the library defaults per dtype
        assert re.search(rf"\| 20,000 \| 32 \| {dtype} \| ann@0\.1 \| {update} \| [0-9.]+ \| [0-9.]+x \| [0-9.]+x \| "
                         r"[0-9.]+ \|", text), text
    assert re.search(r"\| 20,000 \| 32 \| float32 \| pfc-equivalent@0\.1 \| dense \(torch.optim.SGD\) \| [0-9.]+ \| "
                     r"[0-9.]+x \| 1\.00x \|", text), text
    # the profile table: one row per profiled variant, with its share of busy time
    assert re.search(r"\| ann@0\.1 \| lazy \| [0-9.]+ \| [0-9.]+ \| [0-9]+% \| [0-9]+ \| [0-9]+ \| [0-9]+ \| [0-9]+ \|", text), text
    # the tile sweep compared the interpreted kernel with the PyTorch path in fp32
    assert re.search(r"\| 32 \| 200 \| 16 \| triton interpreter default \| [0-9.]+ \| [0-9.]+x \| ([0-9.]+)e-0[4-9] \|",
                     text), text
    # the main job ran through the DeepSpeed launcher and wrote its summary (5 steps on the CPU)
    assert re.search(r"5 steps in [0-9.]+ s of training .* on cpu \(head on cpu\)", lines["train_job"][1])

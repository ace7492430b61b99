"""DeepSpeed's own JIT ops under an architecture-specific TORCH_CUDA_ARCH_LIST (the H200 image sets
"9.0a"): DeepSpeed 0.19 parses each entry with int() and raised ("invalid literal for int() with base
10: '0a'") when a user's FusedAdam or FusedLamb was built, because ds_xc normalised the variable only
around its own build. ``import ds_xc`` now wraps DeepSpeed's parser once (ops/builders.py:
plain_arch_lists_for_deepspeed): its builders read the plain list, the caller's variable is otherwise
left as it was. The build itself needs a GPU: benchmarks/gpu_check_multi.py builds FusedAdam there."""
import os
import subprocess
import sys

import pytest
import torch

import ds_xc  # noqa: F401  (installs the wrapper, as any user of ds_xc gets it)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("builder", ["fused_adam.FusedAdamBuilder", "fused_lamb.FusedLambBuilder"])
@pytest.mark.parametrize("arch,want", [("9.0a", "9.0+PTX"), ("9.0a;10.0a+PTX", "9.0;10.0+PTX"),
                                       ("8.0 9.0a", "8.0;9.0+PTX")])
def test_deepspeed_builders_parse_arch_specific_lists(monkeypatch, builder, arch, want):
    import importlib
    from deepspeed.ops.op_builder.builder import CUDAOpBuilder
    module, name = builder.split(".")
    cls = getattr(importlib.import_module(f"deepspeed.ops.op_builder.{module}"), name)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch)
    b = cls()
    b.jit_mode = True
    with pytest.raises(ValueError, match="0a"):
        CUDAOpBuilder.compute_capability_args.__wrapped__(b)  # DeepSpeed's parser alone
    b._jit_arch_list = arch  # what jit_load captures before the build
    assert b.compute_capability_args() == []  # JIT: torch makes the -gencode flags from the variable
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == want
    b.jit_mode, b._jit_arch_list = False, None
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch)
    flags = b.compute_capability_args()  # ahead-of-time: the -gencode flags themselves
    assert "-gencode=arch=compute_90,code=sm_90" in flags and not any("90a" in f for f in flags)


def test_a_fresh_process_gets_the_wrapper_from_import_ds_xc():
    code = ("import os; os.environ['TORCH_CUDA_ARCH_LIST'] = '9.0a'; import ds_xc; "
            "from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder as B; b = B(); b.jit_mode = True; "
            "print(b.compute_capability_args(), os.environ['TORCH_CUDA_ARCH_LIST'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("[] 9.0+PTX"), out.stdout + out.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device and nvcc")
def test_fused_adam_builds_under_an_arch_specific_list():
    code = ("import os; os.environ['TORCH_CUDA_ARCH_LIST'] = '9.0a'; import torch, ds_xc; "
            "from deepspeed.ops.adam import FusedAdam; p = torch.nn.Parameter(torch.ones(4, device='cuda')); "
            "opt = FusedAdam([p], lr=0.1); p.grad = torch.ones_like(p); opt.step(); "
            "print(float(p.sum()), os.environ['TORCH_CUDA_ARCH_LIST'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1].endswith("9.0a")  # the caller's value after the build

"""Compile the Triton kernels for a GPU target on a machine without a GPU.

The interpreter runs the kernels' Python, not their compiled form: the libdevice popcount
(``USE_POPC=True``), the ``tl.sort`` merge inside a data-dependent ``if`` in a loop, and
the register budget are only seen by the compiler. ``triton.compile`` needs no device:
it lowers to PTX and assembles a cubin with the ptxas bundled in the triton wheel. Run it
without ``TRITON_INTERPRET`` (the kernels must be decorated as compiled kernels)::

    python -m ds_xc_ops.triton_compile_check              # sm_90a, the test configurations
    python -m ds_xc_ops.triton_compile_check --arch 80 --full

Each line reports the registers and spill bytes that ``ptxas -v`` gives for the kernel,
and "popc" when the scan's PTX uses the hardware popcount.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import subprocess
import sys
import tempfile

__all__ = ["compile_kernels", "hamming_configs"]

logger = logging.getLogger(__name__)

_SCAN_SIG = {"q_ptr": "*i32", "codes_ptr": "*i32", "ids_ptr": "*i64", "off_ptr": "*i64",
             "probes_ptr": "*i64", "out_ptr": "*i64", "num_probes": "i32", "num_lists": "i32",
             "probes_per_split": "i32", "num_splits": "i32", "W": "constexpr", "BLOCK_W": "constexpr",
             "BLOCK_R": "constexpr", "K_PAD": "constexpr", "USE_POPC": "constexpr", "RANK_MERGE": "constexpr"}


def hamming_configs(full: bool) -> list:
    """(code_bits, K_PAD) pairs to compile: a small set, or the extremes up to TRITON_MAX_K."""
    if not full:
        return [(64, 16)]
    return [(64, 16), (256, 128), (1024, 256), (512, 512), (1024, 1024)]


def _ptxas_usage(ptx: str, arch: str) -> str:
    """'regs R, spill S bytes' from the bundled ptxas -v, or '' when no ptxas accepts the PTX."""
    import triton.knobs as knobs
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        for tool in (knobs.nvidia.ptxas_blackwell, knobs.nvidia.ptxas):
            path = getattr(tool, "path", None)
            if not path or not os.path.exists(path):
                continue
            res = subprocess.run([path, f"-arch=sm_{arch}", "-v", src, "-o", dst],
                                 capture_output=True, text=True, check=False)
            regs = re.findall(r"Used (\d+) registers", res.stderr)
            spill = re.findall(r"(\d+) bytes spill stores", res.stderr)
            if res.returncode == 0 and regs:
                return f"regs {regs[0]}, spill {spill[0] if spill else '?'} bytes"
    return ""


def compile_kernels(arch: int = 90, full: bool = False) -> list:
    """Compile every kernel for sm_<arch>; returns one report line per kernel configuration.

    Raises whatever triton.compile raises (a compile error is the point of the check).
    """
    from ds_xc_ops.triton_util import interpreting
    if interpreting():
        raise RuntimeError("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ds_xc_ops import hamming_triton, triton_select
    target = GPUTarget("cuda", arch, 32)
    ptx_arch = f"{arch}a" if arch >= 90 else str(arch)
    lines = []

    def build(fn, sig, consts, warps, label):
        kern = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target,
                              options={"num_warps": warps})
        usage = _ptxas_usage(kern.asm["ptx"], ptx_arch)
        popc = " popc" if fn is hamming_triton._ivf_scan_kernel and "popc.b32" in kern.asm["ptx"] else ""
        lines.append(f"{label}: ok{popc} {usage}".rstrip())

    for bits, k_pad in hamming_configs(full):
        words = bits // 32
        consts = {"W": words, "BLOCK_W": triton.next_power_of_2(words), "BLOCK_R": max(k_pad, 128),
                  "K_PAD": k_pad, "USE_POPC": True, "RANK_MERGE": False}
        build(hamming_triton._ivf_scan_kernel, _SCAN_SIG, consts, 8 if k_pad >= 512 else 4,
              f"ivf_scan bits={bits} K_PAD={k_pad}")
    block = triton_select.DEFAULT_BLOCK
    build(triton_select._count_kernel, {"v_ptr": "*fp32", "counts_ptr": "*i32", "n": "i32",
                                        "threshold": "fp32", "BLOCK": "constexpr"},
          {"BLOCK": block}, 4, "select_count fp32")
    for dt in ("fp32", "bf16") if not full else ("fp32", "fp16", "bf16"):
        sig = {"v_ptr": f"*{dt}", "starts_ptr": "*i64", "idx_ptr": "*i64", "val_ptr": f"*{dt}",
               "n": "i32", "threshold": "fp32", "BLOCK": "constexpr"}
        build(triton_select._scatter_kernel, sig, {"BLOCK": block}, 4, f"select_scatter {dt}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (80, 90, ...)")
    ap.add_argument("--full", action="store_true", help="every K_PAD up to TRITON_MAX_K")
    args = ap.parse_args(argv)
    for line in compile_kernels(args.arch, args.full):
        sys.stdout.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

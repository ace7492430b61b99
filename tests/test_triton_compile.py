"""The Triton kernels compile for a GPU target (sm_90a) without a GPU: ds_xc_ops.triton_compile_check.

Under the interpreter the GPU-only code (libdevice popcount, the tl.sort merge in a loop)
is never compiled; this runs triton.compile in a subprocess without TRITON_INTERPRET.
"""
import importlib.util
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


@pytest.mark.skipif(importlib.util.find_spec("triton.backends.nvidia") is None,
                    reason="triton without its NVIDIA backend")
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-m", "ds_xc_ops.triton_compile_check", "--arch", "90"],
                         cwd=root, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-4000:]
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(("ivf_scan", "select_"))]  # not logs
    assert len(lines) == 4 and all(": ok" in line for line in lines), res.stdout
    assert "popc" in lines[0]  # the scan uses the hardware popcount, not the bit trick

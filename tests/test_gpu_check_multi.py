"""benchmarks/gpu_check_multi.py without a GPU: its checks skip with a reason, run through gpu_check's
Checks object, and the two-process job (initialize, three steps, save and load, grow with imprinting,
under the device audit's strict mode) runs on the CPU exactly as it will on one GPU through gloo."""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import gpu_check_multi as multi  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU side of the GPU check")


def test_checks_skip_without_cuda_through_a_checks_object():
    from gpu_check import Checks
    checks = Checks()
    assert multi.run_multi_checks(checks, {"dry_run": True}) == ["SKIP"] * 3
    assert [r[0] for r in checks.rows] == ["two_process_gloo", "fused_adam_arch", "memory_1e7_bf16"]
    assert all("no CUDA device" in r[2] for r in checks.rows)
    assert multi.run_multi_checks(checks, {"dry_run": True}, only={"fused_adam_arch"}) == ["SKIP"]


def test_the_judgement_can_fail():
    good = {"losses": [3.0, 2.5, 2.0], "device": "cuda:0", "head_device": "cuda:0", "resumed": 3, "grown": 26,
            "audit": {"audited": 40, "findings": 0, "distinct": []}}
    assert multi._judge([good, dict(good)])[0]
    assert not multi._judge([good, dict(good, losses=[3.0, 2.5, 2.1])])[0]
    assert not multi._judge([good, dict(good, audit={"audited": 40, "findings": 1, "distinct": ["x"]})])[0]
    assert not multi._judge([good, dict(good, grown=20)])[0]


@pytest.mark.slow
def test_two_process_job_on_the_cpu():
    ok, detail = multi.run_two_process(timeout=300, env={"OMP_NUM_THREADS": "1"})
    assert ok, detail
    assert "2 ranks on cpu" in detail and "0 findings" in detail, detail

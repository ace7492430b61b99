"""The communication-device audit over ds_xc's collectives, 8 GPUs per host simulated on the CPU.

Every job of tests/audit_jobs.py (the engine with ANN sampling, gradient compression, checkpoints and
evaluation; the engine with kNN sampling and the overlap pipeline; the head alone with every sampler,
topk, the compression wrapper and imprinting; launch/grow.py's ``grow``; the tuner's measurements,
link calibration and accuracy probe) and launch/train.py itself run on 2 and 3 gloo ranks (uneven
batches) under ``DeviceAudit(simulate_gpus=8)``: no collective may run before the rank's device is
bound, and none may get a host tensor where the group is NCCL on a GPU host.

On the code before issue 56 the same jobs found 30 distinct (kind, collective, call site) breaches:
23 collectives on an unbound device (initialize's agreement before DeepSpeed binds, the data barrier
of launch/train.py, all of launch/grow.py and the tuner) and 7 host tensors (imprinting's float64
sums, the tuner's and the link calibration's heads built without a device).
"""
import json
import os

import pytest
import torch

from tests import audit_jobs as J
from tests.train_procs import run_ranks

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="simulates GPUs on a CPU machine; "
                                "benchmarks/gpu_check_multi.py runs the strict audit on a real one")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _no_findings(reports: list, what: str) -> None:
    found = J.summary(reports)
    assert not found, f"{what}: the device audit found {json.dumps(found, indent=1)}"
    assert all(r["audited"] > 0 for r in reports), f"{what}: no collective of ds_xc was audited"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("variant", ["ann_compression", "knn_overlap"])
def test_engine_collectives_on_bound_devices(pools, tmp_path, world, variant):
    _no_findings(pools(world).run(J.engine_job, variant, str(tmp_path)), f"engine {variant} on {world} ranks")


@pytest.mark.parametrize("world", [2, 3])
def test_head_samplers_compression_imprint(pools, world):
    _no_findings(pools(world).run(J.head_job), f"head jobs on {world} ranks")


@pytest.mark.parametrize("world", [2, 3])
def test_grow_binds_and_reduces_device_tensors(pools, tmp_path, world):
    _no_findings(pools(world).run(J.grow_job, str(tmp_path)), f"grow on {world} ranks")


@pytest.mark.parametrize("world", [2, 3])
def test_tune_binds_and_measures_on_the_device(pools, tmp_path, world):
    _no_findings(pools(world).run(J.tune_job, str(tmp_path)), f"tune on {world} ranks")


@pytest.mark.slow
def test_launch_train_binds_before_its_first_collective(tmp_path):
    """launch/train.py as the launcher starts it (one process per rank, LOCAL_RANK set), under
    ``python -m ds_xc.parallel.device_audit --simulate-gpus 8``."""
    cfg = J.grow_config(str(tmp_path / "train.json"), 20)
    out = run_ranks(["--simulate-gpus", "8", "--report", str(tmp_path / "rep{rank}.json"), "launch/train.py",
                     "--deepspeed_config", cfg, "--max_steps", "2", "--save_dir", str(tmp_path / "ck")], world=2,
                    script=os.path.join(ROOT, "ds_xc", "parallel", "device_audit.py"), timeout=300)
    reports = [json.loads((tmp_path / f"rep{r}.json").read_text()) for r in range(2)]
    _no_findings(reports, "launch/train.py on 2 ranks")
    assert "done: 2 steps" in out


@pytest.mark.slow
@pytest.mark.parametrize("example", ["torch_head.py"])
def test_examples_bind_before_their_first_collective(tmp_path, example):
    """An example as torchrun starts it, under the audit (examples/common.py binds with ds_xc.bind_device
    for all of them; deepspeed_head.py's engine is the engine jobs' ds_xc.initialize)."""
    run_ranks(["--simulate-gpus", "8", "--report", str(tmp_path / "rep{rank}.json"),
               os.path.join(ROOT, "examples", example), "--steps", "2"], world=2,
              script=os.path.join(ROOT, "ds_xc", "parallel", "device_audit.py"), timeout=300)
    _no_findings([json.loads((tmp_path / f"rep{r}.json").read_text()) for r in range(2)], example)

"""The examples under examples/ run as docs/engines.md says (torchrun, gloo, few steps), and their
losses agree: DDP, FSDP2, DeepSpeed and plain torch.distributed on 2 and 3 ranks equal one process on the
whole global batch (float32 rounding), and the DDP comm hook's compressed run equals
CompressedOptimizer's on the same seeds."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = ["--steps", "6"]


_DONE: dict = {}  # (script, nproc, args) -> result: the dense DDP run serves both tests


def _run(tmp_path, script, nproc, *args):
    key = (script, nproc, args)
    if key not in _DONE:
        _DONE[key] = _launch(tmp_path, script, nproc, *args)
    return _DONE[key]


def _launch(tmp_path, script, nproc, *args):
    out = tmp_path / f"{script}_{nproc}_{'_'.join(args) or 'dense'}.json"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]))
    launcher = [sys.executable] if nproc == 0 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    "--nproc_per_node", str(nproc)]
    cmd = launcher + [os.path.join(ROOT, "examples", f"{script}.py"), *STEPS, "--out", str(out), *args]
    for attempt in range(3):
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        # A rank that finished its steps and wrote its result sometimes aborts while the process
        # exits ("terminate called without an active exception", exit -6, gloo teardown under
        # torchrun; seen on 2026-12-05 in about half of the runs under pytest, never when run by
        # hand): launch again rather than fail on a crash after the work being checked.
        teardown = proc.returncode != 0 and out.exists() and "terminate called without an active exception" in \
            proc.stderr + proc.stdout
        if not teardown:
            break
        out.unlink()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "loss " in proc.stdout
    return json.loads(out.read_text())


@pytest.mark.slow
def test_dense_examples_equal_one_process(tmp_path):
    ref = _run(tmp_path, "torch_head", 0)  # python examples/torch_head.py: one process
    assert ref["world_size"] == 1 and ref["losses"][-1] < ref["losses"][0]
    for script, nproc in (("torch_head", 2), ("ddp_head", 2), ("fsdp_head", 3), ("deepspeed_head", 2)):
        got = _run(tmp_path, script, nproc)
        assert got["world_size"] == nproc
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5), (script, nproc)


@pytest.mark.slow
def test_ddp_hook_example_equals_compressed_optimizer_example(tmp_path):
    hook = _run(tmp_path, "ddp_head", 2, "--compress", "topk")
    plain = _run(tmp_path, "torch_head", 2, "--compress", "topk")
    dense = _run(tmp_path, "ddp_head", 2)
    assert hook["density"] == pytest.approx(plain["density"]) and hook["density"] < 0.5
    assert hook["losses"] == pytest.approx(plain["losses"], rel=1e-6)
    assert hook["losses"][1:] != pytest.approx(dense["losses"][1:], rel=1e-6)  # compression changed the steps

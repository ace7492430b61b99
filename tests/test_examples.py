"""The examples under examples/ run as docs/engines.md says (torchrun, gloo, few steps), and their
losses agree: DDP, FSDP2, DeepSpeed and plain torch.distributed on 2 and 3 ranks equal one process on the
whole global batch (float32 rounding), and the DDP comm hook's compressed run equals
CompressedOptimizer's on the same seeds."""
import json
import os
import subprocess
import sys

import pytest

from tests.example_launch import example_command

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
    cmd, env = example_command(script, nproc)
    cmd += [*STEPS, "--out", str(out), *args]
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


def _language_model(tmp_path, nproc, batch=32):
    """examples/language_model.py under the deepspeed launcher (the documented command) on a small text
    (ds_xc's own sources, tokenised into a cache under tmp_path), a few steps: its JSON and stdout."""
    from tests.dist_pool import free_port

    out = tmp_path / f"lm_{nproc}_{batch}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", XDG_CACHE_HOME=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--master_port", str(free_port())]
    cmd += ["--num_gpus", str(nproc)] if nproc > 1 else []
    cmd += [os.path.join(ROOT, "examples", "language_model.py"), "--steps", "40", "--vocab", "512", "--lr", "0.005", "--context", "8",
            "--batch", str(batch), "--dim", "64", "--eval_samples", "256", "--text_root", os.path.join(ROOT, "ds_xc"),
            "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def _check_trains(result, stdout, nproc):
    losses = result["losses"]
    assert result["world_size"] == nproc and len(losses) == 40
    # the loss falls from ln 512 = 6.24 towards the words' frequencies' entropy (about 5.6 on this text)
    assert sum(losses[-10:]) / 10 < losses[0] - 0.3, losses
    assert "held-out next-token accuracy: top-1" in stdout and 0.0 <= result["top1"] <= result["top5"] <= 1.0
    assert result["samples"] == 256 and result["top5"] > 0.0
    assert stdout.count("held-out next-token accuracy") == 1  # rank 0 prints, the others do not


def test_language_model_example_trains(tmp_path):
    """`deepspeed examples/language_model.py` (one CPU process): the loss falls, held-out accuracy printed."""
    result, stdout = _language_model(tmp_path, 1)
    _check_trains(result, stdout, 1)


@pytest.mark.slow
def test_language_model_example_trains_on_two_ranks(tmp_path):
    """`deepspeed --num_gpus 2 examples/language_model.py`: the vocabulary sharded over two ranks, 16 sequences
    each, trains as one rank on the same 32 sequences per step (the same global batches): the same losses."""
    result, stdout = _language_model(tmp_path, 2, batch=16)
    _check_trains(result, stdout, 2)
    one, _ = _language_model(tmp_path, 1, batch=32)
    assert result["losses"] == pytest.approx(one["losses"], rel=1e-3)

"""examples/arcface_torch_port.py (docs/from_partial_fc.md) runs as documented, one process and two under
torchrun, and its backbone's and head's learning rates equal arcface_torch's PolynomialLRWarmup step for
step (restated below in float64 as arcface_torch computes it: a linear warm-up from the base lr's
1/w, then each step's lr the previous one times a polynomial decay factor), its loss falls, every rank
writes its head shard each epoch, and a resumed run continues the schedule where it stopped."""
import json
import os
import subprocess

import pytest

from tests.example_launch import example_command

SMALL = ["--num_classes", "300", "--embedding_size", "32", "--batch_size", "32", "--num_image", "1024",
         "--warmup_epoch", "1", "--num_epoch", "3", "--frequent", "1000"]


def arcface_schedule(base: float, warmup: int, total: int, power: float, steps: int) -> list:
    """The lr of each of ``steps`` optimizer steps under arcface_torch's PolynomialLRWarmup (float64):
    step 0 keeps the optimizer's lr (its get_lr returns the group's lr at last_epoch 0), step t <= warmup
    is base * t / warmup, a later step multiplies the previous lr by
    ((1 - (t - w) / (T - w)) / (1 - (t - 1 - w) / (T - w))) ** power, and past T the lr stays."""
    lrs, lr = [], base
    for t in range(steps):
        if t == 0 or t > total:
            pass
        elif t <= warmup:
            lr = base * t / warmup
        else:
            lr = lr * ((1.0 - (t - warmup) / (total - warmup)) / (1.0 - (t - 1 - warmup) / (total - warmup))) ** power
        lrs.append(lr)
    return lrs


def _port(tmp_path, nproc, name, *args):
    out = tmp_path / f"{name}.json"
    cmd, env = example_command("arcface_torch_port", nproc)
    cmd += [*SMALL, "--output", str(tmp_path / "ckpt"), "--out", str(out), *args]
    proc = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0 or (out.exists() and "terminate called without an active exception" in proc.stderr), \
        proc.stdout[-3000:] + proc.stderr[-3000:]  # gloo's teardown abort after the work (tests/test_examples.py)
    assert "loss " in proc.stdout and "held-out top-1" in proc.stdout
    return json.loads(out.read_text()), proc.stdout


def _check_schedule(run, start=0):
    """The recorded lrs of steps start.. against the restatement; backbone and head alike."""
    want = arcface_schedule(run["lr"], run["warmup_step"], run["total_step"], run["power"], run["steps"][-1])
    assert run["steps"] == list(range(start + 1, start + len(run["steps"]) + 1))
    assert run["lr_backbone"] == pytest.approx(want[start:], rel=1e-9, abs=1e-15)
    assert run["lr_head"] == pytest.approx(want[start:], rel=1e-9, abs=1e-15)


@pytest.mark.slow
def test_port_one_process_follows_the_schedule_and_learns(tmp_path):
    run, stdout = _port(tmp_path, 0, "one")
    assert run["world_size"] == 1 and (run["warmup_step"], run["total_step"]) == (32, 96)
    _check_schedule(run)
    assert run["lr_head"][0] == run["lr"] and run["lr_head"][1] == pytest.approx(run["lr"] / 32)  # its quirk
    assert max(run["lr_head"]) == pytest.approx(run["lr"]) and run["lr_head"][-1] < 1e-3 * run["lr"]
    first, last = sum(run["loss"][:8]) / 8, sum(run["loss"][-8:]) / 8
    assert last < 0.75 * first, (first, last)
    for epoch in (1, 2, 3):
        assert (tmp_path / "ckpt" / f"epoch_{epoch}" / "ds_xc_head" / "shard_00000_of_00001.pt").is_file()
    assert (tmp_path / "ckpt" / "model.pt").is_file() and stdout.count("held-out top-1") == 1


@pytest.mark.slow
def test_port_two_ranks_power_one_resumes_the_schedule(tmp_path):
    args = ("--power", "1", "--sample_rate", "0.5", "--margin_list", "1.0,0.0,0.35")
    first, stdout = _port(tmp_path, 2, "first", *args, "--max_steps", "16")  # one epoch: 1024 // (32 * 2)
    assert stdout.count("held-out top-1") == 1  # rank 0 prints, the other rank does not
    assert first["world_size"] == 2 and (first["warmup_step"], first["total_step"]) == (16, 48)
    _check_schedule(first)
    for rank in (0, 1):  # one head shard per rank, as arcface_torch's checkpoint_gpu_{rank}.pt
        assert (tmp_path / "ckpt" / "epoch_1" / "ds_xc_head" / f"shard_0000{rank}_of_00002.pt").is_file()
    resumed, _ = _port(tmp_path, 2, "resumed", *args, "--resume")
    _check_schedule(resumed, start=16)  # the schedule continues from the checkpoint's step
    assert resumed["loss"][-1] < first["loss"][0]

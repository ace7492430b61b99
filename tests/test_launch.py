"""End to end: `deepspeed launch/train.py` on 1 and 2 CPU ranks, checkpoint and resume."""
import json
import os
import re
import subprocess
import sys

import pytest

from tests.dist_pool import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEEPSPEED = os.path.join(os.path.dirname(sys.executable), "deepspeed")


def _config(tmp_path, **head):
    cfg = {
        "csv_monitor": {"enabled": True, "output_path": str(tmp_path / "logs"), "job_name": "xc"},
        "train_micro_batch_size_per_gpu": 32, "gradient_clipping": 0.0, "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "torch_adam": True}},
        "extreme_classification": dict({"num_classes": 301, "embedding_dim": 32, "chunk_size": 16,
                                        "loss": {"type": "cosface", "scale": 30.0}}, **head),
        "xc_train": {"data": "synthetic", "max_steps": 6, "eval_every": 3, "eval_samples": 256,
                     "log_every": 2, "hidden_dim": 64},
    }
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _launch(args, nprocs=1, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [DEEPSPEED, "--master_port", str(free_port())]
    if nprocs > 1:
        cmd += ["--num_gpus", str(nprocs)]
    proc = subprocess.run(cmd + [os.path.join(ROOT, "launch", "train.py")] + args, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def _summary(out):
    m = re.search(r"done: (\d+) steps .* held-out top-1 ([0-9.]+) top-5 ([0-9.]+) \((\d+) samples\)", out)
    assert m, out[-3000:]
    return int(m.group(1)), float(m.group(2)), float(m.group(3)), int(m.group(4))


@pytest.mark.slow
def test_one_rank_trains_and_reports(tmp_path):
    out = _launch(["--deepspeed_config", _config(tmp_path)])
    steps, top1, top5, n = _summary(out)
    assert steps == 6 and n == 256 and 0.0 <= top1 <= top5 <= 1.0
    assert out.count("done:") == 1  # printed by rank 0 only
    logs = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "logs") for f in fs]
    names = " ".join(os.path.basename(f) for f in logs)
    assert "Train_loss" in names and "Eval_top1" in names, names


@pytest.mark.slow
def test_two_ranks_checkpoint_and_resume(tmp_path):
    cfg = _config(tmp_path, sampler={"type": "uniform", "sample_rate": 0.5}, optimizer={"update": "lazy"})
    save = str(tmp_path / "ckpt")
    out = _launch(["--deepspeed_config", cfg, "--max_steps", "4", "--save_dir", save], nprocs=2)
    assert _summary(out)[0] == 4 and out.count("done:") == 1
    assert os.path.isfile(os.path.join(save, "step4", "ds_xc_head", "shard_00001_of_00002.pt"))
    out = _launch(["--deepspeed_config", cfg, "--max_steps", "6", "--save_dir", save, "--resume"], nprocs=2)
    assert "resumed from" in out and "at step 4" in out
    assert _summary(out)[0] == 2

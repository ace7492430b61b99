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


@pytest.mark.slow
def test_two_ranks_gradient_compression_section(tmp_path):
    """A `gradient_compression` section is attached by ds_xc.initialize: traffic is counted, the
    per-rank residuals are checkpointed next to the head shards and restored on resume."""
    cfg = json.loads(open(_config(tmp_path)).read())
    cfg["gradient_compression"] = {"method": "topk", "density": 0.02, "min_numel": 1000}
    path = tmp_path / "cfg_comp.json"
    path.write_text(json.dumps(cfg))
    save, summary = str(tmp_path / "ckpt"), str(tmp_path / "summary.json")
    out = _launch(["--deepspeed_config", str(path), "--max_steps", "4", "--save_dir", save,
                   "--summary_json", summary], nprocs=2)
    assert "gradient compression (topk)" in out
    stats = json.loads(open(summary).read())["compression_stats"]
    assert stats["steps"] == 4 and 0 < stats["bytes_sent"] < 0.5 * stats["dense_bytes"]
    files = os.listdir(os.path.join(save, "step4", "ds_xc_compression"))
    assert sorted(files) == ["rank_00000_of_00002.pt", "rank_00001_of_00002.pt"], files
    out = _launch(["--deepspeed_config", str(path), "--max_steps", "6", "--save_dir", save, "--resume",
                   "--summary_json", summary], nprocs=2)
    assert "at step 4" in out and "start from zero" not in out
    assert json.loads(open(summary).read())["compression_stats"]["steps"] == 6


def test_compression_with_zero_stage_1_is_refused_before_the_engine_is_built():
    from ds_xc import ConfigError
    from ds_xc.engine import check_supported
    raw = {"zero_optimization": {"stage": 1}, "gradient_compression": {"method": "topk"},
           "extreme_classification": {"num_classes": 10, "embedding_dim": 4}}
    with pytest.raises(ConfigError, match=r"zero_optimization.stage=1 with gradient_compression.method='topk'"):
        check_supported(raw)
    check_supported(dict(raw, gradient_compression={"method": "none"}))

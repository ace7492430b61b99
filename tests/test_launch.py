"""End to end: `deepspeed launch/train.py` on 1 and 2 CPU ranks, checkpoint and resume."""
import json
import os
import re
import subprocess
import sys

import pytest

from tests.dist_pool import free_port
from tests.train_procs import run_ranks

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


def _direct(args, nprocs=1):
    """The same job with its ranks started directly (tests/train_procs.py): the launcher is tested above."""
    return run_ranks(args, world=nprocs, timeout=300)


def _summary(out):
    m = re.search(r"done: (\d+) steps .* held-out top-1 ([0-9.]+) top-5 ([0-9.]+) \((\d+) samples\)", out)
    assert m, out[-3000:]
    return int(m.group(1)), float(m.group(2)), float(m.group(3)), int(m.group(4))


def _dense_topk(cfg_path, tag_dir, samples):
    """Held-out (top-1, top-5) recomputed without the head: the saved backbone and head rows, the
    data set's held-out batches, float64 cosine scores against all classes, torch.topk."""
    import torch
    import torch.nn.functional as F

    import ds_xc
    from ds_xc.data import build_dataset
    from ds_xc.engine import load_raw_config
    from ds_xc.models import build_backbone
    cfg = ds_xc.parse_config(load_raw_config(cfg_path))
    hcfg, tcfg = cfg.extreme_classification, cfg.xc_train
    data = build_dataset(tcfg.data, hcfg.num_classes, seed=tcfg.seed)
    backbone = build_backbone(data, hcfg.embedding_dim, hidden_dim=tcfg.hidden_dim)
    states = torch.load(os.path.join(tag_dir, "mp_rank_00_model_states.pt"), weights_only=False)
    backbone.load_state_dict(states["module"])
    backbone.eval()
    shard = torch.load(os.path.join(tag_dir, "ds_xc_head", "shard_00000_of_00001.pt"), weights_only=True)
    w = F.normalize(shard["head"]["weight"].double(), dim=1)  # (C, d), all classes on one rank
    hits1 = hits5 = n = 0
    with torch.no_grad():
        for x, y in data.eval_batches(32, 0, 1, samples):
            top = torch.topk(F.normalize(backbone(x).double(), dim=1) @ w.t(), 5, dim=1).indices  # (B, 5)
            hits1 += int((top[:, 0] == y).sum())
            hits5 += int((top == y[:, None]).any(dim=1).sum())
            n += y.numel()
    return hits1 / n, hits5 / n, n


@pytest.mark.slow
def test_one_rank_trains_and_reports(tmp_path):
    cfg = _config(tmp_path)
    save, summary = str(tmp_path / "ckpt"), str(tmp_path / "summary.json")
    out = _launch(["--deepspeed_config", cfg, "--save_dir", save, "--summary_json", summary])
    steps, top1, top5, n = _summary(out)
    assert steps == 6 and n == 256
    with open(summary) as fh:
        report = json.load(fh)
    ref1, ref5, ref_n = _dense_topk(cfg, os.path.join(save, "step6"), 256)
    assert ref_n == n and abs(top1 - report["top1"]) < 1e-4 and abs(top5 - report["top5"]) < 1e-4
    # float32 scores in the run, float64 here: allow one sample whose top-5 boundary is a near tie
    assert abs(report["top1"] - ref1) <= 1 / n and abs(report["top5"] - ref5) <= 1 / n, (report, ref1, ref5)
    assert ref5 > 0.05  # above chance (5/301): the check compares a trained model, not zeros
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
    out = _direct(["--deepspeed_config", cfg, "--max_steps", "6", "--save_dir", save, "--resume"], nprocs=2)
    assert "resumed from" in out and "at step 4" in out
    assert _summary(out)[0] == 2


@pytest.mark.slow
def test_two_ranks_gradient_compression_section(tmp_path):
    """A `gradient_compression` section is attached by ds_xc.initialize: traffic is counted, the
    per-rank residuals are checkpointed next to the head shards and restored on resume."""
    cfg = json.loads(open(_config(tmp_path)).read())
    cfg["gradient_compression"] = {"method": "topk", "density": 0.02, "min_numel": 1000, "warmup_steps": 1}
    path = tmp_path / "cfg_comp.json"
    path.write_text(json.dumps(cfg))
    save, summary = str(tmp_path / "ckpt"), str(tmp_path / "summary.json")
    out = _direct(["--deepspeed_config", str(path), "--max_steps", "4", "--save_dir", save,
                   "--summary_json", summary], nprocs=2)
    assert "gradient compression (topk)" in out
    stats = json.loads(open(summary).read())["compression_stats"]
    assert stats["steps"] == 4 and 0 < stats["bytes_sent"] < 0.5 * stats["dense_bytes"]
    files = os.listdir(os.path.join(save, "step4", "ds_xc_compression"))
    assert sorted(files) == ["rank_00000_of_00002.pt", "rank_00001_of_00002.pt"], files
    out = _direct(["--deepspeed_config", str(path), "--max_steps", "6", "--save_dir", save, "--resume",
                   "--summary_json", summary], nprocs=2)
    assert "at step 4" in out and "start from zero" not in out
    assert json.loads(open(summary).read())["compression_stats"]["steps"] == 6


def test_compression_with_zero_stage_2_is_refused_before_the_engine_is_built():
    from ds_xc import ConfigError
    from ds_xc.engine import check_supported
    raw = {"zero_optimization": {"stage": 2}, "gradient_compression": {"method": "topk"},
           "extreme_classification": {"num_classes": 10, "embedding_dim": 4}}
    with pytest.raises(ConfigError, match=r"zero_optimization.stage=2 with gradient_compression.method='topk'"):
        check_supported(raw)
    check_supported(dict(raw, zero_optimization={"stage": 1}))  # ZeRO-1 takes the compressed mean
    check_supported(dict(raw, gradient_compression={"method": "none"}))

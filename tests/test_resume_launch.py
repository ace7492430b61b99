"""launch/train.py --resume: what it refuses, and where the data stream goes on (issue 59).

* ``--resume`` with a ``--max_steps`` below the checkpoint's step stops with an error naming
  both numbers, before any step or save: ``latest`` and every file of the checkpoint unchanged
  (it used to run "-2 steps" and save the step-4 weights under the tag step2).
* ``--resume`` on a mistyped folder or one without a checkpoint is an error naming the folder;
  ``--resume auto`` starts from step 0 there, and says so.
* The data stream's position (global samples consumed) is in the checkpoint: after a reshard
  from 2 ranks to 1 the resumed job continues at sample 64 = 4 steps x 8 x 2 ranks, where the
  first job stopped (neither replaying nor skipping samples).
"""
import hashlib
import json
import os
import subprocess
import sys

import pytest

from tests.train_procs import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MICRO = 8


def _config(tmp_path):
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0, "steps_per_print": 10**6,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "torch_adam": True}},
           "extreme_classification": {"num_classes": 101, "embedding_dim": 16,
                                      "sampler": {"type": "uniform", "sample_rate": 0.5}},
           "xc_train": {"data": "synthetic", "max_steps": 4, "eval_every": 0, "eval_samples": 16,
                        "log_every": 1000, "hidden_dim": 16, "save_every": 2}}
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _digests(folder):
    return {os.path.relpath(os.path.join(d, f), folder): hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()
            for d, _, files in os.walk(folder) for f in files}


@pytest.mark.slow
def test_resume_refuses_a_smaller_max_steps_and_a_missing_checkpoint_and_keeps_the_data_position(tmp_path):
    cfg, save = _config(tmp_path), str(tmp_path / "ckpt")
    first = str(tmp_path / "first.json")
    run_ranks(["--deepspeed_config", cfg, "--save_dir", save, "--summary_json", first], world=2)
    assert json.load(open(first))["data_samples"] == {"start": 0, "end": 4 * MICRO * 2}
    before = _digests(save)
    assert open(os.path.join(save, "latest")).read() == "step4"

    out = run_ranks(["--deepspeed_config", cfg, "--save_dir", save, "--resume", "--max_steps", "2"], world=2, ok=False)
    assert "is at step 4, past max_steps=2" in out and "Nothing was run or saved" in out, out[-3000:]
    assert _digests(save) == before  # latest still step4, step2 and step4 untouched

    typo = str(tmp_path / "ckpt_typo")
    out = run_ranks(["--deepspeed_config", cfg, "--save_dir", typo, "--resume"], ok=False)
    assert f"no checkpoint in --save_dir {typo!r} (the folder does not exist)" in out, out[-3000:]
    assert "--resume auto" in out and not os.path.exists(typo)
    empty = tmp_path / "empty"
    empty.mkdir()
    out = run_ranks(["--deepspeed_config", cfg, "--save_dir", str(empty), "--resume", "--max_steps", "1"], ok=False)
    assert "(it holds no 'latest')" in out
    out = run_ranks(["--deepspeed_config", cfg, "--save_dir", str(empty), "--resume", "auto", "--max_steps", "1"])
    assert "--resume auto: no checkpoint in" in out and "starting from step 0" in out
    assert open(empty / "latest").read() == "step1"

    # reshard 2 -> 1 rank, resume: the stream continues at sample 64 (the step alone would say 4 x 8 x 1 = 32)
    resharded = str(tmp_path / "ckpt_p1")
    subprocess.run([sys.executable, os.path.join(ROOT, "launch", "reshard.py"), "--load_dir", save, "--world_size",
                    "1", "--out_dir", resharded], check=True, capture_output=True, cwd=ROOT, timeout=300)
    second = str(tmp_path / "second.json")
    out = run_ranks(["--deepspeed_config", cfg, "--save_dir", resharded, "--resume", "--max_steps", "5",
                     "--summary_json", second])
    assert "at step 4, data stream at sample 64 (another world size" in out, out[-3000:]
    assert json.load(open(second))["data_samples"] == {"start": 64, "end": 64 + MICRO}

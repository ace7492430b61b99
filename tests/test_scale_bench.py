"""The measurement path of benchmarks/scale_classes.py at a small scale: launch/train.py on 2 ranks
reports each rank's memory milestones, step time and index build time (the summary's ``ranks``),
and the memory model, given the process baseline, predicts what the ranks hold.

The baseline comes from the run's own RSS after setup, less the head shard and the backbone the
model counts (benchmarks/scale_classes.py takes it from a separate calibration run). At 10^5
classes the shard (25.6 MB per rank) and its SGD momentum are small next to the process (about
0.4 GiB), so the check of the persistent memory after training is within 15% of a number that is
mostly the baseline: what it does check is that every component is counted once and nothing large
is missed (the momentum, the index, a dense gradient would each move it); the tensor-level
agreement is tests/test_cost_memory.py's. The growth from setup to the end of training must cover
the modelled optimizer state and index (the allocator's retention only adds to it).
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from scale_classes import baselines, launch, raw_config, rows  # noqa: E402

CONFIG = "configs/synthetic_1e7.json"
SETS = ["train_micro_batch_size_per_gpu=32", "xc_train.eval_samples=128", "xc_train.hidden_dim=64"]


@pytest.mark.slow
def test_measured_memory_matches_the_model_on_two_ranks():
    res, wall, tree_peak, cmd = launch(CONFIG, 2, 100_000, 6, SETS, timeout=600)
    assert res["world_size"] == 2 and res["steps"] == 6 and len(res["ranks"]) == 2
    raw = raw_config(CONFIG, SETS)
    base = baselines(raw, res)
    table = rows(raw, res, base)
    for t in table:
        mem, est = t["mem"], t["est"]
        assert t["L"] == 50_000
        assert mem["baseline"] < mem["after_setup"] <= mem["after_training"] <= mem["training_peak"] <= mem["peak"]
        assert mem["after_setup"] - mem["baseline"] >= est.persistent["head_weight"]  # the shard is resident
        grown = mem["after_training"] - mem["after_setup"]
        modelled = est.persistent_bytes - t["setup_model"]  # optimizer state, index, lazy_exact, backbone state
        assert modelled >= est.persistent["head_optimizer"] > 0
        assert grown >= 0.9 * modelled, (grown, modelled)
        assert mem["after_training"] == pytest.approx(est.persistent_bytes, rel=0.15)
        assert mem["peak"] == pytest.approx(est.peak_bytes, rel=0.15)
        assert t["step_s"] > 0 and len(t["build_s"]) == 1 and t["build_s"][0] > 0  # built once (rebuild_interval 0)
    assert tree_peak >= sum(t["mem"]["after_training"] for t in table)
    assert 0.0 <= res["top1"] <= res["top5"] <= 1.0

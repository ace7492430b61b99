"""launch/bench.py: argument checks and the sizes each part runs at (the parts themselves are
benchmarks, run by hand; their plumbing by ``python launch/bench.py report --smoke``)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch"))
import bench  # noqa: E402


def test_unknown_parts_and_bad_scale_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["report", "--parts", "samplers,nope"])
    assert "unknown ['nope']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["report", "--scale", "0"])
    assert "--scale=0.0 is invalid" in capsys.readouterr().err


def test_sizes_scale_and_text_classes_are_capped_by_the_vocabulary():
    one = bench.sizes(bench.parse_args(["report"]))
    four = bench.sizes(bench.parse_args(["report", "--scale", "4"]))
    assert four["steps"] == 4 * one["steps"] and four["synthetic_classes"] == 4 * one["synthetic_classes"]
    assert four["text_classes"] == one["text_classes"] == 20_000
    assert four["head_classes"] == [4 * c for c in one["head_classes"]]
    smoke = bench.sizes(bench.parse_args(["report", "--smoke"]))
    assert smoke["steps"] < one["steps"] and max(smoke["head_classes"]) < min(one["head_classes"])


def test_head_case_counts_the_kept_tensors():
    """part head's per-process measurement: persistent memory is weights + momentum (+ index)."""
    exact = bench.head_case(3000, "exact chunked", 0, batch=64, dim=32)
    assert exact["persistent_mib"] == pytest.approx(2 * 3000 * 32 * 4 / 2**20)  # weight + momentum
    assert exact["peak_mib"] >= 0
    ann = bench.head_case(3000, "ann 0.1 (lazy)", 0, batch=64, dim=32)
    assert ann["persistent_mib"] > exact["persistent_mib"]  # + the index (codes, lists, projection)


def test_head_case_step_time_is_the_best_of_steps_3_to_5(monkeypatch):
    """step_s against the clock: with a scripted clock it is exactly the smallest of the last three
    step durations (not the warm-up steps, not the mean); with the real clock three timed steps fit
    in the wall time of the whole call, so step_s <= wall / 3."""
    import time
    import types
    durations = [1.0, 4.0, 3.0, 7.0, 5.0]  # min of all: 1 (warm-up), mean of steps 3-5: 5, best of 3-5: 3
    ticks = iter([v for i, d in enumerate(durations) for v in (10.0 * i, 10.0 * i + d)])
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    scripted = bench.head_case(500, "exact chunked", 0, batch=16, dim=8)
    assert scripted["step_s"] == 3.0
    monkeypatch.setattr(bench, "time", time)
    t = time.perf_counter()
    real = bench.head_case(3000, "exact chunked", 0, batch=64, dim=32)
    wall = time.perf_counter() - t
    assert 0 < 3 * real["step_s"] <= wall, (real["step_s"], wall)

"""The tuner (launch/tune.py, ds_xc/tune) and the time model (ds_xc/cost/compute.py).

* the time model's work counts against hand-worked values (full, uniform and ann heads, 1 and 2
  ranks, head-wide scan budgets);
* config in, config out: only the tuned keys change, every other key is kept, the output parses;
  the tuner never writes over its input;
* an impossible target is a TargetUnreachable naming the tightest constraint and the closest
  candidate (a real run on a small head);
* an interrupted run resumes from its cache: the measurements made before the interruption are
  reused, not repeated, and the choice equals an uninterrupted run's.
"""
from __future__ import annotations

import copy
import json
import math
import os

import pytest
import torch

import ds_xc
from ds_xc.cost.compute import Constants, distinct_rows, head_work, predict_step_time, shape_of
from ds_xc.tune import TUNED_KEYS, Candidate, Target, TargetUnreachable, apply, changed_keys, tune, write_config
from ds_xc.tune import session as tune_session


def _raw(num_classes=1000, dim=16, sampler=None, micro=64, loss="cosface", **head):
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.002}}, "zero_optimization": {"stage": 0},
            "extreme_classification": dict({"num_classes": num_classes, "embedding_dim": dim,
                                             "loss": {"type": loss}, "sampler": sampler or {"type": "full"},
                                             "chunk_size": 32, "optimizer": {"type": "sgd", "lr": 0.1}}, **head),
            "xc_train": {"data": "synthetic", "max_steps": 10}}


# ----------------------------------------------------------------------------- the time model's counts
def test_full_head_flops_by_hand():
    w = head_work(shape_of(_raw(), world_size=1))
    assert w["loss_flops"] == 6 * 64 * 1000 * 16  # forward 2NLd + backward 4NLd
    assert w["loss_elems"] == 64 * 1000
    assert w["update_elems"] == 1000 * 16  # auto -> dense for the full sampler
    assert w["gather_bytes"] == 0 and w["scan_rowq"] == 0 and w["comm_bytes"] == 0
    w2 = head_work(shape_of(_raw(), world_size=2))  # N = 64 x 2 rows, L = 500 per rank
    assert w2["loss_flops"] == 6 * 128 * 500 * 16
    # ds_xc/cost/comm.py's collectives: the input check, the embedding and label gathers, one
    # all-gather of (32, 3) float32 row statistics per chunk (128 rows in chunks of 32), the
    # gradient's reduce-scatter
    assert w2["collectives"] == 4 + 4
    assert w2["comm_bytes"] == 72 * 2 + 2 * 128 * 16 * 4 + 128 * 8 + 4 * (2 * 32 * 3 * 4)


def test_uniform_head_flops_by_hand():
    raw = _raw(sampler={"type": "uniform", "sample_rate": 0.1})
    w = head_work(shape_of(raw, world_size=1))
    assert w["loss_flops"] == 6 * 64 * 100 * 16  # K = ceil(0.1 * 1000)
    assert w["update_elems"] == 100 * 16  # lazy_exact (auto): the K active rows
    assert w["catchup_elems"] == 100 * 16
    assert w["gather_bytes"] == 2 * 100 * 16 * 4


def test_ann_head_counts_by_hand():
    sampler = {"type": "ann", "sample_rate": 0.1, "nprobe": 2, "scan_rows": 256, "code_bits": 64, "top_k": 16,
               "rebuild_interval": 100, "kmeans_iterations": 5}
    shape = shape_of(_raw(sampler=sampler), world_size=2)
    L = 500
    nlist = round(math.sqrt(L))  # 22
    assert (shape.L, shape.K, shape.nlist) == (L, 50, nlist)
    assert shape.S == max(math.ceil(256 * L / 1000), math.ceil(2 * L / nlist)) == 128
    assert shape.R == max(16, math.ceil(256 * L / 1000)) == 128  # head-wide rerank 256: this shard's half
    w = head_work(shape)
    N = 128
    assert w["encode_flops"] == 2 * N * 16 * 64
    assert w["probe_flops"] == 2 * N * nlist * 16
    assert w["scan_rowq"] == N * 128 * 64 / 512
    assert w["rerank_flops"] == 2 * N * 128 * 16 and w["rerank_bytes"] == N * 128 * 16 * 4
    assert w["catchup_elems"] == pytest.approx(50 * 16 + distinct_rows(L, N * 128) * 16)
    per_build = 5 * 2 * min(L, 64 * nlist) * nlist * 16 + 2 * L * nlist * 16 + 2 * L * 16 * 64
    assert w["rebuild_flops"] == pytest.approx(per_build / 100)
    # re-encoded (encode_rows retrieved): the positives D(L, N) and the kept retrieved rows, at most
    # retrieved_share (0.5) of the room the positives leave, all capped at the U = 50 active rows
    pos = distinct_rows(L, N)
    assert w["reencode_flops"] == pytest.approx(2 * min(50, pos + min(distinct_rows(L, N * 16), math.ceil(
        0.5 * max(50 - pos, 0)))) * 16 * 64)
    # plain softmax: the MIPS reduction codes d + 1 dims
    assert shape_of(_raw(sampler=sampler, loss="softmax"), world_size=2).d_code == 17


def test_distinct_rows_and_predicted_parts():
    assert distinct_rows(1000, 0) == 0
    assert distinct_rows(1000, 1) == pytest.approx(1.0, rel=1e-3)
    assert distinct_rows(1000, 1e6) == pytest.approx(1000)
    c = Constants(matmul_s_per_flop=1.0, loss_s_per_flop=1e-9, elem_s=0.0, gather_s_per_byte=0.0,
                  overhead_s={"full": 0.5}, comm_alpha_s=1e-3, comm_s_per_byte=2e-9)
    st = predict_step_time(_raw(), world_size=1, constants=c)
    assert st.parts["loss"] == pytest.approx(6 * 64 * 1000 * 16 * 1e-9)  # the loss's own rate
    assert st.parts["overhead"] == 0.5 and st.parts["comm"] == 0.0
    assert st.total_s == pytest.approx(sum(st.parts.values()))
    # 2 ranks: ring steps of 1 ms each plus 2 ns per byte of a step (half the buffer with P = 2):
    # input check 2 steps of 144 B, the gathers 1 step each (of 128 x 16 x 4 and 128 x 8 B), 4 chunks
    # of 1 all-gather (1 step of 32 x 3 x 4 B), the gradient's reduce-scatter (gloo: an all-reduce,
    # 2 steps of 128 x 16 x 4 B)
    st2 = predict_step_time(_raw(), world_size=2, constants=c)
    steps = 2 + 1 + 1 + 4 * 1 + 2
    step_bytes = (2 * 144 + 128 * 16 * 4 + 128 * 8 + 4 * (2 * 32 * 3 * 4) + 2 * 128 * 16 * 4) / 2
    assert st2.parts["comm"] == pytest.approx(steps * 1e-3 + step_bytes * 2e-9)


# ----------------------------------------------------------------------------- config in, config out
def test_apply_changes_only_tuned_keys():
    raw = _raw(sampler={"type": "ann", "sample_rate": 0.2, "top_k": 32, "groups": 2}, init_std=0.02)
    raw["custom_user_key"] = {"kept": [1, 2, 3]}
    before = copy.deepcopy(raw)
    cand = Candidate(type="ann", sample_rate=0.05, scan_rows=8192, rerank=128, code_bits=256, update="lazy")
    out = apply(raw, cand)
    assert raw == before  # the input dict is not modified
    allowed = {f"extreme_classification.{k}" for k in TUNED_KEYS}
    assert set(changed_keys(raw, out)) <= allowed
    assert out["extreme_classification"]["sampler"]["top_k"] == 32  # untuned sampler keys kept
    assert out["extreme_classification"]["sampler"]["groups"] == 2
    assert out["custom_user_key"] == {"kept": [1, 2, 3]} and out["optimizer"] == raw["optimizer"]
    parsed = ds_xc.parse_config(json.loads(json.dumps(out))).extreme_classification
    assert (parsed.sampler.sample_rate, parsed.sampler.scan_rows, parsed.sampler.code_bits) == (0.05, 8192, 256)
    assert parsed.optimizer.update == "lazy"
    # a type change drops the keys the new sampler does not have; defaults: tuned keys removed
    uni = apply(raw, Candidate(type="uniform", sample_rate=0.1))
    assert uni["extreme_classification"]["sampler"] == {"type": "uniform", "sample_rate": 0.1}
    assert "update" not in uni["extreme_classification"]["optimizer"]
    assert set(changed_keys(raw, uni)) <= allowed | {"extreme_classification.sampler.top_k",
                                                     "extreme_classification.sampler.groups"}


def test_write_config_never_overwrites_input(tmp_path):
    src = tmp_path / "in.json"
    src.write_text(json.dumps(_raw()))
    with pytest.raises(ValueError, match="never overwrites"):
        write_config(_raw(num_classes=5), str(src), str(src))
    link = tmp_path / "link.json"
    link.symlink_to(src)
    with pytest.raises(ValueError, match="never overwrites"):
        write_config(_raw(num_classes=5), str(link), str(src))
    assert json.loads(src.read_text()) == _raw()


# ----------------------------------------------------------------------------- real tuner runs (small)
def _inputs(num_classes, dim, batch, seed=0):
    gen = torch.Generator().manual_seed(seed)
    protos = torch.nn.functional.normalize(torch.randn(num_classes, dim, generator=gen), dim=1)

    def draw(n):
        y = torch.randint(0, num_classes, (n,), generator=gen)
        return protos[y] + 0.3 * torch.randn(n, dim, generator=gen), y
    train = [draw(batch) for _ in range(8)]
    held = [draw(batch)]
    return (lambda i: train[i % len(train)]), (lambda: iter(held))


def _constants_file(tmp_path) -> str:
    path = str(tmp_path / "constants.json")
    c = Constants(threads=torch.get_num_threads(), machine=os.uname().nodename)
    with open(path, "w") as fh:
        json.dump(c.to_json(), fh)
    return path


@pytest.fixture
def small_grid(monkeypatch):
    """A 13-candidate space (ANN: 2 rates x 2 scans x 2 update modes; uniform: 2 rates x 2 modes) for the
    real runs. Which candidates the tuner measures depends on measured step times (the stop rule skips
    those predicted slower than 1.5x the best measurement), so on a loaded machine, where every
    measurement is slower, it measured up to all 115 of the full space: 219 s for one test in the suite
    against 6 s alone. What these tests check (parsing, the choice rule, the cache, the probe) needs no
    more."""
    from ds_xc.tune import space
    monkeypatch.setattr(space, "SAMPLE_RATES", (0.05, 0.1))
    monkeypatch.setattr(space, "SCAN_ROWS", (8192, 16384))
    monkeypatch.setattr(space, "RERANKS", (64,))
    monkeypatch.setattr(space, "CODE_BITS", (256,))


def _run(tmp_path, target, **kw):
    raw = _raw(num_classes=3000, dim=16, micro=64, sampler={"type": "ann"})
    train, held = _inputs(3000, 16, 64)
    return raw, tune(raw, target, train, held, world=1, cache_path=str(tmp_path / "cache.json"),
                     constants_path=_constants_file(tmp_path), steps=1, warmup=1, pretrain_steps=4,
                     types=("ann", "uniform"), **kw)


@pytest.mark.slow
def test_tuner_output_parses_and_keeps_other_keys(small_grid, tmp_path):
    raw, res = _run(tmp_path, Target(min_recall=0.2, max_memory_gib=4.0), time_budget_s=3.0)
    out = res.chosen.config
    ds_xc.parse_config(out)
    assert set(changed_keys(raw, out)) <= {f"extreme_classification.{k}" for k in TUNED_KEYS}
    assert res.chosen.measured["recall"] >= 0.2
    measured = [r for r in res.rows if r.measured]
    assert res.base is not None and res.base in measured  # the defaults are always measured
    assert res.chosen.measured["amortised_s"] == min(r.measured["amortised_s"] for r in measured
                                                    if r.measured["recall"] >= 0.2)


def test_impossible_target_names_tightest_constraint(small_grid, tmp_path):
    with pytest.raises(TargetUnreachable) as info:
        _run(tmp_path, Target(max_memory_gib=1e-6, min_recall=0.2), time_budget_s=3.0)
    msg = str(info.value)
    assert "max_memory_gib is the tightest constraint" in msg
    assert info.value.closest is not None and info.value.closest.cand.label() in msg
    assert "GiB per rank >" in msg


@pytest.mark.slow
def test_interrupted_run_resumes_from_cache(small_grid, tmp_path, monkeypatch):
    from ds_xc.tune import tuner as tuner_module
    monkeypatch.setattr(tuner_module, "STOP_FACTOR", 1e9)  # no stop by prediction: at least 3 measurements
    real = tune_session.measure_candidate
    calls = []

    def interrupted(*a, **k):
        if len(calls) == 2:
            raise KeyboardInterrupt  # the run is killed during its third measurement
        calls.append(1)
        return real(*a, **k)
    monkeypatch.setattr(tune_session, "measure_candidate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, Target(min_recall=0.2), time_budget_s=60.0)
    cache = json.loads((tmp_path / "cache.json").read_text())
    (slot,) = cache.values()
    assert len(slot["measurements"]) == 2 and slot["screen"]
    first_two = dict(slot["measurements"])
    counted = []

    def counting(*a, **k):
        counted.append(1)
        return real(*a, **k)
    monkeypatch.setattr(tune_session, "measure_candidate", counting)
    _, res = _run(tmp_path, Target(min_recall=0.2), time_budget_s=60.0)
    measured = [r for r in res.rows if r.measured is not None]
    reused = [r for r in measured if r.cand.key() in first_two]
    assert {r.cand.key() for r in reused} == set(first_two)
    for r in reused:  # the cached values themselves, not new measurements
        assert r.measured["step_s"] == first_two[r.cand.key()]["step_s"]
    assert len(counted) == len(measured) - len(reused)  # only the others were measured again


@pytest.mark.slow
def test_launch_tune_end_to_end(tmp_path):
    """launch/tune.py on a 2,000-class synthetic head: exit 0, the tuned JSON parses and differs from
    the input only in tuned keys, the input file is unchanged, report and table are written; --out
    naming the input is refused."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    raw = _raw(num_classes=2000, dim=16, micro=32, sampler={"type": "ann"})
    src = tmp_path / "in.json"
    src.write_text(json.dumps(raw, indent=1))
    before = src.read_bytes()
    cache = tmp_path / "cache"
    cache.mkdir()
    c = Constants(threads=1, machine=os.uname().nodename)
    (cache / "tune_constants.json").write_text(json.dumps(c.to_json()))
    env = dict(os.environ, DS_XC_CACHE=str(cache), OMP_NUM_THREADS="1")
    cmd = [sys.executable, os.path.join(root, "launch", "tune.py"), "--deepspeed_config", str(src), "--min_recall",
           "0.05", "--time_budget_s", "2", "--pretrain_steps", "2", "--steps", "1", "--warmup", "1",
           "--samplers", "ann,uniform", "--probe_steps", "8", "--probe_eval_batches", "4", "--max_probes", "1",
           "--out", str(tmp_path / "out.json")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "chosen:" in done.stdout and "tuner wall time" in done.stdout
    out = json.loads((tmp_path / "out.json").read_text())
    ds_xc.parse_config(out)
    assert set(changed_keys(raw, out)) <= {f"extreme_classification.{k}" for k in TUNED_KEYS}
    assert src.read_bytes() == before
    assert "Chosen:" in (tmp_path / "out.report.md").read_text()
    refused = subprocess.run(cmd[:-1] + [str(src)], env=env, capture_output=True, text=True, timeout=600)
    assert refused.returncode != 0 and "never overwrites" in refused.stderr
    assert src.read_bytes() == before


def test_tune_train_benchmark_lists_exactly_the_changed_keys():
    """benchmarks/tune_train.py reports which keys the tuner changed: nested, added and removed keys,
    and nothing that stayed equal."""
    from benchmarks.tune_train import tuned_changes
    before = {"a": 1, "ec": {"sampler": {"type": "ann"}, "optimizer": {"lr": 0.1}}, "keep": [1, 2]}
    after = {"a": 1, "ec": {"sampler": {"type": "ann", "sample_rate": 0.05}, "optimizer": {"lr": 0.2}},
             "keep": [1, 2], "new": True}
    assert tuned_changes(before, after) == [("ec.optimizer.lr", 0.1, 0.2), ("ec.sampler.sample_rate", None, 0.05),
                                            ("new", None, True)]
    assert tuned_changes(before, before) == []


# ----------------------------------------------------------------------------- the accuracy probe
def _row(label, step_s, recall=0.95, tag="", rate=0.1, update="lazy_exact"):
    from ds_xc.tune.tuner import Row
    cand = Candidate(type="ann", sample_rate=None if tag else rate, update=None if tag else update, tag=tag,
                     scan_rows=None if tag else {"a": 8192, "b": 8192, "c": 16384}.get(label, 8192))
    return Row(cand=cand, config={}, pred_s=step_s, pred_persistent=None, pred_peak=None, status="measured",
               measured={"amortised_s": step_s, "recall": recall, "peak_bytes": 1 << 20})


def _probed(top1, base_top1, tag=""):
    """A probe result as probe_accuracy gives it: the defaults' own, or a candidate's paired drop."""
    if tag == "defaults":
        return {"top1": top1, "top5": 0.3, "samples": 100, "steps": 5}
    return {"top1": top1, "top5": 0.3, "samples": 100, "steps": 5, "base_top1": base_top1,
            "drop": base_top1 - top1, "se": 0.005, "discordant": [1, 0], "verdict": "all samples"}


def test_probe_order_rejection_and_choice():
    """The defaults are probed first, then the fastest candidates meeting the other constraints; a
    candidate more than max_accuracy_drop below the defaults' probe is rejected, one no stronger than
    a rejected one is skipped without a probe, the first that passes is chosen; one that was never
    probed cannot be chosen."""
    from ds_xc.tune.tuner import Tuner, choose
    base = _row("defaults", 1.0, tag="defaults")
    a = _row("a", 0.3, rate=0.02)            # fastest: probed, too inaccurate
    b = _row("b", 0.35, rate=0.02)           # no stronger than a (same knobs): skipped
    low = _row("low", 0.36, recall=0.5)       # misses min_recall: never probed
    c = _row("c", 0.5, rate=0.05)             # stronger: probed, within the allowed drop: chosen
    d = _row("d", 0.6, rate=0.1)              # slower than c: not probed
    rows = [base, a, b, low, c, d]
    scores = {"defaults": 0.200, "a": 0.150, "c": 0.198}
    calls = []

    def probe(row):
        name = "defaults" if row.cand.tag else "abcd"[[a, b, c, d].index(row)]
        calls.append(name)
        return _probed(scores[name], scores["defaults"], row.cand.tag)
    target = Target(min_recall=0.9, max_accuracy_drop=0.0025)
    Tuner(rows, target, measure=None, cache=None, time_budget_s=1.0).probe(probe, max_probes=3)
    assert calls == ["defaults", "a", "c"]
    assert a.status.endswith("probe: lower accuracy") and "probe skipped: no stronger than" in b.status
    assert d.probe is None and low.probe is None
    assert choose(rows, target) is c
    # a drop of 0.2 point allowed no more: c is rejected too and, nothing else probed, the defaults win
    for r in rows:
        r.probe, r.status = None, "measured"
    scores["c"] = 0.1970
    calls.clear()
    Tuner(rows, target, measure=None, cache=None, time_budget_s=1.0).probe(probe, max_probes=2)
    assert calls == ["defaults", "a", "c"] and choose(rows, target) is base
    fails = target.failures(c, 1.0)
    assert fails and fails[0][0] == "max_accuracy_drop"
    assert "0.30 +- 0.50 point below the defaults' 0.2000 on the same 100 held-out samples" in fails[0][2]
    assert target.failures(d, 1.0)[0][2] == "accuracy not probed"


def test_probe_accuracy_equals_a_dense_float64_reference():
    """probe_accuracy trains the section's head from its seeded weights and scores held-out top-1
    over all classes: the same steps by hand, then a dense float64 argmax of x.w, give the same
    top-1 and top-5."""
    from ds_xc.tune.probe import probe_accuracy
    from tests.probe_ref import topk_counts, trained_weight
    section = _raw(num_classes=100, dim=16, loss="softmax")["extreme_classification"]
    section["optimizer"]["lr"] = 5.0
    train, held = _inputs(100, 16, 64, seed=3)
    held_batches = [next(held())] + [train(7)]
    got = probe_accuracy(section, train, lambda: iter(held_batches), steps=16)
    hits1, hits5, n = topk_counts(trained_weight(section, train, 16), held_batches)
    assert got["samples"] == n == 128 and got["steps"] == 16
    assert got["top1"] == pytest.approx(hits1 / n, abs=1e-12) and got["top5"] == pytest.approx(hits5 / n, abs=1e-12)
    assert 0.0 < got["top1"] < 1.0  # a score that can move either way


@pytest.mark.slow
def test_tuner_with_probe_never_chooses_a_less_accurate_candidate_and_caches_probes(small_grid, tmp_path, monkeypatch):
    """A real run with the probe: the choice is the defaults or a candidate whose probe top-1 is at
    least the defaults'; a second run takes every probe from the cache."""
    real = tune_session.probe_accuracy
    calls = []

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)
    monkeypatch.setattr(tune_session, "probe_accuracy", counting)
    # The probe considers only candidates measured faster than the defaults. Here they differ by little, so on a
    # loaded machine every candidate could measure slower and nothing was probed (CI at 413f4fa: base.probe None).
    # The defaults are measured first (Tuner.run): their step time gets a fixed 10 s more, the rest stays real.
    real_measure = tune_session.measure_candidate

    def defaults_slower(*a, **k):
        m = real_measure(*a, **k)
        if not measured:
            m = dict(m, amortised_s=m["amortised_s"] + 10.0)
        measured.append(m)
        return m
    measured = []
    monkeypatch.setattr(tune_session, "measure_candidate", defaults_slower)
    target = Target(min_recall=0.2, max_accuracy_drop=0.0)
    # a budget the search never reaches (it ends on the stop rule in seconds): with 20 s, a loaded CI
    # machine spent it in the first run, the second measured the rows the first had skipped and
    # probed one of them (CI at 59bf32b)
    _, res = _run(tmp_path, target, time_budget_s=3600.0, probe_steps=4, max_probes=2)
    assert not any(r.status.endswith("time budget spent") for r in res.rows)
    assert res.base.measured["amortised_s"] >= 10.0  # the first measurement was the defaults'
    probed = [r for r in res.rows if r.probe is not None]
    assert res.base.probe is not None and len(probed) == len(calls) >= 2
    chosen = res.chosen.probe
    assert res.chosen is res.base or (chosen["drop"] <= 0.0 and chosen["top1"] >= chosen["base_top1"])
    first = len(calls)
    _, again = _run(tmp_path, target, time_budget_s=3600.0, probe_steps=4, max_probes=2)
    assert len(calls) == first and again.chosen.cand == res.chosen.cand
    with pytest.raises(ValueError, match="needs probe_steps > 0"):
        _run(tmp_path, target, time_budget_s=1.0, probe_steps=0)
    with pytest.raises(ValueError, match=r"max_accuracy_drop=-0.1; allowed: a fraction >= 0"):
        _run(tmp_path, Target(min_recall=0.2, max_accuracy_drop=-0.1), time_budget_s=1.0, probe_steps=4)
    with pytest.raises(ValueError, match="no held-out samples"):
        _run(tmp_path, target, time_budget_s=20.0, probe_steps=4, probe_batches=lambda: iter([]))


def test_probe_rejection_reopens_candidates_the_stop_rule_skipped():
    """The stop rule skips candidates predicted slower than 1.5x the best passing measurement; when
    the probe rejects that best one, the search resumes without it and measures them."""
    from ds_xc.tune.cache import MeasurementCache
    from ds_xc.tune.tuner import Tuner, choose
    base = _row("defaults", 1.0, tag="defaults")
    a = _row("a", 0.2, rate=0.02)
    e = _row("c", 0.5, rate=0.1)
    for r in (base, a, e):
        r.measured, r.status = None, "not measured"
    measured = []

    def measure(row):
        measured.append(row)
        return {"amortised_s": row.pred_s, "recall": 0.95, "peak_bytes": 1 << 20}

    def probe(row):
        return _probed({0.2: 0.10, 0.5: 0.30}.get(row.pred_s, 0.30), 0.30, row.cand.tag)
    target = Target(max_accuracy_drop=0.0)
    tuner = Tuner([base, a, e], target, measure, MeasurementCache(None, {}), time_budget_s=60.0)
    assert tuner.run() == 2 and e.measured is None and e.status.startswith("skipped: predicted slower")
    assert tuner.probe(probe) == 1 and a.status.endswith("probe: lower accuracy")
    assert tuner.run() == 1 and measured == [base, a, e]
    assert tuner.probe(probe) == 0 and e.probe["top1"] == 0.30
    assert choose([base, a, e], target) is e

"""benchmarks/time_to_accuracy.py's bookkeeping: the target, the first evaluation that reaches it, the time after
the first step, and the ratios of its table (the namespace runs themselves need root and minutes: not here)."""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module():
    spec = importlib.util.spec_from_file_location("tta", os.path.join(ROOT, "benchmarks", "time_to_accuracy.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(points, first=2.0, step_s=0.5, steps=None):
    curve = [{"step": s, "train_s": t, "top1": a, "top5": a} for s, t, a in points]
    return {"curve": curve, "first_step_s": first, "step_s": step_s, "train_s": curve[-1]["train_s"],
            "steps": steps or curve[-1]["step"]}


def test_table_times_and_ratios():
    tta = _module()
    dense = _run([(10, 12.0, 0.10), (20, 22.0, 0.20)])  # target 0.20, reached at 22 - 2 = 20 s
    rows = _run([(10, 4.0, 0.10), (20, 7.0, 0.20)], first=2.0)  # 5 s: 4x dense
    psgd = _run([(10, 6.0, 0.15), (20, 12.0, 0.19), (30, 17.0, 0.21)])  # 15 s
    never = _run([(10, 3.0, 0.05), (40, 9.0, 0.19)])
    ctr = {"tx_bytes": [1000, 1000]}
    runs = [("dense", dense, ctr), ("dense_rows", rows, ctr), ("powersgd", psgd, ctr), ("topk", never, ctr)]
    assert tta.first_reach(psgd["curve"], 0.20)["step"] == 30
    assert tta.first_reach(never["curve"], 0.20) is None
    table = tta.rate_table("1gbit", runs, 0.20)
    by_name = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]] for line in table
               if line.startswith("| ") and not line.startswith("| variant")}
    assert by_name["dense"][2:5] == ["20", "20.0", "1.00x"]
    assert by_name["dense_rows"][2:6] == ["20", "5.0", "4.00x", "3.00x"]  # 20/5 vs dense, 15/5 vs powersgd
    assert by_name["powersgd"][2:6] == ["30", "15.0", "1.33x", "1.00x"]
    assert by_name["topk"][2:6] == ["never", "> 7.0", "n/a", "n/a"]
    assert by_name["topk"][6] == "0.1900 (40)" and by_name["topk"][7] == "25"  # 1000 B over 40 steps


def test_dense_extrapolated_from_a_short_run_of_the_same_mean():
    """--target_variant dense_rows: DeepSpeed's dense runs a few steps; it reaches the target at dense_rows' step,
    after its own mean step time (first step excluded) per step; the losses of the common steps are compared."""
    tta = _module()
    rows = _run([(100, 30.0, 0.10), (200, 60.0, 0.14)], first=3.0)
    rows["losses"] = [5.0, 4.5, 4.0, 3.9]
    dense = {"curve": [], "first_step_s": 2.0, "train_s": 2.0 + 3 * 0.5, "step_s": 0.5, "steps": 4,
             "losses": [5.0, 4.5, 4.25, 3.9]}
    ext = tta.extrapolate(dense, rows, 0.14, "dense_rows")
    assert ext["extrapolated_from"] == 4 and abs(ext["loss_max_diff"] - 0.25) < 1e-12
    assert ext["curve"] == [{"step": 100, "train_s": 2.0 + 0.5 * 99, "top1": 0.10, "top5": 0.10},
                            {"step": 200, "train_s": 2.0 + 0.5 * 199, "top1": 0.14, "top5": 0.14}]
    ctr = {"tx_bytes": [400, 400]}
    table = tta.rate_table("100mbit", [("dense_rows", rows, ctr), ("dense", ext, ctr)], 0.14)
    by_name = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]] for line in table
               if line.startswith("| ") and not line.startswith("| variant")}
    assert by_name["dense"][2:5] == ["200", "99.5 (timed over 4 steps)", "1.00x"]
    assert by_name["dense_rows"][2:5] == ["200", "57.0", "1.75x"]  # 99.5 / 57
    assert by_name["dense"][7] == "100"  # 400 B over the 4 steps it ran
    assert table[0].startswith("## 100mbit: target top-1 0.1400 (dense_rows's final)")
    assert any("at most 2.50e-01" in line for line in table)


def _recording(tmp_path, runs, target=0.14, rate="100mbit", name="rec.json"):
    import json

    path = tmp_path / name
    path.write_text(json.dumps({rate: {"target": target, "runs": [[n, r, {"tx_bytes": [0, 0]}] for n, r in runs]}}))
    return str(path)


def test_trajectory_times_each_variant_on_its_recorded_run(tmp_path, monkeypatch):
    """--trajectory: every variant runs --timed_steps steps on the link; it reaches the recorded target at its
    recorded step after this link's mean step time per step; a variant whose losses differ is refused."""
    tta = _module()
    rows = _run([(100, 30.0, 0.10), (200, 60.0, 0.14)], first=3.0)
    rows["losses"] = [5.0, 4.5, 4.0, 3.9]
    slow = _run([(100, 40.0, 0.12), (300, 95.0, 0.15)], first=3.0)
    slow["losses"] = [5.0, 4.6, 4.1, 3.8]
    path = _recording(tmp_path, [("dense_rows", rows), ("bayes_prior", slow)])
    timed = {"dense_rows": (0.25, [5.0, 4.5, 4.0, 3.9]), "bayes_prior": (0.1, [5.0, 4.6, 4.1, 3.8])}

    def fake_run(args, name, rate, port, steps, target, evaluate=True):
        assert steps == 4 and evaluate and target == 0.0  # evaluations as recorded: they can move later steps
        step_s, losses = timed[name]
        return ({"curve": [], "first_step_s": 1.0, "train_s": 1.0 + 3 * step_s, "step_s": step_s, "steps": 4,
                 "losses": losses}, {"tx_bytes": [40, 40]})

    monkeypatch.setattr(tta, "run_variant", fake_run)
    args = type("A", (), {"trajectory": path, "timed_steps": 4})()
    runs, target = tta.timed_link(args, "1gbit", ["dense_rows", "bayes_prior"], 29000, tta.recorded(path))
    assert target == 0.14
    by = {n: r for n, r, _ in runs}
    assert tta.first_reach(by["dense_rows"]["curve"], target)["train_s"] == 1.0 + 0.25 * 199
    assert tta.first_reach(by["bayes_prior"]["curve"], target)["step"] == 300  # its own recorded step
    table = tta.rate_table("1gbit", runs, target)
    row = next(line for line in table if line.startswith("| bayes_prior"))
    assert "| 300 | 29.9 (timed over 4 steps) |" in row
    assert "| 49.8 (timed over 4 steps) |" in next(line for line in table if line.startswith("| dense_rows"))

    timed["bayes_prior"] = (0.1, [5.0, 4.6, 4.1, 3.7])  # another trajectory
    try:
        tta.timed_link(args, "1gbit", ["dense_rows", "bayes_prior"], 29000, tta.recorded(path))
    except SystemExit as e:
        assert "bayes_prior's losses differ" in str(e) and "1.000e-01" in str(e)
    else:
        raise AssertionError("a variant off the recorded trajectory was accepted")


def test_replot_from_the_saved_json(tmp_path, capsys):
    """A run's .json (written beside its .md) redraws the plot; without matplotlib it says how to get one."""
    import json

    tta = _module()
    curve = [{"step": 100, "train_s": 10.0, "top1": 0.1}, {"step": 200, "train_s": 20.0, "top1": 0.2}]
    run = {"curve": curve, "first_step_s": 1.0, "train_s": 20.0}
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"1gbit": {"target": 0.2, "runs": [["dense_rows", run, {}]]}}))
    tta.replot(str(path))
    assert (tmp_path / "t.png").exists() or "matplotlib is not installed" in capsys.readouterr().out


def test_trajectory_from_several_files(tmp_path):
    """--trajectory A.json,B.json: each variant from the first file that holds it (its source named), one target;
    files whose targets differ are refused."""
    tta = _module()
    rows = _run([(100, 30.0, 0.10), (200, 60.0, 0.14)])
    new = _run([(100, 40.0, 0.12), (300, 95.0, 0.15)])
    old = _run([(100, 41.0, 0.11), (200, 70.0, 0.14)])
    psgd = _run([(100, 35.0, 0.09), (400, 99.0, 0.145)])
    a = _recording(tmp_path, [("dense_rows", rows), ("bayes_prior", new)], name="a.json")
    b = _recording(tmp_path, [("dense_rows", rows), ("powersgd", psgd), ("bayes_prior", old)], rate="1gbit",
                   name="b.json")
    runs, target = tta.recorded(f"{a},{b}")
    assert target == 0.14 and sorted(runs) == ["bayes_prior", "dense_rows", "powersgd"]
    assert runs["bayes_prior"]["curve"] == new["curve"] and runs["bayes_prior"]["source"] == "a.json, 100mbit"
    assert runs["powersgd"]["curve"] == psgd["curve"] and runs["powersgd"]["source"] == "b.json, 1gbit"
    assert tta.recorded(f"{b},{a}")[0]["bayes_prior"]["curve"] == old["curve"]
    c = _recording(tmp_path, [("dense_rows", rows)], target=0.15, name="c.json")
    try:
        tta.recorded(f"{a},{c}")
    except SystemExit as e:
        assert "c.json's target 0.15 differs from 0.14" in str(e)
    else:
        raise AssertionError("files with different targets were merged")


def test_powersgd_rank_reaches_the_run(monkeypatch):
    """--powersgd_rank: the powersgd variant's runs get that rank in their gradient_compression keys."""
    import json

    tta = _module()
    seen = []
    monkeypatch.setattr(tta, "in_namespaces", lambda script, argv, *a, **k: seen.append(argv) or ({}, {}))
    args = tta.argparse.Namespace(config="configs/default.json", density=0.01, eval_every=100, seed=0,
                                  eval_samples=0, timeout=1.0, ranks=4, powersgd_rank=7)
    tta.run_variant(args, "powersgd", "100mbit", 29000, 10, 0.0)
    tta.run_variant(args, "bayes_prior", "100mbit", 29000, 10, 0.0)
    comp = [json.loads(a[a.index("--compression") + 1]) for a in seen]
    assert comp == [{"powersgd": {"rank": 7}}, {}]
    assert tta.VARIANTS["powersgd"][1] == {"powersgd": {"rank": 4}}  # the table is not changed by a run


def test_powersgd_rank_below_one_is_refused(capsys):
    tta = _module()
    try:
        tta.main(["--powersgd_rank", "0", "--out", "-"])
    except SystemExit as e:
        assert e.code == 2 and "--powersgd_rank=0: allowed: a rank >= 1" in capsys.readouterr().err
    else:
        raise AssertionError("rank 0 was accepted")

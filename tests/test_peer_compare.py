"""benchmarks/peer_compare.py --smoke: every variant runs on 1 and 2 gloo ranks in the same processes,
and the benchmark compares like with like: ds_xc's exact head and the Partial-FC-equivalent at rate
1.0 start from the same weights and see the same batches, so their per-step losses agree to float32
rounding (also after an SGD step: HeadSGD dense and torch.optim.SGD follow the same trajectory);
the sampled variants use the same budget ceil(0.1 * C_local); the ratios are the quotients of the
rows' amortised step times and the target column follows them."""
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import peer_compare  # noqa: E402


@pytest.mark.slow
def test_smoke_run_compares_like_with_like(capsys):
    rows = peer_compare.main(["--smoke", "--batch", "128", "--dim", "32"])
    report = capsys.readouterr().out
    by = {(r["world"], r["variant"]): r for r in rows}
    assert set(by) == {(w, v) for w in (1, 2) for v in peer_compare.VARIANTS}
    for world in (1, 2):
        exact, full = by[world, "exact"], by[world, "pfc_full"]
        assert len(exact["losses"]) == 2 and exact["loss_gap"] < 1e-6, (exact["losses"], full["losses"])
        budget = math.ceil(0.1 * exact["num_local"])
        for name in ("pfc", "uniform", "ann"):
            assert by[world, name]["active"] == budget, (world, name)
        for name, peer in peer_compare.PEER.items():
            r = by[world, name]
            assert r["peer"] == peer
            assert r["ratio"] == pytest.approx(r["amortised_s"] / by[world, peer]["amortised_s"])
        ann = by[world, "ann"]
        assert ann["build_s"] > 0 and ann["amortised_s"] > ann["step_s"]  # the index build is amortised in
        assert (peer_compare.verdict(ann) == "yes") == (max(ann["ratio"], ann["ratio_cpu"]) <= 0.35)
        assert f"| {world} | ann | " in report
    assert "Trial run at other sizes" in report and "wrote " not in report  # --smoke writes nothing


def test_bad_flags_are_refused(capsys):
    with pytest.raises(SystemExit):
        peer_compare.parse_args(["--variants", "pfc,nope"])
    assert "--variants: unknown ['nope']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        peer_compare.parse_args(["--worlds", "1,3"])
    assert "--worlds 1,3: every world size must be >= 1 and divide --batch 512" in capsys.readouterr().err
    args = peer_compare.parse_args(["--smoke"])
    assert (args.num_classes, args.steps, args.rounds, args.out) == (8192, 1, 1, "-")
    assert peer_compare.head_section(vars(args) | {"update": "lazy"}, "exact")["optimizer"] == peer_compare.SGD
    assert "update" not in peer_compare.head_section(vars(args), "ann")["optimizer"]  # the library default
    assert peer_compare.head_section(vars(args) | {"update": "lazy"}, "ann")["optimizer"]["update"] == "lazy"

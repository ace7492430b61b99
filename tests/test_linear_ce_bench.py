"""benchmarks/linear_ce.py --smoke: every variant (matmul + cross_entropy, torch's linear_cross_entropy at its
default options, auto-chunked and at a chunk size, ds_xc's exact head) runs in its own process on the same
inputs and gives the same loss and weight gradient; the report has a row per variant and the verdict line;
the memory guard refuses a variant that cannot fit without starting it."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import linear_ce  # noqa: E402


@pytest.mark.slow  # five fresh processes, each importing torch (and one ds_xc): 20-30 s on 2 busy cores
def test_smoke_runs_every_variant_on_the_same_problem(tmp_path):
    out = tmp_path / "linear_ce.md"
    rows = linear_ce.main(["--smoke", "--out", str(out)])
    kinds = [r["kind"] for r in rows]
    assert kinds == [linear_ce.PLAIN, linear_ce.LCE, linear_ce.LCE_AUTO, "lce", "ds_xc"]
    assert all("error" not in r for r in rows), rows
    ref = rows[0]
    for r in rows[1:]:  # the same loss and dL/dW on every path (float32 rounding)
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-5), r["kind"]
        assert r["grad_w_norm"] == pytest.approx(ref["grad_w_norm"], rel=1e-4), r["kind"]
        assert r["time_s"] > 0 and r["cpu_s"] > 0 and len(r["times"]) == 2
    text = out.read_text()
    assert "| ds_xc chunk=64" in text and "| linear_cross_entropy auto |" in text and "Best ds_xc" in text
    assert "torch 2." in text and "git " in text


def test_a_variant_that_cannot_fit_is_not_started():
    rows = linear_ce.main(["--smoke", "--vocab", "400000000", "--skip", "ds_xc,lce,linear_cross_entropy auto",
                           "--out", "-"])
    assert [r["kind"] for r in rows] == [linear_ce.PLAIN, linear_ce.LCE]
    assert all(r["error"].startswith("not run: needs about") for r in rows)

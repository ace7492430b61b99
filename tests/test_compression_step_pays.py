"""Whether compression pays for the whole step (ds_xc/cost/compression_step.py, StepCheck in
ds_xc/compression/pays.py): the exact reduction's prediction equals the formulas worked by hand
(dense ring; a table as its nonzero rows only where that moves fewer bytes), the verdict's
thresholds, the errors, the check's timing on a fake clock, and on 2 and 3 gloo ranks the check
counts each rank's looked-up rows and warns where a fast link makes the exact reduction cheaper."""
from __future__ import annotations

import doctest
import logging

import pytest
import torch

import ds_xc.cost.compression_step as step_model
from ds_xc.compression import CompressedOptimizer, parse_compression
from ds_xc.compression.pays import MEASURE_STEPS, SETTLE_STEPS, StepCheck
from ds_xc.cost.comm import Link
from ds_xc.cost.compression import Calibration
from ds_xc.cost.compression_step import STEPS_FACTOR, STEPS_FACTORS, Table, exact_reduction, step_verdict

from tests.test_compression_pays import _records, pays_records  # the pays logger's records (caplog, a rank)

ALPHA = 50e-6
CAL = Calibration(dense_ns=5.0)


def _ring(nbytes, p, gbit):
    return 2 * (p - 1) * (ALPHA + nbytes / p * 8 / (gbit * 1e9))


@pytest.mark.parametrize("p", [2, 3, 4])
def test_exact_reduction_is_the_hand_formula(p):
    gbit, n = 1.0, 360_000
    link = Link.gbit(gbit, ALPHA)
    dense = exact_reduction(n, [], p, link, CAL)
    assert dense.comm_s == pytest.approx(_ring(4 * n, p, gbit), rel=1e-12)
    assert dense.compute_s == pytest.approx(5e-9 * n, rel=1e-12) and dense.as_rows == ()
    assert dense.bytes_sent == pytest.approx(2 * (p - 1) * 4 * n / p)
    table = Table(20_001, 256, 569)  # the default job's table: 569 rows looked up
    mixed = exact_reduction(n, [table], p, link, CAL)
    rows_bytes = (p - 1) * 569 * (4 * 256 + 8)
    assert mixed.as_rows == (table,) and mixed.kind == "embedding rows and dense all-reduce"
    assert mixed.comm_s == pytest.approx(_ring(4 * n, p, gbit) + 3 * (p - 1) * ALPHA + rows_bytes * 8 / 1e9, rel=1e-12)
    assert mixed.compute_s == pytest.approx(5e-9 * (n + p * 569 * 256), rel=1e-12)
    assert mixed.bytes_sent == pytest.approx(2 * (p - 1) * 4 * n / p + rows_bytes + (p - 1) * 8)
    busy = Table(1000, 64, 990)  # 990 of 1000 rows: rows would move more than the ring, so it goes dense
    fallback = exact_reduction(n, [busy], p, link, CAL)
    assert fallback.as_rows == () and fallback.kind == "dense all-reduce"
    assert fallback.comm_s == pytest.approx(_ring(4 * (n + 64_000), p, gbit), rel=1e-12)
    assert exact_reduction(n, [table], 1, link, CAL).total_s == 0.0  # one rank: nothing to reduce


def test_verdict_thresholds_and_the_docstring_example():
    link, n = Link.gbit(1.0, ALPHA), 5 * 10**6
    exact = exact_reduction(n, [], 2, link, CAL).total_s  # 0.185 s
    step = 0.3
    for speedup, word in ((0.9, "does not pay"), (1.1, "marginal"), (1.3, "pays")):
        # (other + exact) / step = speedup * f, other = step - compressed: solve for the compressed reduction
        compressed = step + exact - speedup * STEPS_FACTOR * step
        assert 0 < compressed < step
        v = step_verdict(step, compressed, n, [], 2, link, calibration=CAL)
        assert v.other_s == pytest.approx(step - compressed)
        assert v.exact_step_s == pytest.approx(v.other_s + exact)
        assert v.step_speedup == pytest.approx(speedup * STEPS_FACTOR)
        assert v.speedup == pytest.approx(speedup) and v.verdict == word
    v = step_verdict(0.1, 0.05, 100_000, [], 2, link, steps_factor=1.0, calibration=CAL)
    assert v.speedup == pytest.approx(v.step_speedup)
    failures, _ = doctest.testmod(step_model, verbose=False)
    assert failures == 0


@pytest.mark.parametrize("kwargs, field", [
    ({"step_s": -1.0}, "step_s"), ({"compressed_s": float("nan")}, "compressed_s"),
    ({"steps_factor": 0.0}, "steps_factor"), ({"dense_numel": -5}, "dense_numel"), ({"world_size": 0}, "world_size")])
def test_bad_numbers_name_the_field(kwargs, field):
    args = dict(step_s=0.1, compressed_s=0.02, dense_numel=10, tables=[], world_size=2, link=Link.gbit(1.0, ALPHA))
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        step_verdict(**args)
    with pytest.raises(ValueError, match="nonzero_rows"):
        Table(10, 4, 11)


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _tensors():
    emb = torch.nn.Parameter(torch.zeros(1000, 16))
    emb.grad = torch.zeros(1000, 16)
    emb.grad[[3, 7, 500]] = 1.0  # 3 rows looked up
    lin = torch.nn.Parameter(torch.zeros(8, 16))
    lin.grad = torch.ones(8, 16)  # every row: dense
    bias = torch.nn.Parameter(torch.zeros(300))
    bias.grad = torch.ones(300)
    return [emb, lin, bias]


@pytest.mark.parametrize("gbit, word", [(100.0, "does not pay"), (1e-4, "pays")])
def test_check_times_the_steps_after_the_warmups_and_logs_once(caplog, gbit, word):
    cfg = parse_compression({"method": "bayes_prior", "link_gbit_per_s": gbit})
    tensors = _tensors()
    check = StepCheck(cfg, tensors, 2, start=3)
    clock = check._clock = _Clock()
    step_s, reduce_s = 0.010, 0.004
    with caplog.at_level(logging.DEBUG, logger="ds_xc.compression.pays"):
        for step in range(3 + SETTLE_STEPS + MEASURE_STEPS + 5):
            clock.now = step * step_s + (0.5 if step == 20 else 0.0)  # one slow step: the medians ignore it
            check.begin(step)
            clock.now += reduce_s
            check.end(compressed=True)
            if step < 3 + SETTLE_STEPS + MEASURE_STEPS:
                assert check.verdict is None, step
    assert [t for t in check.tables] == [Table(1000, 16, 3), Table(8, 16, 8)]
    expected = step_verdict(step_s, reduce_s, 300, check.tables, 2, Link.gbit(gbit, ALPHA))
    v = check.verdict
    assert v.step_s == pytest.approx(step_s) and v.compressed_s == pytest.approx(reduce_s)
    assert v.exact == expected.exact and v.verdict == word == expected.verdict
    (level, msg), = _records(caplog)
    assert level == (logging.WARNING if word == "does not pay" else logging.INFO)
    for part in ("bayes_prior step 10 ms measured (reduction 4 ms)", f"link_gbit_per_s={gbit:g}", "2 ranks",
                 "1 table(s) as their 3 nonzero rows", f"step speedup {v.step_speedup:.2f}x"):
        assert part in msg, (part, msg)
    if word == "does not pay":
        assert "topology.sparse_rows=true" in msg


def test_check_is_off_where_it_cannot_judge(caplog):
    tensors = _tensors()
    on = {"method": "topk", "link_gbit_per_s": 1.0}
    assert StepCheck(parse_compression(on), tensors, 2, start=0).active
    assert not StepCheck(parse_compression({"method": "topk"}), tensors, 2, start=0).active  # link unknown
    assert not StepCheck(parse_compression(on), tensors, 1, start=0).active  # one rank
    assert not StepCheck(parse_compression(on), tensors, 2, start=0, hierarchical=True).active
    assert not StepCheck(parse_compression(dict(on, method="none")), tensors, 2, start=0).active
    assert not StepCheck(parse_compression(on), [], 2, start=0).active
    check = StepCheck(parse_compression(on), tensors, 2, start=0)
    with caplog.at_level(logging.DEBUG, logger="ds_xc.compression.pays"):
        check.end(compressed=True, by_hooks=True)  # an overlapped reduction: no time of its own
    assert not check.active and check.verdict is None
    (level, msg), = _records(caplog)
    assert level == logging.DEBUG and "backward hooks" in msg


def test_check_takes_each_methods_measured_extra_steps():
    """The extra steps to the exact run's accuracy are the method's own: PowerSGD needed more than the selections
    (1.3 against 1.17); randomk, not measured end to end, takes the fewest of any method; an explicit one wins."""
    tensors = _tensors()
    factors = {m: StepCheck(parse_compression({"method": m, "link_gbit_per_s": 1.0}), tensors, 2, start=0).steps_factor
               for m in ("bayes_prior", "topk", "randomk", "powersgd")}
    assert factors == {"bayes_prior": 1.17, "topk": 1.17, "randomk": STEPS_FACTOR, "powersgd": 1.3}
    assert STEPS_FACTOR == min(STEPS_FACTORS.values())
    cfg = parse_compression({"method": "powersgd", "link_gbit_per_s": 1.0})
    check = StepCheck(cfg, tensors, 2, start=0, steps_factor=2.0)
    v = check.judge(0.010, 0.004)
    assert v.steps_factor == 2.0 and v.speedup == pytest.approx(v.step_speedup / 2.0)
    v13 = StepCheck(cfg, tensors, 2, start=0).judge(0.010, 0.004)
    assert v13.speedup == pytest.approx(v13.step_speedup / 1.3) and v13.step_speedup == pytest.approx(v.step_speedup)


def _rank_steps(rank, world, gbit, steps):
    """An embedding bag model's compressed steps on every rank: the verdict, its tables, the pays records,
    and the nonzero rows of this rank's first measured gradient."""
    with pays_records() as records:
        torch.manual_seed(0)
        emb, head = torch.nn.EmbeddingBag(4001, 32, mode="sum"), torch.nn.Linear(32, 10)
        params = list(emb.parameters()) + list(head.parameters())
        opt = CompressedOptimizer(torch.optim.SGD(params, lr=0.1),
                                  {"method": "bayes_prior", "density": 0.05, "link_gbit_per_s": gbit})
        g = torch.Generator().manual_seed(rank)
        looked_up = None
        for step in range(steps):
            ids = torch.randint(0, 4001, (7 + 3 * rank, 5), generator=g)  # uneven batches
            loss = head(emb(ids)).square().mean()
            opt.zero_grad()
            loss.backward()
            if step == opt.step_check.start:
                looked_up = int((emb.weight.grad != 0).any(dim=1).sum())
            opt.step()
    v = opt.step_check.verdict
    return (None if v is None else v.verdict), opt.step_check.tables, records, looked_up


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_judge_their_steps(pools, world):
    steps = SETTLE_STEPS + MEASURE_STEPS + 3
    for verdict, tables, records, looked_up in pools(world).run(_rank_steps, 100.0, steps):
        assert tables == [Table(4001, 32, looked_up)] and 0 < looked_up <= 5 * (7 + 3 * 2)  # the head: below min_numel
        assert verdict == "does not pay"  # 100 Gbit/s: the exact reduction costs microseconds
        warnings = [m for lv, m in records if lv == logging.WARNING and "for the step" in m]  # and the start-up one
        assert len(warnings) == 1 and f"{world} ranks" in warnings[0] and "sparse_rows=true" in warnings[0]
    for verdict, _, records, _ in pools(world).run(_rank_steps, 1e-5, steps):  # 10 kbit/s: rows take seconds
        assert verdict == "pays"
        assert not [m for lv, m in records if lv == logging.WARNING]
        assert len([m for lv, m in records if lv == logging.INFO and "pays for the step" in m]) == 1

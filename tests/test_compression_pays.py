"""When compression pays (ds_xc/cost/compression.py, ds_xc/compression/pays.py): the verdicts equal
the formulas worked by hand here, the modelled bytes equal what the transport counts on 2 and 3
gloo ranks, the start-up check warns exactly in the 'does not pay' region (and only at DEBUG when
the link is unknown), the config field's errors name it, and the table in docs/compression.md is
the one the benchmark command prints."""
from __future__ import annotations

import contextlib
import logging
import math
import os
import sys

import pytest
import torch

from ds_xc.compression import CompressedOptimizer, parse_compression
from ds_xc.compression.pays import break_even_gbit, check_config, paying_density, verdict
from ds_xc.config import ConfigError
from ds_xc.cost.compression import BLOCK, Calibration

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAL = Calibration(dense_ns=8.5, topk_ns=35.0, randomk_ns=0.5, bayes_prior_ns=12.0)
ALPHA = 50e-6


def _dense_s(n, p, gbit, dense_ns=8.5):
    """Ring all-reduce of 4n bytes: 2 (P-1) steps of alpha + 4n/P bytes, plus the dense compute."""
    beta = gbit * 1e9 / 8  # bytes/s
    return 2 * (p - 1) * (ALPHA + 4 * n / p / beta) + dense_ns * 1e-9 * n


def test_pays_at_1e8_elements_100_mbit_4_ranks():
    n, p, gbit, d = 10**8, 4, 0.1, 0.01
    beta = gbit * 1e9 / 8
    header = 4 * math.ceil(n / 65536)  # 1526 blocks
    pairs = 6 * d * n  # 16-bit offset + fp32 value
    comp = (p - 1) * (ALPHA + header / beta) + (p - 1) * (ALPHA + pairs / beta) + (8.5 + 12.0) * 1e-9 * n
    dense = _dense_s(n, p, gbit)
    assert dense == pytest.approx(48.8503, abs=1e-4) and comp == pytest.approx(3.49177, abs=1e-4)
    v = verdict(n, p, gbit, "bayes_prior", d, calibration=CAL)
    assert v.dense.total_s == pytest.approx(dense, rel=1e-12)
    assert v.compressed.total_s == pytest.approx(comp, rel=1e-12)
    assert v.speedup == pytest.approx(13.990, abs=1e-3)
    assert v.verdict == "pays"
    assert v.compressed.bytes_sent == (p - 1) * (header + pairs)
    assert v.dense.bytes_sent == 2 * (p - 1) * 4 * n / p


def test_does_not_pay_at_1e6_elements_100_gbit():
    n, p, gbit = 10**6, 4, 100.0
    beta = gbit * 1e9 / 8
    comp = 2 * (p - 1) * ALPHA + (p - 1) * (4 * 16 + 6 * 10**4) / beta + 20.5e-9 * n
    v = verdict(n, p, gbit, "bayes_prior", 0.01, calibration=CAL)
    assert v.compressed.total_s == pytest.approx(comp, rel=1e-12)
    assert v.speedup == pytest.approx(_dense_s(n, p, gbit) / comp, rel=1e-12)
    assert v.speedup == pytest.approx(9.28e-3 / 0.0208144, abs=1e-4)  # 0.4458
    assert v.verdict == "does not pay"


def test_randomk_bf16_values_allreduce_and_the_marginal_band():
    n, p, gbit = 10**7, 16, 10.0
    beta = gbit * 1e9 / 8
    m = n * (1 - math.exp(-0.01))  # distinct among k = 0.01 n draws with replacement
    comp = 2 * (p - 1) * (ALPHA + round(2 * m) / p / beta) + (8.5 + 0.5) * 1e-9 * n
    v = verdict(n, p, gbit, "randomk", 0.01, value_bytes=2, calibration=CAL)
    assert v.compressed.total_s == pytest.approx(comp, rel=1e-12)
    assert v.speedup == pytest.approx(_dense_s(n, p, gbit) / comp, rel=1e-12)
    assert v.verdict == "pays"
    slow = verdict(n, p, gbit, "randomk", 0.01, calibration=Calibration(dense_ns=8.5, randomk_ns=5.0))
    assert 1.0 <= slow.speedup < 1.25 and slow.verdict == "marginal"


def test_one_rank_never_pays_and_the_inputs_are_checked():
    v = verdict(10**6, 1, 1.0, "topk", 0.01, calibration=CAL)
    assert v.dense.total_s == 0 and v.compressed.total_s == pytest.approx(43.5e-3)
    assert v.speedup == 0 and v.verdict == "does not pay"
    for bad, word in [(dict(link_gbit_per_s=0), "link_gbit_per_s"), (dict(method="powersgd"), "method"),
                      (dict(density=0.0), "density"), (dict(numel=-1), "numel")]:
        args = {**dict(numel=10**6, world_size=2, link_gbit_per_s=1.0, method="topk", density=0.01), **bad}
        with pytest.raises(ValueError, match=word):
            verdict(**args)
    with pytest.raises(ValueError, match="Calibration.topk_ns"):
        Calibration(topk_ns=-1.0)


def test_the_block_size_is_the_transports():
    from ds_xc.compression.transport import BLOCK as TRANSPORT_BLOCK
    assert BLOCK == TRANSPORT_BLOCK


def test_paying_density_reaches_the_target():
    v = verdict(10**7, 2, 1.0, "bayes_prior", 0.5, calibration=CAL)  # 3 bytes of pairs per element
    assert v.verdict == "does not pay"
    d = paying_density(v, calibration=CAL)
    # dense 0.405 s; compressed 0.205 s of compute + 0.48 s per unit of density: 0.405 / 1.25 at d = 0.2475
    assert d == pytest.approx((0.4051 / 1.25 - 0.2051) / 0.48, rel=2e-3)
    assert verdict(10**7, 2, 1.0, "bayes_prior", d, calibration=CAL).speedup == pytest.approx(1.25, rel=1e-4)
    assert paying_density(v, 1.0, calibration=CAL) > d
    # topk's selection alone (43.5 ms per 10^6) costs more than the dense reduction: no density pays
    assert paying_density(verdict(10**7, 2, 1.0, "topk", 0.01, calibration=CAL), calibration=CAL) is None


@pytest.mark.parametrize("method", ["topk", "randomk", "bayes_prior"])
@pytest.mark.parametrize("world", [2, 3, 16])
def test_break_even_link_is_where_the_speedup_is_one(method, world):
    b = break_even_gbit(world, method, 0.01, calibration=CAL)
    if method == "bayes_prior" and world == 2:  # (2-1) (64/2 - 48 0.01) / 12
        assert b == pytest.approx(31.52 / 12)
    v = verdict(10**9, world, b, method, 0.01, latency_s=0.0, calibration=CAL)
    assert v.speedup == pytest.approx(1.0, abs=1e-3)
    assert verdict(10**9, world, 0.9 * b, method, 0.01, latency_s=0.0, calibration=CAL).speedup > 1
    assert verdict(10**9, world, 1.1 * b, method, 0.01, latency_s=0.0, calibration=CAL).speedup < 1


def test_config_field_default_and_errors_name_it():
    assert parse_compression({}).link_gbit_per_s == 0.0
    assert parse_compression({"link_gbit_per_s": 25}).link_gbit_per_s == 25.0
    for bad in (-1, float("nan"), float("inf"), "fast"):
        with pytest.raises(ConfigError, match=r"gradient_compression\.link_gbit_per_s") as e:
            parse_compression({"link_gbit_per_s": bad})
        if bad == -1:
            assert "-1" in str(e.value) and "greater than or equal to 0" in str(e.value)


def _records(caplog, level=logging.DEBUG):
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "ds_xc.compression.pays"
            and r.levelno >= level]


def test_check_warns_only_where_it_does_not_pay(caplog):
    cfg = parse_compression({"method": "bayes_prior", "link_gbit_per_s": 0.1})
    with caplog.at_level(logging.DEBUG, logger="ds_xc.compression.pays"):
        assert check_config(cfg, 10**8, 4).verdict == "pays"
    assert [lv for lv, _ in _records(caplog)] == [logging.INFO]
    caplog.clear()
    cfg = parse_compression({"method": "bayes_prior", "link_gbit_per_s": 100})
    with caplog.at_level(logging.DEBUG, logger="ds_xc.compression.pays"):
        assert check_config(cfg, 10**6, 4).verdict == "does not pay"
    (level, msg), = _records(caplog)
    assert level == logging.WARNING
    v = verdict(10**6, 4, 100.0, "bayes_prior", 0.01)
    assert 0.3 < v.speedup < 0.5  # the default calibration: 0.39x
    for part in ("1,000,000 compressed elements", "4 ranks", "link 100 Gbit/s", "link_gbit_per_s",
                 f"speedup {v.speedup:.2f}x", "method 'none'"):
        assert part in msg, (part, msg)
    assert f"dense all-reduce {v.dense_ms:.3g} ms" in msg and f"{v.compressed_ms:.3g} ms per step" in msg
    assert "no density pays" in msg and "or method" not in msg  # nothing pays at 100 Gbit/s
    caplog.clear()
    cfg = parse_compression({"method": "topk", "link_gbit_per_s": 10, "value_dtype": "bfloat16"})
    with caplog.at_level(logging.DEBUG, logger="ds_xc.compression.pays"):
        v = check_config(cfg, 10**7, 2)
    (level, msg), = _records(caplog)
    assert v.value_bytes == 2 and v.compressed.bytes_sent == 612 + 4 * 10**5  # bf16 pairs: 4 bytes
    other = verdict(10**7, 2, 10.0, "randomk", 0.01, value_bytes=2)
    assert other.verdict == "pays"
    assert level == logging.WARNING and f"or method 'randomk' (predicted {other.speedup:.2f}x" in msg


def test_optimizer_logs_debug_only_when_the_link_is_unknown(caplog):
    p = torch.nn.Parameter(torch.zeros(10000))
    with caplog.at_level(logging.DEBUG, logger="ds_xc.compression.pays"):
        CompressedOptimizer(torch.optim.SGD([p], lr=0.1), {"method": "topk"})
    recs = _records(caplog)
    assert recs and {lv for lv, _ in recs} == {logging.DEBUG} and "link_gbit_per_s is 0" in recs[0][1]
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="ds_xc.compression.pays"):  # one rank: nothing is sent, no warning
        CompressedOptimizer(torch.optim.SGD([p], lr=0.1), {"method": "topk", "link_gbit_per_s": 1})
    (level, msg), = _records(caplog)
    assert level == logging.DEBUG and "1 rank, nothing is communicated" in msg
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="ds_xc.compression.pays"):  # nothing compressed: no check
        CompressedOptimizer(torch.optim.SGD([p], lr=0.1), {"method": "none", "link_gbit_per_s": 1})
    assert _records(caplog) == []


@contextlib.contextmanager
def pays_records():
    """(level, message) of every record of the ds_xc.compression.pays logger within the block, DEBUG and up
    (a spawned rank has no caplog)."""
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append((record.levelno, record.getMessage()))

    logger = logging.getLogger("ds_xc.compression.pays")
    handler, old = Keep(level=logging.DEBUG), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def _rank_run(rank, world, section, n):
    """One reduction on every rank: this rank's counted bytes and the pays logger's records."""
    with pays_records() as records:
        p = torch.nn.Parameter(torch.zeros(n))
        opt = CompressedOptimizer(torch.optim.SGD([p], lr=0.1), section)
    g = torch.Generator().manual_seed(rank)
    p.grad = torch.randn(n, generator=g)
    opt.reduce_gradients()
    return opt.counter.bytes_sent, records


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("method", ["topk", "randomk"])
def test_model_bytes_equal_the_transport_counts(pools, world, method):
    n = 200_000 + 4 * world  # 4 blocks, uneven
    section = {"method": method, "density": 0.01, "allocation": "numel", "link_gbit_per_s": 0.1}
    results = pools(world).run(_rank_run, section, n)
    model = verdict(n, world, 0.1, method, 0.01).compressed.bytes_sent
    for sent, records in results:
        if method == "topk":  # k = round(0.01 n) pairs of 6 bytes, the header of 4 blocks
            assert sent == (world - 1) * (4 * 4 + 6 * round(0.01 * n))
            assert model == pytest.approx(sent, rel=1e-4)
        else:  # the distinct draws vary around n (1 - e^-d)
            assert model == pytest.approx(sent, rel=0.01)
        assert [lv for lv, _ in records if lv >= logging.INFO] == [logging.INFO]  # pays: no warning


def test_two_ranks_on_a_fast_link_warn(pools):
    section = {"method": "topk", "density": 0.01, "link_gbit_per_s": 100}
    for _, records in pools(2).run(_rank_run, section, 50_000):
        warnings = [m for lv, m in records if lv == logging.WARNING]
        assert len(warnings) == 1 and "50,000 compressed elements, 2 ranks, link 100 Gbit/s" in warnings[0]


def test_docs_table_is_the_commands_output():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import compression_pays
    finally:
        sys.path.pop(0)
    with open(os.path.join(ROOT, "docs", "compression.md")) as fh:
        docs = fh.read()
    assert compression_pays.pays_table("bayes_prior", 0.01) in docs
    assert compression_pays.pays_table("bayes_prior", 0.01, zero_stage=1, backend="gloo") in docs
    with open(os.path.join(ROOT, "benchmarks", "results", "compression_pays.md")) as fh:
        recorded = fh.read()

    def body(text):  # the revision line names the checkout that rendered it
        return [line for line in text.splitlines() if not line.startswith("- ds_xc at git ")]
    assert body(compression_pays.render(0.01)) == body(recorded)
    assert "- ds_xc at git " in recorded

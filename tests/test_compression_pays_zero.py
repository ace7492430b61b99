"""The pays checks under ZeRO stage 1 (ds_xc/cost/compression.py, compression_step.py, compression/pays.py).

Under ZeRO-1 the compressed mean feeds DeepSpeed's own step, which all-gathers the updated fp32
parameters whether the gradients were compressed or not, and DeepSpeed's dense reduction is its
reduce-scatter (gloo runs it as an all-reduce). Checked: the model's times equal the formulas worked
by hand (gloo and NCCL), the step check's exact reduction is the reduce-scatter with every table
dense, and on 2 and 3 gloo ranks DeepSpeed's own collectives in a ZeRO-1 step are what the model
counts (the full gradient reduced densely only without compression, the parameters all-gathered in
both), and a ZeRO-1 engine's wrapper judges with them."""
from __future__ import annotations

import logging

import pytest
import torch

from ds_xc.cost.comm import Link
from ds_xc.cost.compression import Calibration, reduction_collectives, verdict
from ds_xc.cost.compression_step import Table, exact_reduction

from tests.test_compression_zero import GAS, TOPK, _batch, _engine, _loss

ALPHA = 50e-6
CAL = Calibration(dense_ns=5.0, bayes_prior_ns=9.0)
N = 10**7


def _step(nbytes, p, gbit):
    """One ring step pattern of (P-1) steps moving nbytes / P each (an all-gather, NCCL's reduce-scatter)."""
    return (p - 1) * (ALPHA + nbytes / p * 8 / (gbit * 1e9))


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_zero1_adds_the_parameter_gather_to_both_sides(p, backend):
    base = verdict(N, p, 1.0, "bayes_prior", 0.01, calibration=CAL)
    z = verdict(N, p, 1.0, "bayes_prior", 0.01, calibration=CAL, zero_stage=1, backend=backend)
    gather = _step(4 * N, p, 1.0)
    scatter = 2 * gather if backend == "gloo" else gather  # gloo: a reduce-scatter is an all-reduce
    assert z.dense.total_s == pytest.approx(scatter + gather + 5e-9 * N, rel=1e-12)
    assert z.compressed.total_s == pytest.approx(base.compressed.total_s + gather, rel=1e-12)
    if backend == "gloo":
        assert z.dense.total_s == pytest.approx(base.dense.total_s + gather, rel=1e-12)
    assert 1.0 < z.speedup < base.speedup  # still pays at 1 Gbit/s, by less
    slow = verdict(N, p, 0.01, "bayes_prior", 0.01, calibration=CAL, zero_stage=1, backend=backend)
    assert slow.speedup < (scatter + gather) / gather  # bounded by the gather, however slow the link
    assert verdict(N, p, 0.01, "bayes_prior", 0.01, calibration=CAL).speedup > 10 * slow.speedup
    kinds = [(c.name, c.kind, c.nbytes) for c in reduction_collectives(N, p, "none", zero_stage=1)]
    assert kinds == [("dense_grads", "reduce_scatter", 4 * N), ("params", "all_gather", 4 * N)]
    assert reduction_collectives(N, p, "topk", zero_stage=1)[-1].name == "params"
    assert reduction_collectives(N, p, "randomk", zero_stage=1)[-1].name == "params"


def test_zero_stage_errors_name_the_field():
    for bad in (2, 3, -1):
        with pytest.raises(ValueError, match=rf"zero_stage: got {bad}; allowed: 0, 1"):
            verdict(N, 2, 1.0, zero_stage=bad)
    with pytest.raises(ValueError, match="backend: got 'mpi'"):
        verdict(N, 2, 1.0, zero_stage=1, backend="mpi")


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_step_checks_exact_reduction_under_zero1_is_the_dense_reduce_scatter(backend):
    """Rows need ZeRO 0: the table goes dense, as DeepSpeed's reduce-scatter (the gather is in both steps)."""
    link = Link.gbit(1.0, ALPHA)
    table = Table(20_001, 256, 569)  # the default job's table: as rows at ZeRO 0
    assert exact_reduction(360_000, [table], 2, link, CAL).as_rows == (table,)
    z = exact_reduction(360_000, [table], 2, link, CAL, zero_stage=1, backend=backend)
    numel = 360_000 + 20_001 * 256
    hops = 2 if backend == "gloo" else 1
    assert z.as_rows == () and z.kind == "ZeRO-1 dense reduce-scatter"
    assert z.comm_s == pytest.approx(hops * _step(4 * numel, 2, 1.0), rel=1e-12)
    assert z.compute_s == pytest.approx(5e-9 * numel, rel=1e-12)
    assert z.bytes_sent == pytest.approx(hops * 4 * numel / 2, rel=1e-12)


def _collectives(rank, world, comp, link=0.0):
    """DeepSpeed's gradient and parameter collectives (deepspeed.comm, elements per call) over the second
    ZeRO-1 optimizer step, and the wrapper's verdicts."""
    import deepspeed.comm as dist
    names = ("all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor",
             "all_gather", "all_gather_into_tensor")
    calls, originals = [], {n: getattr(dist, n) for n in names if hasattr(dist, n)}

    def counting(name):
        def counted(*args, **kwargs):
            tensors = [a for a in list(args) + list(kwargs.values()) if torch.is_tensor(a)]
            calls.append((name, max(t.numel() for t in tensors)))  # an all-gather's output, a reduction's buffer
            return originals[name](*args, **kwargs)
        return counted
    for name in originals:
        setattr(dist, name, counting(name))
    try:
        engine, opt = _engine(1, None if comp is None else dict(comp, link_gbit_per_s=link))
        for step in range(2):
            calls.clear()
            for micro in range(GAS):
                x, t = _batch(step * GAS + micro, rank)
                engine.backward(_loss(engine(x), t))
                engine.step()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    out = {"calls": calls, "numel": sum(p.numel() for p in engine.module.parameters())}
    if opt is not None:
        out.update(verdict=opt.pays_verdict, step_zero=opt.step_check.zero_stage, step_backend=opt.step_check.backend)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_deepspeed_zero1_gathers_the_parameters_compressed_or_not(pools, world):
    dense, comp = pools(world).run(_collectives, None), pools(world).run(_collectives, TOPK, 1.0)
    for d, c in zip(dense, comp):
        n = d["numel"]
        gathers = lambda r: [k for name, k in r["calls"] if name.startswith("all_gather") and k >= n]  # noqa: E731
        reduced = lambda r: [k for name, k in r["calls"] if not name.startswith("all_gather") and k >= n]  # noqa: E731
        assert len(gathers(d)) == 1 and len(gathers(c)) == 1  # the parameters (padded to the partitions), both
        assert reduced(d) == [n] and reduced(c) == []  # the full gradient, dense, only without compression
        v = c["verdict"]
        assert v.zero_stage == 1 and v.backend == "gloo" and c["step_zero"] == 1 and c["step_backend"] == "gloo"
        ref = verdict(v.numel, world, 1.0, "topk", TOPK["density"], zero_stage=1)
        assert v.dense_ms == pytest.approx(ref.dense_ms) and v.compressed_ms == pytest.approx(ref.compressed_ms)


def test_zero1_wording_in_the_log(caplog):
    from ds_xc.compression import parse_compression
    from ds_xc.compression.pays import check_config
    cfg = parse_compression({"method": "bayes_prior", "link_gbit_per_s": 10.0})
    with caplog.at_level(logging.INFO, logger="ds_xc.compression.pays"):
        v = check_config(cfg, N, 2, zero_stage=1)
    assert v.verdict == "does not pay" and "ZeRO-1 dense reduce-scatter" in caplog.text
    assert "both with ZeRO-1's parameter all-gather" in caplog.text

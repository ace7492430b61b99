"""benchmarks/pfc_reference.py (the Partial-FC-equivalent head of the peer comparison) is correct.

At sample_rate 1.0 its loss, embedding gradient (P x d(global mean)/d(own rows)) and dense
shard gradient equal ds_xc's exact head (sampler full, same margin, same initial weights)
and the single-process float64 reference (tests/reference.py), on 1, 2 and 3 gloo ranks
with uneven shards (17 classes). Below 1.0 its sampled set is sorted, holds every positive
of the shard and has ceil(sample_rate * L) classes (exactly the positives when they are
more), and its loss and gradients equal the reference restricted to the union of the
sampled sets; the shard gradient is dense, zero outside the sampled rows.
"""
import math
import os
import sys

import pytest
import torch

from ds_xc import ClassParallelHead
from ds_xc.head import init_shard, shard_range
from tests.reference import LOSSES, reference

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from pfc_reference import PartialFCReference, num_sample  # noqa: E402

D, SEED, STD = 6, 5, 0.5


def local_batch(rank, rows, classes, seed=SEED):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randn(rows, D, generator=g, dtype=torch.float64), torch.randint(0, classes, (rows,), generator=g)


def _pfc(classes, loss, rate, world, rank):
    start, count = shard_range(classes, world, rank)
    return PartialFCReference(D, classes, loss, sample_rate=rate,
                              weight=init_shard(classes, D, start, count, STD, SEED, torch.float64), seed=SEED)


def _step(module, rank, rows, classes):
    x, y = local_batch(rank, rows, classes)
    x.requires_grad_()
    loss = module(x, y)
    loss.backward()
    return loss.item(), x.grad, module.weight.grad


def _run_full(rank, world, loss, classes, rows):
    pfc = _pfc(classes, loss, 1.0, world, rank)
    head = ClassParallelHead(D, classes, loss=loss, sampler="full", dtype=torch.float64, init_std=STD, seed=SEED)
    assert (pfc.class_start, pfc.num_local) == (head.class_start, head.num_local)
    torch.testing.assert_close(pfc.weight, head.weight, rtol=0, atol=0)
    return {"pfc": _step(pfc, rank, rows, classes), "ds_xc": _step(head, rank, rows, classes),
            "start": pfc.class_start, "num_local": pfc.num_local}


def _run_sampled(rank, world, loss, classes, rows, rate, steps):
    pfc = _pfc(classes, loss, rate, world, rank)
    out = []
    for step in range(steps):  # every step its own batch and sample, from fresh gradients
        pfc.weight.grad = None
        loss_value, gx, gw = _step(pfc, rank, rows, classes + step)
        out.append({"loss": loss_value, "gx": gx, "gw": gw, "index": pfc.last_index + pfc.class_start,
                    "num_sample": pfc.num_sample})
    return {"steps": out, "start": pfc.class_start, "num_local": pfc.num_local}


def _global_batch(world, rows, classes):
    xs, ys = zip(*(local_batch(r, rows, classes) for r in range(world)))
    return torch.cat(xs), torch.cat(ys)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("name", ["arcface", "cosface"])
def test_full_rate_equals_ds_xc_exact_head_and_float64_reference(pools, world, name):
    classes, rows = 17, 5  # 17 % 2 and 17 % 3 != 0: uneven shards
    results = pools(world).run(_run_full, LOSSES[name], classes, rows)
    x, y = _global_batch(world, rows, classes)
    ref_loss, ref_gx, ref_gw = reference(x, init_shard(classes, D, 0, classes, STD, SEED, torch.float64), y,
                                         LOSSES[name])
    for rank, res in enumerate(results):
        start, count = res["start"], res["num_local"]
        loss, gx, gw = res["pfc"]
        assert loss == pytest.approx(ref_loss.item(), rel=1e-10)
        assert loss == pytest.approx(res["ds_xc"][0], rel=1e-10)
        # the embedding gradient: P * d(global mean)/d(own rows), ds_xc's contract
        torch.testing.assert_close(gx, ref_gx[rank * rows: (rank + 1) * rows] * world, rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(gx, res["ds_xc"][1], rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(gw, ref_gw[start: start + count], rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(gw, res["ds_xc"][2], rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("rate", [0.3, 0.05])
def test_sampled_set_holds_every_positive_and_the_loss_matches_the_reference(pools, world, rate):
    """101 classes, 4 rows per rank: at 0.3 the positives are fewer than the budget (random fill);
    at 0.05 (budget 2 or 3) some shards have more positives than the budget (exactly the positives)."""
    classes, rows, steps, loss_cfg = 101, 4, 3, LOSSES["arcface"]
    results = pools(world).run(_run_sampled, loss_cfg, classes, rows, rate, steps)
    filled = only_positives = 0
    for step in range(steps):
        x, y = _global_batch(world, rows, classes + step)
        sampled = torch.cat([res["steps"][step]["index"] for res in results])  # global ids, shard by shard
        remap = torch.full((classes,), -1, dtype=torch.int64)
        remap[sampled] = torch.arange(sampled.numel())
        w = init_shard(classes, D, 0, classes, STD, SEED, torch.float64)
        ref_loss, ref_gx, gw_sampled = reference(x, w[sampled], remap[y], loss_cfg)
        ref_gw = torch.zeros_like(w)
        ref_gw[sampled] = gw_sampled
        for rank, res in enumerate(results):
            start, count, got = res["start"], res["num_local"], res["steps"][step]
            index = got["index"]
            positives = torch.unique(y[(y >= start) & (y < start + count)])
            assert got["num_sample"] == num_sample(rate, count) == math.ceil(round(rate * count, 9))
            assert torch.equal(index, torch.unique(index)), "sampled ids are not sorted and distinct"
            assert torch.isin(positives, index).all(), "a positive class was not sampled"
            assert ((index >= start) & (index < start + count)).all()
            if positives.numel() <= got["num_sample"]:
                assert index.numel() == got["num_sample"]
                filled += positives.numel() < got["num_sample"]
            else:
                assert torch.equal(index, positives)
                only_positives += 1
            assert got["loss"] == pytest.approx(ref_loss.item(), rel=1e-10)
            torch.testing.assert_close(got["gx"], ref_gx[rank * rows: (rank + 1) * rows] * world,
                                       rtol=1e-8, atol=1e-10)
            assert got["gw"].layout == torch.strided and got["gw"].shape == (count, D)  # dense, whole shard
            torch.testing.assert_close(got["gw"], ref_gw[start: start + count], rtol=1e-8, atol=1e-10)
            outside = torch.ones(count, dtype=torch.bool)
            outside[index - start] = False
            assert not got["gw"][outside].any()
    assert filled > 0
    if rate == 0.05 and world > 1:
        assert only_positives > 0  # the more-positives-than-budget branch ran


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="loss.type: got 'softmax'"):
        PartialFCReference(D, 17, {"type": "softmax"})
    with pytest.raises(ValueError, match="sample_rate: got 0"):
        PartialFCReference(D, 17, LOSSES["cosface"], sample_rate=0.0)
    with pytest.raises(ValueError, match=r"weight: got shape \(3, 6\)"):
        PartialFCReference(D, 17, LOSSES["cosface"], weight=torch.zeros(3, D))

"""The accuracy probe's paired, sequential comparison (ds_xc/tune/probe.py) against a dense
float64 reference: per-sample hits of two heads trained by hand, the discordant counts, the drop
and its standard error, and where the sequential scoring stops; and shard_topk's blocked scan
against one full top-k."""
import math

import pytest
import torch

from ds_xc.head.partition import shard_topk
from ds_xc.tune.probe import BLOCK, Z, paired_drop, probe_accuracy
from tests.probe_ref import top1_hits, trained_weight

C, D, B = 60, 12, 32


def _section(lr, sampler=None):
    return {"num_classes": C, "embedding_dim": D, "loss": {"type": "softmax"}, "chunk_size": 16, "init_std": 0.01,
            "seed": 4, "sampler": sampler or {"type": "full"}, "optimizer": {"type": "sgd", "lr": lr}}


def _data(held_batches):
    g = torch.Generator().manual_seed(2)
    protos = torch.nn.functional.normalize(torch.randn(C, D, generator=g), dim=1)

    def draw():
        y = torch.randint(0, C, (B,), generator=g)
        return protos[y] + 0.5 * torch.randn(B, D, generator=g), y
    return [draw() for _ in range(6)], [draw() for _ in range(held_batches)]


def _hits_by_hand(section, train, held, steps):
    """(samples,) bool: top-1 hits of the section's head trained by hand, scored in float64."""
    return top1_hits(trained_weight(section, lambda i: train[i % len(train)], steps), held)


def test_paired_drop_by_hand():
    drop, se = paired_drop(30, 14, 8192)
    assert drop == pytest.approx(16 / 8192) and se == pytest.approx(math.sqrt(44 - 16 ** 2 / 8192) / 8192)
    drop, se = paired_drop(0, 0, 1024, adjusted=True)  # no disagreement: an error, not zero
    assert drop == 0.0 and se == pytest.approx(1 / 1026)


def test_paired_probe_equals_a_dense_float64_reference():
    """Every held-out sample scored (no allowance): b, c, drop, se and both top-1 values equal the
    per-sample hits of the two heads trained by hand."""
    train, held = _data(held_batches=6)
    steps = 10
    base_sec, cand_sec = _section(1.0), _section(0.2)
    base = probe_accuracy(base_sec, lambda i: train[i % 6], lambda: iter(held), steps)
    cand = probe_accuracy(cand_sec, lambda i: train[i % 6], lambda: iter(held), steps, reference=base)
    ref_b, ref_c = _hits_by_hand(base_sec, train, held, steps), _hits_by_hand(cand_sec, train, held, steps)
    n = ref_b.numel()
    b, c = int((ref_b & ~ref_c).sum()), int((~ref_b & ref_c).sum())
    assert base["samples"] == cand["samples"] == n == 6 * B
    assert base["top1"] == pytest.approx(ref_b.double().mean().item(), abs=1e-12)
    assert cand["discordant"] == [b, c] and b + c > 0 and cand["verdict"] == "all samples"
    assert cand["top1"] == pytest.approx(ref_c.double().mean().item(), abs=1e-12)
    assert cand["base_top1"] == pytest.approx(base["top1"], abs=1e-12)
    assert cand["drop"] == pytest.approx((b - c) / n, abs=1e-12)
    assert cand["se"] == pytest.approx(math.sqrt(b + c - (b - c) ** 2 / n) / n, abs=1e-12)


def test_sequential_scoring_stops_when_the_verdict_is_clear():
    """A generous allowance: within after the first block; a candidate that did not learn (lr 1e-9)
    against an allowance of zero: beyond after the first block; an allowance at the drop itself:
    every sample scored. The counts are those of the samples scored, by hand."""
    train, held = _data(held_batches=3 * BLOCK)
    steps = 10
    base = probe_accuracy(_section(1.0), lambda i: train[i % 6], lambda: iter(held), steps)
    ref_b = _hits_by_hand(_section(1.0), train, held, steps)
    first = BLOCK * B
    within = probe_accuracy(_section(0.5), lambda i: train[i % 6], lambda: iter(held), steps, reference=base,
                            max_drop=0.9)
    assert within["verdict"] == "within" and within["samples"] == first
    cold = probe_accuracy(_section(1e-9), lambda i: train[i % 6], lambda: iter(held), steps, reference=base,
                          max_drop=0.0)
    ref_cold = _hits_by_hand(_section(1e-9), train, held, steps)[:first]
    assert cold["verdict"] == "beyond" and cold["samples"] == first
    assert cold["discordant"] == [int((ref_b[:first] & ~ref_cold).sum()), int((~ref_b[:first] & ref_cold).sum())]
    drop, se = paired_drop(*cold["discordant"], first, adjusted=True)
    assert drop - Z * se > 0.0
    full = probe_accuracy(_section(0.5), lambda i: train[i % 6], lambda: iter(held), steps, reference=base)
    edge = probe_accuracy(_section(0.5), lambda i: train[i % 6], lambda: iter(held), steps, reference=base,
                          max_drop=max(full["drop"], 0.0))
    assert edge["verdict"] == "all samples" and edge["samples"] == len(held) * B
    assert edge["drop"] == full["drop"]


def test_a_candidate_scoring_more_samples_than_the_defaults_is_an_error():
    train, held = _data(held_batches=2)
    base = probe_accuracy(_section(1.0), lambda i: train[i % 6], lambda: iter(held[:1]), 2)
    with pytest.raises(ValueError, match="defaults' probe scored 32 held-out samples"):
        probe_accuracy(_section(1.0), lambda i: train[i % 6], lambda: iter(held), 2, reference=base)


@pytest.mark.parametrize("rows,classes,k,block", [(7, 50, 5, 8), (3, 1000, 20, 64), (4, 17, 17, 5), (2, 9, 3, 100)])
def test_shard_topk_equals_one_topk(rows, classes, k, block):
    g = torch.Generator().manual_seed(rows * classes)
    x, w = torch.randn(rows, 6, generator=g), torch.randn(classes, 6, generator=g)
    v, i = shard_topk(x, w, k, block=block)
    ref_v, ref_i = torch.topk(x.double() @ w.double().T, k, dim=1)
    assert v.shape == i.shape == (rows, k)
    assert torch.allclose(v.double(), ref_v, atol=1e-5) and torch.equal(i, ref_i)  # random scores: no ties

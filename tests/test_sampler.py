"""Samplers: positives always active, fixed budget, remapping, determinism, state round trip."""
import pytest
import torch

from ds_xc.sampling import build_sampler
from ds_xc.sampling.base import budget


def _sampler(rate, num_local=1000, start=500, seed=0):
    return build_sampler({"type": "uniform", "sample_rate": rate}, num_local, start, seed, rank=0)


def test_budget_is_robust_to_round_off():
    assert budget(0.1, 1000) == 100
    assert budget(0.3, 10) == 3
    assert budget(1e-9, 10) == 1
    assert budget(1.0, 7) == 7


def test_positives_always_included_and_remapped():
    s = _sampler(0.01)
    labels = torch.tensor([500, 1499, 20, 777, 777, 1500, 3000])
    a = s.sample(labels, None, None)
    assert a.index.numel() == 10 and torch.equal(a.index, a.index.sort().values)
    mine = (labels >= 500) & (labels < 1500)
    assert torch.equal(a.index[a.targets[mine]] + 500, labels[mine])
    assert (a.targets[~mine] == -1).all()


def test_more_positives_than_budget_keeps_them_all():
    s = _sampler(0.01)
    labels = torch.arange(500, 540)
    a = s.sample(labels, None, None)
    assert a.index.numel() == 40 and torch.equal(a.index, torch.arange(40))


def test_rate_one_is_every_class_in_order():
    a = _sampler(1.0, num_local=50).sample(torch.tensor([510, 0]), None, None)
    assert torch.equal(a.index, torch.arange(50)) and a.targets.tolist() == [10, -1]


def test_negatives_uniform_and_deterministic():
    s1, s2 = _sampler(0.2, seed=3), _sampler(0.2, seed=3)
    labels = torch.tensor([600])
    counts = torch.zeros(1000)
    for _ in range(200):
        a1, a2 = s1.sample(labels, None, None), s2.sample(labels, None, None)
        assert torch.equal(a1.index, a2.index)
        counts[a1.index] += 1
    assert counts[100] == 200  # the positive, every time
    others = torch.cat([counts[:100], counts[101:]])
    assert others.mean().item() == pytest.approx(199 / 999 * 200, rel=0.02)
    assert others.std().item() < 15  # binomial(200, 0.2) has std ~5.7


def test_state_round_trip_reproduces_the_stream():
    s = _sampler(0.1)
    labels = torch.tensor([700])
    s.sample(labels, None, None)
    state = s.state_dict()
    a = s.sample(labels, None, None).index
    t = _sampler(0.1, seed=99)
    t.load_state_dict(state)
    assert torch.equal(t.sample(labels, None, None).index, a)


def test_rebuild_schedule_doubles_from_warmup_to_interval():
    from ds_xc.sampling.base import rebuild_due

    def schedule(interval, warmup, steps=3000):
        built, out = 0, []
        for step in range(1, steps):
            if rebuild_due(step, built, interval, warmup):
                built = step
                out.append(step)
        return out

    assert schedule(1000, 16)[:8] == [16, 32, 64, 128, 256, 512, 1024, 2024]
    assert schedule(1000, 0)[:2] == [1000, 2000]
    assert schedule(3, 16)[:3] == [3, 6, 9]  # the interval caps the gap from the start
    assert schedule(0, 16) == []  # interval 0: only at start and after loading


def test_knn_graph_is_rebuilt_on_the_early_schedule():
    s = build_sampler({"type": "knn", "sample_rate": 0.1, "neighbors": 4, "rebuild_warmup": 2,
                       "rebuild_interval": 100}, 50, 0, 0, rank=0)
    weight = torch.randn(50, 8)
    builds = []
    s.rebuild = lambda w, _orig=s.rebuild: (builds.append(s.steps), _orig(w))
    labels = torch.tensor([1, 2, 3])
    with torch.enable_grad():
        for _ in range(9):
            s.sample(labels, None, weight)
    assert builds == [0, 2, 4, 8]


def test_candidate_share_caps_retrieved_classes_and_fills_the_rest_uniformly():
    from ds_xc.sampling.active import assemble
    from ds_xc.sampling.fill import FillStream
    positives, mine = torch.tensor([3, 7]), torch.ones(2, dtype=torch.bool)
    candidates = torch.arange(100, 200)  # 100 distinct candidates in priority order
    out = assemble(positives, mine, 1000, 42, FillStream(0, 0), candidates, candidate_share=0.5, core=42)
    stats = out.stats.read()
    assert out.index.numel() == 42 and stats["positives"] == 2
    assert stats["kept"] == 20 and stats["fill"] == 20 and stats["cut"] == 80  # ceil(0.5 * 40) retrieved
    assert set(out.core[:22].tolist()) == {3, 7} | set(range(100, 120))  # the first 20 in priority order, first
    assert set(positives.tolist()) <= set(out.index.tolist())
    full = assemble(positives, mine, 1000, 42, FillStream(0, 0), candidates).stats.read()
    assert full["kept"] == 40 and full["fill"] == 0

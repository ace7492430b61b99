"""The tuner's accuracy probe on 2 and 3 gloo ranks == the same probe in one process on the
concatenated batches (uneven shards: 101 classes; uneven per-rank batches, one rank's may be
empty)."""
import pytest
import torch

C, D, STEPS = 101, 12, 12


def _section(lr=2.0):
    return {"num_classes": C, "embedding_dim": D, "loss": {"type": "softmax"}, "sampler": {"type": "full"},
            "chunk_size": 16, "init_std": 0.01, "seed": 5, "optimizer": {"type": "sgd", "lr": lr, "momentum": 0.5}}


def _data():
    """8 training batches and 2 held-out batches of 24 rows from fixed class prototypes."""
    g = torch.Generator().manual_seed(11)
    protos = torch.nn.functional.normalize(torch.randn(C, D, generator=g), dim=1)

    def draw(n):
        y = torch.randint(0, C, (n,), generator=g)
        return protos[y] + 0.4 * torch.randn(n, D, generator=g), y
    return [draw(24) for _ in range(8)], [draw(24) for _ in range(2)]


def _cuts(world, n=24):
    """Uneven row ranges of a batch of n rows over the ranks (rank 0 holds none on 3 ranks)."""
    sizes = {1: [n], 2: [15, 9], 3: [0, 17, 7]}[world]
    starts = [sum(sizes[:r]) for r in range(world)]
    return [slice(s, s + k) for s, k in zip(starts, sizes)]


def _probe(rank, world):
    from ds_xc.tune.probe import probe_accuracy
    from ds_xc.tune.session import held_out_samples
    train, held = _data()
    cut = _cuts(world)[rank]
    mine = [(x[cut], y[cut]) for x, y in train]
    mine_held = [(x[cut], y[cut]) for x, y in held]
    out = probe_accuracy(_section(), lambda i: mine[i % len(mine)], lambda: iter(mine_held), STEPS)
    out["held_out_samples"] = held_out_samples(lambda: iter(mine_held))
    out["paired"] = probe_accuracy(_section(lr=0.3), lambda i: mine[i % len(mine)], lambda: iter(mine_held), STEPS,
                                   reference=out)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_probe_on_ranks_equals_one_process(pools, world):
    ref = _probe_single()
    res = pools(world).run(_probe)
    for r in res:
        assert r["samples"] == ref["samples"] == r["held_out_samples"] == 48
        assert abs(r["top1"] - ref["top1"]) <= 1 / 48 and abs(r["top5"] - ref["top5"]) <= 1 / 48
        assert r["top1"] == res[0]["top1"]  # every rank reports the same score
        p, q = r["paired"], ref["paired"]  # the candidate paired with the defaults, on the same 48 samples
        assert p["samples"] == 48 and p == {**res[0]["paired"], "probe_s": p["probe_s"]}
        assert all(abs(u - v) <= 1 for u, v in zip(p["discordant"], q["discordant"]))
        assert abs(p["drop"] - q["drop"]) <= 2 / 48 and abs(p["base_top1"] - r["top1"]) < 1e-12
    assert 0.05 < ref["top1"] < 0.95 and sum(ref["paired"]["discordant"]) > 0


def _probe_single():
    import torch.distributed as dist
    from tests.probe_ref import top1_hits, topk_counts, trained_weight
    if dist.is_initialized():  # pragma: no cover - the test process never joins a group
        raise RuntimeError("unexpected process group")
    train, held = _data()
    batch = lambda i: train[i % len(train)]  # noqa: E731
    w = trained_weight(_section(), batch, STEPS)
    hits1, hits5, n = topk_counts(w, held)
    base, cand = top1_hits(w, held), top1_hits(trained_weight(_section(lr=0.3), batch, STEPS), held)
    b, c = int((base & ~cand).sum()), int((~base & cand).sum())
    paired = {"discordant": [b, c], "drop": (b - c) / n}
    return {"top1": hits1 / n, "top5": hits5 / n, "samples": n, "paired": paired}


def _link(rank, world, fake_ms, no_transfer=False):
    """measure_link on the world group; with ``fake_ms``, every step timing replaced: the solo step
    10 ms, the group step 10 ms plus fake_ms per ring step of its collectives. ``no_transfer``: the
    bytes' predicted time (from the measured bandwidth, which varies with the machine's load) is 0."""
    import ds_xc.cost.calibrate as cal
    import ds_xc.cost.comm as comm
    from ds_xc.parallel.groups import group_size, new_groups
    solo = new_groups([[r] for r in range(world)])
    real, real_predict = cal._step_times, comm.predict_time
    ring = (world - 1) * (4 * world + 6)  # by hand: see test_measure_link_on_ranks

    def fake(section, rows, group, steps, warmup, seed, device=None):
        return [0.010 + (fake_ms * 1e-3 * ring if group_size(group) > 1 else 0.0)] * steps
    if fake_ms:
        cal._step_times = fake
    if no_transfer:
        comm.predict_time = lambda colls, link: 0.0
    try:
        link = cal.measure_link(None, solo)
    finally:
        cal._step_times, comm.predict_time = real, real_predict
    return [link.latency_s, link.bandwidth_bps]


@pytest.mark.parametrize("world", [2, 3])
def test_measure_link_on_ranks(pools, world):
    """The in-situ latency is the group step less the solo step over the step's ring steps: 128 rows
    per rank in chunks of 32 = 4 P chunks of one all-gather of row statistics (P - 1 steps each),
    the input check and the gradient's reduce-scatter (gloo: an all-reduce, 2 (P - 1) steps each),
    two all-gathers (P - 1 steps each): (P - 1) (4 P + 6) ring steps. Every rank returns the same link."""
    exact = pools(world).run(_link, 1.5, True)  # the bytes' time left out: exactly the ring count's share
    assert all(r == exact[0] for r in exact)
    assert exact[0][0] == pytest.approx(1.5e-3, rel=1e-9)
    res = pools(world).run(_link, 1.5)
    assert all(r == res[0] for r in res)
    latency, bandwidth = res[0]
    assert bandwidth > 1e6
    assert 0.8 * 1.5e-3 < latency < 1.5e-3  # less the bytes' time at the measured bandwidth: small on loopback
    real = pools(world).run(_link, 0.0)
    assert all(r == real[0] for r in real) and 0.0 <= real[0][0] < 0.1 and real[0][1] > 1e6

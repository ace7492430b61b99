"""The softmax's one-collective merge of per-rank row statistics (ds_xc/head/softmax.py).

Each rank exponentiates its logits against its own row max and all-gathers [max, sum-exp,
target term]; the merge must equal a dense log-sum-exp, including shards without classes and
rows where a rank's whole share of the mass underflows (its max far below the global one) while
it holds the row's target.
"""
import pytest
import torch

from ds_xc.head.margins import build_loss
from ds_xc.head.softmax import fused_loss_and_grads, merge_row_stats
from tests.reference import LOSSES, reference


def _stats(parts, target_rank, y):
    """(P, n, 3) statistics of logit blocks ``parts`` as each rank forms them."""
    rows = []
    for r, z in enumerate(parts):
        m = z.amax(dim=1) if z.shape[1] else torch.full((z.shape[0],), float("-inf"), dtype=z.dtype)
        s = (z - m[:, None]).exp().sum(dim=1) if z.shape[1] else torch.zeros(z.shape[0], dtype=z.dtype)
        t = torch.where(target_rank == r, y, torch.zeros_like(y))
        rows.append(torch.stack([m, s, t], 1))
    return torch.stack(rows)


@pytest.mark.parametrize("widths", [(7,), (3, 4), (5, 0, 2), (1, 1, 1, 1)])
@pytest.mark.parametrize("separate", [False, True])
def test_merge_equals_dense_logsumexp(widths, separate):
    g = torch.Generator().manual_seed(len(widths))
    z = torch.randn(6, sum(widths), generator=g, dtype=torch.float64) * 40  # spreads beyond exp's range
    z[0, :widths[0]] += 300.0  # row 0: every other rank's share underflows
    parts = list(torch.split(z, widths, dim=1))
    y = torch.randn(6, generator=g, dtype=torch.float64)
    target_rank = torch.arange(6) % len(widths)
    stats = _stats(parts, target_rank, y)
    if separate:  # D-Softmax: local maxima are clamped at 0 and the sums taken against them
        m_loc = stats[..., 0].clamp_min(0.0)  # (P, n)
        stats[..., 1] = torch.stack([(p - m_loc[r][:, None]).exp().sum(dim=1) for r, p in enumerate(parts)])
        stats[..., 0] = m_loc
    m, sumexp, target = merge_row_stats(stats, separate)
    dense = torch.cat([z, torch.zeros(6, 1, dtype=z.dtype)], 1) if separate else z
    torch.testing.assert_close(m + sumexp.log(), torch.logsumexp(dense, dim=1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(target, y)
    assert (m >= 0).all() or not separate


def _far_rank(rank, world, name):
    """float32 fused loss on ``world`` ranks over a weight matrix whose last shard scores every row
    about 200 logits below the first shard; rows 0-3 have their targets there."""
    torch.manual_seed(0)
    n, d, per = 8, 16, 5
    cfg = {"type": "softmax"} if name == "softmax" else LOSSES[name]
    x, w, y = _far_problem(n, d, per, world)
    lo, hi = rank * per, (rank + 1) * per
    t = torch.where((y >= lo) & (y < hi), y - lo, torch.full_like(y, -1))
    group = torch.distributed.group.WORLD
    total, gx, gw = fused_loss_and_grads(x.float(), w[lo:hi].float(), t, build_loss(cfg), group, chunk_size=3)
    return total.item(), gx, gw


def _far_problem(n, d, per, world):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.randn(world * per, d, generator=g, dtype=torch.float64) * 0.1
    direction = x.mean(dim=0) / x.mean(dim=0).norm()
    x = x * 0.2 + 4.0 * direction  # every row points along ``direction``
    w[:per] += 12.0 * direction  # first shard: logits about +48 (scaled losses: cos near 1)
    w[-per:] -= 40.0 * direction  # last shard: logits about -160 (scaled losses: cos near -1)
    y = torch.randint(0, world * per, (n,), generator=g)
    y[:4] = (world - 1) * per + torch.arange(4) % per  # targets in the far shard
    return x, w, y


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", ["softmax", "arcface", "dsoftmax"])
def test_far_below_global_max_matches_reference(pools, world, name):
    results = pools(world).run(_far_rank, name)
    n, d, per = 8, 16, 5
    x, w, y = _far_problem(n, d, per, world)
    cfg = {"type": "softmax"} if name == "softmax" else LOSSES[name]
    ref_loss, ref_gx, ref_gw = reference(x, w, y, cfg)  # mean over rows: the fused sums
    total = results[0][0]
    assert all(r[0] == total for r in results)  # the same bits on every rank
    assert total == pytest.approx(ref_loss.item() * n, rel=1e-5)
    gx = sum(r[1].double() for r in results)  # each rank's part of d(total)/dx
    scale = ref_gx.abs().max().item() * n
    torch.testing.assert_close(gx, ref_gx * n, rtol=1e-4, atol=1e-5 * scale)
    for rank, (_, _, gw) in enumerate(results):
        assert torch.isfinite(gw).all()
        torch.testing.assert_close(gw.double(), ref_gw[rank * per:(rank + 1) * per] * n, rtol=1e-4,
                                   atol=1e-5 * max(ref_gw.abs().max().item() * n, 1.0))

"""Class-parallel head on 2 and 3 gloo ranks == the single-process float64 reference.

num_classes=17 is uneven for both world sizes, labels fall on every shard, and each
rank checks its loss, its embedding gradient (P x d(global mean)/d(own rows)) and the
gradient of its weight shard.
"""
import pytest
import torch

from ds_xc import ClassParallelHead
from ds_xc.head import init_shard, shard_range
from tests.reference import LOSSES, reference

C, D, SEED = 17, 6, 5


def local_batch(rank, size, seed=SEED):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randn(size, D, generator=g, dtype=torch.float64), torch.randint(0, C, (size,), generator=g)


def _run_head(rank, world, loss, sampler, chunk, sizes):
    head = ClassParallelHead(D, C, loss=loss, sampler=sampler, chunk_size=chunk, dtype=torch.float64,
                             init_std=0.5, seed=SEED)
    x, y = local_batch(rank, sizes[rank])
    x.requires_grad_()
    out = head(x, y, batch_sizes=None if len(set(sizes)) == 1 else sizes)
    out.backward()
    index = head.last_active.index
    return {"loss": out.item(), "gx": x.grad, "gw": head.weight.grad, "start": head.class_start,
            "index": None if index is None else index + head.class_start}


def _global(sizes):
    xs, ys = zip(*(local_batch(r, b) for r, b in enumerate(sizes)))
    return torch.cat(xs), torch.cat(ys)


def _check(results, sizes, loss_cfg, atol=1e-9):
    world = len(sizes)
    x, y = _global(sizes)
    w = init_shard(C, D, 0, C, 0.5, SEED, torch.float64)
    active = None
    if results[0]["index"] is not None:
        active = torch.cat([r["index"] for r in results])
    if active is None:
        ref_loss, ref_gx, ref_gw = reference(x, w, y, loss_cfg)
    else:  # sampled softmax: the reference sees exactly the union of the active sets
        assert torch.isin(y, active).all(), "a positive class was not sampled"
        remap = torch.full((C,), -1, dtype=torch.int64)
        remap[active] = torch.arange(active.numel())
        ref_loss, ref_gx, gw_active = reference(x, w[active], remap[y], loss_cfg)
        ref_gw = torch.zeros_like(w)
        ref_gw[active] = gw_active
    offset = 0
    for rank, res in enumerate(results):
        start, num_local = shard_range(C, world, rank)
        assert res["start"] == start
        assert res["loss"] == pytest.approx(ref_loss.item(), rel=1e-10)
        b = sizes[rank]
        # every rank gets P * d(global mean)/dx_r (equal batches: d(local mean)/dx_r, as N / B_r = P)
        torch.testing.assert_close(res["gx"], ref_gx[offset: offset + b] * world, rtol=1e-8, atol=atol)
        gw = res["gw"].to_dense() if res["gw"].is_sparse else res["gw"]
        torch.testing.assert_close(gw, ref_gw[start: start + num_local], rtol=1e-8, atol=atol)
        offset += b


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_exact_head_matches_reference(pools, world, name):
    sizes = [5] * world
    chunk = 4 if name in ("arcface", "softmax") else 0
    results = pools(world).run(_run_head, LOSSES[name], "full", chunk, sizes)
    _check(results, sizes, LOSSES[name])


@pytest.mark.parametrize("world", [2, 3])
def test_uneven_batches(pools, world):
    sizes = [5, 3, 4][:world]
    results = pools(world).run(_run_head, LOSSES["cosface"], "full", 3, sizes)
    _check(results, sizes, LOSSES["cosface"])


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("update", ["dense", "lazy"])
def test_uniform_sampler_matches_reference_on_same_active_sets(pools, world, update):
    sizes = [4] * world
    sampler = {"type": "uniform", "sample_rate": 0.4}
    results = pools(world).run(_run_head_update, LOSSES["arcface"], sampler, 0, sizes, update)
    _check(results, sizes, LOSSES["arcface"])


def _run_head_update(rank, world, loss, sampler, chunk, sizes, update):
    head = ClassParallelHead(D, C, loss=loss, sampler=sampler, chunk_size=chunk, dtype=torch.float64,
                             init_std=0.5, seed=SEED, update=update)
    x, y = local_batch(rank, sizes[rank])
    x.requires_grad_()
    out = head(x, y)
    out.backward()
    assert head.weight.grad.is_sparse == (update == "lazy")
    return {"loss": out.item(), "gx": x.grad, "gw": head.weight.grad.to_dense(), "start": head.class_start,
            "index": head.last_active.index + head.class_start}


@pytest.mark.parametrize("world", [2, 3])
def test_uniform_rate_one_equals_full(pools, world):
    sizes = [5] * world
    full = pools(world).run(_run_head, LOSSES["combined"], "full", 0, sizes)
    unif = pools(world).run(_run_head, LOSSES["combined"], {"type": "uniform", "sample_rate": 1.0}, 0, sizes)
    for a, b in zip(full, unif):
        assert a["loss"] == b["loss"]
        torch.testing.assert_close(a["gx"], b["gx"], rtol=0, atol=0)
        torch.testing.assert_close(a["gw"], b["gw"], rtol=0, atol=0)


def _run_topk(rank, world, sizes, loss):
    head = ClassParallelHead(D, C, loss=loss, dtype=torch.float64, init_std=0.5, seed=SEED, chunk_size=3)
    x, _ = local_batch(rank, sizes[rank])
    return head.topk(x, k=5, batch_sizes=None if len(set(sizes)) == 1 else sizes)


@pytest.mark.parametrize("world,sizes", [(2, [4, 4]), (3, [4, 2, 3])])
@pytest.mark.parametrize("name", ["softmax", "arcface"])
def test_topk_over_all_classes(pools, world, sizes, name):
    results = pools(world).run(_run_topk, sizes, LOSSES[name])
    x, _ = _global(sizes)
    w = init_shard(C, D, 0, C, 0.5, SEED, torch.float64)
    if name == "softmax":
        scores = x @ w.t()
    else:
        scores = torch.nn.functional.normalize(x, dim=1) @ torch.nn.functional.normalize(w, dim=1).t()
    ref = scores.topk(5, dim=1).indices
    assert torch.equal(torch.cat(results), ref)


def _run_bad_label(rank, world):
    head = ClassParallelHead(D, C, seed=SEED, dtype=torch.float64)
    x, y = local_batch(rank, 4)
    if rank == 1:
        y[2] = C + 3
    try:
        head(x, y)
    except ValueError as exc:
        return str(exc)
    return None


def test_bad_label_on_one_rank_raises_on_every_rank(pools):
    msgs = pools(2).run(_run_bad_label)
    assert f"label {C + 3} at position 2 on rank 1" in msgs[1]
    assert "another rank" in msgs[0]

"""Uneven and empty local batches, without ``batch_sizes``, == the float64 single-process reference.

Local batches of (4, 1) and (0, 3) rows on 2 gloo ranks and (5, 0, 3) on 3, for every
sampler (full, uniform, knn, ann with groups) and every loss, through the serial head and
the overlap schedule (one tensor, and the backbone mode), with and without row chunking.
Each rank checks, against the reference computed on the concatenated global batch: the
loss (the global mean, on every rank), its weight shard's gradient (of the global mean)
and its embedding gradient, P x d(global mean)/d(own rows). Many cases run inside one
``pool.run`` call per world size. Also: ``topk`` with shards smaller than k and an empty rank.
"""
import itertools

import pytest
import torch

from ds_xc import ClassParallelHead
from ds_xc.head import init_shard, shard_range
from ds_xc.overlap import ChunkedHeadSchedule
from tests.reference import LOSSES, per_row_loss

C, D, SEED = 29, 8, 11  # 29 classes: uneven shards at 2 and 3 ranks
SAMPLERS = {
    "full": "full",
    "uniform": {"type": "uniform", "sample_rate": 0.4},
    "knn": {"type": "knn", "sample_rate": 0.3, "neighbors": 3},
    "ann": {"type": "ann", "sample_rate": 0.3, "code_bits": 32, "nlist": 3, "nprobe": 2, "top_k": 3,
            "rerank": 4, "groups": 2, "backend": "torch"},
}
MODES = ("serial", "overlap", "backbone")
_GROUPS: dict = {}


def _comm_group(world):
    """One side group per pool process for the schedules (groups are costly to create)."""
    if world not in _GROUPS:
        from ds_xc.overlap import side_group
        _GROUPS[world] = side_group() if world > 1 else None
    return _GROUPS[world]


def local_batch(rank, rows, case):
    g = torch.Generator().manual_seed(SEED * 1000 + case * 10 + rank)
    return torch.randn(rows, D, generator=g, dtype=torch.float64), torch.randint(0, C, (rows,), generator=g)


def cases_for(sizes_list):
    """Every (sampler, loss, mode) with the first size set; every (sampler, mode) with the others
    (the loss rotating); row chunking and 2 or 3 schedule chunks alternate."""
    combos = [(s, lo, m, sizes_list[0]) for s, lo, m in itertools.product(SAMPLERS, LOSSES, MODES)]
    losses = list(LOSSES)
    for sizes in sizes_list[1:]:
        combos += [(s, losses[j % len(losses)], m, sizes)
                   for j, (s, m) in enumerate(itertools.product(SAMPLERS, MODES))]
    return [{"case": i, "sampler": s, "loss": lo, "mode": m, "sizes": sizes, "chunk": 2 if i % 2 else 0,
             "num_chunks": 2 + i % 2} for i, (s, lo, m, sizes) in enumerate(combos)]


def _run_one(rank, world, spec):
    head = ClassParallelHead(D, C, loss=LOSSES[spec["loss"]], sampler=SAMPLERS[spec["sampler"]],
                             chunk_size=spec["chunk"], dtype=torch.float64, init_std=0.5, seed=SEED)
    x, y = local_batch(rank, spec["sizes"][rank], spec["case"])
    x.requires_grad_()
    if spec["mode"] == "serial":
        loss = head(x, y)  # no batch_sizes: exchanged in the input check
        loss.backward()
    else:
        sched = ChunkedHeadSchedule(head, spec["num_chunks"], comm_group=_comm_group(world))
        if spec["mode"] == "overlap":
            loss = sched.run(x * 1.0, y)
        else:
            loss = sched.run_backbone(lambda part: part * 1.0, x, y)
    groups = [(rows.start, rows.stop, None if idx is None else (idx + head.class_start).tolist())
              for rows, idx in head.last_active.groups()]
    gw = head.weight.grad
    return {"loss": float(loss), "gx": x.grad if x.grad is not None else torch.zeros_like(x),
            "gw": gw.to_dense() if gw is not None else torch.zeros_like(head.weight), "groups": groups}


def _run_cases(rank, world, specs):
    return [_run_one(rank, world, s) for s in specs]


def _reference(spec, results):
    """Loss, d loss/dx (N, d) and d loss/dw (C, d) of the global mean over the union of the active sets."""
    world = len(spec["sizes"])
    xs, ys = zip(*(local_batch(r, b, spec["case"]) for r, b in enumerate(spec["sizes"])))
    x, y = torch.cat(xs).requires_grad_(), torch.cat(ys)
    w = init_shard(C, D, 0, C, 0.5, SEED, torch.float64).requires_grad_()
    n, total = x.shape[0], 0.0
    for g, (a, b, index) in enumerate(results[0]["groups"]):
        if index is None:
            active = torch.arange(C)
        else:
            active = torch.tensor(sorted(set(sum((results[r]["groups"][g][2] for r in range(world)), []))))
            assert torch.isin(y[a:b], active).all(), "a positive class was not sampled"
        remap = torch.full((C,), -1, dtype=torch.int64)
        remap[active] = torch.arange(active.numel())
        total = total + per_row_loss(x[a:b], w[active], remap[y[a:b]], LOSSES[spec["loss"]]).sum() / n
    total.backward()
    return total.item(), x.grad, w.grad


def _check_all(specs, per_rank):
    world = len(per_rank)
    for i, spec in enumerate(specs):
        results = [per_rank[r][i] for r in range(world)]
        ref_loss, ref_gx, ref_gw = _reference(spec, results)
        offset = 0
        for rank, res in enumerate(results):
            where = f"case {spec} rank {rank}"
            start, num = shard_range(C, world, rank)
            b = spec["sizes"][rank]
            assert res["loss"] == pytest.approx(ref_loss, rel=1e-9), where
            assert res["gx"].shape == (b, D), where
            torch.testing.assert_close(res["gx"], world * ref_gx[offset: offset + b], rtol=1e-7, atol=1e-10,
                                       msg=where)
            torch.testing.assert_close(res["gw"], ref_gw[start: start + num], rtol=1e-7, atol=1e-10, msg=where)
            offset += b
        assert ref_gw.abs().max() > 0 and ref_gx.abs().max() > 0


@pytest.mark.parametrize("world,sizes_list", [(2, [(4, 1), (0, 3)]), (3, [(5, 0, 3)])])
def test_uneven_and_empty_batches_every_sampler_loss_and_schedule(pools, world, sizes_list):
    specs = cases_for(sizes_list)
    per_rank = pools(world).run(_run_cases, specs)
    _check_all(specs, per_rank)


def test_one_process_empty_batch_is_a_zero_loss():
    """World size 1 with 0 rows: a zero loss and zero-size gradients, no error."""
    head = ClassParallelHead(D, C, dtype=torch.float64)
    x = torch.zeros((0, D), dtype=torch.float64, requires_grad=True)
    loss = head(x, torch.zeros(0, dtype=torch.int64))
    loss.backward()
    assert loss.item() == 0.0 and x.grad.shape == (0, D)


# ---------------------------------------------------------------------------- topk
def _run_topk(rank, world, classes, sizes, k, loss):
    head = ClassParallelHead(D, classes, loss=LOSSES[loss], dtype=torch.float64, init_std=0.5, seed=SEED,
                             chunk_size=2)
    x, _ = local_batch(rank, sizes[rank], 7)
    return head.topk(x, k=k)


@pytest.mark.parametrize("world,classes,sizes,k", [(2, 5, (3, 2), 3), (2, 5, (2, 2), 7), (3, 5, (3, 0, 2), 2),
                                                   (3, 4, (1, 2, 0), 3)])
@pytest.mark.parametrize("loss", ["softmax", "cosface"])
def test_topk_small_shards_and_empty_rank(pools, world, classes, sizes, k, loss):
    """k larger than a shard (C=5 on 2 ranks: shards of 3 and 2), k > C, an empty rank, shards of 2, 1, 1 with k=3."""
    results = pools(world).run(_run_topk, classes, sizes, k, loss)
    x = torch.cat([local_batch(r, b, 7)[0] for r, b in enumerate(sizes)])
    w = init_shard(classes, D, 0, classes, 0.5, SEED, torch.float64)
    if loss == "softmax":
        scores = x @ w.t()
    else:
        scores = torch.nn.functional.normalize(x, dim=1) @ torch.nn.functional.normalize(w, dim=1).t()
    ref = scores.topk(min(k, classes), dim=1).indices
    assert [r.shape[0] for r in results] == list(sizes)
    assert torch.equal(torch.cat(results), ref)


# ---------------------------------------------------------------------------- sampler metrics
def _run_metrics(rank, world, sizes):
    sampler = {"type": "ann", "sample_rate": 1.0, "code_bits": 32, "nlist": 2, "nprobe": 2, "top_k": 2,
               "rerank": 0, "backend": "torch", "metrics_interval": 1}
    head = ClassParallelHead(D, 13, loss=LOSSES["cosface"], sampler=sampler, dtype=torch.float64, init_std=0.5,
                             seed=SEED)
    x, y = local_batch(rank, sizes[rank], 9)
    head(x, y % 13)
    return head.sampler_stats()


def test_sampler_metrics_with_shards_smaller_than_k(pools):
    """recall@10 over 13 classes on 3 ranks (shards of 5, 4, 4 < 10) with an empty rank: every rank
    uses k=10 (padded candidates); every class active, so recall and mass are exactly 1."""
    stats = pools(3).run(_run_metrics, (3, 0, 2))
    for s in stats:
        assert s["recall_active@10"] == pytest.approx(1.0) and s["softmax_mass"] == pytest.approx(1.0), s

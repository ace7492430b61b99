"""ANN (with sample groups) and kNN samplers on 2 and 3 gloo ranks == the single-process
float64 reference computed on the same active sets (uneven shards, labels everywhere)."""
import pytest
import torch

from ds_xc import ClassParallelHead
from ds_xc.head import init_shard, shard_range
from tests.reference import LOSSES, per_row_loss

C, D, B, SEED = 41, 8, 6, 3
SAMPLERS = {
    "ann": {"type": "ann", "sample_rate": 0.25, "code_bits": 32, "nlist": 4, "nprobe": 2, "top_k": 3,
            "rerank": 6, "groups": 2, "backend": "torch"},
    "ann_g1": {"type": "ann", "sample_rate": 0.3, "code_bits": 64, "nlist": 3, "nprobe": 3, "top_k": 4,
               "rerank": 0, "backend": "torch"},
    "knn": {"type": "knn", "sample_rate": 0.3, "neighbors": 3},
}


def _batch(rank):
    g = torch.Generator().manual_seed(SEED * 100 + rank)
    return torch.randn(B, D, generator=g, dtype=torch.float64), torch.randint(0, C, (B,), generator=g)


def _run(rank, world, sampler, loss):
    head = ClassParallelHead(D, C, loss=loss, sampler=sampler, dtype=torch.float64, init_std=0.5, seed=SEED,
                             update="lazy", chunk_size=5)
    x, y = _batch(rank)
    x.requires_grad_()
    out = head(x, y)
    out.backward()
    groups = [(rows.start, rows.stop, (idx + head.class_start).tolist()) for rows, idx in head.last_active.groups()]
    return {"loss": out.item(), "gx": x.grad, "gw": head.weight.grad.to_dense(), "groups": groups}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name,loss", [("ann", "arcface"), ("ann_g1", "softmax"), ("knn", "cosface")])
def test_sampled_head_matches_reference_on_same_active_sets(pools, world, name, loss):
    res = pools(world).run(_run, SAMPLERS[name], LOSSES[loss])
    xs, ys = zip(*(_batch(r) for r in range(world)))
    x = torch.cat(xs).requires_grad_()
    y = torch.cat(ys)
    w = init_shard(C, D, 0, C, 0.5, SEED, torch.float64).requires_grad_()
    n = x.shape[0]
    total = 0.0
    for g, (a, b, _) in enumerate(res[0]["groups"]):
        active = torch.tensor(sorted(set(sum((r["groups"][g][2] for r in res), []))))
        assert torch.isin(y[a:b], active).all(), "a positive class was not sampled"
        remap = torch.full((C,), -1, dtype=torch.int64)
        remap[active] = torch.arange(active.numel())
        total = total + per_row_loss(x[a:b], w[active], remap[y[a:b]], LOSSES[loss]).sum() / n
    total.backward()
    for rank, r in enumerate(res):
        start, num = shard_range(C, world, rank)
        assert r["loss"] == pytest.approx(total.item(), rel=1e-10)
        torch.testing.assert_close(r["gx"], x.grad[rank * B: (rank + 1) * B] * world, rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(r["gw"], w.grad[start: start + num], rtol=1e-8, atol=1e-10)

"""The exact mean of a dense (warm-up) step, ds_xc/compression/exact.py: the nonzeros of row-sparse gradients
go as a sparse all-gather when that moves fewer bytes, else the ring all-reduce; either way the mean equals a
float64 reference, on 2 and 3 ranks with uneven (and empty) nonzeros, replicas identical."""
import pytest
import torch

from ds_xc.compression import CompressedOptimizer
from ds_xc.compression.exact import sparse_pays
from ds_xc.parallel.collectives import allreduce_bytes

ROWS, DIM = 500, 16  # an "embedding" of 8,000 elements, a 40 x 30 weight (1,200) and a bias (30, dense: min_numel)


def _grads(rank: int, case: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    emb = torch.zeros(ROWS, DIM)
    if case == "dense":
        emb = torch.randn(ROWS, DIM, generator=g)
    elif rank != 2:  # rank 2 looked up no row at all
        rows = torch.randperm(ROWS, generator=g)[: 5 + 10 * rank]
        emb[rows] = torch.randn(rows.numel(), DIM, generator=g)
    return [emb, torch.randn(40, 30, generator=g), torch.randn(30, generator=g)]


def _warmup_step(rank, world, case):
    params = [torch.nn.Parameter(torch.zeros(s)) for s in ((ROWS, DIM), (40, 30), (30,))]
    opt = CompressedOptimizer(torch.optim.SGD(params, lr=0.0),
                              {"method": "bayes_prior", "warmup_steps": 3, "min_numel": 100})
    for p, g in zip(params, _grads(rank, case)):
        p.grad = g.clone()
    before = opt.counter.bytes_sent
    opt.reduce_gradients()
    assert not opt.stats()["last"]["compressed"]
    return {"out": [p.grad.clone() for p in params], "bytes": opt.counter.bytes_sent - before}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", ["rows", "dense"])
def test_warmup_mean_equals_the_float64_reference(pools, world, case):
    results = pools(world).run(_warmup_step, case)
    ref = [torch.stack([_grads(r, case)[i].double() for r in range(world)]).mean(0) for i in range(3)]
    for r in results:
        for got, want in zip(r["out"], ref):
            torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-7)
        for a, b in zip(r["out"], results[0]["out"]):
            assert torch.equal(a, b)  # every rank sums the same pairs in rank order
    bucket = ROWS * DIM + 1200  # the compressed tensors, one float32 bucket (padding: none below 65536)
    dense = allreduce_bytes(4 * bucket, world) + allreduce_bytes(4 * 30, world)
    if case == "dense":  # every element nonzero: the all-gather would move more, so the ring all-reduce runs
        assert all(r["bytes"] == dense + allreduce_bytes(8, world) for r in results)
    else:  # at most (5 + 10 (P - 1)) rows x 16 + 1,200 pairs per rank
        assert all(r["bytes"] < dense / 2 for r in results)


def test_sparse_pays_rule():
    assert sparse_pays(6132, 9200, 2) and not sparse_pays(6134, 9200, 2)  # 6 m < 4 n on 2 ranks
    assert sparse_pays(4088, 9200, 3) and not sparse_pays(4090, 9200, 3)  # 2 * 6 m < 4/3 * 4 n on 3

"""Row-sparse gradients sent as rows (ds_xc/parallel/sparse_rows.py) == the dense mean.

On 2 and 3 gloo ranks, with batches of different sizes (one rank looks up nothing), rows
shared by several ranks, and a table whose rows are all touched (where the dense
all-reduce moves fewer bytes and must be chosen on every rank). Against a float64
single-process reference and, on 2 ranks, bit for bit against the dense all-reduce.
"""
import pytest
import torch
import torch.distributed as dist

VOCAB, DIM = 53, 6


def _tokens(rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(0, VOCAB // 2, (n,), generator=g) + (rank % 2) * (VOCAB // 4)  # overlapping ranges


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.ModuleDict({"emb": torch.nn.Embedding(VOCAB, DIM), "out": torch.nn.Linear(DIM, 3)}).to(dtype)


def _loss(model, tokens):
    if tokens.numel() == 0:  # an empty local batch: the table's gradient is all zeros
        return model["out"](model["emb"].weight[:1]).sum() * 0.0
    return model["out"](model["emb"](tokens)).pow(2).sum()


def _batch(rank: int, dense_table: bool) -> torch.Tensor:
    if dense_table:
        return torch.arange(VOCAB)  # every row touched: rows cost more than the ring
    return _tokens(rank, [5, 0, 9][rank % 3])  # uneven; rank 1 looks up nothing


def _reduce(rank, world, dtype, dense_table, overlap):
    from ds_xc.parallel.buckets import BucketedGradReducer
    from ds_xc.parallel.collectives import all_reduce_mean_
    model = _model(dtype)
    reducer = BucketedGradReducer(model.parameters(), dist.group.WORLD, bucket_bytes=64, overlap=overlap,
                                  row_sparse=[model["emb"].weight])
    reducer.arm()
    _loss(model, _batch(rank, dense_table)).backward()
    local = [p.grad.clone() for p in model.parameters()]
    reducer.finish()
    dense = [all_reduce_mean_(g.clone(), dist.group.WORLD).wait() for g in local]
    return {"got": [p.grad.clone() for p in model.parameters()], "dense": dense, "modes": list(reducer.row_modes),
            "bytes": reducer.bytes_sent, "buckets": [list(b) for b in reducer.buckets],
            "nonzero": int((local[0] != 0).any(1).sum())}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dense_table", [False, True])
def test_rows_equal_the_dense_mean(pools, world, dense_table):
    dtype = torch.float64
    results = pools(world).run(_reduce, dtype, dense_table, True)
    grads = []
    for r in range(world):  # the float64 single-process reference: the mean of every rank's gradient
        model = _model(torch.float64)
        _loss(model, _batch(r, dense_table)).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    ref = [sum(g[i] for g in grads) / world for i in range(len(grads[0]))]
    k_max = max(res["nonzero"] for res in results)
    for res in results:
        assert res["modes"] == ["dense" if dense_table else "rows"]  # the same choice on every rank
        assert [0] in res["buckets"]  # the table has a bucket of its own
        for got, want, dense in zip(res["got"], ref, res["dense"]):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            if world == 2:
                assert torch.equal(got, dense)  # a + b == b + a, 0 + a == a: the dense all-reduce's bits
        assert torch.equal(res["got"][0], results[0]["got"][0])  # every rank holds the same table
        others = sum(p.numel() for p in _model(dtype).parameters()) - VOCAB * DIM
        ring = 2 * (world - 1) / world * 8
        table = VOCAB * DIM * ring if dense_table else (world - 1) * k_max * (DIM * 8 + 8)
        assert res["bytes"] == pytest.approx(table + others * ring)
    assert not dense_table and k_max < VOCAB or dense_table


def test_rows_float32_serial_and_all_empty(pools):
    """The serial reducer (overlap=False), float32; and a window where no rank looked anything up."""
    results = pools(2).run(_reduce, torch.float32, False, False)
    for res in results:
        assert res["modes"] == ["rows"]
        for got, dense in zip(res["got"], res["dense"]):
            assert torch.equal(got, dense)
    assert pools(2).run(_empty_everywhere) == [True, True]


def _empty_everywhere(rank, world):
    from ds_xc.parallel.sparse_rows import RowSparseMean
    g = torch.zeros(7, 3)
    work = RowSparseMean(g, dist.group.WORLD, async_op=True)
    return work.mode == "rows" and work.nbytes == 0 and torch.equal(work.wait(), torch.zeros(7, 3))


def _nan_row(rank, world):
    from ds_xc.parallel.sparse_rows import RowSparseMean
    g = torch.zeros(5, 2)
    if rank == 0:
        g[3, 1] = float("nan")
    return RowSparseMean(g, dist.group.WORLD).wait()


def test_a_nan_row_is_sent(pools):
    """A NaN is not skipped (NaN != 0): the non-finite check after the reduction still sees it."""
    for out in pools(2).run(_nan_row):
        assert torch.isnan(out[3, 1]) and torch.isfinite(out[:3]).all()


def test_refusals():
    from ds_xc.parallel.buckets import BucketedGradReducer
    lin = torch.nn.Linear(4, 3)
    with pytest.raises(ValueError, match="only 2-D tables"):
        BucketedGradReducer(lin.parameters(), None, row_sparse=[lin.bias])
    with pytest.raises(ValueError, match="bucket of its own"):
        BucketedGradReducer(lin.parameters(), None, row_sparse=[lin.weight], buckets=[[1, 0]])
    from ds_xc.parallel.sparse_rows import RowSparseMean, rows_pay
    with pytest.raises(ValueError, match="2-D gradient"):
        RowSparseMean(torch.zeros(3))
    assert rows_pay(10, (1000, 8), 4, 2) and not rows_pay(900, (1000, 8), 4, 2)


def _hier_rows(rank, world):
    from ds_xc.parallel.buckets import BucketedGradReducer
    from ds_xc.parallel.hierarchical import HierarchicalAllReduce
    from ds_xc.parallel.topology import detect_layout
    model = _model(torch.float64)
    h = HierarchicalAllReduce(detect_layout(dist.group.WORLD, ranks_per_node=2))
    reducer = BucketedGradReducer(model.parameters(), dist.group.WORLD, bucket_bytes=64, reduction=h,
                                  row_sparse=[model["emb"].weight])
    reducer.arm()
    _loss(model, _batch(rank, False)).backward()
    reducer.finish()
    return reducer.row_modes, [p.grad.clone() for p in model.parameters()]


def test_rows_beside_the_hierarchical_buckets(pools):
    """2 nodes x 2: the dense buckets go hierarchically, the table as rows over the whole group."""
    world = 4
    results = pools(world).run(_hier_rows)
    grads = []
    for r in range(world):
        model = _model(torch.float64)
        _loss(model, _batch(r, False)).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    ref = [sum(g[i] for g in grads) / world for i in range(len(grads[0]))]
    for modes, got in results:
        assert modes == ["rows"]
        for g, want in zip(got, ref):
            torch.testing.assert_close(g, want, rtol=1e-12, atol=1e-12)

"""The overlapped schedule (ds_xc/overlap) equals the serial path on 1, 2 and 3 gloo ranks.

Per rank, two identical copies of a backbone (a per-row MLP) and a ClassParallelHead run
the same micro-steps: the serial path (head(backbone(x)), backward, one all-reduce of the
backbone gradients) and the overlapped one (ChunkedHeadSchedule + BucketedGradReducer).
Loss, embedding-side gradients (through the backbone's) and head weight gradients must
agree within 1e-9 (float64), for num_chunks 1, 2, 4, exact and sampled heads, uneven
shards (C % P != 0), uneven batches (a rank with an empty chunk) and labels that put
all of a rank's positives on another rank.
"""
import pytest
import torch
import torch.distributed as dist

from ds_xc import ClassParallelHead
from ds_xc.overlap import BucketedGradReducer, ChunkedHeadSchedule, Timeline
from tests.reference import LOSSES

C, D, IN, SEED = 43, 8, 6, 5
SAMPLERS = {
    "full": "full",
    "uniform": {"type": "uniform", "sample_rate": 0.3},
    "ann": {"type": "ann", "sample_rate": 0.3, "code_bits": 32, "nlist": 4, "nprobe": 2, "top_k": 3,
            "rerank": 6, "groups": 2, "backend": "torch"},
    "knn": {"type": "knn", "sample_rate": 0.3, "neighbors": 3},
}
_GROUPS: dict = {}


def _side_groups(world):
    """Two copies of the world group per pool process, reused by every test (groups are costly)."""
    if world not in _GROUPS:
        from ds_xc.overlap import side_group
        _GROUPS[world] = (side_group(), side_group()) if world > 1 else (None, None)
    return _GROUPS[world]


def _backbone(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, 16), torch.nn.Tanh(), torch.nn.Linear(16, D)).double()


def _batch(rank, step, rows, skew):
    g = torch.Generator().manual_seed(SEED * 1000 + rank * 10 + step)
    x = torch.randn(rows, IN, generator=g, dtype=torch.float64)
    if skew:  # every positive of rank r lives on the shard of rank r+1: some ranks hold none
        y = torch.randint(0, C // 3, (rows,), generator=g) + (C // 3) * ((rank + 1) % 3)
    else:
        y = torch.randint(0, C, (rows,), generator=g)
    return x, y


def _compare(rank, world, sampler, loss, num_chunks, rows, skew, update, chunk_backbone):
    sizes = [rows[r % len(rows)] for r in range(world)]
    heads, nets = [], []
    for _ in range(2):
        heads.append(ClassParallelHead(D, C, loss=loss, sampler=sampler, dtype=torch.float64, init_std=0.5,
                                       seed=SEED, update=update, chunk_size=3))
        nets.append(_backbone(SEED))
    g_head, g_grad = _side_groups(world)
    timeline = Timeline()
    sched = ChunkedHeadSchedule(heads[1], num_chunks, timeline=timeline, comm_group=g_head)
    reducer = BucketedGradReducer(list(nets[1].parameters()), bucket_bytes=200, timeline=timeline,
                                  comm_group=g_grad)
    losses = [[], []]
    for step in range(2):  # two micro-steps accumulate; the reduction runs after the second
        x, y = _batch(rank, step, sizes[rank], skew)
        out = heads[0](nets[0](x), y, batch_sizes=sizes)
        out.backward()
        losses[0].append(out.item())

        def backward(i, emb, grad, last, step=step):
            if last and step == 1:
                reducer.arm()
            emb.backward(grad)
        timeline.begin_step()
        if chunk_backbone:
            out = sched.run_backbone(nets[1], x, y, batch_sizes=sizes, backward=backward)
        else:
            out = sched.run(nets[1](x), y, batch_sizes=sizes, backward=backward)
        if step == 1:
            reducer.finish()
        timeline.end_step()
        losses[1].append(out.item())
    for p in nets[0].parameters():  # the serial reduction
        if world > 1:
            dist.all_reduce(p.grad)
        p.grad /= world
    gw = [h.weight.grad.to_dense() if h.weight.grad is not None else torch.zeros_like(h.weight) for h in heads]
    return {"loss": losses, "head": (gw[0] - gw[1]).abs().max().item(), "head_norm": gw[0].abs().max().item(),
            "net": max((a.grad - b.grad).abs().max().item() for a, b in zip(nets[0].parameters(),
                                                                            nets[1].parameters())),
            "net_norm": max(a.grad.abs().max().item() for a in nets[0].parameters()),
            "steps": timeline.steps, "issued": timeline.summary().get("issued", 0)}


def _check(res):
    for r in res:
        assert r["loss"][0] == pytest.approx(r["loss"][1], rel=1e-10, abs=1e-12)
        assert r["head"] <= 1e-9 * max(r["head_norm"], 1.0), r
        assert r["net"] <= 1e-9 * max(r["net_norm"], 1.0), r
        assert r["head_norm"] > 0 and r["net_norm"] > 0
        assert r["steps"] == 2
    assert len({round(r["loss"][0][0], 12) for r in res}) == 1  # the same loss on every rank


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("num_chunks", [1, 2, 4])
@pytest.mark.parametrize("name,loss", [("full", "arcface"), ("uniform", "cosface"), ("ann", "softmax"),
                                       ("knn", "combined")])
def test_overlapped_equals_serial(pools, world, num_chunks, name, loss):
    res = pools(world).run(_compare, SAMPLERS[name], LOSSES[loss], num_chunks, [6], False, "dense", True)
    _check(res)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("chunk_backbone", [True, False])
def test_uneven_batches_empty_chunks_and_skewed_positives(pools, world, chunk_backbone):
    """Batches of 5, 2 (and 4) rows in 4 chunks: rank 1 has empty chunks; positives all elsewhere."""
    res = pools(world).run(_compare, SAMPLERS["uniform"], LOSSES["arcface"], 4, [5, 2, 4], True, "lazy",
                           chunk_backbone)
    _check(res)


@pytest.mark.parametrize("num_chunks", [1, 3])
def test_one_process(num_chunks):
    """World size 1 (no process group): the schedule is the serial path with chunked rows."""
    res = _compare(0, 1, SAMPLERS["ann"], LOSSES["cosface"], num_chunks, [7], False, "lazy", True)
    _check([res])

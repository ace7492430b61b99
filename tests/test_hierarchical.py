"""The hierarchical all-reduce (ds_xc/parallel/hierarchical.py) == the flat one and a float64 reference.

On 4 gloo ranks as 2 nodes x 2 and on 6 ranks as 3 nodes x 2 (simulated node layouts on
loopback: topology.ranks_per_node, or the launcher's node rank in the environment), for
lengths that do not divide by the ranks per node. Integer-valued tensors add exactly, so
there the result must equal the flat all-reduce bit for bit; random floats within rounding
of the float64 sum. The bucketed reducer with several buckets in flight gives the mean.
"""
import os

import pytest
import torch
import torch.distributed as dist

from ds_xc.config_base import ConfigError
from ds_xc.parallel.topology import NodeLayout, choose_reduction, detect_layout, node_name

LENGTHS = (1, 3, 1001, 4096)


def _data(rank, n, kind):
    g = torch.Generator().manual_seed(1000 * rank + n)
    if kind == "int":
        return torch.randint(-1000, 1000, (n,), generator=g).to(torch.float32)
    return torch.randn(n, generator=g, dtype=torch.float64).to(torch.float32)


def _reduce(rank, world, rpn, node_var, chunk, intra_mode):
    from ds_xc.parallel.hierarchical import HierarchicalAllReduce
    old = os.environ.get("GROUP_RANK")
    if node_var == "blocks":
        layout = detect_layout(dist.group.WORLD, ranks_per_node=rpn)
    else:  # the launcher's node rank: "strided" puts ranks r, r+N, ... on node r % N
        nodes = world // rpn
        os.environ["GROUP_RANK"] = str(rank % nodes if node_var == "strided" else rank // rpn)
        try:
            layout = detect_layout(dist.group.WORLD)
        finally:
            os.environ.pop("GROUP_RANK") if old is None else os.environ.update(GROUP_RANK=old)
    h = HierarchicalAllReduce(layout, chunk_numel=chunk, intra_mode=intra_mode)
    assert HierarchicalAllReduce(layout).intra_mode == "alltoall"  # gloo's default
    out = {"nodes": layout.nodes}
    for kind in ("int", "float"):
        for n in LENGTHS:
            x = _data(rank, n, kind)
            flat = x.clone()
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=dist.group.WORLD)
            pending = [h.sum_(x.clone(), async_op=True), h.mean_(x.clone(), async_op=True)]
            limit = 3
            for p in pending:  # progress in order, as the bucketed reducer does
                limit = p.progress(limit)
            out[kind, n] = (flat, pending[0].wait(), pending[1].wait())
    return out


@pytest.mark.parametrize("world,node_var,chunk,intra_mode", [
    (4, "blocks", 0, "alltoall"), (6, "blocks", 500, "alltoall"), (4, "strided", 500, "alltoall"),
    (6, "launcher", 0, "native"), (4, "blocks", 500, "allreduce"), (6, "strided", 0, "allreduce")])
def test_hierarchical_equals_flat(pools, world, node_var, chunk, intra_mode):
    """chunk 500: the 1001- and 4096-element tensors run as pipelines of 3 and 9 chunks, the last one short.
    Every node-stage implementation (alltoall: gloo's default, allreduce, native reduce_scatter/all_gather)."""
    results = pools(world).run(_reduce, 2, node_var, chunk, intra_mode)
    nodes = world // 2
    if node_var == "strided":
        assert results[0]["nodes"] == tuple(tuple(range(i, world, nodes)) for i in range(nodes))
    else:
        assert results[0]["nodes"] == tuple((2 * i, 2 * i + 1) for i in range(nodes))
    for kind in ("int", "float"):
        for n in LENGTHS:
            ref = sum(_data(r, n, kind).double() for r in range(world))  # float64, single process
            for r, res in enumerate(results):
                flat, hsum, hmean = res[kind, n]
                assert hsum.shape == (n,) and hsum.dtype == torch.float32
                if kind == "int":  # exact sums: bitwise equal to the flat all-reduce and the reference
                    assert torch.equal(hsum, flat), (r, n)
                    assert torch.equal(hsum.double(), ref)
                    assert torch.equal(hmean, flat / world)
                else:
                    torch.testing.assert_close(hsum.double(), ref, rtol=1e-5, atol=1e-5)
                    torch.testing.assert_close(hsum, flat, rtol=1e-5, atol=1e-5)
                    torch.testing.assert_close(hmean.double(), ref / world, rtol=1e-5, atol=1e-5)
                assert torch.equal(hsum, results[0][kind, n][1])  # every rank holds the same bits


def _buckets(rank, world):
    from ds_xc.parallel.buckets import BucketedGradReducer
    from ds_xc.parallel.hierarchical import HierarchicalAllReduce
    h = HierarchicalAllReduce(detect_layout(dist.group.WORLD, ranks_per_node=2))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
    reducer = BucketedGradReducer(model.parameters(), dist.group.WORLD, bucket_bytes=64, reduction=h)
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(rank))
    reducer.arm()
    model(x).pow(2).sum().backward()  # buckets launched from the hooks, several in flight
    launched = reducer.launched_in_backward
    reducer.finish()
    return launched, len(reducer.buckets), [p.grad.clone() for p in model.parameters()]


def test_bucketed_hierarchical_mean(pools):
    world = 6
    results = pools(world).run(_buckets)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3), torch.nn.Linear(3, 2)).double()
    grads = []
    for r in range(world):  # float64 single-process reference: the mean of every rank's gradient
        model.zero_grad()
        model(torch.randn(4, 7, generator=torch.Generator().manual_seed(r)).double()).pow(2).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    ref = [sum(g[i] for g in grads) / world for i in range(len(grads[0]))]
    for launched, buckets, got in results:
        assert buckets > 2 and launched == buckets
        for g, want in zip(got, ref):
            torch.testing.assert_close(g.double(), want, rtol=1e-5, atol=1e-6)


def test_choose_reduction():
    two_by_two = NodeLayout(nodes=((0, 1), (2, 3)), source="test")
    assert choose_reduction("auto", two_by_two) == "hierarchical"
    assert choose_reduction("flat", two_by_two) == "flat"
    assert choose_reduction("auto", NodeLayout(nodes=((0, 1, 2, 3),), source="test")) == "flat"
    assert choose_reduction("auto", NodeLayout(nodes=((0,), (1,)), source="test")) == "flat"
    uneven = NodeLayout(nodes=((0, 1, 2), (3,)), source="test")
    assert choose_reduction("auto", uneven) == "flat"
    with pytest.raises(ConfigError, match="topology.reduction='hierarchical'"):
        choose_reduction("hierarchical", uneven)
    with pytest.raises(ConfigError, match="allowed: auto, flat, hierarchical"):
        choose_reduction("tree", two_by_two)
    with pytest.raises(ConfigError, match="topology.ranks_per_node=3 must divide"):
        from ds_xc.parallel.topology import layout_from_blocks
        layout_from_blocks(3)  # one process: a group of 1


def test_node_name_uses_launcher_node_rank(monkeypatch):
    for var in ("GROUP_RANK", "CROSS_RANK", "SLURM_NODEID", "NODE_RANK"):
        monkeypatch.delenv(var, raising=False)
    plain = node_name()
    monkeypatch.setenv("CROSS_RANK", "1")
    assert node_name() == plain + "/CROSS_RANK=1"


def _probe(rank, world, fake):
    from ds_xc.parallel.hierarchical import HierarchicalAllReduce
    from ds_xc.parallel.reduction_probe import probe_reduction
    h = HierarchicalAllReduce(detect_layout(dist.group.WORLD, ranks_per_node=2), chunk_numel=1000)
    seen = []

    def measure(mode, buf):  # the real reduction (the result checked), then the injected time
        want = sum(torch.randn(buf.numel(), generator=torch.Generator().manual_seed(r)) for r in range(world)) / world
        took = time_one(h, dist.group.WORLD, mode, buf)
        torch.testing.assert_close(buf, want, rtol=1e-5, atol=1e-6)
        seen.append(mode)
        return took if fake is None else fake[rank][mode]
    from ds_xc.parallel.reduction_probe import time_one
    mode, medians = probe_reduction(h, dist.group.WORLD, 3001, 2, measure=measure)
    return mode, medians, seen


@pytest.mark.parametrize("fake,want", [
    (None, None),  # real timings: whatever the clocks say, one agreed choice
    ([{"flat": 1.0, "hierarchical": 0.5}] * 4, "hierarchical"),
    ([{"flat": 1.0, "hierarchical": 0.97}] * 4, "flat"),  # within the 5% margin: flat
    ([{"flat": 1.0, "hierarchical": 0.5}] + [{"flat": 0.2, "hierarchical": 0.1}] * 3, "hierarchical"),
    ([{"flat": 1.0, "hierarchical": 0.5}] * 3 + [{"flat": 0.2, "hierarchical": 4.0}], "flat")])
def test_auto_probe_agreed_and_used(pools, fake, want):
    """The probe times both modes alternately (one warm-up, 2 timed rounds), takes the slowest rank's times and
    the first rank's decision: every rank ends with the same choice, the one the (injected) times imply."""
    results = pools(4).run(_probe, fake)
    modes = {r[0] for r in results}
    assert len(modes) == 1 and modes <= {"flat", "hierarchical"}
    assert all(r[1] == results[0][1] for r in results)  # the same medians everywhere
    for _, _, seen in results:
        assert seen == ["flat", "hierarchical", "hierarchical", "flat", "flat", "hierarchical"]
    if want is not None:
        assert modes == {want}
        slowest = {m: max(f[m] for f in fake) for m in ("flat", "hierarchical")}
        assert results[0][1] == slowest

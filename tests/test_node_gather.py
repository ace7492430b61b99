"""The head's rank-aligned two-stage row exchange (ds_xc/parallel/node_gather.py) == the flat one.

On 4 gloo ranks as 2 nodes x 2 (consecutive and strided), 6 ranks as 3 x 2 and 2 x 3, and the
degenerate layouts (one rank per node, one node): the forward equals the flat all-gather bit for
bit (it only moves rows) and the backward equals a float64 single-process sum of every rank's
upstream gradient; uneven blocks, empty ones included. A ClassParallelHead with the two stages
gives the flat head's loss and gradients on uneven batches, and the engine wires it from
``topology.head_collectives`` (tests/test_topology_engine.py runs its steps against the reference).
"""
import os

import pytest
import torch
import torch.distributed as dist

D, SCALE = 5, 2.5
SIZE_CASES = {"equal": lambda r, w: 3, "uneven": lambda r, w: (2 * r + 1) % 4,
              "one_empty": lambda r, w: 0 if r == w - 1 else r + 2}


def _layout(rank, world, rpn, order):
    from ds_xc.parallel.topology import detect_layout
    if order == "blocks":
        return detect_layout(dist.group.WORLD, ranks_per_node=rpn)
    nodes = world // rpn  # strided: ranks r, r + nodes, ... share node r % nodes (the launcher's node rank)
    old = os.environ.get("GROUP_RANK")
    os.environ["GROUP_RANK"] = str(rank % nodes)
    try:
        return detect_layout(dist.group.WORLD)
    finally:
        os.environ.pop("GROUP_RANK") if old is None else os.environ.update(GROUP_RANK=old)


def _rows(rank, n):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(n, D, generator=g, dtype=torch.float64)


def _upstream(rank, total):
    g = torch.Generator().manual_seed(7000 + rank)
    return torch.randn(total, D, generator=g, dtype=torch.float64)


def _exchange(rank, world, rpn, order):
    from ds_xc.parallel.collectives import all_gather_rows
    from ds_xc.parallel.node_gather import NodeGather, node_gather_rows
    layout = _layout(rank, world, rpn, order)
    plan = NodeGather(layout, dist.group.WORLD)
    out = {"nodes": layout.nodes}
    for case, size_of in SIZE_CASES.items():
        sizes = [size_of(r, world) for r in range(world)]
        passed = None if case == "equal" else sizes
        x = _rows(rank, sizes[rank]).requires_grad_(True)
        y = node_gather_rows(x, plan, passed, grad_scale=SCALE)
        x_flat = x.detach().clone().requires_grad_(True)
        flat = all_gather_rows(x_flat, dist.group.WORLD, passed, grad_scale=SCALE)
        (y * _upstream(rank, y.shape[0])).sum().backward()
        (flat * _upstream(rank, flat.shape[0])).sum().backward()
        labels = torch.arange(sizes[rank], dtype=torch.int64) + 1000 * rank
        out[case] = (y.detach(), flat.detach(), x.grad, x_flat.grad, plan.gather(labels, passed))
    return out


@pytest.mark.parametrize("world,rpn,order", [(4, 2, "blocks"), (4, 2, "strided"), (6, 2, "blocks"),
                                             (6, 3, "blocks"), (6, 2, "strided"), (4, 1, "blocks"), (4, 4, "blocks")])
def test_two_stages_equal_flat_and_reference(pools, world, rpn, order):
    results = pools(world).run(_exchange, rpn, order)
    nodes = world // rpn
    if order == "strided":
        assert results[0]["nodes"] == tuple(tuple(range(i, world, nodes)) for i in range(nodes))
    for case, size_of in SIZE_CASES.items():
        sizes = [size_of(r, world) for r in range(world)]
        total = sum(sizes)
        expected_rows = torch.cat([_rows(r, sizes[r]) for r in range(world)])  # (N, D) in rank order
        expected_labels = torch.cat([torch.arange(sizes[r]) + 1000 * r for r in range(world)])
        grad_sum = sum(_upstream(r, total) for r in range(world)) * SCALE  # float64, one process
        start = 0
        for rank, res in enumerate(results):
            y, flat, gx, gflat, labels = res[case]
            assert torch.equal(y, expected_rows) and torch.equal(flat, expected_rows), (case, rank)
            assert torch.equal(labels, expected_labels)
            mine = grad_sum[start: start + sizes[rank]]
            assert gx.shape == (sizes[rank], D)
            torch.testing.assert_close(gx, mine, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(gx, gflat, rtol=1e-12, atol=1e-12)
            start += sizes[rank]


def _head(rank, world, hierarchical):
    from ds_xc.head import ClassParallelHead
    from ds_xc.parallel.node_gather import NodeGather
    from ds_xc.parallel.topology import detect_layout
    head = ClassParallelHead(D, 23, loss="cosface", group=dist.group.WORLD, dtype="float64", seed=3)
    if hierarchical:
        head.node_gather = NodeGather(detect_layout(dist.group.WORLD, ranks_per_node=2), head.group)
    sizes = [(3 * r + 2) % 5 for r in range(world)]  # 2, 0, 3, 1 (, 4, 2): uneven, one empty
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(sizes[rank], D, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 23, (sizes[rank],), generator=g)
    loss = head(x, y, batch_sizes=sizes)
    loss.backward()
    return loss.detach(), x.grad, head.weight.grad


@pytest.mark.parametrize("world", [4, 6])
def test_head_with_two_stages_equals_flat_head(pools, world):
    flat, hier = pools(world).run(_head, False), pools(world).run(_head, True)
    for (l0, gx0, gw0), (l1, gx1, gw1) in zip(flat, hier):
        torch.testing.assert_close(l1, l0, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gx1, gx0, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gw1, gw0, rtol=1e-12, atol=1e-12)


def _bad_layout(rank, world):
    from ds_xc.parallel.node_gather import NodeGather
    from ds_xc.parallel.topology import NodeLayout
    with pytest.raises(ValueError, match="not regular"):
        NodeGather(NodeLayout(nodes=((0, 1, 2), (3,)), source="test"), dist.group.WORLD)
    with pytest.raises(ValueError, match="are not the group's"):
        NodeGather(NodeLayout(nodes=((0, 1), (2, 5)), source="test"), dist.group.WORLD)
    return True


def test_bad_layouts_are_refused(pools):
    assert all(pools(4).run(_bad_layout))

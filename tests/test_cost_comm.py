"""ds_xc/cost/comm.py: the collectives it lists are the ones the head step really runs, with the
bytes they really move (recorded on 2- and 3-rank gloo runs, uneven batches), and the alpha-beta
formulas give hand-worked values."""
from __future__ import annotations

import math

import pytest
import torch

from ds_xc.cost.comm import Collective, Link, collective_time, predict_time, ring_steps, step_collectives, wire_bytes

DIM, CLASSES = 8, 37


def _section(sampler, chunk, check_inputs=True):
    return {"num_classes": CLASSES, "embedding_dim": DIM, "chunk_size": chunk, "check_inputs": check_inputs,
            "loss": {"type": "cosface", "scale": 8.0}, "sampler": sampler,
            "optimizer": {"type": "sgd", "lr": 0.1}}


def _record(rank, world, section, sizes, pass_sizes):
    """Run two head steps with every collective recorded: [(kind, nbytes)] of the second."""
    import torch.distributed as dist

    import ds_xc
    import ds_xc.parallel.collectives as coll
    calls = []

    def wrap(kind, fn, which):
        def inner(*args, **kwargs):
            t = args[which]
            calls.append((kind, t.numel() * t.element_size()))
            return fn(*args, **kwargs)
        return inner

    saved = (dist.all_reduce, coll.gather_flat, coll.reduce_scatter_flat)
    dist.all_reduce = wrap("all_reduce", saved[0], 0)
    coll.gather_flat = wrap("all_gather", saved[1], 0)  # (out, x): the gathered output
    coll.reduce_scatter_flat = wrap("reduce_scatter", saved[2], 1)  # (out, x): the summed input
    try:
        head = ds_xc.ClassParallelHead.from_config(section, group=dist.group.WORLD)
        opt = ds_xc.build_head_optimizer(head, section["optimizer"])
        gen = torch.Generator().manual_seed(rank)
        for _ in range(2):
            calls.clear()
            x = torch.randn((sizes[rank], DIM), generator=gen, requires_grad=True)
            y = torch.randint(0, CLASSES, (sizes[rank],), generator=gen)
            loss = head(x, y, batch_sizes=sizes if pass_sizes else None)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        dist.all_reduce, coll.gather_flat, coll.reduce_scatter_flat = saved
    return list(calls)


CASES = [
    ({"type": "full"}, 3, False, True),
    ({"type": "uniform", "sample_rate": 0.5}, 4, True, True),
    ({"type": "ann", "sample_rate": 0.3, "groups": 2, "nlist": 2, "scan_rows": 8, "rerank": 8, "top_k": 4}, 2,
     False, False),
    ({"type": "ann", "sample_rate": 0.3, "nlist": 2, "metrics_interval": 1, "top_k": 4}, 0, True, False),
]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_byte_counts_equal_recorded_collectives(pools, world, case):
    sampler, chunk, pass_sizes, check = CASES[case]
    sizes = [5, 0, 7][:world] if world == 3 else [6, 3]
    section = _section(sampler, chunk, check)
    recorded = pools(world).run(_record, section, sizes, pass_sizes)
    assert all(r == recorded[0] for r in recorded)  # every rank runs the same collectives
    predicted = step_collectives({"extreme_classification": section}, world_size=world, batch_sizes=sizes,
                                 sizes_known=pass_sizes)
    # a count below 1 (amortised) is a collective of some steps: the second step runs it when due
    expanded = [(c.kind, c.nbytes) for c in predicted for _ in range(math.ceil(c.count))]
    assert sorted(expanded) == sorted(recorded[0])
    assert [k for k, _ in expanded] == [k for k, _ in recorded[0]] or sampler.get("metrics_interval")


def test_sizes_and_backbone():
    section = _section({"type": "full"}, 0)
    cs = step_collectives({"train_micro_batch_size_per_gpu": 4, "extreme_classification": section}, world_size=4,
                          backbone_params=1000)
    by = {c.name: c for c in cs}
    assert by["gather_embeddings"].nbytes == 4 * 4 * DIM * 4 and by["gather_labels"].nbytes == 4 * 4 * 8
    assert by["scatter_grad"].nbytes == 4 * 4 * DIM * 4 and by["input_check"].nbytes == 4 * 72
    assert by["softmax_stats"].nbytes == 4 * 16 * 3 * 4  # (P n, 3) float32, n = 16 rows
    assert by["backbone_grads"].nbytes == 4000 and by["backbone_grads"].group == "data"
    assert step_collectives(section, world_size=1, global_batch=9) == []
    with pytest.raises(ValueError, match="world_size"):
        step_collectives(section, world_size=0, global_batch=4)
    with pytest.raises(ValueError, match="batch_sizes"):
        step_collectives(section, world_size=2, batch_sizes=[1, 2, 3])
    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu"):
        step_collectives(section, world_size=2)


def test_ring_formulas_hand_worked():
    link = Link(1e9, 1e-4)  # 1 Gbit/s, 100 us
    ag = Collective("g", "all_gather", 4, 4_000_000)
    # 3 steps x (100 us + 1 MB x 8 / 1e9) = 3 x 8.1 ms
    assert collective_time(ag, link, ranks_per_node=1) == pytest.approx(3 * (1e-4 + 8e-3))
    ar = Collective("r", "all_reduce", 4, 4_000_000)
    assert collective_time(ar, link) == pytest.approx(6 * (1e-4 + 8e-3))
    rs = Collective("s", "reduce_scatter", 4, 4_000_000)
    assert collective_time(rs, link) == pytest.approx(6 * 8.1e-3)  # gloo: an all_reduce
    assert collective_time(rs, link, backend="nccl") == pytest.approx(3 * 8.1e-3)
    # a group inside one node (4 ranks per node) runs on the intra link
    intra = Link(8e9, 1e-5)
    assert collective_time(ag, link, ranks_per_node=4, intra=intra) == pytest.approx(3 * (1e-5 + 1e-3))
    assert collective_time(ag, link, ranks_per_node=2, intra=intra) == pytest.approx(3 * 8.1e-3)
    half = Collective("h", "all_gather", 4, 4_000_000, count=0.5)
    assert predict_time([ag, half], link) == pytest.approx(1.5 * 3 * 8.1e-3)
    assert ring_steps("all_reduce", 1) == (0, 0.0)
    assert wire_bytes(ar, ranks_per_node=2) == pytest.approx(6 * 1_000_000)
    assert wire_bytes(ar, ranks_per_node=4) == 0.0
    with pytest.raises(ValueError, match="bandwidth_bps"):
        Link(0, 1e-5)
    with pytest.raises(ValueError, match="kind"):
        Collective("x", "broadcast", 2, 1)
    with pytest.raises(ValueError, match="backend"):
        ring_steps("all_gather", 2, backend="mpi")

"""XCEngine with extreme_classification.topology: the hierarchical backbone reduction (ds_xc owns it)
moves the backbone and every head shard as the float64 single-process reference says, on 2 nodes
x 2 ranks and 3 nodes x 2 (simulated with topology.ranks_per_node on loopback gloo ranks), with
gradient accumulation; ``auto`` times both on a probe there (the timing injected: the choice follows the
slowest rank's times, agreed on every rank) and stays flat on one node; forced modes do not probe;
refusals name the key."""
import pytest
import torch

import ds_xc
from ds_xc.head import shard_range
from tests.test_engine import LR_BODY, LR_HEAD, C, _backbone, _batch, _config, check_one_step_against_reference


# injected probe timings {mode: seconds} per rank: "hier" faster everywhere; "mixed" faster on rank 0 only
# (rank 0 alone would choose hierarchical; the slowest rank's times say flat)
FAKE_TIMES = {"hier": lambda rank: {"flat": 2.0, "hierarchical": 1.0},
              "mixed": lambda rank: {"flat": 2.0, "hierarchical": 1.0 if rank == 0 else 3.0}}


def _steps(rank, world, reduction, rpn, gas, overlap=False, stage=0, fake="hier", head="auto"):
    from ds_xc.parallel import reduction_probe
    body = _backbone()
    cfg = _config(stage, gas)
    cfg["extreme_classification"]["topology"] = {"reduction": reduction, "ranks_per_node": rpn,
                                                 "bucket_size_mb": 1e-5, "head_collectives": head}
    if overlap:
        cfg["extreme_classification"]["overlap"] = {"enabled": True, "num_chunks": 2, "bucket_size_mb": 1e-5}
    from ds_xc.parallel import node_gather
    calls, real, real_exchange = [], reduction_probe.time_one, node_gather.time_exchange

    def timed(hier, group, mode, buf):  # the real reduction, the injected time
        calls.append(mode)
        real(hier, group, mode, buf)
        return FAKE_TIMES[fake](rank)[mode]

    def timed_exchange(plan, group, mode, rows):  # the head's probe: the real exchange, the injected time
        calls.append(("head", mode))
        real_exchange(plan, group, mode, rows)
        return FAKE_TIMES[fake](rank)[mode]
    reduction_probe.time_one, node_gather.time_exchange = timed, timed_exchange
    try:
        xc = ds_xc.initialize(model=body, optimizer=torch.optim.SGD(body.parameters(), lr=LR_BODY), config=cfg)
    finally:
        reduction_probe.time_one, node_gather.time_exchange = real, real_exchange
    losses = []
    for micro in range(gas):
        x, y = _batch(micro, rank)
        losses.append(xc.forward_backward(x, y).item())
        xc.step()
    reducer = xc.grad_reducer
    return {"w1": xc.head.weight.detach().clone(), "a1": xc.engine.module.weight.detach().clone(),
            "losses": losses, "steps": xc.global_steps, "allreduce_on": xc.engine.enable_backward_allreduce,
            "hier": reducer is not None and reducer.reduction is not None,
            "probe_calls": sum(1 for c in calls if not isinstance(c, tuple)),
            "head_probe_calls": sum(1 for c in calls if isinstance(c, tuple)),
            "head_hier": xc.head.node_gather is not None}


@pytest.mark.parametrize("world,reduction,rpn,gas,overlap,fake", [
    (4, "auto", 2, 2, False, "hier"), (6, "auto", 2, 1, False, "mixed"), (6, "hierarchical", 2, 1, False, "mixed"),
    (4, "hierarchical", 2, 1, True, "mixed"), (4, "auto", 0, 1, False, "hier"), (4, "flat", 2, 1, False, "hier")])
def test_hierarchical_engine_step_matches_reference(pools, world, reduction, rpn, gas, overlap, fake):
    res = pools(world).run(_steps, reduction, rpn, gas, overlap, 0, fake)
    a0, w0 = check_one_step_against_reference(res, world, gas)
    probed = reduction == "auto" and rpn == 2  # rpn 0: one host, one node: nothing to choose
    expect_hier = reduction == "hierarchical" or (probed and fake == "hier")
    for r in res:  # the default probe_repeats=3: one warm-up and 3 timed rounds of both modes; forced: none
        assert r["probe_calls"] == (8 if probed else 0)
    for rank, r in enumerate(res):
        start, n = shard_range(C, world, rank)
        expected = w0.detach()[start: start + n] - LR_HEAD * w0.grad[start: start + n]
        torch.testing.assert_close(r["w1"].double(), expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["a1"].double(), a0.detach() - LR_BODY * a0.grad, rtol=1e-5, atol=1e-6)
        assert r["hier"] == expect_hier and r["allreduce_on"] == (not expect_hier and not overlap)
        head_probed = rpn == 2 and not overlap  # head_collectives auto: its own probe where the two stages can run
        assert r["head_probe_calls"] == (8 if head_probed else 0)
        assert r["head_hier"] == (head_probed and fake == "hier")
        assert torch.equal(r["a1"], res[0]["a1"])  # the same backbone bits on every rank


def test_forced_hierarchical_refused_under_zero2(pools):
    with pytest.raises(RuntimeError, match="topology.reduction='hierarchical' with zero_optimization.stage=2"):
        pools(4).run(_steps, "hierarchical", 2, 1, False, 2)


@pytest.mark.parametrize("reduction,rpn,overlap,match", [
    ("auto", 0, False, "on 1 node"), ("hierarchical", 2, True, "with the overlap pipeline")])
def test_forced_hierarchical_head_collectives_refused(pools, reduction, rpn, overlap, match):
    with pytest.raises(RuntimeError, match=f"topology.head_collectives='hierarchical' {match}"):
        pools(4).run(_steps, reduction, rpn, 1, overlap, 0, "hier", "hierarchical")


def _head_forced(rank, world):
    """head_collectives forced while the backbone's reduction stays flat: the head alone runs in two stages."""
    return _steps(rank, world, "flat", 2, 1, head="hierarchical")


def test_forced_head_collectives_with_flat_backbone(pools):
    res = pools(4).run(_head_forced)
    a0, w0 = check_one_step_against_reference(res, 4, 1)
    for rank, r in enumerate(res):
        start, n = shard_range(C, 4, rank)
        expected = w0.detach()[start: start + n] - LR_HEAD * w0.grad[start: start + n]
        torch.testing.assert_close(r["w1"].double(), expected, rtol=1e-5, atol=1e-6)
        assert r["head_hier"] and not r["hier"] and r["allreduce_on"]


def _compressed(rank, world, by_topology):
    body = _backbone()
    cfg = _config(0, 1)
    cfg["gradient_compression"] = {"method": "topk", "density": 0.3, "min_numel": 1, "warmup_steps": 1}
    if by_topology:  # the node groups from the (simulated) layout, not set by hand
        cfg["extreme_classification"]["topology"] = {"reduction": "auto", "ranks_per_node": 2, "probe_repeats": 0,
                                                     "head_collectives": "flat"}  # the head alike in both runs
    else:
        cfg["gradient_compression"]["hierarchy"] = {"ranks_per_node": 2}
    xc = ds_xc.initialize(model=body, optimizer=torch.optim.SGD(body.parameters(), lr=LR_BODY), config=cfg)
    for step in range(3):  # one dense warm-up step, two compressed
        x, y = _batch(step, rank)
        xc.forward_backward(x, y)
        xc.step()
    nodes = xc.compression.nodes
    return {"a": xc.engine.module.weight.detach().clone(), "nodes": (nodes.num_nodes, nodes.local_size),
            "compressed": xc.compression.stats()["compressed_steps"]}


def test_compression_hierarchy_from_the_detected_layout(pools):
    """The compressed reduction's node groups come from the layout: the same steps as set by hand."""
    auto, by_hand = pools(4).run(_compressed, True), pools(4).run(_compressed, False)
    for a, h in zip(auto, by_hand):
        assert a["nodes"] == h["nodes"] == (2, 2) and a["compressed"] == h["compressed"] == 2
        assert torch.equal(a["a"], h["a"])

"""Single-process parts of the overlap pipeline: chunk sizes, bucket plans, the timeline,
input checks and the config section."""
import time

import pytest
import torch

import ds_xc
from ds_xc import ClassParallelHead
from ds_xc.overlap import BucketedGradReducer, ChunkedHeadSchedule, Timeline
from ds_xc.overlap.buckets import plan_buckets
from ds_xc.overlap.comm import split_sizes


@pytest.mark.parametrize("n,parts", [(10, 4), (3, 4), (0, 2), (8, 8), (7, 1)])
def test_split_sizes_are_tensor_split_sizes(n, parts):
    assert split_sizes(n, parts) == [t.shape[0] for t in torch.tensor_split(torch.arange(n), parts)]


def test_bucket_plan_is_reverse_order_bounded_and_per_dtype():
    params = [torch.zeros(100), torch.zeros(100), torch.zeros(500), torch.zeros(10, dtype=torch.float64),
              torch.zeros(50), torch.zeros(50)]
    buckets = plan_buckets(params, bucket_bytes=800)  # 200 float32 per bucket
    assert buckets == [[5, 4], [3], [2], [1, 0]]  # the oversized one alone; dtypes never mixed
    assert sorted(i for b in buckets for i in b) == list(range(len(params)))


class _SlowWork:
    def __init__(self, seconds):
        self.seconds = seconds

    def wait(self):
        time.sleep(self.seconds)


def test_timeline_counts_waits_as_exposed_and_the_rest_as_compute():
    tl = Timeline()
    tl.begin_step()
    tl.issued("gather", 1 << 20)
    time.sleep(0.03)  # "compute"
    tl.wait(_SlowWork(0.05), "gather")
    tl.wait(None, "gather")  # finished work costs nothing
    rec = tl.end_step()
    assert rec["exposed_s"] == pytest.approx(rec["exposed_gather_s"]) and rec["exposed_s"] >= 0.05
    assert rec["compute_s"] >= 0.03 and rec["step_s"] == pytest.approx(rec["compute_s"] + rec["exposed_s"])
    assert rec["issued"] == 1 and rec["issued_mb"] == pytest.approx(1.0)
    assert tl.summary()["steps"] == 1 and "exposed comm" in Timeline.format(rec)
    assert tl.end_step() == {}  # no open step


def test_schedule_rejects_chunks_that_break_the_split_rule_and_bad_labels():
    head = ClassParallelHead(4, 10)
    sched = ChunkedHeadSchedule(head, 2)
    x = torch.randn(5, 4, requires_grad=True)
    with pytest.raises(ValueError, match=r"must have \[3, 2\]"):
        sched.run([x[:2], x[2:]], torch.zeros(5, dtype=torch.int64))
    with pytest.raises(ValueError, match="got 3 embedding chunks"):
        sched.run([x[:2], x[2:4], x[4:]], torch.zeros(5, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"labels must have shape \(5,\)"):
        sched.run(x, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="label 10 at position 1"):
        sched.run(x, torch.tensor([0, 10, 1, 2, 3]))
    assert head.weight.grad is None and x.grad is None  # nothing was touched


def test_schedule_one_process_matches_the_head_and_reducer_finishes_unarmed():
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 4)
    heads = [ClassParallelHead(4, 9, loss={"type": "cosface", "scale": 8.0, "margin": 0.2}, seed=1) for _ in range(2)]
    x, y = torch.randn(7, 3), torch.randint(0, 9, (7,))
    ref = heads[0](net(x), y)
    ref.backward()
    ref_grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    red = BucketedGradReducer(list(net.parameters()), bucket_bytes=16)
    loss = ChunkedHeadSchedule(heads[1], 3).run_backbone(net, x, y)
    red.finish()  # never armed: launches everything itself (one process: a no-op mean)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    torch.testing.assert_close(heads[1].weight.grad, heads[0].weight.grad, rtol=1e-5, atol=1e-7)
    for p, g in zip(net.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-7)
    red.remove()


def test_overlap_section_defaults_and_errors():
    cfg = ds_xc.parse_config({"extreme_classification": {"num_classes": 10, "embedding_dim": 4}})
    ov = cfg.extreme_classification.overlap
    assert (ov.enabled, ov.num_chunks, ov.chunk_backbone, ov.overlap_grad_reduce) == (False, 2, False, True)
    with pytest.raises(ds_xc.ConfigError, match=r"extreme_classification.overlap.num_chunks: got 0"):
        ds_xc.parse_config({"extreme_classification": {"num_classes": 10, "embedding_dim": 4,
                                                       "overlap": {"num_chunks": 0}}})
    with pytest.raises(ds_xc.ConfigError, match=r"overlap.chunks"):
        ds_xc.parse_config({"extreme_classification": {"num_classes": 10, "embedding_dim": 4,
                                                       "overlap": {"chunks": 2}}})

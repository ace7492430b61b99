"""The CPU proxies of the GPU step, held to committed budgets (issue 55; benchmarks/step_counts.py).

* The counter counts what it claims: item(), nonzero, unique, boolean masks, repeat_interleave
  without output_size, tolist / cpu / numpy, tensors made from host data; views and allocations
  are not launches.
* At the library defaults (10^5 classes, batch 512, d = 128, sample rate 0.1, softmax, SGD,
  update auto), after warm-up, a uniform, ann and knn step makes at most 1 host sync (the input
  check) and at most 2x (uniform) / 3x (ann, knn) the ops of a Partial-FC-equivalent step counted
  the same way; with check_interval 4 and batch_sizes given the steps between checks make none.
* Every sampled head, update mode and loss (smaller sizes): no host sync but the input check.
"""
import os
import sys

import pytest
import torch

from ds_xc.host_syncs import StepCounter, count_steps

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import step_counts as bench  # noqa: E402

pytestmark = pytest.mark.xdist_group("step_counts")


def test_the_counter_counts_syncs_and_launches():
    x = torch.randn(6)
    counter = StepCounter()
    with counter:
        y = x * 2  # one launch
        _ = x.view(2, 3)  # a view: nothing
        _ = torch.empty(3)  # an allocation: nothing
        _ = float(y.sum())  # a launch and an item
        _ = y[y > 0]  # a launch (gt) and a boolean mask
        _ = torch.nonzero(y)
        _ = torch.unique(y)
        _ = y.tolist()
        _ = torch.tensor([1.0, 2.0])  # host data
        _ = torch.repeat_interleave(torch.arange(3, dtype=torch.int64), torch.ones(3, dtype=torch.int64))
    assert counter.syncs == {"item": 1, "dynamic": 4, "host_read": 1, "host_data": 1}
    assert counter.ops["mul"] == 1 and counter.ops["sum"] == 1 and counter.ops["gt"] == 1
    assert "view" not in counter.ops and "empty" not in counter.ops
    assert any("test_step_counts" not in k for k in counter.where)  # each sync is placed


@pytest.fixture(scope="module")
def pfc_ops():
    return count_steps(bench.pfc_step(), warmup=2, steps=2, where=False).ops


@pytest.mark.parametrize("sampler", ["uniform", "ann", "knn"])
def test_defaults_within_the_budgets(sampler, pfc_ops):
    counts = count_steps(bench.ds_xc_step(sampler), warmup=3, steps=3)
    max_syncs, max_ratio = bench.BUDGETS[sampler]
    assert counts.syncs <= max_syncs, counts.describe()
    assert set(counts.by_kind) <= {"host_read"}, counts.describe()  # the input check's one .tolist()
    assert counts.ops <= max_ratio * pfc_ops, (counts.ops, pfc_ops, counts.top_ops)


@pytest.mark.parametrize("sampler", ["uniform", "ann", "knn"])
def test_no_sync_between_input_checks(sampler):
    step = bench.ds_xc_step(sampler, check_interval=4)
    for i in range(4):  # warm-up; the next call (4) is checked, 5-7 are not
        step(i)
    step(4)
    counter = StepCounter()
    with counter:
        for i in range(5, 8):
            step(i)
    assert counter.total_syncs == 0, dict(counter.where)


SMALL = dict(bench.SIZES, num_classes=4000, batch=96, dim=32)


@pytest.mark.parametrize("sampler", ["uniform", "ann", "knn"])
@pytest.mark.parametrize("update", ["lazy_exact", "lazy"])
def test_no_coalesce_of_the_row_gradient_outside_the_counter(sampler, update, monkeypatch):
    """Under a dispatch mode torch's gradient accumulation keeps a sparse gradient's coalesced mark; in an
    ordinary step it drops it, and a coalesce (sort + unique: a host sync on a GPU) would follow. The head
    optimizer reads the head's own sorted rows instead: no coalesce in ordinary steps either."""
    calls = []
    real = torch.Tensor.coalesce
    monkeypatch.setattr(torch.Tensor, "coalesce", lambda t, *a, **k: calls.append(1) or real(t, *a, **k))
    step = bench.ds_xc_step(sampler, SMALL, update=update)
    for i in range(4):
        step(i)
    assert calls == []
CASES = [(s, u, "softmax", "sgd") for s in ("uniform", "ann", "knn") for u in ("lazy_exact", "lazy", "dense")]
CASES += [(s, "auto", loss, "sgd") for s in ("uniform", "ann", "knn") for loss in ("cosface", "arcface", "combined",
                                                                                   "dsoftmax")]
CASES += [(s, "auto", "softmax", "adamw") for s in ("uniform", "ann", "knn")]


@pytest.mark.parametrize("sampler,update,loss,optimizer", CASES)
def test_every_head_update_and_loss_is_sync_free(sampler, update, loss, optimizer):
    opt = bench.SGD if optimizer == "sgd" else {"type": "adamw", "lr": 1e-3}
    step = bench.ds_xc_step(sampler, SMALL, update=update, loss=loss, optimizer=opt)
    counts = count_steps(step, warmup=3, steps=2)
    assert counts.syncs <= 1 and set(counts.by_kind) <= {"host_read"}, counts.describe()

"""The head's input checks on 2 gloo ranks, serial and through the overlap schedule.

Each provoked fault (labels on another device, batch_sizes that do not match the rows,
an out-of-range label, NaN embeddings in the schedule's backbone mode) must raise on every
rank with a message naming the argument, the value and what is allowed (or the rank at
fault), before any gather of the step is issued, leaving the weights and the optimizer
state unchanged, and the ranks still in step (a good call afterwards works). Unchecked
steps (``check_inputs=False``, ``check_interval``) never train silently on out-of-range
labels: the loss is NaN on every rank and the count is raised at the next check.
"""
import math

import pytest
import torch

from ds_xc import ClassParallelHead
from ds_xc.head import HeadSGD
from ds_xc.overlap import ChunkedHeadSchedule, Timeline
from tests.test_uneven_dist import C, D, SEED, _comm_group, local_batch

SIZES = (4, 1)


def _head(**kw):
    return ClassParallelHead(D, C, sampler={"type": "uniform", "sample_rate": 0.5}, dtype=torch.float64,
                             init_std=0.5, seed=SEED, **kw)


def _call(head, mode, x, y, batch_sizes=None, world=2, timeline=None):
    """One head step, serial or scheduled; returns the loss (the backward has run)."""
    if mode == "serial":
        loss = head(x, y, batch_sizes=batch_sizes)
        loss.backward()
        return loss.detach()
    sched = ChunkedHeadSchedule(head, 2, timeline=timeline, comm_group=_comm_group(world))
    if mode == "backbone":
        return sched.run_backbone(lambda part: part * 1.0, x, y, batch_sizes)
    return sched.run(x * 1.0, y, batch_sizes)


def _provoke(rank, world, kind, mode):
    head = _head()
    opt = HeadSGD([head.weight], lr=0.1, momentum=0.9)
    x, y = local_batch(rank, SIZES[rank], 3)
    x.requires_grad_()
    _call(head, mode, x, y, world=world)  # a good step first: the optimizer has state
    opt.step()
    opt.zero_grad(set_to_none=True)
    weight = head.weight.detach().clone()
    state = {k: v.clone() for k, v in opt.state[head.weight].items() if torch.is_tensor(v)}
    sampler = head.sampler.state_dict()
    bad_x, bad_y, sizes = x.detach().clone().requires_grad_(), y.clone(), None
    if kind == "device" and rank == 1:
        bad_y = bad_y.to("meta")
    elif kind == "batch_sizes":
        sizes = [SIZES[0], SIZES[1] + 1]
    elif kind == "label" and rank == 1:
        bad_y[0] = C + 3
    elif kind == "nonfinite" and rank == 1:
        bad_x = torch.full_like(bad_x, float("nan")).requires_grad_()
    timeline = Timeline()
    timeline.begin_step()
    try:
        _call(head, mode, bad_x, bad_y, sizes, world, timeline)
        msg = None
    except (ValueError, FloatingPointError) as exc:
        msg = f"{type(exc).__name__}: {exc}"
    issued = timeline.end_step()["issued"]
    unchanged = (torch.equal(head.weight.detach(), weight) and head.weight.grad is None
                 and all(torch.equal(opt.state[head.weight][k], v) for k, v in state.items())
                 and str(head.sampler.state_dict()) == str(sampler))
    after = _call(head, mode, x, y, world=world)  # the ranks are still in step
    return {"msg": msg, "issued": issued, "unchanged": unchanged, "after": float(after)}


EXPECTED = {  # (message on the rank at fault (rank 1), message on the other rank)
    "device": ("labels must be on the embeddings' device cpu, got meta on rank 1", "another rank reported"),
    "batch_sizes": (f"batch_sizes [4, 2] do not match the rows the ranks passed, {list(SIZES)} (wrong for rank(s) "
                    "[1]; this is rank 1)", "batch_sizes [4, 2] do not match the rows the ranks passed, [4, 1]"),
    "label": (f"label {C + 3} at position 0 on rank 1 is outside [0, {C})", "another rank reported"),
    "nonfinite": ("NaN or Inf", "NaN or Inf"),
}


@pytest.mark.parametrize("mode", ["serial", "overlap", "backbone"])
def test_faults_raise_on_every_rank_before_any_gather(pools, mode):
    for kind, (at_fault, other) in EXPECTED.items():
        res = pools(2).run(_provoke, kind, mode)
        assert at_fault in (res[1]["msg"] or ""), (kind, res[1]["msg"])
        assert other in (res[0]["msg"] or ""), (kind, res[0]["msg"])
        if kind == "nonfinite":
            assert res[0]["msg"].startswith("FloatingPointError"), res[0]["msg"]
            if mode == "backbone":  # found on the gathered rows: the gathers ran, nothing else
                assert "rank(s) [1]" in res[0]["msg"] and "rank(s) [1]" in res[1]["msg"]
            else:
                assert res[0]["issued"] == res[1]["issued"] == 0, (kind, res)
        elif mode != "serial":
            assert res[0]["issued"] == res[1]["issued"] == 0, (kind, res)  # checked before any gather
        for r in res:
            assert r["unchanged"], (kind, mode, r)
            assert math.isfinite(r["after"]) and r["after"] == res[0]["after"]


def _unchecked(rank, world, mode, check_inputs, interval):
    """Out-of-range labels in steps without a check: NaN loss, then raised at the next check."""
    head = _head(check_inputs=check_inputs, check_interval=interval)
    x, y = local_batch(rank, SIZES[rank], 5)
    x.requires_grad_()
    bad = y.clone()
    if rank == 1:
        bad[0] = -2
    out = {"losses": []}
    if interval > 1:
        out["losses"].append(float(_call(head, mode, x, y, list(SIZES), world)))  # call 0: checked
    out["losses"].append(float(_call(head, mode, x, bad, list(SIZES), world)))  # unchecked, sizes trusted
    out["losses"].append(float(_call(head, mode, x, y, list(SIZES), world)))  # unchecked, good labels
    try:  # check_inputs=False: the next exchange (batch_sizes=None); check_interval=3: call 3, checked
        _call(head, mode, x, y, None if not check_inputs else list(SIZES), world)
        out["late"] = None
    except ValueError as exc:
        out["late"] = str(exc)
    try:  # an exchange step (batch_sizes=None): the label range is tested even without a full check
        _call(head, mode, x, bad, None, world)
        out["now"] = None
    except ValueError as exc:
        out["now"] = str(exc)
    return out


@pytest.mark.parametrize("mode", ["serial", "overlap"])
@pytest.mark.parametrize("check_inputs,interval", [(False, 1), (True, 3)])
def test_unchecked_steps_never_drop_out_of_range_labels_silently(pools, mode, check_inputs, interval):
    res = pools(2).run(_unchecked, mode, check_inputs, interval)
    for rank, r in enumerate(res):
        losses = r["losses"][1:] if interval > 1 else r["losses"]
        assert math.isnan(losses[0]), r  # the step with the bad label: NaN on every rank
        assert math.isfinite(losses[1]), r
        assert f"1 label(s) outside [0, {C}) were seen in the steps since the last check" in (r["late"] or ""), r
        assert f"check_interval={interval}" in r["late"]
        expected = f"label -2 at position 0 on rank 1 is outside [0, {C})" if rank == 1 else "another rank"
        assert expected in (r["now"] or ""), r


def test_check_interval_is_validated():
    with pytest.raises(Exception, match="check_interval: got 0; must be >= 1"):
        _head(check_interval=0)


# ---------------------------------------------------------------------------- through XCEngine
def _engine_unchecked(rank, world, case):
    """check_inputs off, batch_sizes passed: a bad label's step is skipped by XCEngine (NaN loss), nothing
    changes, and the count is raised at the next exchange (a call without batch_sizes)."""
    import ds_xc
    from tests import test_reliability as rel
    torch.manual_seed(rel.SEED)
    body = rel.Body()
    config = rel._config(**rel.CASES[case])
    config["extreme_classification"]["check_inputs"] = False
    xc = ds_xc.initialize(model=body, optimizer=torch.optim.SGD(body.parameters(), lr=0.1, momentum=0.9),
                          config=config)
    sizes = [rel.B] * world
    x, y = rel._batch(0, rank)
    xc.forward_backward(x, y, sizes)
    xc.step()
    before = rel._state(xc)
    x, y = rel._batch(1, rank)
    if rank == 1:
        y[1] = rel.C + 5
    loss = xc.forward_backward(x, y, sizes).item()
    xc.step()
    rel._assert_same(before, rel._state(xc))
    try:
        xc.forward_backward(*rel._batch(2, rank))
        late = None
    except ValueError as exc:
        late = str(exc)
    return {"loss": loss, "skipped": xc.stats()["skipped_steps"], "late": late}


@pytest.mark.parametrize("case", ["exact_sgd", "uniform_lazy_adamw_compressed_overlap"])
def test_engine_skips_an_unchecked_step_with_an_out_of_range_label(pools, case):
    from tests.test_reliability import C as REL_C
    for r in pools(2).run(_engine_unchecked, case):
        assert math.isnan(r["loss"]) and r["skipped"] == 1, r
        assert f"1 label(s) outside [0, {REL_C}) were seen" in (r["late"] or ""), r

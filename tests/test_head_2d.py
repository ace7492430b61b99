"""2-D head layout (classes over a class group, each shard replicated over a replica group)
on 4 and 3 gloo ranks == the float64 single-process reference of the whole global batch.

Layouts are written "classes x replicas": 2x2, 4x1, 1x4 (and 3x1, 1x3). Rank r = replica *
classes + class rank. Rows per rank are uneven and change every step (one rank has none in
a step); 17 classes are uneven over 2, 3 and 4 shards. Each step checks the loss (the mean
over the union of all ranks' rows), every rank's embedding gradient (world size x d(global
mean)/d(own rows)), and after the head optimizer's step the weights and the optimizer state
against a dense torch.optim on the full matrix; replicas of a shard must hold the same bits.
Sampled heads: the reference scores each class group's rows against the union of that
group's active sets (which differ between replica groups).
"""
import importlib.util
import json
import os

import pytest
import torch

from ds_xc import ClassParallelHead, build_head_optimizer
from ds_xc.checkpoint import load_head_state, save_head_state
from ds_xc.head import init_shard, shard_range
from ds_xc.parallel.groups import new_groups
from tests.reference import LOSSES, per_row_loss

C, D, SEED, STD = 17, 6, 7, 0.5
ROWS = [3, 1, 4, 0, 2]
SGD = {"type": "sgd", "lr": 0.5, "momentum": 0.9, "weight_decay": 0.01}
ADAMW = {"type": "adamw", "lr": 0.05, "weight_decay": 0.01}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def batch(rank, step):
    g = torch.Generator().manual_seed(SEED * 1000 + 10 * step + rank)
    n = ROWS[(rank + 2 * step) % len(ROWS)]
    return torch.randn(n, D, generator=g, dtype=torch.float64), torch.randint(0, C, (n,), generator=g)


def layout(world, classes):
    """(class group, replica group) of this rank: class groups are runs of ``classes`` ranks."""
    replicas = world // classes
    cg = new_groups([[r * classes + c for c in range(classes)] for r in range(replicas)])
    rg = new_groups([[r * classes + c for r in range(replicas)] for c in range(classes)])
    return cg, rg


def _state(opt, head):
    opt.catch_up_all()  # lazy_exact: every row current (a no-op for other modes)
    return {k: v.clone() for k, v in opt.state[head.weight].items() if torch.is_tensor(v) and v.dim() >= 1}


def _steps(head, opt, rank, first, last):
    out = []
    for step in range(first, last):
        x, y = batch(rank, step)
        x.requires_grad_()
        loss = head(x, y)
        loss.backward()
        index = head.last_active.index
        opt.step()
        opt.zero_grad(set_to_none=True)
        state = _state(opt, head)  # first: it catches lazy_exact rows up
        out.append({"loss": loss.item(), "gx": x.grad.clone(), "weight": head.weight.detach().clone(),
                    "state": state,
                    "active": None if index is None else (index + head.class_start).tolist()})
    return out


def _run(rank, world, classes, loss, sampler, update, opt_cfg, steps, save_tag=None):
    cg, rg = layout(world, classes)
    head = ClassParallelHead(D, C, loss=loss, sampler=sampler, group=cg, replica_group=rg, dtype=torch.float64,
                             init_std=STD, seed=SEED, update=update)
    opt = build_head_optimizer(head, dict(opt_cfg, update=update))
    out = _steps(head, opt, rank, 0, steps)
    if save_tag is not None:
        save_head_state(save_tag, head, opt)
    return {"class_rank": head.rank, "replica": head.replicas.rank, "start": head.class_start, "steps": out}


def _resume(rank, world, classes, tag, opt_cfg, first, last):
    cg, rg = layout(world, classes)
    head = ClassParallelHead(D, C, group=cg, replica_group=rg, dtype=torch.float64, init_std=0.1, seed=SEED + 1)
    opt = build_head_optimizer(head, opt_cfg)
    load_head_state(tag, head, opt)
    loaded = {"weight": head.weight.detach().clone(), "state": _state(opt, head)}
    return {"class_rank": head.rank, "start": head.class_start, "loaded": loaded,
            "steps": _steps(head, opt, rank, first, last)}


def reference(world, classes, loss_cfg, opt_cfg, steps, actives=None, replicated=False):
    """Per step: (loss, dL/dX (N, d) of the global batch in world-rank order, W after the step,
    optimizer state rows), dense float64 on one process. ``actives[step][g]``: the active classes
    of class group g (None: every class). ``replicated``: class group g's rows are those of its
    first rank, once (input_parallel="replicated")."""
    owners = [g * classes for g in range(world // classes)] if replicated else list(range(world))
    per = 1 if replicated else classes  # row blocks per class group
    w = torch.nn.Parameter(init_shard(C, D, 0, C, STD, SEED, torch.float64))
    kind = torch.optim.SGD if opt_cfg["type"] == "sgd" else torch.optim.AdamW
    opt = kind([w], **{k: v for k, v in opt_cfg.items() if k != "type"})
    out = []
    for step in range(steps):
        xs, ys = zip(*(batch(r, step) for r in owners))
        x = torch.cat(xs).requires_grad_()
        y = torch.cat(ys)
        n = x.shape[0]
        bounds = torch.tensor([0] + [b.shape[0] for b in xs]).cumsum(0).tolist()
        total = 0.0
        for g in range(world // classes):  # class group g: world ranks [g * classes, (g + 1) * classes)
            a, b = bounds[g * per], bounds[(g + 1) * per]
            if actives is None or actives[step][g] is None:
                total = total + per_row_loss(x[a:b], w, y[a:b], loss_cfg).sum()
                continue
            act = torch.tensor(sorted(actives[step][g]))
            assert torch.isin(y[a:b], act).all(), "a positive class was not active"
            remap = torch.full((C,), -1, dtype=torch.int64)
            remap[act] = torch.arange(act.numel())
            total = total + per_row_loss(x[a:b], w[act], remap[y[a:b]], loss_cfg).sum()
        loss = total / n
        opt.zero_grad()
        loss.backward()
        opt.step()
        state = {k: v.detach().clone() for k, v in opt.state[w].items() if torch.is_tensor(v) and v.dim() >= 1}
        out.append({"loss": loss.item(), "gx": x.grad.clone(), "bounds": bounds, "weight": w.detach().clone(),
                    "state": state})
    return out


def _actives(results, world, classes, steps):
    """actives[step][g]: the union of class group g's active sets (None for a full head)."""
    out = []
    for s in range(steps):
        per_group = []
        for g in range(world // classes):
            sets = [results[g * classes + c]["steps"][s]["active"] for c in range(classes)]
            per_group.append(None if sets[0] is None else sorted(set().union(*sets)))
        out.append(per_group)
    return out


def _compare(results, ref, world, step_offset=0, atol=1e-10):
    for rank, res in enumerate(results):
        start, count = shard_range(C, len({r["class_rank"] for r in results}), res["class_rank"])
        assert res["start"] == start
        for s, got in enumerate(res["steps"]):
            want = ref[s + step_offset]
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-10), (rank, s)
            a, b = want["bounds"][rank], want["bounds"][rank + 1]
            torch.testing.assert_close(got["gx"], want["gx"][a:b] * world, rtol=1e-8, atol=atol)
            torch.testing.assert_close(got["weight"], want["weight"][start: start + count], rtol=1e-9, atol=atol)
            for key, value in want["state"].items():
                torch.testing.assert_close(got["state"][key], value[start: start + count], rtol=1e-9, atol=atol)


def _replicas_identical(results):
    """Replicas of a shard hold the same bits: weights and optimizer state, every step."""
    by_shard = {}
    for res in results:
        by_shard.setdefault(res["class_rank"], []).append(res)
    for group in by_shard.values():
        for other in group[1:]:
            for s, (a, b) in enumerate(zip(group[0]["steps"], other["steps"])):
                assert torch.equal(a["weight"], b["weight"]), s
                assert a["state"].keys() == b["state"].keys()
                assert all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"]), s


@pytest.mark.parametrize("classes", [2, 4, 1])
@pytest.mark.parametrize("loss,sampler,update,opt", [
    ("cosface", "full", "dense", SGD),
    ("softmax", "full", "lazy_exact", ADAMW),
    ("arcface", {"type": "uniform", "sample_rate": 0.4}, "lazy_exact", SGD),
    ("softmax", {"type": "uniform", "sample_rate": 0.3}, "dense", SGD),
])
def test_2d_matches_reference_on_4_ranks(pools, classes, loss, sampler, update, opt):
    steps = 3
    results = pools(4).run(_run, classes, LOSSES[loss], sampler, update, opt, steps)
    actives = _actives(results, 4, classes, steps)
    ref = reference(4, classes, LOSSES[loss], opt, steps, actives)
    atol = 1e-9 if opt is ADAMW else 1e-10  # lazy_exact AdamW drops eps in skipped steps (here: none)
    _compare(results, ref, 4, atol=atol)
    _replicas_identical(results)
    if not isinstance(sampler, str) and classes < 4:  # replica groups really differ in their active sets
        assert any(len({tuple(g) for g in per_step}) > 1 for per_step in actives)


@pytest.mark.parametrize("classes", [3, 1])
def test_2d_on_3_ranks(pools, classes):
    sampler = {"type": "uniform", "sample_rate": 0.5}
    results = pools(3).run(_run, classes, LOSSES["softmax"], sampler, "lazy_exact", SGD, 2)
    ref = reference(3, classes, LOSSES["softmax"], SGD, 2, _actives(results, 3, classes, 2))
    _compare(results, ref, 3)
    _replicas_identical(results)


def _reshard_module():
    spec = importlib.util.spec_from_file_location("ds_xc_launch_reshard_2d", os.path.join(ROOT, "launch", "reshard.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_checkpoint_2x2_loads_under_4x1_1x4_and_one_process(pools, tmp_path):
    tag = str(tmp_path / "ckpt_2x2")
    results = pools(4).run(_run, 2, LOSSES["softmax"], "full", "dense", SGD, 2, tag)
    ref = reference(4, 2, LOSSES["softmax"], SGD, 3)
    _compare(results, ref, 4)
    names = sorted(os.listdir(os.path.join(tag, "ds_xc_head")))
    assert names == ["meta.json", "shard_00000_of_00002.pt", "shard_00001_of_00002.pt"]  # once per shard
    with open(os.path.join(tag, "ds_xc_head", "meta.json")) as fh:
        assert json.load(fh)["layout"] == {"class_shards": 2, "replicas": 2}
    reshard = _reshard_module()
    tags = {}
    for shards in (4, 1):
        tags[shards] = str(tmp_path / f"ckpt_{shards}")
        reshard.reshard_head(tag, tags[shards], shards)
    for classes in (4, 1):  # 4x1 and 1x4: load, compare, and one more step against the reference
        out = pools(4).run(_resume, classes, tags[classes], SGD, 2, 3)
        for res in out:
            start, count = shard_range(C, classes, res["class_rank"])
            torch.testing.assert_close(res["loaded"]["weight"], ref[1]["weight"][start: start + count],
                                       rtol=0, atol=1e-12)
            torch.testing.assert_close(res["loaded"]["state"]["momentum_buffer"],
                                       ref[1]["state"]["momentum_buffer"][start: start + count], rtol=0, atol=1e-12)
        _compare(out, ref, 4, step_offset=2)
    head = ClassParallelHead(D, C, dtype=torch.float64, seed=SEED)  # one process, no group
    opt = build_head_optimizer(head, SGD)
    load_head_state(tags[1], head, opt)
    torch.testing.assert_close(head.weight.detach(), ref[1]["weight"], rtol=0, atol=1e-12)
    torch.testing.assert_close(_state(opt, head)["momentum_buffer"], ref[1]["state"]["momentum_buffer"],
                               rtol=0, atol=1e-12)


def _run_replicated(rank, world, classes, steps):
    cg, rg = layout(world, classes)
    head = ClassParallelHead(D, C, loss=LOSSES["cosface"], group=cg, replica_group=rg, dtype=torch.float64,
                             init_std=STD, seed=SEED, input_parallel="replicated")
    opt = build_head_optimizer(head, dict(SGD, update="dense"))
    out = []
    for step in range(steps):
        x, y = batch(rank - head.rank, step)  # the rows of the class group's first rank, on all of it
        x.requires_grad_()
        loss = head(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append({"loss": loss.item(), "gx": x.grad.clone(), "weight": head.weight.detach().clone()})
    return {"class_rank": head.rank, "start": head.class_start, "steps": out}


def test_2d_replicated_input(pools):
    """input_parallel="replicated" in 2x2: the rows are shared inside a class group, the global
    batch is the union of the class groups' rows, and the embedding gradient is Pr x d(mean)/dx."""
    results = pools(4).run(_run_replicated, 2, 3)
    ref = reference(4, 2, LOSSES["cosface"], SGD, 3, replicated=True)
    for rank, res in enumerate(results):
        start, count = shard_range(C, 2, res["class_rank"])
        for s, got in enumerate(res["steps"]):
            a, b = ref[s]["bounds"][rank // 2], ref[s]["bounds"][rank // 2 + 1]
            assert got["loss"] == pytest.approx(ref[s]["loss"], rel=1e-10)
            torch.testing.assert_close(got["gx"], ref[s]["gx"][a:b] * 2, rtol=1e-8, atol=1e-10)
            torch.testing.assert_close(got["weight"], ref[s]["weight"][start: start + count], rtol=1e-9, atol=1e-10)


def _run_bad_label(rank, world, classes):
    cg, rg = layout(world, classes)
    head = ClassParallelHead(D, C, group=cg, replica_group=rg, dtype=torch.float64, seed=SEED)
    x, y = batch(rank, 0)
    if rank == 1:
        x, y = torch.zeros(2, D, dtype=torch.float64), torch.tensor([0, C + 3])
    try:
        head(x, y)
    except ValueError as exc:
        return str(exc)
    return None


def test_2d_bad_input_raises_in_every_class_group(pools):
    """A bad label in class group {0, 1} raises there and, through the replica all-reduce, in
    class group {2, 3} as well: no rank is left waiting in a collective."""
    errors = pools(4).run(_run_bad_label, 2)
    assert all(e is not None for e in errors), errors
    assert f"label {C + 3}" in errors[1] and "another rank" in errors[0]
    assert all("other class group" in e for e in errors[2:]), errors

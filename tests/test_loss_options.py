"""Loss options (issue 57): ignore_index, label_smoothing, z_loss, softcap, reduction, sample weights and
(B, T) sequences, for every loss, on 1, 2 and 3 gloo ranks == the float64 single-process reference
(tests/reference.py, option_reference).

17 classes are uneven over 2 and 3 shards; local batches are uneven (one rank has none). Every rank
checks the value (reduction none: its own rows), its embedding gradient (P x the gradient of the global
loss with respect to its rows; for none the global loss is sum over ranks of <upstream, rows>), the
gradient of its weight shard and ``last_lse``.
"""
import pytest
import torch
import torch.nn.functional as F

from ds_xc import ClassParallelHead
from ds_xc.config import ConfigError
from ds_xc.head import init_shard, shard_range
from tests.reference import LOSSES, option_reference, option_rows

C, D, SEED, T = 17, 6, 11, 2
SIZES = {1: [7], 2: [5, 3], 3: [4, 0, 6]}
CASES = [  # opts; sample weights; some labels ignored; chunk rows; (B, T) sequences
    dict(opts={"label_smoothing": 0.1}, weights=True, ignore=True, chunk=3),
    dict(opts={"z_loss": 0.01, "reduction": "sum", "ignore_index": 3}, weights=False, ignore=True, chunk=0),
    dict(opts={"reduction": "none", "label_smoothing": 0.2, "z_loss": 0.05}, weights=True, ignore=True, chunk=2,
         seq=True),
    dict(opts={"label_smoothing": 0.3, "z_loss": 0.02}, weights=False, ignore=False, chunk=0),
]
SOFTCAP_CASES = [
    dict(opts={"softcap": 2.0, "label_smoothing": 0.1, "reduction": "sum"}, weights=True, ignore=True, chunk=2),
    dict(opts={"softcap": 1.5, "z_loss": 0.03}, weights=False, ignore=True, chunk=0, seq=True),
]


def local_case(rank, sizes, case, index):
    """This rank's rows: x (b, d) or (b, T, d), labels, sample weights (or None), upstream of reduction none."""
    g = torch.Generator().manual_seed(SEED * 1000 + 10 * index + rank)
    shape = (sizes[rank], T) if case.get("seq") else (sizes[rank],)
    x = torch.randn(shape + (D,), generator=g, dtype=torch.float64)
    y = torch.randint(0, C, shape, generator=g)
    if case["ignore"]:
        flat = y.view(-1)
        flat[::3] = case["opts"].get("ignore_index", -100)
    sw = torch.rand(shape, generator=g, dtype=torch.float64) + 0.5 if case["weights"] else None
    u = torch.rand(shape, generator=g, dtype=torch.float64) + 0.5
    return x, y, sw, u


def _run_cases(rank, world, loss_cfg, cases, sizes, extra):
    """Every case on this rank. extra: head keywords, and "classes" (a 2-D layout: class groups of that
    many ranks, the shard replicated over the rest) or "overlap" (ChunkedHeadSchedule with that many chunks)."""
    extra = dict(extra)
    classes, chunks = extra.pop("classes", None), extra.pop("overlap", None)
    if classes is not None:
        from ds_xc.parallel.groups import new_groups
        reps = world // classes
        extra["group"] = new_groups([[r * classes + c for c in range(classes)] for r in range(reps)])
        extra["replica_group"] = new_groups([[r * classes + c for r in range(reps)] for c in range(classes)])
    out = []
    for i, case in enumerate(cases):
        head = ClassParallelHead(D, C, loss={**loss_cfg, **case["opts"]}, chunk_size=case["chunk"],
                                 dtype=torch.float64, init_std=0.5, seed=SEED, **extra)
        x, y, sw, u = local_case(rank, sizes, case, i)
        x.requires_grad_()
        if chunks:
            from ds_xc.overlap import ChunkedHeadSchedule
            res = ChunkedHeadSchedule(head, chunks).run(x, y)  # the backbone's backward: x.grad
        else:
            res = head(x, y, sw)
            (res if res.dim() == 0 else (res * u).sum()).backward()
        head.replicas.reduce_grad_(head.weight)  # 2-D: the shard's gradient summed over its replicas
        gw = head.weight.grad
        out.append(dict(value=res.detach(), gx=x.grad, gw=gw.to_dense() if gw.is_sparse else gw, lse=head.last_lse,
                        start=head.class_start))
    return out


def _check(results, loss_cfg, cases, sizes, replicated=False, classes=None):
    world = len(results)
    classes = classes or world
    w = init_shard(C, D, 0, C, 0.5, SEED, torch.float64)
    for i, case in enumerate(cases):
        parts = [local_case(0 if replicated else r, sizes, case, i) for r in range(1 if replicated else world)]
        x = torch.cat([p[0].reshape(-1, D) for p in parts])
        y = torch.cat([p[1].reshape(-1) for p in parts])
        sw = torch.cat([p[2].reshape(-1) for p in parts]) if case["weights"] else None
        u = torch.cat([p[3].reshape(-1) for p in parts])
        opts = case["opts"]
        none = opts.get("reduction") == "none"
        ref, gx, gw, lse = option_reference(x, w, y, {**loss_cfg}, opts, sw, u if none else None)
        offset = 0
        for rank, res in enumerate(results):
            b = parts[0 if replicated else rank][1].numel()
            shape = parts[0 if replicated else rank][1].shape
            mine = slice(offset, offset + b)
            where = f"case {i} {opts}, rank {rank}/{world}"
            if none:
                torch.testing.assert_close(res[i]["value"], ref[mine].reshape(shape), rtol=1e-9, atol=1e-11, msg=lambda m, w=where: f"{w}: {m}")
            else:
                assert res[i]["value"].item() == pytest.approx(ref.item(), rel=1e-9), where
            torch.testing.assert_close(res[i]["lse"], lse[mine].reshape(shape), rtol=1e-9, atol=1e-11, msg=lambda m, w=where: f"{w}: {m}")
            scale = 1 if replicated else world  # P x d(global loss)/d(own rows); replicated: the full gradient
            torch.testing.assert_close(res[i]["gx"], (gx[mine] * scale).reshape(shape + (D,)), rtol=1e-7,
                                       atol=1e-8, msg=lambda m, w=where: f"{w}: {m}")
            start, num_local = shard_range(C, classes, rank % classes)
            torch.testing.assert_close(res[i]["gw"], gw[start: start + num_local], rtol=1e-7, atol=1e-8, msg=lambda m, w=where: f"{w}: {m}")
            if not replicated:
                offset += b


def _run(pools, world, loss_cfg, cases, extra=None, sizes=None):
    sizes = sizes or SIZES[world]
    if world == 1:
        return [_run_cases(0, 1, loss_cfg, cases, sizes, extra or {})]
    return pools(world).run(_run_cases, loss_cfg, cases, sizes, extra or {})


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_options_match_reference(pools, world, name):
    results = _run(pools, world, LOSSES[name], CASES)
    _check(results, LOSSES[name], CASES, SIZES[world])


@pytest.mark.parametrize("world", [1, 2, 3])
def test_softcap_matches_reference(pools, world):
    results = _run(pools, world, LOSSES["softmax"], SOFTCAP_CASES)
    _check(results, LOSSES["softmax"], SOFTCAP_CASES, SIZES[world])


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", ["softmax", "arcface", "dsoftmax"])
def test_overlap_schedule_takes_the_options(pools, world, name):
    cases = [c for c in CASES + (SOFTCAP_CASES if name == "softmax" else [])
             if c["opts"].get("reduction") != "none" and not c["weights"] and not c.get("seq")]
    results = _run(pools, world, LOSSES[name], cases, {"overlap": 2})
    _check(results, LOSSES[name], cases, SIZES[world])


@pytest.mark.parametrize("classes", [1, 3])
@pytest.mark.parametrize("name", ["cosface", "combined"])
def test_2d_layout_takes_the_options(pools, classes, name):
    """3 ranks as 1 x 3 (one shard, three replicas: the mean's weight rides in the replica all-reduce) and 3 x 1."""
    results = _run(pools, 3, LOSSES[name], CASES, {"classes": classes})
    _check(results, LOSSES[name], CASES, SIZES[3], classes=classes)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", ["softmax", "arcface"])
def test_replicated_input_takes_the_options(pools, world, name):
    sizes = [SIZES[3][2]] * world  # every rank passes the same rows (rank 0's batch)
    results = pools(world).run(_run_replicated, LOSSES[name], CASES, sizes)
    _check(results, LOSSES[name], CASES, sizes, replicated=True)


def _run_replicated(rank, world, loss_cfg, cases, sizes):
    return _run_cases(0, world, loss_cfg, cases, sizes, {"input_parallel": "replicated"})


SAMPLED = {
    "uniform": {"type": "uniform", "sample_rate": 0.3},
    "ann": {"type": "ann", "sample_rate": 0.25, "code_bits": 32, "nlist": 4, "nprobe": 2, "top_k": 3,
            "rerank": 6, "groups": 2, "backend": "torch"},
    "knn": {"type": "knn", "sample_rate": 0.3, "neighbors": 3},
}
SAMPLED_CASES = [  # per-row options only: smoothing and z-loss are refused on sampled heads
    dict(opts={"ignore_index": 3}, weights=True, ignore=True, chunk=3),
    dict(opts={"reduction": "sum", "softcap": 2.5}, weights=False, ignore=True, chunk=0, softmax_only=True),
    dict(opts={"reduction": "none"}, weights=True, ignore=True, chunk=2, seq=True),
]


def _run_sampled(rank, world, sampler, loss_cfg, cases, sizes):
    out = []
    for i, case in enumerate(cases):
        head = ClassParallelHead(D, C, loss={**loss_cfg, **case["opts"]}, sampler=sampler, chunk_size=case["chunk"],
                                 dtype=torch.float64, init_std=0.5, seed=SEED, update="lazy")
        x, y, sw, u = local_case(rank, sizes, case, i)
        x.requires_grad_()
        res = head(x, y, sw)
        (res if res.dim() == 0 else (res * u).sum()).backward()
        groups = [(r.start, r.stop, (idx + head.class_start).tolist()) for r, idx in head.last_active.groups()]
        out.append(dict(value=res.detach(), gx=x.grad, gw=head.weight.grad.to_dense(), lse=head.last_lse,
                        groups=groups, positives=head.sampler_stats().get("positives")))
    return out


@pytest.mark.parametrize("sampler", sorted(SAMPLED))
@pytest.mark.parametrize("name", ["softmax", "cosface"])
def test_sampled_heads_take_the_per_row_options(pools, sampler, name):
    """The reference scores each row group against the union of the ranks' active sets; rows labelled
    ignore_index (3: a real class id) add nothing and are nobody's positives."""
    world, sizes = 2, SIZES[2]
    cases = [c for c in SAMPLED_CASES if name == "softmax" or not c.get("softmax_only")]
    res = pools(world).run(_run_sampled, SAMPLED[sampler], LOSSES[name], cases, sizes)
    w0 = init_shard(C, D, 0, C, 0.5, SEED, torch.float64)
    for i, case in enumerate(cases):
        opts = case["opts"]
        ign = opts.get("ignore_index", -100)
        parts = [local_case(r, sizes, case, i) for r in range(world)]
        x = torch.cat([p[0].reshape(-1, D) for p in parts]).requires_grad_()
        y = torch.cat([p[1].reshape(-1) for p in parts])
        v = (y != ign).double() * (torch.cat([p[2].reshape(-1) for p in parts]) if case["weights"] else 1.0)
        u = torch.cat([p[3].reshape(-1) for p in parts])
        w = w0.clone().requires_grad_()
        rows, lses = [], []
        for g, (a, b, _) in enumerate(res[0][i]["groups"]):
            active = torch.tensor(sorted(set(sum((r[i]["groups"][g][2] for r in res), []))))
            assert torch.isin(y[a:b][y[a:b] != ign], active).all(), "a positive class was not sampled"
            remap = torch.full((C,), 0, dtype=torch.int64)
            remap[active] = torch.arange(active.numel())
            yg = torch.where(y[a:b] == ign, -100, remap[y[a:b].clamp_min(0)])  # a column may equal ign: -100
            r_g, l_g = option_rows(x[a:b], w[active], yg, LOSSES[name], {**opts, "ignore_index": -100})
            rows.append(r_g)
            lses.append(l_g)
        rows = torch.cat(rows) * v
        red = opts.get("reduction", "mean")
        ref = rows if red == "none" else (rows.sum() / v.sum() if red == "mean" else rows.sum())
        (ref if red != "none" else (ref * u).sum()).backward()
        lse = torch.cat(lses).detach()
        offset = 0
        for rank, r in enumerate(res):
            shape = parts[rank][1].shape
            mine = slice(offset, offset + parts[rank][1].numel())
            if red == "none":
                torch.testing.assert_close(r[i]["value"], ref[mine].detach().reshape(shape), rtol=1e-9, atol=1e-11)
            else:
                assert r[i]["value"].item() == pytest.approx(ref.item(), rel=1e-9)
            torch.testing.assert_close(r[i]["lse"], lse[mine].reshape(shape), rtol=1e-9, atol=1e-11)
            torch.testing.assert_close(r[i]["gx"], (x.grad[mine] * world).reshape(shape + (D,)), rtol=1e-7, atol=1e-8)
            start, num = shard_range(C, world, rank)
            torch.testing.assert_close(r[i]["gw"], w.grad[start: start + num], rtol=1e-7, atol=1e-8)
            offset += parts[rank][1].numel()


@pytest.mark.parametrize("key,value", [("label_smoothing", 0.1), ("z_loss", 0.01)])
@pytest.mark.parametrize("sampler", sorted(SAMPLED))
def test_sampled_heads_refuse_smoothing_and_z_loss(sampler, key, value):
    with pytest.raises(ConfigError, match=f"{key}.*{sampler}"):
        ClassParallelHead(D, C, loss={"type": "softmax", key: value}, sampler=SAMPLED[sampler])
    with pytest.raises(ConfigError, match=key):  # the keyword form too
        ClassParallelHead(D, C, sampler=SAMPLED[sampler], **{key: value})


def test_ignored_labels_are_no_sampler_positives():
    """Every label is ignore_index 3 (a real class): the uniform sampler keeps no positive."""
    head = ClassParallelHead(D, C, loss={"type": "softmax", "ignore_index": 3}, sampler=SAMPLED["uniform"],
                             dtype=torch.float64)
    x = torch.randn(5, D, dtype=torch.float64)
    y = torch.full((5,), 3)
    y[0] = 4
    head(x, y)
    assert head.sampler_stats()["positives"] == 1

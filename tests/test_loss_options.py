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


# ------------------------------------------------------------------ one rank against torch
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.15])
@pytest.mark.parametrize("ignore_index", [-100, 2])
def test_one_rank_equals_torch_cross_entropy(reduction, smoothing, ignore_index):
    """The softmax head == F.cross_entropy on x @ W^T and == F.linear_cross_entropy, in value and in the
    gradients of x and W (the keyword form of the options)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, D, generator=g, dtype=torch.float64)
    y = torch.randint(0, C, (9,), generator=g)
    y[[1, 4]] = ignore_index
    u = torch.rand(9, generator=g, dtype=torch.float64)
    head = ClassParallelHead(D, C, dtype=torch.float64, init_std=0.5, seed=SEED, chunk_size=4,
                             ignore_index=ignore_index, label_smoothing=smoothing, reduction=reduction)
    xs = x.clone().requires_grad_()
    out = head(xs, y)
    (out if reduction != "none" else (out * u).sum()).backward()
    kw = dict(ignore_index=ignore_index, label_smoothing=smoothing, reduction=reduction)
    for fn in ("cross_entropy", "linear_cross_entropy"):
        xr = x.clone().requires_grad_()
        wr = head.weight.detach().clone().requires_grad_()
        ref = F.cross_entropy(xr @ wr.t(), y, **kw) if fn == "cross_entropy" else F.linear_cross_entropy(xr, wr, y, **kw)
        (ref if reduction != "none" else (ref * u).sum()).backward()
        torch.testing.assert_close(out.detach(), ref.detach(), rtol=1e-10, atol=1e-12, msg=lambda m: f"{fn}: {m}")
        torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-9, atol=1e-12, msg=lambda m: f"{fn}: {m}")
        torch.testing.assert_close(head.weight.grad, wr.grad, rtol=1e-9, atol=1e-12, msg=lambda m: f"{fn}: {m}")


def test_one_rank_sequences_and_weights_equal_torch():
    """(B, T, d) with (B, T) labels and per-token weights == torch's per-token losses, weighted by hand."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 4, D, generator=g, dtype=torch.float64)
    y = torch.randint(0, C, (3, 4), generator=g)
    y[0, 1] = y[2, 3] = -100
    sw = torch.rand(3, 4, generator=g, dtype=torch.float64) + 0.1
    head = ClassParallelHead(D, C, dtype=torch.float64, init_std=0.5, seed=SEED, label_smoothing=0.1)
    xs = x.clone().requires_grad_()
    head(xs, y, sw).backward()
    xr = x.clone().requires_grad_()
    wr = head.weight.detach().clone().requires_grad_()
    rows = F.cross_entropy((xr @ wr.t()).reshape(-1, C), y.reshape(-1), label_smoothing=0.1, reduction="none")
    v = sw.reshape(-1) * (y.reshape(-1) != -100)
    ((rows * v).sum() / v.sum()).backward()
    torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(head.weight.grad, wr.grad, rtol=1e-9, atol=1e-12)
    lse = torch.logsumexp(x @ head.weight.detach().t(), dim=-1)  # (3, 4)
    torch.testing.assert_close(head.last_lse, lse, rtol=1e-10, atol=1e-12)


def _all_ignored(rank, world, update, sampler):
    from ds_xc import build_head_optimizer
    head = ClassParallelHead(D, C, sampler=sampler, dtype=torch.float64, init_std=0.5, seed=SEED, update=update,
                             label_smoothing=0.1 if sampler == "full" else 0.0, chunk_size=2)
    opt = build_head_optimizer(head, {"type": "adamw", "lr": 0.05, "weight_decay": 0.0, "update": update})
    before = head.weight.detach().clone()
    x = torch.randn(3 + rank, D, dtype=torch.float64, requires_grad=True)
    loss = head(x, torch.full((3 + rank,), -100))
    loss.backward()
    gw = head.weight.grad.to_dense() if head.weight.grad.is_sparse else head.weight.grad
    opt.step()
    states = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.is_floating_point()]
    return {"loss": loss.item(), "gx": x.grad.abs().max().item(), "gw": gw.abs().max().item(),
            "moved": (head.weight.detach() - before).abs().max().item(),
            "finite": all(bool(torch.isfinite(s).all()) for s in states)}


@pytest.mark.parametrize("update,sampler", [("dense", "full"), ("lazy", "full"), ("lazy_exact", "uniform")])
def test_all_ignored_step_is_nan_with_zero_gradients(pools, update, sampler):
    """torch's behaviour: the mean over no rows is NaN and every gradient is an exact zero, so neither the
    weights nor the (lazy) optimizer's state take a NaN (XCEngine skips the step on the NaN loss)."""
    smp = "full" if sampler == "full" else SAMPLED[sampler]
    for r in pools(2).run(_all_ignored, update, smp):
        assert r["loss"] != r["loss"]  # NaN
        assert r["gx"] == 0.0 and r["gw"] == 0.0 and r["moved"] == 0.0 and r["finite"]


def test_label_smoothing_on_three_ranks_equals_one_process(pools):
    """Smoothing's mean runs over all C = 17 classes of the head (shards of 6, 6 and 5), not over a
    shard's own classes (Megatron's vocab-parallel formula divides by the local vocabulary)."""
    case = dict(opts={"label_smoothing": 0.25}, weights=False, ignore=True, chunk=0)
    results = pools(3).run(_run_cases, LOSSES["softmax"], [case], SIZES[3], {})
    parts = [local_case(r, SIZES[3], case, 0) for r in range(3)]
    x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    w = init_shard(C, D, 0, C, 0.5, SEED, torch.float64)
    expected = F.cross_entropy(x @ w.t(), y, label_smoothing=0.25)
    for r in results:
        assert r[0]["value"].item() == pytest.approx(expected.item(), rel=1e-12)


# ------------------------------------------------------------------ input checks and refusals
def _bad_weight(rank, world):
    head = ClassParallelHead(D, C, dtype=torch.float64)
    x, y = torch.randn(4, D, dtype=torch.float64), torch.full((4,), -100)
    y[0] = 1
    sw = torch.ones(3 if rank == 1 else 4, dtype=torch.float64)
    try:
        head(x, y, sw)
    except ValueError as e:
        return str(e)
    return "no error"


def test_sample_weight_of_the_wrong_shape_raises_on_every_rank(pools):
    msgs = pools(2).run(_bad_weight)
    assert "sample_weight must have the labels' shape (4,), got (3,) on rank 1" in msgs[1]
    assert "rank(s) [1]" in msgs[0]


def test_ignore_index_labels_pass_the_check_and_others_do_not():
    head = ClassParallelHead(D, C, dtype=torch.float64, ignore_index=-1)
    x = torch.randn(3, D, dtype=torch.float64)
    head(x, torch.tensor([-1, 2, -1]))
    with pytest.raises(ValueError, match=r"label -100 at position 1 .* not the ignore_index -1"):
        head(x, torch.tensor([1, -100, 2]))


@pytest.mark.parametrize("name", ["cosface", "arcface", "combined", "dsoftmax"])
def test_softcap_is_refused_for_margin_losses(name):
    with pytest.raises(ConfigError, match="softcap"):
        ClassParallelHead(D, C, loss={**LOSSES[name], "softcap": 5.0})
    with pytest.raises(ConfigError, match="softcap"):
        ClassParallelHead(D, C, loss=LOSSES[name], softcap=5.0)


@pytest.mark.parametrize("key,value", [("label_smoothing", 1.0), ("z_loss", -0.1), ("reduction", "avg"),
                                       ("softcap", -1.0)])
def test_bad_option_values_name_the_key(key, value):
    with pytest.raises(ConfigError, match=f"loss.{key}"):
        ClassParallelHead(D, C, loss={"type": "softmax", key: value})
    with pytest.raises(ConfigError, match=f"loss.{key}"):
        ClassParallelHead(D, C, **{key: value})


def test_the_engine_refuses_reduction_none():
    from ds_xc.engine.setup import check_supported
    raw = {"train_batch_size": 8, cfg_head(): {"num_classes": C, "embedding_dim": D,
                                               "loss": {"type": "softmax", "reduction": "none"}}}
    with pytest.raises(ConfigError, match="loss.reduction: 'none'"):
        check_supported(raw)
    raw[cfg_head()]["loss"]["reduction"] = "sum"
    check_supported(raw)


def cfg_head():
    from ds_xc.config import HEAD_SECTION
    return HEAD_SECTION


def test_overlap_schedule_refuses_reduction_none():
    from ds_xc.overlap import ChunkedHeadSchedule
    with pytest.raises(ValueError, match="loss.reduction='none'"):
        ChunkedHeadSchedule(ClassParallelHead(D, C, reduction="none"), 2)


@pytest.mark.parametrize("loss,extra,key", [({"type": "softmax", "z_loss": 0.1}, {"sampler": {"type": "uniform"}},
                                             "loss.z_loss"),
                                            ({"type": "cosface", "label_smoothing": 0.1},
                                             {"sampler": {"type": "knn"}}, "loss.label_smoothing"),
                                            ({"type": "softmax", "reduction": "none"}, {"overlap": {"enabled": True}},
                                             "loss.reduction")])
def test_the_config_refuses_what_a_path_cannot_do(loss, extra, key):
    from ds_xc import parse_config
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_config({cfg_head(): {"num_classes": C, "embedding_dim": D, "loss": loss, **extra}})


@pytest.mark.parametrize("name", ["softmax", "arcface"])
def test_bfloat16_head_takes_the_options(name):
    """bf16 weights (float32 statistics): the options within bf16's rounding of the float64 reference."""
    opts = {"label_smoothing": 0.1, "z_loss": 0.01, "ignore_index": 0, **({"softcap": 3.0} if name == "softmax" else {})}
    head = ClassParallelHead(D, C, loss={**LOSSES[name], **opts}, dtype="bfloat16", init_std=0.5, seed=2, chunk_size=4)
    g = torch.Generator().manual_seed(8)
    x, y = torch.randn(10, D, generator=g), torch.randint(0, C, (10,), generator=g)
    y[::3] = 0
    xs = x.clone().requires_grad_()
    out = head(xs, y)
    out.backward()
    ref, gx, gw, _ = option_reference(x.to(torch.bfloat16).double(), head.weight.detach().double(), y, LOSSES[name],
                                      opts)
    assert out.item() == pytest.approx(ref.item(), rel=2e-2)
    torch.testing.assert_close(xs.grad.double(), gx, rtol=5e-2, atol=5e-2 * gx.abs().max().item())
    torch.testing.assert_close(head.weight.grad.double(), gw, rtol=5e-2, atol=5e-2 * gw.abs().max().item())

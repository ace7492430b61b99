"""update: lazy_exact == the dense optimizer on the same gradients (inactive rows: zero gradient).

float64, 300 steps, warm-up + cosine lr, random active sets plus rows skipped for 1 step and
for ~250 steps; then catch_up_all and every row is compared with torch.optim.SGD / AdamW."""
import copy
import math

import pytest
import torch

from ds_xc import config as cfg
from ds_xc.head import lazy_exact
from ds_xc.head.optim import HeadAdamW, HeadSGD, build_head_optimizer

L, D, STEPS = 30, 3, 300


def _lr(t, base):
    """Warm-up over 20 steps, then cosine decay to 5% (t = 0, 1, ...)."""
    if t < 20:
        return base * (t + 1) / 20
    return base * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (t - 20) / (STEPS - 20))))


def _schedule(seed=0):
    """Per step: (active rows (K,) sorted, gradient rows (K, D)). Row 0 is always active, row 1 every
    other step (skipped 1 step), row 2 at steps 0, 20 and 280 (skipped ~260), row 3 at step 0 only;
    others with probability 0.2. Every row is active at step 0 (AdamW with eps=0 needs v > 0)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in range(STEPS):
        mask = torch.rand(L, generator=g) < 0.2
        mask[0], mask[1], mask[2], mask[3] = True, t % 2 == 0, t in (0, 20, 280), t == 0
        if t == 0:
            mask[:] = True
        rows = mask.nonzero().squeeze(1)
        out.append((rows, torch.randn(rows.numel(), D, generator=g, dtype=torch.float64)))
    return out


def _w0():
    return torch.randn(L, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


def _run(opt, p, sched, base_lr, start=0, stop=STEPS, sparse=True):
    for t in range(start, stop):
        rows, vals = sched[t]
        for group in opt.param_groups:
            group["lr"] = _lr(t, base_lr)
        if sparse:
            p.grad = torch.sparse_coo_tensor(rows[None], vals, (L, D), check_invariants=True)
        else:
            p.grad = torch.zeros(L, D, dtype=torch.float64).index_copy_(0, rows, vals)
        opt.step()


SGD_CASES = [dict(momentum=0.9, weight_decay=0.01), dict(momentum=0.9, weight_decay=0.02, nesterov=True),
             dict(momentum=0.0, weight_decay=0.05), dict(momentum=0.5, weight_decay=0.0)]


@pytest.mark.parametrize("kw", SGD_CASES)
def test_sgd_equals_torch_dense(kw, monkeypatch):
    monkeypatch.setattr(lazy_exact, "BLOCK_BYTES", 4 * 4 * D * 8)  # several catch-up blocks of 4 rows
    monkeypatch.setattr(lazy_exact, "WINDOW", 7)  # every row caught up every 7 steps in the middle of the run
    sched = _schedule()
    ref_p, p = torch.nn.Parameter(_w0()), torch.nn.Parameter(_w0())
    ref, ours = torch.optim.SGD([ref_p], lr=0.1, **kw), HeadSGD([p], lr=0.1, exact=True, **kw)
    _run(ref, ref_p, sched, 0.1, sparse=False)
    _run(ours, p, sched, 0.1)
    assert not torch.allclose(p, ref_p, rtol=1e-6)  # before the catch-up the skipped rows are stale
    ours.catch_up_all()
    torch.testing.assert_close(p, ref_p, rtol=1e-12, atol=1e-13)
    if kw["momentum"]:
        torch.testing.assert_close(ours.state[p]["momentum_buffer"], ref.state[ref_p]["momentum_buffer"],
                                   rtol=1e-11, atol=1e-13)
    assert ours.state[p][lazy_exact.STEPS] == STEPS and int(ours.state[p][lazy_exact.LAST].min()) == STEPS
    assert ours.state[p][lazy_exact.BASE] == STEPS  # every row current


def _adamw_ref(sched, eps, wd):
    """Dense torch AdamW; also the bound on the error of dropping eps in the skipped steps: the sum,
    over the steps a row skipped, of lr * |m/bc1| * eps / (v/bc2) (1/x - 1/(x+eps) <= eps/x^2)."""
    p = torch.nn.Parameter(_w0())
    opt = torch.optim.AdamW([p], lr=0.05, eps=eps, weight_decay=wd)
    bound = torch.zeros(L, D, dtype=torch.float64)
    for t in range(STEPS):
        _run(opt, p, sched, 0.05, t, t + 1, sparse=False)
        skipped = torch.ones(L, dtype=torch.bool)
        skipped[sched[t][0]] = False
        st = opt.state[p]
        bc1, bc2 = 1 - 0.9 ** (t + 1), 1 - 0.999 ** (t + 1)
        term = _lr(t, 0.05) * (st["exp_avg"] / bc1).abs() * eps / (st["exp_avg_sq"] / bc2)
        bound[skipped] += term[skipped]
    return p, opt, bound


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adamw_equals_torch_dense_within_the_eps_bound(wd):
    sched = _schedule(1)
    for eps in (0.0, 1e-8):
        ref_p, ref, bound = _adamw_ref(sched, eps, wd)
        p = torch.nn.Parameter(_w0())
        ours = HeadAdamW([p], lr=0.05, eps=eps, weight_decay=wd, exact=True)
        _run(ours, p, sched, 0.05)
        ours.catch_up_all()
        err = (p - ref_p).abs()
        if eps == 0.0:  # the closed form is exact: only rounding
            torch.testing.assert_close(p, ref_p, rtol=1e-11, atol=1e-12)
        else:
            assert bool((err <= bound + 1e-12).all()), float((err - bound).max())
            disp = (ref_p.detach() - _w0()).abs().max()
            assert float(bound.max()) < 1e-6 * float(disp)  # the documented size: ~eps/sqrt(v) relative
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours.state[p][key], ref.state[ref_p][key], rtol=1e-11, atol=1e-15)


@pytest.mark.parametrize("make", [lambda p: HeadSGD([p], lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True,
                                                    exact=True),
                                  lambda p: HeadAdamW([p], lr=0.05, weight_decay=0.1, exact=True)])
def test_state_dict_round_trip_mid_run(make, monkeypatch):
    monkeypatch.setattr(lazy_exact, "WINDOW", 16)
    sched = _schedule(2)
    p, q = torch.nn.Parameter(_w0()), torch.nn.Parameter(_w0())
    a = make(p)
    _run(a, p, sched, 0.1, 0, 150)
    saved = copy.deepcopy(a.state_dict())  # as a checkpoint: stale rows, counters and suffix products
    q.data.copy_(p.data)
    b = make(q)
    b.load_state_dict(saved)
    assert b.state[q][lazy_exact.SUFFIX].dtype == torch.float64
    assert b.state[q][lazy_exact.LAST].dtype == torch.int64
    _run(a, p, sched, 0.1, 150)
    _run(b, q, sched, 0.1, 150)
    a.catch_up_all()
    b.catch_up_all()
    torch.testing.assert_close(q, p, rtol=0, atol=0)


def test_bf16_and_config():
    p = torch.nn.Parameter(torch.zeros(4, 2, dtype=torch.bfloat16))
    opt = HeadSGD([p], lr=0.1, momentum=0.9, exact=True)
    p.grad = torch.ones(4, 2, dtype=torch.bfloat16)
    with pytest.raises(cfg.ConfigError, match="lazy_exact.*bfloat16"):
        opt.step()
    c = cfg.validate_section(cfg.HeadOptimizerConfig, {"update": "lazy_exact"}, "x")
    assert c.update == "lazy_exact"
    with pytest.raises(cfg.ConfigError, match="update"):
        cfg.validate_section(cfg.HeadOptimizerConfig, {"update": "exact"}, "x")


C, B = 23, 5


def _head_run(rank, world, update, opt_type, eps):
    """A 2-rank uniform-sampled head, 40 steps with a changing lr; returns the caught-up shard."""
    from ds_xc import ClassParallelHead
    head = ClassParallelHead(D, C, loss="softmax", sampler={"type": "uniform", "sample_rate": 0.3},
                             dtype=torch.float64, init_std=0.5, seed=4, update=update)
    opt = build_head_optimizer(head, {"type": opt_type, "lr": 0.05, "momentum": 0.9, "weight_decay": 0.05,
                                      "nesterov": True, "update": update, "eps": eps})
    g = torch.Generator().manual_seed(100 + rank)
    for t in range(40):
        x = torch.randn(B, D, generator=g, dtype=torch.float64)
        y = torch.randint(0, C, (B,), generator=g)
        for group in opt.param_groups:
            group["lr"] = 0.05 * (1 + t % 7) / 7
        head(x, y).backward()
        assert head.weight.grad.is_sparse == (update != "dense")
        opt.step()
        opt.zero_grad(set_to_none=True)
    stale = bool(head.weight.grad is None) and update == "lazy_exact"
    before = head.weight.detach().clone()
    top = head.topk(torch.randn(B, D, generator=g, dtype=torch.float64), k=3)  # catches every row up
    return {"w": head.weight.detach().clone(), "moved": stale and not torch.equal(before, head.weight), "top": top}


@pytest.mark.parametrize("opt_type,eps,tol", [("sgd", 1e-8, 1e-11), ("adamw", 1e-14, 1e-9), ("adamw", 1e-8, 5e-6)])
def test_two_rank_head_lazy_exact_equals_dense(pools, opt_type, eps, tol):
    """SGD: exact. AdamW: the eps dropped in the skipped steps is the only difference (eps=1e-14:
    ~1e-12; the default 1e-8 with these small gradients: measured max |diff| 1.3e-6 on weights of
    size ~0.5, grown over 40 steps because the gradients depend on the weights)."""
    exact = pools(2).run(_head_run, "lazy_exact", opt_type, eps)
    dense = pools(2).run(_head_run, "dense", opt_type, eps)
    for e, d in zip(exact, dense):
        assert e["moved"]  # topk did catch stale rows up
        torch.testing.assert_close(e["w"], d["w"], rtol=tol, atol=tol)
        assert torch.equal(e["top"], d["top"])


def test_overlap_schedule_catches_active_rows_up_and_frozen_is_lazy():
    """One process: the chunked overlap schedule with lazy_exact == the dense head's forward."""
    from ds_xc import ClassParallelHead
    from ds_xc.overlap import ChunkedHeadSchedule
    heads, opts = [], []
    for update in ("lazy_exact", "dense"):
        head = ClassParallelHead(D, C, sampler={"type": "uniform", "sample_rate": 0.3}, dtype=torch.float64,
                                 init_std=0.5, seed=4, update=update)
        heads.append(head)
        opts.append(build_head_optimizer(head, {"type": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.05,
                                                "update": update}))
    assert heads[0].lazy_catch_up is not None and heads[1].lazy_catch_up is None
    sched = ChunkedHeadSchedule(heads[0], 2)
    g = torch.Generator().manual_seed(9)
    for _ in range(25):
        x = torch.randn(B, D, generator=g, dtype=torch.float64)
        y = torch.randint(0, C, (B,), generator=g)
        sched.run(x.clone().requires_grad_(), y)
        heads[1](x, y).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    opts[0].catch_up_all()
    torch.testing.assert_close(heads[0].weight, heads[1].weight, rtol=1e-11, atol=1e-12)
    frozen = ClassParallelHead(D, C, sampler={"type": "uniform", "sample_rate": 0.3}, update="frozen")
    opt = build_head_optimizer(frozen, {"update": "frozen"})
    assert opt.param_groups[0]["lazy"] and not opt.param_groups[0]["exact"] and frozen.lazy_catch_up is None


def test_lazy_exact_checkpoint_resumed_dense_catches_up_and_keeps_its_mode():
    sched = _schedule(3)
    p, q, r = (torch.nn.Parameter(_w0()) for _ in range(3))
    exact = HeadSGD([p], lr=0.1, momentum=0.9, weight_decay=0.05, exact=True)
    _run(exact, p, sched, 0.1, 0, 100)
    dense = HeadSGD([q], lr=0.1, momentum=0.9, weight_decay=0.05)
    q.data.copy_(p.data)
    dense.load_state_dict(copy.deepcopy(exact.state_dict()))
    assert not dense.param_groups[0]["exact"] and lazy_exact.LAST not in dense.state[q]
    ref = torch.optim.SGD([r], lr=0.1, momentum=0.9, weight_decay=0.05)
    _run(ref, r, sched, 0.1, 0, 100, sparse=False)
    torch.testing.assert_close(q, r, rtol=1e-12, atol=1e-13)  # caught up at load


def _engine_run(rank, world, path, update):
    """XCEngine, uniform sampler, 5 steps, then save_checkpoint: the saved shard is caught up."""
    import ds_xc
    from tests.test_engine import LR_BODY, _backbone, _batch, _config
    body = _backbone()
    config = _config(0, 1, loss="arcface", momentum=0.9)
    config["extreme_classification"]["sampler"] = {"type": "uniform", "sample_rate": 0.3}
    config["extreme_classification"]["optimizer"].update(update=update, weight_decay=0.05)
    xc = ds_xc.initialize(model=body, optimizer=torch.optim.SGD(body.parameters(), lr=LR_BODY), config=config)
    losses = []
    for step in range(5):
        x, y = _batch(step, rank)
        loss = xc(x, y)
        xc.backward(loss)
        xc.step()
        losses.append(loss.item())
    before = xc.head.weight.detach().clone()
    xc.save_checkpoint(path, client_state={"step": 5})
    return {"losses": losses, "w": xc.head.weight.detach().clone(), "changed": not torch.equal(before, xc.head.weight)}


def test_engine_lazy_exact_equals_dense_and_saves_caught_up_rows(pools, tmp_path):
    exact = pools(2).run(_engine_run, str(tmp_path / "e"), "lazy_exact")
    dense = pools(2).run(_engine_run, str(tmp_path / "d"), "dense")
    for e, d in zip(exact, dense):
        assert e["changed"] and not d["changed"]  # save_checkpoint caught the stale rows up
        assert e["losses"] == pytest.approx(d["losses"], rel=1e-5)
        # float32 head: the catch-up's combination runs in float32 (docs/head.md), so a row rounds
        # once per catch-up where the dense run rounds every step; with ArcFace's s=64 the momentum
        # term lr*mu*buf is large next to the weight and its rounding shows at ~1e-6 absolute
        torch.testing.assert_close(e["w"], d["w"], rtol=1e-5, atol=5e-6)

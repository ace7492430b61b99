"""The compressed optimizer inside a DeepSpeed engine (ZeRO 0, 2 gloo ranks): with density 1.0
one step equals the float64 data-parallel reference under gradient accumulation (so the
engine neither reduces twice nor loses its accumulation scaling); compressed, the engine
path equals the plain torch.distributed path bit for bit; bf16; refusals name the keys;
checkpoints (engine + per-rank residuals) resume bitwise. ZeRO-1: tests/test_compression_zero.py."""
import pytest
import torch

IN, D, B, LR, SEED = 12, 10, 4, 0.2, 5
COMP = {"method": "bayes_prior", "density": 0.3, "min_numel": 16, "stats_sync_interval": 2}


def _batch(i, rank):
    g = torch.Generator().manual_seed(100 * i + rank)
    return torch.randn(B, IN, generator=g), torch.randn(B, D, generator=g)


def _body():
    torch.manual_seed(SEED)
    return torch.nn.Linear(IN, D, bias=False)


def _ds_config(gas, bf16=False, stage=0, clip=0.0):
    return {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": gas,
            "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": bf16}, "steps_per_print": 10**9, "gradient_clipping": clip}


def _engine(gas, comp, bf16=False, stage=0, clip=0.0, momentum=0.0, adamw=False):
    """A DeepSpeed engine over _body() with SGD (``momentum``), or AdamW (lr 0.01) with ``adamw``."""
    from ds_xc.compression import attach_to_engine
    from ds_xc.engine import cpu_friendly_deepspeed
    deepspeed = cpu_friendly_deepspeed()
    body = _body()
    inner = (torch.optim.AdamW(body.parameters(), lr=0.01) if adamw else
             torch.optim.SGD(body.parameters(), lr=LR, momentum=momentum))
    engine, _, _, _ = deepspeed.initialize(model=body, optimizer=inner, config=_ds_config(gas, bf16, stage, clip))
    return engine, attach_to_engine(engine, comp)


def _engine_steps(engine, rank, gas, start, stop, bf16=False):
    for step in range(start, stop):
        for micro in range(gas):
            x, t = _batch(step * gas + micro, rank)
            out = engine(x.to(torch.bfloat16) if bf16 else x)
            engine.backward((out.float() - t).pow(2).mean())
            engine.step()


def _run_engine(rank, world, comp, gas, steps, bf16=False):
    engine, opt = _engine(gas, comp, bf16)
    _engine_steps(engine, rank, gas, 0, steps, bf16)
    return {"w": engine.module.weight.detach().float().clone(), "steps": engine.global_steps,
            "stats": opt.stats(), "backward_allreduce": engine.enable_backward_allreduce}


def _run_plain(rank, world, comp, gas, steps):
    from ds_xc.compression import CompressedOptimizer
    body = _body()
    opt = CompressedOptimizer(torch.optim.SGD(body.parameters(), lr=LR), comp)
    for step in range(steps):
        for micro in range(gas):
            x, t = _batch(step * gas + micro, rank)
            ((body(x) - t).pow(2).mean() / gas).backward()
        opt.step()
        opt.zero_grad()
    return {"w": body.weight.detach().clone()}


@pytest.mark.parametrize("bf16", [False, True])
def test_density_one_step_equals_the_data_parallel_reference(pools, bf16):
    world, gas = 2, 2
    res = pools(world).run(_run_engine, dict(COMP, density=1.0), gas, 1, bf16)
    w = _body().weight.detach().double().requires_grad_()
    total = 0.0
    for micro in range(gas):
        for rank in range(world):
            x, t = _batch(micro, rank)
            total = total + (x.double() @ w.t() - t.double()).pow(2).mean() / (gas * world)
    total.backward()
    expected = w.detach() - LR * w.grad
    tol = {"rtol": 2e-2, "atol": 2e-2} if bf16 else {"rtol": 1e-5, "atol": 1e-6}
    for r in res:
        assert r["steps"] == 1 and r["backward_allreduce"] is False
        torch.testing.assert_close(r["w"].double(), expected, **tol)
        assert r["stats"]["bytes_sent"] > 0
    assert torch.equal(res[0]["w"], res[1]["w"])


POWERSGD = {"method": "powersgd", "powersgd": {"rank": 2}, "min_numel": 16}


@pytest.mark.parametrize("comp,density", [(COMP, None), (POWERSGD, (10 + IN) * 2 / (10 * IN))],
                         ids=["bayes_prior", "powersgd"])
def test_compressed_engine_equals_plain_torch_distributed(pools, comp, density):
    """powersgd: the (10, 12) weight at rank 2 sends (10 + 12) x 2 floats of its 120 per step."""
    engine = pools(2).run(_run_engine, comp, 2, 4)
    plain = pools(2).run(_run_plain, comp, 2, 4)
    for e, p in zip(engine, plain):
        assert torch.equal(e["w"], p["w"])
    assert torch.equal(engine[0]["w"], engine[1]["w"])
    if density is None:
        assert 0.2 < engine[0]["stats"]["density"] < 0.4
    else:
        assert engine[0]["stats"]["density"] == pytest.approx(density, rel=1e-12)


def test_bf16_compressed_replicas_stay_identical(pools):
    res = pools(2).run(_run_engine, COMP, 1, 3, True)
    assert torch.equal(res[0]["w"], res[1]["w"])
    assert not torch.equal(res[0]["w"], _body().weight.detach())


def _bf16_adamw_run(rank, world, steps, momentum):
    """bf16 engine, AdamW, bayes_prior with momentum_correction ``momentum`` (None: auto): the betas the
    inner torch AdamW (stepping DeepSpeed's fp32 master copies) sees at each step, and after."""
    comp = dict(COMP, adam_variance="live") if momentum is None else dict(COMP, momentum_correction=momentum)
    engine, opt = _engine(1, comp, bf16=True, adamw=True)
    inner = engine.optimizer.inner.optimizer  # DeepSpeed's bf16 wrapper -> its torch AdamW
    seen = []
    inner.register_step_pre_hook(lambda o, args, kwargs: seen.append([g["betas"] for g in o.param_groups]))
    _engine_steps(engine, rank, 1, 0, steps, bf16=True)
    return {"wrapper": type(engine.optimizer.inner).__name__, "inner": type(inner).__name__, "seen": seen,
            "after": [g["betas"] for g in inner.param_groups], "velocity": opt.momentum_correction.owns,
            "momentum_buffer": "momentum" in opt._buffers, "w": engine.module.weight.detach().float().clone()}


@pytest.mark.parametrize("momentum", [None, 0.0])
def test_bf16_master_copies_step_without_the_first_moment(pools, momentum):
    """Under bf16 DeepSpeed's wrapper steps fp32 master copies of exactly the reduced tensors with its torch
    AdamW: momentum correction (auto) moves beta1 into the wrapper's velocity, so that AdamW steps with beta1 = 0
    at every compressed step and gets its groups back after; with momentum_correction 0 it keeps beta1."""
    res = pools(2).run(_bf16_adamw_run, 3, momentum)
    for r in res:
        assert r["wrapper"] == "FP16_UnfusedOptimizer" and r["inner"] == "AdamW"  # DeepSpeed 0.19, bf16 at ZeRO 0
        assert r["velocity"] is r["momentum_buffer"] is (momentum is None)
        assert len(r["seen"]) == 3 and r["after"] == [(0.9, 0.999)] * len(r["after"])
        beta1 = 0.0 if momentum is None else 0.9
        assert all(betas == [(beta1, 0.999)] * len(betas) for betas in r["seen"])
    assert torch.equal(res[0]["w"], res[1]["w"])


def _bf16_score_run(rank, world, steps, select_by):
    """bf16 engine, AdamW, top-k ranked by ``select_by``: the scorer, and its score of a fixed v against the
    float64 formula on the inner AdamW's state of the weight's float32 master."""
    from ds_xc.compression.score import FLOOR
    engine, opt = _engine(1, {"method": "topk", "density": 0.3, "min_numel": 16, "select_by": select_by},
                          bf16=True, adamw=True)
    _engine_steps(engine, rank, 1, 0, steps, bf16=True)
    wrapper = engine.optimizer.inner
    inner, master = wrapper.optimizer, wrapper.fp32_groups[0][0]  # the weight's float32 master
    st = inner.state[master]
    v = torch.randn(engine.module.weight.numel(), generator=torch.Generator().manual_seed(7))
    got = opt._update_score(v, torch.zeros_like(v), 0, v.numel())
    vhat = st["exp_avg_sq"].double().reshape(-1) / (1.0 - 0.999 ** float(st["step"]))
    want = v.double() / vhat.clamp(min=FLOOR * float(vhat.mean())).sqrt()
    return {"scorer_on": opt._update_score.optimizer is inner, "got": got, "want": want,
            "steps": float(st["step"])}


@pytest.mark.parametrize("select_by", ["update", "auto"])
def test_bf16_ranks_by_the_masters_adam_state(pools, select_by):
    """Under bf16 (DeepSpeed 0.19 at ZeRO 0: a float32 master per parameter) the update score reads the inner
    AdamW's state of each weight's master; an explicit 'update' is no longer refused."""
    for r in pools(2).run(_bf16_score_run, 3, select_by):
        assert r["scorer_on"] and r["steps"] >= 3  # + the wrapper's zero-gradient step at start
        torch.testing.assert_close(r["got"].double(), r["want"], rtol=1e-5, atol=0.0)


def _refusal(rank, world, stage, clip, bf16):
    from ds_xc.config import ConfigError
    try:
        _engine(1, COMP, bf16=bf16, stage=stage, clip=clip)
    except ConfigError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("stage,clip,bf16,key", [(2, 0.0, False, "zero_optimization.stage=2"),
                                                  (0, 1.0, False, "gradient_clipping=1.0"),
                                                  (0, 1.0, True, None)])
def test_unsupported_settings_are_refused_naming_the_keys(pools, stage, clip, bf16, key):
    msgs = pools(2).run(_refusal, stage, clip, bf16)
    for msg in msgs:
        if key is None:
            assert msg is None
        else:
            assert key in msg and "gradient_compression.method='bayes_prior'" in msg


def _checkpoint(rank, world, path, phase):
    from ds_xc.compression import load_compression_state, save_compression_state
    engine, opt = _engine(1, COMP, momentum=0.9)
    start, stop = {"straight": (0, 4), "save": (0, 2), "resume": (2, 4)}[phase]
    if phase == "resume":
        engine.load_checkpoint(path, tag="t2")
        load_compression_state(f"{path}/t2", opt)
    _engine_steps(engine, rank, 1, start, stop)
    if phase == "save":
        save_compression_state(f"{path}/t2", opt)
        engine.save_checkpoint(path, tag="t2")
    return {"w": engine.module.weight.detach().clone(), "residual": opt._buffers["residual"].clone(),
            "steps": opt.stats()["steps"]}


def test_engine_checkpoint_resumes_bitwise(pools, tmp_path):
    pool = pools(2)
    straight = pool.run(_checkpoint, str(tmp_path), "straight")
    pool.run(_checkpoint, str(tmp_path), "save")
    resumed = pool.run(_checkpoint, str(tmp_path), "resume")
    for a, b in zip(straight, resumed):
        assert b["steps"] == 4
        assert torch.equal(a["w"], b["w"]) and torch.equal(a["residual"], b["residual"])
    assert not torch.equal(straight[0]["residual"], straight[1]["residual"])

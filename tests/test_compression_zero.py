"""Gradient compression under ZeRO (DeepSpeed 0.19.8, 2 and 3 gloo ranks, uneven batches and uneven
partitions): ZeRO-1 + top-k equals a single-process float64 re-implementation (local gradients under
accumulation -> error feedback -> top-k per tensor -> mean over ranks -> AdamW); ZeRO-1 follows the
ZeRO-0 trajectory (bayes_prior, random-k); a ZeRO-1 checkpoint (DeepSpeed's partitions + per-rank
residuals) resumes equal to the uninterrupted run; ZeRO-2 is refused, and the reproducer of why:
its hooks reduce during the backward even with the engine's all-reduce off."""
import pytest
import torch

from tests.test_reliability import NanGrad  # identity forward, NaN gradient backward

IN, H, D, LR, SEED, GAS = 12, 40, 5, 0.05, 3, 2
CLIP = 0.05
BUCKET = 256  # reduce_bucket_size of the ZeRO-2 reproducer (elements)
TOPK = {"method": "topk", "density": 0.2, "min_numel": 64, "allocation": "numel"}  # 480, 200 compressed; 40, 5 dense


def _rows(rank):
    return 3 + 2 * rank  # uneven local batches: 3, 5, 7


def _batch(i, rank, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * i + rank)
    n = _rows(rank)
    return torch.randn(n, IN, generator=g).to(dtype), torch.randn(n, D, generator=g).to(dtype)


def _body(dtype=torch.float32):
    torch.manual_seed(SEED)
    return torch.nn.Sequential(torch.nn.Linear(IN, H), torch.nn.Tanh(), torch.nn.Linear(H, D)).to(dtype)


def _loss(out, t):
    return (out - t).pow(2).mean()


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


def _engine(stage, comp, clip=0.0, extra=None):
    from ds_xc.compression import attach_to_engine
    from ds_xc.engine import cpu_friendly_deepspeed
    deepspeed = cpu_friendly_deepspeed()
    body = _body()
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": GAS,
              "zero_optimization": dict({"stage": stage}, **(extra or {})), "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**9, "gradient_clipping": clip}
    engine, _, _, _ = deepspeed.initialize(model=body, optimizer=_adamw(body.parameters()), config=config)
    return engine, (attach_to_engine(engine, comp) if comp is not None else None)


def _steps(engine, rank, start, stop):
    for step in range(start, stop):
        for micro in range(GAS):
            x, t = _batch(step * GAS + micro, rank)
            engine.backward(_loss(engine(x), t))
            engine.step()


def _params(engine):
    return [p.detach().clone() for p in engine.module.parameters()]


def _run(rank, world, stage, comp, steps, clip=0.0):
    engine, opt = _engine(stage, comp, clip)
    _steps(engine, rank, 0, steps)
    return {"params": _params(engine), "residual": opt._buffers["residual"].clone() if "residual" in opt._buffers
            else None, "steps": engine.global_steps, "compressed_steps": opt.stats()["compressed_steps"],
            "allreduce": engine.enable_backward_allreduce, "zero": type(engine.optimizer).__name__,
            "velocity": opt.momentum_correction.owns}


def _reference_topk(world, steps, density, min_numel, clip=0.0, momentum=0.0):
    """float64, one process: each rank's local gradient (loss / GAS per micro-batch), v = e + g, the
    round(density n) largest |v| per tensor of >= min_numel elements, their mean over the ranks,
    e = v - sent; the small tensors' dense mean; the mean clipped to norm ``clip`` (> 0); AdamW.
    ``momentum`` m > 0: DGC's momentum correction, u = m u + g and v = e + u, u zeroed where sent (the
    small tensors: their g, as at density 1), and AdamW steps every tensor with beta1 = 0."""
    body = _body(torch.float64)
    params = list(body.parameters())
    opt = _adamw(params)
    if momentum:
        for group in opt.param_groups:
            group["betas"] = (0.0, group["betas"][1])
    residual = [[torch.zeros_like(p) for p in params] for _ in range(world)]
    velocity = [[torch.zeros_like(p) for p in params] for _ in range(world)]
    for step in range(steps):
        mean = [torch.zeros_like(p) for p in params]
        for rank in range(world):
            body.zero_grad()
            for micro in range(GAS):
                x, t = _batch(step * GAS + micro, rank, torch.float64)
                (_loss(body(x), t) / GAS).backward()
            for i, p in enumerate(params):
                if p.numel() < min_numel:
                    mean[i] += p.grad / world
                    continue
                u = velocity[rank][i].reshape(-1)
                u.mul_(momentum).add_(p.grad.reshape(-1))
                v = residual[rank][i].reshape(-1) + (u if momentum else p.grad.reshape(-1))
                k = max(1, round(density * v.numel()))
                idx = torch.topk(v.abs(), k).indices
                sent = torch.zeros_like(v)
                sent[idx] = v[idx]
                residual[rank][i] = (v - sent).view_as(p)
                u[idx] = 0.0
                mean[i] += sent.view_as(p) / world
        for p, g in zip(params, mean):
            p.grad = g
        if clip > 0.0:
            assert float(torch.nn.utils.clip_grad_norm_(params, clip)) > 2 * clip  # the clipping bites
        opt.step()
    return [p.detach() for p in params], residual


@pytest.mark.parametrize("world,clip,momentum", [(2, 0.0, 0.0), (3, 0.0, 0.0), (2, CLIP, 0.0), (2, 0.0, None),
                                                 (3, CLIP, None)])
def test_zero1_topk_step_equals_the_float64_reference(pools, world, clip, momentum):
    """gradient_clipping: ZeRO-1 clips the compressed mean (the global norm over the partitions).
    momentum None: momentum_correction at its default, AdamW's beta1 (0.9) moved into the velocity."""
    steps = 3
    comp = dict(TOPK, select_by="magnitude")  # the reference ranks by |v| (update: test_compression_zero_score.py)
    comp = comp if momentum is None else dict(comp, momentum_correction=momentum)
    res = pools(world).run(_run, 1, comp, steps, clip)
    m = 0.9 if momentum is None else momentum
    expected, residual = _reference_topk(world, steps, TOPK["density"], TOPK["min_numel"], clip, m)
    for rank, r in enumerate(res):
        assert r["zero"] == "DeepSpeedZeroOptimizer" and r["allreduce"] is False and r["velocity"] is (m > 0)
        assert r["steps"] == steps and r["compressed_steps"] == steps
        for got, want in zip(r["params"], expected):
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
        flat = torch.cat([e.reshape(-1) for e, p in zip(residual[rank], expected) if p.numel() >= TOPK["min_numel"]])
        torch.testing.assert_close(r["residual"][: flat.numel()].double(), flat, rtol=1e-4, atol=1e-6)
    for r in res[1:]:  # replicas bit-identical after the all-gather of the partitions
        assert all(torch.equal(a, b) for a, b in zip(res[0]["params"], r["params"]))
    # the reference can fail: without compression (dense mean) the parameters differ
    dense, _ = _reference_topk(world, steps, 1.0, TOPK["min_numel"], clip, m)
    assert max(float((a - b).abs().max()) for a, b in zip(dense, expected)) > 1e-3
    if m:  # and the optimizer's own momentum instead of the velocity gives other parameters
        plain, _ = _reference_topk(world, steps, TOPK["density"], TOPK["min_numel"], clip)
        assert max(float((a - b).abs().max()) for a, b in zip(plain, expected)) > 1e-3


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("comp", [{"method": "bayes_prior", "density": 0.2, "min_numel": 64, "stats_sync_interval": 2,
                                   "adam_variance": "live", "select_by": "magnitude", "momentum_correction": 0.0},
                                  # a live variance and ranked by |v| (ZeRO-1 partitions the Adam state); the
                                  # optimizer's own momentum (momentum_correction 0)
                                  {"method": "randomk", "density": 0.3, "min_numel": 64, "value_dtype": "bfloat16",
                                   "adam_variance": "live", "momentum_correction": 0.0},
                                  {"method": "powersgd", "powersgd": {"rank": 2}, "min_numel": 64},
                                  # momentum correction at its default (auto: AdamW's beta1): the velocity in the
                                  # wrapper, ZeRO's inner AdamW steps the master partitions with beta1 = 0
                                  {"method": "bayes_prior", "density": 0.2, "min_numel": 64, "stats_sync_interval": 2,
                                   "adam_variance": "live", "select_by": "magnitude"}],
                         ids=["bayes_prior", "randomk-bf16-values", "powersgd", "bayes_prior-momentum"])
def test_zero1_follows_the_zero0_trajectory(pools, world, comp):
    zero0 = pools(world).run(_run, 0, comp, 3)
    zero1 = pools(world).run(_run, 1, comp, 3)
    velocity = "momentum_correction" not in comp and comp["method"] != "powersgd"
    for a, b in zip(zero0, zero1):
        assert (a["zero"], b["zero"]) == ("CompressedOptimizer", "DeepSpeedZeroOptimizer")
        assert a["velocity"] is b["velocity"] is velocity
        for x, y in zip(a["params"], b["params"]):
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b["residual"], a["residual"], rtol=1e-4, atol=1e-6)


def _checkpoint(rank, world, path, phase):
    from ds_xc.compression import load_compression_state, save_compression_state
    engine, opt = _engine(1, TOPK)
    start, stop = {"straight": (0, 4), "save": (0, 2), "resume": (2, 4)}[phase]
    if phase == "resume":
        engine.load_checkpoint(path, tag="t2")
        assert load_compression_state(f"{path}/t2", opt)
    _steps(engine, rank, start, stop)
    if phase == "save":
        save_compression_state(f"{path}/t2", opt)
        engine.save_checkpoint(path, tag="t2")
    return {"params": _params(engine), "residual": opt._buffers["residual"].clone(), "steps": opt.stats()["steps"]}


@pytest.mark.parametrize("world", [2, 3])
def test_zero1_checkpoint_resumes_equal_to_uninterrupted(pools, tmp_path, world):
    pool = pools(world)
    straight = pool.run(_checkpoint, str(tmp_path), "straight")
    pool.run(_checkpoint, str(tmp_path), "save")
    resumed = pool.run(_checkpoint, str(tmp_path), "resume")
    for a, b in zip(straight, resumed):
        assert b["steps"] == 4
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
        assert torch.equal(a["residual"], b["residual"])
    assert not torch.equal(straight[0]["residual"], straight[1]["residual"])  # per-rank state really restored


def _refusal(rank, world, stage, extra):
    from ds_xc.config import ConfigError
    try:
        _engine(stage, TOPK, extra=extra)
    except ConfigError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("stage,extra,key", [(2, None, "zero_optimization.stage=2"),
                                             (1, {"overlap_comm": True}, "zero_optimization.overlap_comm=True")])
def test_unsupported_zero_settings_are_refused_naming_the_keys(pools, stage, extra, key):
    for msg in pools(2).run(_refusal, stage, extra):
        assert msg is not None and key in msg and "gradient_compression.method='topk'" in msg


def test_raw_config_refusals_name_the_keys():
    from ds_xc.config import ConfigError
    from ds_xc.engine import check_supported
    base = {"extreme_classification": {"num_classes": 10, "embedding_dim": 4}, "gradient_compression": {}}
    for zero, bf16, key in [({"stage": 2}, False, "zero_optimization.stage=2"),
                            ({"stage": 1, "overlap_comm": True}, False, "zero_optimization.overlap_comm=True"),
                            ({"stage": 1}, True, "bf16.enabled=true"),
                            ({"stage": 1, "offload_optimizer": {"device": "cpu"}}, False, "offload_optimizer")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            check_supported(dict(base, zero_optimization=zero, bf16={"enabled": bf16}))
    check_supported(dict(base, zero_optimization={"stage": 1}))  # allowed
    check_supported(dict(base, zero_optimization={"stage": 2}, gradient_compression={"method": "none"}))


def _zero2_reproducer(rank, world, stage, bucket=BUCKET):
    """Why ZeRO-2 cannot take compressed gradients: with the engine's all-reduce off, count the
    gradient collectives DeepSpeed issues during the first backward of an accumulation window, look
    at ``.grad`` after it, then run the second micro-batch's backward. ``bucket``:
    zero_optimization.reduce_bucket_size (elements), small so that the 725-parameter model fills
    buckets as a model above 5e8 parameters fills DeepSpeed's default."""
    import deepspeed.comm as dist  # what DeepSpeed's ZeRO code calls its collectives through
    engine, _ = _engine(stage, None, extra={"reduce_bucket_size": bucket} if bucket else None)
    engine.enable_backward_allreduce = False
    calls, originals = [], {}
    for name in ("all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor",
                 "reduce_scatter_fn"):
        if hasattr(dist, name):
            originals[name] = getattr(dist, name)

            def counted(*args, _name=name, **kwargs):
                tensor = (args[1] if _name.startswith("reduce_scatter") and len(args) > 1 else
                          args[0] if args else next(iter(kwargs.values())))
                calls.append(sum(t.numel() for t in tensor) if isinstance(tensor, (list, tuple)) else tensor.numel())
                return originals[_name](*args, **kwargs)
            setattr(dist, name, counted)
    try:
        x, t = _batch(0, rank)
        engine.backward(_loss(engine(x), t))
        out = {"collectives": len(calls), "elements": sum(calls),
               "grads_left": sum(p.grad is not None for p in engine.module.parameters()), "second": "ok"}
        if not bucket:  # nothing reduced yet: ZeRO's own epilogue is what builds the partitioned gradient
            engine.optimizer.independent_gradient_partition_epilogue()
            out.update(epilogue_collectives=len(calls) - out["collectives"],
                       epilogue_elements=sum(calls) - out["elements"])
            return out
        engine.step()  # not a boundary (gas 2)
        x, t = _batch(1, rank)
        try:
            engine.backward(_loss(engine(x), t))
        except AssertionError as exc:  # DeepSpeed's own check, inside its gradient hook
            out["second"] = str(exc)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return out


def test_zero2_reduces_inside_its_hooks_even_with_the_engine_allreduce_off(pools):
    zero1, zero2 = pools(2).run(_zero2_reproducer, 1), pools(2).run(_zero2_reproducer, 2)
    for r in zero1:  # ZeRO-1: nothing reduced, every local gradient still there for the compressed step
        assert r == {"collectives": 0, "elements": 0, "grads_left": 4, "second": "ok"}
    for r in zero2:  # ZeRO-2: reduced densely inside the backward; the next micro-batch trips DeepSpeed's check
        assert r["collectives"] > 0 and r["elements"] > 0 and "has already been reduced" in r["second"]
    numel = sum(p.numel() for p in _body().parameters())
    for r in pools(2).run(_zero2_reproducer, 2, 0):  # default buckets (5e8): held until ZeRO's epilogue, which
        assert r["collectives"] == 0 and r["epilogue_elements"] >= numel  # reduces every gradient densely


# ---------------------------------------------------------------------- through ds_xc.initialize (XCEngine)
C = 23  # classes of the head: 12 + 11 on 2 ranks


def _xc_config(stage):
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": GAS, "steps_per_print": 10**9,
            "gradient_clipping": 0.0, "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
            "gradient_compression": {"method": "bayes_prior", "density": 0.2, "min_numel": 64,
                                     "stats_sync_interval": 2, "adam_variance": "live",  # as ZeRO-1 (its step)
                                     "select_by": "magnitude"},  # ZeRO-1's update score: test_compression_zero_score.py
            "extreme_classification": {"num_classes": C, "embedding_dim": D, "sampler": {"type": "full"},
                                       "loss": {"type": "arcface", "scale": 8.0, "margin": 0.2}, "init_std": 0.5,
                                       "seed": SEED, "optimizer": {"type": "adamw", "lr": 0.05}}}


def _xc_run(rank, world, stage, path, phase, nan_step=None):
    """XCEngine with the compressed backbone: 4 steps straight, or 2 + save, or load + 2."""
    import ds_xc
    body = _body()
    xc = ds_xc.initialize(model=body, optimizer=_adamw(body.parameters()), config=_xc_config(stage))
    start, stop = {"straight": (0, 4), "save": (0, 2), "resume": (2, 4)}[phase]
    if phase == "resume":
        start = xc.load_checkpoint(path)["step"]
    losses, before_nan = [], None
    for step in range(start, stop):
        if step == nan_step:
            before_nan = _params(xc.engine)
        for micro in range(GAS):
            x, t = _batch(step * GAS + micro, rank)
            y = t.argmax(dim=1) * 4 + rank  # labels in [0, C)
            out = xc.engine(x)
            if step == nan_step and rank == 1 and micro == 0:
                out = NanGrad.apply(out)
            loss = xc.head(out, y)
            xc.backward(loss)
            xc.step()
            losses.append(loss.item())
        if step == nan_step:
            unchanged = all(torch.equal(a, b) for a, b in zip(before_nan, _params(xc.engine)))
    if phase == "save":
        xc.save_checkpoint(path, client_state={"step": stop})
    out = {"losses": losses, "params": _params(xc.engine), "residual": xc.compression._buffers["residual"].clone(),
           "head": xc.head.weight.detach().clone(), "skipped": xc.skipped_steps}
    if nan_step is not None:
        out["unchanged"] = unchanged
    return out


def test_xcengine_zero1_compressed_equals_zero0_and_resumes(pools, tmp_path):
    pool = pools(2)
    zero0 = pool.run(_xc_run, 0, None, "straight")
    zero1 = pool.run(_xc_run, 1, None, "straight")
    pool.run(_xc_run, 1, str(tmp_path), "save")
    resumed = pool.run(_xc_run, 1, str(tmp_path), "resume")
    for a, b, c in zip(zero0, zero1, resumed):
        assert b["losses"] == pytest.approx(a["losses"], rel=1e-5, abs=1e-6)
        for x, y in zip(a["params"], b["params"]):
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b["residual"], a["residual"], rtol=1e-4, atol=1e-6)
        assert c["losses"] == b["losses"][2 * GAS:]  # bitwise on CPU
        assert all(torch.equal(x, y) for x, y in zip(b["params"], c["params"]))
        assert torch.equal(b["residual"], c["residual"]) and torch.equal(b["head"], c["head"])
    assert len(set(zero1[0]["losses"])) == 4 * GAS


def test_xcengine_zero1_compressed_skips_a_nan_step_everywhere(pools, tmp_path):
    res = pools(2).run(_xc_run, 1, None, "straight", 1)
    for r in res:
        assert r["skipped"] == 1 and r["unchanged"] is True
        assert all(bool(torch.isfinite(p).all()) for p in r["params"]) and bool(torch.isfinite(r["residual"]).all())
    assert all(torch.equal(a, b) for a, b in zip(res[0]["params"], res[1]["params"]))

"""momentum_correction (ds_xc/compression/momentum.py): the wrapper accumulates the velocity u = m u + g of
the compressed tensors, compresses it, and steps them without the wrapped optimizer's first moment.

The distributed runs (1, 2 and 3 gloo ranks, uneven local batches, top-k) equal a single-process float64
re-implementation: per rank u = m u + g, v = e + u, the k largest |v| per compressed tensor, their mean
over the ranks, e = v - sent, u = 0 where sent, the small tensors' dense mean; then a torch optimizer
that steps with the first moment 0 at compressed steps (AdamW: every tensor; SGD: the compressed ones, the
small dense tensors keep their heavy ball) and with its own before (the dense warm-up). m defaults to Adam's beta1 (or
SGD's momentum) and follows a change of it; a number fixes it. Plus the cases where the default
turns itself off, the param groups left as they were, and a checkpoint that resumes equal."""
import logging

import pytest
import torch

import ds_xc
from ds_xc.compression import CompressedOptimizer

from tests.test_compression_zero import _batch, _body  # uneven local batches (3, 5, 7 rows); a 2-layer MLP

LR = 0.02
TOPK = {"method": "topk", "density": 0.2, "min_numel": 64, "allocation": "numel", "select_by": "magnitude"}
# the MLP's weights (480 and 200 elements) are compressed, its biases (40 and 5) reduced densely


def _inner(kind, params, dtype_groups=None):
    groups = dtype_groups if dtype_groups is not None else [{"params": list(params)}]
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.99), weight_decay=0.01)
    if kind == "cpu_adam":  # DeepSpeed's C++ Adam (AdamW mode), the same update as torch's AdamW
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam(groups, lr=LR, betas=(0.9, 0.99), weight_decay=0.01, adamw_mode=True)
    return torch.optim.SGD(groups, lr=LR * 5, momentum=0.9, weight_decay=0.01)


def _first(kind, group):
    return group["momentum"] if kind == "sgd" else group["betas"][0]


def _set_first(kind, group, value):
    if kind != "sgd":
        group["betas"] = (value, group["betas"][1])
    else:
        group["momentum"] = value


def _run(rank, world, kind, section, steps, change_at=None):
    body = _body()
    opt = CompressedOptimizer(_inner(kind, body.parameters()), dict(TOPK, **section))
    groups_before = opt.inner.param_groups
    for step in range(steps):
        if step == change_at:
            _set_first(kind, opt.param_groups[0], 0.7)  # a momentum schedule (OneCycleLR's kind)
        x, t = _batch(step, rank)
        opt.zero_grad()
        (body(x) - t).pow(2).mean().backward()
        opt.step()
        assert opt.inner.param_groups is groups_before and len(groups_before) == 1  # restored after the step
    return {"params": [p.detach().clone() for p in body.parameters()],
            "velocity": opt._buffers["momentum"].clone() if "momentum" in opt._buffers else None,
            "first": _first(kind, opt.param_groups[0])}


def _reference(world, kind, steps, fixed=None, warmup=0, change_at=None):
    """float64, one process, every rank's gradient computed here; returns the parameters and each
    rank's velocities."""
    body = _body(torch.float64)
    params = list(body.parameters())
    big = [p for p in params if p.numel() >= TOPK["min_numel"]]
    small = [p for p in params if p.numel() < TOPK["min_numel"]]
    opt = _inner(kind, params, [{"params": small}, {"params": big}])
    u = [[torch.zeros_like(p) for p in big] for _ in range(world)]
    e = [[torch.zeros_like(p) for p in big] for _ in range(world)]
    for step in range(steps):
        own = 0.7 if change_at is not None and step >= change_at else 0.9  # the optimizer's own momentum
        m = own if fixed is None else fixed
        mean = [torch.zeros_like(p) for p in params]
        for rank in range(world):
            body.zero_grad()
            x, t = _batch(step, rank, torch.float64)
            (body(x) - t).pow(2).mean().backward()
            for i, p in enumerate(params):
                if p.numel() < TOPK["min_numel"] or step < warmup:
                    mean[i] += p.grad / world
                    continue
                j = next(k for k, q in enumerate(big) if q is p)
                u[rank][j] = m * u[rank][j] + p.grad
                v = (e[rank][j] + u[rank][j]).reshape(-1)
                idx = torch.topk(v.abs(), max(1, round(TOPK["density"] * v.numel()))).indices
                sent = torch.zeros_like(v)
                sent[idx] = v[idx]
                e[rank][j] = (v - sent).view_as(p)
                u[rank][j].view(-1)[idx] = 0.0
                mean[i] += sent.view_as(p) / world
        for p, g in zip(params, mean):
            p.grad = g
        for group in opt.param_groups[(0 if kind == "adamw" else 1):]:  # Adam: all; SGD: the compressed ones
            _set_first(kind, group, own if step < warmup else 0.0)
        opt.step()
    return [p.detach() for p in params], u


def _check(results, expected, velocities, first=None):
    for rank, r in enumerate(results):
        for got, want in zip(r["params"], expected):
            torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=2e-6)
        flat = torch.cat([v.reshape(-1) for v in velocities[rank]])
        assert r["velocity"] is not None and float(r["velocity"].abs().max()) > 0.0
        torch.testing.assert_close(r["velocity"][:flat.numel()], flat.float(), rtol=1e-4, atol=1e-5)
        if first is not None:
            assert r["first"] == first


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_default_velocity_equals_the_float64_reference(pools, world, kind):
    """Default: m = beta1 0.9 (AdamW) or momentum 0.9 (SGD); the compressed tensors step without it."""
    steps = 6
    if world == 1:
        results = [_run(0, 1, kind, {}, steps)]
    else:
        results = pools(world).run(_run, kind, {}, steps)
    expected, velocities = _reference(world, kind, steps)
    _check(results, expected, velocities, first=0.9)  # the user's setting is left as it was


def _cpu_adam_builds() -> bool:
    from deepspeed.ops.op_builder import CPUAdamBuilder
    return CPUAdamBuilder().is_compatible(verbose=False)


def test_deepspeed_adams_take_the_default(pools):
    """DeepSpeed's Adams read each group's betas at every step (FusedAdam on GPUs, DeepSpeedCPUAdam here):
    the default moves beta1 into the velocity for them too, and DeepSpeedCPUAdam's run equals the float64
    reference of torch's AdamW (2 ranks)."""
    if not _cpu_adam_builds():
        pytest.skip("DeepSpeed's CPU Adam op cannot be built here")
    results = pools(2).run(_run, "cpu_adam", {}, 6)
    expected, velocities = _reference(2, "adamw", 6)
    _check(results, expected, velocities, first=0.9)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="DeepSpeed's FusedAdam needs CUDA")
def test_fused_adam_takes_the_default_on_a_gpu():
    """DeepSpeed's default Adam on GPUs: the wrapper owns its first moment and the run equals the same run
    with torch's AdamW (one rank, CUDA)."""
    from deepspeed.ops.adam import FusedAdam
    runs = {}
    for name in ("torch", "fused"):
        body = _body().cuda()
        inner = (torch.optim.AdamW if name == "torch" else FusedAdam)(body.parameters(), lr=LR, betas=(0.9, 0.99),
                                                                     weight_decay=0.01)
        opt = CompressedOptimizer(inner, TOPK)
        seen = []
        inner.register_step_pre_hook(lambda o, a, k: seen.append({g["betas"] for g in o.param_groups}))
        for step in range(6):
            x, t = _batch(step, 0)
            opt.zero_grad()
            (body(x.cuda()) - t.cuda()).pow(2).mean().backward()
            opt.step()
        assert opt.momentum_correction.owns and seen == [{(0.0, 0.99)}] * 6
        runs[name] = [p.detach().cpu() for p in body.parameters()]
    for a, b in zip(runs["torch"], runs["fused"]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("world", [2, 3])
def test_warmup_schedule_and_fixed_factor_equal_the_reference(pools, world):
    """Two dense warm-up steps with Adam's own momentum everywhere, then the velocity; beta1 changed
    to 0.7 at step 4 is followed (default), and a fixed factor 0.5 ignores it."""
    res = pools(world).run(_run, "adamw", {"warmup_steps": 2}, 7, 4)
    expected, velocities = _reference(world, "adamw", 7, warmup=2, change_at=4)
    _check(res, expected, velocities, first=0.7)
    res = pools(world).run(_run, "adamw", {"momentum_correction": 0.5}, 5, 2)
    expected, velocities = _reference(world, "adamw", 5, fixed=0.5, change_at=2)
    _check(res, expected, velocities, first=0.7)


def test_momentum_correction_zero_leaves_the_optimizer_momentum():
    """0 = off: no velocity, and the optimizer's momentum applies to every tensor (a plain AdamW of
    the top-k mean; one process)."""
    body, ref = _body(), _body()
    opt = CompressedOptimizer(_inner("adamw", body.parameters()), dict(TOPK, momentum_correction=0.0))
    plain = _inner("adamw", ref.parameters())
    assert "momentum" not in opt._buffers
    e = {}
    for step in range(4):
        x, t = _batch(step, 0)
        for net in (body, ref):
            net.zero_grad()
            (net(x) - t).pow(2).mean().backward()
        for p in ref.parameters():
            if p.numel() >= TOPK["min_numel"]:
                v = e.get(p, torch.zeros_like(p)).reshape(-1) + p.grad.reshape(-1)
                idx = torch.topk(v.abs(), max(1, round(0.2 * v.numel()))).indices
                sent = torch.zeros_like(v)
                sent[idx] = v[idx]
                e[p] = v - sent
                p.grad = sent.view_as(p)
        opt.step()
        plain.step()
    for a, b in zip(body.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("make,why", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1), "no momentum"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True), "nesterov=True"),
    (lambda ps: torch.optim.RMSprop(ps, lr=0.1, momentum=0.9), "RMSprop, not torch.optim.Adam"),
])
def test_default_turns_off_where_it_cannot_own_the_momentum(caplog, make, why):
    body = _body()
    with caplog.at_level(logging.INFO, logger="ds_xc.compression.momentum"):
        opt = CompressedOptimizer(make(body.parameters()), TOPK)
    assert not opt.momentum_correction.enabled and "momentum" not in opt._buffers
    assert why in caplog.text


def test_error_feedback_off_method_none_and_powersgd_have_no_velocity():
    body = _body()
    for section in ({"error_feedback": False}, {"method": "none"}, {"method": "powersgd"}):
        opt = CompressedOptimizer(_inner("adamw", body.parameters()), dict(TOPK, **section))
        assert not opt.momentum_correction.enabled and "momentum" not in opt._buffers, section


def test_a_wrapper_that_only_reduces_owns_the_momentum_through_step_hooks():
    """steps_optimizer=False (the DDP hook): the user's own optimizer.step() takes the compressed tensors'
    first moment off after a compressed reduction, as the wrapper's step() does (tests/test_ddp_hook.py
    checks the same inside DDP on 2 and 3 ranks)."""
    nets = [_body(), _body()]
    inner = [_inner("adamw", n.parameters()) for n in nets]
    stepping = CompressedOptimizer(inner[0], dict(TOPK, warmup_steps=1))
    reducing = CompressedOptimizer(inner[1], dict(TOPK, warmup_steps=1), steps_optimizer=False)
    assert reducing.momentum_correction.owns
    groups = inner[1].param_groups
    for step in range(4):
        x, t = _batch(step, 0)
        for net in nets:
            net.zero_grad()
            (net(x) - t).pow(2).mean().backward()
        stepping.step()
        reducing.reduce_gradients()
        inner[1].step()
        assert inner[1].param_groups is groups
    for a, b in zip(*[n.parameters() for n in nets]):
        assert torch.equal(a, b)
    assert torch.equal(stepping._buffers["momentum"], reducing._buffers["momentum"])


def test_fixed_factor_with_another_optimizer_keeps_its_momentum(caplog):
    """A number with an optimizer the wrapper cannot step without momentum: the velocity is on, the
    optimizer is untouched, and the log says its momentum applies twice unless set to 0."""
    body = _body()
    inner = torch.optim.RMSprop(body.parameters(), lr=0.01, momentum=0.5)
    with caplog.at_level(logging.INFO, logger="ds_xc.compression.momentum"):
        opt = CompressedOptimizer(inner, dict(TOPK, momentum_correction=0.8))
    assert opt.momentum_correction.enabled and not opt.momentum_correction.owns
    assert "applies twice" in caplog.text
    x, t = _batch(0, 0)
    (body(x) - t).pow(2).mean().backward()
    opt.step()
    assert inner.param_groups[0]["momentum"] == 0.5 and float(opt._buffers["momentum"].abs().max()) > 0


def test_groups_with_different_momenta_turn_the_default_off(caplog):
    body = _body()
    w1, b1, w2, b2 = body.parameters()
    inner = torch.optim.AdamW([{"params": [w1, b1]}, {"params": [w2, b2], "betas": (0.8, 0.99)}], lr=LR)
    with caplog.at_level(logging.WARNING):
        opt = CompressedOptimizer(inner, TOPK)
    assert not opt.momentum_correction.enabled and "different momenta" in caplog.text
    opt = CompressedOptimizer(inner, dict(TOPK, momentum_correction=0.9))  # a number: one factor for all
    assert opt.momentum_correction.owns


def test_checkpoint_resumes_equal_to_uninterrupted():
    """The velocity and the residual round-trip through state_dict(); the resumed run is bitwise equal."""
    def make():
        body = _body()
        return body, CompressedOptimizer(_inner("adamw", body.parameters()), TOPK)

    def train(body, opt, start, stop):
        for step in range(start, stop):
            x, t = _batch(step, 0)
            opt.zero_grad()
            (body(x) - t).pow(2).mean().backward()
            opt.step()

    body, opt = make()
    train(body, opt, 0, 6)
    half_body, half = make()
    train(half_body, half, 0, 3)
    saved = {"model": half_body.state_dict(), "opt": half.state_dict()}
    resumed_body, resumed = make()
    resumed_body.load_state_dict(saved["model"])
    resumed.load_state_dict(saved["opt"])
    assert torch.equal(resumed._buffers["momentum"], half._buffers["momentum"])
    train(resumed_body, resumed, 3, 6)
    for a, b in zip(body.parameters(), resumed_body.parameters()):
        assert torch.equal(a, b)


def test_config_null_is_the_default_and_bad_values_name_the_field():
    from ds_xc.compression.config import parse_compression
    assert parse_compression({}).momentum_correction is None
    assert parse_compression({"momentum_correction": None, "error_feedback": False}).momentum_correction is None
    for bad, allowed in ((1.0, "less than 1"), (-0.1, "greater than or equal to 0"), ("auto", "number")):
        with pytest.raises(ds_xc.ConfigError, match=r"gradient_compression.momentum_correction") as info:
            parse_compression({"momentum_correction": bad})
        assert allowed in str(info.value) and str(bad) in str(info.value)

"""adam_variance: the wrapper's Adam(W) step with the second moment frozen after the dense warm-up
(ds_xc/compression/frozen_adam.py) against a float64 re-implementation, its resolution from the config, its
checkpoint round trip and a skipped step."""
import copy

import pytest
import torch

from ds_xc.compression import CompressedOptimizer, parse_compression
from ds_xc.compression.config import ADAM_WARMUP_STEPS
from ds_xc.compression.frozen_adam import FROZEN_KEY
from ds_xc.config import ConfigError

LR, BETAS, EPS, WD, WARMUP, STEPS = 0.01, (0.9, 0.999), 1e-8, 0.05, 3, 9
SECTION = {"method": "topk", "density": 1.0, "min_numel": 1, "warmup_steps": WARMUP,  # 1 rank, all sent: mean = grad
           "adam_variance": "auto"}


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    a = torch.randn(16, 8, generator=g)
    if step < WARMUP:
        a[:4] = 0.0  # rows no warm-up batch touched: no estimate when the variance freezes
    return [a, torch.randn(40, generator=g) * (1 + step)]


def _params():
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(16, 8, generator=g)), torch.nn.Parameter(torch.randn(40, generator=g))]


def _reference(decoupled: bool, frozen: bool, first_off: bool = False) -> list[list[torch.Tensor]]:
    """Parameters after each step, float64: torch's Adam(W) for the warm-up, then v-hat frozen (where it is
    nonzero; elsewhere Adam's own) when ``frozen``, and beta1 = 0 when ``first_off`` (the wrapper owns the
    momentum: density 1 sends u = m u + g whole and zeroes it, so what is sent is g itself)."""
    ps = [p.detach().double() for p in _params()]
    m = [torch.zeros_like(p) for p in ps]
    v = [torch.zeros_like(p) for p in ps]
    vhat_frozen = None
    out = []
    for t in range(1, STEPS + 1):
        if frozen and t == WARMUP + 1:
            vhat_frozen = [vi / (1 - BETAS[1] ** WARMUP) for vi in v]
        for i, (p, g) in enumerate(zip(ps, _grads(t - 1))):
            g = g.double()
            if decoupled:
                p.mul_(1 - LR * WD)
            else:
                g = g + WD * p
            b1 = 0.0 if first_off and t > WARMUP else BETAS[0]
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = BETAS[1] * v[i] + (1 - BETAS[1]) * g * g
            vhat = v[i] / (1 - BETAS[1] ** t)
            if vhat_frozen is not None:
                vhat = torch.where(vhat_frozen[i] > 0, vhat_frozen[i], vhat)
            p.sub_(LR / (1 - b1 ** t) * m[i] / (vhat.sqrt() + EPS))
        out.append([p.clone() for p in ps])
    return out


def _wrapper(kind, params, section=SECTION):
    inner = kind(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    return CompressedOptimizer(inner, section)


def _step(opt, params, t):
    for p, g in zip(params, _grads(t)):
        p.grad = g.clone()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("velocity", [None, 0.0])
@pytest.mark.parametrize("kind", [torch.optim.AdamW, torch.optim.Adam])
def test_frozen_step_equals_the_float64_reference(kind, velocity):
    """velocity None: the default momentum_correction, the compressed steps without Adam's first moment."""
    decoupled = kind is torch.optim.AdamW
    params = _params()
    opt = _wrapper(kind, params, dict(SECTION, momentum_correction=velocity))
    assert opt.frozen_variance  # auto: an Adam, a warm-up, error feedback, an element-selecting method
    assert opt.momentum_correction.owns == (velocity is None)
    ref = _reference(decoupled, frozen=True, first_off=velocity is None)
    live = _reference(decoupled, frozen=False, first_off=velocity is None)
    for t in range(STEPS):
        _step(opt, params, t)
        for p, r in zip(params, ref[t]):
            torch.testing.assert_close(p.detach().double(), r, rtol=2e-6, atol=2e-6)
    # the frozen variance matters: plain Adam(W) ends elsewhere
    assert max(float((a - b).abs().max()) for a, b in zip(ref[-1], live[-1])) > 1e-3
    frozen = opt.inner.state[params[0]][FROZEN_KEY]
    if decoupled:  # rows without a warm-up gradient have no estimate (and stay live)
        assert bool((frozen[:4] == 0).all()) and bool((frozen[4:] > 0).all())
    else:  # Adam's L2 term gave them one
        assert bool((frozen > 0).all())


def test_checkpoint_resume_equals_uninterrupted():
    params, params2 = _params(), _params()
    opt = _wrapper(torch.optim.AdamW, params)
    for t in range(WARMUP + 2):
        _step(opt, params, t)
    state = copy.deepcopy(opt.state_dict())  # torch's load_state_dict keeps the tensors it is given
    assert FROZEN_KEY in state["inner"]["state"][0]
    opt2 = _wrapper(torch.optim.AdamW, params2)
    with torch.no_grad():
        for a, b in zip(params2, params):
            a.copy_(b)
    opt2.load_state_dict(state)
    for t in range(WARMUP + 2, STEPS):
        _step(opt, params, t)
        _step(opt2, params2, t)
    for a, b in zip(params, params2):
        assert torch.equal(a, b)


def test_skipped_step_changes_nothing():
    params = _params()
    opt = _wrapper(torch.optim.AdamW, params)
    for t in range(WARMUP + 1):
        _step(opt, params, t)
    before = [p.detach().clone() for p in params]
    opt.inner.step = lambda *a, **k: None  # what the engine does to a skipped step
    opt.skip_reduction()
    _step(opt, params, WARMUP + 1)
    assert all(torch.equal(a, b) for a, b in zip(params, before))
    del opt.inner.step
    _step(opt, params, WARMUP + 2)
    assert not all(torch.equal(a, b) for a, b in zip(params, before))


def test_resolution_from_the_config():
    def on(kind=torch.optim.AdamW, **section):
        params = _params()
        inner = kind(params, lr=LR) if kind is not torch.optim.SGD else kind(params, lr=LR)
        return CompressedOptimizer(inner, dict(SECTION, **section)).frozen_variance

    assert on() and on(adam_variance="frozen")
    assert not on(adam_variance="live")
    assert not on(warmup_steps=0) and not on(kind=torch.optim.SGD) and not on(error_feedback=False)
    assert not on(method="none", adam_variance="auto")
    params = _params()
    assert not CompressedOptimizer(torch.optim.AdamW(params, amsgrad=True), SECTION).frozen_variance
    with pytest.raises(ConfigError, match=r"gradient_compression.adam_variance='frozen': the wrapped optimizer is "
                                          r"SGD, not torch.optim.Adam"):
        on(kind=torch.optim.SGD, adam_variance="frozen")
    for bad in ({"warmup_steps": 0}, {"method": "powersgd"}, {"error_feedback": False}):
        with pytest.raises(ConfigError,
                           match=r"adam_variance='frozen' with warmup_steps=.*allowed: warmup_steps null or >= 1"):
            parse_compression(dict({"adam_variance": "frozen", "warmup_steps": 2}, **bad))
    with pytest.raises(ConfigError, match=r"gradient_compression.adam_variance.*'live'"):
        parse_compression({"adam_variance": "always"})



def test_default_warmup_follows_the_variance():
    """warmup_steps null: ADAM_WARMUP_STEPS dense steps when an Adam's variance is frozen, else none (and the
    variance stays live unless asked for)."""
    def made(kind, **section):
        params = _params()
        return CompressedOptimizer(kind(params, lr=LR), dict({"method": "topk"}, **section))

    assert not made(torch.optim.AdamW).frozen_variance and made(torch.optim.AdamW).warmup_steps == 0  # defaults
    assert made(torch.optim.AdamW, adam_variance="auto").warmup_steps == ADAM_WARMUP_STEPS
    assert made(torch.optim.AdamW, adam_variance="frozen").warmup_steps == ADAM_WARMUP_STEPS
    assert made(torch.optim.SGD, adam_variance="auto").warmup_steps == 0
    assert made(torch.optim.AdamW, adam_variance="auto", warmup_steps=7).warmup_steps == 7
    opt = made(torch.optim.AdamW, adam_variance="auto")
    params = opt.params
    for t in range(ADAM_WARMUP_STEPS + 1):
        assert opt.compresses_this_step() == (t >= ADAM_WARMUP_STEPS)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()


def test_channels_last_state_takes_the_mask_path():
    """A channels_last convolution weight's Adam state is not contiguous: its live elements go through a mask,
    with the same result as a contiguous copy of the same parameter."""
    g0 = torch.Generator().manual_seed(3)
    w = torch.randn(8, 4, 3, 3, generator=g0)
    grads = [torch.randn(8, 4, 3, 3, generator=g0) for _ in range(WARMUP + 3)]
    for t in range(WARMUP):
        grads[t][:2] = 0.0  # two output channels with no estimate when the variance freezes
    out = []
    for fmt in (torch.contiguous_format, torch.channels_last):
        p = torch.nn.Parameter(w.clone().contiguous(memory_format=fmt))
        opt = CompressedOptimizer(torch.optim.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD),
                                  dict(SECTION, min_numel=1))
        for g in grads:
            p.grad = g.clone().contiguous(memory_format=fmt)
            opt.step()
        assert opt.inner.state[p]["exp_avg_sq"].is_contiguous() == (fmt is torch.contiguous_format)
        out.append(p.detach().contiguous())
    torch.testing.assert_close(out[0], out[1], rtol=1e-6, atol=1e-7)

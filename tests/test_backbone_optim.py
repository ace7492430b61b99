"""LAMB and LARS (ds_xc/optim/) against the papers' formulas written plainly in float64 numpy.

Several parameter tensors of different shapes and scales (so that the trust ratio is clamped
at both ends), a tensor that starts at 0 (||w|| = 0: ratio 1), a tensor whose gradient is
always 0 (||g|| = 0), weight decay on and off, the exclusion of 1-D tensors, 30 steps with
a learning rate that changes at every step; and a state_dict round trip mid-run.
"""
import copy
import math

import numpy as np
import pytest
import torch

from ds_xc.optim import Lamb, Lars

SHAPES = [(5, 3), (4,), (2, 3, 2), (3, 3), (6,), (2, 2)]
SCALES = [10.0, 0.3, 0.003, 0.0, 1.0, 1.0]  # (3, 3) starts at 0; (2, 2) never gets a gradient
STEPS = 30


def _start():
    rng = np.random.default_rng(0)
    return [s * rng.standard_normal(shape) for shape, s in zip(SHAPES, SCALES)]


def _noise():
    rng = np.random.default_rng(1)
    return [[rng.standard_normal(shape) for shape in SHAPES] for _ in range(STEPS)]


def _grad(i, w, t, noise):
    """The gradient at step t: it depends on the weights, so errors compound; tensor 5 gets none."""
    return np.zeros_like(w) if i == 5 else 0.5 * w + noise[t][i]


def _lr(t, base):
    return base * (1.0 + 0.5 * math.sin(t))  # changes every step, as a scheduler would


def lamb_reference(weights, noise, lr, betas, eps, wd, lo, hi, bias_correction, eps_inside_sqrt, exclude):
    """Weights after STEPS LAMB steps and the number of clamped ratios (You et al. 2019, Algorithm 2)."""
    w = [x.copy() for x in weights]
    m = [np.zeros_like(x) for x in w]
    v = [np.zeros_like(x) for x in w]
    clamped = 0
    for t in range(STEPS):
        for i in range(len(w)):
            g = _grad(i, w[i], t, noise)
            if i == 5:
                continue  # no gradient: torch leaves .grad None, the optimizer skips the tensor
            m[i] = betas[0] * m[i] + (1 - betas[0]) * g
            v[i] = betas[1] * v[i] + (1 - betas[1]) * g * g
            step = t + 1
            mh = m[i] / (1 - betas[0] ** step) if bias_correction else m[i]
            vh = v[i] / (1 - betas[1] ** step) if bias_correction else v[i]
            denom = np.sqrt(vh + eps) if eps_inside_sqrt else np.sqrt(vh) + eps
            one_d = exclude and w[i].ndim <= 1
            r = mh / denom + (0.0 if one_d else wd) * w[i]
            wn, rn = np.sqrt((w[i] ** 2).sum()), np.sqrt((r ** 2).sum())
            if one_d or wn == 0 or rn == 0:
                trust = 1.0
            else:
                trust = min(max(wn / rn, lo), hi)
                clamped += trust in (lo, hi)
            w[i] = w[i] - _lr(t, lr) * trust * r
    return w, clamped


def lars_reference(weights, noise, lr, momentum, wd, eta, eps, exclude):
    """Weights after STEPS LARS steps (You et al. 2017, Algorithm 1); tensor 5's gradient is 0, not None."""
    w = [x.copy() for x in weights]
    vel = [np.zeros_like(x) for x in w]
    for t in range(STEPS):
        for i in range(len(w)):
            g = _grad(i, w[i], t, noise)
            one_d = exclude and w[i].ndim <= 1
            decay = 0.0 if one_d else wd
            wn, gn = np.sqrt((w[i] ** 2).sum()), np.sqrt((g ** 2).sum())
            local = 1.0 if one_d or wn == 0 or gn == 0 else eta * wn / (gn + decay * wn + eps)
            vel[i] = momentum * vel[i] + _lr(t, lr) * local * (g + decay * w[i])
            w[i] = w[i] - vel[i]
    return w


def _run(make, weights, noise, lr, steps=range(STEPS), params=None, opt=None, grad_for_5=False):
    params = params or [torch.nn.Parameter(torch.tensor(x)) for x in weights]
    opt = opt or make(params)
    for t in steps:
        for group in opt.param_groups:
            group["lr"] = _lr(t, lr)
        for i, p in enumerate(params):
            g = _grad(i, p.detach().numpy(), t, noise)
            p.grad = torch.tensor(g) if (i != 5 or grad_for_5) else None
        opt.step()
    return params, opt


LAMB_CASES = [  # (weight_decay, exclude, bias_correction, eps_inside_sqrt, min_coeff, max_coeff)
    (0.0, False, True, False, 0.01, 10.0),
    (0.05, False, True, False, 0.5, 2.0),
    (0.05, True, True, False, 0.5, 2.0),
    (0.0, True, False, True, 0.01, 10.0),
]


@pytest.mark.parametrize("wd, exclude, bias_correction, inside, lo, hi", LAMB_CASES)
def test_lamb_equals_the_float64_formula(wd, exclude, bias_correction, inside, lo, hi):
    weights, noise = _start(), _noise()
    kw = {"betas": (0.9, 0.99), "eps": 1e-6, "weight_decay": wd, "min_coeff": lo, "max_coeff": hi,
              "bias_correction": bias_correction, "eps_inside_sqrt": inside, "exclude_bias_and_norm": exclude}
    params, _ = _run(lambda ps: Lamb(ps, lr=0.01, **kw), weights, noise, 0.01)
    ref, clamped = lamb_reference(weights, noise, 0.01, (0.9, 0.99), 1e-6, wd, lo, hi, bias_correction, inside,
                                  exclude)
    if hi == 2.0:
        assert clamped > 10, "the case should exercise the clamp"
    assert np.abs(ref[3]).sum() > 0 and not np.allclose(ref[0], weights[0])  # started at 0, moved
    for p, r in zip(params, ref):
        np.testing.assert_allclose(p.detach().numpy(), r, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("wd, exclude, eps", [(0.0, False, 0.0), (0.01, False, 0.0), (0.01, True, 0.0),
                                              (0.01, True, 1e-3)])
def test_lars_equals_the_float64_formula(wd, exclude, eps):
    weights, noise = _start(), _noise()
    make = lambda ps: Lars(ps, lr=2.0, momentum=0.9, weight_decay=wd, trust_coefficient=0.02, eps=eps,
                           exclude_bias_and_norm=exclude)
    params, _ = _run(make, weights, noise, 2.0, grad_for_5=True)
    ref = lars_reference(weights, noise, 2.0, 0.9, wd, 0.02, eps, exclude)
    assert not np.allclose(ref[1], weights[1])
    for p, r in zip(params, ref):
        np.testing.assert_allclose(p.detach().numpy(), r, rtol=1e-10, atol=1e-12)


def test_the_trust_ratio_changes_the_step():
    """The reference is not plain Adam / SGD: without the trust ratio the weights differ (the test can fail)."""
    weights, noise = _start(), _noise()
    ref, _ = lamb_reference(weights, noise, 0.01, (0.9, 0.99), 1e-6, 0.0, 1.0, 1.0, True, False, False)
    ours, _ = lamb_reference(weights, noise, 0.01, (0.9, 0.99), 1e-6, 0.0, 0.01, 10.0, True, False, False)
    assert not np.allclose(ref[0], ours[0])


@pytest.mark.parametrize("make", [
    lambda ps: Lamb(ps, lr=0.01, weight_decay=0.05, exclude_bias_and_norm=True),
    lambda ps: Lars(ps, lr=2.0, weight_decay=0.01, trust_coefficient=0.02),
])
def test_state_dict_round_trip_continues_identically(make):
    weights, noise = _start(), _noise()
    params, opt = _run(make, weights, noise, 0.01, steps=range(12))
    saved = copy.deepcopy(opt.state_dict())
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = make(twin)
    resumed.load_state_dict(saved)
    _run(make, weights, noise, 0.01, steps=range(12, STEPS), params=params, opt=opt)
    _run(make, weights, noise, 0.01, steps=range(12, STEPS), params=twin, opt=resumed)
    for a, b in zip(params, twin):
        assert torch.equal(a, b)
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in twin]
    _run(make, weights, noise, 0.01, steps=range(12, STEPS), params=fresh)  # without the state: differs
    assert not all(torch.equal(a, b) for a, b in zip(params, fresh))


def test_bad_arguments_are_refused():
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="betas"):
        Lamb(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="min_coeff"):
        Lamb(p, min_coeff=2.0, max_coeff=1.0)
    with pytest.raises(ValueError, match="momentum"):
        Lars(p, momentum=1.5)

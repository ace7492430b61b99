"""bf16 head: stochastic rounding, the three bf16 update modes of HeadSGD/HeadAdamW against
float64 / float32 references, state-dict round trips and persistent bytes per element."""
from __future__ import annotations

import io

import pytest
import torch

import ds_xc
from ds_xc import config as cfg
from ds_xc.head import HeadAdamW, HeadSGD, sharded_margin_loss
from ds_xc.head.bf16 import persistent_bytes, stochastic_round
from ds_xc.head.margins import build_loss

MODES = ("stochastic_rounding", "master_fp32", "plain")


def _neighbours(x: torch.Tensor):
    """The bf16 values either side of float32 x: (toward zero, away from zero)."""
    bits = x.view(torch.int32)
    lo = (bits & -65536).view(torch.float32)
    hi = ((bits & -65536) + 65536).view(torch.float32)
    return lo, hi


@pytest.mark.parametrize("value", [1.0 + 0.3 * 2 ** -7, -3.0e-3 * 1.37, 123.456, 1.0 + 2 ** -7])
def test_stochastic_round_unbiased_and_neighbours(value):
    n = 200_000
    x = torch.full((n,), value, dtype=torch.float32)
    out = stochastic_round(x, torch.Generator().manual_seed(1)).float()
    lo, hi = _neighbours(x[:1])
    assert bool(((out == lo) | (out == hi)).all()), "every result is one of the two bf16 neighbours"
    if float(lo) == value:  # exactly representable: never moves
        assert bool((out == lo).all())
        return
    p = (value - float(lo)) / (float(hi) - float(lo))  # probability of rounding away from zero
    sigma = abs(float(hi) - float(lo)) * (p * (1 - p) / n) ** 0.5
    assert abs(out.double().mean().item() - value) < 5 * sigma
    assert 0 < int((out == hi).sum()) < n  # both neighbours occur
    rtn = x[:1].to(torch.bfloat16).float()
    assert abs(out.double().mean().item() - value) < abs(float(rtn) - value) or p == 0.5


def test_stochastic_round_deterministic_given_the_generator():
    x = torch.randn(1000)
    a = stochastic_round(x, torch.Generator().manual_seed(7))
    b = stochastic_round(x, torch.Generator().manual_seed(7))
    c = stochastic_round(x, torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)
    state = torch.get_rng_state()
    stochastic_round(x, torch.Generator().manual_seed(7))
    assert torch.equal(state, torch.get_rng_state()), "the global RNG is never used"


def _make(kind: str, p: torch.Tensor, mode: str = "stochastic_rounding", lazy: bool = False, **kw):
    if kind == "sgd":
        hp = dict(lr=0.1, momentum=0.9, weight_decay=0.0)
        hp.update(kw)
        return HeadSGD([p], lazy=lazy, bf16_update=mode, seed=3, **hp)
    hp = dict(lr=1e-3, weight_decay=0.0)
    hp.update(kw)
    return HeadAdamW([p], lazy=lazy, bf16_update=mode, seed=3, **hp)


def _grad(g: torch.Tensor, rows: torch.Tensor | None):
    """Dense g, or the row-sparse gradient of ``rows`` (a sampler's sorted active set)."""
    if rows is None:
        return g.clone()
    return torch.sparse_coo_tensor(rows[None], g[rows], g.shape)


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("lazy", [False, True])
def test_small_updates_plain_drifts_sr_and_master_track_float64(kind, lazy):
    """50 steps whose per-step change (1e-4 for SGD lr*g/(1-mu) -> 1e-3, AdamW ~lr = 1e-3) is
    below half a bf16 ulp at |w| in [1, 2) (2^-8 ~ 3.9e-3): round-to-nearest loses every one of
    them, stochastic rounding keeps them in expectation, the master copy exactly."""
    gen = torch.Generator().manual_seed(0)
    w0 = (1.0 + torch.rand(512, 16, generator=gen)).to(torch.bfloat16)  # (L, d) in [1, 2)
    g = torch.full((512, 16), 1e-3).to(torch.bfloat16).float()  # bf16-exact, the same for all; SGD: lr*g = 1e-4 per step, momentum builds it to 1e-3
    rows = torch.arange(0, 512, 2) if lazy else None
    ref = w0.double().clone()
    opt_ref = _make(kind, ref, lazy=lazy)
    weights = {m: w0.clone() for m in MODES}
    opts = {m: _make(kind, weights[m], m, lazy=lazy) for m in MODES}
    for _ in range(50):
        ref.grad = _grad(g.double(), rows)
        opt_ref.step()
        for m in MODES:
            weights[m].grad = _grad(g.to(torch.bfloat16), rows)
            opts[m].step()
    moved = (ref - w0.double()) if rows is None else (ref - w0.double())[rows]
    drift = moved.abs().mean().item()
    assert drift > 0.02  # the reference moved by ~0.03-0.05 per element

    def bias(m):  # mean signed error against float64 over the updated rows
        err = weights[m].double() - ref
        return (err if rows is None else err[rows]).mean().abs().item()

    assert bias("plain") > 0.8 * drift, "round-to-nearest loses updates below half an ulp"
    assert bias("stochastic_rounding") < 0.05 * drift
    master = opts["master_fp32"].state[weights["master_fp32"]]["master"]
    assert (master.double() - ref).abs().max().item() < 1e-5  # float32 accumulation of the updates
    ulp = 2 ** -7  # the bf16 weight is the master's nearest bf16 value
    assert (weights["master_fp32"].double() - ref).abs().max().item() <= ulp / 2 + 1e-6


def _trajectory_case(kind: str, lazy: bool, steps: int = 30):
    gen = torch.Generator().manual_seed(1)
    w0 = torch.randn(300, 8, generator=gen).to(torch.bfloat16)
    grads = [torch.randn(300, 8, generator=gen).to(torch.bfloat16) for _ in range(steps)]
    rows = [torch.randperm(300, generator=gen)[:40].sort().values if lazy else None for _ in range(steps)]
    kw = dict(weight_decay=5e-4, nesterov=True) if kind == "sgd" else dict(weight_decay=0.05)
    return w0, grads, rows, kw


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("lazy", [False, True])
def test_master_mode_is_the_fp32_trajectory_cast_to_bf16(kind, lazy):
    w0, grads, rows, kw = _trajectory_case(kind, lazy)
    p32, pb = w0.float().clone(), w0.clone()
    o32, ob = _make(kind, p32, lazy=lazy, **kw), _make(kind, pb, "master_fp32", lazy=lazy, **kw)
    for g, r in zip(grads, rows):
        p32.grad, pb.grad = _grad(g.float(), r), _grad(g, r)
        o32.step()
        ob.step()
        assert torch.equal(pb, p32.to(torch.bfloat16))
    assert torch.equal(ob.state[pb]["master"], p32)
    for key, value in o32.state[p32].items():
        assert torch.equal(ob.state[pb][key], value), key


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lazy", [False, True])
def test_state_dict_round_trip_resumes_bitwise(kind, mode, lazy):
    w0, grads, rows, kw = _trajectory_case(kind, lazy, steps=12)
    pa = w0.clone()
    oa = _make(kind, pa, mode, lazy=lazy, **kw)
    for g, r in zip(grads[:6], rows[:6]):
        pa.grad = _grad(g, r)
        oa.step()
    buf = io.BytesIO()
    torch.save({"w": pa.detach().clone(), "opt": oa.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    pb = saved["w"].clone()
    ob = _make(kind, pb, mode, lazy=lazy, **kw)
    ob.seed = 12345  # a fresh optimizer's own seed must not matter: the saved stream wins
    ob.load_state_dict(saved["opt"])
    for key, value in oa.state[pa].items():
        assert ob.state[pb][key].dtype == value.dtype, key  # float32 states stay float32
    for g, r in zip(grads[6:], rows[6:]):
        pa.grad, pb.grad = _grad(g, r), _grad(g, r)
        oa.step()
        ob.step()
    assert torch.equal(pa, pb)
    for key, value in oa.state[pa].items():
        assert torch.equal(ob.state[pb][key], value), key


EXPECTED_BYTES = {  # bytes per weight element: weights + optimizer state
    ("sgd", "float32", None): 8, ("sgd", "bfloat16", "stochastic_rounding"): 4,
    ("sgd", "bfloat16", "master_fp32"): 10, ("sgd", "bfloat16", "plain"): 4,
    ("adamw", "float32", None): 12, ("adamw", "bfloat16", "stochastic_rounding"): 8,
    ("adamw", "bfloat16", "master_fp32"): 14, ("adamw", "bfloat16", "plain"): 6,
}


@pytest.mark.parametrize("case", sorted(EXPECTED_BYTES, key=str))
def test_persistent_bytes_per_element(case):
    kind, dtype, mode = case
    head = ds_xc.ClassParallelHead(16, 101, dtype=dtype)
    section = {"type": kind, "momentum": 0.9}
    if mode:
        section["bf16_update"] = mode
    opt = ds_xc.build_head_optimizer(head, section)
    x, y = torch.randn(8, 16), torch.randint(0, 101, (8,))
    head(x, y).backward()
    opt.step()
    got = persistent_bytes(opt)
    assert got["total"] == EXPECTED_BYTES[case] * 101 * 16
    assert got["weights"] == (2 if dtype == "bfloat16" else 4) * 101 * 16


def test_sr_target_ratios():
    """The chosen mode sits inside 0.5-0.75x of float32's persistent bytes for both optimizers."""
    for kind in ("sgd", "adamw"):
        ratio = EXPECTED_BYTES[(kind, "bfloat16", "stochastic_rounding")] / EXPECTED_BYTES[(kind, "float32", None)]
        assert 0.5 <= ratio <= 0.75


def test_bf16_update_config_checked():
    with pytest.raises(cfg.ConfigError, match="bf16_update"):
        HeadSGD([torch.zeros(2, 2, dtype=torch.bfloat16)], lr=0.1, bf16_update="kahan")
    head = ds_xc.ClassParallelHead(4, 10, dtype="bfloat16")
    with pytest.raises(cfg.ConfigError, match="bf16_update"):
        ds_xc.build_head_optimizer(head, {"type": "sgd", "bf16_update": "kahan"})
    assert ds_xc.build_head_optimizer(head, {"type": "adamw"}).bf16_update == "stochastic_rounding"


@pytest.mark.parametrize("loss_name", ["softmax", "cosface"])
def test_bf16_logits_and_gradient_in_float32(loss_name):
    """bf16 weights: the loss is the float64 loss of the same (bf16-valued) weights to float32
    accuracy (no bf16 rounding of the logits), the weight gradient to bf16 rounding of the
    float32-accumulated gradient (its dtype is the weight's, as autograd requires)."""
    gen = torch.Generator().manual_seed(2)
    loss = build_loss({"type": loss_name, "scale": 64.0, "margin": 0.35} if loss_name == "cosface" else loss_name)
    x = torch.randn(64, 32, generator=gen)
    wb = (3 * torch.randn(500, 32, generator=gen)).to(torch.bfloat16).requires_grad_()
    w64 = wb.detach().double().requires_grad_()
    t = torch.randint(0, 500, (64,), generator=gen)
    lb = sharded_margin_loss(x, wb, t, loss, chunk_size=16)
    l64 = sharded_margin_loss(x.to(torch.bfloat16).double(), w64, t, loss, chunk_size=16)
    lb.backward()
    l64.backward()
    assert abs(lb.item() - l64.item()) < 1e-5 * max(1.0, abs(l64.item()))
    assert wb.grad.dtype == torch.bfloat16
    rel = (wb.grad.double() - w64.grad).norm() / w64.grad.norm()
    assert rel < 2 ** -8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_logits_float32_on_cuda():
    from ds_xc.head.softmax import _mm

    gen = torch.Generator().manual_seed(3)
    a = torch.randn(32, 64, generator=gen).cuda()
    w = torch.randn(3000, 64, generator=gen).to(torch.bfloat16).cuda()
    out = torch.empty(32, 3000, device="cuda")
    ref = a.to(torch.bfloat16).double() @ w.double().t()
    assert (_mm(a, w, out).double() - ref).abs().max().item() < 1e-3  # bf16 output would be off ~0.03


@pytest.mark.parametrize("mode", MODES)
def test_head_checkpoint_resume_bitwise(tmp_path, mode):
    """save_head_state / load_head_state (the engine's checkpoint path) keep the bf16 states,
    their dtypes and the rounding stream: the resumed head steps exactly like the original."""
    from ds_xc.checkpoint import load_head_state, save_head_state

    section = {"type": "adamw", "lr": 1e-3, "weight_decay": 0.01, "bf16_update": mode}
    heads = [ds_xc.ClassParallelHead(16, 97, dtype="bfloat16", seed=5) for _ in range(2)]
    opts = [ds_xc.build_head_optimizer(h, section) for h in heads]
    gen = torch.Generator().manual_seed(4)
    batches = [(torch.randn(8, 16, generator=gen), torch.randint(0, 97, (8,), generator=gen)) for _ in range(6)]

    def step(i, x, y):
        heads[i](x, y).backward()
        opts[i].step()
        opts[i].zero_grad(set_to_none=True)

    for x, y in batches[:3]:
        step(0, x, y)
    save_head_state(str(tmp_path), heads[0], opts[0])
    load_head_state(str(tmp_path), heads[1], opts[1])
    for x, y in batches[3:]:
        step(0, x, y)
        step(1, x, y)
    assert torch.equal(heads[0].weight, heads[1].weight)
    for key, value in opts[0].state[heads[0].weight].items():
        assert torch.equal(opts[1].state[heads[1].weight][key], value), key

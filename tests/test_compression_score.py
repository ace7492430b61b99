"""select_by: ranking the pending values in units of the wrapped Adam's steps (ds_xc/compression/score.py).

Checked against float64 references: the score of any region of the bucket (a node slice cutting
through a tensor), and on 2 and 3 gloo ranks with uneven batches the elements each rank sends,
which must be the top-k of |v| / sqrt(max(v-hat, floor)) computed from the replicated Adam state.
"""
import logging

import pytest
import torch

from ds_xc.compression import CompressedOptimizer
from ds_xc.compression.layout import plan_layout
from ds_xc.compression.frozen_adam import FROZEN_KEY
from ds_xc.compression.score import FLOOR, UpdateScore
from ds_xc.config import ConfigError

from tests.test_compression_momentum import _cpu_adam_builds  # whether DeepSpeed's CPU Adam op builds here

IN, HID, OUT = 40, 120, 30  # compressed (min_numel 1000): 40*120 and 120*30 weights; biases dense


def _net():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.Tanh(), torch.nn.Linear(HID, OUT))


def _score64(v, sq, steps, beta2=0.999):
    """The float64 reference: v / sqrt(max(v-hat, FLOOR * mean v-hat))."""
    vhat = sq.double() / (1.0 - beta2 ** steps)
    return v.double() / vhat.clamp(min=FLOOR * float(vhat.mean())).sqrt()


def test_score_of_a_region_equals_the_float64_formula():
    """A node slice (local rank 1 of 3) cuts the first weight: its positions score with that weight's
    own v-hat at the right offsets; a tensor without Adam state yet is ranked by v itself."""
    net = _net()
    params = list(net.parameters())
    opt = torch.optim.AdamW(params[:2], lr=1e-3)  # the second weight never steps: no state
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p) * torch.rand_like(p)
        opt.step()
    lay = plan_layout(params, 1000, True, local_rank=1, local_size=3)
    lo, hi = lay.region
    assert lay.starts[0] < lo < lay.starts[0] + params[0].numel() < hi  # the slice starts inside weight 0
    score = UpdateScore(opt, params, lay)
    v = torch.randn(hi - lo)
    out = score(v, torch.full_like(v, float("nan")), 0, hi - lo)
    w0 = params[0].numel() - (lo - lay.starts[0])  # positions of weight 0 in the region
    ref = _score64(v[:w0], opt.state[params[0]]["exp_avg_sq"].reshape(-1)[lo - lay.starts[0]:], 3)
    torch.testing.assert_close(out[:w0].double(), ref, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(out[w0:], v[w0:])  # weight 2 (index 2) has no Adam state: v
    assert not torch.allclose(out[:w0], v[:w0])  # the scale matters
    part = score(v, torch.zeros_like(v), 5, 9)  # only [5, 9) is written
    assert torch.equal(part[5:9], out[5:9]) and not part[:5].any() and not part[9:].any()


def test_a_frozen_variance_is_the_one_ranked_by():
    """adam_variance frozen: the steps divide by the frozen v-hat, so the score does too."""
    net = _net()
    params = list(net.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    frozen = torch.rand_like(params[0]) ** 4  # (HID, IN) unlike exp_avg_sq, and some below the floor
    opt.state[params[0]][FROZEN_KEY] = frozen
    lay = plan_layout(params, 1000, True)
    v = torch.randn(lay.padded)
    out = UpdateScore(opt, params, lay)(v, torch.zeros_like(v), 0, params[0].numel())
    n = params[0].numel()
    want = v[:n].double() / frozen.reshape(-1).double().clamp(min=FLOOR * float(frozen.double().mean())).sqrt()
    torch.testing.assert_close(out[:n].double(), want, rtol=1e-6, atol=0.0)
    assert (frozen.reshape(-1) < FLOOR * float(frozen.mean())).any()  # the floor is exercised


def test_the_score_follows_the_groups_a_load_installs():
    """torch's load_state_dict installs new group dicts (with the checkpoint's betas): the score
    then bias-corrects with the loaded beta2, and with a schedule's later change of it."""
    net = _net()
    params = list(net.parameters())
    saved = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95))
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        saved.step()
    opt = torch.optim.AdamW(params, lr=1e-3)  # beta2 0.999 until the load
    lay = plan_layout(params, 1000, True)
    score = UpdateScore(opt, params, lay)
    n = params[0].numel()
    v = torch.randn(lay.padded)
    score(v, torch.zeros_like(v), 0, n)  # builds the map on the groups of before
    opt.load_state_dict(saved.state_dict())
    sq = opt.state[params[0]]["exp_avg_sq"].reshape(-1)
    for beta2 in (0.95, 0.9):
        opt.param_groups[0]["betas"] = (0.9, beta2)
        out = score(v, torch.zeros_like(v), 0, n)
        torch.testing.assert_close(out[:n].double(), _score64(v[:n], sq, 2, beta2), rtol=1e-6, atol=0.0)
    assert not torch.allclose(out[:n].double(), _score64(v[:n], sq, 2, 0.999), rtol=1e-3, atol=0.0)


def test_auto_resolution_and_errors(caplog):
    net = _net()
    cfg = {"method": "topk", "density": 0.1, "min_numel": 1000}
    assert CompressedOptimizer(torch.optim.AdamW(net.parameters()), cfg)._update_score is not None
    with caplog.at_level(logging.INFO, logger="ds_xc.compression.score"):
        assert CompressedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), cfg)._update_score is None
    assert "select_by auto -> magnitude" in caplog.text
    assert CompressedOptimizer(torch.optim.AdamW(net.parameters()), dict(cfg, select_by="magnitude"))._update_score \
        is None
    with pytest.raises(ConfigError, match=r"select_by='update'.*SGD"):
        CompressedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), dict(cfg, select_by="update"))
    with pytest.raises(ConfigError, match=r"gradient_compression.*select_by.*randomk"):
        CompressedOptimizer(torch.optim.AdamW(net.parameters()), dict(cfg, method="randomk", select_by="update"))


def _adam(kind, params, **kw):
    if kind == "cpu_adam":  # DeepSpeed's C++ Adam; FusedAdam (a GPU's) keeps the same state
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam(params, adamw_mode=True, **kw)
    return torch.optim.AdamW(params, **kw)


@pytest.mark.parametrize("bias_correction", [True, False])
def test_deepspeed_cpu_adam_is_ranked_by_its_state(bias_correction, caplog):
    """DeepSpeed's Adams keep step and exp_avg_sq per parameter as torch's do: auto ranks by them, with
    the bias correction where the group asks for it (the region formula in float64)."""
    if not _cpu_adam_builds():
        pytest.skip("DeepSpeed's CPU Adam op cannot be built here")
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    net = _net()
    params = list(net.parameters())
    opt = DeepSpeedCPUAdam(params, lr=1e-3, bias_correction=bias_correction)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p) * torch.rand_like(p)
        opt.step()
    lay = plan_layout(params, 1000, True)
    score = UpdateScore(opt, params, lay)
    v = torch.randn(lay.region[1] - lay.region[0])
    out = score(v, torch.empty_like(v), 0, v.numel())
    n = params[0].numel()
    sq = opt.state[params[0]]["exp_avg_sq"].reshape(-1)
    ref = _score64(v[:n], sq, 3) if bias_correction else v[:n].double() / sq.double().clamp(
        min=FLOOR * float(sq.double().mean())).sqrt()
    torch.testing.assert_close(out[:n].double(), ref, rtol=1e-6, atol=0.0)
    cfg = {"method": "topk", "density": 0.1, "min_numel": 1000}
    with caplog.at_level(logging.INFO, logger="ds_xc.compression.score"):
        assert CompressedOptimizer(DeepSpeedCPUAdam(net.parameters()), cfg)._update_score is not None
    assert "select_by auto -> magnitude" not in caplog.text


def _ranked_run(rank, world, select_by, steps=4, kind="adamw"):
    """Per compressed step: this rank's v = e + u, its residual after, and the Adam state it ranked by."""
    net = _net()
    params = list(net.parameters())
    opt = CompressedOptimizer(_adam(kind, params, lr=0.01),
                              {"method": "topk", "density": 0.05, "min_numel": 1000, "allocation": "numel",
                               "select_by": select_by})
    res, lay = opt._buffers["residual"], opt.layout
    out = []
    for step in range(steps):
        opt.zero_grad()
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(6 + 3 * rank, IN, generator=g)  # uneven batches
        y = torch.randint(0, OUT, (6 + 3 * rank,), generator=g)
        torch.nn.functional.cross_entropy(net(x), y).backward()
        flat = torch.cat([params[i].grad.reshape(-1) for i in lay.sparse])
        adam = [opt.inner.state.get(params[i]) for i in lay.sparse]
        state = [(st["exp_avg_sq"].reshape(-1).clone(), float(st["step"])) if st else None for st in adam]
        u = opt._buffers["momentum"][: flat.numel()]  # the default velocity: u = beta1 u + g (beta1 0.9)
        v = res[: flat.numel()] + (u * 0.9 + flat)
        opt.step()
        out.append({"v": v, "e": res[: flat.numel()].clone(), "state": state})
    return {"steps": out, "numels": [params[i].numel() for i in lay.sparse],
            "params": [p.detach().clone() for p in params]}


@pytest.mark.parametrize("world,kind", [(2, "adamw"), (3, "adamw"), (2, "cpu_adam")])
def test_each_rank_sends_the_top_k_of_its_update_score(pools, world, kind):
    if kind == "cpu_adam" and not _cpu_adam_builds():
        pytest.skip("DeepSpeed's CPU Adam op cannot be built here")
    results = pools(world).run(_ranked_run, "update", 4, kind)
    differs = 0
    for r in results:
        for step in r["steps"]:
            start = 0
            for n, state in zip(r["numels"], step["state"]):
                v, e = step["v"][start: start + n], step["e"][start: start + n]
                sent = (e == 0) & (v != 0)
                k = round(0.05 * n)
                score = _score64(v, *state) if state is not None else v.double()
                want = torch.zeros(n, dtype=torch.bool)
                want[torch.topk(score.abs(), k).indices] = True
                assert torch.equal(sent, want)
                by_size = torch.zeros(n, dtype=torch.bool)
                by_size[torch.topk(v.abs(), k).indices] = True
                differs += int((by_size != want).sum())
                start += n
    assert differs > 0  # ranking by size would have sent other elements: the check can fail
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], r["params"]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="DeepSpeed's FusedAdam needs CUDA")
def test_fused_adam_is_ranked_by_its_state_on_a_gpu():
    """DeepSpeed's default Adam on GPUs: auto ranks by its state, and the run equals the same run with
    torch's AdamW, which ranks by the same formula (one rank, CUDA)."""
    from deepspeed.ops.adam import FusedAdam
    runs = {}
    for name in ("torch", "fused"):
        net = _net().cuda()
        inner = (torch.optim.AdamW if name == "torch" else FusedAdam)(net.parameters(), lr=0.01)
        opt = CompressedOptimizer(inner, {"method": "topk", "density": 0.05, "min_numel": 1000})
        assert opt._update_score is not None
        for step in range(5):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, IN, generator=g).cuda(), torch.randint(0, OUT, (8,), generator=g).cuda()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
        runs[name] = [p.detach().cpu() for p in net.parameters()]
    for a, b in zip(runs["torch"], runs["fused"]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)

"""Single-process checks of the fused sharded loss against dense float64 references."""
import math

import pytest
import torch

from ds_xc import ClassParallelHead
from ds_xc.head.margins import build_loss
from tests.reference import LOSSES, reference, target_logit


def _data(n=24, d=7, c=19, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64), torch.randint(0, c, (n,), generator=g)


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("chunk", [0, 1, 5, 24, 100])
def test_loss_and_gradients_match_dense_reference(name, chunk):
    x, y = _data()
    head = ClassParallelHead(7, 19, loss=LOSSES[name], chunk_size=chunk, dtype=torch.float64, init_std=0.5)
    x = x.requires_grad_()
    loss = head(x, y)
    loss.backward()
    ref_loss, ref_gx, ref_gw = reference(x, head.weight, y, LOSSES[name])
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-12, abs=1e-12)
    torch.testing.assert_close(x.grad, ref_gx, rtol=1e-8, atol=1e-9)
    torch.testing.assert_close(head.weight.grad, ref_gw, rtol=1e-8, atol=1e-9)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_chunked_equals_unchunked_float32(name):
    x, y = _data(n=64, d=16, c=50, seed=3)
    x = x.float()
    out = []
    for chunk in (0, 7):
        head = ClassParallelHead(16, 50, loss=LOSSES[name], chunk_size=chunk, init_std=0.3)
        xx = x.clone().requires_grad_()
        loss = head(xx, y)
        loss.backward()
        out.append((loss.detach(), xx.grad, head.weight.grad))
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["cosface", "arcface", "combined"])
def test_target_logit_derivative_is_exact(name):
    cfg = LOSSES[name]
    c = torch.linspace(-0.999, 0.999, 301, dtype=torch.float64)
    z, dz = build_loss(cfg).target_logit(c)
    cc = c.clone().requires_grad_()
    ref = target_logit(name, cfg, cc)
    ref.sum().backward()
    torch.testing.assert_close(z, ref.detach(), rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(dz, cc.grad, rtol=1e-9, atol=1e-8)


def test_arcface_fallback_branch_is_used_beyond_pi():
    cfg = LOSSES["arcface"]
    m = cfg["margin"]
    c = torch.tensor([-math.cos(m) - 0.05, -math.cos(m) + 0.05], dtype=torch.float64)
    z, dz = build_loss(cfg).target_logit(c)
    assert z[0].item() == pytest.approx(cfg["scale"] * (c[0].item() - m * math.sin(m)))
    assert dz[0].item() == pytest.approx(cfg["scale"])
    assert z[1].item() == pytest.approx(cfg["scale"] * math.cos(math.acos(c[1].item()) + m))


def test_no_grad_forward_computes_loss_only():
    x, y = _data()
    head = ClassParallelHead(7, 19, loss=LOSSES["arcface"], dtype=torch.float64, init_std=0.5)
    with torch.no_grad():
        loss = head(x, y)
    ref_loss, _, _ = reference(x, head.weight, y, LOSSES["arcface"])
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-12)


def test_backward_twice_raises_clearly():
    x, y = _data()
    head = ClassParallelHead(7, 19, dtype=torch.float64)
    loss = head(x.requires_grad_(), y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()


def test_grad_output_scales_gradients():
    x, y = _data()
    head = ClassParallelHead(7, 19, dtype=torch.float64, init_std=0.5)
    xx = x.clone().requires_grad_()
    (head(xx, y) * 3.0).backward()
    _, gx, gw = reference(x, head.weight, y, LOSSES["softmax"])
    torch.testing.assert_close(xx.grad, 3.0 * gx)
    torch.testing.assert_close(head.weight.grad, 3.0 * gw)


def test_bfloat16_embeddings_are_accepted():
    x, y = _data(n=16, d=8, c=10)
    head = ClassParallelHead(8, 10, loss=LOSSES["cosface"], init_std=0.5)
    xb = x.to(torch.bfloat16).requires_grad_()
    loss = head(xb, y)
    loss.backward()
    assert xb.grad.dtype == torch.bfloat16
    ref_loss, _, _ = reference(xb.double(), head.weight, y, LOSSES["cosface"])
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-4)

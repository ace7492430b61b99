"""Tests of the small backbones (ds_xc.models): outputs against float64 re-implementations,
gradients against finite differences, that they learn, and argument checks."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from ds_xc.data import SyntheticDataset
from ds_xc.models import DenseBackbone, TokenBackbone, build_backbone


def _tokens_dataset(vocab: int = 50, context: int = 3):
    """A stand-in with the attributes build_backbone reads (no corpus needed)."""
    return types.SimpleNamespace(input_kind="tokens", input_dim=vocab, context=context)


def _mlp64(x, mlp):
    """The MLP written out in float64: Linear, exact (erf) GELU, LayerNorm by its formula."""
    def lin(h, m):
        return h @ m.weight.double().t() + m.bias.double()

    def gelu(h):
        return 0.5 * h * (1.0 + torch.erf(h / 2 ** 0.5))

    def norm(h, m):
        mu = h.mean(dim=1, keepdim=True)
        var = ((h - mu) ** 2).mean(dim=1, keepdim=True)  # biased, as LayerNorm
        return (h - mu) / torch.sqrt(var + m.eps) * m.weight.double() + m.bias.double()

    l1, _, n1, l2, _, n2, l3 = mlp
    return lin(norm(gelu(lin(norm(gelu(lin(x.double(), l1)), n1), l2)), n2), l3)


def test_dense_backbone_matches_a_float64_reimplementation():
    ds = SyntheticDataset(100, input_dim=16)
    torch.manual_seed(0)
    model = build_backbone(ds, embedding_dim=12, hidden_dim=32)
    assert isinstance(model, DenseBackbone)
    x, _ = ds.train_batch(0, 8)
    emb = model(x)
    assert emb.shape == (8, 12) and emb.dtype == torch.float32
    torch.testing.assert_close(emb.double(), _mlp64(x, model.mlp), rtol=1e-5, atol=1e-5)
    # gradients: torch's fused GELU/LayerNorm backward against autograd through the plain float64 ops
    params = list(model.parameters())
    got = torch.autograd.grad(emb.square().sum(), params)
    want = torch.autograd.grad(_mlp64(x, model.mlp).square().sum(), params)
    for name, g, r in zip([n for n, _ in model.named_parameters()], got, want):
        torch.testing.assert_close(g.double(), r.double(), rtol=1e-4, atol=1e-5, msg=name)


def test_default_backbones_are_small():
    dense = build_backbone(SyntheticDataset(10), embedding_dim=128)
    assert sum(p.numel() for p in dense.parameters()) < 200_000
    tokens = build_backbone(_tokens_dataset(1001, 4), embedding_dim=128)
    assert sum(p.numel() for p in tokens.parameters()) < 1_000_000


def test_token_backbone_matches_a_float64_reimplementation():
    torch.manual_seed(0)
    model = build_backbone(_tokens_dataset(50, 3), embedding_dim=10, hidden_dim=16)
    assert isinstance(model, TokenBackbone)
    tokens = torch.tensor([[1, 2, 49], [49, 2, 1]])  # 49 = largest id (the pad id)
    emb = model(tokens)
    assert emb.shape == (2, 10) and emb.dtype == torch.float32
    table = model.embed.weight.double()  # (vocab, hidden)
    concat = torch.cat([table[tokens[:, j]] for j in range(3)], dim=1)  # (2, 3*hidden), context order
    torch.testing.assert_close(emb.double(), _mlp64(concat, model.mlp), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(emb[0], emb[1])  # order of the context matters
    with pytest.raises(ValueError, match=r"expected \(B, 3\)"):
        model(torch.zeros(2, 4, dtype=torch.int64))


def test_image_backbone_matches_a_functional_reimplementation():
    """Train mode: conv/BN/ReLU/pool blocks written with torch.nn.functional in float64, and the
    BN-FC-BN invariant (each output feature has batch mean 0, biased variance 1 at init)."""
    torch.manual_seed(0)
    fake = types.SimpleNamespace(input_kind="image", input_shape=(1, 16, 16))
    model = build_backbone(fake, embedding_dim=6, hidden_dim=128)  # w = 8
    x = torch.randn(5, 1, 16, 16)
    emb = model(x)
    assert emb.shape == (5, 6)

    def bn(h, m):  # training-mode batch norm over all dims but the channel one
        dims = [0] + list(range(2, h.dim()))
        mu = h.mean(dim=dims, keepdim=True)
        var = ((h - mu) ** 2).mean(dim=dims, keepdim=True)
        shape = [1, -1] + [1] * (h.dim() - 2)
        return (h - mu) / torch.sqrt(var + m.eps) * m.weight.double().view(shape) + m.bias.double().view(shape)

    h = x.double()
    for block in model.features[:3]:
        c1, b1, _, c2, b2, _, _ = block
        h = torch.relu(bn(F.conv2d(h, c1.weight.double(), padding=1), b1))
        h = torch.relu(bn(F.conv2d(h, c2.weight.double(), padding=1), b2))
        h = F.max_pool2d(h, 2)  # (5, c, H/2, W/2)
    h = bn(h, model.features[3])  # (5, 32, 2, 2)
    ref = bn(h.flatten(1) @ model.fc.weight.double().t() + model.fc.bias.double(), model.bn)  # (5, 6)
    torch.testing.assert_close(emb.double(), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(emb.double().mean(0), torch.zeros(6, dtype=torch.float64), atol=1e-5, rtol=0)
    torch.testing.assert_close(emb.double().var(0, unbiased=False), torch.ones(6, dtype=torch.float64),
                               atol=1e-3, rtol=0)


def test_dense_backbone_learns_synthetic_task():
    """Thirty steps on 50 classes cut the loss well below its start."""
    torch.manual_seed(0)
    ds = SyntheticDataset(50, input_dim=16, latent_dim=8, noise=0.3)
    model = torch.nn.Sequential(build_backbone(ds, 32, hidden_dim=64), torch.nn.Linear(32, 50))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for step in range(30):
        x, y = ds.train_batch(step, 128)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5


@pytest.mark.parametrize("kwargs, match", [
    ({"embedding_dim": 0}, "embedding_dim=0"),
    ({"embedding_dim": 8, "hidden_dim": 0}, "hidden_dim=0"),
])
def test_bad_dims(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_backbone(SyntheticDataset(10), **kwargs)


def test_unknown_input_kind():
    fake = types.SimpleNamespace(input_kind="audio", input_dim=3, context=0)
    with pytest.raises(ValueError, match=r"input_kind='audio'.*dense.*image.*tokens"):
        build_backbone(fake, 8)

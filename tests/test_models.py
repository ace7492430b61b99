"""Tests of the small backbones (ds_xc.models): shapes, dtypes, gradients, that they
learn, and argument checks."""

from __future__ import annotations

import types

import pytest
import torch

from ds_xc.data import SyntheticDataset
from ds_xc.models import DenseBackbone, TokenBackbone, build_backbone


def _tokens_dataset(vocab: int = 50, context: int = 3):
    """A stand-in with the attributes build_backbone reads (no corpus needed)."""
    return types.SimpleNamespace(input_kind="tokens", input_dim=vocab, context=context)


def test_dense_backbone_shapes_and_grads():
    ds = SyntheticDataset(100, input_dim=16)
    model = build_backbone(ds, embedding_dim=12, hidden_dim=32)
    assert isinstance(model, DenseBackbone)
    x, _ = ds.train_batch(0, 8)
    emb = model(x)
    assert emb.shape == (8, 12) and emb.dtype == torch.float32
    emb.square().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_default_backbones_are_small():
    dense = build_backbone(SyntheticDataset(10), embedding_dim=128)
    assert sum(p.numel() for p in dense.parameters()) < 200_000
    tokens = build_backbone(_tokens_dataset(1001, 4), embedding_dim=128)
    assert sum(p.numel() for p in tokens.parameters()) < 1_000_000


def test_token_backbone_shapes_and_position_awareness():
    torch.manual_seed(0)
    model = build_backbone(_tokens_dataset(50, 3), embedding_dim=10, hidden_dim=16)
    assert isinstance(model, TokenBackbone)
    tokens = torch.tensor([[1, 2, 49], [49, 2, 1]])  # 49 = largest id (the pad id)
    emb = model(tokens)
    assert emb.shape == (2, 10) and emb.dtype == torch.float32
    assert not torch.allclose(emb[0], emb[1])  # order of the context matters
    with pytest.raises(ValueError, match=r"expected \(B, 3\)"):
        model(torch.zeros(2, 4, dtype=torch.int64))


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

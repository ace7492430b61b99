"""Single-process behaviour of ClassParallelHead: init, input checks, state round trip."""
import pytest
import torch

from ds_xc import ClassParallelHead
from ds_xc.head import init_shard, owner_of, shard_range, shard_sizes


def test_shard_split_is_partial_fc_rule():
    assert shard_sizes(17, 3) == [6, 6, 5]
    assert [shard_range(17, 3, r) for r in range(3)] == [(0, 6), (6, 6), (12, 5)]
    for c in range(17):
        start, n = shard_range(17, 3, owner_of(c, 17, 3))
        assert start <= c < start + n
    with pytest.raises(ValueError, match="num_classes=2 must be >= the number of ranks"):
        shard_sizes(2, 3)


def test_init_is_independent_of_world_size():
    full = init_shard(200_000, 4, 0, 200_000, 0.02, seed=3)
    parts = [init_shard(200_000, 4, *shard_range(200_000, 3, r), 0.02, seed=3) for r in range(3)]
    assert torch.equal(torch.cat(parts), full)
    assert full.std().item() == pytest.approx(0.02, rel=0.01)
    assert not torch.equal(init_shard(100, 4, 0, 100, 0.02, seed=4), full[:100])


def _head(**kw):
    return ClassParallelHead(8, 50, dtype=torch.float64, **kw)


def test_bad_label_is_named_and_nothing_changes():
    head = _head()
    w = head.weight.detach().clone()
    with pytest.raises(ValueError, match=r"label 50 at position 3 on rank 0 is outside \[0, 50\)"):
        head(torch.randn(5, 8, dtype=torch.float64), torch.tensor([0, 1, 2, 50, 4]))
    with pytest.raises(ValueError, match="label -1 at position 0"):
        head(torch.randn(2, 8, dtype=torch.float64), torch.tensor([-1, 4]))
    assert torch.equal(head.weight.detach(), w) and head.weight.grad is None


def test_non_finite_embeddings_are_named():
    x = torch.randn(4, 8, dtype=torch.float64)
    x[2, 5] = float("nan")
    with pytest.raises(FloatingPointError, match="embeddings row 2 on rank 0 contains NaN or Inf"):
        _head()(x, torch.tensor([0, 1, 2, 3]))


def test_shape_and_dtype_errors():
    head = _head()
    with pytest.raises(ValueError, match=r"embeddings must have shape \(batch, 8\), got \(4, 7\)"):
        head(torch.randn(4, 7), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"labels must have shape \(4,\)"):
        head(torch.randn(4, 8), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="labels must be an integer tensor"):
        head(torch.randn(4, 8), torch.zeros(4))
    with pytest.raises(TypeError, match="embeddings must be floating point"):
        head(torch.zeros(4, 8, dtype=torch.int64), torch.zeros(4, dtype=torch.int64))


def test_same_seed_same_losses():
    losses = []
    for _ in range(2):
        head = _head(sampler={"type": "uniform", "sample_rate": 0.2}, seed=7)
        g = torch.Generator().manual_seed(0)
        losses.append([head(torch.randn(6, 8, generator=g, dtype=torch.float64),
                            torch.randint(0, 50, (6,), generator=g)).item() for _ in range(3)])
    assert losses[0] == losses[1]


def test_state_dict_round_trip_and_mismatch_message():
    a = _head(sampler={"type": "uniform", "sample_rate": 0.2}, seed=1)
    b = _head(sampler={"type": "uniform", "sample_rate": 0.2}, seed=2)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.weight, b.weight)
    y = torch.tensor([3])
    assert torch.equal(a.sampler.sample(y, None, None).index, b.sampler.sample(y, None, None).index)
    other = ClassParallelHead(8, 60, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"checkpoint holds classes \[0, 50\) of 50 .* expects \[0, 60\) of 60"):
        other.load_state_dict(a.state_dict())


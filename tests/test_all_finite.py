"""ds_xc.engine.core.all_finite (the per-step NaN/Inf check of the gradients) against isfinite().all()."""
import pytest
import torch

from ds_xc.engine.core import all_finite


def _reference(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [1, 7, 64, 4097, 300_001])
def test_matches_isfinite_at_every_kind_of_position(dtype, numel):
    g = torch.Generator().manual_seed(numel)
    for bad in (float("nan"), float("inf"), -float("inf"), None):
        for where in sorted({0, numel // 2, numel - 1}):
            t = torch.randn(numel, generator=g).to(dtype)
            if bad is not None:
                t[where] = bad
            others = [torch.randn(3, 5, generator=g).to(dtype), torch.empty(0, dtype=dtype)]
            for tensors in ([t], others + [t], [t] + others):
                assert all_finite(tensors) == _reference(tensors) == (bad is None)


def test_shapes_views_empty_and_integers():
    t = torch.randn(64, 33)
    t[5, 7] = float("nan")
    assert not all_finite([t.t()])  # non-contiguous
    assert all_finite([t[:5]]) and not all_finite([t[5:6]])
    assert all_finite([]) and all_finite([torch.empty(0, 4)])
    assert all_finite([torch.arange(10)])  # integer tensors hold no NaN/Inf
    big = torch.full((3,), 3.0e38)  # finite extremes, an overflowing sum: still finite
    assert all_finite([big, -big])
    huge = torch.full((2,), 1e300, dtype=torch.float64)  # finite in float64, inf in float32: still finite
    assert all_finite([huge, -huge, big]) and not all_finite([huge, torch.tensor([float("inf")])])
    z = torch.randn(9, dtype=torch.complex64)
    assert all_finite([z])
    z[4] = complex(0.0, float("inf"))
    assert not all_finite([z])
    assert all_finite(iter([torch.ones(2)]))  # any iterable, as a generator of .grad tensors

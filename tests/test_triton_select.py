"""ds_xc_ops.triton_select: the Triton threshold selection against its PyTorch reference.

Without a GPU the kernels run under Triton's CPU interpreter (TRITON_INTERPRET is set
before the kernel module is imported). Exact equality of indices and values for float32,
float16 and bfloat16 (stored bf16, compared in fp32), thresholds keeping nothing, some
or everything, sizes not a multiple of the block, NaN entries; and the BayesPrior
compressor's selection through it.
"""
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from ds_xc_ops.triton_select import select_above, select_above_torch  # noqa: E402
from ds_xc_ops.triton_util import interpreting  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() and not interpreting() else "cpu")


def values(n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 2)  # a wide range of |v|
    v[::7] = 0.0
    return v.to(dtype).to(DEV)


def assert_same(got, want, dtype):
    assert got[0].dtype == torch.int64 and got[1].dtype == dtype
    assert torch.equal(got[0].cpu(), want[0].cpu())
    assert torch.equal(got[1].cpu().float(), want[1].cpu().float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,block", [(1000, 128), (1, 16), (4096, 1024), (777, 1024)])
def test_matches_reference(dtype, n, block):
    v = values(n, dtype, seed=n)
    a = v.float().abs()
    for t in (math.inf, float(a.max()) * 2, float(a.median()), float(a.max()), 0.0, -1.0):
        want = select_above_torch(v, t)
        assert_same(select_above(v, t, backend="triton", block=block), want, dtype)
        expect = torch.nonzero(a >= t).squeeze(1)  # the semantics, independently of the reference
        assert torch.equal(want[0].cpu(), expect.cpu())


def test_counts_nothing_some_everything():
    v = torch.tensor([0.5, -2.0, 0.0, 3.0, -0.25, float("nan"), 2.0], device=DEV)
    idx, val = select_above(v, 2.0, backend="triton", block=16)
    assert idx.tolist() == [1, 3, 6] and val.tolist() == [-2.0, 3.0, 2.0]
    assert select_above(v, 0.0, backend="triton", block=16)[0].tolist() == [0, 1, 2, 3, 4, 6]  # not NaN
    assert select_above(v, 3.5, backend="triton", block=16)[0].numel() == 0
    assert select_above(v, float("nan"), backend="triton", block=16)[0].numel() == 0
    assert select_above(v[:0], 1.0, backend="triton")[0].numel() == 0


def test_threshold_rounds_to_float32_and_bf16_compares_values():
    """A threshold just above fp32(0.1) rounds down to it; bf16 entries are compared as numbers."""
    v = torch.tensor([0.1, 0.2, -0.1], dtype=torch.float32, device=DEV)
    t = 0.1000000016  # > float64(fp32(0.1)), rounds to fp32(0.1)
    assert select_above(v, t, backend="triton", block=16)[0].tolist() == [0, 1, 2]
    b = torch.tensor([1.5, -3.0, 0.75, 2.0], dtype=torch.bfloat16, device=DEV)
    idx, val = select_above(b, 1.75, backend="triton", block=16)
    assert idx.tolist() == [1, 3] and val.dtype == torch.bfloat16 and val.float().tolist() == [-3.0, 2.0]


def test_shapes_and_errors():
    v = values(60, torch.float32).view(6, 10)
    assert_same(select_above(v, 0.5, backend="triton", block=32), select_above_torch(v.flatten(), 0.5), v.dtype)
    with pytest.raises(ValueError, match="backend"):
        select_above(v, 0.5, backend="cuda")
    with pytest.raises(ValueError, match="power of two"):
        select_above(v, 0.5, backend="triton", block=100)
    with pytest.raises(ValueError, match="dtype torch.float64"):
        select_above(v.double(), 0.5, backend="triton")
    with pytest.raises(ValueError, match="floating"):
        select_above(torch.arange(4), 1.0)
    d = v.double().flatten()
    assert torch.equal(select_above(d, 0.5)[0], torch.nonzero(d.abs() >= 0.5).squeeze(1))  # auto -> torch


def test_auto_keeps_cpu_tensors_on_torch(monkeypatch):
    """auto never takes CPU tensors to Triton (CPU behaviour unchanged), even when interpreting."""
    import ds_xc_ops.triton_select as S
    monkeypatch.setattr(S, "_select_triton", lambda *a: pytest.fail("triton used for a CPU tensor"))
    v = values(100, torch.float32).cpu()
    assert_same(select_above(v, 0.3), select_above_torch(v, 0.3), v.dtype)


@pytest.mark.parametrize("power", [1.0, 3.0])
def test_bayes_sampling_through_the_kernel_is_identical(power):
    """bayes.sample_indices with the Triton threshold pass keeps exactly the same elements."""
    import functools

    from ds_xc.compression import bayes
    v = values(3000, torch.float32, seed=11)
    tau = float(v.abs().quantile(0.95))
    kernel = functools.partial(select_above, backend="triton", block=256)
    got = bayes.sample_indices(v, tau, 0.25, None, 0.0, torch.Generator(DEV).manual_seed(5), power, select=kernel)
    want = bayes.sample_indices(v, tau, 0.25, None, 0.0, torch.Generator(DEV).manual_seed(5), power)
    assert got.numel() > 0 and torch.equal(got, want)


def test_bayes_prior_selects_the_same_through_every_backend(monkeypatch):
    """bayes_prior's threshold pass: "auto" (the C++ kernel for a float32 CPU tensor where it builds, Triton
    on CUDA) keeps the same elements as the PyTorch pass."""
    from ds_xc.compression import compressors
    from ds_xc.compression.config import GradientCompressionConfig
    comp = compressors.build_compressor(GradientCompressionConfig(method="bayes_prior", density=0.05))
    v = values(2000, torch.float32, seed=2).cpu()
    counts = comp.local_histogram(v, bayes_top(v), None)
    tstate = {}
    comp.update(tstate, counts, bayes_top(v))
    got = comp.select(v, tstate, torch.Generator().manual_seed(1), None)
    monkeypatch.setattr(compressors.BayesPrior, "select_backend", "torch")
    want = comp.select(v, tstate, torch.Generator().manual_seed(1), None)
    assert want.numel() > 0 and torch.equal(got, want)
    monkeypatch.undo()
    if torch.cuda.is_available():  # the CUDA path: same elements as the torch pass
        vc, g = v.cuda(), torch.Generator("cuda")
        got = comp.select(vc, tstate, g.manual_seed(1), None)
        monkeypatch.setattr(compressors.BayesPrior, "select_backend", "torch")
        assert torch.equal(got, comp.select(vc, tstate, g.manual_seed(1), None))


def bayes_top(v):
    from ds_xc.compression import bayes
    return bayes.log2_ceil_max(v.abs())

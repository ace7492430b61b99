"""The C++ threshold selection (ds_xc_ops.triton_select.select_above, backend "cpu"; ops/csrc/select_cpu.cpp)
against the PyTorch reference, on its vector (AVX-512) and scalar paths, at sizes around its 16-entry vectors
and 32768-entry blocks, with NaN, infinities, signed zeros and the edge thresholds; and bayes_prior's selection,
which "auto" routes through it on the CPU, unchanged by it."""
import math

import pytest
import torch

from ds_xc.compression import bayes
from ds_xc_ops import triton_select as T
from tests.native_ops import built_op, call_in_process


@pytest.fixture(scope="module")
def op():
    return built_op("select")


def _vector(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(4) * 3  # heavy-tailed magnitudes
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0, -1.0])
    if n:
        pos = torch.randint(0, n, (min(n, 40),), generator=g)
        v[pos] = special[torch.arange(pos.numel()) % special.numel()]
    return v


def _same(got, want):
    assert got[0].dtype == torch.int64 and got[1].dtype == torch.float32
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1].view(torch.int32), want[1].view(torch.int32))  # bit for bit, signs of zeros too


THRESHOLDS = [0.5, 1.0, 2.9999, 1e-30, 0.0, -1.0, math.inf, math.nan, 0.1 + 1e-12]


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 1000, 32767, 32768, 32769, 100_003])
def test_cpu_backend_equals_torch_reference(op, n):
    v = _vector(n, n)
    for t in THRESHOLDS:
        _same(T.select_above(v, t, backend="cpu"), T.select_above_torch(v, t))


def test_edge_semantics(op):
    v = torch.tensor([1.0, -2.0, float("nan"), 0.0, -0.0, 3.0, float("inf")])
    assert T.select_above(v, 2.0, backend="cpu")[0].tolist() == [1, 5, 6]
    assert T.select_above(v, 2.0, backend="cpu")[1].tolist() == [-2.0, 3.0, float("inf")]  # the signed values
    assert T.select_above(v, 0.0, backend="cpu")[0].tolist() == [0, 1, 3, 4, 5, 6]  # every non-NaN entry
    assert T.select_above(v, float("nan"), backend="cpu")[0].numel() == 0
    assert T.select_above(v.reshape(7, 1), 2.0, backend="cpu")[0].tolist() == [1, 5, 6]  # flattened
    assert T.select_above(v[::2], 2.0, backend="cpu")[0].tolist() == [3]  # a strided view: [1, nan, 0, inf]


def test_auto_picks_the_kernel_on_cpu_float32_only(op, monkeypatch):
    v = _vector(1000, 3)
    assert T._resolve("auto", v) == "cpu"
    assert T._resolve("auto", v.double()) == "torch"
    monkeypatch.setenv(T.NATIVE_ENV, "0")
    assert T._resolve("auto", v) == "torch"
    with pytest.raises(ValueError, match="backend='cpu' cannot run here: a float32 CPU tensor is needed"):
        T.select_above(v.double(), 1.0, backend="cpu")
    with pytest.raises(ValueError, match="backend = 'gpu' is not one of"):
        T.select_above(v, 1.0, backend="gpu")


def test_scalar_path_equals_the_vector_path(op, tmp_path):
    v = _vector(100_003, 7)
    vec = [op.select_above(v, t) for t in (0.5, 0.0)]
    scalar = call_in_process("select", {"DS_XC_SELECT_SIMD": "0"},
                             "(op.simd_enabled(), [op.select_above(a, t) for t in (0.5, 0.0)])", v, tmp_path)
    assert scalar[0] is False
    for got, want in zip(scalar[1], vec):
        _same(got, want)


@pytest.mark.parametrize("power", [1.0, 8.0])
def test_bayes_selection_unchanged_by_the_kernel(op, power):
    """sample_indices with the kernel (what the compressors pass) == with the PyTorch pass, same draws."""
    v = _vector(200_000, 11)
    v[torch.isnan(v) | torch.isinf(v)] = 0.0
    log2_hi = math.ceil(math.log2(float(v.abs().max())))
    counts = bayes.local_histogram(v, log2_hi, 128, 0, None)  # (128,) every element
    tau = bayes.solve_threshold(counts, log2_hi, 0.01 * v.numel(), power)
    rate = bayes.thinning_rate(counts, log2_hi, tau, power)
    explore = torch.tensor([0.001])
    picks = []
    for select in (None, lambda x, t: T.select_above(x, t, backend="cpu")):
        gen = torch.Generator().manual_seed(5)
        picks.append(bayes.sample_indices(v, tau, rate, explore, log2_hi, gen, power, select=select))
    assert torch.equal(picks[0], picks[1])
    assert 0.5 * 0.01 * v.numel() < picks[0].numel() < 2.0 * 0.01 * v.numel()

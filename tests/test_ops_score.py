"""The fused update score (ds_xc_ops.score.update_score, backend "cpu"; ops/csrc/select_cpu.cpp): bit for
bit the IEEE float32 result of its three correctly rounded steps (computed in float64 and rounded once per
step, which is exact for *, sqrt and /), on its vector (AVX-512) and scalar paths, at sizes around its
16-entry vectors and 32768-entry blocks, with zeros, NaN and infinities in v and in the second moment;
within 1 ulp of the PyTorch expression it replaces (whose float32 sqrt is not always correctly rounded);
the floor in both forms (a float, a 0-dim tensor); and the routing of "auto"."""
import pytest
import torch

from ds_xc_ops import score as S
from tests.native_ops import built_op, call_in_process


@pytest.fixture(scope="module")
def op():
    return built_op("select")


def _inputs(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, generator=g) * 1e-3
    m = torch.rand(n, generator=g).pow(6) * 1e-6  # second moments spanning many octaves, some under the floor
    special = torch.tensor([float("nan"), float("inf"), 0.0, -0.0, 1e-45])
    if n:
        for t in (v, m):
            pos = torch.randint(0, n, (min(n, 30),), generator=g)
            t[pos] = special[torch.arange(pos.numel()) % special.numel()]
    return v, m


def _same(got: torch.Tensor, want: torch.Tensor):
    """Equal bits wherever the reference is a number (NaN payloads may differ), NaN where it is NaN."""
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))


def _ieee32(v, m, scale, floor):
    """v / sqrt(max(m scale, floor)) as IEEE float32 evaluates it: each step in float64, rounded to float32."""
    h = (m.double() * float(torch.tensor(scale, dtype=torch.float32))).float()
    h = torch.where(h < float(floor), torch.tensor(float(floor)), h)  # a NaN h stays NaN
    s = torch.sqrt(h.double()).float()
    return (v.double() / s.double()).float()


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 1000, 32767, 32768, 32769, 100_003])
@pytest.mark.parametrize("scale", [1.0, 1.0 / (1.0 - 0.999 ** 37)])
def test_cpu_backend_is_the_ieee_float32_formula(op, n, scale):
    v, m = _inputs(n, n)
    floor = torch.tensor(2e-10, dtype=torch.float32).mul_(scale)
    got = S.update_score(v, m, scale, floor, torch.full((n,), 7.0), backend="cpu")
    _same(got, _ieee32(v, m, scale, floor))
    want = S.update_score_torch(v, m, scale, floor, torch.empty(n))
    torch.testing.assert_close(got, want, rtol=2.4e-7, atol=0, equal_nan=True)  # the torch expression: 1 ulp


def test_floor_as_float_or_tensor_and_under_the_floor(op):
    v = torch.tensor([1.0, -2.0, 3.0, 0.0])
    m = torch.tensor([4.0, 0.0, 1e-12, 9.0])
    for floor in (1e-2, torch.tensor(1e-2)):
        got = S.update_score(v, m, 1.0, floor, torch.empty(4), backend="cpu")
        torch.testing.assert_close(got, torch.tensor([0.5, -20.0, 30.0, 0.0]), rtol=1e-6, atol=0)


def test_scalar_path_equals_the_vector_path(op, tmp_path):
    v, m = _inputs(100_003, 5)
    vec = torch.empty_like(v)
    op.update_score_(v, m, 3.0, 1e-9, vec)
    scalar = call_in_process("select", {"DS_XC_SELECT_SIMD": "0"},
                             "(op.simd_enabled(), a[2], op.update_score_(a[0], a[1], 3.0, 1e-9, a[2]))",
                             (v, m, torch.empty_like(v)), tmp_path)
    assert scalar[0] is False
    _same(scalar[1], vec)


def test_auto_routing_and_errors(op, monkeypatch):
    v, m = _inputs(1000, 3)
    _same(S.update_score(v, m, 2.0, 1e-9, torch.empty(1000)), _ieee32(v, m, 2.0, 1e-9))  # auto: the kernel
    monkeypatch.setenv(S.NATIVE_ENV, "0")
    _same(S.update_score(v, m, 2.0, 1e-9, torch.empty(1000)),
          S.update_score_torch(v, m, 2.0, 1e-9, torch.empty(1000)))  # auto: torch
    monkeypatch.delenv(S.NATIVE_ENV)
    # what the kernel cannot take goes to torch under auto, and is refused with a reason under "cpu"
    _same(S.update_score(v, m, 2.0, float("nan"), torch.empty(1000)),
          S.update_score_torch(v, m, 2.0, float("nan"), torch.empty(1000)))
    with pytest.raises(ValueError, match="backend='cpu' cannot run here: floor must be finite"):
        S.update_score(v, m, 2.0, float("nan"), torch.empty(1000), backend="cpu")
    with pytest.raises(ValueError, match="exp_avg_sq must be a contiguous 1-D float32 CPU tensor"):
        S.update_score(v, m.double(), 2.0, 1e-9, torch.empty(1000), backend="cpu")
    with pytest.raises(ValueError, match="sizes differ: v 1000, exp_avg_sq 999"):
        S.update_score(v, m[:999], 2.0, 1e-9, torch.empty(1000), backend="cpu")
    with pytest.raises(ValueError, match="backend = 'gpu' is not one of"):
        S.update_score(v, m, 2.0, 1e-9, torch.empty(1000), backend="gpu")

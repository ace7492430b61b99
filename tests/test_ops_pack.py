"""ds_xc_ops.hamming.pack_signs_min_abs: the CPU op's one-pass sign codes and smallest |projection|
against the torch definitions (pack_signs, abs().amin), on its vector and scalar paths."""
import pytest
import torch

from ds_xc_ops import hamming as H
from ds_xc.sampling.ann.codes import encode_with_margins, pack
from tests.native_ops import built_op, call_in_process


@pytest.fixture(scope="module")
def cpu_op():
    return built_op("cpu")


def _projections(rows: int, bits: int, seed: int = 0) -> torch.Tensor:
    z = torch.randn(rows, bits, generator=torch.Generator().manual_seed(seed))
    z[0, ::2] = 0.0  # zeros: bit 0, min 0
    if rows > 4:
        z[1, ::3] = -0.0
        z[2, bits // 2] = float("nan")  # NaN: bit 0, the row's min NaN
        z[3, 0], z[3, -1] = float("inf"), float("-inf")
        z[4] = 1e-30  # tiny positive: every bit 1, min 1e-30
    return z


def _check(codes, min_abs, z):
    assert codes.dtype == torch.uint8 and codes.shape == (z.shape[0], z.shape[1] // 8)
    assert torch.equal(codes, H.pack_signs(z))
    want = z.abs().amin(dim=1)
    assert torch.equal(min_abs.isnan(), want.isnan())
    assert torch.equal(min_abs[~want.isnan()], want[~want.isnan()])


@pytest.mark.parametrize("bits", [8, 24, 64, 256, 504, 512, 1024])
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_op_equals_torch(cpu_op, rows, bits):
    z = _projections(rows, bits, seed=bits + rows)
    codes, min_abs = cpu_op.pack_signs_min_abs(z)
    _check(codes, min_abs, z)
    assert torch.equal(pack(z), H.pack_signs(z))  # the encoder's pack takes the op for float32 on CPU


def test_fallbacks_and_errors(cpu_op):
    z = _projections(6, 64)
    _check(*H.pack_signs_min_abs(z.double()), z.double())  # not float32: torch ops
    _check(*H.pack_signs_min_abs(z.t().contiguous().t()), z)  # not contiguous: torch ops
    with pytest.raises(RuntimeError, match="multiple of 8"):
        cpu_op.pack_signs_min_abs(torch.randn(2, 12))
    codes, margins = encode_with_margins(torch.randn(9, 16), torch.randn(16, 64))
    assert codes.shape == (9, 8) and (margins >= 0).all()


def test_scalar_path_forced_equals_vector_path(cpu_op, tmp_path):
    """DS_XC_HAMMING_SIMD=0 (read once per process) selects the scalar loop; both give the same bytes."""
    z = _projections(257, 520, seed=3)
    (codes, min_abs), (codes16, min16) = call_in_process(
        "cpu", {"DS_XC_HAMMING_SIMD": "0"}, "(op.pack_signs_min_abs(a), op.pack_signs_min_abs(a.bfloat16()))", z,
        tmp_path)
    _check(codes, min_abs, z)
    vec = cpu_op.pack_signs_min_abs(z)
    assert torch.equal(vec[0], codes) and torch.equal(vec[1].nan_to_num(-1.0), min_abs.nan_to_num(-1.0))
    vec16 = cpu_op.pack_signs_min_abs(z.bfloat16())
    assert torch.equal(vec16[0], codes16) and torch.equal(vec16[1].nan_to_num(-1.0), min16.nan_to_num(-1.0))
    assert torch.equal(codes16, H.pack_signs(z.bfloat16()))


@pytest.mark.parametrize("bits", [8, 24, 256, 512, 520])
def test_op_takes_bfloat16(cpu_op, bits):
    """bf16 projections (the ANN codes' bf16 matmul output) are packed without a float32 copy: the same
    codes as pack_signs and the same min |z| (float32) as torch, NaN and +-inf included."""
    z = _projections(300, bits, seed=bits).bfloat16()
    codes, min_abs = cpu_op.pack_signs_min_abs(z)
    assert min_abs.dtype == torch.float32
    _check(codes, min_abs.bfloat16(), z)
    assert torch.equal(min_abs.isnan(), z.abs().amin(dim=1).isnan())
    assert torch.equal(pack(z), H.pack_signs(z))

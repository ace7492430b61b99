"""ds_xc_ops.softmax_rows.exp_rows_: the CPU op's row max, in-place exponentials and row sums against
float64 references and torch's passes, on its vector (AVX-512) and scalar paths; and the fused loss
with the op against the loss without it."""
import pytest
import torch

from ds_xc.head.margins import build_loss
from ds_xc.head.softmax import fused_loss_and_grads
from ds_xc_ops import softmax_rows as S
from tests.native_ops import built_op, call_in_process


@pytest.fixture(scope="module")
def op():
    return built_op("softmax")


def _ulps(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|got - ref| in units of the float32 spacing at ref (float64 ref, normal range)."""
    spacing = (torch.nextafter(ref.float(), torch.tensor(float("inf"))) - ref.float()).double()
    return (got.double() - ref).abs() / spacing


def test_exp_within_one_ulp_of_float64_over_the_whole_range(op):
    x = torch.cat([torch.linspace(-103.0, 88.0, 400_001), torch.randn(100_000) * 10]).reshape(1, -1)
    y = x.clone()
    m, s = op.exp_rows(y, float("-inf"))
    assert m.item() == x.max().item()
    ref = (x - m).double().exp()  # of the float32 difference, which the kernel exponentiates
    normal = ref > torch.finfo(torch.float32).tiny
    assert _ulps(y, ref)[normal].max() < 1.0
    assert (y[~normal] <= 2 * torch.finfo(torch.float32).tiny).all()  # underflow: 0 or a tiny subnormal
    assert abs(s.double().item() - ref.sum().item()) <= 1e-6 * ref.sum().item()


@pytest.mark.parametrize("k", [0, 1, 15, 16, 17, 31, 1024, 1039, 70_001])
@pytest.mark.parametrize("floor", [None, 0.0])
def test_rows_equal_torch_passes(op, k, floor):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(5, k, generator=g) * 12 - 3
    y = x.clone()
    m, s = S.exp_rows_(y, floor)
    want_m = x.amax(dim=1) if k else torch.full((5,), float("-inf"))
    if floor is not None:
        want_m = want_m.clamp_min(floor)
    assert torch.equal(m, want_m)
    e = (x - want_m[:, None]).double().exp()
    torch.testing.assert_close(y.double(), e, rtol=2.5e-7, atol=3e-45)  # subnormals: a step or two
    torch.testing.assert_close(s.double(), e.sum(dim=1), rtol=1e-6, atol=0.0)


def test_special_values(op):
    x = torch.randn(6, 40)
    x[0, 3] = float("nan")  # NaN: the whole row and its sum NaN, as amax / sub_ / exp_ give
    x[1, 5] = float("-inf")  # -inf entry: 0
    x[2] = float("-inf")  # all -inf: max -inf, entries NaN ((-inf) - (-inf))
    x[3, 7] = float("inf")  # +inf: max inf, the inf entry NaN, the others 0
    x[4] = 1e-30
    x[5, :] = -200.0  # far below: the max subtracted first, all ones
    y = x.clone()
    m, s = op.exp_rows(y, float("-inf"))
    ref = x.clone()
    rm = ref.amax(dim=1)
    ref.sub_(rm[:, None]).exp_()
    assert torch.equal(m.isnan(), rm.isnan()) and torch.equal(m[~rm.isnan()], rm[~rm.isnan()])
    assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(s.isnan(), ref.sum(dim=1).isnan())
    torch.testing.assert_close(y.nan_to_num(-1.0), ref.nan_to_num(-1.0), rtol=2.5e-7, atol=0.0)
    assert y[1, 5] == 0.0 and torch.equal(y[5], torch.ones(40))
    y = x[2:3].clone()
    m, s = op.exp_rows(y, 0.0)  # the floor: max 0, every entry exp(-inf) = 0, sum 0
    assert m.item() == 0.0 and s.item() == 0.0 and (y == 0).all()


def test_fallbacks(op, monkeypatch):
    x = torch.randn(3, 20)
    assert S.exp_rows_(x.double()) is None and S.exp_rows_(x.t()) is None and S.exp_rows_(x[0]) is None
    monkeypatch.setenv(S.ENV, "0")
    y = x.clone()
    assert S.exp_rows_(y) is None and torch.equal(y, x)  # nothing done
    with pytest.raises(RuntimeError, match="float32"):
        op.exp_rows(x.double(), 0.0)


def test_scalar_path_forced_equals_float64(op, tmp_path):
    """DS_XC_SOFTMAX_SIMD=0 (read once per process) selects the scalar loop (std::exp, float64 sums)."""
    x = torch.randn(7, 1001) * 9
    x[2, 4] = float("nan")
    y, m, s, simd = call_in_process("softmax", {"DS_XC_SOFTMAX_SIMD": "0"},
                                    "(a, *op.exp_rows(a, 0.0), op.simd_enabled())", x, tmp_path)
    assert simd is False
    y2 = x.clone()
    m2, s2 = op.exp_rows(y2, 0.0)
    assert torch.equal(m.nan_to_num(-1.0), m2.nan_to_num(-1.0))
    torch.testing.assert_close(y.nan_to_num(-1.0), y2.nan_to_num(-1.0), rtol=2.5e-7, atol=0.0)
    torch.testing.assert_close(s.nan_to_num(-1.0), s2.nan_to_num(-1.0), rtol=1e-6, atol=0.0)
    ok = ~x.isnan().any(dim=1)
    e = (x[ok] - m[ok][:, None]).double().exp()
    torch.testing.assert_close(s[ok].double(), e.sum(dim=1), rtol=1e-7, atol=0.0)


@pytest.mark.parametrize("loss_cfg", [{"type": "arcface", "scale": 64.0, "margin": 0.5}, {"type": "softmax"},
                                      {"type": "dsoftmax", "scale": 30.0, "d": 0.9}])
def test_fused_loss_with_the_op_matches_float64(op, loss_cfg, monkeypatch):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(37, 16, generator=g), torch.randn(300, 16, generator=g)
    t = torch.randint(0, 300, (37,), generator=g)
    t[::5] = -1  # targets elsewhere
    loss = build_loss(loss_cfg)
    ref = fused_loss_and_grads(x.double(), w.double(), t, loss, chunk_size=8)
    got = fused_loss_and_grads(x, w, t, loss, chunk_size=8)
    monkeypatch.setenv(S.ENV, "0")
    plain = fused_loss_and_grads(x, w, t, loss, chunk_size=8)
    for a, b, c in zip(got, ref, plain):
        torch.testing.assert_close(a.double(), b, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(a, c, rtol=2e-5, atol=2e-5)

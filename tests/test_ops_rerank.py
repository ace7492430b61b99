"""ds_xc_ops.rows.rerank_scores, the ANN re-rank's one-pass scores of candidate rows, against a float64
reference on its AVX-512 and plain paths, and exact_cosine_rerank with and without it."""
import pytest
import torch

from ds_xc.sampling.ann.index import exact_cosine_rerank
from ds_xc_ops import rows as native_rows
from tests.native_ops import built_op, call_in_process


@pytest.fixture(scope="module")
def op():
    return built_op("rows")


def _case(d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(3000, d, generator=g) * torch.rand(3000, 1, generator=g) * 3
    w[7] = 0.0  # a zero row: cosine divides by 1e-12
    q = torch.randn(40, d, generator=g)
    cand = torch.randint(0, 3000, (40, 50), generator=g)
    cand[5, 10:] = -1  # padding
    cand[6] = 7
    return q, w, cand


def _reference(q, w, cand, cosine):
    rows = w.double()[cand.clamp_min(0)]  # (N, R, d)
    s = (rows * q.double()[:, None, :]).sum(dim=2)
    if cosine:
        s = s / rows.norm(dim=2).clamp_min(1e-12)
    return s.masked_fill(cand < 0, float("-inf"))


@pytest.mark.parametrize("d", [1, 15, 16, 17, 128, 129])
@pytest.mark.parametrize("cosine", [True, False])
def test_scores_equal_float64(op, d, cosine):
    q, w, cand = _case(d, seed=d)
    got = native_rows.rerank_scores(q, w, cand, cosine)
    want = _reference(q, w, cand, cosine)
    assert got.dtype == torch.float32 and got.shape == cand.shape
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    scale = (q.double().norm(dim=1)[:, None] * (1.0 if cosine else w.double().norm(dim=1).max())).expand_as(want)
    fin = torch.isfinite(want)
    assert ((got.double() - want).abs()[fin] <= 1e-5 * scale[fin]).all()


def test_plain_path_forced_equals_float64(op, tmp_path):
    """DS_XC_ROWS_SIMD=0 (read once per process) takes the plain loop."""
    q, w, cand = _case(37, seed=3)
    path, got = call_in_process("rows", {"DS_XC_ROWS_SIMD": "0"}, "(op.simd(), op.rerank_scores(*a, True))",
                                (q, w, cand), tmp_path)
    assert path == "scalar"
    want = _reference(q, w, cand, True)
    fin = torch.isfinite(want)
    assert torch.equal(torch.isinf(got), ~fin)
    assert ((got.double() - want).abs()[fin] <= 1e-5 * q.double().norm(dim=1)[:, None].expand_as(want)[fin]).all()


def test_fallbacks_and_errors(op):
    q, w, cand = _case(16)
    assert native_rows.rerank_scores(q.double(), w.double(), cand, True) is None
    assert native_rows.rerank_scores(q, w.t().contiguous().t(), cand, True) is None
    assert native_rows.rerank_scores(q, w, cand.int(), True) is None
    bad = cand.clone()
    bad[0, 0] = 3000
    with pytest.raises(RuntimeError, match="outside"):
        native_rows.rerank_scores(q, w, bad, True)


@pytest.mark.parametrize("metric", ["cosine", "dot"])
def test_rerank_with_and_without_the_kernel(op, monkeypatch, metric):
    """The kept candidates are those of the gather + bmm path (random data: no near ties) and of a
    float64 ranking; padding stays -1."""
    q, w, cand = _case(128, seed=5)
    got = exact_cosine_rerank(q, w, cand, 12, metric=metric)
    monkeypatch.setenv(native_rows.ENV, "0")
    plain = exact_cosine_rerank(q, w, cand, 12, metric=metric)
    assert torch.equal(got, plain)
    want = _reference(q, w, cand, metric == "cosine")
    top = cand.gather(1, torch.topk(want, 12, dim=1).indices)
    assert torch.equal(got, torch.where(torch.isfinite(torch.topk(want, 12, dim=1).values), top, -1))
    assert (got[5, 10:] == -1).all()

"""The head's kept scratch buffers and its gather of the active rows (ds_xc/head/workspace.py,
ops/rows.py gather_rows)."""
import pytest
import torch
import torch.nn.functional as F

from ds_xc import ClassParallelHead
from ds_xc.head.workspace import Workspace, gather_rows
from ds_xc_ops import rows as native_rows


def test_workspace_keeps_small_buffers_only():
    ws = Workspace(keep_bytes=1024)
    a = ws.buffer("x", (4, 8), torch.float32, "cpu")  # 128 bytes: kept
    b = ws.buffer("x", (2, 8), torch.float32, "cpu")  # fits in the kept one: same storage
    assert b.data_ptr() == a.data_ptr() and b.shape == (2, 8)
    c = ws.buffer("x", (4, 8), torch.float64, "cpu")  # another dtype: a new kept buffer
    assert c.dtype == torch.float64 and c.data_ptr() != a.data_ptr()
    big = ws.buffer("x", (64, 8), torch.float32, "cpu")  # 2 KiB > keep_bytes: transient, nothing kept
    assert big.shape == (64, 8) and ws.kept_bytes() == 0
    assert ws.buffer("y", (3,), torch.float32, "cpu").data_ptr() == ws.buffer("y", (3,), torch.float32, "cpu").data_ptr()
    ws.clear()
    assert ws.kept_bytes() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("native", ["1", "0"])
def test_gather_rows_equals_index_select(monkeypatch, dtype, native):
    monkeypatch.setenv(native_rows.ENV, native)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1000, 24, generator=g).to(dtype)
    idx = torch.randint(0, 1000, (301,), generator=g)  # repeats allowed, any order
    assert torch.equal(native_rows.gather_rows(w, idx), w[idx])
    out = torch.empty(301, 24, dtype=dtype)
    assert native_rows.gather_rows(w, idx, out) is out and torch.equal(out, w[idx])
    assert native_rows.gather_rows(w, idx[:0]).shape == (0, 24)
    with pytest.raises((RuntimeError, IndexError)):
        native_rows.gather_rows(w, torch.tensor([0, 1000]))


@pytest.mark.parametrize("sparse", [True, False])
def test_gather_rows_gradient_is_embeddings(sparse):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(50, 6, generator=g, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([2, 5, 7, 11, 40])
    up = torch.randn(5, 6, generator=g, dtype=torch.float64)
    ws = Workspace()
    (gather_rows(w, idx, sparse, ws) * up).sum().backward()
    mine, w.grad = w.grad, None
    (F.embedding(idx, w, sparse=sparse) * up).sum().backward()
    assert mine.is_sparse == sparse == w.grad.is_sparse
    if sparse:
        assert not mine.is_coalesced() and torch.equal(mine._indices(), w.grad._indices())
        mine, ref = mine.to_dense(), w.grad.to_dense()
    else:
        ref = w.grad
    torch.testing.assert_close(mine, ref, rtol=0, atol=0)
    assert torch.autograd.gradcheck(lambda t: gather_rows(t, idx, False, ws), (w.detach().requires_grad_(),))


def _head(seed=3):
    return ClassParallelHead(8, 300, loss={"type": "arcface", "scale": 16.0, "margin": 0.3},
                             sampler={"type": "uniform", "sample_rate": 0.2}, chunk_size=5, dtype=torch.float64,
                             seed=seed)


def test_two_forwards_before_one_backward():
    """The kept buffers are overwritten by the second forward: the first loss's gradient (formed
    during its forward) must not change."""
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(12, 8, generator=g, dtype=torch.float64) for _ in range(2)]
    ys = [torch.randint(0, 300, (12,), generator=g) for _ in range(2)]
    torch.manual_seed(0)
    a = _head()
    xa = [x.clone().requires_grad_() for x in xs]
    sum(a(x, y) for x, y in zip(xa, ys)).backward()
    torch.manual_seed(0)
    b = _head()
    xb = [x.clone().requires_grad_() for x in xs]
    for x, y in zip(xb, ys):
        b(x, y).backward()
    ga = a.weight.grad.to_dense() if a.weight.grad.is_sparse else a.weight.grad
    gb = b.weight.grad.to_dense() if b.weight.grad.is_sparse else b.weight.grad
    torch.testing.assert_close(ga, gb, rtol=1e-12, atol=1e-12)
    for u, v in zip(xa, xb):
        torch.testing.assert_close(u.grad, v.grad, rtol=1e-12, atol=1e-12)
    assert a.workspace.kept_bytes() > 0  # the sampled head did keep its scratch

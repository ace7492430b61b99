"""The fused row kernels of the head optimizers' lazy steps (ops/csrc/rows_cpu.cpp via ds_xc_ops.rows)
against the PyTorch path they replace (DS_XC_NATIVE_ROWS=0): SGD bitwise (the kernels fuse a
multiply-add exactly where PyTorch's CPU kernels do), AdamW's moments bitwise and its weights within
an ulp or two (PyTorch's vectorised sqrt is not the correctly rounded one the kernel uses), for the
lazy step and the exact catch-up, float32 and float64, rows with duplicates, and the fallbacks."""
import logging

import pytest
import torch

import ds_xc_ops.logs
from ds_xc.head.optim import HeadAdamW, HeadSGD
from ds_xc_ops import builders
from ds_xc_ops import rows as native_rows

L, D = 257, 24  # D not a multiple of the vector width: the loops' tails run too


@pytest.fixture(scope="module")
def op():
    built = builders.load_op("rows")
    assert built is not None, "the C++ rows op did not build (see the logged warning)"
    return built


def _optimizer(kind, w, **kw):
    if kind == "sgd":
        return HeadSGD([w], lr=0.1, momentum=0.9, weight_decay=kw.pop("wd", 5e-4), exact=True, **kw)
    return HeadAdamW([w], lr=0.01, weight_decay=kw.pop("wd", 0.01), exact=True, **kw)


def _trajectory(kind, native, dtype, monkeypatch, steps=40, **kw):
    """A lazy_exact run with a warm-up + decay learning rate, random active sets (some rows skipped
    for the whole run), catch-ups with repeated rows, and a final catch_up_all."""
    monkeypatch.setenv(native_rows.ENV, "1" if native else "0")
    g = torch.Generator().manual_seed(3)
    w = torch.nn.Parameter(torch.randn(L, D, generator=g, dtype=dtype))
    opt = _optimizer(kind, w, **kw)
    base = opt.param_groups[0]["lr"]
    for s in range(steps):
        opt.param_groups[0]["lr"] = base * min(1.0, (s + 1) / 8) * 0.97 ** s
        rows = torch.randperm(L - 20, generator=g)[: L // 4].sort().values  # rows >= L - 20: never active
        again = rows[torch.randint(0, rows.numel(), (9,), generator=g)]
        opt.catch_up(torch.cat([rows, again]))  # duplicates: each stale row caught up once
        vals = torch.randn(rows.numel(), D, generator=g, dtype=dtype)
        w.grad = torch.sparse_coo_tensor(rows[None], vals, (L, D))
        opt.step()
    opt.catch_up_all()
    state = {k: v.clone() for k, v in opt.state[w].items() if torch.is_tensor(v)}
    return w.detach().clone(), state


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kw", [{}, {"nesterov": True}, {"wd": 0.0}], ids=["plain", "nesterov", "no_decay"])
def test_sgd_kernels_give_the_bits_of_the_torch_path(op, monkeypatch, dtype, kw):
    w_native, s_native = _trajectory("sgd", True, dtype, monkeypatch, **kw)
    w_torch, s_torch = _trajectory("sgd", False, dtype, monkeypatch, **kw)
    assert torch.equal(w_native, w_torch)
    assert s_native.keys() == s_torch.keys()
    for key in s_torch:
        assert torch.equal(s_native[key], s_torch[key]), key


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("wd", [0.01, 0.0])
def test_adamw_kernels_match_the_torch_path(op, monkeypatch, dtype, wd):
    w_native, s_native = _trajectory("adamw", True, dtype, monkeypatch, wd=wd)
    w_torch, s_torch = _trajectory("adamw", False, dtype, monkeypatch, wd=wd)
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(w_native, w_torch, rtol=8 * ulp, atol=8 * ulp)
    assert not torch.equal(w_native, w_torch[torch.randperm(L)])  # the comparison can fail
    for key in ("exp_avg", "exp_avg_sq", "lazy_last", "lazy_suffix"):
        torch.testing.assert_close(s_native[key], s_torch[key], rtol=8 * ulp, atol=0)


def test_the_optimizer_takes_the_kernel_and_bumps_versions(op, monkeypatch):
    calls = []
    for name in ("sgd_step", "sgd_catch_up"):
        real = getattr(native_rows, name)
        monkeypatch.setattr(native_rows, name, lambda *a, _real=real, _n=name: calls.append(_n) or _real(*a))
    w = torch.nn.Parameter(torch.randn(L, D))
    opt = _optimizer("sgd", w)
    rows = torch.tensor([1, 5, 9])
    for _ in range(2):
        w.grad = torch.sparse_coo_tensor(rows[None], torch.ones(3, D), (L, D))
        opt.step()
    before = w._version
    opt.catch_up(torch.tensor([0, 2, 2]))  # stale rows: the kernel writes them in place
    assert w._version > before
    assert calls.count("sgd_step") == 2 and "sgd_catch_up" in calls


def test_what_the_kernels_refuse_falls_back(op, monkeypatch):
    w, buf = torch.randn(8, 4), torch.randn(8, 4)
    rows, g = torch.tensor([0, 3]), torch.randn(2, 4)
    assert native_rows.sgd_step(w, buf, rows, g, 0.1, 0.9, 0.0, False)
    assert not native_rows.sgd_step(w.bfloat16(), buf.bfloat16(), rows, g.bfloat16(), 0.1, 0.9, 0.0, False)
    assert not native_rows.sgd_step(w, buf.double(), rows, g, 0.1, 0.9, 0.0, False)  # mixed dtypes
    assert not native_rows.sgd_step(w.t(), buf.t(), rows, g, 0.1, 0.9, 0.0, False)  # not contiguous
    assert not native_rows.sgd_step(w, buf, rows.int(), g, 0.1, 0.9, 0.0, False)  # int32 ids
    monkeypatch.setenv(native_rows.ENV, "0")
    assert native_rows.native_op(w) is None
    assert not native_rows.sgd_step(w, buf, rows, g, 0.1, 0.9, 0.0, False)


def test_rows_out_of_range_raise_and_write_nothing(op):
    w, buf = torch.randn(8, 4), torch.randn(8, 4)
    w0, b0 = w.clone(), buf.clone()
    with pytest.raises(RuntimeError, match="row 8 outside"):
        native_rows.sgd_step(w, buf, torch.tensor([0, 8]), torch.randn(2, 4), 0.1, 0.9, 0.0, False)
    last = torch.zeros(8, dtype=torch.int64)
    coef = torch.eye(2, dtype=torch.float64).expand(3, 2, 2).contiguous()
    with pytest.raises(RuntimeError, match="row -1 outside"):
        native_rows.sgd_catch_up(w, buf, last, torch.tensor([1, -1]), coef, 2)
    with pytest.raises(RuntimeError, match="skipped 5 steps, coef covers 2"):
        native_rows.sgd_catch_up(w, buf, last, torch.tensor([1]), coef, 5)
    assert torch.equal(w, w0) and torch.equal(buf, b0) and not last.any()  # no row marked current either


def test_a_failed_build_logs_and_the_optimizer_runs_in_torch(monkeypatch, caplog):
    class Broken(builders.RowsBuilder):
        def load(self, verbose=False):
            raise RuntimeError("Error building extension 'ds_xc_rows_cpu'")

    monkeypatch.setattr(builders, "_OPS", {})
    monkeypatch.setitem(builders.BUILDERS, "rows", Broken)
    monkeypatch.setattr(ds_xc_ops.logs, "_LOGGED", set())
    with caplog.at_level(logging.WARNING):
        w_broken, _ = _trajectory("sgd", True, torch.float64, monkeypatch, steps=5)
    assert any("rows op" in r.getMessage() and "falling back" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(builders, "_OPS", {})
    monkeypatch.setitem(builders.BUILDERS, "rows", builders.RowsBuilder)
    w_torch, _ = _trajectory("sgd", False, torch.float64, monkeypatch, steps=5)
    assert torch.equal(w_broken, w_torch)


def test_kernels_equal_a_dense_float64_reference(op, monkeypatch):
    """The fused path is the dense optimizer's trajectory (torch.optim.SGD on every row, float64)."""
    monkeypatch.setenv(native_rows.ENV, "1")
    g = torch.Generator().manual_seed(5)
    w0 = torch.randn(L, D, generator=g, dtype=torch.float64)
    w = torch.nn.Parameter(w0.clone())
    ref = torch.nn.Parameter(w0.clone())
    opt = _optimizer("sgd", w, nesterov=True)
    ref_opt = torch.optim.SGD([ref], lr=0.1, momentum=0.9, weight_decay=5e-4, nesterov=True)
    for _ in range(60):
        rows = torch.randperm(L, generator=g)[:30].sort().values
        vals = torch.randn(30, D, generator=g, dtype=torch.float64)
        w.grad = torch.sparse_coo_tensor(rows[None], vals, (L, D))
        ref.grad = torch.zeros(L, D, dtype=torch.float64).index_copy_(0, rows, vals)
        opt.catch_up(rows)
        opt.step()
        ref_opt.step()
    opt.catch_up_all()
    torch.testing.assert_close(w.detach(), ref.detach(), rtol=1e-12, atol=1e-12)

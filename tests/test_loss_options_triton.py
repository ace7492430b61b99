"""Loss options (issue 57) on the Triton kernels, under Triton's CPU interpreter: row weights (ignored
rows weigh 0), label smoothing over all C classes and the z-loss == the PyTorch path in float64, for
every loss, also accumulated like the overlap schedule; a Triton head with the options == the float64
reference; softcap is refused by 'triton' (naming the key) and runs the PyTorch path under 'auto'.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated: before their import

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from ds_xc import ClassParallelHead  # noqa: E402
from ds_xc.config import ConfigError  # noqa: E402
from ds_xc.head.margins import build_loss  # noqa: E402
from ds_xc.head.row_terms import RowTerms  # noqa: E402
from ds_xc.head.softmax import fused_loss_and_grads  # noqa: E402
from ds_xc.head.softmax_backend import resolve_softmax  # noqa: E402
from ds_xc.head.triton_softmax import triton_fused_loss_and_grads  # noqa: E402
from tests.reference import LOSSES, option_reference  # noqa: E402

N, K, D, C = 37, 53, 24, 101


def _problem(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g).to(dtype)
    w = (0.5 * torch.randn(K, D, generator=g)).to(dtype)
    t = torch.randint(0, K, (N,), generator=g)
    t[torch.rand(N, generator=g) < 0.25] = -1
    v = torch.rand(N, generator=g) + 0.5
    v[::5] = 0.0  # ignored rows
    return x, w, t, v


def _terms(v, dtype, rows=False):
    return RowTerms(weight=v.to(dtype), smoothing=0.2, z_loss=0.03, num_classes=C,
                    rows_out=torch.empty(N, dtype=dtype) if rows else None, lse_out=torch.empty(N, dtype=dtype))


@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_kernels_take_the_row_terms(name, signed):
    """signed: some row weights negative (reduction none's upstream gradient): a second launch takes them."""
    loss = build_loss(LOSSES[name])
    x, w, t, v = _problem(2)
    if signed:
        v[1::7] = -0.7
        v[::5] = 0.0
    got_terms, want_terms = _terms(v, torch.float32, True), _terms(v, torch.float64, True)
    got_terms.signed = signed
    total, gx, gw = triton_fused_loss_and_grads(x, w, t, loss, terms=got_terms)
    ref_total, ref_gx, ref_gw = fused_loss_and_grads(x.double(), w.double(), t, loss, terms=want_terms)
    assert total.item() == pytest.approx(ref_total.item(), rel=2e-6)
    for got, want in ((gx, ref_gx), (gw, ref_gw), (got_terms.rows_out, want_terms.rows_out),
                      (got_terms.lse_out, want_terms.lse_out)):
        torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5 * want.abs().max().item())
    assert (gx[::5] == 0).all()  # ignored rows: no gradient


def test_kernels_accumulate_the_terms_like_the_overlap_schedule():
    loss = build_loss(LOSSES["cosface"])
    x, w, t, v = _problem(3)
    gw = torch.zeros(K, D)
    for a, b in ((0, 20), (20, N)):
        terms = _terms(v, torch.float32).slice(a, b)
        triton_fused_loss_and_grads(x[a:b], w, t[a:b], loss, gw=gw, accumulate=True, finish=a == 20, terms=terms)
    _, _, ref = fused_loss_and_grads(x.double(), w.double(), t, loss, terms=_terms(v, torch.float64))
    torch.testing.assert_close(gw.double(), ref, rtol=2e-5, atol=2e-5 * ref.abs().max().item())


@pytest.mark.parametrize("name", ["softmax", "arcface", "dsoftmax"])
def test_triton_head_with_options_matches_reference(name):
    opts = {"label_smoothing": 0.1, "z_loss": 0.01, "ignore_index": 4}
    head = ClassParallelHead(D, C, loss={**LOSSES[name], **opts}, softmax_backend="triton", init_std=0.5, seed=1)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N, D, generator=g)
    y = torch.randint(0, C, (N,), generator=g)
    y[::4] = 4
    sw = torch.rand(N, generator=g) + 0.5
    xs = x.clone().requires_grad_()
    out = head(xs, y, sw)
    out.backward()
    ref, gx, gw, lse = option_reference(x, head.weight.detach(), y, LOSSES[name], opts, sw)
    assert out.item() == pytest.approx(ref.item(), rel=1e-5)
    torch.testing.assert_close(xs.grad.double(), gx, rtol=1e-4, atol=1e-4 * gx.abs().max().item())
    torch.testing.assert_close(head.weight.grad.double(), gw, rtol=1e-4, atol=1e-4 * gw.abs().max().item())
    torch.testing.assert_close(head.last_lse.double(), lse, rtol=1e-5, atol=1e-5)


def test_softcap_is_refused_by_triton_and_runs_torch_under_auto():
    with pytest.raises(ConfigError, match="loss.softcap"):
        ClassParallelHead(D, C, softmax_backend="triton", softcap=3.0)
    x, w = torch.randn(4, D), torch.randn(5, D)
    with pytest.raises(ValueError, match="softcap"):
        resolve_softmax("triton", x, w, RowTerms(softcap=3.0))
    assert resolve_softmax("auto", x, w, RowTerms(softcap=3.0)) is None


def test_triton_head_reduction_none_with_negative_upstream():
    head = ClassParallelHead(D, C, loss={**LOSSES["cosface"], "reduction": "none", "z_loss": 0.01},
                             softmax_backend="triton", init_std=0.5, seed=1)
    g = torch.Generator().manual_seed(6)
    x, y = torch.randn(N, D, generator=g), torch.randint(0, C, (N,), generator=g)
    u = torch.randn(N, generator=g)  # upstream of both signs
    xs = x.clone().requires_grad_()
    (head(xs, y) * u).sum().backward()
    opts = {"reduction": "none", "z_loss": 0.01}
    _, gx, gw, _ = option_reference(x, head.weight.detach(), y, LOSSES["cosface"], opts, None, u.double())
    torch.testing.assert_close(xs.grad.double(), gx, rtol=1e-4, atol=1e-4 * gx.abs().max().item())
    torch.testing.assert_close(head.weight.grad.double(), gw, rtol=1e-4, atol=1e-4 * gw.abs().max().item())

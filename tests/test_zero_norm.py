"""An all-zero embedding row under a cosine loss (CosFace, ArcFace, combined, D-Softmax) has gradient 0 (issue 59):
its direction is undefined, and F.normalize's eps would multiply its gradient by 10^12. The other rows' gradients,
the weight gradient and the loss equal the float64 dense reference (the zero row's cosines are 0), in the chunked
PyTorch path (one chunk and several) and in the Triton path (CPU interpreter), and through the head.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated: before their import

import pytest  # noqa: E402
import torch  # noqa: E402

from ds_xc import ClassParallelHead  # noqa: E402
from ds_xc.head.margins import build_loss  # noqa: E402
from ds_xc.head.softmax import fused_loss_and_grads  # noqa: E402
from tests.reference import LOSSES, reference  # noqa: E402

COSINE = ["cosface", "arcface", "combined", "dsoftmax"]
N, K, D, ZERO = 9, 13, 6, 4


def _problem():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    x[ZERO] = 0.0
    w = 0.5 * torch.randn(K, D, generator=g, dtype=torch.float64)
    return x, w, torch.randint(0, K, (N,), generator=g)


def _expected(name, x, w, t):
    mean, gx, gw = reference(x, w, t, LOSSES[name])
    assert gx[ZERO].abs().max() > 1e6  # what F.normalize's eps gives the zero row
    gx = gx.clone()
    gx[ZERO] = 0.0
    return mean * N, gx * N, gw * N


@pytest.mark.parametrize("chunk", [0, 4])
@pytest.mark.parametrize("name", COSINE)
def test_torch_path(name, chunk):
    x, w, t = _problem()
    total, gx, gw = fused_loss_and_grads(x, w, t, build_loss(LOSSES[name]), chunk_size=chunk)
    ref_total, ref_gx, ref_gw = _expected(name, x, w, t)
    torch.testing.assert_close(total, ref_total, rtol=1e-12, atol=1e-12)
    assert torch.equal(gx[ZERO], torch.zeros(D, dtype=torch.float64))
    torch.testing.assert_close(gx, ref_gx, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gw, ref_gw, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", COSINE)
def test_triton_path(name):
    pytest.importorskip("triton")
    from ds_xc.head.triton_softmax import triton_fused_loss_and_grads
    x, w, t = _problem()
    total, gx, gw = triton_fused_loss_and_grads(x.float(), w.float(), t, build_loss(LOSSES[name]))
    ref_total, ref_gx, ref_gw = _expected(name, x.float().double(), w.float().double(), t)
    assert torch.equal(gx[ZERO], torch.zeros(D))
    torch.testing.assert_close(total.double(), ref_total, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(gx.double(), ref_gx, rtol=2e-5, atol=2e-5 * ref_gx.abs().max().item())
    torch.testing.assert_close(gw.double(), ref_gw, rtol=2e-5, atol=2e-5 * ref_gw.abs().max().item())


@pytest.mark.parametrize("name", COSINE)
def test_through_the_head(name):
    x, _, _ = _problem()
    y = torch.arange(N) % 7
    head = ClassParallelHead(D, 7, loss=LOSSES[name], dtype=torch.float64, init_std=0.5, seed=1)
    x.requires_grad_()
    head(x, y).backward()
    assert torch.equal(x.grad[ZERO], torch.zeros(D, dtype=torch.float64))
    _, ref_gx, ref_gw = reference(x, head.weight.detach(), y, LOSSES[name])
    ref_gx[ZERO] = 0.0
    torch.testing.assert_close(x.grad, ref_gx, rtol=1e-7, atol=1e-10)  # the tolerance of tests/test_uneven_dist.py
    torch.testing.assert_close(head.weight.grad, ref_gw, rtol=1e-7, atol=1e-10)

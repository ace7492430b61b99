"""16-bit weights multiply as 16-bit GEMMs with float32 results on tensor-core devices (ds_xc_ops.matmul).

The chunked softmax and the ANN re-rank run shape-only on the meta device, which ds_xc_ops.matmul treats as
a tensor-core device (as CUDA), while a dispatch mode records every matrix product: with bfloat16 weights
every GEMM over the active rows takes bfloat16 operands and writes float32 (``mm.dtype`` / ``mm.dtype_out``,
``addmm.dtype_out``, ``bmm.dtype``: no upcast float32 GEMM, the ``cutlass_80_simt_sgemm`` of the H200
profile); with float32 weights the products are plain float32 ones (the user's matmul precision). On the
CPU the 16-bit path is not taken (no kernel): the CPU results are those of the float32 blocks, tested
everywhere else.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ds_xc.head.margins import build_loss
from ds_xc.head.softmax import fused_loss_and_grads
from ds_xc.sampling.ann.index import exact_cosine_rerank
from ds_xc_ops.matmul import tensor_cores
from tests.reference import LOSSES

N, K, D = 64, 500, 32


class _Products(TorchDispatchMode):
    """Records (op, dtypes of its matrix operands) of every matrix product."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("mm", "addmm", "bmm", "baddbmm"):
            mats = [a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2]
            self.seen.append((str(func), tuple(m.dtype for m in mats), tuple(tuple(m.shape) for m in mats)))
        return func(*args, **(kwargs or {}))


def _gemms(seen):
    """The products over the active rows (at least one operand with K rows or columns; not the per-row
    dot products of the cosine's backward, (K, 1, d) x (K, d, 1))."""
    return [s for s in seen if any(K in shape[-2:] for shape in s[2]) and not any(1 in shape[-2:] for shape in s[2])]


def test_meta_is_a_tensor_core_device_and_the_cpu_is_not():
    assert tensor_cores(torch.bfloat16, torch.device("meta")) and tensor_cores(torch.float16, torch.device("cuda"))
    assert not tensor_cores(torch.bfloat16, torch.device("cpu")) and not tensor_cores(torch.float32, torch.device("meta"))


@pytest.mark.parametrize("loss", ["softmax", "arcface", "dsoftmax"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_weights_take_16_bit_gemms_with_float32_results(loss, dtype):
    x = torch.empty(N, D, device="meta")
    w = torch.empty(K, D, dtype=dtype, device="meta")
    t = torch.empty(N, dtype=torch.int64, device="meta")
    rec = _Products()
    with rec:
        total, gx, gw = fused_loss_and_grads(x, w, t, build_loss(LOSSES[loss]), chunk_size=16)
    gemms = _gemms(rec.seen)
    assert len(gemms) == 3 * 4, rec.seen  # per chunk: the logits, M @ w, and M^T @ x (4 chunks of 16 rows)
    for op, dtypes, _ in gemms:
        assert ".dtype" in op and all(d == dtype for d in dtypes[-2:]), (op, dtypes)
    # the logits are written straight into the float32 scratch (no second (n, K) buffer, issue 56)
    assert [op for op, _, shapes in gemms if shapes[1] == (D, K)] == ["aten.mm.dtype_out"] * 4, gemms
    assert gx.dtype == torch.float32 and gw.dtype == torch.float32


def test_float32_weights_keep_float32_products():
    x, w = torch.empty(N, D, device="meta"), torch.empty(K, D, device="meta")
    rec = _Products()
    with rec:
        fused_loss_and_grads(x, w, torch.empty(N, dtype=torch.int64, device="meta"), build_loss(LOSSES["arcface"]),
                             chunk_size=16)
    gemms = _gemms(rec.seen)
    assert gemms and all(".dtype" not in op and set(d) == {torch.float32} for op, d, _ in gemms), gemms


def test_the_ann_re_rank_scores_16_bit_rows_on_tensor_cores():
    q = torch.empty(N, D, device="meta")
    w = torch.empty(K * 4, D, dtype=torch.bfloat16, device="meta")
    cand = torch.empty(N, K, dtype=torch.int64, device="meta")
    rec = _Products()
    with rec:
        out = exact_cosine_rerank(q, w, cand, 10)
    assert out.shape == (N, 10)
    assert [s[:2] for s in rec.seen] == [("aten.bmm.dtype", (torch.bfloat16, torch.bfloat16))], rec.seen

"""ds_xc_ops.hamming_triton (backend="triton") against the PyTorch reference, exact equality.

Without a GPU the kernel runs under Triton's CPU interpreter: TRITON_INTERPRET is set
before any kernel module is imported (triton reads it when a kernel is decorated). The
interpreter checks the indexing, masking, the key packing and both tile merges; it
cannot check speed, races or the libdevice popcount (see docs/ops.md).
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from ds_xc_ops import hamming as H  # noqa: E402
from ds_xc_ops.hamming_torch import topk_ivf_torch  # noqa: E402
from ds_xc_ops.hamming_triton import TRITON_MAX_K, topk_ivf_triton  # noqa: E402
from ds_xc_ops.triton_util import interpreting  # noqa: E402
from tests.ivf_data import random_ivf  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() and not interpreting() else "cpu")
CASES = ["random", "duplicates", "one_code", "k_large", "skip_probes", "empty_lists", "repeat_probes"]


def make_ivf(seed, bits, n=6, rows=200, nlist=8, nprobe=3, distinct=None):
    """A random inverted file (q, list_codes, list_ids, list_offsets, probes) on DEV."""
    return [t.to(DEV) for t in random_ivf(seed, bits, n, rows, nlist, nprobe, distinct, id_scale=7, id_offset=3)]


def case(name, bits, seed=0):
    """(inputs, k) of a named scenario."""
    if name == "random":
        return make_ivf(seed, bits), 10
    if name == "duplicates":
        return make_ivf(seed, bits, distinct=3), 40
    if name == "one_code":  # every distance equal: the order is the ids alone
        return make_ivf(seed, bits, distinct=1), 17
    if name == "k_large":  # fewer candidates than k: padding
        return make_ivf(seed, bits, rows=30), 70
    if name == "skip_probes":
        args = make_ivf(seed, bits, nprobe=4)
        args[4][::2, 1:] = -1
        args[4][1] = -1  # nothing to scan: all padding
        return args, 12
    if name == "empty_lists":
        return make_ivf(seed, bits, rows=20, nlist=30, nprobe=6), 5
    if name == "repeat_probes":
        args = make_ivf(seed, bits, nprobe=4, distinct=4)
        args[4][:, 2] = args[4][:, 0]
        args[4][:, 3] = args[4][:, 0]
        return args, 30
    raise KeyError(name)


def assert_same(got, want):
    assert got[0].dtype == torch.int32 and got[1].dtype == torch.int64
    assert got[0].shape == want[0].shape and got[1].shape == want[1].shape
    assert torch.equal(got[0].cpu(), want[0].cpu()), (got[0], want[0])
    assert torch.equal(got[1].cpu(), want[1].cpu()), (got[1], want[1])


@pytest.mark.parametrize("bits", [32, 64, 256, 512])
@pytest.mark.parametrize("name", CASES)
def test_public_api_matches_reference(name, bits):
    args, k = case(name, bits)
    want = H.hamming_topk_ivf(*args, k, backend="torch")
    assert_same(H.hamming_topk_ivf(*args, k, backend="triton"), want)


@pytest.mark.parametrize("splits,merge,k", [(2, "rank", 40), (3, "rank", 40), (1, "sort", 8), (2, "sort", 8),
                                            (1, "sort", 100)])
def test_splits_and_merges(splits, merge, k):
    """Probe splits merged by torch, and the GPU's tl.sort merge (slow under the interpreter)."""
    n, rows = ((1 if k > 8 else 2), 120) if merge == "sort" else (6, 200)  # tl.sort: ~0.3 s a merge here
    args = make_ivf(3, 64, n=n, rows=rows, distinct=3)
    args[4] = H._unique_probes(args[4])
    want = topk_ivf_torch(*args, k)
    assert_same(topk_ivf_triton(*args, k, splits=splits, merge=merge), want)


@pytest.mark.parametrize("k", [1, 100, 256, 1024])
def test_k_range_and_many_tiles(k):
    """Lists longer than a tile (128 rows at small k), k up to TRITON_MAX_K, ids near the 2^52 limit."""
    args = make_ivf(5, 128, n=3, rows=1500, nlist=2, nprobe=2, distinct=50)
    args[2] = args[2] + (H.TRITON_ID_LIMIT - 20_000)
    assert_same(H.hamming_topk_ivf(*args, k, backend="triton"), H.hamming_topk_ivf(*args, k, backend="torch"))


def test_flat_and_degenerate_shapes():
    q, codes = make_ivf(1, 32)[:2]
    assert_same(H.hamming_topk_flat(q, codes, 9, backend="triton"), H.hamming_topk_flat(q, codes, 9, backend="torch"))
    args = make_ivf(2, 64)
    for k in (0,):
        assert_same(H.hamming_topk_ivf(*args, k, backend="triton"), H.hamming_topk_ivf(*args, k, backend="torch"))
    empty = [args[0][:0], *args[1:4], args[4][:0]]
    assert_same(H.hamming_topk_ivf(*empty, 5, backend="triton"), H.hamming_topk_ivf(*empty, 5, backend="torch"))


def test_limits_are_errors():
    args = make_ivf(0, 64)
    with pytest.raises(ValueError, match="k <= 1024"):
        H.hamming_topk_ivf(*args, TRITON_MAX_K + 1, backend="triton")
    big = list(args)
    big[2] = big[2] + H.TRITON_ID_LIMIT
    with pytest.raises(ValueError, match="list_ids < 2\\^52"):
        H.hamming_topk_ivf(*big, 5, backend="triton")
    with pytest.raises(ValueError, match="splits"):
        topk_ivf_triton(*args, 5, splits=99)


def test_cpu_tensors_without_interpreter_are_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    args = [t.cpu() for t in make_ivf(0, 64)]
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        H.hamming_topk_ivf(*args, 5, backend="triton")
    assert "triton" not in H.available_backends(build=False) or torch.cuda.is_available()


def test_auto_routing(monkeypatch):
    """auto on CUDA tensors: the native op if it builds, else triton up to k = 1024, else torch."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(H, "triton_unusable_reason", lambda dev: None)
    monkeypatch.setattr(H, "_cuda_op", lambda: None)
    assert H._resolve("auto", cuda, 10) == "triton"
    assert H._resolve("auto", cuda, TRITON_MAX_K + 1) == "torch"
    monkeypatch.setattr(H, "_cuda_op", lambda: object())
    assert H._resolve("auto", cuda, 10) == "cuda"
    monkeypatch.setattr(H, "_cpu_op", lambda: None)
    assert H._resolve("auto", torch.device("cpu"), 10) == "torch"  # never triton for CPU tensors
    monkeypatch.setattr(H, "triton_unusable_reason", lambda dev: "no triton")
    with pytest.raises(ValueError, match="no triton"):
        H._resolve("triton", cuda, 10)

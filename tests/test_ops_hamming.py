"""ds_xc_ops.hamming: the PyTorch reference against a brute-force loop, and every other backend
(C++ CPU, faiss, CUDA when present) against the reference, with exact equality of
distances and ids, on random and adversarial inputs (many ties, k above the candidate
count, -1 and repeated probes, empty lists, code_bits 32/64/96/256/1024).

The C++ op is built at most once per session (module fixture; cached across sessions in
the torch extensions cache, ~30 s cold on 2 cores).
"""
import logging
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import ds_xc_ops.logs
from ds_xc_ops import builders
from ds_xc_ops import hamming as H
from ds_xc_ops.hamming_torch import topk_ivf_torch
from tests.ivf_data import random_ivf

BITS = [32, 64, 96, 256, 512, 1024]
SCENARIOS = ["random", "few_codes", "one_code", "k_large", "skip_probes", "empty_lists",
             "repeat_probes", "probes_over_nlist", "no_probes"]
CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def cpu_op():
    op = builders.load_op("cpu")
    assert op is not None, "the C++ Hamming op did not build (see the logged warning)"
    return op


def make_ivf(seed, bits, n=9, rows=300, nlist=12, nprobe=4, distinct=None, k=10):
    """A random inverted file: (q, list_codes, list_ids, list_offsets, probes), k."""
    return random_ivf(seed, bits, n, rows, nlist, nprobe, distinct, id_scale=3, id_offset=5), k


def scenario(name, bits, seed=0):
    if name == "random":
        return make_ivf(seed, bits)
    if name == "few_codes":
        return make_ivf(seed, bits, distinct=3, k=25)
    if name == "one_code":  # every distance equal: the order is the ids alone
        return make_ivf(seed, bits, distinct=1, k=17)
    if name == "k_large":
        return make_ivf(seed, bits, rows=40, k=60)
    if name == "skip_probes":
        (q, c, i, o, p), k = make_ivf(seed, bits, nprobe=6)
        p[::2, 1:] = -1
        p[1] = -1  # a query with nothing to scan: all padding
        return (q, c, i, o, p), k
    if name == "empty_lists":
        return make_ivf(seed, bits, rows=30, nlist=40, nprobe=8, k=5)
    if name == "repeat_probes":
        (q, c, i, o, p), k = make_ivf(seed, bits, nprobe=5, distinct=4)
        p[:, 3] = p[:, 0]
        p[:, 4] = p[:, 0]
        return (q, c, i, o, p), k
    if name == "probes_over_nlist":  # more probe columns than lists: repeats and -1
        (q, c, i, o, p), k = make_ivf(seed, bits, nlist=3, nprobe=7, distinct=5, k=30)
        p[:, 5:] = -1
        return (q, c, i, o, p), k
    if name == "no_probes":
        (q, c, i, o, p), k = make_ivf(seed, bits)
        return (q, c, i, o, p[:, :0]), k
    raise ValueError(name)


def brute_force(q, codes, ids, offsets, probes, k):
    """The semantics written as a plain loop: sort each query's (distance, id) pairs."""
    bits = q.shape[1] * 8
    qb, cb = H.unpack_bits(q).bool(), H.unpack_bits(codes).bool()
    dist = torch.full((q.shape[0], k), bits + 1, dtype=torch.int32)
    out = torch.full((q.shape[0], k), -1, dtype=torch.int64)
    for i in range(q.shape[0]):
        cand = []
        for p in set(probes[i].tolist()) - {-1}:
            for r in range(int(offsets[p]), int(offsets[p + 1])):
                cand.append((int((qb[i] ^ cb[r]).sum()), int(ids[r])))
        for j, (d, x) in enumerate(sorted(cand)[:k]):
            dist[i, j], out[i, j] = d, x
    return dist, out


def assert_same(got, want):
    assert got[0].dtype == torch.int32 and got[1].dtype == torch.int64
    assert torch.equal(got[0].cpu(), want[0]), (got[0], want[0])
    assert torch.equal(got[1].cpu(), want[1]), (got[1], want[1])


# ---------------------------------------------------------------- packing
def test_pack_matches_numpy_little_endian_bits():
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(1))
    codes = H.pack_signs(x)
    assert codes.dtype == torch.uint8 and codes.shape == (7, 12)
    want = np.packbits((x > 0).numpy(), axis=1, bitorder="little")
    assert np.array_equal(codes.numpy(), want)
    assert torch.equal(H.unpack_bits(codes), (x > 0).to(torch.uint8))
    one = torch.full((1, 32), -1.0)
    one[0, 9] = 2.0  # bit 9 -> byte 1, bit position 1
    assert H.pack_signs(one).tolist() == [[0, 2, 0, 0]]


def test_pack_errors():
    with pytest.raises(ValueError, match="multiple of 8"):
        H.pack_signs(torch.randn(2, 12))
    with pytest.raises(ValueError, match="floating"):
        H.pack_signs(torch.ones(2, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="uint8"):
        H.unpack_bits(torch.ones(2, 8))


# ---------------------------------------------------------------- the reference
@pytest.mark.parametrize("bits", [32, 64, 96])
@pytest.mark.parametrize("name", SCENARIOS)
def test_torch_reference_equals_brute_force(name, bits):
    args, k = scenario(name, bits, seed=bits)
    assert_same(H.hamming_topk_ivf(*args, k, backend="torch"), brute_force(*args, k))


@pytest.mark.parametrize("name", ["random", "few_codes", "one_code", "skip_probes"])
def test_torch_reference_chunked_equals_unchunked(name):
    """Tiny pair budgets and blocks: many chunks, blocks split inside a query, merges."""
    (q, c, i, o, p), k = scenario(name, 64, seed=3)
    p = H._unique_probes(p)
    want = topk_ivf_torch(q, c, i, o, p, k)
    for budget, block in [(1, 8), (37, 40), (500, 8 * 13)]:
        assert_same(topk_ivf_torch(q, c, i, o, p, k, pair_budget=budget, block_bytes=block), want)
    assert_same(want, brute_force(q, c, i, o, p, k))


# ---------------------------------------------------------------- backends vs reference
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("name", SCENARIOS)
def test_cpu_equals_torch(cpu_op, name, bits):
    args, k = scenario(name, bits, seed=bits + 1)
    assert_same(H.hamming_topk_ivf(*args, k, backend="cpu"),
                H.hamming_topk_ivf(*args, k, backend="torch"))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("name", SCENARIOS)
def test_faiss_equals_torch(name, bits):
    args, k = scenario(name, bits, seed=bits + 2)
    assert_same(H.hamming_topk_ivf(*args, k, backend="faiss"),
                H.hamming_topk_ivf(*args, k, backend="torch"))


@pytest.mark.parametrize("bits", [64, 256])
def test_faiss_own_distances_are_exact(bits):
    """Without the tie fix-up faiss's distances already match; its ids are candidates."""
    from ds_xc_ops.hamming_faiss import FaissBinaryIVF
    (q, c, i, o, p), k = scenario("few_codes", bits, seed=5)
    want = H.hamming_topk_ivf(q, c, i, o, p, k, backend="torch")
    got = FaissBinaryIVF(c, i, o).search(q, H._unique_probes(p), k, exact_ties=False)
    assert torch.equal(got[0], want[0])
    for row in range(q.shape[0]):  # same multiset of ids at each distance below the k-th
        below = want[0][row] < want[0][row, -1]
        assert torch.equal(got[1][row][below].sort().values, want[1][row][below].sort().values)


@pytest.mark.parametrize("bits", [64, 128, 96])
def test_cpu_and_faiss_equal_torch_at_scale(cpu_op, bits):
    """Larger lists: histogram threshold with wide ties, many probes, k = 100."""
    args, k = make_ivf(7, bits, n=48, rows=20000, nlist=40, nprobe=10, k=100)
    want = H.hamming_topk_ivf(*args, k, backend="torch")
    assert_same(H.hamming_topk_ivf(*args, k, backend="cpu"), want)
    assert_same(H.hamming_topk_ivf(*args, k, backend="faiss"), want)


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_query_blocks_equal_torch(cpu_op, threads):
    """The C++ scan works list-major in blocks of queries sized by k (here k = 9000: blocks of
    29 queries), with queries sharing most lists; every block must equal the reference."""
    args, k = make_ivf(11, 64, n=150, rows=12000, nlist=12, nprobe=9, k=9000)
    want = H.hamming_topk_ivf(*args, k, backend="torch")
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert_same(H.hamming_topk_ivf(*args, k, backend="cpu"), want)
    finally:
        torch.set_num_threads(old)


def _cpu_has_vpopcntdq() -> bool:
    try:
        with open("/proc/cpuinfo") as fh:
            flags = fh.read()
    except OSError:
        return False
    return " avx512f" in flags and " avx512_vpopcntdq" in flags


SIMD_CASES = [  # (bits, rows, nlist, nprobe, distinct, k): list lengths not multiples of 8, the bound
    (256, 5003, 37, 9, None, 1), (512, 5003, 37, 9, None, 7), (1024, 3001, 23, 6, None, 40),  # falling
    (512, 4099, 29, 8, 3, 5), (256, 4099, 29, 8, 2, 33), (1024, 2003, 17, 5, 4, 200),  # inside a group
    (512, 61, 11, 4, None, 9), (512, 7, 3, 3, None, 4),  # of 8; wide ties; lists shorter than 8
]


@pytest.mark.parametrize("bits,rows,nlist,nprobe,distinct,k", SIMD_CASES)
def test_cpu_vector_scan_equals_torch(cpu_op, bits, rows, nlist, nprobe, distinct, k):
    """The 8-rows-at-a-time AVX-512 scan (256/512/1024-bit codes, where the CPU has VPOPCNTDQ) keeps the
    scalar selection's result exactly: tails, ties broken by id, a bound that falls within a group."""
    if _cpu_has_vpopcntdq() and os.environ.get("DS_XC_HAMMING_SIMD", "1") != "0":
        assert cpu_op.simd() == "avx512"  # CI runs on such machines: the vector path is the one tested here
    args = random_ivf(bits * 7 + rows, bits, 40, rows, nlist, nprobe, distinct, id_scale=3, id_offset=5)
    assert_same(H.hamming_topk_ivf(*args, k, backend="cpu"), H.hamming_topk_ivf(*args, k, backend="torch"))


def _one_list_ivf(codes: torch.Tensor, queries: torch.Tensor, seed: int = 0):
    """(q, list_codes, list_ids, list_offsets, probes) of one list holding every row, ids shuffled."""
    ids = torch.randperm(codes.shape[0], generator=torch.Generator().manual_seed(seed)) * 3 + 5
    offsets = torch.tensor([0, codes.shape[0]], dtype=torch.int64)
    probes = torch.zeros((queries.shape[0], 1), dtype=torch.int64)
    return queries.contiguous(), codes.contiguous(), ids, offsets, probes


@pytest.mark.parametrize("bits", [64, 96, 512])
def test_cpu_sampled_bound_too_tight_rescans(cpu_op, bits):
    """The scan's starting bound comes from every 32nd row: here exactly those rows equal the query
    (distance 0) and the rest are far, so the sampled bound (0) admits fewer than k and the query must
    be scanned again with an open bound; the result is still the k smallest (distance, id)."""
    g = torch.Generator().manual_seed(bits)
    rows, k = 4096, 256
    q = torch.randint(0, 256, (3, bits // 8), dtype=torch.uint8, generator=g)
    codes = torch.randint(0, 256, (rows, bits // 8), dtype=torch.uint8, generator=g)
    codes[::32] = q[0]
    args = _one_list_ivf(codes, q, seed=bits)
    assert_same(H.hamming_topk_ivf(*args, k, backend="cpu"), H.hamming_topk_ivf(*args, k, backend="torch"))


@pytest.mark.parametrize("distinct,k", [(1, 5), (2, 300), (3, 1000)])
def test_cpu_ties_that_fill_the_buffer(cpu_op, distinct, k):
    """Many candidates at the bound's distance (a few distinct codes over 20,000 rows): the buffer fills
    with ties and is cut to the k smallest pairs again and again; ties go by id."""
    g = torch.Generator().manual_seed(distinct)
    pool = torch.randint(0, 256, (distinct, 64), dtype=torch.uint8, generator=g)
    codes = pool[torch.randint(0, distinct, (20000,), generator=g)]
    q = torch.randint(0, 256, (4, 64), dtype=torch.uint8, generator=g)
    q[1] = pool[0]
    args = _one_list_ivf(codes, q, seed=distinct)
    assert_same(H.hamming_topk_ivf(*args, k, backend="cpu"), H.hamming_topk_ivf(*args, k, backend="torch"))


def test_cpu_scalar_scan_forced_equals_vector_scan(cpu_op, tmp_path):
    """DS_XC_HAMMING_SIMD=0 (read once per process) selects the scalar scan; both paths agree bitwise."""
    args = random_ivf(3, 512, 64, 20011, 61, 12, None, id_scale=3, id_offset=5)
    torch.save(args, tmp_path / "ivf.pt")
    code = ("import sys, torch; sys.path.insert(0, sys.argv[1]); from ds_xc_ops import builders, hamming as H; "
            "op = builders.load_op('cpu'); a = torch.load(sys.argv[2]); "
            "torch.save((op.simd(), H.hamming_topk_ivf(*a, 50, backend='cpu')), sys.argv[3])")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, DS_XC_HAMMING_SIMD="0")
    subprocess.run([sys.executable, "-c", code, root, str(tmp_path / "ivf.pt"), str(tmp_path / "out.pt")],
                   env=env, check=True, timeout=600)
    path, scalar = torch.load(tmp_path / "out.pt")
    assert path == "scalar"
    assert_same(H.hamming_topk_ivf(*args, 50, backend="cpu"), scalar)
    assert_same(scalar, H.hamming_topk_ivf(*args, 50, backend="torch"))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("name", SCENARIOS)
def test_cuda_equals_torch(name, bits):
    args, k = scenario(name, bits, seed=bits + 4)
    want = H.hamming_topk_ivf(*args, k, backend="torch")
    cuda_args = [t.cuda() for t in args]
    assert_same(H.hamming_topk_ivf(*cuda_args, k, backend="cuda"), want)
    assert_same(H.hamming_topk_ivf(*cuda_args, k, backend="torch"), want)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_equals_torch_at_scale():
    args, k = make_ivf(8, 128, n=64, rows=50000, nlist=50, nprobe=12, distinct=2000, k=300)
    want = H.hamming_topk_ivf(*args, k, backend="torch")
    assert_same(H.hamming_topk_ivf(*[t.cuda() for t in args], k, backend="cuda"), want)


@pytest.mark.parametrize("backend", ["torch", "cpu", "faiss"] + (["cuda"] if CUDA else []))
@pytest.mark.parametrize("bits,k", [(64, 7), (96, 500), (1024, 3)])
def test_flat_equals_ivf_with_one_list(cpu_op, backend, bits, k):
    g = torch.Generator().manual_seed(bits)
    db = torch.randint(0, 256, (400, bits // 8), dtype=torch.uint8, generator=g)
    db[100:200] = db[0]  # ties
    q = torch.cat([db[:3], torch.randint(0, 256, (4, bits // 8), dtype=torch.uint8, generator=g)])
    dev = "cuda" if backend == "cuda" else "cpu"
    got = H.hamming_topk_flat(q.to(dev), db.to(dev), k, backend=backend)
    args = (q, db, torch.arange(400), torch.tensor([0, 400]), torch.zeros(7, 1, dtype=torch.int64))
    assert_same(got, brute_force(*args, k))
    assert got[0][0, 0] == 0 and got[1][0, 0] == 0 and got[1][0, 1] == 100  # ties by id


# ---------------------------------------------------------------- dispatch, build, errors
def test_auto_uses_cpu_and_logs_once(cpu_op, caplog, monkeypatch):
    monkeypatch.setattr(ds_xc_ops.logs, "_LOGGED", set())
    args, k = scenario("random", 64)
    with caplog.at_level(logging.INFO, logger="ds_xc_ops.hamming"):
        assert_same(H.hamming_topk_ivf(*args, k), H.hamming_topk_ivf(*args, k, backend="torch"))
        H.hamming_topk_ivf(*args, k)
    msgs = [r.getMessage() for r in caplog.records if "backend 'auto'" in r.getMessage()]
    assert msgs == ["hamming_topk: backend 'auto' uses 'cpu' for cpu tensors"]
    assert {"torch", "cpu", "faiss"} <= set(H.available_backends())


def test_failed_build_warns_and_falls_back(monkeypatch, caplog):
    class Broken(builders.HammingBuilder):
        def load(self, verbose=False):
            raise RuntimeError("Error building extension 'ds_xc_hamming_cpu'")

    monkeypatch.setattr(builders, "_OPS", {})
    monkeypatch.setitem(builders.BUILDERS, "cpu", Broken)
    monkeypatch.setattr(ds_xc_ops.logs, "_LOGGED", set())
    args, k = scenario("few_codes", 32)
    with caplog.at_level(logging.INFO):
        got = H.hamming_topk_ivf(*args, k)
    assert_same(got, H.hamming_topk_ivf(*args, k, backend="torch"))
    assert any(r.levelno == logging.WARNING and "falling back" in r.getMessage()
               and "Error building" in r.getMessage() for r in caplog.records)
    assert any("uses 'torch'" in r.getMessage() for r in caplog.records)
    with pytest.raises(RuntimeError, match="unavailable"):
        H.hamming_topk_ivf(*args, k, backend="cpu")
    assert builders.load_op("cpu") is None  # no second build attempt


def test_plain_arch_list_drops_architecture_specific_suffixes():
    assert builders.plain_arch_list("9.0a") == "9.0"
    assert builders.plain_arch_list("8.0;9.0a;10.0a+PTX 12.0 9.0") == "8.0;9.0;10.0+PTX;12.0"
    assert builders.plain_arch_list("8.6+PTX") == "8.6+PTX"
    assert builders.plain_arch_list("sm_90") == "sm_90"  # not ours to reinterpret: DeepSpeed names it


def test_cuda_build_reads_an_arch_specific_list_and_restores_it(monkeypatch):
    """A CUDA image's TORCH_CUDA_ARCH_LIST="9.0a" (seen on the H200 image): DeepSpeed's builder reads
    every entry as int and fails; load_op builds with the plain list and gives the caller's back."""
    from deepspeed.ops.op_builder.builder import CUDAOpBuilder
    jit = builders.HammingCudaBuilder()
    jit.jit_mode = True
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    with pytest.raises(ValueError, match="0a"):
        CUDAOpBuilder.compute_capability_args.__wrapped__(jit)  # DeepSpeed's own parser, unwrapped
    seen = []

    class Recording(builders.HammingCudaBuilder):
        def is_compatible(self, verbose=False):
            return True

        def load(self, verbose=False):
            seen.append(os.environ["TORCH_CUDA_ARCH_LIST"])
            self.jit_mode = True
            self.compute_capability_args()  # what the real load does first: parses the list
            return "op"

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a;10.0a+PTX")
    monkeypatch.setattr(builders, "_OPS", {})
    monkeypatch.setitem(builders.BUILDERS, "cuda", Recording)
    assert builders.load_op("cuda") == "op"
    assert seen == ["9.0;10.0+PTX"]
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0a;10.0a+PTX"


def test_builders_are_deepspeed_op_builders():
    from deepspeed.ops.op_builder.builder import CUDAOpBuilder, OpBuilder
    cpu, cuda = builders.HammingBuilder(), builders.HammingCudaBuilder()
    assert isinstance(cpu, OpBuilder) and isinstance(cuda, CUDAOpBuilder)
    for path in cpu.sources() + cuda.sources():
        assert os.path.isfile(path), path
    assert cuda.is_compatible() == CUDA


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_cuda_kernel_compiles_with_nvcc(tmp_path):
    src = os.path.join(builders.CSRC, "hamming_cuda.cu")
    cmd = ["nvcc", "-c", "-O3", "-std=c++17", "-gencode", "arch=compute_90,code=sm_90",
           src, "-o", str(tmp_path / "hamming_cuda.o")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "warning" not in res.stderr.lower(), res.stderr


def _bad(**over):
    (q, c, i, o, p), k = scenario("random", 64)
    kw = dict(q_codes=q, list_codes=c, list_ids=i, list_offsets=o, probes=p, k=k)
    kw.update(over)
    return kw


@pytest.mark.parametrize("over,match", [
    (dict(q_codes=torch.zeros(9, 8)), r"q_codes must be a 2-D torch.uint8 .*torch.float32"),
    (dict(q_codes=torch.zeros(9, 6, dtype=torch.uint8)), r"code_bits = 48 .*multiple of 32"),
    (dict(q_codes=torch.zeros(9, 132, dtype=torch.uint8)), r"code_bits = 1056 .*\[32, 1024\]"),
    (dict(list_codes=torch.zeros(300, 4, dtype=torch.uint8)), r"list_codes.shape\[1\] = 4 .* 8"),
    (dict(list_ids=torch.zeros(299, dtype=torch.int64)), r"list_ids has 299 .* 300 rows"),
    (dict(list_ids=torch.zeros(300, dtype=torch.int32)), r"list_ids must be a 1-D torch.int64"),
    (dict(probes=torch.zeros(8, 4, dtype=torch.int64)), r"probes has 8 rows .* 9 queries"),
    (dict(probes=torch.full((9, 4), 12)), r"probes must lie in .* = \[-1, 11\], got min 12, max 12"),
    (dict(probes=torch.full((9, 4), -2)), r"probes must lie in .* = \[-1, 11\], got min -2"),
    (dict(list_offsets=torch.tensor([0, 5, 3, 300])), r"list_offsets must be non-decreasing"),
    (dict(list_offsets=torch.tensor([0, 299])), r"from 0 to rows = 300"),
    (dict(list_ids=torch.full((300,), -4)), r"list_ids must be >= 0, got min -4"),
    (dict(k=-1), r"k = -1 must be an int >= 0"),
    (dict(k=2.0), r"k = 2.0 must be an int"),
])
def test_errors_name_argument_value_and_allowed(over, match):
    with pytest.raises(ValueError, match=match):
        H.hamming_topk_ivf(**_bad(**over), backend="torch")


def test_k_may_be_a_numpy_or_tensor_integer(cpu_op):
    args, k = scenario("random", 64)
    want = H.hamming_topk_ivf(*args, k, backend="torch")
    for kk in (np.int64(k), torch.tensor(k)):
        assert_same(H.hamming_topk_ivf(*args, kk, backend="cpu"), want)
    with pytest.raises(ValueError, match="k = True must be an int"):
        H.hamming_topk_flat(args[0], args[1], True)


def test_backend_errors():
    kw = _bad()
    with pytest.raises(ValueError, match=r"backend = 'gpu' is not one of"):
        H.hamming_topk_ivf(**kw, backend="gpu")
    with pytest.raises(ValueError, match=r"backend='cuda' needs CUDA tensors, got device cpu"):
        H.hamming_topk_ivf(**kw, backend="cuda")
    with pytest.raises(ValueError, match=r"db_codes.shape\[1\] = 4 bytes"):
        H.hamming_topk_flat(kw["q_codes"], kw["list_codes"][:, :4], 3)


def test_non_contiguous_inputs(cpu_op):
    (q, c, i, o, p), k = scenario("few_codes", 64)
    want = H.hamming_topk_ivf(q, c, i, o, p, k, backend="torch")
    q_t = q.t().contiguous().t()  # same values, column-major
    p_t = p.t().contiguous().t()
    assert not q_t.is_contiguous() and not p_t.is_contiguous()
    for backend in ["torch", "cpu", "faiss"]:
        assert_same(H.hamming_topk_ivf(q_t, c, i, o, p_t, k, backend=backend), want)


def test_degenerate_shapes(cpu_op):
    (q, c, i, o, p), _ = scenario("random", 32)
    for backend in ["torch", "cpu", "faiss"]:
        d, ids = H.hamming_topk_ivf(q, c, i, o, p, 0, backend=backend)
        assert d.shape == (9, 0) and ids.shape == (9, 0)
        d, ids = H.hamming_topk_ivf(q[:0], c, i, o, p[:0], 4, backend=backend)
        assert d.shape == (0, 4)
        empty = (c[:0], i[:0], torch.zeros(1, dtype=torch.int64), torch.full((9, 2), -1))
        d, ids = H.hamming_topk_ivf(q, *empty, 4, backend=backend)
        assert (d == 33).all() and (ids == -1).all()

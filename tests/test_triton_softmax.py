"""The fused Triton margin softmax (ds_xc/head/triton_softmax.py) == the PyTorch path, under Triton's
CPU interpreter: every loss, targets on other ranks (-1), N and K off the tile sizes, fp32,
fp16 and bf16-stored inputs, every need_gx / need_gw combination, the overlap schedule's
accumulate / finish arguments, the backend switch, and a 2-rank class-parallel run against
the single-process float64 reference. Speed, races and tf32 need a GPU (docs/ops.md).
"""
import os

os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated: before their import

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from ds_xc import ClassParallelHead  # noqa: E402
from ds_xc import config as cfg  # noqa: E402
from ds_xc.head import init_shard, shard_range  # noqa: E402
from ds_xc.head.margins import build_loss  # noqa: E402
from ds_xc.head.softmax import finish_weight_grad, fused_loss_and_grads, inverse_row_norms  # noqa: E402
from ds_xc.head.softmax_backend import resolve_softmax  # noqa: E402
from ds_xc.head.triton_softmax import TileConfig, triton_fused_loss_and_grads  # noqa: E402
from tests.reference import LOSSES, reference  # noqa: E402

N, K, D = 37, 53, 24  # none a multiple of the 16-wide interpreter tiles


def _problem(seed, n=N, k=K, d=D, dtype=torch.float32, p_other=0.25):
    """x (n, d), w (k, d) in `dtype`; targets (n,) in [0, k) or -1 (class on another rank)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g).to(dtype)
    w = (0.5 * torch.randn(k, d, generator=g)).to(dtype)
    t = torch.randint(0, k, (n,), generator=g)
    t[torch.rand(n, generator=g) < p_other] = -1
    return x, w, t


def _torch64(x, w, t, loss, **kw):
    """The PyTorch path in float64 on exactly the stored values."""
    return fused_loss_and_grads(x.double(), w.double(), t, loss, **kw)


def _close(got, want, rtol):
    assert got is not None and want is not None
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=rtol * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_matches_torch_path(name, dtype):
    loss = build_loss(LOSSES[name])
    x, w, t = _problem(1, dtype=dtype)
    assert (t == -1).any() and (t >= 0).any()
    total, gx, gw = triton_fused_loss_and_grads(x, w, t, loss)
    ref_total, ref_gx, ref_gw = _torch64(x, w, t, loss)
    assert total.item() == pytest.approx(ref_total.item(), rel=2e-6)
    _close(gx, ref_gx, 2e-5)
    _close(gw, ref_gw, 2e-5)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_matches_float64_autograd(name):
    """Every target local (one rank): the kernels against autograd of the plain formulas."""
    x, w, t = _problem(2, n=21, k=29, d=20, p_other=0.0)
    total, gx, gw = triton_fused_loss_and_grads(x, w, t, build_loss(LOSSES[name]))
    mean, ref_gx, ref_gw = reference(x, w, t, LOSSES[name])  # d(mean)/d.
    assert total.item() == pytest.approx(mean.item() * 21, rel=2e-6)
    _close(gx, ref_gx * 21, 2e-5)
    _close(gw, ref_gw * 21, 2e-5)


@pytest.mark.parametrize("need_gx,need_gw", [(True, False), (False, True), (False, False)])
def test_gradient_subsets(need_gx, need_gw):
    loss = build_loss(LOSSES["arcface"])
    x, w, t = _problem(3)
    total, gx, gw = triton_fused_loss_and_grads(x, w, t, loss, need_gx=need_gx, need_gw=need_gw)
    ref_total, ref_gx, ref_gw = _torch64(x, w, t, loss)
    assert total.item() == pytest.approx(ref_total.item(), rel=2e-6)
    assert (gx is None) != need_gx and (gw is None) != need_gw
    if need_gx:
        _close(gx, ref_gx, 2e-5)
    if need_gw:
        _close(gw, ref_gw, 2e-5)


@pytest.mark.parametrize("name", ["softmax", "combined"])
def test_fp16_inputs(name):
    loss = build_loss(LOSSES[name])
    x, w, t = _problem(4, dtype=torch.float16)
    total, gx, gw = triton_fused_loss_and_grads(x, w, t, loss)
    ref_total, ref_gx, ref_gw = _torch64(x, w, t, loss)
    assert total.item() == pytest.approx(ref_total.item(), rel=2e-6)
    _close(gx, ref_gx, 2e-5)
    _close(gw, ref_gw, 2e-5)


@pytest.mark.parametrize("tiles", [TileConfig(block_m=32, block_n=32, block_d=32, splits=1, num_warps=1),
                                   TileConfig(block_m=16, block_n=16, block_d=16, splits=7, num_warps=1),
                                   TileConfig(block_m=16, block_n=16, block_d=16, splits=4, num_warps=1,
                                              max_partial_bytes=2 * 48 * 32 * 4)])
@pytest.mark.parametrize("shape", [(5, 7, 8), (48, 70, 32)])
def test_tile_shapes(tiles, shape):
    """Problems smaller than one tile, splits that do not divide the class tiles, and fewer
    backward splits than forward ones (the dX partials' memory cap)."""
    n, k, d = shape
    loss = build_loss(LOSSES["dsoftmax"])
    x, w, t = _problem(5, n=n, k=k, d=d)
    total, gx, gw = triton_fused_loss_and_grads(x, w, t, loss, tiles=tiles)
    ref_total, ref_gx, ref_gw = _torch64(x, w, t, loss)
    assert total.item() == pytest.approx(ref_total.item(), rel=2e-6)
    _close(gx, ref_gx, 2e-5)
    _close(gw, ref_gw, 2e-5)


def test_accumulate_unfinished_like_the_overlap_schedule():
    """Two micro-chunks into one gw buffer with finish=False, then one finish_weight_grad."""
    loss = build_loss(LOSSES["cosface"])
    x, w, t = _problem(6)
    rw = inverse_row_norms(w, loss)
    _, _, gw = triton_fused_loss_and_grads(x[:20], w, t[:20], loss, rw=rw, finish=False)
    _, _, gw2 = triton_fused_loss_and_grads(x[20:], w, t[20:], loss, rw=rw, gw=gw, accumulate=True, finish=False)
    assert gw2 is gw
    finish_weight_grad(gw, w, rw, loss)
    _, _, ref_gw = _torch64(x, w, t, loss)
    _close(gw, ref_gw, 2e-5)


_COMPILE_SM90 = """
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ds_xc.head.triton_softmax import gpu_tiles
from ds_xc_ops.triton_softmax_kernels import backward_kernel, forward_stats_kernel
assert isinstance(forward_stats_kernel, triton.runtime.JITFunction), type(forward_stats_kernel)
ptr = {"rx_ptr": "*fp32", "rw_ptr": "*fp32", "t_ptr": "*i32"}
ints = {"N": "i32", "K": "i32", "D": "i32", "tiles_per_split": "i32", "scale": "fp32"}
for dtype, name, native in ((torch.float32, "*fp32", False), (torch.bfloat16, "*bf16", False),
                            (torch.bfloat16, "*bf16", True)):
    t = gpu_tiles(dtype, 132)
    c = dict(BM=t.block_m, BN=t.block_n, BD=t.block_d, PRECISION=t.precision, NATIVE=native)
    sig = {"x_ptr": name, "w_ptr": name, **ptr, "zt_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", **ints}
    k = triton.compile(ASTSource(forward_stats_kernel, {**sig, **dict.fromkeys(c, "constexpr")}, c),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": t.num_warps})
    assert k.asm["cubin"]
    c.update(NEED_GX=True, NEED_GW=True)
    sig = {"x_ptr": name, "w_ptr": name, **ptr, "lse_ptr": "*fp32", "gt_ptr": "*fp32", "gxp_ptr": "*fp32",
           "gw_ptr": "*fp32", **ints}
    k = triton.compile(ASTSource(backward_kernel, {**sig, **dict.fromkeys(c, "constexpr")}, c),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": t.num_warps})
    assert k.asm["cubin"]
print("compiled")
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_a_gpu(tmp_path):
    """The real (non-interpreted) compiler lowers both kernels to a cubin for sm_90 with the
    GPU tiles: catches what the interpreter accepts and the compiler rejects (globals that are
    not constexpr, dot shapes, types). Needs no GPU: triton ships ptxas."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=os.getcwd() + os.pathsep + env.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SM90], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


def _recorded_shapes(fn, *args):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn(*args)
    return {tuple(s) for e in prof.events() for s in e.input_shapes if isinstance(s, list)}


def test_no_logits_tensor():
    """No torch op of the triton path sees an (N, K) tensor; the PyTorch path's do (the check works)."""
    n, k = 20, 200
    x, w, t = _problem(10, n=n, k=k, d=16)
    loss = build_loss(LOSSES["arcface"])
    assert (n, k) in _recorded_shapes(fused_loss_and_grads, x, w, t, loss)
    shapes = _recorded_shapes(triton_fused_loss_and_grads, x, w, t, loss)
    assert (n, k) not in shapes and (k, n) not in shapes


def test_empty_batch():
    loss = build_loss(LOSSES["arcface"])
    x, w, t = _problem(7, n=0)
    total, gx, gw = triton_fused_loss_and_grads(x, w, t, loss)
    assert total.item() == 0.0 and gx.shape == (0, D)
    assert torch.equal(gw, torch.zeros(K, D))


def test_rejects_float64_and_bad_gw():
    loss = build_loss(LOSSES["softmax"])
    x, w, t = _problem(8)
    with pytest.raises(ValueError, match="float64"):
        triton_fused_loss_and_grads(x.double(), w.double(), t, loss)
    with pytest.raises(ValueError, match="gw must be"):
        triton_fused_loss_and_grads(x, w, t, loss, gw=torch.zeros(K, D + 1))


def test_backend_switch(monkeypatch):
    x, w, _ = _problem(9)
    assert resolve_softmax("torch", x, w) is None
    assert resolve_softmax("auto", x, w) is None  # CPU tensors keep the PyTorch path
    assert resolve_softmax("triton", x, w) is triton_fused_loss_and_grads  # the interpreter is on
    with pytest.raises(ValueError, match="softmax_backend.*float64"):
        resolve_softmax("triton", x.double(), w.double())
    with pytest.raises(ValueError, match="softmax_backend: got 'cuda'"):
        resolve_softmax("cuda", x, w)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="softmax_backend = 'triton' cannot run: tensors are on cpu"):
        resolve_softmax("triton", x, w)
    with pytest.raises(cfg.ConfigError, match="softmax_backend: got 'fast'"):
        ClassParallelHead(D, 11, softmax_backend="fast")
    with pytest.raises(cfg.ConfigError, match="softmax_backend"):
        cfg.validate_section(cfg.HeadConfig, {"num_classes": 11, "embedding_dim": D, "softmax_backend": "fast"},
                             cfg.HEAD_SECTION)


def test_backend_when_triton_does_not_import(monkeypatch):
    """A failed import (remembered by the loader) makes 'triton' an error naming the key."""
    import ds_xc.head.softmax_backend as sb
    monkeypatch.setattr(sb, "_STATE", {"fn": None, "error": "ImportError: no module named 'triton'"})
    x, w, _ = _problem(9)
    assert sb.load_triton_softmax() is None
    with pytest.raises(ValueError, match="softmax_backend = 'triton' cannot run: triton does not import"):
        resolve_softmax("triton", x, w)
    assert resolve_softmax("auto", x, w) is None


@pytest.mark.parametrize("name", ["softmax", "arcface"])
def test_head_backends_agree(name):
    """ClassParallelHead from a config: the triton backend's loss and autograd gradients ==
    the torch backend's (one process, chunked torch path)."""
    out = {}
    for backend in ("torch", "triton"):
        head = ClassParallelHead.from_config({"num_classes": 45, "embedding_dim": 16, "loss": LOSSES[name],
                                              "chunk_size": 7, "init_std": 0.5, "seed": 3,
                                              "softmax_backend": backend})
        g = torch.Generator().manual_seed(11)
        x = torch.randn(19, 16, generator=g).requires_grad_()
        y = torch.randint(0, 45, (19,), generator=g)
        loss = head(x, y)
        loss.backward()
        out[backend] = (loss.item(), x.grad, head.weight.grad)
    assert out["triton"][0] == pytest.approx(out["torch"][0], rel=1e-5)
    torch.testing.assert_close(out["triton"][1], out["torch"][1], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(out["triton"][2], out["torch"][2], rtol=1e-4, atol=1e-6)


def test_overlap_schedule_with_triton_backend():
    """ChunkedHeadSchedule (micro-chunks accumulating into one unfinished gw) on the triton
    backend == the head on the torch backend."""
    from ds_xc.overlap import ChunkedHeadSchedule
    heads = [ClassParallelHead(16, 30, loss=LOSSES["cosface"], seed=2, init_std=0.5, softmax_backend=b)
             for b in ("torch", "triton")]
    g = torch.Generator().manual_seed(12)
    x, y = torch.randn(17, 16, generator=g), torch.randint(0, 30, (17,), generator=g)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    ref = heads[0](xs[0], y)
    ref.backward()
    loss = ChunkedHeadSchedule(heads[1], 3).run(xs[1], y)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(heads[1].weight.grad, heads[0].weight.grad, rtol=1e-4, atol=1e-6)


C_DIST, D_DIST, SEED = 23, 16, 5  # 23 classes: shards of 12 and 11


def _batch(rank, size):
    g = torch.Generator().manual_seed(SEED * 100 + rank)
    return torch.randn(size, D_DIST, generator=g), torch.randint(0, C_DIST, (size,), generator=g)


def _run_triton_head(rank, world, loss, sizes):
    head = ClassParallelHead(D_DIST, C_DIST, loss=loss, chunk_size=0, init_std=0.5, seed=SEED,
                             softmax_backend="triton")
    x, y = _batch(rank, sizes[rank])
    x.requires_grad_()
    out = head(x, y)
    out.backward()
    return {"loss": out.item(), "gx": x.grad, "gw": head.weight.grad, "start": head.class_start}


@pytest.mark.parametrize("name", ["combined", "dsoftmax"])
def test_two_ranks_match_float64_reference(pools, name):
    """Classes sharded 12 / 11 over 2 gloo ranks, triton kernels with the class-parallel
    all-reduces == the single-process float64 reference over all 23 classes."""
    sizes = [9, 9]
    results = pools(2).run(_run_triton_head, LOSSES[name], sizes)
    x = torch.cat([_batch(r, b)[0] for r, b in enumerate(sizes)])
    y = torch.cat([_batch(r, b)[1] for r, b in enumerate(sizes)])
    w = init_shard(C_DIST, D_DIST, 0, C_DIST, 0.5, SEED, torch.float32)
    ref_loss, ref_gx, ref_gw = reference(x, w, y, LOSSES[name])
    n = sum(sizes)
    for rank, res in enumerate(results):
        start, num_local = shard_range(C_DIST, 2, rank)
        assert res["start"] == start
        assert res["loss"] == pytest.approx(ref_loss.item(), rel=2e-6)
        b0 = sum(sizes[:rank])  # local-mean convention: d(local mean)/dx_r = (N / B_r) d(global mean)/dx_r
        want_gx = ref_gx[b0: b0 + sizes[rank]] * (n / sizes[rank])
        torch.testing.assert_close(res["gx"].double(), want_gx, rtol=2e-5, atol=2e-5 * want_gx.abs().max().item())
        want_gw = ref_gw[start: start + num_local]
        torch.testing.assert_close(res["gw"].double(), want_gw, rtol=2e-5, atol=2e-5 * want_gw.abs().max().item())


def test_auto_takes_triton_for_16_bit_cuda_weights_only():
    """auto follows the H200 measurements (docs/ops.md): the kernels for bf16/fp16 weights on CUDA,
    the PyTorch path for float32 weights (fp32 FMA tiles, 4x slower there) and on the CPU."""
    from types import SimpleNamespace

    def on_cuda(dtype):
        return SimpleNamespace(dtype=dtype, device=torch.device("cuda", 0))

    for x_dtype, w_dtype in ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)):
        fused = resolve_softmax("auto", on_cuda(x_dtype), on_cuda(w_dtype))
        assert fused.__wrapped__ is triton_fused_loss_and_grads  # behind the launch-failure fallback
    assert resolve_softmax("auto", on_cuda(torch.float32), on_cuda(torch.float32)) is None
    assert resolve_softmax("auto", on_cuda(torch.bfloat16), on_cuda(torch.float32)) is None


def test_fp32_rows_with_bf16_weights_are_cast_first_as_the_pytorch_path():
    """The head passes fp32 embeddings with bf16 weights: the kernels take x in the weights' dtype
    (one 16-bit tile type, tensor cores on a GPU), as fused_loss_and_grads does (x.to(w.dtype))."""
    from ds_xc.head.softmax import fused_loss_and_grads
    loss = build_loss(LOSSES["arcface"])
    x, w, t = _problem(10)
    wb = w.to(torch.bfloat16)
    mixed = triton_fused_loss_and_grads(x.float(), wb, t, loss)
    cast = triton_fused_loss_and_grads(x.float().to(torch.bfloat16), wb, t, loss)
    for a, b in zip(mixed, cast):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    ref = fused_loss_and_grads(x.float(), wb, t, loss)
    for a, b in zip(mixed, ref):
        _close(a, b.double(), 2e-2)


def test_auto_falls_back_when_the_kernels_cannot_launch(monkeypatch, caplog):
    """A GPU with less shared memory than the tiles need: Triton raises OutOfResources at launch.
    'auto' then runs the PyTorch path (the same result as 'torch') and stays there; 'triton' raises."""
    import logging
    from types import SimpleNamespace
    import ds_xc.head.softmax_backend as sb
    from ds_xc.head.softmax import fused_loss_and_grads

    class OutOfResources(Exception):  # what triton.runtime.errors raises, by name
        pass

    calls = []

    def no_launch(*args, **kwargs):
        calls.append(1)
        raise OutOfResources("out of resource: shared memory, Required: 262144, Hardware limit: 101376")

    monkeypatch.setattr(sb, "_STATE", {"fn": no_launch, "error": None})
    monkeypatch.setattr(sb, "interpreting", lambda: True)
    loss = build_loss(LOSSES["arcface"])
    x, w, t = _problem(11)
    wb = w.to(torch.bfloat16)
    cuda_like = SimpleNamespace(dtype=torch.bfloat16, device=torch.device("cuda", 0))
    fn = sb.resolve_softmax("auto", cuda_like, cuda_like)  # what fused_loss_and_grads gets on a GPU
    monkeypatch.setattr(sb, "resolve_softmax", lambda backend, x_, w_: fn if backend == "auto" else no_launch)
    with caplog.at_level(logging.WARNING):
        got = fused_loss_and_grads(x, wb, t, loss, backend="auto")
    want = fused_loss_and_grads(x, wb, t, loss, backend="torch")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert calls == [1] and "auto_off" in sb._STATE
    assert any("cannot launch" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()
    monkeypatch.setattr(sb, "_STATE", {"fn": no_launch, "error": None, "auto_off": "OutOfResources"})
    monkeypatch.setattr(sb, "interpreting", lambda: True)
    assert sb.resolve_softmax("auto", cuda_like, cuda_like) is None  # later calls: the PyTorch path
    assert sb.resolve_softmax("triton", cuda_like, cuda_like) is no_launch  # explicit: the error itself

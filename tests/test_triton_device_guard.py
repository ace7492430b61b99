"""Every Triton launch runs on its tensors' GPU, whatever the current device.

Triton launches on the current CUDA device (and its current stream), not on the device of the
tensors it is given; the CUDA Hamming op guards its launch (``torch.cuda.device``), the Triton ones did
not: with tensors on cuda:k and another current device (a rank that did not bind, a library that
switched devices) they ran on the wrong GPU. Checked here:

* on the syntax tree: every launch ``kernel[grid](...)`` of ds_xc/ and ops/ sits inside a
  ``with device_guard(...)`` (or ``torch.cuda.device(...)``) block;
* ``device_guard`` makes a CUDA tensor's device current and is a no-op for CPU tensors (the
  interpreter's; the interpreted kernels' tests run through it);
* with two GPUs, each kernel gives the same result with its tensors on cuda:1 and cuda:0 current as on
  cuda:0 (skipped with fewer GPUs).
"""
import ast
import contextlib
from pathlib import Path

import pytest
import torch

from ds_xc_ops.triton_util import device_guard

ROOT = Path(__file__).resolve().parents[1]
GUARDS = {"device_guard", "device"}  # device_guard(t), torch.cuda.device(d)


def _launches(tree: ast.AST):
    """(lineno, kernel name) of each ``name[grid](...)`` call."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) and \
                isinstance(node.func.value, ast.Name) and node.func.value.id.endswith("kernel"):
            yield node.lineno, node.func.value.id


def _guarded_lines(tree: ast.AST) -> set:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.With):
            for item in node.items:
                call = item.context_expr
                if not isinstance(call, ast.Call):
                    continue
                name = getattr(call.func, "attr", getattr(call.func, "id", None))
                if name in GUARDS:
                    lines.update(range(node.lineno, node.end_lineno + 1))
    return lines


def test_every_triton_launch_is_guarded():
    found, unguarded = [], []
    for path in sorted(list((ROOT / "ops").rglob("*.py")) + list((ROOT / "ds_xc").rglob("*.py"))):
        tree = ast.parse(path.read_text())
        guarded = _guarded_lines(tree)
        for line, name in _launches(tree):
            found.append(name)
            if line not in guarded:
                unguarded.append(f"{path.relative_to(ROOT)}:{line} {name}")
    assert len(found) >= 5, found  # the Hamming scan, the selection's two, the softmax's two
    assert not unguarded, "Triton launches without a device guard:\n" + "\n".join(unguarded)


def test_device_guard_makes_a_cuda_tensors_device_current(monkeypatch):
    entered = []

    @contextlib.contextmanager
    def recording(device):
        entered.append(torch.device(device))
        yield

    monkeypatch.setattr(torch.cuda, "device", recording)

    class OnGpu:  # a CUDA tensor's device, on a machine without one
        device = torch.device("cuda", 3)
    with device_guard(OnGpu()):
        pass
    with device_guard(torch.zeros(2)):  # the interpreter's CPU tensors: no guard
        pass
    assert entered == [torch.device("cuda", 3)]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_kernels_run_on_their_tensors_gpu():
    from ds_xc.head.margins import build_loss
    from ds_xc.head.triton_softmax import triton_fused_loss_and_grads
    from ds_xc_ops.hamming import hamming_topk_ivf
    from ds_xc_ops.triton_select import select_above
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 32, generator=gen), torch.randn(300, 32, generator=gen)
    t = torch.randint(0, 300, (64,), generator=gen)
    q = torch.randint(0, 256, (8, 32), dtype=torch.uint8, generator=gen)
    codes = torch.randint(0, 256, (100, 32), dtype=torch.uint8, generator=gen)
    v = torch.randn(5000, generator=gen)

    def run(dev):
        loss, gx, gw = triton_fused_loss_and_grads(x.to(dev), w.to(dev), t.to(dev), build_loss({"type": "arcface"}))
        dist, ids = hamming_topk_ivf(q.to(dev), codes.to(dev), torch.arange(100, device=dev),
                                     torch.tensor([0, 40, 100], device=dev), torch.tensor([[0, 1]] * 8, device=dev),
                                     10, backend="triton")
        idx, val = select_above(v.to(dev), 1.5, backend="triton")
        return [a.cpu() for a in (loss, gx, gw, dist, ids, idx, val)]
    torch.cuda.set_device(0)
    want = run("cuda:0")
    got = run("cuda:1")  # cuda:0 is current
    for a, b in zip(want, got):
        assert torch.equal(a, b)

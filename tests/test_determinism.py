"""Deterministic index builds and weight gradients, where torch allows.

On the GPU, float accumulation through atomics (``index_add_``, ``scatter_add_``, ``scatter_reduce``,
``index_reduce``, ``put_`` with accumulate) sums in whatever order the threads run: two runs of the same
step differ in the last bits, and the k-means of the ANN index can then assign a row differently. On
the CPU those ops run serially, so CUDA's nondeterminism cannot be seen there; CudaAtomics below
records the aten ops of a computation on CPU tensors and names the ones that would use atomics on a
GPU (``index_put_`` with accumulate=True is the deterministic alternative: CUDA sorts the indices and
sums each run in order; on a CPU it is index_add_ that is serial, and index_put_'s accumulation uses
parallel atomics, so ds_xc_ops.accumulate.add_rows_ picks by device: the recordings below run with the
GPU's pick, the bitwise repeats with the CPU's).

* the ANN sampler's index build (spherical k-means, codes, lists) uses none of them (the k-means
  update used ``index_add_``), on 1 process and on 2 and 3 gloo ranks;
* two runs give bitwise equal centroids, and bitwise equal losses and weight gradients of an ANN head
  step on 2 and 3 ranks (CPU), and, on a GPU, of the k-means under
  ``torch.use_deterministic_algorithms(True)`` (which raises on an op without a deterministic CUDA
  kernel);
* the head's whole training step (every sampler, loss and update mode: forward, backward, optimizer
  step) adds floats through no atomics at repeated indices: the fused softmax sums the target terms of
  rows sharing a class with ``index_put_(accumulate=True)`` (it used ``index_add_``), the gathered active
  rows are distinct (an ``index_add_`` over distinct rows has nothing to race: ConflictingAtomics below);
  two runs give bitwise equal weight gradients, and on a GPU two runs of a step with repeated targets do;
* where torch does not allow it: ``torch.bincount``
  of integer ids (deterministic: integer atomics commute) is allowed; cuBLAS GEMMs are deterministic for
  the same shapes, GPU and stream, not across GPU models; Triton's tiles add in a fixed order.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ds_xc import ClassParallelHead
from ds_xc.sampling.ann.ivf import spherical_kmeans

ATOMIC_OPS = {"index_add", "index_add_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_",
              "index_reduce", "index_reduce_"}
ANN = {"type": "ann", "sample_rate": 0.3, "code_bits": 32, "nlist": 6, "nprobe": 2, "top_k": 4,
       "rebuild_interval": 2, "backend": "torch"}


class CudaAtomics(TorchDispatchMode):
    """Records the aten ops of a computation that accumulate floats through atomics on a GPU."""

    def __init__(self):
        super().__init__()
        self.found: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        atomic = name in ATOMIC_OPS or name in ("put", "put_") and kwargs.get(
            "accumulate", len(args) > 3 and bool(args[3]))
        if atomic and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
            self.found.append(f"{name} on {args[0].dtype} {tuple(args[0].shape)}")
        return func(*args, **kwargs)


class ConflictingAtomics(CudaAtomics):
    """Only the atomic adds whose indices repeat: what makes a GPU's sums depend on the threads' order."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("index_add", "index_add_") and isinstance(args[2], torch.Tensor) and \
                torch.unique(args[2]).numel() == args[2].numel():
            return func(*args, **(kwargs or {}))  # distinct rows: each added once, no race
        return super().__torch_dispatch__(func, types, args, kwargs)


def _points(n=6000, d=16, seed=0):
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(seed))
    return torch.nn.functional.normalize(x, dim=1)


def test_the_recorder_finds_atomics():  # it must be able to fail
    x, a = torch.randn(10, 3), torch.tensor([0, 1, 0, 1, 0, 1, 0, 1, 0, 1])
    with CudaAtomics() as rec:
        torch.zeros(2, 3).index_add_(0, a, x)
        torch.zeros(2, 3).index_put_((a,), x, accumulate=True)  # the deterministic alternative
        torch.zeros(2, 3).scatter_add_(0, a[:, None].expand(10, 3), x)
    assert [f.split(" ")[0] for f in rec.found] == ["index_add_", "scatter_add_"]


def test_kmeans_uses_no_atomics_and_repeats_bitwise(monkeypatch):
    from ds_xc_ops import accumulate
    x = _points()
    first = spherical_kmeans(x, 32, iterations=5, seed=3)
    assert torch.equal(first, spherical_kmeans(x, 32, iterations=5, seed=3))  # the CPU's serial sums
    monkeypatch.setattr(accumulate, "SORTED_DEVICES", accumulate.SORTED_DEVICES + ("cpu",))
    with CudaAtomics() as rec:
        spherical_kmeans(x, 32, iterations=5, seed=3)  # the ops a GPU runs
    assert rec.found == []


def test_add_rows_picks_the_deterministic_op_per_device():
    from ds_xc_ops.accumulate import add_rows_
    g = torch.Generator().manual_seed(0)
    x, a = torch.randn(20000, 64, generator=g), torch.randint(0, 5, (20000,), generator=g)
    runs = [add_rows_(torch.zeros(5, 64), a, x) for _ in range(5)]  # two threads and more: still equal
    assert all(torch.equal(r, runs[0]) for r in runs)
    torch.testing.assert_close(runs[0], torch.zeros(5, 64, dtype=torch.float64).index_add_(0, a, x.double()).float(),
                               rtol=1e-4, atol=1e-3)  # 4,000 float32 terms a row
    with CudaAtomics() as rec:
        add_rows_(torch.zeros(5, 64, device="meta"), a.to("meta"), x.to("meta"))  # a GPU's choice
    assert rec.found == []


def _index_and_step(rank, world):
    """(atomics found in the ANN index build as a GPU runs it, loss, weight gradient) of one ANN head step."""
    from ds_xc_ops import accumulate
    head = ClassParallelHead(16, 203, loss="cosface", sampler=ANN, seed=4, update="dense")
    sorted_devices, accumulate.SORTED_DEVICES = accumulate.SORTED_DEVICES, accumulate.SORTED_DEVICES + ("cpu",)
    try:
        with CudaAtomics() as rec:
            head.rebuild_index()
    finally:
        accumulate.SORTED_DEVICES = sorted_devices
    head.rebuild_index()  # the index the step uses: built with the CPU's serial sums
    g = torch.Generator().manual_seed(10 + rank)
    x, y = torch.randn(7 + rank, 16, generator=g), torch.randint(0, 203, (7 + rank,), generator=g)
    loss = head(x, y)
    loss.backward()
    return rec.found, loss.item(), head.weight.grad.clone()


@pytest.mark.parametrize("world", [2, 3])
def test_ann_index_build_and_step_are_deterministic_on_ranks(pools, world):
    first, again = pools(world).run(_index_and_step), pools(world).run(_index_and_step)
    for (found, loss, grad), (_, loss2, grad2) in zip(first, again):
        assert found == []
        assert loss == loss2 and torch.equal(grad, grad2)


HEAD_SAMPLERS = {"full": {"type": "full"}, "uniform": {"type": "uniform", "sample_rate": 0.3},
                 "knn": {"type": "knn", "sample_rate": 0.3, "neighbors": 4}, "ann": ANN}


def _head_step(sampler, loss, update, device="cpu", seed=0):
    from ds_xc.head import build_head_optimizer
    head = ClassParallelHead(16, 203, loss=loss, sampler=HEAD_SAMPLERS[sampler], seed=4, update=update, device=device)
    opt = build_head_optimizer(head, {"type": "sgd", "lr": 0.1, "momentum": 0.9})
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(40, 16, generator=g).to(device).requires_grad_()
    y = torch.randint(0, 30, (40,), generator=g).to(device)  # 40 rows over 30 classes: repeated targets
    loss_value = head(x, y)
    loss_value.backward()
    grad = head.weight.grad.to_dense().clone() if head.weight.grad.is_sparse else head.weight.grad.clone()
    opt.step()
    return loss_value.detach(), grad, x.grad.clone(), head.weight.detach().clone()


@pytest.mark.parametrize("sampler", list(HEAD_SAMPLERS))
@pytest.mark.parametrize("loss", ["softmax", "arcface"])
@pytest.mark.parametrize("update", ["auto", "lazy", "dense"])
def test_the_head_step_adds_through_no_conflicting_atomics(sampler, loss, update, monkeypatch):
    first = _head_step(sampler, loss, update)
    for a, b in zip(first, _head_step(sampler, loss, update)):  # bitwise, with the CPU's serial sums
        assert torch.equal(a, b)
    from ds_xc_ops import accumulate
    monkeypatch.setattr(accumulate, "SORTED_DEVICES", accumulate.SORTED_DEVICES + ("cpu",))
    with ConflictingAtomics() as rec:  # the ops a GPU runs
        _head_step(sampler, loss, update)
    assert rec.found == [], rec.found


def test_the_conflict_recorder_can_fail():
    with ConflictingAtomics() as rec:
        torch.zeros(3, 2).index_add_(0, torch.tensor([0, 2]), torch.ones(2, 2))  # distinct: no race
        torch.zeros(3, 2).index_add_(0, torch.tensor([1, 1]), torch.ones(2, 2))  # repeated: a race on a GPU
    assert [f.split(" ")[0] for f in rec.found] == ["index_add_"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("sampler", list(HEAD_SAMPLERS))
def test_the_head_step_on_a_gpu_repeats_bitwise(sampler):
    runs = [_head_step(sampler, "arcface", "auto", device="cuda") for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kmeans_on_a_gpu_is_deterministic():
    x = _points(200_000, 64).cuda()  # 64 rows per centroid on average: many repeated targets
    torch.use_deterministic_algorithms(True)
    try:
        runs = [spherical_kmeans(x, 4096, iterations=4, seed=1) for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(runs[0], runs[1])

"""Shared fixtures: spawned gloo pools of 2 and 3 ranks, created once per session."""
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


# Triton reads TRITON_INTERPRET when it is imported and when kernels are decorated: set it before
# any test module imports triton (a module-level importorskip would do), so that on a machine
# without CUDA every Triton kernel of the session runs in the CPU interpreter. The tests that
# compile for a GPU target run in subprocesses without it.
if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.dist_pool import DistPool, close_all  # noqa: E402

_POOLS: dict = {}


def get_pool(world_size: int) -> DistPool:
    if world_size not in _POOLS:
        _POOLS[world_size] = DistPool(world_size)
    return _POOLS[world_size]


# A pool's workers keep every process group the tests created on them, with its gloo threads; their
# event loops wake up while idle (about 2% of a core per rank with 20 groups, measured). After a few
# hundred tests each rank of a long-lived pool had 240 threads and several idle pools kept the load
# average near 30 on 2 cores, slowing every other test up to tenfold. A pool past this many threads is
# closed after the test that crossed it, and the next test that asks for one gets a fresh one.
POOL_THREAD_LIMIT = 64


@pytest.fixture(autouse=True)
def _recycle_crowded_pools():
    yield
    for size, pool in list(_POOLS.items()):
        if pool.threads() > POOL_THREAD_LIMIT:
            pool.close()
            del _POOLS[size]


@pytest.fixture(scope="session")
def pools():
    """Call with a world size: ``pools(2)`` returns a running 2-rank pool."""
    yield get_pool
    close_all(list(_POOLS.values()))
    _POOLS.clear()


def pytest_sessionstart(session):
    """Build (or load from the torch extensions cache) the C++ ops once, before any test: the first
    lazy head step, Hamming scan or compressed selection would otherwise compile them inside a timed
    distributed test.
    Concurrent sessions (xdist workers) wait for the one building (ds_xc_ops.build_cache.exclusive_build);
    a failed build only logs (the tests of ds_xc_ops then fail where they need the op)."""
    from ds_xc_ops import builders
    for kind in ("cpu", "rows", "select"):
        builders.load_op(kind)

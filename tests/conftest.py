"""Shared fixtures: spawned gloo pools of 2 and 3 ranks, created once per session."""
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests.dist_pool import DistPool  # noqa: E402

_POOLS: dict = {}


def get_pool(world_size: int) -> DistPool:
    if world_size not in _POOLS:
        _POOLS[world_size] = DistPool(world_size)
    return _POOLS[world_size]


@pytest.fixture(scope="session")
def pools():
    """Call with a world size: ``pools(2)`` returns a running 2-rank pool."""
    yield get_pool
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()

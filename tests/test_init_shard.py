"""The head's initial weights (ds_xc/head/partition.py: init_shard), drawn by several threads.

The values are today's bit for bit (a copy of the serial implementation below is the reference), a
pure function of (seed, class id): the same on 1, 2 and 3 ranks (uneven shards crossing the 65,536-row
generator blocks), for any number of threads and any dtype; the blocks are drawn by torch's intra-op
thread count of threads (a 10^7 x 512 head is 5*10^9 normals: ~53 s on one core, a few seconds on a
16-core GPU host).
"""
import threading

import pytest
import torch

import ds_xc
from ds_xc.head import init_shard, shard_range

BLOCK = 1 << 16
C, D = 2 * BLOCK + 7, 4


def serial_reference(num_classes, dim, start, count, std, seed, dtype=torch.float32):
    """init_shard as it was before issue 56: one generator, one block after the other."""
    out = torch.empty((count, dim), dtype=dtype)
    first, last = start // BLOCK, (start + count - 1) // BLOCK if count else -1
    gen = torch.Generator(device="cpu")
    for b in range(first, last + 1):
        b0 = b * BLOCK
        rows = min(BLOCK, num_classes - b0)
        gen.manual_seed((int(seed) * 1_000_003 + b) % (2**63))
        block = torch.randn((rows, dim), generator=gen, dtype=torch.float32).mul_(std)
        lo, hi = max(start, b0), min(start + count, b0 + rows)
        out[lo - start: hi - start] = block[lo - b0: hi - b0].to(dtype)
    return out


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_are_todays_for_any_thread_count(workers, dtype):
    for start, count in ((0, C), (5, BLOCK), (BLOCK - 3, 10), (BLOCK + 1, BLOCK + 6), (C - 1, 1), (7, 0)):
        got = init_shard(C, D, start, count, 0.02, 9, dtype, workers=workers)
        assert torch.equal(got, serial_reference(C, D, start, count, 0.02, 9, dtype)), (start, count)


def test_blocks_are_drawn_by_several_threads(monkeypatch):
    seen, randn = set(), torch.randn

    def recording(*args, **kwargs):
        seen.add(threading.get_ident())
        return randn(*args, **kwargs)
    monkeypatch.setattr(torch, "randn", recording)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        init_shard(C, D, 0, C, 0.02, 9)  # 3 blocks, 3 threads allowed
    finally:
        torch.set_num_threads(threads)
    assert len(seen) == 3


def _shard(rank, world):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # two drawing threads per rank
    try:
        head = ds_xc.ClassParallelHead(D, C, init_std=0.02, seed=9, dtype="bfloat16")
    finally:
        torch.set_num_threads(threads)
    return head.class_start, head.weight.detach()


@pytest.mark.parametrize("world", [2, 3])
def test_the_same_rows_on_every_world_size(pools, world):
    whole = serial_reference(C, D, 0, C, 0.02, 9, torch.bfloat16)
    for rank, (start, weight) in enumerate(pools(world).run(_shard)):
        want_start, count = shard_range(C, world, rank)
        assert start == want_start and torch.equal(weight, whole[start: start + count])

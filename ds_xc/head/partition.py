"""How classes are split over ranks: contiguous ranges, Partial FC's balanced rule, and the
per-class initial weights that do not depend on the split.

``num_local(r) = C // P + (r < C % P)``; rank r owns ``[start(r), start(r) + num_local(r))``.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch

__all__ = ["shard_range", "shard_sizes", "owner_of", "init_shard", "shard_topk"]

_INIT_BLOCK = 1 << 16  # rows per init block: the init of a class does not depend on the world size
TOPK_BLOCK = 1 << 14  # classes scored at once by shard_topk: a (rows, block) score tile stays in cache


def shard_sizes(num_classes: int, world_size: int) -> list[int]:
    """Number of classes on each rank, in rank order."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if num_classes < world_size:
        raise ValueError(f"num_classes={num_classes} must be >= the number of ranks ({world_size}): "
                         "every rank needs at least one class")
    base, extra = divmod(num_classes, world_size)
    return [base + (r < extra) for r in range(world_size)]


def shard_range(num_classes: int, world_size: int, rank: int) -> tuple[int, int]:
    """(class_start, num_local) of ``rank``."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, {world_size})")
    base, extra = divmod(num_classes, world_size)
    sizes = shard_sizes(num_classes, world_size)
    start = rank * base + min(rank, extra)
    return start, sizes[rank]


def owner_of(label: int, num_classes: int, world_size: int) -> int:
    """The rank whose shard holds class ``label``."""
    base, extra = divmod(num_classes, world_size)
    big = extra * (base + 1)  # classes held by the first `extra` ranks
    return label // (base + 1) if label < big else extra + (label - big) // base


def init_shard(num_classes: int, dim: int, start: int, count: int, std: float, seed: int,
               dtype=torch.float32, device=None, workers: Optional[int] = None) -> torch.Tensor:
    """Rows [start, start+count) of a N(0, std^2) matrix that is a pure function of (seed, row).

    Generated in fixed blocks of global rows, each from its own CPU generator seeded by (seed, block),
    so every world size (and a resharded checkpoint) sees the same initial weights for the same class,
    on every device. The blocks are independent: ``workers`` threads (default: torch's intra-op thread
    count, at most the blocks and 32) draw them at once, each block cast to ``dtype`` and copied into
    the shard on ``device`` as soon as it is drawn, so at most one float32 block per thread is on the
    host. A 10^7 x 512 shard is 5*10^9 normals: ~53 s on one core (~96 M/s measured on this CI
    machine), a few seconds on a 16-core GPU host.
    """
    out = torch.empty((count, dim), dtype=dtype, device=device)
    first, last = start // _INIT_BLOCK, (start + count - 1) // _INIT_BLOCK if count else -1

    def fill(b: int) -> None:
        b0 = b * _INIT_BLOCK
        rows = min(_INIT_BLOCK, num_classes - b0)
        gen = torch.Generator(device="cpu").manual_seed((int(seed) * 1_000_003 + b) % (2**63))
        block = torch.randn((rows, dim), generator=gen, dtype=torch.float32).mul_(std)  # (rows, d): all of it,
        lo, hi = max(start, b0), min(start + count, b0 + rows)  # since the last draws depend on the size
        out[lo - start: hi - start] = block[lo - b0: hi - b0].to(dtype)

    blocks = range(first, last + 1)
    workers = min(len(blocks), 32, workers if workers is not None else torch.get_num_threads())
    if workers <= 1:
        for b in blocks:
            fill(b)
    else:  # torch releases the GIL while it draws: the threads run in parallel
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ds_xc_init") as pool:
            for done in pool.map(fill, blocks):
                del done
    return out


def shard_topk(x: torch.Tensor, w: torch.Tensor, k: int, block: int = TOPK_BLOCK) -> tuple:
    """(values (n, k) float32, local ids (n, k)) of the k best rows of ``w`` (L, d) for each row of
    ``x`` (n, d), by x.w; k <= L. The shard is scored ``block`` classes at a time and the running
    best merged, rather than as one (n, L) score matrix: at 10^6 classes a chunk of 128 rows wrote
    a 512 MB matrix, and the blocked scan took a third less time on a CPU core."""
    best_v = best_i = None
    for s in range(0, w.shape[0], block):
        v, i = torch.topk((x @ w[s: s + block].t()).float(), min(k, block, w.shape[0] - s), dim=1)
        if best_v is not None:  # merge with the best so far: (n, k + kb) -> (n, k)
            v, i = torch.cat([best_v, v], dim=1), torch.cat([best_i, i + s], dim=1)
            v, j = torch.topk(v, min(k, v.shape[1]), dim=1)
            i = i.gather(1, j)
        best_v, best_i = v, i
    return best_v, best_i

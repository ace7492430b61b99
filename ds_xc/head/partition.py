"""How classes are split over ranks: contiguous ranges, Partial FC's balanced rule.

``num_local(r) = C // P + (r < C % P)``; rank r owns ``[start(r), start(r) + num_local(r))``.
"""
from __future__ import annotations

__all__ = ["shard_range", "shard_sizes", "owner_of"]


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

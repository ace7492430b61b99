"""Cost models of a ds_xc job from its config: per-rank memory (memory.py), communication (comm.py),
compute time of the head's step (compute.py), the gradient reduction dense vs compressed
(compression.py: when compression pays; compression_step.py: for the whole step); launch/tune.py
prunes its search space with them (docs/tuning.md)."""
from ds_xc.cost.memory import MemoryEstimate, estimate_memory, process_memory

__all__ = ["MemoryEstimate", "estimate_memory", "process_memory"]

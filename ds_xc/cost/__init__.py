"""Cost models of a ds_xc job from its config: per-rank memory (memory.py), communication (comm.py)."""
from ds_xc.cost.memory import MemoryEstimate, estimate_memory, process_memory

__all__ = ["MemoryEstimate", "estimate_memory", "process_memory"]

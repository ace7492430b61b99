"""Process groups and autograd-aware collectives (explicit groups, no global state)."""
from ds_xc.parallel.groups import group_rank, group_size, is_distributed
from ds_xc.parallel.collectives import all_gather_rows, all_gather_no_grad

__all__ = ["group_rank", "group_size", "is_distributed", "all_gather_rows", "all_gather_no_grad"]

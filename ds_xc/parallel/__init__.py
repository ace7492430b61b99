"""Process groups, autograd-aware collectives and cross-rank agreement (explicit groups, no global state)."""
from ds_xc.parallel.groups import group_rank, group_size, is_distributed
from ds_xc.parallel.collectives import all_gather_rows, all_gather_no_grad
from ds_xc.parallel.agree import DisagreementError, agree, agree_outcome, all_or_none
from ds_xc.parallel.device import DeviceBindingError, bind_device, check_bound

__all__ = ["group_rank", "group_size", "is_distributed", "all_gather_rows", "all_gather_no_grad", "agree",
           "agree_outcome", "all_or_none", "DisagreementError", "bind_device", "check_bound", "DeviceBindingError"]

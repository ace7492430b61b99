"""ds_xc: extreme classification on DeepSpeed.

Public API: :class:`ClassParallelHead`, :func:`parse_config`, :class:`ConfigError`,
:func:`initialize` (DeepSpeed engine + head + head optimizer from one config),
:func:`build_head_optimizer`, :class:`CompressedOptimizer` (compressed data-parallel
gradient reduction, see docs/compression.md), :class:`CompressedDDPHook` and
:func:`compressed_ddp_hook` (the same reduction as a DDP communication hook, docs/engines.md),
:func:`bind_device` (this rank's GPU made current from the launcher's local rank, before the first
collective: for users who start torch.distributed themselves; docs/multinode.md).
"""
from ds_xc.config import ConfigError, parse_config
from ds_xc.head import ClassParallelHead, build_head_optimizer
from ds_xc.compression import CompressedDDPHook, CompressedOptimizer, compressed_ddp_hook
from ds_xc.parallel.device import bind_device

__version__ = "0.1.0"


def initialize(*args, **kwargs):
    """Build the DeepSpeed engine, the head and its optimizer from one config (see ds_xc.engine)."""
    from ds_xc.engine import initialize as _initialize  # imports deepspeed only when used
    return _initialize(*args, **kwargs)


__all__ = ["ClassParallelHead", "ConfigError", "parse_config", "initialize", "build_head_optimizer",
           "CompressedOptimizer", "CompressedDDPHook", "compressed_ddp_hook", "bind_device", "__version__"]

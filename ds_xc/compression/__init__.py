"""Compressed data-parallel gradient reduction: Bayes-prior sampling, top-k, random-k, error feedback.

``CompressedOptimizer(optimizer, config=section, group=None)`` wraps a torch optimizer;
``attach_to_engine(engine, section)`` makes it take over a DeepSpeed engine's gradient
reduction (imported lazily: it is the only module here that needs deepspeed);
``CompressedDDPHook`` + ``compressed_ddp_hook`` run it as a DDP communication hook.
See docs/compression.md.
"""
from ds_xc.compression.checkpoint import load_compression_state, save_compression_state
from ds_xc.compression.compressors import COMPRESSORS, Compressor, build_compressor
from ds_xc.compression.ddp_hook import CompressedDDPHook, compressed_ddp_hook
from ds_xc.compression.config import COMPRESSION_SECTION, GradientCompressionConfig, parse_compression
from ds_xc.compression.optimizer import CompressedOptimizer
from ds_xc.compression.transport import NodeGroups, build_node_groups


def attach_to_engine(engine, config, group=None, node_groups=None):
    """Wrap a DeepSpeed engine's optimizer so that it reduces the backbone gradients compressed
    (``node_groups``: the hierarchy's NodeGroups from the detected node layout, or None)."""
    from ds_xc.compression.deepspeed import attach_to_engine as _attach
    return _attach(engine, config, group=group, node_groups=node_groups)


__all__ = ["CompressedOptimizer", "GradientCompressionConfig", "parse_compression", "COMPRESSION_SECTION",
           "COMPRESSORS", "Compressor", "build_compressor", "NodeGroups", "build_node_groups",
           "attach_to_engine", "CompressedDDPHook", "compressed_ddp_hook", "save_compression_state", "load_compression_state"]

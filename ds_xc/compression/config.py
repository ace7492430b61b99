"""Section ``gradient_compression``: re-exported from :mod:`ds_xc.config_compression`.

The models live on the configuration floor, so that ds_xc/config.py can validate the whole
DeepSpeed config without importing the compression package (no import cycle).
"""
from ds_xc.config_compression import (ADAM_WARMUP_STEPS, COMPRESSION_SECTION, ConfigError,  # noqa: F401
                                      GradientCompressionConfig, HierarchyConfig, PowerSGDConfig, PriorConfig,
                                      parse_compression)

__all__ = ["ADAM_WARMUP_STEPS", "COMPRESSION_SECTION", "PriorConfig", "HierarchyConfig", "PowerSGDConfig", "GradientCompressionConfig",
           "parse_compression", "ConfigError"]

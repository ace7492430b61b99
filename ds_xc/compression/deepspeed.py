"""DeepSpeed integration: the compressed optimizer takes over the engine's gradient reduction.

The mechanism of DeepSpeed's former 1-bit optimizers: switch the engine's backward
all-reduce off (``engine.enable_backward_allreduce = False``) and let the optimizer
communicate in ``step()``, which the engine calls once per gradient-accumulation
boundary. So :func:`attach_to_engine` wraps ``engine.optimizer`` (the client optimizer,
or DeepSpeed's bf16 wrapper around it) in a :class:`CompressedOptimizer` that reduces the
gradients of the engine module's parameters. The head lives outside the engine
(ds_xc/engine/) and is untouched.

Gradient accumulation: ``engine.backward`` divides the loss by
``gradient_accumulation_steps`` whether or not the backward all-reduce is on
(DeepSpeed 0.19.8, checked by tests/test_compression_engine.py), so the accumulated
gradient that reaches ``step()`` is already the micro-batch mean.

Supported: ZeRO stage 0 with fp32 or bf16. Refused at start, naming the keys:
* ZeRO 1/2/3: their optimizers reduce (and partition) the gradients inside DeepSpeed
  before any wrapper could see the local ones;
* fp16: dynamic loss scaling would mix scales inside the error-feedback residuals;
* ``gradient_clipping`` > 0 with fp32: DeepSpeed clips fp32 ZeRO-0 gradients *before*
  ``optimizer.step()``, i.e. each rank's local gradient before the (now deferred)
  averaging. With bf16 its wrapper clips inside ``step()``, after our reduction: allowed.
"""
from __future__ import annotations

import logging

from ds_xc.compression.config import COMPRESSION_SECTION, parse_compression
from ds_xc.compression.optimizer import CompressedOptimizer
from ds_xc.config import ConfigError

log = logging.getLogger(__name__)

__all__ = ["attach_to_engine", "check_engine", "check_zero_stage"]


def check_zero_stage(stage: int, method: str) -> None:
    """Raise ConfigError when a wrapper for ``method`` would meet ZeRO stage ``stage`` > 0.

    Called from the raw config before the engine is built (ds_xc.engine.check_supported, where
    method none attaches nothing) and from the built engine (:func:`check_engine`), so both
    give the same message.
    """
    if int(stage) != 0:
        raise ConfigError(f"zero_optimization.stage={stage} with {COMPRESSION_SECTION}.method={method!r}: ZeRO "
                          "stages 1-3 reduce and partition gradients inside DeepSpeed's optimizer, before a "
                          f"compressed reduction could see them; use zero_optimization.stage=0 or "
                          f"{COMPRESSION_SECTION}.method='none'")


def check_engine(engine, method: str) -> None:
    """Raise ConfigError for engine settings the compressed reduction cannot serve correctly."""
    where = f"{COMPRESSION_SECTION}.method={method!r}"
    check_zero_stage(int(engine.zero_optimization_stage()), method)
    if engine.fp16_enabled():
        raise ConfigError(f"fp16.enabled=true with {where}: dynamic loss scaling would mix scales in the "
                          "error-feedback residuals; use bf16.enabled=true or fp32")
    clip = float(engine.gradient_clipping() or 0.0)
    if clip > 0.0 and not engine.bfloat16_enabled():
        raise ConfigError(f"gradient_clipping={clip} with {where} and fp32: DeepSpeed clips fp32 ZeRO-0 "
                          "gradients before optimizer.step(), i.e. before they are averaged over ranks; set "
                          "gradient_clipping=0 (or use bf16.enabled=true, whose wrapper clips after the reduction)")
    if engine.optimizer is None:
        raise ConfigError(f"{where} needs an optimizer: give deepspeed.initialize an optimizer or an "
                          "'optimizer' section")
    if isinstance(engine.optimizer, CompressedOptimizer):
        raise RuntimeError("attach_to_engine: this engine's optimizer is already a CompressedOptimizer")


def attach_to_engine(engine, config, group=None) -> CompressedOptimizer:
    """Make ``engine`` reduce its module's gradients through a CompressedOptimizer; return it.

    ``config`` is the ``gradient_compression`` section (dict or model); ``group`` the
    data-parallel group (default: the engine's). Call it right after ``deepspeed.initialize``.
    The residuals are per rank: save them with :func:`ds_xc.compression.save_compression_state`
    next to the engine's checkpoint (DeepSpeed saves rank 0's optimizer state only).
    """
    cfg = parse_compression(config)
    check_engine(engine, cfg.method)
    if group is None:
        group = getattr(engine, "seq_data_parallel_group", None)
    params = [p for p in engine.module.parameters() if p.requires_grad]
    wrapper = CompressedOptimizer(engine.optimizer, cfg, group=group, params=params,
                                  rank_state_in_state_dict=False)
    engine.optimizer = wrapper
    engine.enable_backward_allreduce = False
    log.info("gradient_compression attached to the DeepSpeed engine: method=%s density=%g (bf16=%s); the "
             "engine's backward all-reduce is off", cfg.method, cfg.density, engine.bfloat16_enabled())
    return wrapper

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

Supported: ZeRO stage 0 with fp32 or bf16, and ZeRO stage 1 with fp32
(ds_xc/compression/zero.py: the compressed mean feeds the partitioned optimizer). Refused at
start, naming the keys:
* ZeRO 2/3: their own hooks reduce the gradients densely during the backward and keep only
  this rank's partition, before any wrapper could see them (measured: docs/compression.md,
  "With ZeRO");
* ZeRO 1 with ``overlap_comm`` (it all-reduces in hooks during the boundary backward), CPU
  offload (its hooks copy the gradients to the CPU) or bf16 (not found equal to ZeRO 0);
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


def check_zero_stage(stage: int, method: str, overlap_comm=None, bf16: bool = False, offload: bool = False) -> None:
    """Raise ConfigError when a wrapper for ``method`` would meet a ZeRO setting it cannot serve:
    stage 2 or 3, or stage 1 with ``overlap_comm``, bf16 or an optimizer offload.

    Called from the raw config before the engine is built (ds_xc.engine.check_supported, where
    method none attaches nothing) and from the built engine (:func:`check_engine`), so both
    give the same message.
    """
    where = f"zero_optimization.stage={stage} with {COMPRESSION_SECTION}.method={method!r}"
    if int(stage) >= 2:
        raise ConfigError(f"{where}: ZeRO stages 2 and 3 reduce the gradients densely in their own hooks during the "
                          "backward and keep only this rank's partition; DeepSpeed refuses to defer that reduction, "
                          "and it is the only way to build their partitioned gradients (measured in "
                          "docs/compression.md, 'With ZeRO'); allowed with compression: zero_optimization.stage 0 "
                          f"or 1, or {COMPRESSION_SECTION}.method='none'")
    if int(stage) != 1:
        return
    if overlap_comm:
        raise ConfigError(f"zero_optimization.overlap_comm={overlap_comm!r} with {where}: ZeRO-1 then all-reduces "
                          "the gradients in hooks during the boundary backward, before the compressed reduction; "
                          "set zero_optimization.overlap_comm=false (or leave it out)")
    if bf16:
        raise ConfigError(f"bf16.enabled=true with {where}: not supported (with fp32 gradient accumulation "
                          "DeepSpeed's BF16_Optimizer keeps the gradients in its own fp32 buffers, out of the "
                          "compressed reduction's reach; with bf16 accumulation the run was not found equal to "
                          "ZeRO-0, see docs/compression.md); use fp32 with ZeRO-1, or zero_optimization.stage=0 "
                          "with bf16")
    if offload:
        raise ConfigError(f"zero_optimization.offload_optimizer with {where}: the offloaded ZeRO-1 optimizer copies "
                          "gradients to the CPU in its own hooks; remove offload_optimizer (or its device: none)")


def check_engine(engine, method: str) -> None:
    """Raise ConfigError for engine settings the compressed reduction cannot serve correctly."""
    where = f"{COMPRESSION_SECTION}.method={method!r}"
    stage = int(engine.zero_optimization_stage())
    check_zero_stage(stage, method, overlap_comm=stage == 1 and bool(engine.zero_overlap_comm()),
                     bf16=stage == 1 and bool(engine.bfloat16_enabled()),
                     offload=stage == 1 and bool(getattr(engine.optimizer, "cpu_offload", False)))
    if engine.fp16_enabled():
        raise ConfigError(f"fp16.enabled=true with {where}: dynamic loss scaling would mix scales in the "
                          "error-feedback residuals; use bf16.enabled=true or fp32")
    clip = float(engine.gradient_clipping() or 0.0)
    if clip > 0.0 and not engine.bfloat16_enabled() and stage == 0:
        raise ConfigError(f"gradient_clipping={clip} with {where} and fp32: DeepSpeed clips fp32 ZeRO-0 "
                          "gradients before optimizer.step(), i.e. before they are averaged over ranks; set "
                          "gradient_clipping=0 (or use bf16.enabled=true, whose wrapper clips after the reduction)")
    if engine.optimizer is None:
        raise ConfigError(f"{where} needs an optimizer: give deepspeed.initialize an optimizer or an "
                          "'optimizer' section")
    if isinstance(engine.optimizer, CompressedOptimizer):
        raise RuntimeError("attach_to_engine: this engine's optimizer is already a CompressedOptimizer")


def attach_to_engine(engine, config, group=None, node_groups=None) -> CompressedOptimizer:
    """Make ``engine`` reduce its module's gradients through a CompressedOptimizer; return it.

    ``config`` is the ``gradient_compression`` section (dict or model); ``group`` the
    data-parallel group (default: the engine's); ``node_groups`` the hierarchy's NodeGroups from the
    detected node layout (ds_xc/engine/reduction.py; None: ``hierarchy.ranks_per_node`` decides).
    Call it right after ``deepspeed.initialize``.
    Under ZeRO-1 ``engine.optimizer`` stays DeepSpeed's (its ``step`` runs the compressed
    reduction first: ds_xc/compression/zero.py). The residuals are per rank: save them with
    :func:`ds_xc.compression.save_compression_state` next to the engine's checkpoint (DeepSpeed
    saves rank 0's optimizer state only under ZeRO 0, its partitions under ZeRO 1).
    """
    cfg = parse_compression(config)
    check_engine(engine, cfg.method)
    if group is None:
        group = getattr(engine, "seq_data_parallel_group", None)
    if int(engine.zero_optimization_stage()) == 1:
        from ds_xc.compression.zero import attach_to_zero
        return attach_to_zero(engine, cfg, group, node_groups)
    params = [p for p in engine.module.parameters() if p.requires_grad]
    wrapper = CompressedOptimizer(engine.optimizer, cfg, group=group, params=params,
                                  rank_state_in_state_dict=False, node_groups=node_groups)
    engine.optimizer = wrapper
    engine.enable_backward_allreduce = False
    log.info("gradient_compression attached to the DeepSpeed engine: method=%s density=%g (bf16=%s); the "
             "engine's backward all-reduce is off", cfg.method, cfg.density, engine.bfloat16_enabled())
    return wrapper

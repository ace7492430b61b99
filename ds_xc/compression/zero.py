"""Compressed gradients under ZeRO stage 1: the compressed mean feeds the partitioned optimizer.

ZeRO-1 partitions the optimizer state, not the gradients: every rank holds the full local
gradient in ``.grad`` until the accumulation boundary, where DeepSpeed 0.19.8 averages it
(``allreduce_gradients`` -> the ZeRO optimizer's ``reduce_gradients``) and copies this
rank's slice into the partition its optimizer steps on. With the engine's backward
all-reduce off (``engine.enable_backward_allreduce = False``) nothing is reduced, so at the
boundary ``.grad`` still holds the local (accumulated, 1/gas-scaled) gradient. The
ZeRO optimizer's ``step`` is then shadowed on this instance by one that

1. replaces every ``.grad`` by the compressed mean (:meth:`CompressedOptimizer.reduce_gradients`,
   the same bytes, seeds and error feedback as under ZeRO 0),
2. lets DeepSpeed cut this rank's partition out of those (now identical) gradients with its
   own epilogue (``independent_gradient_partition_epilogue``: no communication, its buckets
   are empty because ZeRO-1 without ``overlap_comm`` buckets nothing before the boundary),
3. runs DeepSpeed's own step (norm, clipping, the partition's update, the all-gather).

``engine.optimizer`` stays the ZeRO optimizer (DeepSpeed checks its type in backward and in
checkpoints); the CompressedOptimizer is returned and held by the caller (XCEngine). ZeRO-2
cannot be served this way: its hooks reduce-scatter each bucket during the backward and drop
the local gradients (see docs/compression.md, "With ZeRO", and tests/test_compression_zero.py).
"""
from __future__ import annotations

import logging

from ds_xc.compression.optimizer import CompressedOptimizer

log = logging.getLogger(__name__)

__all__ = ["ZeroStep", "attach_to_zero"]


class ZeroStep:
    """The optimizer a CompressedOptimizer wraps under ZeRO-1: its ``step`` partitions the reduced
    ``.grad`` and runs the ZeRO optimizer's own (unshadowed) step; everything else is the ZeRO
    optimizer's (``param_groups`` are its flat fp32 partitions, so learning rates stay shared)."""

    zero_stage = 1  # the pays checks model ZeRO-1's parameter all-gather on both sides (ds_xc.compression.pays)

    def __init__(self, zero_optimizer):
        self.zero = zero_optimizer
        self.param_groups = zero_optimizer.param_groups
        self.defaults = getattr(zero_optimizer, "defaults", {})
        self._own_step = type(zero_optimizer).step.__get__(zero_optimizer)  # the class's step, bound

    def step(self, closure=None):
        self.zero.independent_gradient_partition_epilogue()  # .grad -> this rank's partition, no collective
        return self._own_step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zero.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {}  # the ZeRO optimizer's partitions are saved by DeepSpeed's own checkpoint files

    def load_state_dict(self, state_dict: dict, **kwargs) -> None:
        return None

    def __getattr__(self, name):
        if name.startswith("__") or name == "zero":
            raise AttributeError(name)
        return getattr(self.zero, name)


def attach_to_zero(engine, cfg, group, node_groups=None) -> CompressedOptimizer:
    """Make a ZeRO-1 ``engine`` reduce its module's gradients through a CompressedOptimizer (see the
    module docstring); ``cfg`` is the parsed section, ``group`` the data-parallel group."""
    zero = engine.optimizer
    params = [p for p in engine.module.parameters() if p.requires_grad]
    wrapper = CompressedOptimizer(ZeroStep(zero), cfg, group=group, params=params, rank_state_in_state_dict=False,
                                  node_groups=node_groups)
    zero.step = wrapper.step  # shadows the class's step on this instance only
    engine.enable_backward_allreduce = False
    log.info("gradient_compression attached to a ZeRO-1 engine: method=%s density=%g; the engine's backward "
             "all-reduce is off, the compressed mean feeds the partitioned optimizer", cfg.method, cfg.density)
    return wrapper

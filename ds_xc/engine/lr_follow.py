"""``lr_schedule: follow_engine``: the head's learning rate follows the engine's schedule.

The head has its own optimizer (ds_xc/head/optim.py), so a schedule that DeepSpeed steps
(its config's ``scheduler`` section, an ``lr_scheduler`` passed to ``ds_xc.initialize``, or
the ``adaptive_lr`` section) moves only the backbone's lr. Under ``follow_engine`` the head
takes, before each of its optimizer steps,

    head lr = configured head lr * (engine lr of this step / the schedule's reference lr)

with the engine lr and the reference both of the engine's first parameter group. The
reference is the lr the schedule's factors multiply (its 100 %), read from the scheduler
itself, never from the optimizer's lr at ``initialize`` (a scheduler built before then may
already have set that lr to 0 or to a warm-up fraction):

* a scheduler with ``base_lrs`` (every ``torch.optim.lr_scheduler.LRScheduler``: LambdaLR,
  arcface_torch's PolynomialLRWarmup, ...; ds_xc's AdaptiveLR): ``base_lrs[0]``, the
  optimizer's lr when the scheduler was built (torch keeps it as the group's ``initial_lr``);
* DeepSpeed's WarmupCosineLR: ``org_lrs[0]`` (the optimizer's lr it scales);
* DeepSpeed's WarmupLR, WarmupDecayLR (``warmup_max_lr``) and OneCycle (``cycle_max_lr``):
  ``max_lrs[0]``, the peak;
* DeepSpeed's LRRangeTest: ``min_lr[0]`` (``lr_range_test_min_lr``, where it starts);
* no scheduler: the optimizer's lr at ``initialize`` (the head follows lr changes made by hand).

So the configured head lr is the head's lr where the engine runs at its reference (the peak of
a warm-up schedule). Any other scheduler, or a reference that is not a finite number > 0, is a
ConfigError at ``initialize`` naming ``lr_schedule`` (set ``lr_schedule: constant``, or give
the scheduler a ``base_lrs`` list). DeepSpeed's scheduler attributes are read here only.
"""
from __future__ import annotations

import math
from typing import Any, Optional

from ds_xc import config as cfg

__all__ = ["reference_lr", "check_follow_engine", "REFERENCE_ATTRIBUTES"]

# (attribute, what it holds), in the order they are looked for
REFERENCE_ATTRIBUTES = (
    ("base_lrs", "the lrs its factors multiply (torch LRScheduler, ds_xc AdaptiveLR)"),
    ("org_lrs", "the optimizer's lrs it scales (DeepSpeed WarmupCosineLR)"),
    ("max_lrs", "the peak lrs (DeepSpeed WarmupLR / WarmupDecayLR warmup_max_lr, OneCycle cycle_max_lr)"),
    ("min_lr", "the starting lrs (DeepSpeed LRRangeTest lr_range_test_min_lr)"),
)
_KEY = f"{cfg.HEAD_SECTION}.optimizer.lr_schedule"


def reference_lr(scheduler: Any, optimizer_lr: Optional[float]) -> tuple[Optional[float], str]:
    """(the engine's reference lr, where it was read) for ``scheduler`` (None: no scheduler, the
    optimizer's lr at initialize ``optimizer_lr``); (None, why) when no reference can be read."""
    if scheduler is None:
        return optimizer_lr, "the optimizer's lr at initialize (no lr scheduler)"
    for name, _ in REFERENCE_ATTRIBUTES:
        values = getattr(scheduler, name, None)
        if isinstance(values, (list, tuple)) and len(values) > 0:
            return float(values[0]), f"{type(scheduler).__name__}.{name}[0]"
    return None, f"{type(scheduler).__name__} has none of {', '.join(n for n, _ in REFERENCE_ATTRIBUTES)}"


def check_follow_engine(scheduler: Any, optimizer_lr: Optional[float]) -> float:
    """The reference lr the head follows (see the module docstring), or a ConfigError naming
    ``lr_schedule``, the scheduler and what is allowed."""
    ref, source = reference_lr(scheduler, optimizer_lr)
    if ref is None:
        allowed = "; ".join(f"{name}: {what}" for name, what in REFERENCE_ATTRIBUTES)
        raise cfg.ConfigError(f"{_KEY}='follow_engine': the engine's lr scheduler {type(scheduler).__name__} gives "
                              f"no reference lr to scale the head's lr by ({source}); allowed: a scheduler with one "
                              f"of these lists ({allowed}), or set {_KEY} to 'constant'")
    if not (math.isfinite(ref) and ref > 0.0):
        raise cfg.ConfigError(f"{_KEY}='follow_engine': the engine's reference lr is {ref!r} (from {source}); "
                              f"allowed: a finite lr > 0 (the head's lr = its configured lr * engine lr / reference), "
                              f"or set {_KEY} to 'constant'")
    return ref

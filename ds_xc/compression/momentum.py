"""Who owns the momentum of the reduced tensors (``momentum_correction``, DGC's momentum correction).

Why. With error feedback an element is sent as a burst of what it accumulated, tens of steps late
at density 0.01. An optimizer's momentum applied after the exchange (SGD's heavy ball, Adam's first
moment) then smooths bursts that are already stale: measured on the glyphs CNN, heavy-ball SGD under
compression never left its initial plateau, and AdamW lost 1.4 points top-1 on average over four
seeds (docs/compression.md, "The CNN's gap"). Deep Gradient Compression (Lin et al., 2018) moves the
momentum before the compression: each rank accumulates the velocity u = m u + g locally, error
feedback and the selection work on u, and u is zeroed where it was sent (optimizer.py's
``_accumulate`` / ``_feedback``). The optimizer must then step those tensors without its own
momentum, or it would be applied twice. A tensor reduced densely (under ``min_numel``) is DGC's limit of
density 1: its velocity is sent whole and zeroed every step, i.e. it has no momentum either.

:class:`MomentumCorrection` resolves the factor m and, where it can, takes the first moment out of the
wrapped optimizer's step at the steps whose reduction was compressed
(:meth:`MomentumCorrection.first_moment_off`): an Adam (torch's ``Adam``/``AdamW``, DeepSpeed's
``FusedAdam``, its default on GPUs, and ``DeepSpeedCPUAdam``: :func:`is_adam`) steps every tensor the wrapper
reduces with beta1 = 0, a torch ``SGD`` steps the compressed tensors with momentum 0. Why the two differ:
Adam's first moment is an average, so without it a dense tensor's steps keep their size, and on the
glyphs CNN (four seeds, docs/compression.md) leaving the small dense tensors (BatchNorm, biases) their
beta1 ended 1.2 points of top-1 lower on average; SGD's heavy ball multiplies a consistent gradient by
1 / (1 - m), so taking it from the dense tensors would cut their learning rate tenfold at m = 0.9 (and a
test of SGD on the synthetic MLP trains worse so). In a dense (warm-up) step every tensor keeps the
optimizer's momentum, and tensors the optimizer steps but the wrapper does not reduce are never touched.

The default (null, "auto" below) takes m from the optimizer itself, Adam's beta1 or SGD's momentum,
read at every step so that a schedule of it (OneCycleLR's) is followed; a number fixes m; 0 is off.
Under the DDP hook the user's loop steps the optimizer, and :meth:`MomentumCorrection.hook_into` does
the same through torch's optimizer step hooks. Off by construction: no error feedback, method none or
powersgd, another optimizer class; a number then still sets m, and the wrapped optimizer's own momentum is
the user's to turn off.

DeepSpeed's ZeRO-1 and bf16 wrappers step fp32 master copies (flat partitions) with a torch optimizer
inside them (``.optimizer``). Where that is an Adam (:func:`is_adam`) and the master copies are those of exactly the
reduced tensors (their ``bit16_groups`` / ``bf16_groups`` / ``fp16_groups``), every tensor it steps is a
reduced one, so "an Adam steps every reduced tensor with beta1 = 0" is its groups with beta1 = 0
(:func:`master_optimizer`); ZeRO-1 then follows the ZeRO-0 trajectory (tests/test_compression_zero.py). An
SGD there stays unsupported: the flat partitions mix compressed and dense tensors.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Optional

import torch

from ds_xc.compression.frozen_adam import not_torch_adam, steps_other_tensors
from ds_xc.config_base import COMPRESSION_SECTION

log = logging.getLogger(__name__)

__all__ = ["MomentumCorrection", "owner_unsupported", "master_optimizer", "is_adam"]

_MASTER_GROUPS = ("bit16_groups", "bf16_groups", "fp16_groups")  # ZeRO-1 / BF16_Optimizer / FP16_Optimizer
_DEEPSPEED_ADAMS = ("FusedAdam", "DeepSpeedCPUAdam")  # deepspeed.ops.adam: read each group's betas every step


def is_adam(optimizer) -> bool:
    """Whether ``optimizer`` is an Adam whose first moment is each group's ``betas[0]``, read at every step:
    torch's Adam/AdamW, or DeepSpeed's FusedAdam (its default Adam on GPUs) and DeepSpeedCPUAdam."""
    if not_torch_adam(optimizer) is None:
        return True
    if not type(optimizer).__module__.startswith("deepspeed.ops.adam"):
        return False
    from deepspeed.ops import adam as ds_adam  # only for an optimizer of that module: it is imported already
    return isinstance(optimizer, tuple(getattr(ds_adam, name) for name in _DEEPSPEED_ADAMS))


def master_optimizer(optimizer, reduced: list):
    """The Adam (:func:`is_adam`) inside a DeepSpeed wrapper (ZeRO-1, bf16) that steps the fp32 master copies
    of exactly the ``reduced`` tensors; None when ``optimizer`` is no such wrapper (see the module docstring)."""
    inner = getattr(optimizer, "optimizer", None)
    if inner is None or not is_adam(inner):
        return None
    for name in _MASTER_GROUPS:
        groups = getattr(optimizer, name, None)
        if groups:
            covered = {id(p) for group in groups for p in group}
            return inner if covered == {id(p) for p in reduced} else None
    return None


def owner_unsupported(optimizer, params: list) -> Optional[str]:
    """Why the wrapper cannot step ``params`` without ``optimizer``'s momentum (None: it can)."""
    if isinstance(optimizer, torch.optim.SGD):
        for g in optimizer.param_groups:
            if g.get("nesterov") or g.get("dampening", 0.0):
                return (f"the wrapped SGD has nesterov={g.get('nesterov')} dampening={g.get('dampening')} (its "
                        "momentum is not DGC's u = m u + g)")
    elif not is_adam(optimizer):
        return (f"the wrapped optimizer is {type(optimizer).__name__}, not torch.optim.Adam, AdamW or SGD, nor "
                f"DeepSpeed's {' or '.join(_DEEPSPEED_ADAMS)}")
    return steps_other_tensors(optimizer, params)


def _first_moment(optimizer, group: dict) -> float:
    """The group's momentum factor: Adam's beta1 or SGD's momentum."""
    if isinstance(optimizer, torch.optim.SGD):
        return float(group.get("momentum", 0.0))
    return float(group["betas"][0])


class MomentumCorrection:
    """The factor m of u = m u + g for the compressed tensors, and the wrapped optimizer's step without it.

    Args:
        setting: the section's ``momentum_correction`` (None: auto, or a number in [0, 1)).
        optimizer: the wrapped optimizer.
        compressed: the tensors whose gradients are compressed (the layout's sparse ones): auto reads m
            from their groups.
        reduced: every tensor the wrapper reduces (compressed or dense): an Adam steps them all without its
            first moment (an SGD only the compressed ones).
        usable: whether the reduction can carry a velocity at all (error feedback and an
            element-selecting method, and at least one compressed tensor).
    """

    def __init__(self, setting, optimizer, compressed: list, reduced: list, usable: bool):
        masters = master_optimizer(optimizer, reduced) if compressed else None  # ZeRO-1 / bf16: their Adam
        self.optimizer = optimizer if masters is None else masters
        self._masters = masters is not None  # every tensor it steps is a reduced one's master copy
        self._compressed = {id(p) for p in compressed}
        self._groups: list = []  # the optimizer's group dicts that hold compressed tensors (see _values)
        self._groups_of = None  # the param_groups list they were taken from
        adam = is_adam(self.optimizer)
        self._ids = {id(p) for p in (reduced if adam else compressed)}  # stepped without the first moment
        self._swapped = False  # the optimizer's param_groups are the split ones right now
        why = (None if self._masters else owner_unsupported(optimizer, reduced)) if compressed else \
            "no compressed tensor"
        self._fixed: Optional[float] = None if setting is None else float(setting)
        self.enabled = self._resolve(usable, why)
        self.owns = self.enabled and why is None  # steps them without the optimizer's momentum
        if not self.enabled:
            return
        if self._fixed is not None and why is not None:
            log.info("CompressedOptimizer: momentum_correction %g; the wrapped optimizer's own momentum is left as "
                     "it is (%s): set it to 0, or it applies twice", self._fixed, why)
        log.info("CompressedOptimizer: momentum_correction %s, the reduced tensors stepped %s%s",
                 "auto (the optimizer's own momentum)" if self._fixed is None else f"{self._fixed:g}",
                 "without the optimizer's first moment after a compressed reduction" if self.owns
                 else "by the optimizer as it is",
                 f" (their master copies, by the {type(self.optimizer).__name__} inside "
                 f"{type(optimizer).__name__})" if self._masters else "")

    def _resolve(self, usable: bool, why: Optional[str]) -> bool:
        """Whether the velocity is on: a number > 0, or auto where the optimizer has one momentum > 0."""
        if not usable or (self._fixed is None and why is not None):
            if self._fixed is None:
                log.info("CompressedOptimizer: momentum_correction auto -> off (%s)", why if usable else
                         "no error feedback, method none or powersgd, or no compressed tensor")
            return False
        if self._fixed is not None:
            return self._fixed > 0.0
        values = self._values()
        if len(values) > 1:
            log.warning("%s.momentum_correction null (auto): the parameter groups of the compressed tensors "
                        "have different momenta %s; off (set a number to use one factor for all)",
                        COMPRESSION_SECTION, sorted(values))
            return False
        if values == {0.0}:
            log.info("CompressedOptimizer: momentum_correction auto -> off (the optimizer has no momentum)")
            return False
        return True

    def _values(self) -> set:
        """The momenta of the groups holding compressed tensors. The groups are found once per param_groups
        list (torch's load_state_dict installs a new one), not per call: this runs on every bucket."""
        groups = self.optimizer.param_groups
        if groups is not self._groups_of and not self._swapped:
            self._groups = [g for g in groups if self._masters or any(id(p) in self._compressed for p in g["params"])]
            self._groups_of = groups
        return {_first_moment(self.optimizer, g) for g in self._groups}

    def factor(self) -> float:
        """m for this step: the fixed number, or the optimizer's current momentum (auto)."""
        if self._fixed is not None:
            return self._fixed
        values = self._values()
        if len(values) != 1:
            raise ValueError(f"{COMPRESSION_SECTION}.momentum_correction null (auto): the parameter groups of the "
                             f"compressed tensors now have different momenta {sorted(values)}; allowed: one value "
                             "(or set momentum_correction to a number)")
        return values.pop()

    @contextlib.contextmanager
    def first_moment_off(self, active: bool = True):
        """Within the block the wrapped optimizer's ``param_groups`` put the tensors it owns (an Adam's
        reduced ones, an SGD's compressed ones) in copies of their groups with the first moment 0 (beta1,
        momentum); the list is restored afterwards.
        The copies share every other setting (lr, weight decay) with the original group at this step."""
        original = self._swap() if active else None
        try:
            yield
        finally:
            self._restore(original)

    def hook_into(self, compressed) -> None:
        """For a wrapper whose ``step()`` is not how the optimizer steps (the DDP hook): take the first
        moment off around the optimizer's own ``step()``, through torch's public step hooks, whenever
        ``compressed()`` says the gradients it is about to use came from a compressed exchange."""
        if not self.owns:
            return
        pending: list = []

        def pre(opt, args, kwargs):
            while pending:  # a step that raised never ran the post hook: restore first
                self._restore(pending.pop())
            if compressed():
                pending.append(self._swap())

        def post(opt, args, kwargs):
            while pending:
                self._restore(pending.pop())
        self.optimizer.register_step_pre_hook(pre)
        self.optimizer.register_step_post_hook(post)

    def _swap(self) -> Optional[list]:
        """Install the split groups; returns the original list (None: nothing to do, or already split)."""
        if not self.owns or self._swapped:
            return None
        opt, original = self.optimizer, self.optimizer.param_groups
        split = []
        for g in original:
            mine = g["params"] if self._masters else [p for p in g["params"] if id(p) in self._ids]  # masters: all
            rest = [] if self._masters else [p for p in g["params"] if id(p) not in self._ids]
            if rest:
                split.append(dict(g, params=rest))
            if mine:
                off = {"momentum": 0.0} if isinstance(opt, torch.optim.SGD) else {"betas": (0.0, g["betas"][1])}
                split.append(dict(g, params=mine, **off))
        opt.param_groups = split
        self._swapped = True
        return original

    def _restore(self, original: Optional[list]) -> None:
        if original is not None:
            self.optimizer.param_groups = original
            self._swapped = False

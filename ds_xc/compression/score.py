"""What the element selection ranks (``select_by``): |v|, or |v| in units of the wrapped Adam's steps.

Why. With error feedback an element waits in the residual until it is selected, and what it waits
for decides how late its information arrives. Ranking by |v| serves the elements with large raw
gradients first; but Adam(W) takes steps of about lr wherever a gradient is consistent, however
small, and of little where it is large but noisy. An element's pending value v_i moves its weight by
about lr |v_i| / sqrt(v-hat_i) once delivered (v-hat: Adam's bias-corrected second moment), so
``select_by: update`` ranks by that: s_i = v_i / sqrt(max(v-hat_i, floor)). A consistent small
gradient then climbs the ranking as fast as a large one, and a noisy element, whose residual grows
only as the square root of its wait, waits longer. Measured on the glyphs CNN and the text task in
docs/compression.md.

The Adams it reads: torch's Adam/AdamW and DeepSpeed's FusedAdam (what DeepSpeed builds for an
``"optimizer": {"type": "Adam"}`` section on a GPU) and DeepSpeedCPUAdam. All three keep ``step`` and
``exp_avg_sq`` per parameter in ``optimizer.state``; DeepSpeed's skip the bias correction when a group
says ``bias_correction: false``, and so does the score.

``floor`` = ``FLOOR`` x the tensor's mean v-hat (an RMS of 1% of the tensor's): an element with no
second moment yet (an embedding row no batch looked up so far) is ranked as if its gradients were
that small, not divided by zero. With ``adam_variance: frozen`` the score divides by the frozen
v-hat, the one the steps divide by. The wrapped optimizer's state is the same on every rank (it is
replicated), so every rank ranks with the same scale; the values sent are v itself, the score only
chooses which.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from ds_xc.compression.frozen_adam import FROZEN_KEY, steps_other_tensors
from ds_xc.compression.momentum import is_adam
from ds_xc.compression.zero_score import ZeroVariance, zero_variance_unsupported
from ds_xc.config_base import COMPRESSION_SECTION, ConfigError
from ds_xc_ops.score import update_score

log = logging.getLogger(__name__)

__all__ = ["FLOOR", "not_an_adam", "update_score_unsupported", "per_param_masters", "UpdateScore", "build_update_score"]

FLOOR = 1e-4  # v-hat floor, relative to the tensor's mean v-hat


def not_an_adam(optimizer) -> Optional[str]:
    """Why ``optimizer``'s state is not one the score can read (None: an Adam it reads, module docstring)."""
    if is_adam(optimizer):
        return None
    return (f"the wrapped optimizer is {type(optimizer).__name__}, not torch.optim.Adam/AdamW or DeepSpeed's "
            "FusedAdam/DeepSpeedCPUAdam")


def update_score_unsupported(optimizer, params: list) -> Optional[str]:
    """Why ``select_by: update`` cannot rank ``params`` by ``optimizer``'s steps (None: it can)."""
    return not_an_adam(optimizer) or steps_other_tensors(optimizer, params)


def per_param_masters(optimizer, params: list) -> Optional[tuple]:
    """(the inner Adam, {id(param): its float32 master}) when ``optimizer`` is a DeepSpeed wrapper with one
    master tensor per parameter (``fp16_groups`` and ``fp32_groups`` in step: DeepSpeed 0.19's bf16 at ZeRO 0,
    FP16_UnfusedOptimizer) whose inner Adam (:func:`not_an_adam`) steps the masters of all ``params``; else
    None (flat masters, ZeRO partitions, another optimizer). The masters' Adam state is then the one to rank
    by."""
    inner = getattr(optimizer, "optimizer", None)
    low, high = getattr(optimizer, "fp16_groups", None), getattr(optimizer, "fp32_groups", None)
    if inner is None or not_an_adam(inner) is not None or not low or not isinstance(high, list):
        return None
    pairs = {}
    for lg, hg in zip(low, high):
        if not isinstance(hg, list) or len(lg) != len(hg):
            return None
        pairs.update((id(a), b) for a, b in zip(lg, hg) if a.shape == b.shape)
    if any(id(p) not in pairs for p in params) or steps_other_tensors(inner, [pairs[id(p)] for p in params]):
        return None
    return inner, pairs


class UpdateScore:
    """s = v / sqrt(max(v-hat, floor)) per compressed parameter, over any positions of the region."""

    def __init__(self, optimizer, params: list, layout, masters: Optional[dict] = None):
        self.optimizer = optimizer
        self._masters = masters or {}  # id(param) -> the tensor the optimizer steps for it (per_param_masters)
        self._group: dict = {}  # id(param) -> its group dict (the optimizer's own: a change of betas is followed)
        self._group_of = None  # the param_groups list the map was taken from (see beta2)
        lo, hi = layout.region
        # (param, region start, region end, offset in the param) for each compressed parameter in the region
        self.parts = []
        for i, start in zip(layout.sparse, layout.starts):
            a, b = max(start, lo), min(start + params[i].numel(), hi)
            if a < b:
                self.parts.append((params[i], a - lo, b - lo, a - start))

    def group(self, p: torch.Tensor) -> dict:
        """``p``'s param group now (its betas and bias correction are read at every call). The map is rebuilt
        whenever the optimizer holds another param_groups list than the one it was built from: torch's
        ``load_state_dict`` installs new group dicts (a checkpoint's betas), and the old ones would go on
        answering with the betas of before."""
        groups = self.optimizer.param_groups
        if groups is not self._group_of:
            self._group = {id(q): g for g in groups for q in g["params"]}
            self._group_of = groups
        return self._group[id(self._masters.get(id(p), p))]

    def bias_correction(self, p: torch.Tensor, steps: float) -> float:
        """1 / (1 - beta2^steps), or 1 where the group turns the correction off (DeepSpeed's Adams)."""
        group = self.group(p)
        if not group.get("bias_correction", True):
            return 1.0
        return 1.0 / (1.0 - float(group["betas"][1]) ** steps)

    def prepare(self, counter=None) -> None:
        """At the start of every reduction, on every rank: lets a source that gathers its state do so
        (ZeRO-1's partitions, zero_score.py; a collective when due)."""
        refresh = getattr(self.optimizer, "refresh_if_due", None)
        if refresh is not None:
            refresh(counter)

    @torch.no_grad()
    def __call__(self, v: torch.Tensor, out: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """Write the score of region positions [a, b) of ``v`` (s,) into ``out`` (s,); returns ``out``."""
        for p, start, end, offset in self.parts:
            lo, hi = max(start, a), min(end, b)
            if lo >= hi:
                continue
            st = self.optimizer.state.get(self._masters.get(id(p), p), {})
            steps = float(st.get("step", 0))
            if "exp_avg_sq" not in st or steps == 0:  # no second moment yet: rank by |v|
                out[lo:hi].copy_(v[lo:hi])
                continue
            if FROZEN_KEY in st:  # adam_variance frozen: the v-hat the steps divide by (bias-corrected)
                full, scale = st[FROZEN_KEY], 1.0
            else:
                full, scale = st["exp_avg_sq"], self.bias_correction(p, steps)
            moment = full.reshape(-1)[offset + lo - start: offset + hi - start]  # (hi - lo,)
            floor = full.mean().mul_(FLOOR * scale).clamp_(min=1e-38)  # 0-dim, on the device: no host sync
            update_score(v[lo:hi], moment, scale, floor, out[lo:hi])  # one fused pass on the CPU
        return out


def build_update_score(config, optimizer, params: list, layout, store=None, group=None) -> Optional[UpdateScore]:
    """The score ``select_by`` asks for: an :class:`UpdateScore`, or None to rank by |v|.

    ``auto``: update where it can be (an element-selecting method that reads magnitudes, topk or
    bayes_prior, and a wrapped Adam (:func:`not_an_adam`) stepping the reduced tensors themselves, or their
    per-parameter masters: :func:`per_param_masters`, or ZeRO-1's partitions, gathered into ``store``, the
    wrapper's per-parameter state, over ``group``: zero_score.py), else magnitude. ``update`` where it
    cannot be raises a ConfigError naming the reason."""
    if config.select_by == "magnitude" or config.method not in ("topk", "bayes_prior"):
        return None
    compressed = [params[i] for i in layout.sparse]
    if getattr(optimizer, "zero_stage", 0) == 1 and store is not None:  # ZeroStep (zero.py)
        why = zero_variance_unsupported(optimizer.zero, compressed, group)
        if why is None:
            log.info("CompressedOptimizer: select_by %s under ZeRO-1, by the partitioned Adam state gathered every "
                     "%d steps", config.select_by, config.score_sync_interval)
            source = ZeroVariance(optimizer.zero, compressed, store, group, config.score_sync_interval)
            return UpdateScore(source, params, layout)
        masters = None
    else:
        masters = per_param_masters(optimizer, compressed)  # DeepSpeed's bf16 at ZeRO 0: the masters' state
        why = None if masters is not None else update_score_unsupported(optimizer, compressed)
    if why is not None:
        if config.select_by == "update":
            raise ConfigError(f"{COMPRESSION_SECTION}.select_by='update': {why}; allowed: 'update' with a "
                              "torch.optim.Adam/AdamW, DeepSpeed's FusedAdam or DeepSpeedCPUAdam that steps the "
                              "reduced parameters (or their per-parameter masters inside DeepSpeed's bf16 wrapper), "
                              "else 'auto' or 'magnitude'")
        log.info("CompressedOptimizer: select_by auto -> magnitude (%s)", why)
        return None
    if masters is not None:
        log.info("CompressedOptimizer: select_by %s, by the Adam state of the float32 masters inside %s",
                 config.select_by, type(optimizer).__name__)
        return UpdateScore(masters[0], params, layout, masters=masters[1])
    return UpdateScore(optimizer, params, layout)

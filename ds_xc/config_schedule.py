"""Section ``adaptive_lr``: the adaptive learning-rate schedule (ds_xc/engine/adaptive_lr.py).

A top-level section of the DeepSpeed JSON, next to DeepSpeed's own ``scheduler`` (which it
replaces: both at once is a ConfigError). Warm-up scaled to the global batch, then decay by
``factor`` when the monitored metric plateaus: the held-out metric fed by the training loop
(``launch/train.py`` feeds the top-1 of every evaluation), else the smoothed training loss.
Units are optimizer steps throughout. docs/convergence.md describes the rule.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ds_xc.config_base import ConfigError, Section, validate_section

__all__ = ["ADAPTIVE_LR_SECTION", "AdaptiveLRConfig", "parse_adaptive_lr", "check_no_scheduler_clash"]

ADAPTIVE_LR_SECTION = "adaptive_lr"


class AdaptiveLRConfig(Section):
    """Section ``adaptive_lr``: warm-up scaled to the global batch, then decay on plateaus of the monitored
    metric; rank 0 decides, every rank of the engine's data-parallel group (and the head, through
    ``lr_schedule: follow_engine``) gets the same rate. Replaces DeepSpeed's ``scheduler`` section."""
    enabled: bool = Field(True, description="Build the schedule and pass it to deepspeed.initialize as its "
                          "lr_scheduler (false: the section is ignored).")
    reference_batch: int = Field(256, ge=1, description="Global batch the optimizer's lr was chosen for; the "
                                 "peak lr is lr * (global_batch / reference_batch) ** p (see batch_scaling).")
    batch_scaling: Literal["linear", "sqrt", "none"] = Field(
        "linear", description="p of the peak rule: linear p=1 (Goyal et al. 2017), sqrt p=0.5 (often better "
        "for Adam), none p=0 (peak = the optimizer's lr).")
    warmup_samples: int = Field(25_600, ge=0, description="Length of the linear warm-up in samples; in steps "
                                "ceil(warmup_samples / global_batch), so a larger batch warms up in fewer steps "
                                "over the same data. 0: no warm-up.")
    warmup_start: float = Field(0.0, ge=0.0, le=1.0, description="lr at step 0 as a share of the peak; the "
                                "warm-up rises linearly from it to the peak.")
    monitor: Literal["auto", "eval", "train_loss"] = Field(
        "auto", description="What the plateau test watches. eval: only held-out values fed with "
        "observe_metric (launch/train.py: top-1 after each evaluation); train_loss: the EMA of the training "
        "loss, every step; auto: the training-loss EMA until the first held-out value arrives, then the "
        "held-out metric (the tracker restarts on it).")
    eval_mode: Literal["max", "min"] = Field("max", description="Whether a larger held-out value is better "
                                             "(max: accuracy) or a smaller (min: a loss). The training loss "
                                             "is always min.")
    patience: int = Field(200, ge=1, description="Steps without an improvement of the monitored metric (after "
                          "the warm-up and any cooldown) before the lr is multiplied by factor.")
    factor: float = Field(0.5, gt=0.0, lt=1.0, description="Multiplier of the lr at each plateau.")
    cooldown: int = Field(0, ge=0, description="Steps after a decay during which no plateau is counted.")
    min_lr: float = Field(0.0, ge=0.0, description="Floor of the lr after the warm-up (absolute, per parameter "
                          "group): a decay never goes below it.")
    threshold: float = Field(1e-3, ge=0.0, le=1.0, description="An improvement must beat the best value by "
                             "more than this (relative: best * threshold; absolute: threshold).")
    threshold_mode: Literal["rel", "abs"] = Field("rel", description="rel or abs, see threshold.")
    loss_ema: float = Field(0.98, ge=0.0, lt=1.0, description="Smoothing of the training loss: ema = b * ema + "
                            "(1 - b) * loss per step (bias-corrected by 1 - b**n).")


def parse_adaptive_lr(value: Any) -> AdaptiveLRConfig:
    """Validate the ``adaptive_lr`` section (a dict or a model), raising ConfigError naming the key path."""
    return validate_section(AdaptiveLRConfig, value, ADAPTIVE_LR_SECTION)


def check_no_scheduler_clash(raw: dict, client_scheduler: Any = None) -> None:
    """An enabled ``adaptive_lr`` section together with DeepSpeed's ``scheduler`` section (or an
    ``lr_scheduler`` passed to ds_xc.initialize) is refused: two schedules would fight over the lr."""
    section = raw.get(ADAPTIVE_LR_SECTION)
    if not isinstance(section, dict) or not section.get("enabled", True):
        return
    if raw.get("scheduler") is not None:
        kind = raw["scheduler"].get("type") if isinstance(raw["scheduler"], dict) else raw["scheduler"]
        raise ConfigError(f"scheduler: got DeepSpeed's scheduler {kind!r} together with the {ADAPTIVE_LR_SECTION} "
                          f"section; allowed: one of them (remove 'scheduler', or set "
                          f"{ADAPTIVE_LR_SECTION}.enabled=false)")
    if client_scheduler is not None:
        raise ConfigError(f"lr_scheduler: got {type(client_scheduler).__name__} passed to ds_xc.initialize "
                          f"together with the {ADAPTIVE_LR_SECTION} section; allowed: one of them")

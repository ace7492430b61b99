"""AdaptiveLR: warm-up scaled to the global batch, then decay on plateaus of a monitored metric.

Why here: DeepSpeed's schedulers are fixed in advance (WarmupLR, WarmupDecayLR, OneCycle); the
fast-convergence strategy of the 100-million-class system (Song et al., arXiv 2102.06025) adapts
the rate to the run. This class speaks DeepSpeed's scheduler interface (``step``, ``get_lr``,
``get_last_lr``, ``state_dict``, ``load_state_dict``): ``ds_xc.initialize`` passes it to
``deepspeed.initialize`` as ``lr_scheduler`` (built from the ``adaptive_lr`` section,
ds_xc/config_schedule.py), DeepSpeed steps it after every optimizer step and saves and
restores it with its checkpoints; the head follows through ``lr_schedule: follow_engine``.

The rule, with t the number of optimizer steps taken, B the global batch and lr_g the
optimizer's configured lr of parameter group g:

* peak_g = lr_g * (B / reference_batch) ** p, p = 1 (linear), 0.5 (sqrt) or 0 (none);
* warm-up: W = ceil(warmup_samples / B) steps; for t < W, lr = peak_g * (s + (1 - s) * t / W)
  with s = warmup_start;
* afterwards lr = max(min_lr, peak_g * scale), scale = factor ** (number of decays);
* plateau: whenever a value v of the monitored metric is observed at step t, it improves on
  the best value if v > best * (1 + threshold) (mode max, rel), v > best + threshold (max,
  abs), v < best * (1 - threshold) (min, rel) or v < best - threshold (min, abs); an
  improvement (or the first value) sets best = v and last = t. With
  start = max(last, cooldown_until, W): if t >= W and t - start >= patience and some group's
  lr is above min_lr, the lr decays (scale *= factor), cooldown_until = t + cooldown, last = t.

The monitored metric: held-out values fed with :meth:`observe_metric` (mode ``eval_mode``),
else the EMA of the training loss (mode min), fed per micro-step with
:meth:`observe_train_loss` (XCEngine does) and folded in once per step:
ema = b * ema + (1 - b) * mean(window), read bias-corrected as ema / (1 - b ** n).

Every rank may observe its own values (a local loss, a rank-local metric): only rank 0 of the
bound group decides. Each :meth:`step` is one broadcast of rank 0's whole state (a fixed-size
float64 vector) over that explicit group, so every rank holds, applies and checkpoints the
same state and rate. An observed value takes effect at the next ``step``.
"""
from __future__ import annotations

import logging
import math
from typing import Optional

import torch
import torch.distributed as dist

from ds_xc.config_schedule import AdaptiveLRConfig
from ds_xc.parallel.groups import comm_device, group_rank, group_ranks, is_distributed, world_rank_and_size

log = logging.getLogger(__name__)

__all__ = ["AdaptiveLR", "adaptive_lr_factory", "STATE_KEYS"]

_UNBOUND = object()  # bind() not called yet: a distributed step refuses to guess the group
_EXPONENT = {"linear": 1.0, "sqrt": 0.5, "none": 0.0}
# the decision state, in the order of the broadcast vector (best is NaN before the first value)
STATE_KEYS = ("last_step", "scale", "best", "last_improve", "cooldown_until", "ema", "ema_n", "on_eval",
              "decays")


class AdaptiveLR:
    """The adaptive schedule of one optimizer (see the module docstring for the rule).

    ``optimizer``: its param groups' current ``lr`` are the configured rates lr_g.
    ``global_batch`` and ``group`` may come later through :meth:`bind` (ds_xc.initialize binds
    the engine's data-parallel group and ``engine.train_batch_size()`` once the engine exists).
    """

    def __init__(self, optimizer, config: AdaptiveLRConfig, global_batch: Optional[int] = None,
                 group=_UNBOUND):
        self.optimizer = optimizer
        self.config = config
        self.base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        self.group = _UNBOUND
        self.global_batch: Optional[int] = None
        self.warmup_steps = 0
        self.peak_lrs = list(self.base_lrs)
        self.last_step, self.scale, self.best, self.last_improve = 0, 1.0, math.nan, 0
        self.cooldown_until, self.ema, self.ema_n, self.on_eval, self.decays = 0, 0.0, 0, False, 0
        self._pending: Optional[float] = None  # this rank's latest held-out value since the last step
        self._window: list = []  # this rank's training losses since the last step (tensors, unsynced)
        self._last_lr = list(self.base_lrs)
        if global_batch is not None:
            self.bind(group, global_batch)

    # ------------------------------------------------------------------ set-up
    def bind(self, group, global_batch: int) -> None:
        """The group rank 0's decisions are broadcast over (None or a one-rank group: one
        process) and the global batch the warm-up and the peak are scaled to; sets the lr of step 0."""
        if type(global_batch) is not int or global_batch < 1:
            raise ValueError(f"global_batch: got {global_batch!r}; allowed: an int >= 1 (samples per optimizer "
                             "step over all data-parallel ranks)")
        self.group, self.global_batch = group, global_batch
        self.warmup_steps = math.ceil(self.config.warmup_samples / global_batch)
        factor = (global_batch / self.config.reference_batch) ** _EXPONENT[self.config.batch_scaling]
        self.peak_lrs = [b * factor for b in self.base_lrs]
        self._apply()
        log.info("ds_xc: adaptive lr: global batch %d, peak %s (x%.4g of the configured lr), warm-up %d steps",
                 global_batch, [f"{p:.4g}" for p in self.peak_lrs], factor, self.warmup_steps)

    # ------------------------------------------------------------------ observations
    def observe_metric(self, value: float) -> None:
        """A held-out value (e.g. top-1 after an evaluation); rank 0's is used at the next step."""
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"observe_metric: got {value!r}; allowed: a finite number")
        self._pending = value

    def observe_train_loss(self, loss) -> None:
        """One micro-step's training loss (a tensor or a number); non-finite ones are ignored."""
        self._window.append(loss.detach().reshape(-1)[:1] if torch.is_tensor(loss)
                            else torch.tensor([float(loss)]))

    # ------------------------------------------------------------------ DeepSpeed's interface
    def step(self, last_batch_iteration: Optional[int] = None) -> None:
        """After an optimizer step (DeepSpeed calls it): rank 0 folds in what it observed and
        decides, the state is broadcast over the bound group, every rank sets the new lr.
        ``last_batch_iteration`` is accepted for DeepSpeed's interface and ignored: the step
        count is rank 0's (checkpointed)."""
        if self.global_batch is None:
            raise RuntimeError("AdaptiveLR.step before bind(group, global_batch): the warm-up and the group "
                               "that carries rank 0's decision are unknown")
        group = self._decision_group()
        if group is None or group_rank(group) == 0:
            self._decide()
        if group is not None:
            state = torch.tensor(self._pack(), dtype=torch.float64, device=comm_device(group))
            dist.broadcast(state, src=group_ranks(group)[0], group=group)
            self._unpack(state.tolist())
        self._pending, self._window = None, []
        self._apply()

    def get_lr(self) -> list:
        """The lr of every parameter group for the coming step (the schedule's formula)."""
        t = self.last_step
        if t < self.warmup_steps:
            s = self.config.warmup_start
            return [p * (s + (1.0 - s) * t / self.warmup_steps) for p in self.peak_lrs]
        return [max(self.config.min_lr, p * self.scale) for p in self.peak_lrs]

    def get_last_lr(self) -> list:
        """The lrs last written into the optimizer."""
        return list(self._last_lr)

    def state_dict(self) -> dict:
        """The decision state (identical on every rank after each step) and the warm-up geometry."""
        out = {k: getattr(self, k) for k in STATE_KEYS}
        out.update(global_batch=self.global_batch, warmup_steps=self.warmup_steps, peak_lrs=list(self.peak_lrs))
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore the decision state (the geometry follows this run's config and batch)."""
        missing = [k for k in STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"AdaptiveLR.load_state_dict: keys {missing} missing; expected {list(STATE_KEYS)} "
                             "(a state_dict of another scheduler?)")
        self._unpack([float(state[k]) for k in STATE_KEYS])
        if state.get("global_batch") not in (None, self.global_batch):
            log.warning("ds_xc: adaptive lr resumed with global batch %s (saved with %s): warm-up and peak "
                        "follow the new batch", self.global_batch, state["global_batch"])
        self._pending, self._window = None, []
        self._apply()

    # ------------------------------------------------------------------ the decision (rank 0)
    def _decide(self) -> None:
        cfg, t = self.config, self.last_step + 1
        losses = torch.cat(self._window).double().cpu() if self._window else torch.zeros(0, dtype=torch.float64)
        losses = losses[torch.isfinite(losses)]
        if losses.numel():
            self.ema = cfg.loss_ema * self.ema + (1.0 - cfg.loss_ema) * float(losses.mean())
            self.ema_n += 1
        self.last_step = t
        if self._pending is not None and cfg.monitor in ("eval", "auto"):
            if not self.on_eval:  # the first held-out value: the tracker restarts on the held-out metric
                self.on_eval, self.best, self.last_improve = True, math.nan, t
            self._plateau(self._pending, cfg.eval_mode, t)
        elif self.ema_n and (cfg.monitor == "train_loss" or (cfg.monitor == "auto" and not self.on_eval)):
            self._plateau(self.ema / (1.0 - cfg.loss_ema ** self.ema_n), "min", t)

    def _plateau(self, value: float, mode: str, t: int) -> None:
        cfg = self.config
        if math.isnan(self.best) or _improves(value, self.best, mode, cfg.threshold, cfg.threshold_mode):
            self.best, self.last_improve = value, t
        start = max(self.last_improve, self.cooldown_until, self.warmup_steps)
        above_floor = any(p * self.scale > cfg.min_lr for p in self.peak_lrs)
        if t >= self.warmup_steps and t - start >= cfg.patience and above_floor:
            self.scale *= cfg.factor
            self.decays += 1
            self.cooldown_until, self.last_improve = t + cfg.cooldown, t
            log.info("ds_xc: adaptive lr: plateau at step %d (best %.6g): lr x%g -> %s", t, self.best, cfg.factor,
                     [f"{lr:.4g}" for lr in self.get_lr()])

    # ------------------------------------------------------------------ helpers
    def _decision_group(self):
        """The bound group when it has several ranks, None for one process; unbound and
        distributed is an error (never the world implicitly)."""
        if self.group is _UNBOUND:
            if world_rank_and_size()[1] > 1:
                raise RuntimeError("AdaptiveLR.step in a distributed run before bind(group, ...): name the group "
                                   "its rank 0 decides for (ds_xc.initialize binds the engine's data-parallel group)")
            return None
        return self.group if self.group is not None and is_distributed(self.group) else None

    def _pack(self) -> list:
        return [float(getattr(self, k)) for k in STATE_KEYS]

    def _unpack(self, values: list) -> None:
        state = dict(zip(STATE_KEYS, values))
        for k in ("last_step", "last_improve", "cooldown_until", "ema_n", "decays"):
            setattr(self, k, int(state[k]))
        self.scale, self.best, self.ema = state["scale"], state["best"], state["ema"]
        self.on_eval = bool(state["on_eval"])

    def _apply(self) -> None:
        self._last_lr = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr


def _improves(value: float, best: float, mode: str, threshold: float, threshold_mode: str) -> bool:
    if mode == "max":
        return value > (best * (1.0 + threshold) if threshold_mode == "rel" else best + threshold)
    return value < (best * (1.0 - threshold) if threshold_mode == "rel" else best - threshold)


def adaptive_lr_factory(config: AdaptiveLRConfig):
    """What ds_xc.initialize passes to deepspeed.initialize as ``lr_scheduler``: DeepSpeed calls it
    with the optimizer it built (a callable, so that the schedule wraps DeepSpeed's own optimizer)."""
    def build(optimizer) -> AdaptiveLR:
        return AdaptiveLR(optimizer, config)
    return build

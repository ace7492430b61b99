"""The reducers' interface of CompressedOptimizer: what a step of gradient reduction calls.

Two reducers run a CompressedOptimizer's step: ``reduce_gradients()`` after the backward
(ds_xc/compression/optimizer.py), and the overlapped reducer from backward hooks, bucket by
bucket (ds_xc/compression/overlapped.py). Both go through these public methods, in this
order: :meth:`~ReductionSteps.compresses_this_step` (dense or compressed),
:meth:`~ReductionSteps.select_region` per region (or bucket) of the flat layout (error
feedback, statistics sync, selection), the caller's exchange, then
:meth:`~ReductionSteps.close_step` once. CompressedOptimizer inherits them; they read its
state (``self._step``, the residual buffers, the tallies), which stays private to it.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

log = logging.getLogger("ds_xc.compression.optimizer")  # the step log keeps the optimizer's logger

__all__ = ["ReductionSteps"]


class ReductionSteps:
    """Mixin of :class:`ds_xc.compression.optimizer.CompressedOptimizer` (see the module docstring)."""

    @property
    def params(self) -> list[torch.Tensor]:
        """The tensors whose gradients this wrapper reduces, in layout order."""
        return self._params

    @property
    def value_dtype(self) -> torch.dtype:
        """The dtype compressed values travel in (``value_dtype`` of the config)."""
        return self._value_dtype

    def compresses_this_step(self) -> bool:
        """False during warm-up and for ``method: none``: then every gradient goes dense."""
        return self.compressor is not None and self._step >= self.warmup_steps

    def stats_sync_due(self) -> bool:
        """Whether this (compressed) step syncs the |v| statistics before selecting (bayes_prior)."""
        return self.compressor.uses_stats and self._stats_due()

    def density_scale(self) -> float:
        """The factor on the density at this compressed step: during ``density_warmup_steps`` (DGC's
        warm-up) (start / density)^(1 - c / steps) at compressed step c, falling geometrically from
        ``density_warmup_start`` to ``density``; 1 after it (and without one)."""
        cfg = self.config
        c = self._step - self.warmup_steps
        if c >= cfg.density_warmup_steps:
            return 1.0
        return (cfg.density_warmup_start / cfg.density) ** (1.0 - max(c, 0) / cfg.density_warmup_steps)

    def scratch(self, name: str, numel: int, device) -> torch.Tensor:
        """A float32 work buffer ``name`` of ``numel`` elements, reused across steps (never saved)."""
        return self._scratch(name, numel, device)

    def select_region(self, x: torch.Tensor, a: int = 0, b: Optional[int] = None, segments=None, comm=None,
                      sync_stats: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Error feedback and selection on the fresh gradient ``x`` (s,) of the region, positions [a, b)
        and their ``segments`` (default: all): the nonzero counts when the allocation is due, v = e + x,
        the statistics sync over ``comm`` when ``sync_stats``, the selection, e = v - sent. Returns
        (idx (m,) sorted region positions, vals (m,) float32) for the caller's exchange."""
        self.compressor.scale = self.density_scale()
        if self._allocation_due():
            self._count_nonzero(x, segments)
        v = self._accumulate(x, a, b)  # (s,) the region; [a, b) updated
        score = v if self._update_score is None else self._update_score(  # (s,) v in units of Adam's steps
            v, self._scratch("score", v.numel(), v.device), a, v.numel() if b is None else b)
        if sync_stats:
            self._sync_stats(score, segments, comm=comm)
        idx = self._select(score, segments)  # (m,)
        vals = v[idx]  # (m,) a copy: the feedback below leaves it as selected
        self._feedback(v, idx, vals)
        return idx, vals

    def begin_reduction(self) -> dict:
        """Start this step's reduction (after the backward): the counter snapshot for :meth:`close_step`, and
        the step check's clock (ds_xc.compression.pays.StepCheck)."""
        self.step_check.begin(self._step)
        if self._update_score is not None:  # ZeRO-1: the Adam state's snapshot, when due (a collective)
            self._update_score.prepare(self.counter)
        return self.counter.snapshot()

    def close_step(self, before: dict, exchange: Optional[tuple] = None, by_hooks: bool = False) -> None:
        """End this step's reduction: ``exchange`` is (sent, global_sent, comm) of a compressed exchange
        (None: the step was dense), ``before`` the counter snapshot taken at its start. ``by_hooks``:
        the gradients are already reduced, so the next ``step()`` only steps the wrapped optimizer."""
        if exchange is not None:
            self._close_compressed_step(*exchange)
        else:
            self._last = {"compressed": False}
        self._tally["dense_bytes"] += self._dense_step_bytes
        self._last.update(step=self._step, bytes_sent=self.counter.bytes_sent - before["bytes_sent"],
                          bytes_received=self.counter.bytes_received - before["bytes_received"])
        log.debug("compressed reduction step %d: %s", self._step, self._last)
        self.step_check.end(exchange is not None, by_hooks)
        self._step += 1
        self._reduced_by_hooks = self._reduced_by_hooks or by_hooks

    def skip_reduction(self) -> None:
        """Let the next ``step()`` only step the wrapped optimizer (a skipped step: no reduction, the
        residuals stay as they are; the engine has made that step a no-op, and the frozen-variance
        step, which the wrapper takes itself, is left out too)."""
        self._reduced_by_hooks = True
        self._skip_next = True

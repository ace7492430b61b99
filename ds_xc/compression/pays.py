"""Does compression pay for this configuration? A check at start, and the rule users can apply.

Why: on a fast link, or when the selection costs more than the bytes it saves, compressing makes
the step slower, and nothing else would tell. ``CompressedOptimizer.__init__`` calls
:func:`check_config` once: with ``gradient_compression.link_gbit_per_s`` > 0 it predicts the dense
and the compressed reduction of the compressed elements over the exchange's ranks
(:mod:`ds_xc.cost.compression`: the transport's bytes on an alpha-beta ring plus calibrated
compute per element) and logs a WARNING in the ``does not pay`` region (speedup < 1), naming the
numbers and what to do; ``marginal`` and ``pays`` are logged at INFO. With the link unknown (0)
it logs at DEBUG only. :func:`verdict` is the same model for any numbers (docs/compression.md,
"When compression pays").

The start-up check judges the reduction alone. :class:`StepCheck` then judges the whole step on
the running job (:mod:`ds_xc.cost.compression_step`): it times :data:`MEASURE_STEPS` compressed
steps after the warm-ups, counts the nonzero rows of the compressed 2-D gradients once (embedding
tables, whose exact mean can go as rows), and logs once whether the measured compressed step beats
the predicted exact one by more than the extra steps compression needs: a WARNING when it does not.
"""
from __future__ import annotations

import logging
import statistics
import time
from typing import Optional, Sequence

import torch

from ds_xc.compression.config import GradientCompressionConfig
from ds_xc.cost.compression import (BREAK_EVEN, DEFAULT_LATENCY_S, METHODS, PAYS_AT, Calibration, Verdict,
                                    break_even_gbit, verdict)
from ds_xc.cost.comm import Link
from ds_xc.cost.compression_step import StepVerdict, Table, step_verdict, steps_factor as method_steps_factor

log = logging.getLogger(__name__)

__all__ = ["verdict", "Verdict", "Calibration", "break_even_gbit", "exchange", "check_config", "paying_density",
           "PAYS_AT", "BREAK_EVEN", "StepCheck", "StepVerdict", "MEASURE_STEPS", "SETTLE_STEPS"]

MEASURE_STEPS = 20  # compressed steps the step check times (medians)
SETTLE_STEPS = 5  # compressed steps after the warm-ups left out first (allocation, first syncs)


def paying_density(v: Verdict, target: float = PAYS_AT, *, latency_s: float = DEFAULT_LATENCY_S,
                   calibration: Optional[Calibration] = None) -> Optional[float]:
    """The largest density at which ``v``'s configuration reaches speedup ``target`` (None: none does).

    The compressed time is affine in the density (fixed: compute, header, latency; per unit of
    density: the pairs or values), so two evaluations give the line (randomk's deduplication
    bends it a little: an approximation)."""
    dense_s = v.dense.total_s
    same = dict(latency_s=latency_s, value_bytes=v.value_bytes, calibration=calibration, zero_stage=v.zero_stage,
                backend=v.backend)
    at = verdict(v.numel, v.world_size, v.link_gbit_per_s, v.method, v.density, **same).compressed.total_s
    floor = verdict(v.numel, v.world_size, v.link_gbit_per_s, v.method, 1e-12, **same).compressed.total_s
    goal = dense_s / target
    if floor >= goal or v.density <= 0:
        return None
    slope = (at - floor) / v.density
    return 1.0 if slope <= 0 else min(1.0, (goal - floor) / slope)


def _advice(v: Verdict, calibration: Optional[Calibration]) -> str:
    """What to do about a configuration that does not pay: method none, a density that would pay,
    or another method that would (its accuracy is another matter: docs/compression.md, Results)."""
    others = [verdict(v.numel, v.world_size, v.link_gbit_per_s, m, v.density, value_bytes=v.value_bytes,
                      calibration=calibration, zero_stage=v.zero_stage, backend=v.backend)
              for m in METHODS if m != v.method]
    best = max(others, key=lambda o: o.speedup)
    other = (f"; or method '{best.method}' (predicted {best.speedup:.2f}x at this density)"
             if best.speedup >= PAYS_AT else "")
    d_pays = paying_density(v, PAYS_AT, calibration=calibration)
    if d_pays is not None:
        return (f"set method 'none' (dense), or a density <= {d_pays:.2g} (predicted speedup >= {PAYS_AT})"
                + other)
    d_even = paying_density(v, BREAK_EVEN, calibration=calibration)
    if d_even is not None:
        return (f"set method 'none' (dense); no density reaches {PAYS_AT}x, a density <= {d_even:.2g} "
                "only breaks even" + other)
    return (f"set method 'none' (dense): no density pays, the compressed path's compute alone "
            f"({1e3 * v.compressed.compute_s:.3g} ms) costs more than the dense reduction it replaces" + other)


def exchange(optimizer, group=None) -> dict:
    """What the checks model besides the elements: ``zero_stage`` 1 when ``optimizer`` feeds DeepSpeed's
    ZeRO-1 step (ds_xc.compression.zero.ZeroStep says so), and the ``backend`` of ``group`` (nccl, else
    gloo's costs)."""
    backend = "gloo"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        backend = "nccl" if str(torch.distributed.get_backend(group)).lower() == "nccl" else "gloo"
    return {"zero_stage": 1 if getattr(optimizer, "zero_stage", 0) == 1 else 0, "backend": backend}


def check_config(cfg: GradientCompressionConfig, numel: int, world_size: int, hierarchical: bool = False,
                 calibration: Optional[Calibration] = None, *, zero_stage: int = 0,
                 backend: str = "gloo") -> Optional[Verdict]:
    """Log whether compressing ``numel`` elements over ``world_size`` ranks pays on the configured
    link (WARNING when it does not); returns the verdict, or None when nothing was judged.
    ``zero_stage`` 1: the wrapper feeds DeepSpeed's ZeRO-1 step, whose parameter all-gather both
    sides pay (ds_xc.cost.compression); ``backend``: the group's, gloo or nccl."""
    if not cfg.enabled or numel == 0:
        return None
    field = "gradient_compression.link_gbit_per_s"
    if cfg.link_gbit_per_s <= 0:
        log.debug("%s is 0 (unknown): not checking whether compression pays (set it to the slowest link's "
                  "speed to be warned when it does not)", field)
        return None
    if world_size < 2:
        log.debug("compression pays check: %d rank, nothing is communicated", world_size)
        return None
    if cfg.method not in METHODS or hierarchical:
        log.debug("compression pays check: no cost model for method %r%s", cfg.method,
                  " with a hierarchy" if hierarchical else "")
        return None
    vb = 2 if cfg.value_dtype == "bfloat16" else 4
    v = verdict(numel, world_size, cfg.link_gbit_per_s, cfg.method, cfg.density, value_bytes=vb,
                calibration=calibration, zero_stage=zero_stage, backend=backend)
    dense, gather = (("dense all-reduce", "") if zero_stage == 0 else
                     ("ZeRO-1 dense reduce-scatter", " (both with ZeRO-1's parameter all-gather)"))
    numbers = (f"{numel:,} compressed elements, {world_size} ranks, link {cfg.link_gbit_per_s:g} Gbit/s ({field}): "
               f"predicted {dense} {v.dense_ms:.3g} ms vs {cfg.method} at density {cfg.density:g} "
               f"{v.compressed_ms:.3g} ms per step{gather} (speedup {v.speedup:.2f}x)")
    if v.verdict == "does not pay":
        log.warning("gradient compression does not pay here: %s; %s. The model is calibrated on a 2-core CPU "
                    "machine (docs/compression.md, 'When compression pays').", numbers, _advice(v, calibration))
    else:
        log.info("gradient compression %s: %s", v.verdict, numbers)
    return v


class StepCheck:
    """Times a running job's compressed steps and logs once whether compression pays for the step.

    :class:`~ds_xc.compression.optimizer.CompressedOptimizer` calls :meth:`begin` when a step's
    reduction starts and :meth:`end` when it ends. From step ``start`` + :data:`SETTLE_STEPS` on,
    it takes the medians of :data:`MEASURE_STEPS` step intervals (reduction start to reduction
    start) and reductions, then :meth:`judge` logs the :class:`StepVerdict` (kept in
    ``verdict``). Inactive (it never reads a clock) without a link speed, on one rank, with a
    hierarchy, or when nothing is compressed; a reduction done from backward hooks (overlapped,
    the DDP hook) has no separate time, so that ends the check at DEBUG. Each rank judges its own
    measurements and its own rows: nothing is communicated. ``steps_factor`` (the extra steps
    compression needs to the same accuracy) defaults to the method's measured one
    (ds_xc.cost.compression_step.steps_factor). ``zero_stage`` 1: the exact reduction is ZeRO-1's
    dense reduce-scatter on ``backend`` (its parameter all-gather is in both steps)."""

    def __init__(self, cfg: GradientCompressionConfig, tensors: Sequence[torch.Tensor], world_size: int,
                 start: int, hierarchical: bool = False, calibration: Optional[Calibration] = None,
                 steps_factor: Optional[float] = None, *, zero_stage: int = 0, backend: str = "gloo"):
        self.cfg, self.world_size, self.calibration = cfg, world_size, calibration
        self.zero_stage, self.backend = zero_stage, backend
        self.steps_factor = steps_factor if steps_factor is not None else method_steps_factor(cfg.method)
        self.tensors = list(tensors)
        self.start = start + SETTLE_STEPS
        self.active = (cfg.enabled and cfg.method != "none" and cfg.link_gbit_per_s > 0 and world_size > 1
                       and not hierarchical and bool(self.tensors))
        self.verdict: Optional[StepVerdict] = None
        self.tables: list = []  # Table per row-sparse 2-D gradient, counted at the first measured step
        self._dense_numel = sum(t.numel() for t in self.tensors)
        self._t0: Optional[float] = None
        self._prev = -1
        self._steps: list = []
        self._reductions: list = []

    def _clock(self) -> float:
        if self.tensors[0].is_cuda:  # kernels run asynchronously: time what they do, not their launch
            torch.cuda.synchronize(self.tensors[0].device)
        return time.perf_counter()

    def _count_rows(self) -> None:
        """The 2-D gradients as tables of their nonzero rows (before the clock starts: a pass over them)."""
        self.tables, self._dense_numel = [], 0
        for t in self.tensors:
            g = t.grad
            if t.dim() == 2 and g is not None:
                k = int((g != 0).any(dim=1).sum())
                self.tables.append(Table(t.shape[0], t.shape[1], k))
            else:
                self._dense_numel += t.numel()

    def begin(self, step: int) -> None:
        """A reduction of optimizer step ``step`` starts (the gradients of the step are complete)."""
        if not self.active or step < self.start:
            return
        if self._t0 is None:  # the first measured step
            self._count_rows()
        now = self._clock()
        if self._t0 is not None and step == self._prev + 1:
            self._steps.append(now - self._t0)
        self._t0, self._prev = now, step

    def end(self, compressed: bool, by_hooks: bool = False) -> None:
        """The reduction that :meth:`begin` started has ended (``by_hooks``: it ran from backward hooks)."""
        if not self.active:
            return
        if by_hooks:
            self.active = False
            log.debug("compression step check: the reduction runs from backward hooks (overlapped), so it has no "
                      "time of its own; not judged")
            return
        if self._t0 is None:
            return
        if compressed:
            self._reductions.append(self._clock() - self._t0)
        if len(self._steps) >= MEASURE_STEPS and len(self._reductions) >= MEASURE_STEPS:
            self.active = False
            self.judge(statistics.median(self._steps), statistics.median(self._reductions))

    def judge(self, step_s: float, compressed_s: float) -> StepVerdict:
        """Log (WARNING when it does not pay) and keep the verdict on a ``step_s`` step of which
        ``compressed_s`` the compressed reduction."""
        cfg = self.cfg
        link = Link.gbit(cfg.link_gbit_per_s, DEFAULT_LATENCY_S)
        v = step_verdict(step_s, compressed_s, self._dense_numel, self.tables, self.world_size, link,
                         steps_factor=self.steps_factor, calibration=self.calibration, zero_stage=self.zero_stage,
                         backend=self.backend)
        self.verdict = v
        as_rows = v.exact.as_rows
        rows = (f"; {len(as_rows)} table(s) as their {sum(t.nonzero_rows for t in as_rows):,} nonzero rows, "
                f"counted on this rank" if as_rows else "")
        numbers = (f"{cfg.method} step {1e3 * step_s:.4g} ms measured (reduction {1e3 * compressed_s:.4g} ms) vs "
                   f"{1e3 * v.exact_step_s:.4g} ms predicted with the exact {v.exact.kind} "
                   f"({1e3 * v.exact.total_s:.4g} ms at gradient_compression.link_gbit_per_s="
                   f"{cfg.link_gbit_per_s:g}, {self.world_size} ranks{rows}): step speedup {v.step_speedup:.2f}x, "
                   f"{v.speedup:.2f}x to the same accuracy with {v.steps_factor:g}x the steps")
        if v.verdict == "does not pay":
            todo = ("send the tables as rows: method 'none' with extreme_classification.topology.sparse_rows=true "
                    "(under DDP: nn.Embedding(sparse=True))" if as_rows else "set method 'none' (dense)")
            log.warning("gradient compression does not pay for the step: %s; %s (docs/compression.md, 'When "
                        "compression pays').", numbers, todo)
        else:
            log.info("gradient compression %s for the step: %s", v.verdict, numbers)
        return v

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
"""
from __future__ import annotations

import logging
from typing import Optional

from ds_xc.compression.config import GradientCompressionConfig
from ds_xc.cost.compression import (BREAK_EVEN, DEFAULT_LATENCY_S, METHODS, PAYS_AT, Calibration, Verdict,
                                    break_even_gbit, verdict)

log = logging.getLogger(__name__)

__all__ = ["verdict", "Verdict", "Calibration", "break_even_gbit", "check_config", "paying_density", "PAYS_AT", "BREAK_EVEN"]


def paying_density(v: Verdict, target: float = PAYS_AT, *, latency_s: float = DEFAULT_LATENCY_S,
                   calibration: Optional[Calibration] = None) -> Optional[float]:
    """The largest density at which ``v``'s configuration reaches speedup ``target`` (None: none does).

    The compressed time is affine in the density (fixed: compute, header, latency; per unit of
    density: the pairs or values), so two evaluations give the line (randomk's deduplication
    bends it a little: an approximation)."""
    dense_s = v.dense.total_s
    at = verdict(v.numel, v.world_size, v.link_gbit_per_s, v.method, v.density, latency_s=latency_s,
                 value_bytes=v.value_bytes, calibration=calibration).compressed.total_s
    floor = verdict(v.numel, v.world_size, v.link_gbit_per_s, v.method, 1e-12, latency_s=latency_s,
                    value_bytes=v.value_bytes, calibration=calibration).compressed.total_s
    goal = dense_s / target
    if floor >= goal or v.density <= 0:
        return None
    slope = (at - floor) / v.density
    return 1.0 if slope <= 0 else min(1.0, (goal - floor) / slope)


def _advice(v: Verdict, calibration: Optional[Calibration]) -> str:
    """What to do about a configuration that does not pay: method none, a density that would pay,
    or another method that would (its accuracy is another matter: docs/compression.md, Results)."""
    others = [verdict(v.numel, v.world_size, v.link_gbit_per_s, m, v.density, value_bytes=v.value_bytes,
                      calibration=calibration)
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
            f"({1e3 * v.compressed.compute_s:.3g} ms) costs more than the dense all-reduce" + other)


def check_config(cfg: GradientCompressionConfig, numel: int, world_size: int, hierarchical: bool = False,
                 calibration: Optional[Calibration] = None) -> Optional[Verdict]:
    """Log whether compressing ``numel`` elements over ``world_size`` ranks pays on the configured
    link (WARNING when it does not); returns the verdict, or None when nothing was judged."""
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
                calibration=calibration)
    numbers = (f"{numel:,} compressed elements, {world_size} ranks, link {cfg.link_gbit_per_s:g} Gbit/s ({field}): "
               f"predicted dense all-reduce {v.dense_ms:.3g} ms vs {cfg.method} at density {cfg.density:g} "
               f"{v.compressed_ms:.3g} ms per step (speedup {v.speedup:.2f}x)")
    if v.verdict == "does not pay":
        log.warning("gradient compression does not pay here: %s; %s. The model is calibrated on a 2-core CPU "
                    "machine (docs/compression.md, 'When compression pays').", numbers, _advice(v, calibration))
    else:
        log.info("gradient compression %s: %s", v.verdict, numbers)
    return v

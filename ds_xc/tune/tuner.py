"""The tuner: predict every candidate, prune, measure the short list, choose (docs/tuning.md).

1. Every candidate of the space (space.py) is written into the user's config and predicted:
   step time by ds_xc/cost/compute.py (calibrated on this machine), persistent and peak memory
   per rank by ds_xc/cost/memory.py.
2. Pruned without a measurement: a predicted peak above ``max_memory_gib`` (with a 15% margin
   for the model's error), a uniform sampler whose expected recall (its sample rate: a uniform
   active set holds a class with that probability) is below ``min_recall``.
3. Measured in the order of predicted time, the library defaults first (the speed-up's
   reference): a few real head steps each (measure.py). A candidate is skipped without a
   measurement when a measured one that failed the recall target is at least as strong in every
   recall knob (same type, sample rate, scan rows, re-rank, code bits all >=), and the search
   stops when the next prediction is slower than 1.5x the best measured candidate that meets
   the target, or the wall-clock budget is spent.
4. With ``max_accuracy_drop``: the accuracy probe (probe.py). The defaults are probed, then the
   measured candidates that meet every other constraint, fastest first, until one learns as well
   as the defaults (its held-out top-1 at most ``max_accuracy_drop`` below theirs, paired on the
   same samples: probe.py) or
   ``max_probes`` were tried; a candidate no stronger than a rejected one (recall knobs, same
   update mode) is not probed, and one that was not probed cannot be chosen. When rejections
   leave no passing candidate, the search (3.) resumes without them, since the stop rule may have
   ruled out slower, more accurate candidates because of them; then the new ones are probed.
5. The choice: the fastest measured candidate (amortised step) that meets every constraint;
   none: a ``TargetUnreachable`` naming the tightest constraint and the closest candidate.

Measurements are cached (cache.py) under a key of everything they depend on, so an
interrupted run resumes where it stopped.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch.distributed as dist

from ds_xc.config import ConfigError
from ds_xc.cost.compute import Constants, global_batch_of, predict_step_time
from ds_xc.parallel.groups import is_distributed
from ds_xc.tune.cache import MeasurementCache
from ds_xc.tune.space import Candidate, apply, build_space, stronger_or_equal

log = logging.getLogger(__name__)

__all__ = ["Target", "Row", "TargetUnreachable", "predict_all", "prune", "prune_by_screen", "choose", "Tuner",
           "frontier"]

GIB = float(1 << 30)
MEMORY_MARGIN = 1.15  # a predicted peak within 15% above the limit is still measured
STOP_FACTOR = 1.5  # stop when the prediction exceeds 1.5x the best passing measurement


@dataclass
class Target:
    """What the chosen configuration must meet (None: no constraint)."""
    max_memory_gib: Optional[float] = None
    min_recall: Optional[float] = None
    min_speedup: Optional[float] = None
    max_step_s: Optional[float] = None
    max_accuracy_drop: Optional[float] = None  # held-out top-1 of the probe, below the defaults' (a fraction)

    def failures(self, row: "Row", base_s: Optional[float], accuracy: bool = True) -> list:
        """The constraints a measured row misses: [(name, how far, text)]; how far is relative.
        ``accuracy=False`` leaves the probe out (its drop is paired with the defaults: probe.py)."""
        m, out = row.measured, []
        if self.max_memory_gib is not None and m["peak_bytes"] / GIB > self.max_memory_gib:
            gib = m["peak_bytes"] / GIB
            out.append(("max_memory_gib", gib / self.max_memory_gib - 1, f"peak {gib:.2f} GiB per rank > "
                        f"{self.max_memory_gib} GiB"))
        if self.min_recall is not None and m["recall"] < self.min_recall:
            out.append(("min_recall", 1 - m["recall"] / self.min_recall,
                        f"recall@10 {m['recall']:.3f} < {self.min_recall}"))
        speed = row.speedup(base_s)
        if self.min_speedup is not None and speed is not None and speed < self.min_speedup:
            out.append(("min_speedup", 1 - speed / self.min_speedup, f"speed-up {speed:.2f}x < {self.min_speedup}x"))
        if self.max_step_s is not None and m["amortised_s"] > self.max_step_s:
            out.append(("max_step_s", m["amortised_s"] / self.max_step_s - 1,
                        f"step {m['amortised_s']:.3f} s > {self.max_step_s} s"))
        if accuracy and self.max_accuracy_drop is not None and row.cand.tag != "defaults":
            p = row.probe
            if p is None:
                out.append(("max_accuracy_drop", 1.0, "accuracy not probed"))
            elif p["drop"] > self.max_accuracy_drop:
                out.append(("max_accuracy_drop", p["drop"] / max(self.max_accuracy_drop, 1e-9) - 1,
                            f"probe top-1 {p['top1']:.4f} is {100 * p['drop']:.2f} +- {100 * p['se']:.2f} point "
                            f"below the defaults' {p['base_top1']:.4f} on the same {p['samples']} held-out samples "
                            f"(allowed {100 * self.max_accuracy_drop:.2f})"))
        return out


@dataclass
class Row:
    """One candidate: its config, the predictions, the measurement (None: not measured) and why."""
    cand: Candidate
    config: dict
    pred_s: float
    pred_persistent: Optional[float]
    pred_peak: Optional[float]
    measured: Optional[dict] = None
    status: str = "not measured"
    parts: dict = field(default_factory=dict)
    screen: Optional[float] = None  # recall@10 on the shared trained weights (screen.py)
    probe: Optional[dict] = None  # the accuracy probe (probe.py): held-out top1, top5, samples, probe_s

    def speedup(self, base_s: Optional[float]) -> Optional[float]:
        if self.measured is None or not base_s:
            return None
        return base_s / self.measured["amortised_s"]


class TargetUnreachable(RuntimeError):
    """No measured candidate meets the target; the message names the tightest constraint and the
    closest candidate, ``closest`` holds its Row (None when nothing was measured)."""

    def __init__(self, message: str, closest: Optional[Row] = None, rows: Optional[list] = None):
        super().__init__(message)
        self.closest, self.rows = closest, rows or []


def _memory(config: dict, world: int, batch: int) -> tuple:
    """(persistent, peak) bytes per rank from ds_xc/cost/memory.py; (None, None) without it."""
    try:
        from ds_xc.cost.memory import estimate_memory
    except ImportError:
        return None, None
    est = estimate_memory(config, world_size=world, global_batch=batch)
    return float(est.persistent_bytes), float(est.peak_bytes)


def predict_all(raw: dict, world: int, constants: Constants, types=("ann", "uniform", "full")) -> list:
    """A Row per valid candidate of the space, with its predictions (invalid ones are dropped)."""
    batch = global_batch_of(raw, world)
    rows = []
    for cand in build_space(raw, types):
        try:
            config = apply(raw, cand)
        except ConfigError as exc:  # e.g. lazy_exact on a bfloat16 head
            log.info("candidate %s skipped: %s", cand.label(), exc)
            continue
        st = predict_step_time(config, world_size=world, global_batch=batch, constants=constants)
        persistent, peak = _memory(config, world, batch)
        rows.append(Row(cand=cand, config=config, pred_s=st.total_s, pred_persistent=persistent, pred_peak=peak,
                        parts=st.parts))
    return rows


def prune_by_screen(rows: list, target: Target) -> None:
    """Mark the rows whose screened recall misses the target (the defaults are always measured)."""
    for r in rows:
        if target.min_recall is not None and r.screen is not None and r.screen < target.min_recall and \
                r.cand.tag != "defaults" and not r.status.startswith("pruned"):
            r.status = f"pruned: recall {r.screen:.3f} (screen)"


def prune(rows: list, target: Target) -> None:
    """Mark the rows the predictions rule out (status 'pruned: ...')."""
    for r in rows:
        if r.cand.tag == "defaults":
            continue
        if target.max_memory_gib is not None and r.pred_peak is not None and \
                r.pred_peak / GIB > target.max_memory_gib * MEMORY_MARGIN:
            r.status = f"pruned: predicted peak {r.pred_peak / GIB:.2f} GiB"
        elif target.min_recall is not None and r.cand.type == "uniform" and r.cand.sample_rate < target.min_recall:
            r.status = f"pruned: uniform recall ~ rate {r.cand.sample_rate}"


def frontier(rows: list) -> list:
    """The measured rows no other measured row beats in step time, recall and peak memory at once."""
    done = [r for r in rows if r.measured is not None]

    def beats(a, b):
        ma, mb = a.measured, b.measured
        ge = (ma["amortised_s"] <= mb["amortised_s"] and ma["recall"] >= mb["recall"]
              and ma["peak_bytes"] <= mb["peak_bytes"])
        gt = (ma["amortised_s"] < mb["amortised_s"] or ma["recall"] > mb["recall"]
              or ma["peak_bytes"] < mb["peak_bytes"])
        return ge and gt
    return [r for r in done if not any(beats(o, r) for o in done if o is not r)]


LOWER = "probe: lower accuracy"  # the status suffix of a row the probe rejected
SKIPPED = "probe skipped: no stronger than"


def _rejected(row: Row) -> bool:
    """The probe rejected the row, or skipped it as no stronger than a rejected one."""
    return row.status.endswith(LOWER) or SKIPPED in row.status


def _base(rows: list) -> Optional[float]:
    """The defaults' measured step s, None where not measured."""
    base = next((r for r in rows if r.cand.tag == "defaults" and r.measured), None)
    return None if base is None else base.measured["amortised_s"]


def choose(rows: list, target: Target) -> Row:
    """The fastest measured row that meets the target, else TargetUnreachable (see the class)."""
    base_s = _base(rows)
    measured = [r for r in rows if r.measured is not None]
    ok = [r for r in measured if not target.failures(r, base_s)]
    if ok:
        best = min(ok, key=lambda r: r.measured["amortised_s"])
        best.status = "chosen"
        return best
    if not measured:
        raise TargetUnreachable("no candidate was measured (the time budget ran out before the first "
                                "measurement, or every candidate was pruned); raise --time_budget_s", None, rows)
    fails = {id(r): target.failures(r, base_s) for r in measured}
    names = [f[0] for fs in fails.values() for f in fs]
    met = {n: sum(1 for fs in fails.values() if n not in [f[0] for f in fs]) for n in set(names)}
    tightest = min(met, key=lambda n: (met[n], -names.count(n)))
    closest = min(measured, key=lambda r: sum(f[1] for f in fails[id(r)]))
    raise TargetUnreachable(
        f"no configuration meets the target: {tightest} is the tightest constraint (met by {met[tightest]} of "
        f"{len(measured)} measured candidates); the closest candidate is {closest.cand.label()} "
        f"({'; '.join(f[2] for f in fails[id(closest)])})", closest, rows)


class Tuner:
    """Measures the short list in order (see the module docstring); every rank of the head's group
    runs it with the same rows (rank 0's predictions are broadcast) and its own batches."""

    def __init__(self, rows: list, target: Target, measure: Callable[["Row"], dict], cache: MeasurementCache,
                 time_budget_s: float, group=None, progress: Optional[Callable[[Row], None]] = None):
        self.rows, self.target, self.measure, self.cache = rows, target, measure, cache
        self.time_budget_s, self.group, self.progress = time_budget_s, group, progress
        self.t0: Optional[float] = None  # the first run()'s start: the budget covers every round
        self.probes_left: Optional[int] = None

    def _agree(self, flag: bool) -> bool:
        """Rank 0's decision for every rank (the clock differs between ranks)."""
        if not is_distributed(self.group):
            return flag
        box = [flag]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0) if self.group else 0,
                                   group=self.group)
        return bool(box[0])

    def _skip_reason(self, row: Row, best_s: Optional[float]) -> Optional[str]:
        failed = [r for r in self.rows if r.measured is not None and self.target.min_recall is not None
                  and r.measured["recall"] < self.target.min_recall and r.cand.tag != "defaults"]
        for f in failed:
            if stronger_or_equal(f.cand, row.cand):
                return f"skipped: no stronger than {f.cand.label()} (recall {f.measured['recall']:.3f})"
        if best_s is not None and row.pred_s > STOP_FACTOR * best_s:
            return "skipped: predicted slower than the best measured"
        return None

    def run(self) -> int:
        """Measure until the list, the budget or the useful predictions end; returns how many rows
        it measured. Called again after the probe rejected candidates, it measures what they had
        ruled out (rows measured before are kept)."""
        if self.t0 is None:
            self.t0 = time.perf_counter()
        order = sorted((r for r in self.rows if not r.status.startswith("pruned") and r.measured is None),
                       key=lambda r: (r.cand.tag != "defaults", r.pred_s))
        count = 0
        for row in order:
            base_s = _base(self.rows)
            ok = [r for r in self.rows if r.measured is not None and not _rejected(r) and
                  not self.target.failures(r, base_s, accuracy=False)]
            best_s = min((r.measured["amortised_s"] for r in ok), default=None)
            reason = self._skip_reason(row, best_s) if row.cand.tag != "defaults" else None
            if reason:
                row.status = reason
                continue
            cached = self.cache.get(row.cand)
            if cached is None:
                if not self._agree(time.perf_counter() - self.t0 < self.time_budget_s):
                    row.status = "skipped: time budget spent"
                    continue
                cached = self.measure(row)
                self.cache.put(row.cand, cached)
                row.status = "measured"
            else:
                row.status = "measured (cached)"
            row.measured = cached
            count += 1
            if self.progress is not None:
                self.progress(row)
        return count

    def probe(self, probe: Callable[["Row"], dict], max_probes: int = 3) -> int:
        """The accuracy probe (module docstring, 4.): ``probe(row)`` trains and scores one row (cached
        by the caller), at most ``max_probes`` rows besides the defaults over every call. Nothing
        runs without ``max_accuracy_drop``, without a measured defaults row, or when no measured
        candidate that meets the other constraints is faster than the defaults (slower ones count
        too when the defaults miss a constraint). Returns how many rows it rejected: 0 when one
        passed or nothing is left to probe."""
        base = next((r for r in self.rows if r.cand.tag == "defaults" and r.measured), None)
        if self.target.max_accuracy_drop is None or base is None:
            return 0
        if self.probes_left is None:
            self.probes_left = int(max_probes)
        base_s = base.measured["amortised_s"]
        base_ok = not self.target.failures(base, base_s, accuracy=False)  # else slower rows may be chosen
        ok = sorted((r for r in self.rows if r.measured is not None and r is not base and r.probe is None
                     and not _rejected(r) and (r.measured["amortised_s"] < base_s or not base_ok)
                     and not self.target.failures(r, base_s, accuracy=False)),
                    key=lambda r: r.measured["amortised_s"])
        if not ok or self.probes_left < 1:
            return 0
        rejected = [r for r in self.rows if r.status.endswith(LOWER)]
        count = 0
        for row in ([base] if base.probe is None else []) + ok:
            weaker = next((r for r in rejected if r.cand.update == row.cand.update
                           and stronger_or_equal(r.cand, row.cand)), None)
            if weaker is not None:  # no more negatives than a rejected one: no better accuracy expected
                row.status += f"; {SKIPPED} {weaker.cand.label()}"
                continue
            row.probe = probe(row)
            if self.progress is not None:
                self.progress(row)
            if row is base:
                continue
            if not self.target.failures(row, base_s):
                return 0
            row.status += "; " + LOWER
            rejected.append(row)
            count += 1
            self.probes_left -= 1
            if self.probes_left == 0:
                break
        return count

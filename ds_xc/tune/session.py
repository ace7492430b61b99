"""One tuner run end to end (launch/tune.py parses the flags, builds the inputs and prints).

Every rank of the head's group calls :func:`tune` with its own batches; rank 0 calibrates the
time model (or reads the cached constants) and sends the constants to the others, so that
every rank predicts, orders and skips the same candidates.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

from ds_xc.config import HEAD_SECTION
from ds_xc.cost.calibrate import load_or_calibrate, measure_link
from ds_xc.cost.compute import Constants, global_batch_of
from ds_xc.parallel.groups import comm_device, group_ranks, is_distributed, new_groups
from ds_xc.tune.cache import MeasurementCache
from ds_xc.tune.measure import batch_device, measure_candidate
from ds_xc.tune.probe import BLOCK, Z, probe_accuracy
from ds_xc.tune.space import TUNED_KEYS
from ds_xc.tune.screen import pretrain_weight, screen_recall, structure_key
from ds_xc.tune.tuner import Target, Tuner, choose, frontier, predict_all, prune, prune_by_screen

log = logging.getLogger(__name__)

__all__ = ["TuneResult", "tune", "changed_keys", "shared_constants", "cache_context"]


@dataclass
class TuneResult:
    rows: list
    chosen: object  # a tuner.Row
    base: object  # the defaults' Row (None when not measured)
    front: list
    constants: Constants
    context: dict


def changed_keys(before: dict, after: dict, prefix: str = "") -> list:
    """Dotted paths whose values differ between two nested dicts (added and removed keys too)."""
    out = []
    for key in sorted(set(before) | set(after)):
        a, b = before.get(key, "<absent>"), after.get(key, "<absent>")
        path = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += changed_keys(a, b, path + ".")
        elif a != b:
            out.append(path)
    return out


def shared_constants(path: Optional[str], group=None, recalibrate: bool = False, device=None) -> Constants:
    """Rank 0's calibrated (or cached) constants on every rank of ``group`` (the world, or a group
    every world rank calls this for), with the link of ``group``'s collectives measured now (it
    depends on the group and its placement, not on the machine: never cached). ``device``: where the
    job's head runs (the rank's GPU in a GPU job; None: the CPU): the kernels and heads are timed there."""
    if not is_distributed(group):
        return load_or_calibrate(path, recalibrate=recalibrate, device=device)
    # the calibration's heads run on rank 0 alone: a one-rank group per rank (every world rank
    # creates every group, in the same order), so that rank 0's heads wait for no one
    solo = new_groups([[r] for r in group_ranks(None)])
    mine = (load_or_calibrate(path, recalibrate=recalibrate, group=solo, device=device)
            if dist.get_rank(group=group) == 0 else None)
    box = [None if mine is None else mine.to_json()]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    c = Constants.from_json(box[0])
    c.set_link(measure_link(group, solo, device=device))
    return c


def cache_context(raw: dict, world: int, steps: int, warmup: int, data: str) -> dict:
    """What a measurement depends on besides the candidate: the config without the tuned keys."""
    import copy

    import ds_xc
    stripped = copy.deepcopy(raw)
    head = stripped.get(HEAD_SECTION, {})
    for key in TUNED_KEYS:
        section, _, name = key.partition(".")
        if isinstance(head.get(section), dict):
            head[section].pop(name, None)
    return {"config": stripped, "world": world, "global_batch": global_batch_of(raw, world), "steps": steps,
            "warmup": warmup, "data": data, "version": ds_xc.__version__}


def screen(rows: list, raw: dict, cache: MeasurementCache, train_batch, eval_batches, pretrain_steps: int,
           group=None) -> tuple:
    """Every unpruned row's recall on shared trained weights (screen.py), from the cache when there;
    returns (the trained weights, {structure: (index state, build s)}), (None, {}) when all cached."""
    todo = [r for r in rows if not r.status.startswith("pruned")]
    for r in todo:
        r.screen = cache.get_screen(r.cand)
    missing = [r for r in todo if r.screen is None]
    weight, indexes = None, {}
    if missing:
        weight = pretrain_weight(raw[HEAD_SECTION], train_batch, pretrain_steps, group)
        values = screen_recall([r.config[HEAD_SECTION] for r in missing], weight, eval_batches, group, indexes)
        for r, v in zip(missing, values):
            r.screen = v
        cache.put_screens([(r.cand, r.screen) for r in missing])
    return weight, indexes


def held_out_samples(batches: Callable[[], Iterable], group=None) -> int:
    """The number of held-out samples ``batches()`` yields, summed over the ranks of ``group``."""
    t = torch.tensor([sum(int(y.shape[0]) for _, y in batches())], dtype=torch.int64, device=comm_device(group))
    if is_distributed(group):
        dist.all_reduce(t, group=group)
    return int(t.item())


def tune(raw: dict, target: Target, train_batch: Callable[[int], tuple], eval_batches: Callable[[], Iterable], *,
         world: int = 1, group=None, cache_path: Optional[str] = None, constants_path: Optional[str] = None,
         time_budget_s: float = 420.0, steps: int = 4, warmup: int = 2, pretrain_steps: int = 200,
         types=("ann", "uniform", "full"), data: str = "", progress: Optional[Callable] = None,
         is_writer: bool = True, probe_steps: int = 40, probe_batches: Optional[Callable[[], Iterable]] = None,
         max_probes: int = 3) -> TuneResult:
    """Predict, prune, screen the recall, measure, probe the accuracy and choose (tuner.py); raises
    tuner.TargetUnreachable when nothing measured meets the target. ``progress(row)`` after each
    measured row. The accuracy probe (probe.py) runs when ``target.max_accuracy_drop`` is set and
    ``probe_steps`` > 0: ``probe_steps`` head steps per probed candidate, held-out top-1 on
    ``probe_batches()`` (default ``eval_batches``), at most ``max_probes`` candidates besides the
    defaults."""
    if target.max_accuracy_drop is not None and probe_steps <= 0:
        raise ValueError(f"tune: max_accuracy_drop={target.max_accuracy_drop} needs probe_steps > 0 "
                         f"(got {probe_steps}); leave max_accuracy_drop unset to tune without the probe")
    if target.max_accuracy_drop is not None and not target.max_accuracy_drop >= 0.0:
        raise ValueError(f"tune: max_accuracy_drop={target.max_accuracy_drop}; allowed: a fraction >= 0 "
                         "(0.0025 = a quarter point of top-1)")
    t0 = time.perf_counter()
    constants = shared_constants(constants_path, group, device=batch_device(train_batch))
    log.info("tuner: constants ready after %.1f s", time.perf_counter() - t0)
    rows = predict_all(raw, world, constants, types)
    prune(rows, target)
    context = cache_context(raw, world, steps, warmup, data)
    context["pretrain_steps"] = pretrain_steps
    cache = MeasurementCache(cache_path, context, writer=is_writer).load_shared(group)
    weight, indexes = screen(rows, raw, cache, train_batch, eval_batches, pretrain_steps, group)
    prune_by_screen(rows, target)
    log.info("tuner: %d candidates predicted, recall screened after %.1f s", len(rows), time.perf_counter() - t0)

    def measure(row) -> dict:  # from the screen's weights and index (when this run screened)
        section = row.config[HEAD_SECTION]
        state, build_s = indexes.get(structure_key(section.get("sampler", {})), (None, None))
        m = measure_candidate(section, train_batch, eval_batches, steps=steps, warmup=warmup, group=group,
                              recall=False, init_weight=weight, sampler_state=state, build_s=build_s)
        return dict(m, recall=row.screen)
    tuner = Tuner(rows, target, measure, cache, time_budget_s, group=group, progress=progress)
    tuner.run()
    batches = probe_batches or eval_batches
    setting = None  # the probe's cache key part: its steps and held-out sample count

    def probe(row) -> dict:
        nonlocal setting
        if setting is None:  # the same on every rank: the held-out samples of the whole group
            samples = held_out_samples(batches, group)
            if samples == 0:  # every rank sees the same sum: the same error everywhere
                raise ValueError("tune: the accuracy probe has no held-out samples (probe_batches yields none; "
                                 "launch/tune.py: --probe_eval_batches must be >= 1)")
            setting = (f"steps={int(probe_steps)},samples={samples},paired:drop={target.max_accuracy_drop},"
                       f"block={BLOCK},z={Z}")  # a candidate's scored samples depend on all of them
        got = cache.get_probe(row.cand, setting)
        if got is None:
            base = next(r for r in rows if r.cand.tag == "defaults")  # probed first (Tuner.probe)
            got = probe_accuracy(row.config[HEAD_SECTION], train_batch, batches, probe_steps, group,
                                 reference=None if row is base else base.probe, max_drop=target.max_accuracy_drop)
            cache.put_probe(row.cand, setting, got)
        return got
    while tuner.probe(probe, max_probes) and tuner.run():
        pass  # rejected candidates had ruled others out by the stop rule: measure those, probe again
    base = next((r for r in rows if r.cand.tag == "defaults" and r.measured), None)
    front = frontier(rows)
    chosen = choose(rows, target)  # may raise TargetUnreachable
    log.info("tuner: chose %s (%d cached measurements reused)", chosen.cand.label(), cache.hits)
    return TuneResult(rows=rows, chosen=chosen, base=base, front=front, constants=constants, context=context)


def default_cache_dir() -> str:
    """$DS_XC_CACHE or ~/.cache/ds_xc: the constants and the measurement cache."""
    return os.environ.get("DS_XC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ds_xc")

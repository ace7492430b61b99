"""The update score under ZeRO stage 1: Adam's second moment, gathered from its partitions now and then.

Why. ``select_by: update`` ranks each pending value by the step it would make, |v| / sqrt(v-hat)
(score.py). Every rank ranks all of its own elements, so it needs v-hat for every element, but
ZeRO-1 keeps Adam's state partitioned: rank r holds ``exp_avg_sq`` for its slice of each flat
parameter group only. Without it the selection fell back to |v| under ZeRO-1, another selection
than the defaults were chosen with (a ZeRO-1 run then followed another trajectory than ZeRO-0:
benchmarks/results/compression_netns_zero1_fcb70be.md).

What. :class:`ZeroVariance` all-gathers the partitions' ``exp_avg_sq`` into a full-size snapshot
(one fp32 copy of the backbone per rank) at the start of a reduction when the Adam step count s
is due: every step while s <= ``interval`` is a power of two, then every ``interval`` steps
(``gradient_compression.score_sync_interval``). Between refreshes the score divides by the
snapshot (its own step count for the bias correction). v-hat is an average over ~1/(1 - beta2)
steps (1,000 at 0.999), so a snapshot some tens of steps old ranks almost as the live one; with
``interval`` 1 it is the live one and ZeRO-1 ranks exactly as ZeRO-0 (tests/test_compression_zero_score.py).
Bytes: 4 bytes per element every ``interval`` steps (counted in the wrapper's wire counter), beside
ZeRO-1's own all-gather of the parameters, 4 bytes per element every step.

The snapshot lives in the wrapper's per-parameter state (``zero1_exp_avg_sq``, ``zero1_step``), so
the per-rank compression checkpoint carries it and a resume ranks as the uninterrupted run. It
presents the ``state`` and ``param_groups`` that :class:`~ds_xc.compression.score.UpdateScore` reads
(the groups' betas and bias correction are the ZeRO optimizer's, read at every call).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Optional

import torch
import torch.distributed as dist

from ds_xc.compression.momentum import is_adam

log = logging.getLogger(__name__)

__all__ = ["ZeroVariance", "zero_variance_unsupported", "SNAPSHOT", "SNAPSHOT_STEP"]

SNAPSHOT, SNAPSHOT_STEP = "zero1_exp_avg_sq", "zero1_step"  # keys in the wrapper's per-parameter state


def zero_variance_unsupported(zero, params: list, group) -> Optional[str]:
    """Why the partitions of DeepSpeed's ZeRO-1 optimizer ``zero`` cannot give ``params``' v-hat (None: they can)."""
    inner = getattr(zero, "optimizer", None)
    if inner is None or not is_adam(inner):
        return f"ZeRO-1 steps {type(inner).__name__}, not an Adam"
    flats, groups = getattr(zero, "bit16_groups_flat", None), getattr(zero, "bit16_groups", None)
    parts = getattr(zero, "single_partition_of_fp32_groups", None)
    if not (flats and groups and parts) or not (len(flats) == len(groups) == len(parts)):
        return "the ZeRO optimizer has no flat parameter groups with fp32 partitions"
    size = dist.get_world_size(group)
    for flat, part in zip(flats, parts):
        if flat.numel() != size * part.numel():
            return f"a flat group of {flat.numel()} elements is not {size} partitions of {part.numel()}"
    owned = {id(p) for g in groups for p in g}
    if any(id(p) not in owned for p in params):
        return "ZeRO-1's groups do not hold every reduced parameter"
    ours = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    for dp in getattr(zero, "real_dp_process_group", []):
        if dp is not None and dist.get_process_group_ranks(dp) != ours:  # the partitions' order is theirs
            return f"ZeRO-1 partitions over ranks {dist.get_process_group_ranks(dp)}, the wrapper's group is {ours}"
    return None


class _Group(Mapping):
    """One flat group as UpdateScore sees it: the module's parameters, the ZeRO group's other keys now."""

    def __init__(self, zero, index: int, params: list):
        self.zero, self.index, self.params = zero, index, params

    def _source(self) -> dict:
        return self.zero.optimizer.param_groups[self.index]

    def __getitem__(self, key):
        return self.params if key == "params" else self._source()[key]

    def __iter__(self):
        return iter(set(self._source()) | {"params"})

    def __len__(self) -> int:
        return len(set(self._source()) | {"params"})


class _State(Mapping):
    """param -> {"step", "exp_avg_sq"} from the snapshot (empty before the first refresh)."""

    def __init__(self, store):
        self.store = store

    def __getitem__(self, p):
        st = self.store[p]
        if SNAPSHOT not in st:
            return {}
        return {"step": st[SNAPSHOT_STEP], "exp_avg_sq": st[SNAPSHOT]}

    def get(self, p, default=None):
        return self[p] if p in self.store else default

    def __iter__(self):
        return iter(self.store)

    def __len__(self) -> int:
        return len(self.store)


class ZeroVariance:
    """v-hat of every reduced parameter under ZeRO-1, from snapshots of the partitioned Adam state (module
    docstring). ``store``: the wrapper's per-parameter state, where the snapshot is kept and checkpointed."""

    def __init__(self, zero, params: list, store, group, interval: int):
        self.zero, self.group, self.interval = zero, group, int(interval)
        self.store = store
        index = {id(p): i for i, g in enumerate(zero.bit16_groups) for p in g}
        self.param_groups = [_Group(zero, i, [p for p in params if index[id(p)] == i])
                             for i in range(len(zero.bit16_groups))]
        self.state = _State(store)
        self._offsets = []  # (param, group index, offset in its flat group)
        for p in params:
            i = index[id(p)]
            flat = zero.bit16_groups_flat[i]
            offset = (p.data_ptr() - flat.data_ptr()) // p.element_size()
            if not (p.is_contiguous() and 0 <= offset and offset + p.numel() <= flat.numel()):
                raise ValueError(f"ZeroVariance: a parameter of shape {tuple(p.shape)} is not a view of its ZeRO flat "
                                 "group (DeepSpeed's layout changed?)")
            self._offsets.append((p, i, offset))

    def _steps(self) -> Optional[int]:
        """The Adam step count of the partitions (the same on every rank), None before the first step."""
        st = self.zero.optimizer.state.get(self.zero.single_partition_of_fp32_groups[0], {})
        return int(st["step"]) if "exp_avg_sq" in st and "step" in st else None

    def due(self, steps: Optional[int]) -> bool:
        """Whether a snapshot of the state after ``steps`` Adam steps is to be taken now."""
        if steps is None or steps < 1:
            return False
        first = self.store[self._offsets[0][0]] if self._offsets else {}
        taken = int(first[SNAPSHOT_STEP]) if SNAPSHOT in first else None
        if taken == steps:
            return False
        if taken is None:
            return True
        if steps <= self.interval:
            return steps & (steps - 1) == 0
        return steps % self.interval == 0

    @torch.no_grad()
    def refresh_if_due(self, counter=None) -> bool:
        """All-gather the partitions' ``exp_avg_sq`` into the snapshot when due (collective over the group:
        every rank sees the same step count); returns whether it did."""
        steps = self._steps()
        if not self.due(steps):
            return False
        gathered = []
        for i, part in enumerate(self.zero.single_partition_of_fp32_groups):
            sq = self.zero.optimizer.state[part]["exp_avg_sq"].reshape(-1).float()  # (partition,)
            out = torch.empty(self.zero.bit16_groups_flat[i].numel(), dtype=torch.float32, device=sq.device)
            dist.all_gather_into_tensor(out, sq.contiguous(), group=self.group)  # (flat,) in partition order
            gathered.append(out)
            if counter is not None:
                size = dist.get_world_size(self.group)
                counter.add((size - 1) * sq.numel() * 4, (size - 1) * sq.numel() * 4)
        for p, i, offset in self._offsets:
            st = self.store[p]
            view = gathered[i].narrow(0, offset, p.numel()).view_as(p)
            if SNAPSHOT in st and st[SNAPSHOT].shape == p.shape:
                st[SNAPSHOT].copy_(view)
            else:
                st[SNAPSHOT] = view.clone()
            st[SNAPSHOT_STEP] = steps
        log.debug("ZeroVariance: v-hat snapshot after Adam step %d", steps)
        return True

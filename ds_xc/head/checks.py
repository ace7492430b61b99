"""Input checks of the class-parallel head: what one rank can tell alone, and the agreed verdict.

Legend: P ranks, B this rank's rows. ``ClassParallelHead.check_batch`` fills one (P, 5) int64
table per step (row r: rank r's [verdict code, B, first bad position, bad label, out-of-range
labels seen in earlier unchecked steps]), all-reduces it once and reads it with one
``.tolist()``; :func:`decide` turns the table into the same decision on every rank, so that
bad input on one rank raises on all of them instead of leaving the others in a collective.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from ds_xc import config as cfg
from ds_xc.parallel.groups import comm_device

log = logging.getLogger(__name__)

__all__ = ["BAD_INPUT", "NONFINITE", "Verdict", "local_problem", "check_comm_device", "fill_verdict", "decide"]

BAD_INPUT, NONFINITE = 2, 1  # per-rank verdict codes (larger = worse)


@dataclass
class Verdict:
    """What the input check of one step decided: every rank's row count, and whether this
    step's labels were range-checked (False: an unchecked step, see ``ClassParallelHead.flag_unchecked``)."""
    sizes: list
    labels_checked: bool
    full: bool = False  # a full check (finiteness too) was due in this step


def local_problem(head, embeddings: Optional[torch.Tensor], labels: torch.Tensor,
                   num_rows: int, sample_weight: Optional[torch.Tensor] = None) -> Optional[Exception]:
    """Host-side checks of this rank's input (shapes, dtypes, devices; no device work, no sync):
    None when fine, else the error to raise. ``embeddings`` None: the overlap schedule's
    backbone mode, where only the row count is known before the first gather."""
    where = f"on rank {head.rank}"
    check_comm_device(head)
    if embeddings is not None:
        if embeddings.dim() != 2 or embeddings.shape[1] != head.embedding_dim:
            return ValueError(f"embeddings must have shape (batch, {head.embedding_dim}), got "
                              f"{tuple(embeddings.shape)} {where} (sequences: (batch, time, {head.embedding_dim}) "
                              "with labels (batch, time))")
        if not embeddings.is_floating_point():
            return TypeError(f"embeddings must be floating point, got {embeddings.dtype} {where}")
        if embeddings.device != head.weight.device:
            return ValueError(f"embeddings must be on the head's device {head.weight.device}, got "
                              f"{embeddings.device} {where}")
    if labels.shape != (num_rows,):
        return ValueError(f"labels must have shape ({num_rows},) to match the embeddings, got "
                          f"{tuple(labels.shape)} {where}")
    if labels.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        return TypeError(f"labels must be an integer tensor, got {labels.dtype} {where}")
    if labels.device != head.weight.device:
        return ValueError(f"labels must be on the embeddings' device {head.weight.device}, got "
                          f"{labels.device} {where}")
    if sample_weight is not None:
        if sample_weight.shape != labels.shape:
            return ValueError(f"sample_weight must have the labels' shape {tuple(labels.shape)}, got "
                              f"{tuple(sample_weight.shape)} {where}")
        if not sample_weight.is_floating_point() or sample_weight.device != head.weight.device:
            return TypeError(f"sample_weight must be a floating point tensor on {head.weight.device}, got "
                             f"{sample_weight.dtype} on {sample_weight.device} {where}")
    return None


def check_comm_device(head) -> None:
    """Raise at once (before the check's all-reduce, which would hang or fail) when the head's group is
    NCCL and this rank's GPU is not the current device (DeviceBindingError, from comm_device) or the
    head's weight is not on it: NCCL moves tensors of the rank's own GPU only."""
    dev = comm_device(head.group)
    if dev.type == "cuda" and head.weight.device != dev:
        raise ValueError(f"the head's weight is on {head.weight.device}, but its group's collectives (NCCL) run on "
                         f"{dev}, this rank's device (rank {head.rank}); build the head with device={str(dev)!r} "
                         "(ds_xc.initialize does: the engine's device) or move it there with head.to(...)")


def fill_verdict(head, row: torch.Tensor, embeddings: Optional[torch.Tensor], labels: torch.Tensor) -> None:
    """This rank's verdict into ``row`` (5,) on the device, without a host sync: code
    (BAD_INPUT for an out-of-range label, else NONFINITE for NaN/Inf embeddings when they are
    checked), the first bad label's position and value."""
    if labels.numel():
        bad = (labels < 0) | (labels >= head.num_classes)  # (B,); ignore_index rows are fine
        bad &= labels != head.loss_options.ignore_index
        first = torch.argmax(bad.to(torch.int8))  # the first True (0 when none)
        any_bad = bad.any()
        row[2], row[3] = first, labels.index_select(0, first.view(1)).squeeze(0).to(torch.int64)
        code = torch.where(any_bad, BAD_INPUT, 0)
        if embeddings is not None:
            finite = torch.isfinite(embeddings).all(dim=1)  # (B,)
            code = torch.where(any_bad | finite.all(), code, NONFINITE)
            row[2] = torch.where(any_bad, first, torch.argmin(finite.to(torch.int8)))
        row[0] = code


def decide(head, rows_of: list, error: Optional[Exception], batch_sizes, full: bool) -> Optional[Verdict]:
    """Turn the all-reduced table into the same decision on every rank (raise, skip or run)."""
    codes = [r[0] for r in rows_of]
    sizes = [r[1] for r in rows_of]
    mine = codes[head.rank]
    if mine == BAD_INPUT:
        if error is not None:
            raise error
        _, _, pos, value, _ = rows_of[head.rank]
        raise ValueError(f"label {value} at position {pos} on rank {head.rank} is outside "
                         f"[0, {head.num_classes}) and not the ignore_index {head.loss_options.ignore_index}")
    bad = [r for r, c in enumerate(codes) if c == BAD_INPUT]
    if bad:
        raise ValueError(f"another rank reported invalid labels, embedding shape, dtype or device: rank(s) {bad} "
                         f"(this is rank {head.rank}, whose input is {'fine' if not mine else 'non-finite'}); "
                         "see that rank's error")
    if batch_sizes is not None and [int(b) for b in batch_sizes] != sizes:
        wrong = [r for r, (a, b) in enumerate(zip(batch_sizes, sizes)) if int(a) != b]
        raise ValueError(f"batch_sizes {list(batch_sizes)} do not match the rows the ranks passed, {sizes} "
                         f"(wrong for rank(s) {wrong}; this is rank {head.rank}); pass each rank's row count "
                         "or None to have them exchanged")
    late = max(r[4] for r in rows_of)  # the same count on every rank (from the gathered labels)
    if late:
        raise ValueError(f"{late} label(s) outside [0, {head.num_classes}) were seen in the steps since the last "
                         f"check (unchecked steps: {cfg.HEAD_SECTION}.check_inputs={head.check_inputs}, "
                         f"check_interval={head.check_interval}); their steps returned a NaN loss (rank "
                         f"{head.rank})")
    if not any(codes):
        return Verdict(sizes, labels_checked=True, full=full)
    nonfinite = [r for r, c in enumerate(codes) if c]
    if head.nonfinite == "raise":
        if mine:
            raise FloatingPointError(f"embeddings row {rows_of[head.rank][2]} on rank {head.rank} contains NaN "
                                     f"or Inf ({cfg.HEAD_SECTION}.nonfinite='raise')")
        raise FloatingPointError(f"another rank reported NaN or Inf embeddings: rank(s) {nonfinite} (this is "
                                 f"rank {head.rank}; {cfg.HEAD_SECTION}.nonfinite='raise')")
    head.nonfinite_inputs += 1
    log.warning("rank %d: rank(s) %s reported NaN or Inf embeddings; the step is skipped on every rank "
                "(%s.nonfinite='skip')", head.rank, nonfinite, cfg.HEAD_SECTION)
    return None

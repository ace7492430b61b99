"""Input checks of the class-parallel head: what one rank can tell alone, and the agreed verdict.

Legend: P ranks, B this rank's rows. ``ClassParallelHead.check_batch`` fills one (P, 9) int64
table per step (row r: rank r's [verdict code, B, first bad position, bad label, out-of-range
labels seen in earlier unchecked steps, embedding dtype code, embedding width d, fingerprint of
the ``batch_sizes`` it passed (0: None), fingerprint of the head's options]), all-reduces it
once and reads it with one ``.tolist()``; :func:`decide` turns the table into the same decision on
every rank, so that bad input on one rank raises on all of them instead of leaving the others in a
collective, ranks whose embeddings differ in dtype or width raise before the all-gather would
mix their bytes (float16 and bfloat16 rows have one size: gathered, they would be reinterpreted),
a ``batch_sizes`` wrong on one rank only raises on every rank, and so do heads built with
different options (chunk size, loss, sampler, dtype, ...: :func:`head_options`), whose collectives
would not match. :func:`agree_topk` is the same
agreement for ``ClassParallelHead.topk``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from ds_xc import config as cfg
from ds_xc.parallel.agree import DisagreementError, agree, fingerprint
from ds_xc.parallel.collectives import gather_stacked
from ds_xc.parallel.groups import comm_device, is_distributed

log = logging.getLogger(__name__)

__all__ = ["BAD_INPUT", "NONFINITE", "TABLE_COLS", "Verdict", "local_problem", "check_comm_device", "fill_verdict",
           "fill_layout", "decide", "dtype_code", "agree_layout", "batch_sizes_length_error"]

BAD_INPUT, NONFINITE = 2, 1  # per-rank verdict codes (larger = worse)
TABLE_COLS = 9  # columns of the check's table (module docstring)
# embedding dtypes as table codes (0: not known, e.g. the overlap schedule's backbone mode)
_CODED = [torch.float16, torch.bfloat16, torch.float32, torch.float64] + [
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n)]
_OTHER = len(_CODED) + 1  # any other dtype (not floating point: refused by local_problem anyway)


def dtype_code(dtype: torch.dtype) -> int:
    """The table code of an embedding dtype (1.. for the floating dtypes, a catch-all for the rest)."""
    return _CODED.index(dtype) + 1 if dtype in _CODED else _OTHER


def _dtype_name(code: int) -> str:
    return str(_CODED[code - 1]) if 0 < code <= len(_CODED) else "a non-floating dtype"


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


class DtypeDisagreementError(DisagreementError, TypeError):
    """Ranks passed embeddings of different dtypes (a ValueError like every disagreement, and a TypeError)."""


def options_fingerprint(head) -> int:
    """The 64-bit fingerprint of :func:`head_options` (the head keeps it, refreshed when its dtype changes)."""
    return fingerprint(head_options(head))


def head_options(head) -> dict:
    """What every rank of the head's group must share for its collectives to match: the shapes, the weight
    dtype, the loss and its constants, the sampler's config, the chunking, the backend and the check options."""
    loss = {k: v for k, v in vars(head.loss_fn).items() if isinstance(v, (bool, int, float, str))}
    sampler = head.sampler_config
    return {"num_classes": head.num_classes, "embedding_dim": head.embedding_dim, "world_size": head.world_size,
            "dtype": str(head.weight.dtype), "loss": dict(loss, type=type(head.loss_fn).__name__),
            "loss_options": vars(head.loss_options),
            "sampler": sampler.model_dump() if hasattr(sampler, "model_dump") else repr(sampler),
            "chunk_size": head.chunk_size, "softmax_backend": head.softmax_backend, "update": head.update,
            "input_parallel": head.input_parallel, "check_inputs": head.check_inputs,
            "check_interval": head.check_interval, "nonfinite": head.nonfinite}


def fill_layout(row: torch.Tensor, embeddings: Optional[torch.Tensor], batch_sizes, options: int) -> None:
    """This rank's embedding dtype code and width, the fingerprint of its ``batch_sizes`` (0: None) and of its
    head's options into ``row`` (TABLE_COLS,) (kernel arguments, no sync); dtype and width stay 0 when the
    embeddings do not exist yet (backbone mode)."""
    if embeddings is not None:
        row[5].fill_(dtype_code(embeddings.dtype))
        row[6].fill_(int(embeddings.shape[1]) if embeddings.dim() == 2 else 0)
    if batch_sizes is not None:
        row[7].fill_(_sizes_print(batch_sizes))
    row[8].fill_(options)


def _sizes_print(sizes) -> int:
    """A non-zero 64-bit fingerprint of a list of row counts."""
    return fingerprint([int(b) for b in sizes]) or 1


def agree_layout(head, codes: list, dims: list, what: str = "embeddings") -> Optional[torch.dtype]:
    """Raise on every rank when the ranks' embeddings differ in dtype (``codes``, per rank, 0: not known yet)
    or width (``dims``); else the agreed dtype (None: no rank knew it). Every rank holds the same lists."""
    known = {r: c for r, c in enumerate(codes) if c}
    if len(set(known.values())) > 1:
        shown = ", ".join(f"rank {r}: {_dtype_name(c)}" for r, c in known.items())
        raise DtypeDisagreementError(
            f"{what}.dtype differs across the ranks of the head's group: {shown} (this is rank {head.rank}); "
            "allowed: one floating-point dtype on every rank (the rows are all-gathered as they are, so other "
            "dtypes would be mixed or reinterpreted); cast them before the head",
            {r: _dtype_name(c) for r, c in known.items()})
    widths = {r: dims[r] for r in known}
    if len(set(widths.values())) > 1:
        shown = ", ".join(f"rank {r}: {d}" for r, d in widths.items())
        raise DisagreementError(f"{what}.shape[1] (embedding_dim) differs across the ranks of the head's group: "
                                f"{shown} (this is rank {head.rank}); allowed: one embedding_dim on every rank",
                                widths)
    code = next(iter(known.values()), 0)
    return _CODED[code - 1] if 0 < code <= len(_CODED) else None


def _agree_batch_sizes(head, batch_sizes, sizes: list, prints: list, what: str) -> None:
    """Raise on every rank when any rank passed ``batch_sizes`` other than the exchanged ``sizes``
    (``prints``: every rank's fingerprint of its list, 0 for None)."""
    wrong_ranks = [r for r, f in enumerate(prints) if f and f != _sizes_print(sizes)]
    if not wrong_ranks:
        return
    if batch_sizes is not None and [int(b) for b in batch_sizes] != sizes:
        wrong = [r for r, (a, b) in enumerate(zip(batch_sizes, sizes)) if int(a) != b]
        raise ValueError(f"{what}batch_sizes {list(batch_sizes)} do not match the rows the ranks passed, {sizes} "
                         f"(wrong for rank(s) {wrong}; this is rank {head.rank}); pass each rank's row count "
                         "or None to have them exchanged")
    raise ValueError(f"{what}rank(s) {wrong_ranks} passed batch_sizes that do not match the rows the ranks passed, "
                     f"{sizes} (this is rank {head.rank}, whose batch_sizes are "
                     f"{'None' if batch_sizes is None else 'right'}); see that rank's error")


def decide(head, rows_of: list, error: Optional[Exception], batch_sizes, full: bool) -> Optional[Verdict]:
    """Turn the all-reduced table into the same decision on every rank (raise, skip or run)."""
    codes = [r[0] for r in rows_of]
    sizes = [r[1] for r in rows_of]
    mine = codes[head.rank]
    if mine == BAD_INPUT:
        if error is not None:
            raise error
        pos, value = rows_of[head.rank][2:4]
        raise ValueError(f"label {value} at position {pos} on rank {head.rank} is outside "
                         f"[0, {head.num_classes}) and not the ignore_index {head.loss_options.ignore_index}")
    bad = [r for r, c in enumerate(codes) if c == BAD_INPUT]
    if bad:
        raise ValueError(f"another rank reported invalid labels, embedding shape, dtype or device: rank(s) {bad} "
                         f"(this is rank {head.rank}, whose input is {'fine' if not mine else 'non-finite'}); "
                         "see that rank's error (it names the labels, embeddings or batch_sizes at fault)")
    if len({r[8] for r in rows_of}) > 1:  # every rank sees it: every rank gathers the options, raising on all
        agree(head_options(head), "the head's options (ClassParallelHead arguments / the extreme_classification "
              "section; allowed: the same on every rank of the head's group)", head.group)
    head.agreed_dtype = agree_layout(head, [r[5] for r in rows_of], [r[6] for r in rows_of]) or head.agreed_dtype
    _agree_batch_sizes(head, batch_sizes, sizes, [r[7] for r in rows_of], "")
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


def batch_sizes_length_error(head, batch_sizes, what: str = "") -> Optional[ValueError]:
    """The error for ``batch_sizes`` without one entry per rank of the head's group (None: fine or not given)."""
    if batch_sizes is None or len(batch_sizes) == head.world_size:
        return None
    return ValueError(f"{what}batch_sizes has {len(batch_sizes)} entries {list(batch_sizes)}; allowed: one entry "
                      f"per rank of the head's group, {head.world_size} (rank {head.rank})")


def agree_topk(head, embeddings: torch.Tensor, k: int, batch_sizes) -> tuple[list, list]:
    """``ClassParallelHead.topk``'s input check, agreed before its gathers: every rank sends [error flag, rows,
    embedding dtype code, width, k, batch_sizes fingerprint, rows with NaN/Inf] in one small all-gather (one
    host sync, as the row-count exchange it replaces). Raises on every rank for a bad input on any rank, and for
    ranks that differ in ``k``, embedding dtype or width, or whose ``batch_sizes`` are wrong. Returns (every
    rank's row count, every rank's count of rows holding NaN or Inf)."""
    check_comm_device(head)
    where = f"on rank {head.rank}"
    error = None
    if k < 1:
        error = ValueError(f"topk: k must be >= 1, got {k} (rank {head.rank})")
    elif (error := batch_sizes_length_error(head, batch_sizes, "topk: ")) is not None:
        pass
    elif embeddings.dim() != 2 or embeddings.shape[1] != head.embedding_dim:
        error = ValueError(f"topk: embeddings must have shape (batch, {head.embedding_dim}), got "
                           f"{tuple(embeddings.shape)} {where}")
    elif not embeddings.is_floating_point():
        error = TypeError(f"topk: embeddings must be floating point, got {embeddings.dtype} {where}")
    elif embeddings.device != head.weight.device:
        error = ValueError(f"topk: embeddings must be on the head's device {head.weight.device}, got "
                           f"{embeddings.device} {where}")
    mine = torch.zeros((1, 7), dtype=torch.int64, device=head.weight.device)
    mine[0, 1].fill_(embeddings.shape[0] if embeddings.dim() else 0)
    mine[0, 2].fill_(dtype_code(embeddings.dtype))
    mine[0, 3].fill_(embeddings.shape[1] if embeddings.dim() == 2 else 0)
    mine[0, 4].fill_(int(k))
    if batch_sizes is not None:
        mine[0, 5].fill_(_sizes_print(batch_sizes))
    if error is not None:
        mine[0, 0].fill_(1)
    elif embeddings.numel():
        mine[0, 6] = (~torch.isfinite(embeddings).all(dim=1)).sum()
    table = (gather_stacked(mine, head.group).view(-1, 7) if is_distributed(head.group) else mine).tolist()
    failed = [r for r, row in enumerate(table) if row[0]]
    if error is not None:
        raise error
    if failed:
        raise ValueError(f"topk: another rank reported invalid input (k, batch_sizes, embedding shape, dtype or "
                         f"device): rank(s) {failed} (this is rank {head.rank}); see that rank's error")
    ks = [row[4] for row in table]
    if len(set(ks)) > 1:
        shown = ", ".join(f"rank {r}: {v}" for r, v in enumerate(ks))
        raise DisagreementError(f"topk: k differs across the ranks of the head's group: {shown} (this is rank "
                                f"{head.rank}); allowed: the same k on every rank", dict(enumerate(ks)))
    agree_layout(head, [row[2] for row in table], [row[3] for row in table], "topk: embeddings")
    sizes = [row[1] for row in table]
    _agree_batch_sizes(head, batch_sizes, sizes, [row[5] for row in table], "topk: ")
    return sizes, [row[6] for row in table]

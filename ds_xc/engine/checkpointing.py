"""Saving and loading an XCEngine: the DeepSpeed engine's files plus every rank's head shard,
error-feedback residuals and RNG states, staged and agreed between the ranks.

Staged, so that a process killed at any point leaves the previous checkpoint and ``latest``
as they were: every file goes into ``save_dir/.staging_<tag>``, then rank 0 fsyncs the
files, renames the folder to ``save_dir/<tag>`` and replaces ``latest`` atomically. Agreed
(``ds_xc.parallel.agree``), so that a failure on one rank is an error on every rank and
nothing is published or loaded. :meth:`XCEngine.save_checkpoint` and
:meth:`XCEngine.load_checkpoint` call these functions.
"""
from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import shutil
from typing import Optional

from ds_xc.checkpoint import (CheckpointError, apply_head_state, atomic_save, fsync_tree, publish_tag,
                              read_head_state, resolve_tag, save_head_state)
from ds_xc.checkpoint.options import compare_head_options, head_options
from ds_xc.checkpoint.lock import LOCK_PREFIX, acquire_save_lock, lock_is_held, release_save_lock, remove_stale_lock
from ds_xc.checkpoint.shared import check_shared_dir
from ds_xc.engine.rng import apply_rng_state, read_rng_state, rng_file, rng_state
from ds_xc.manifest import verify_manifest_all_ranks, write_manifest_all_ranks
from ds_xc.parallel.agree import agree, all_or_none
from ds_xc.parallel.groups import group_rank

log = logging.getLogger(__name__)

__all__ = ["STAGING_PREFIX", "MAX_TAG_CHARS", "check_tag", "save_engine_checkpoint", "load_engine_checkpoint",
           "read_engine_checkpoint", "check_engine_files"]

STAGING_PREFIX = ".staging_"
# a tag names the folders <tag>, .staging_<tag>, .old_<tag>, .lock_<tag>.stale_<32 hex>: 200 characters keep
# the longest (tag + 45) under the 255 bytes a file name may have on every common file system
MAX_TAG_CHARS = 200
_TAG_CHARS = re.compile(r"[A-Za-z0-9_+=@-][A-Za-z0-9._+=@-]*")


def check_tag(tag: str) -> str:
    """``tag`` if it can name a checkpoint folder, else ValueError naming the value, the limit and the
    characters allowed (checked before anything is written: a long tag used to fail mid-save on the
    staging folder's name)."""
    if len(tag) > MAX_TAG_CHARS:
        raise ValueError(f"checkpoint tag {tag[:40]!r}... has {len(tag)} characters; at most {MAX_TAG_CHARS} are "
                         f"allowed (the save also names folders '{STAGING_PREFIX}<tag>' and '.old_<tag>', and a "
                         "file name may have 255 bytes)")
    if tag == "latest" or not _TAG_CHARS.fullmatch(tag):
        raise ValueError(f"checkpoint tag {tag!r}: must be a plain folder name of letters, digits and "
                         "'.', '_', '-', '+', '=', '@' (not starting with '.', no '/' or spaces), and not 'latest'")
    return tag


def _checked_tag(xc, tag: Optional[str]) -> str:
    return check_tag(str(tag or f"global_step{xc.global_steps}"))


def _check_window(xc) -> None:
    """Refuse a save inside a gradient-accumulation window: the gradients accumulated so far are not part
    of a checkpoint, so a resume would start the window over and silently lose those micro-steps."""
    gas = int(xc.engine.gradient_accumulation_steps())
    done = int(getattr(xc.engine, "micro_steps", 0)) % gas  # DeepSpeed counts every engine.step() call
    if done:
        raise RuntimeError(
            f"save_checkpoint at global step {xc.global_steps}: inside a gradient-accumulation window ({done} of "
            f"gradient_accumulation_steps={gas} micro-steps done since the last optimizer step). Their gradients "
            "are not part of a checkpoint, so a resume would continue one window behind; save after the "
            f"xc.step() that completes the window ({gas - done} more micro-step(s)); nothing was written")


def _clear_staging(save_dir: str, tag: str) -> None:
    """Remove staging folders left by killed saves: this tag's (its lock is ours now), and other tags' whose
    save lock no live process holds (a concurrent job's save of another tag is left alone); and the locks
    that killed saves of other tags left."""
    for name in os.listdir(save_dir):
        if name.startswith(LOCK_PREFIX) and ".stale_" not in name and name != LOCK_PREFIX + tag:
            remove_stale_lock(save_dir, name[len(LOCK_PREFIX):])
        if name.startswith(STAGING_PREFIX):
            other = name[len(STAGING_PREFIX):]
            if other == tag or not lock_is_held(save_dir, other):
                shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)


def save_engine_checkpoint(xc, save_dir: str, tag: Optional[str], client_state: Optional[dict]) -> str:
    """Write the checkpoint of ``xc`` (an XCEngine) as ``save_dir/<tag>``; collective over its flag group
    (a copy of the engine's data-parallel group), whose rank 0 prepares and publishes the folder."""
    group = xc.flag_group
    with all_or_none("save_checkpoint (checking the tag and the accumulation window)", group):
        tag = _checked_tag(xc, tag)
        _check_window(xc)
    agree((os.path.abspath(save_dir), tag), "save_checkpoint(save_dir, tag)", group)
    rank0 = group_rank(group) == 0
    lock = None
    try:
        with all_or_none(f"save_checkpoint: taking the save lock of {tag!r} in {save_dir!r} (rank 0)", group):
            if rank0:
                os.makedirs(save_dir, exist_ok=True)
                lock = acquire_save_lock(save_dir, tag)
                _clear_staging(save_dir, tag)
        return _save_locked(xc, save_dir, tag, client_state, group)
    finally:
        if lock is not None:
            release_save_lock(save_dir, tag, lock)


def _save_locked(xc, save_dir: str, tag: str, client_state: Optional[dict], group) -> str:
    """The save of :func:`save_engine_checkpoint` once rank 0 holds the tag's lock."""
    rank0 = group_rank(group) == 0
    staging = os.path.join(save_dir, STAGING_PREFIX + tag)
    check_shared_dir(save_dir, group, "save_checkpoint", create=True)  # one folder on every node, or refused
    with all_or_none(f"save_checkpoint: writing the head shards, residuals and RNG states into {staging!r}",
                     group):
        if hasattr(xc.head_optimizer, "catch_up_all"):  # update lazy_exact: save up-to-date rows
            xc.head_optimizer.catch_up_all()
        save_head_state(staging, xc.head, xc.head_optimizer, options=_options(xc))
        if xc.compression is not None:  # per-rank residuals: DeepSpeed saves rank 0's optimizer only
            from ds_xc.compression import save_compression_state
            save_compression_state(staging, xc.compression)
        atomic_save(rng_state(), rng_file(staging, group))
    state = dict(client_state or {})
    state["ds_xc"] = {"num_classes": xc.head.num_classes, "world_size": xc.head.world_size,
                      "skipped_steps": xc.skipped_steps}
    xc.engine.save_checkpoint(save_dir, tag=STAGING_PREFIX + tag, client_state=state, save_latest=False)
    write_manifest_all_ranks(staging, group)
    with all_or_none(f"save_checkpoint: publishing {os.path.join(save_dir, tag)!r} (rank 0)", group):
        if rank0:
            fsync_tree(staging)
            publish_tag(save_dir, tag, staging)
    log.info("checkpoint %s saved", os.path.join(save_dir, tag))
    return tag


def _agreed_tag(load_dir: str, tag: Optional[str], group) -> Optional[str]:
    """``tag``, or the one ``load_dir/latest`` names (None: no checkpoint), agreed by every rank."""
    with all_or_none(f"load_checkpoint: reading {os.path.join(load_dir, 'latest')!r}", group):
        if tag is None:
            latest = os.path.join(load_dir, "latest")
            if os.path.isfile(latest):
                with open(latest) as fh:
                    tag = fh.read().strip()
    agree((os.path.abspath(load_dir), None if tag is None else str(tag)), "load_checkpoint(load_dir, tag "
          "or the tag in latest)", group)
    return None if tag is None else str(tag)


def load_engine_checkpoint(xc, load_dir: str, tag: Optional[str]) -> Optional[dict]:
    """Load a checkpoint into ``xc`` (an XCEngine); returns the client state, None when there is none."""
    group = xc.flag_group
    agree((os.path.abspath(load_dir), None if tag is None else str(tag)), "load_checkpoint(load_dir, tag)", group)
    check_shared_dir(load_dir, group, "load_checkpoint", create=False, tag=tag)  # reads only: works read-only
    tag = _agreed_tag(load_dir, tag, group)
    if tag is None:
        return None
    tag_dir = os.path.join(load_dir, tag)
    with all_or_none(f"load_checkpoint: locating {tag_dir!r}", group):
        if group_rank(group) == 0 and not os.path.isdir(tag_dir):
            with contextlib.suppress(FileNotFoundError):
                resolve_tag(load_dir, tag)  # puts back a tag whose re-save was killed between renames
    verify_manifest_all_ranks(tag_dir, group)  # a truncated or bit-flipped file: refused on every rank
    with all_or_none(f"load_checkpoint: reading {tag_dir!r}", group):  # refuse before anything loads
        head_state, comp_state, rng = read_engine_checkpoint(xc, tag_dir)
        changes = compare_head_options(head_state, xc.head, xc.head_optimizer, _options(xc), tag_dir)
    path, client_state = xc.engine.load_checkpoint(load_dir, tag=tag)
    agree(path is not None, f"load_checkpoint: DeepSpeed found a checkpoint for tag {tag!r} in {load_dir!r}",
          group)
    if path is None:
        raise FileNotFoundError(f"DeepSpeed found no checkpoint for tag {tag!r} in {load_dir!r}")
    with all_or_none(f"load_checkpoint: loading the head shard, residuals and RNG state of {tag_dir!r}", group):
        apply_head_state(xc.head, xc.head_optimizer, head_state)
        if xc.compression is not None:  # absent or other world size: residuals restart (warned)
            from ds_xc.compression.checkpoint import apply_compression_state
            apply_compression_state(tag_dir, xc.compression, *comp_state)
        apply_rng_state(rng, tag_dir, group)
    if changes and group_rank(group) == 0:
        log.warning("loaded %s with a head configured differently: %s", tag_dir, "; ".join(changes))
    return client_state or {}


def _options(xc) -> dict:
    """The head's options to record in (and compare with) a checkpoint: sampler, head optimizer, loss."""
    section = xc.config.extreme_classification
    return head_options(xc.head, section.optimizer, section.loss)


def read_engine_checkpoint(xc, tag_dir: str) -> tuple:
    """This rank's head shard, compression state and RNG state, read and checked; DeepSpeed's
    files checked present and readable. Changes nothing (the load happens after agreement)."""
    head_state = read_head_state(tag_dir, xc.head)
    comp_state = (None, False)
    if xc.compression is not None:
        from ds_xc.compression.checkpoint import read_compression_state
        comp_state = read_compression_state(tag_dir, xc.compression)
    rng = read_rng_state(tag_dir, xc.flag_group)
    check_engine_files(tag_dir, xc.engine)
    return head_state, comp_state, rng


def check_engine_files(tag_dir: str, engine) -> None:
    """DeepSpeed's files of ``tag_dir`` this rank will read exist and are complete torch zip files.

    DeepSpeed reads them with collectives around, so a rank that failed inside its load would
    leave the others waiting; checking here (the zip directory at the end of each file: a
    truncated file has none) turns a missing or cut file into an agreed error first."""
    import zipfile
    model = os.path.join(tag_dir, "mp_rank_00_model_states.pt")
    files = [model] + (sorted(glob.glob(os.path.join(tag_dir, "*zero_pp_rank_*_optim_states.pt")))
                       if engine.zero_optimization_stage() in (1, 2) else [])
    for path in files:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"DeepSpeed checkpoint file {path!r} is missing")
        try:
            with zipfile.ZipFile(path) as zf:
                zf.namelist()
        except (zipfile.BadZipFile, OSError) as exc:
            raise CheckpointError(f"cannot read DeepSpeed checkpoint file {path!r} (damaged or truncated): "
                                  f"{exc}") from None


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
import shutil
from typing import Optional

from ds_xc.checkpoint import (CheckpointError, apply_head_state, atomic_save, fsync_tree, publish_tag,
                              read_head_state, resolve_tag, save_head_state)
from ds_xc.checkpoint.shared import check_shared_dir
from ds_xc.engine.rng import apply_rng_state, read_rng_state, rng_file, rng_state
from ds_xc.manifest import verify_manifest_all_ranks, write_manifest_all_ranks
from ds_xc.parallel.agree import agree, all_or_none
from ds_xc.parallel.groups import group_rank

log = logging.getLogger(__name__)

__all__ = ["STAGING_PREFIX", "save_engine_checkpoint", "load_engine_checkpoint", "read_engine_checkpoint",
           "check_engine_files"]

STAGING_PREFIX = ".staging_"


def _checked_tag(xc, tag: Optional[str]) -> str:
    tag = str(tag or f"global_step{xc.global_steps}")
    if not tag or os.sep in tag or tag.startswith(".") or tag == "latest":
        raise ValueError(f"checkpoint tag {tag!r}: must be a plain folder name (no '/', not starting "
                         "with '.', not 'latest')")
    return tag


def _clear_staging(save_dir: str) -> None:
    """Create ``save_dir`` and remove staging folders left by saves that were killed (one job per save_dir)."""
    os.makedirs(save_dir, exist_ok=True)
    for name in os.listdir(save_dir):
        if name.startswith(STAGING_PREFIX):
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)


def save_engine_checkpoint(xc, save_dir: str, tag: Optional[str], client_state: Optional[dict]) -> str:
    """Write the checkpoint of ``xc`` (an XCEngine) as ``save_dir/<tag>``; collective over its flag group
    (a copy of the engine's data-parallel group), whose rank 0 prepares and publishes the folder."""
    group = xc.flag_group
    with all_or_none("save_checkpoint (checking the tag)", group):
        tag = _checked_tag(xc, tag)
    agree((os.path.abspath(save_dir), tag), "save_checkpoint(save_dir, tag)", group)
    rank0 = group_rank(group) == 0
    staging = os.path.join(save_dir, STAGING_PREFIX + tag)
    with all_or_none(f"save_checkpoint: preparing {save_dir!r}", group):
        if rank0:
            _clear_staging(save_dir)
    check_shared_dir(save_dir, group, "save_checkpoint", create=True)  # one folder on every node, or refused
    with all_or_none(f"save_checkpoint: writing the head shards, residuals and RNG states into {staging!r}",
                     group):
        if hasattr(xc.head_optimizer, "catch_up_all"):  # update lazy_exact: save up-to-date rows
            xc.head_optimizer.catch_up_all()
        save_head_state(staging, xc.head, xc.head_optimizer)
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
    check_shared_dir(load_dir, group, "load_checkpoint", create=False)
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
    return client_state or {}


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


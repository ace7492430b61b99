"""Per-rank checkpoints of the compression state (residuals differ on every rank).

DeepSpeed writes the optimizer state of data-parallel rank 0 only (ZeRO 0 assumes
replicated optimizer state), but error-feedback residuals are per rank. So the DeepSpeed
integration keeps them out of ``state_dict()`` and saves one file per rank::

    <tag>/ds_xc_compression/rank_00000_of_00002.pt

A resume on another world size finds no file for its (rank, world) pair: the residuals
and thresholds restart from zero with a warning, and the step counter comes from rank 0.
"""
from __future__ import annotations

import glob
import logging
import os

import torch

from ds_xc.checkpoint import atomic_save
from ds_xc.parallel.groups import group_rank, group_size

log = logging.getLogger(__name__)

__all__ = ["save_compression_state", "load_compression_state", "compression_file"]

COMPRESSION_DIR = "ds_xc_compression"


def compression_file(tag_dir: str, rank: int, world_size: int) -> str:
    return os.path.join(tag_dir, COMPRESSION_DIR, f"rank_{rank:05d}_of_{world_size:05d}.pt")


def save_compression_state(tag_dir: str, optimizer) -> str:
    """Write this rank's compression state (residuals, thresholds, step) under ``tag_dir``."""
    path = compression_file(tag_dir, group_rank(optimizer.group), group_size(optimizer.group))
    atomic_save(optimizer.compression_state_dict(rank_state=True), path)
    log.info("saved compression state %s", path)
    return path


def load_compression_state(tag_dir: str, optimizer) -> bool:
    """Load this rank's file; False (and a fresh start of the residuals) when the checkpoint has none."""
    rank, world = group_rank(optimizer.group), group_size(optimizer.group)
    path = compression_file(tag_dir, rank, world)
    if os.path.isfile(path):
        optimizer.load_compression_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        log.info("loaded compression state %s", path)
        return True
    mine = compression_file(tag_dir, 0, world)
    others = [f for f in sorted(glob.glob(os.path.join(tag_dir, COMPRESSION_DIR, "rank_00000_of_*.pt")))
              if f != mine]
    if os.path.isfile(mine):  # same world size, but this rank's file is gone
        raise FileNotFoundError(f"compression state {path!r} is missing from checkpoint {tag_dir!r}")
    if not others:
        log.warning("checkpoint %s has no compression state: error-feedback residuals start from zero", tag_dir)
        return False
    state = torch.load(others[0], map_location="cpu", weights_only=True)
    optimizer.load_compression_state_dict(state)  # world size differs: keeps the step, warns, restarts residuals
    return False

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

from ds_xc.checkpoint import CheckpointError, atomic_save, load_file
from ds_xc.parallel.agree import agree, all_or_none
from ds_xc.parallel.groups import group_rank, group_size

log = logging.getLogger(__name__)

__all__ = ["save_compression_state", "load_compression_state", "read_compression_state", "apply_compression_state",
           "compression_file"]

COMPRESSION_DIR = "ds_xc_compression"


def compression_file(tag_dir: str, rank: int, world_size: int) -> str:
    return os.path.join(tag_dir, COMPRESSION_DIR, f"rank_{rank:05d}_of_{world_size:05d}.pt")


def save_compression_state(tag_dir: str, optimizer) -> str:
    """Write this rank's compression state (residuals, thresholds, step) under ``tag_dir``."""
    path = compression_file(tag_dir, group_rank(optimizer.group), group_size(optimizer.group))
    atomic_save(optimizer.compression_state_dict(rank_state=True), path)
    log.info("saved compression state %s", path)
    return path


def read_compression_state(tag_dir: str, optimizer):
    """This rank's saved compression state, checked against ``optimizer``, without changing anything.

    Returns (state, own): ``own`` is True for this rank's file of the same world size; False
    for rank 0's file of another world size (only the step counters are kept); state None when
    the checkpoint has no compression state. No collectives: :func:`load_compression_state`
    and XCEngine.load_checkpoint agree on the outcome across ranks. A damaged file raises
    ds_xc.checkpoint.CheckpointError naming it; a file of another run (other tensors) a
    CheckpointError naming the file and the sizes.
    """
    rank, world = group_rank(optimizer.group), group_size(optimizer.group)
    path = compression_file(tag_dir, rank, world)
    mine = compression_file(tag_dir, 0, world)
    if os.path.isfile(path):
        own = True
    elif os.path.isfile(mine):  # same world size, but this rank's file is gone
        raise FileNotFoundError(f"compression state {path!r} is missing from checkpoint {tag_dir!r} "
                                f"(rank 0's {os.path.basename(mine)} is there)")
    else:
        others = sorted(glob.glob(os.path.join(tag_dir, COMPRESSION_DIR, "rank_00000_of_*.pt")))
        if not others:
            return None, False
        path, own = others[0], False
    state = load_file(path, "compression state file")
    try:
        optimizer.check_compression_state(state)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"compression state file {path!r} does not fit this optimizer: {exc}") from None
    return state, own


def apply_compression_state(tag_dir: str, optimizer, state, own: bool) -> bool:
    """Load what :func:`read_compression_state` returned; True when this rank's residuals were restored."""
    if state is None:
        log.warning("checkpoint %s has no compression state: error-feedback residuals start from zero", tag_dir)
        return False
    optimizer.load_compression_state_dict(state)  # another world size: keeps the step, warns, restarts residuals
    if own:
        log.info("loaded compression state of %s", tag_dir)
    return own


def load_compression_state(tag_dir: str, optimizer) -> bool:
    """Load this rank's file; False (and a fresh start of the residuals) when the checkpoint has none.

    Collective over ``optimizer.group``: every rank reads and checks its file first, then the
    ranks agree that all succeeded and that they resume the same compression step (a file from
    another checkpoint on one rank is caught); only then is anything loaded, on every rank.
    """
    with all_or_none(f"reading the compression state of {tag_dir!r}", optimizer.group):
        state, own = read_compression_state(tag_dir, optimizer)
    step = None if state is None else int(state.get("step", -1))
    agree(("none",) if state is None else ("own" if own else "other world size", step),
          f"the compression state of {tag_dir!r} (found, step)", optimizer.group)
    return apply_compression_state(tag_dir, optimizer, state, own)

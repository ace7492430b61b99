"""Head shard checkpoints: one file per rank, written atomically, loaded without code execution.

Layout inside a checkpoint tag directory::

    <tag>/ds_xc_head/meta.json                     num_classes, world_size, shard ranges (rank 0)
    <tag>/ds_xc_head/shard_00000_of_00002.pt       rank 0's weight rows, optimizer and sampler state
    <tag>/ds_xc_head/shard_00001_of_00002.pt

Each shard records its class range, so a checkpoint can be merged or resharded to
another world size without the processes that wrote it.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile

import torch

from ds_xc.head.partition import shard_sizes

log = logging.getLogger(__name__)

__all__ = ["save_head_state", "load_head_state", "shard_file", "atomic_save"]

HEAD_DIR = "ds_xc_head"


def shard_file(tag_dir: str, rank: int, world_size: int) -> str:
    return os.path.join(tag_dir, HEAD_DIR, f"shard_{rank:05d}_of_{world_size:05d}.pt")


def atomic_save(obj, path: str) -> None:
    """torch.save to a temporary file in the same folder, then rename over ``path``."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp_", suffix=".pt")
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_head_state(tag_dir: str, head, optimizer=None) -> str:
    """Write this rank's shard (weights, extra state, optimizer state) under ``tag_dir``."""
    path = shard_file(tag_dir, head.rank, head.world_size)
    atomic_save({"head": head.state_dict(),
                 "optimizer": optimizer.state_dict() if optimizer is not None else None,
                 "class_start": head.class_start, "num_local": head.num_local,
                 "num_classes": head.num_classes, "world_size": head.world_size}, path)
    if head.rank == 0:
        meta = {"num_classes": head.num_classes, "world_size": head.world_size,
                "embedding_dim": head.embedding_dim,
                "shard_sizes": shard_sizes(head.num_classes, head.world_size), "format": 1}
        tmp = os.path.join(os.path.dirname(path), ".meta.json.tmp")
        with open(tmp, "w") as fh:
            json.dump(meta, fh, indent=1)
        os.replace(tmp, os.path.join(os.path.dirname(path), "meta.json"))
    log.info("saved head shard %s", path)
    return path


def _read_meta(tag_dir: str) -> dict:
    meta_path = os.path.join(tag_dir, HEAD_DIR, "meta.json")
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"no ds_xc head in checkpoint {tag_dir!r} (missing {meta_path})")
    with open(meta_path) as fh:
        return json.load(fh)


def load_head_state(tag_dir: str, head, optimizer=None) -> None:
    """Load this rank's shard from ``tag_dir``; a world-size or class mismatch is an error."""
    meta = _read_meta(tag_dir)
    if meta["num_classes"] != head.num_classes or meta["world_size"] != head.world_size:
        raise RuntimeError(
            f"checkpoint {tag_dir!r} holds a head of {meta['num_classes']} classes on {meta['world_size']} "
            f"ranks; this run has {head.num_classes} classes on {head.world_size} ranks. Resume it with "
            f"{meta['world_size']} ranks and the same num_classes; nothing was loaded")
    path = shard_file(tag_dir, head.rank, head.world_size)
    try:
        state = torch.load(path, map_location=head.weight.device, weights_only=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"head shard {path!r} is missing from checkpoint {tag_dir!r}") from None
    except Exception as exc:  # truncated or tampered file
        raise RuntimeError(f"cannot read head shard {path!r}: {type(exc).__name__}: {exc}") from None
    head.load_state_dict(state["head"])
    if optimizer is not None and state.get("optimizer") is not None:
        optimizer.load_state_dict(state["optimizer"])
    log.info("loaded head shard %s", path)

"""Is a checkpoint folder one folder for every rank? The check behind save and load across nodes.

Saving writes every rank's files into one staging folder that rank 0 then renames and
publishes (ds_xc/engine/checkpointing.py), and loading has every rank read its own files
from the published folder: both assume that ``save_dir`` is the same directory on every
node (a filesystem all nodes mount at the same path: NFS, Lustre, GPFS, a bucket mount).
A node-local path (``/tmp/ckpt``, a local disk) would look fine on one host and, across
hosts, publish a checkpoint that holds rank 0's node's shards only. :func:`check_shared_dir`
turns that into an error on every rank, naming the folder and the fix.

Saving: rank 0 writes a marker file named by a fresh token (broadcast), every rank must see it.
Loading writes nothing (a checkpoint on a read-only mount loads on any number of ranks): every
rank reads what the save wrote, ``latest`` and the sha256 of the tag's checksum manifest, and
they must equal rank 0's. That is what loading needs: the same checkpoint on every rank (a
copy of it on each node's local disk passes, a node without it or with another one fails).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import uuid
from typing import Optional

import torch.distributed as dist

from ds_xc.checkpoint.files import CheckpointError
from ds_xc.parallel.agree import all_or_none
from ds_xc.parallel.groups import group_rank, is_distributed

__all__ = ["MARKER_PREFIX", "check_shared_dir"]

MARKER_PREFIX = ".ds_xc_shared_"


def _token_from_rank0(token, group):
    """Rank 0's token, on every rank of ``group`` (one small object broadcast)."""
    box = [token]
    dist.broadcast_object_list(box, group_src=0, group=group)
    return box[0]


def _fingerprint(folder: str, tag: Optional[str]):
    """What a load of ``folder`` would read, cheaply: (is a folder, ``latest``'s text, the tag loaded, the
    sha256 of that tag's manifest); read only."""
    try:
        if not os.path.isdir(folder):
            return (False, None, None, None)
        latest = os.path.join(folder, "latest")
        text = open(latest).read().strip() if os.path.isfile(latest) else None
        name = tag if tag is not None else text
        manifest = os.path.join(folder, name, "ds_xc_manifest.json") if name else None
        digest = None
        if manifest and os.path.isfile(manifest):
            with open(manifest, "rb") as fh:
                digest = hashlib.sha256(fh.read()).hexdigest()[:16]
        return (True, text, name if name and os.path.isdir(os.path.join(folder, name)) else None, digest)
    except OSError as exc:
        return ("unreadable", f"{type(exc).__name__}: {exc}")


def _check_same_checkpoint(folder: str, group, what: str, tag: Optional[str]) -> bool:
    """Loading: every rank must read the same checkpoint as rank 0 (compared, nothing written)."""
    mine = _fingerprint(folder, tag)
    seen = [None] * dist.get_world_size(group)
    dist.all_gather_object(seen, mine, group=group)
    differ = [r for r, fp in enumerate(seen) if fp != seen[0]]
    if differ:
        def show(fp):
            if fp[0] is False:
                return "no such folder"
            if fp[0] == "unreadable":
                return f"unreadable ({fp[1]})"
            return f"latest={fp[1]!r}, tag folder {fp[2]!r}, manifest sha256 {fp[3]}"
        raise CheckpointError(
            f"{what}: the checkpoint folder {os.path.abspath(folder)!r} is not the same on every rank: rank 0 sees "
            f"{show(seen[0])}; " + "; ".join(f"rank {r} sees {show(seen[r])}" for r in differ) + ". Every rank "
            "loads its own files from this folder: put it on a filesystem every node mounts at the same path "
            "(NFS, Lustre, ...), or copy the same checkpoint to each node; see docs/multinode.md. Nothing was "
            "loaded")
    return seen[0][0] is True


def check_shared_dir(folder: str, group, what: str, create: bool, tag: Optional[str] = None) -> bool:
    """Raise :class:`CheckpointError` on every rank of ``group`` unless every rank sees ``folder`` as rank 0 does.

    ``create``: rank 0 creates the folder first and a marker file proves it is one folder (saving);
    otherwise (loading) nothing is written: every rank must see the same ``latest`` and the same
    manifest of ``tag`` (default: the one ``latest`` names), and a folder rank 0 does not have is no
    checkpoint, and the check passes (returns False). Collective over ``group``."""
    if not is_distributed(group):
        return os.path.isdir(folder)
    if not create:
        return _check_same_checkpoint(folder, group, what, tag)
    rank0 = group_rank(group) == 0
    token = None
    with all_or_none(f"{what}: writing the shared-folder marker into {folder!r} (rank 0)", group):
        if rank0:
            if create:
                os.makedirs(folder, exist_ok=True)
            if os.path.isdir(folder):
                token = f"{uuid.uuid4().hex}"
                with open(os.path.join(folder, MARKER_PREFIX + token), "w") as fh:
                    fh.write(socket.gethostname())
    token = _token_from_rank0(token, group)
    if token is None:
        return False
    marker = os.path.join(folder, MARKER_PREFIX + token)
    try:
        with all_or_none(f"{what}: checking that {folder!r} is shared by every rank", group):
            if not os.path.isfile(marker):
                raise CheckpointError(
                    f"{what}: the checkpoint folder {os.path.abspath(folder)!r} is not shared by all ranks: this "
                    f"rank (group rank {group_rank(group)}, host {socket.gethostname()}) does not see the marker "
                    f"file {os.path.basename(marker)!r} that rank 0 just wrote there. ds_xc saves every rank's "
                    "shard into one folder that rank 0 publishes, and every rank loads from it: put --save_dir "
                    "on a filesystem every node mounts at the same path (NFS, Lustre, ...); see docs/multinode.md")
    finally:
        if rank0:
            with contextlib.suppress(OSError):
                os.remove(marker)
    return True

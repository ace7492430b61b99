"""Is a checkpoint folder one folder for every rank? The check behind save and load across nodes.

Saving writes every rank's files into one staging folder that rank 0 then renames and
publishes (ds_xc/engine/checkpointing.py), and loading has every rank read its own files
from the published folder: both assume that ``save_dir`` is the same directory on every
node (a filesystem all nodes mount at the same path: NFS, Lustre, GPFS, a bucket mount).
A node-local path (``/tmp/ckpt``, a local disk) would look fine on one host and, across
hosts, publish a checkpoint that holds rank 0's node's shards only. :func:`check_shared_dir`
turns that into an error on every rank, naming the folder and the fix: rank 0 writes a
marker file named by a fresh token (broadcast), every rank must see it.
"""
from __future__ import annotations

import contextlib
import os
import socket
import uuid

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


def check_shared_dir(folder: str, group, what: str, create: bool) -> bool:
    """Raise :class:`CheckpointError` on every rank of ``group`` unless every rank sees ``folder`` as rank 0 does.

    ``create``: rank 0 creates the folder first (saving); otherwise (loading) a folder rank 0 does
    not have is no checkpoint, and the check passes (returns False). Collective over ``group``."""
    if not is_distributed(group):
        return os.path.isdir(folder)
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

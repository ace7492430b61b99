"""Checksums of every file of a checkpoint tag: ``<tag>/ds_xc_manifest.json``.

``torch.load`` does not notice a flipped bit inside a tensor's bytes (its zip records are
read without their CRC), so a damaged checkpoint would load silently with wrong numbers.
The manifest lists each file's size and sha256; :meth:`ds_xc.XCEngine.save_checkpoint`
writes it into the staging folder before the folder is published (the ranks hash a share
of the files each), and :meth:`ds_xc.XCEngine.load_checkpoint` checks it before anything
is loaded, so a truncated or bit-flipped file raises :class:`CheckpointError` naming it on
every rank. Checkpoints written without a manifest load with a warning.

    {"format": 1, "files": {"mp_rank_00_model_states.pt": {"bytes": 1234, "sha256": "..."}, ...}}
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
from typing import Optional

import torch.distributed as dist

from ds_xc.checkpoint import CheckpointError, atomic_json
from ds_xc.parallel.groups import group_rank, group_size, is_distributed

log = logging.getLogger(__name__)

__all__ = ["MANIFEST_FILE", "list_files", "hash_files", "write_manifest", "read_manifest", "check_files",
           "verify_manifest", "write_manifest_all_ranks", "verify_manifest_all_ranks", "raise_if_disk_full"]

MANIFEST_FILE = "ds_xc_manifest.json"


def list_files(tag_dir: str) -> list:
    """Every file under ``tag_dir`` (paths relative to it, '/'-separated, sorted), the manifest excepted."""
    out = []
    for root, _, files in os.walk(tag_dir):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), tag_dir).replace(os.sep, "/")
            if rel != MANIFEST_FILE:
                out.append(rel)
    return sorted(out)


def _digest(path: str) -> dict:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
            size += len(block)
    return {"bytes": size, "sha256": h.hexdigest()}


def hash_files(tag_dir: str, names: list) -> dict:
    """{name: {"bytes", "sha256"}} for the files ``names`` (relative to ``tag_dir``)."""
    return {name: _digest(os.path.join(tag_dir, name)) for name in names}


def write_manifest(tag_dir: str, entries: dict) -> str:
    """Write the manifest of ``entries`` (from :func:`hash_files`) atomically: temporary file, fsync, rename."""
    path = os.path.join(tag_dir, MANIFEST_FILE)
    atomic_json({"format": 1, "files": dict(sorted(entries.items()))}, path)
    return path


def read_manifest(tag_dir: str) -> Optional[dict]:
    """The manifest's ``files`` dict, None when the tag has no manifest; a damaged one raises CheckpointError."""
    path = os.path.join(tag_dir, MANIFEST_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as fh:
            doc = json.loads(fh.read().decode("utf-8"))
        files = doc["files"]
        ok = doc.get("format") == 1 and isinstance(files, dict) and all(
            isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get("sha256"), str)
            and len(v["sha256"]) == 64 for v in files.values())
    except Exception as exc:  # not UTF-8, not JSON, no "files"
        raise CheckpointError(f"cannot read the checksum manifest {path!r} (damaged): {type(exc).__name__}: "
                              f"{exc}") from None
    if not ok:
        raise CheckpointError(f"the checksum manifest {path!r} is damaged: expected format 1 with a size and a "
                              "64-digit sha256 per file")
    return files


def check_files(tag_dir: str, files: dict, names: list) -> list:
    """Problems (one string per file, naming it) of the files ``names`` against the manifest ``files``."""
    problems = []
    for name in names:
        path = os.path.join(tag_dir, name)
        want = files.get(name)
        if want is None:
            problems.append(f"{path!r} is not in the manifest")
            continue
        try:
            got = _digest(path)
        except OSError as exc:
            problems.append(f"{path!r} cannot be read ({exc.strerror or exc})")
            continue
        if got["bytes"] != want["bytes"]:
            problems.append(f"{path!r} has {got['bytes']} bytes, the manifest says {want['bytes']} (truncated?)")
        elif got["sha256"] != want["sha256"]:
            problems.append(f"{path!r} does not match its sha256 in the manifest (damaged)")
    return problems


def verify_manifest(tag_dir: str, tool: str) -> bool:
    """Check every file of ``tag_dir`` against its manifest in this process (launch/export.py,
    launch/reshard.py: file tools, no process group); a problem raises CheckpointError naming the file.
    Returns False (with a warning) for a tag written before ds_xc checksummed its checkpoints."""
    files = read_manifest(tag_dir)
    if files is None:
        log.warning("%s: %s has no %s (written before ds_xc checksummed its checkpoints): file checksums are "
                    "not verified", tool, tag_dir, MANIFEST_FILE)
        return False
    problems = check_files(tag_dir, files, sorted(files))
    if problems:
        raise CheckpointError(f"checkpoint {tag_dir!r} fails its checksums ({MANIFEST_FILE}); {tool} refused it "
                              "and wrote nothing: " + "; ".join(problems))
    return True


_FULL_BYTES = 1 << 20  # a file system with less free space than this counts as full


def raise_if_disk_full(exc: BaseException, save_dir: str) -> None:
    """Re-raise a failed save as OSError(ENOSPC) naming ``save_dir`` and its free bytes when its file
    system is full: torch.save then fails with "unexpected pos ..." and never mentions the disk."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return
    try:
        st = os.statvfs(save_dir)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if free < _FULL_BYTES:
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: {save_dir!r} has {free} bytes free, the "
                      f"checkpoint was not saved (the previous one and 'latest' are intact; make room and "
                      f"save again): {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc


# ---------------------------------------------------------------------- on every rank of a job

def write_manifest_all_ranks(staging: str, group) -> None:
    """Every rank hashes a share of the staged files; rank 0 writes ds_xc_manifest.json (ds_xc/manifest.py)."""
    if is_distributed(group):
        dist.barrier(group=group)  # every file is written
    rank, world = group_rank(group), group_size(group)  # shares of the work, and rank 0, within ``group``
    names = list_files(staging)
    entries = [hash_files(staging, names[rank::world])]
    if world > 1:
        entries = [None] * world
        dist.all_gather_object(entries, hash_files(staging, names[rank::world]), group=group)
    if rank == 0:
        write_manifest(staging, {k: v for part in entries for k, v in part.items()})


def verify_manifest_all_ranks(tag_dir: str, group) -> None:
    """Check every file against the manifest, a share per rank of ``group``; any problem raises on every
    rank alike."""
    rank, world = group_rank(group), group_size(group)
    files = read_manifest(tag_dir)  # the same file on every rank: a damaged one raises everywhere
    if files is None:
        log.warning("%s has no %s (written before ds_xc checksummed its checkpoints): file checksums are not "
                    "verified", tag_dir, MANIFEST_FILE)
        return
    problems = [check_files(tag_dir, files, sorted(files)[rank::world])]
    if world > 1:
        problems = [None] * world
        dist.all_gather_object(problems, check_files(tag_dir, files, sorted(files)[rank::world]), group=group)
    found = [p for part in problems for p in part]
    if found:
        raise CheckpointError(f"checkpoint {tag_dir!r} fails its checksums ({MANIFEST_FILE}), nothing was loaded: "
                              + "; ".join(found))

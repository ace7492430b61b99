"""Files that are whole or absent: one atomic write (temporary file, fsync, rename), durable
renames, publishing a staged checkpoint tag, and weights-only reads that name the file.

Every file a checkpoint or an export writes goes through :func:`atomic_write`, so a
process killed mid-write leaves the previous file (or none), never half of one.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from typing import Callable, Optional

import torch

log = logging.getLogger(__name__)

__all__ = ["CheckpointError", "atomic_write", "atomic_save", "atomic_json", "fsync_tree", "write_latest",
           "publish_tag", "resolve_tag", "load_file", "file_sha256", "refuse_under_launcher"]


class CheckpointError(RuntimeError):
    """A checkpoint or exported-head file that is unreadable or inconsistent; the message names it."""


def atomic_write(path: str, write: Callable[[str], None]) -> str:
    """Create or replace ``path`` whole: ``write(tmp)`` fills a temporary file in the same folder,
    which is fsynced and renamed over ``path``; on any failure the temporary file is removed and
    ``path`` is left as it was. Returns ``path``."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".tmp_{os.getpid()}_{os.path.basename(path)}")
    try:
        write(tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def atomic_save(obj, path: str) -> None:
    """``torch.save(obj)`` to ``path`` atomically (:func:`atomic_write`)."""
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def _write_text(tmp: str, text: str) -> None:
    with open(tmp, "w") as fh:
        fh.write(text)


def atomic_json(obj, path: str) -> None:
    """``obj`` as JSON (indent 1) to ``path`` atomically (:func:`atomic_write`)."""
    atomic_write(path, lambda tmp: _write_text(tmp, json.dumps(obj, indent=1)))


def _fsync_dir(folder: str) -> None:
    """Make a rename inside ``folder`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(folder: str) -> None:
    """fsync every file and folder under ``folder`` (DeepSpeed writes its files without it)."""
    for root, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(root)


def write_latest(save_dir: str, tag: str) -> None:
    """Point ``save_dir/latest`` at ``tag`` atomically (:func:`atomic_write`), the rename made durable."""
    atomic_write(os.path.join(save_dir, "latest"), lambda tmp: _write_text(tmp, tag))
    _fsync_dir(save_dir)


def publish_tag(save_dir: str, tag: str, staging: str) -> str:
    """Rename the complete folder ``staging`` to ``save_dir/tag``, then move ``latest`` to it.

    A folder already named ``tag`` is moved aside to ``.old_<tag>`` for the moment between the
    two renames and removed afterwards (:func:`resolve_tag` puts it back if a crash hits that
    moment). Call on one process, after every rank has finished writing into ``staging``.
    """
    final, old = os.path.join(save_dir, tag), os.path.join(save_dir, f".old_{tag}")
    if os.path.isdir(old):
        shutil.rmtree(old)
    if os.path.isdir(final):
        os.replace(final, old)
    os.replace(staging, final)
    _fsync_dir(save_dir)
    write_latest(save_dir, tag)
    shutil.rmtree(old, ignore_errors=True)
    return final


def refuse_under_launcher(tool: str) -> None:
    """Stop a single-process file tool (launch/export.py, launch/reshard.py) started on several ranks.

    They run no process group and no collectives; under ``deepspeed``/``torchrun`` every rank
    would write the same output files at once."""
    world = os.environ.get("WORLD_SIZE", "")
    if world.isdigit() and int(world) > 1:
        raise SystemExit(f"{tool}: WORLD_SIZE={world}: this is a single-process tool (it reads and writes files, "
                         f"no process group); run it once with `python launch/{tool}.py ...`, not under a launcher")
    log.info("%s: file work in one process on the CPU: no process group, no collective, no GPU bound", tool)


# ---------------------------------------------------------------------- reading, validated
def resolve_tag(load_dir: str, tag: Optional[str] = None) -> str:
    """``tag``, or the one named in ``load_dir/latest``; the tag folder must exist."""
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest):
            tags = sorted(d for d in os.listdir(load_dir) if os.path.isdir(os.path.join(load_dir, d))) \
                if os.path.isdir(load_dir) else []
            raise FileNotFoundError(f"{latest!r} does not exist: name a tag (one of {tags})")
        with open(latest) as fh:
            tag = fh.read().strip()
    old = os.path.join(load_dir, f".old_{tag}")
    if not os.path.isdir(os.path.join(load_dir, tag)) and os.path.isdir(old):
        os.replace(old, os.path.join(load_dir, tag))  # a re-save of this tag was killed between its renames
        log.warning("restored %s from %s (a save of the same tag was interrupted)", tag, old)
    if not os.path.isdir(os.path.join(load_dir, tag)):
        raise FileNotFoundError(f"tag {tag!r}: {os.path.join(load_dir, tag)!r} is not a folder")
    return tag


def load_file(path: str, what: str = "checkpoint file", map_location="cpu", mmap: bool = False):
    """``torch.load(path, weights_only=True)``; any failure becomes an error that names the file.

    ``mmap`` maps the tensors instead of reading them (merging or resharding a large head
    then touches only the rows it copies).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} {path!r} does not exist")
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as exc:  # truncated, tampered (a pickle that is not plain data), not a torch file
        if mmap:  # a legacy (non-zip) torch file cannot be mapped: read it normally
            try:
                return torch.load(path, map_location=map_location, weights_only=True)
            except Exception:
                pass
        raise CheckpointError(f"cannot read {what} {path!r} (damaged, truncated or not a plain-tensor "
                              f"file; nothing in it was executed): {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}") from None



def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()
